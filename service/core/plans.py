"""A turn request, validated before any I/O: what the turn service is asked to do, built once.

Also the one If-Match rule (``check_precondition``): every use case and both stores decide
a precondition with it.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from service.core.errors import InvalidInput, ModelNotFound, PreconditionFailed
from service.core.ids import parse_conversation_id
from service.core.items import user_input_item
from service.core.model import ANONYMOUS, ForkPoint, IdempotencyKey, Precondition, Said
from service.core.strictjson import is_encodable

# Whitespace as JSON Schema (ECMA-262) patterns know it: the OpenAPI document states the
# message rule with this very class (service/api/schemas.py), so a client validating against
# it never sends a message the server refuses.
WHITESPACE = r"\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
MESSAGE_PATTERN = rf"^[^\x00]*[^\x00{WHITESPACE}][^\x00]*$"  # not whitespace only; no NUL
_VISIBLE = re.compile(rf"[^{WHITESPACE}]")


@dataclass(frozen=True)
class PlanRules:
    """What a request may ask, from the server's configuration."""

    max_message_chars: int = 100_000  # MAX_MESSAGE_CHARS
    idempotency: bool = True  # Idempotency-Key is served (its claims are stored somewhere)
    own_tools: frozenset[str] = frozenset()  # TOOLS: names no client tool may take
    models: frozenset[str] | None = frozenset()  # MODELS besides the configured one (None: any)
    instructions: str = "append"  # INSTRUCTIONS: append, client, or server (client's refused)
    compact_threshold: int | None = None  # CONTEXT_STRATEGY=compact: every turn's threshold
    compact_default: int = 100_000  # COMPACT_THRESHOLD_TOKENS: a context_management's default

    def check_model(self, model: str | None, configured: str) -> None:
        """A model a request may name: the configured one, one of MODELS, or any with ``*``."""
        if model is None or model == configured or self.models is None or model in self.models:
            return
        served = ", ".join(repr(name) for name in [configured, *sorted(self.models - {configured})])
        raise ModelNotFound(
            f"The model {model!r} does not exist or you do not have access to it. This server "
            f"serves {served} (GET /v1/models); its MODELS setting adds others (comma-separated, "
            "or * for any)."
        )

    def server_prompt_first(self, instructions: str | None) -> bool:
        """Whether the server's prompt is sent (before a client's instructions): not when
        INSTRUCTIONS=client lets a client's instructions replace it."""
        return instructions is None or self.instructions != "client"

    def compaction_asked(self, entries: Sequence[Any] | None) -> int | None:
        """The threshold a /v1 ``context_management`` asks for (None: none asked): its
        ``compaction`` entry's ``compact_threshold``, else COMPACT_THRESHOLD_TOKENS."""
        threshold = None
        for entry in entries or ():
            if not isinstance(entry, dict) or entry.get("type") != "compaction":
                raise InvalidInput(
                    'context_management: only {"type": "compaction"} entries are supported.',
                    param="context_management",
                )
            value = entry.get("compact_threshold", self.compact_default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(
                    "context_management: compact_threshold must be a positive integer.",
                    param="context_management",
                )
            threshold = value if threshold is None else min(threshold, value)
        return threshold

    def check_instructions(self, instructions: str | None) -> None:
        if instructions is not None and self.instructions == "server":
            raise InvalidInput(
                "instructions: this server sends its own system prompt only (INSTRUCTIONS=server).",
                param="instructions",
            )


@dataclass(frozen=True)
class TurnPlan:
    conversation_id: uuid.UUID
    is_new: bool  # a new conversation's id is provisional until its first turn commits
    message: str
    if_match: Precondition
    owner: str = ANONYMOUS
    idempotency: IdempotencyKey | None = None
    background: bool = False  # runs on when its client goes away (service/usecases/runs.py)
    truncate: bool = True  # False: a turn whose window would leave earlier turns out is refused
    fork_of: ForkPoint | None = None  # a new conversation forked here, made by this turn's commit
    # The turn's input as items, when a client sent items (answers to its function calls, and
    # its message if any; ``message`` is then their text, for the transcript). Otherwise the
    # input is ``message`` as one user item.
    items: tuple[msgspec.Raw, ...] = ()
    said: tuple[Said, ...] = ()  # the input's transcript (default: ``message`` as the user's)
    client_tools: tuple[msgspec.Raw, ...] = ()  # function tools the client runs itself
    # What a client of the OpenAI surface asked of the provider for this turn only: the model
    # (None: the configured one), its instructions, its other fields as they came, what to
    # include. ``relayed``: the request is the client's, so a refusal of it by the provider is
    # the client's 400 (on /api/v1 the server builds every request: a refusal is a 502).
    model: str | None = None
    instructions: str | None = None
    fields: Mapping[str, msgspec.Raw] = field(default_factory=dict)
    include: tuple[str, ...] = ()
    relayed: bool = False
    response: msgspec.Raw | None = None  # what the turn keeps of its Response (see Turn)
    server_prompt: bool = True  # the server's system prompt comes first (INSTRUCTIONS)
    stored_response: bool = False  # a /v1 response's new conversation, which expires
    # The input, in the provider's tokens, above which the turn compacts its window first
    # (service/usecases/compaction.py); None: it never does.
    compact_threshold: int | None = None

    @property
    def input_items(self) -> list[msgspec.Raw]:
        return list(self.items) if self.items else [user_input_item(self.message)]

    @property
    def input_said(self) -> tuple[Said, ...]:
        return self.said or (("user", self.message),)


def make_plan(
    rules: PlanRules,
    message: str,
    conversation_id: str | None,
    if_match: Precondition,
    *,
    owner: str = ANONYMOUS,
    idempotency_key: str | None = None,
    key_subject: bytes | None = None,
    background: bool = False,
    truncate: bool = True,
    items: tuple[msgspec.Raw, ...] = (),
    said: tuple[Said, ...] = (),
    client_tools: tuple[msgspec.Raw, ...] = (),
    fork_of: ForkPoint | None = None,
    asked: Asked | None = None,
    stored_response: bool = False,
) -> TurnPlan:
    """The plan of a turn on ``conversation_id`` (None: a new conversation, whose id is made
    here), or on a new conversation forked at ``fork_of`` (``conversation_id`` then names
    the source, and ``if_match`` is checked against the fork point). ``key_subject``: what an
    Idempotency-Key's retries must repeat exactly (default: the message, the conversation and
    the background flag). ``asked``: what a client of the OpenAI surface asked of the
    provider."""
    _check_message(rules, message, items)
    relayed, asked = asked is not None, asked or Asked()
    rules.check_instructions(asked.instructions)
    idempotency = None
    if idempotency_key is not None:
        if not rules.idempotency:
            raise InvalidInput("Idempotency-Key is not enabled on this server.")
        subject = key_subject or _chat_subject(message, conversation_id, background)
        idempotency = IdempotencyKey(owner, idempotency_key, hashlib.sha256(subject).hexdigest())
    if conversation_id is None and if_match is not None:
        raise PreconditionFailed("If-Match needs an existing conversation.")
    new = conversation_id is None or fork_of is not None
    return TurnPlan(
        conversation_id=uuid.uuid4() if new else parse_conversation_id(conversation_id or ""),
        is_new=new,
        message=message,
        if_match=if_match,
        owner=owner,
        idempotency=idempotency,
        background=background,
        truncate=truncate,
        fork_of=fork_of,
        items=items,
        said=said,
        client_tools=client_tools,
        model=asked.model,
        instructions=asked.instructions,
        fields=asked.fields,
        include=asked.include,
        relayed=relayed,
        response=asked.response(stored_response) if asked.response else None,
        server_prompt=rules.server_prompt_first(asked.instructions),
        stored_response=stored_response,
        compact_threshold=rules.compact_threshold if asked.compact is None else asked.compact,
    )


def compaction_plan(
    conversation_id: uuid.UUID,
    owner: str,
    if_match: Precondition,
    idempotency: IdempotencyKey | None = None,
) -> TurnPlan:
    """The plan of a compaction committed on its own (no message, no reply): a commit under
    the same lease, If-Match and Idempotency-Key as a turn."""
    return TurnPlan(
        conversation_id, is_new=False, message="", if_match=if_match, owner=owner,
        idempotency=idempotency,
    )  # fmt: skip


@dataclass(frozen=True)
class Asked:
    """What a client of the OpenAI surface asks of the provider for one turn (see TurnPlan)."""

    model: str | None = None
    instructions: str | None = None
    fields: Mapping[str, msgspec.Raw] = field(default_factory=dict)
    include: tuple[str, ...] = ()
    # What the turn keeps of its Response (see Turn), given whether it is a stored response
    # (known once planned: a chained one is if its source is).
    response: Callable[[bool], msgspec.Raw] | None = None
    compact: int | None = None  # the threshold its context_management asks (None: the server's)


def _check_message(rules: PlanRules, message: str, items: tuple[msgspec.Raw, ...]) -> None:
    if not items and not _VISIBLE.search(message):
        raise InvalidInput("message must not be empty or whitespace only.")
    if len(message) > rules.max_message_chars:
        raise InvalidInput(f"message is longer than {rules.max_message_chars} characters.")
    if "\x00" in message or not is_encodable(message):
        raise InvalidInput("message must be valid text without NUL characters.")


def _chat_subject(message: str, conversation_id: str | None, background: bool) -> bytes:
    # Endpoint-agnostic: a retry may switch between /chat and /chat/stream. A plain turn
    # hashes as before background turns existed, so keys claimed before an upgrade (or on a
    # replica not yet upgraded) still match their retries.
    return msgspec.json.encode([message, conversation_id, *([True] if background else [])])


def check_precondition(if_match: Precondition, revision: int) -> None:
    """The If-Match rule: ``if_match`` (None: no precondition) must list ``revision``."""
    if if_match is not None and revision not in if_match:
        raise PreconditionFailed()
