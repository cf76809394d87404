"""A turn request, validated before any I/O: what the turn service is asked to do, built once.

Also the one If-Match rule (``check_precondition``): every use case and both stores decide
a precondition with it.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from service.core.asks import Asked
from service.core.errors import InvalidInput, ModelNotFound, PreconditionFailed
from service.core.ids import parse_conversation_id
from service.core.items import TurnInput, user_input_item
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
    configured_model: str = ""  # a request naming no model gets it (the provider's default)
    instructions: str = "append"  # INSTRUCTIONS: append, client, or server (client's refused)
    compact_threshold: int | None = None  # CONTEXT_STRATEGY=compact: every turn's threshold
    compact_default: int = 100_000  # COMPACT_THRESHOLD_TOKENS: a context_management's default
    max_line_bytes: int = 1_048_576  # MAX_BODY_BYTES: an imported line's
    max_import_bytes: int | None = None  # an import's whole body (see service/app.py)

    def check_model(self, model: str | None) -> None:
        """A model a request may name: the configured one, one of MODELS (or of
        PROVIDERS_FILE), or any with ``*`` (as text a provider can be sent and the turn's row
        can keep: no NUL, no lone surrogate)."""
        if model is not None and ("\x00" in model or not is_encodable(model)):
            raise InvalidInput(
                "model: text must be valid and without NUL characters.", param="model"
            )
        configured = self.configured_model
        if model is None or model == configured or self.models is None or model in self.models:
            return
        served = ", ".join(repr(name) for name in [configured, *sorted(self.models - {configured})])
        raise ModelNotFound(
            f"The model {model!r} does not exist or you do not have access to it. This server "
            f"serves {served} (GET /v1/models); its MODELS setting or PROVIDERS_FILE adds others."
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
class TurnRequest:
    """A turn as a surface asks for it, before it is checked: on ``conversation_id`` (None:
    a new conversation), or on a new conversation forked at ``fork_of`` (``conversation_id``
    names the source then, and ``if_match`` is checked against the fork point); its input; an
    Idempotency-Key (``key_subject``: what its retries must repeat exactly, default: the
    message, the conversation and the background flag); ``asked``: what a client of the
    OpenAI surface asked of the provider (None: an /api/v1 turn); ``stored_response``: a /v1
    response's new conversation, which expires."""

    owner: str
    conversation_id: uuid.UUID | str | None  # a str: as a client sent it (checked here)
    input: TurnInput
    if_match: Precondition = None
    idempotency_key: str | None = None
    key_subject: bytes | None = None
    background: bool = False
    fork_of: ForkPoint | None = None
    asked: Asked | None = None
    stored_response: bool = False
    model: str | None = None  # an /api/v1 turn's model (a /v1 turn's is asked.model)


@dataclass(frozen=True)
class TurnPlan:
    """A turn checked and ready to run (``make_plan``)."""

    conversation_id: uuid.UUID
    is_new: bool  # a new conversation's id is provisional until its first turn commits
    input: TurnInput  # what the client sent (a message, or items) and how people read it
    if_match: Precondition
    owner: str = ANONYMOUS
    idempotency: IdempotencyKey | None = None
    background: bool = False  # runs on when its client goes away (service/usecases/runs.py)
    fork_of: ForkPoint | None = None  # a new conversation forked here, made by this turn's commit
    asked: Asked | None = None  # what a client of the OpenAI surface asked (None: /api/v1)
    server_prompt: bool = True  # the server's system prompt comes first (INSTRUCTIONS)
    stored_response: bool = False  # a /v1 response's new conversation, which expires
    # The input, in the provider's tokens, above which the turn compacts its window first
    # (service/usecases/compaction.py); None: it never does.
    compact_threshold: int | None = None
    model: str | None = None  # the model asked for (None: the configured one), which routes it

    @property
    def message(self) -> str:
        return self.input.message

    @property
    def input_items(self) -> list[msgspec.Raw]:
        items = self.input.items
        return list(items) if items else [user_input_item(self.input.message)]

    @property
    def input_said(self) -> tuple[Said, ...]:
        return self.input.said or (("user", self.input.message),)

    @property
    def client_tools(self) -> tuple[msgspec.Raw, ...]:
        """The function tools the client runs itself (none on /api/v1)."""
        return self.asked.tools if self.asked else ()

    @property
    def response(self) -> msgspec.Raw | None:
        """What the turn keeps of its Response (see Turn.response; None: an /api/v1 turn)."""
        return self.asked.record(self.stored_response) if self.asked else None


