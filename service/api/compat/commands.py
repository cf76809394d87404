"""A /v1/responses create as the use case's command: the request body checked and made into
one ``Asked`` (service/core/asks.py), with what its Response echoes."""

from __future__ import annotations

import msgspec

from service.api.compat import item_views as views
from service.api.compat.item_views import ENCRYPTED
from service.api.compat.objects import NOT_COUNTED, ResponseCreate, TokensCount, passed_through
from service.api.deps import Api, WriteApi
from service.core.asks import Asked, Echo
from service.core.errors import InvalidInput
from service.core.plans import TurnPlan
from service.usecases.responses import Responses


def check_fields(asked: ResponseCreate) -> None:
    """400 naming a field this server cannot honour, for any call."""
    if asked.store is False and (asked.background or asked.conversation is not None):
        what = "background" if asked.background else "conversation"
        raise InvalidInput(f"store: false cannot be used with {what}.", param="store")
    views.includes(asked.include)


def asked_of(asked: ResponseCreate, body: bytes, responses: Responses, created_at: float) -> Asked:
    """What the request asks of the provider besides its input (the model, instructions, what
    to include, when to compact, and every field turnstore does not interpret, as it came),
    and what its Response echoes (kept with the turn, created at ``created_at``). 400 naming
    a field this server cannot honour."""
    check_fields(asked)
    fields = passed_through(body)
    compact = responses.compaction_asked(asked.context_management)
    if asked.store is False and asked.context_management is not None:
        # Nothing is kept to compact: the provider compacts, as OpenAI does with store false.
        fields["context_management"] = msgspec.Raw(msgspec.json.encode(asked.context_management))
    echo = Echo(
        model=asked.model or responses.model,
        instructions=asked.instructions,
        tools=asked.tools or (),
        truncation=asked.truncation,
        previous_response_id=asked.previous_response_id,
        store=asked.store is not False,
        background=bool(asked.background),
        fields=fields,
        created_at=created_at,
    )
    include = tuple(i for i in asked.include or () if i != ENCRYPTED)
    tools = responses.client_tools(asked.tools, relayed=asked.store is False)
    ask = Asked(
        asked.model,
        asked.instructions,
        fields,
        include,
        tools,
        truncate=asked.truncation != "disabled",
        compact=compact,
        background=bool(asked.background),
        echo=echo,
    )
    responses.check(ask)
    return ask


async def planned(
    asked: ResponseCreate,
    ask: Asked,
    writer: WriteApi,
    body: bytes,
) -> TurnPlan:
    """The stored turn a create asks for (the use case decides where it goes)."""
    return await writer.cases.responses.plan(
        writer.owner,
        ask,
        asked.input,
        conversation=asked.conversation_id,
        previous_response_id=asked.previous_response_id,
        if_match=writer.precondition,
        idempotency_key=writer.idempotency_key,
        body=body,  # a retry asks exactly this body
    )


def encrypted_asked(asked: ResponseCreate) -> bool:
    return ENCRYPTED in (asked.include or ())


async def tokens_counted(asked: TokensCount, body: bytes, api: Api) -> int:
    """``POST /v1/responses/input_tokens``: what a create with this body would send, counted
    (its fields as a create's, but those that do not change the count)."""
    responses = api.cases.responses
    fields = {
        name: value for name, value in passed_through(body).items() if name not in NOT_COUNTED
    }
    tools = responses.client_tools(asked.tools, relayed=True)
    ask = Asked(asked.model, asked.instructions, fields, tools=tools)
    responses.check(ask)
    return await responses.count_tokens(
        api.owner,
        ask,
        asked.input,
        conversation=asked.conversation_id,
        previous=asked.previous_response_id,
    )