def make_plan(rules: PlanRules, request: TurnRequest) -> TurnPlan:
    """The plan of ``request`` (InvalidInput, PreconditionFailed for what it may not ask)."""
    given, asked = request.input, request.asked
    _check_message(rules, given.message, given.items)
    rules.check_instructions(asked.instructions if asked else None)
    idempotency = None
    if request.idempotency_key is not None:
        if not rules.idempotency:
            raise InvalidInput("Idempotency-Key is not enabled on this server.")
        cid = request.conversation_id
        where = None if cid is None else str(cid)
        subject = request.key_subject or _chat_subject(given.message, where, request)
        digest = hashlib.sha256(subject).hexdigest()
        idempotency = IdempotencyKey(request.owner, request.idempotency_key, digest)
    if request.conversation_id is None and request.if_match is not None:
        raise PreconditionFailed("If-Match needs an existing conversation.")
    cid = request.conversation_id
    new = cid is None or request.fork_of is not None
    if new or cid is None:
        cid = uuid.uuid4()
    elif not isinstance(cid, uuid.UUID):
        cid = parse_conversation_id(cid)
    compact = asked.compact if asked and asked.compact is not None else rules.compact_threshold
    model = asked.model if asked else request.model
    rules.check_model(model)
    return TurnPlan(
        conversation_id=cid,
        is_new=new,
        input=given,
        if_match=request.if_match,
        owner=request.owner,
        idempotency=idempotency,
        background=request.background,
        fork_of=request.fork_of,
        asked=asked,
        server_prompt=rules.server_prompt_first(asked.instructions if asked else None),
        stored_response=request.stored_response,
        compact_threshold=compact,
        model=model,
    )


def chat_request(
    owner: str, message: str, conversation_id: str | None, if_match: Precondition, **more: Any
) -> TurnRequest:
    """An /api/v1 turn's request: its message as the one user item."""
    return TurnRequest(owner, conversation_id, TurnInput(message, (), ()), if_match, **more)


def compaction_plan(
    conversation_id: uuid.UUID,
    owner: str,
    if_match: Precondition,
    idempotency: IdempotencyKey | None = None,
) -> TurnPlan:
    """The plan of a compaction committed on its own (no message, no reply): a commit under
    the same lease, If-Match and Idempotency-Key as a turn."""
    return TurnPlan(
        conversation_id,
        is_new=False,
        input=TurnInput("", (), ()),
        if_match=if_match,
        owner=owner,
        idempotency=idempotency,
    )


def _check_message(rules: PlanRules, message: str, items: tuple[msgspec.Raw, ...]) -> None:
    if not items and not _VISIBLE.search(message):
        raise InvalidInput("message must not be empty or whitespace only.")
    if len(message) > rules.max_message_chars:
        raise InvalidInput(f"message is longer than {rules.max_message_chars} characters.")
    if "\x00" in message or not is_encodable(message):
        raise InvalidInput("message must be valid text without NUL characters.")


def _chat_subject(message: str, conversation_id: str | None, request: TurnRequest) -> bytes:
    # Endpoint-agnostic: a retry may switch between /chat and /chat/stream. A plain turn on
    # the default model hashes as before background turns and models existed, so keys claimed
    # before an upgrade (or on a replica not yet upgraded) still match their retries.
    more: list[object] = [True] if request.background else []
    if request.model is not None:
        more.append({"model": request.model})
    return msgspec.json.encode([message, conversation_id, *more])


def check_precondition(if_match: Precondition, revision: int) -> None:
    """The If-Match rule: ``if_match`` (None: no precondition) must list ``revision``."""
    if if_match is not None and revision not in if_match:
        raise PreconditionFailed()
