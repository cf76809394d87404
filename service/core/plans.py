"""A turn request, validated before any I/O: what the turn service is asked to do, built once.

Also the one If-Match rule (``check_precondition``): every use case and both stores decide
a precondition with it.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass

import msgspec

from service.core.errors import InvalidInput, PreconditionFailed
from service.core.ids import parse_conversation_id
from service.core.items import user_input_item
from service.core.model import ANONYMOUS, ForkPoint, IdempotencyKey, Precondition
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
    client_tools: tuple[msgspec.Raw, ...] = ()  # function tools the client runs itself

    @property
    def input_items(self) -> list[msgspec.Raw]:
        return list(self.items) if self.items else [user_input_item(self.message)]


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
    client_tools: tuple[msgspec.Raw, ...] = (),
    fork_of: ForkPoint | None = None,
) -> TurnPlan:
    """The plan of a turn on ``conversation_id`` (None: a new conversation, whose id is made
    here), or on a new conversation forked at ``fork_of`` (``conversation_id`` then names
    the source, and ``if_match`` is checked against the fork point). ``key_subject``: what an
    Idempotency-Key's retries must repeat exactly (default: the message, the conversation and
    the background flag)."""
    _check_message(rules, message, items)
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
        client_tools=client_tools,
    )


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


def claim_lease_s(read_timeout_s: float, max_rounds: int) -> float:
    """How long an Idempotency-Key claim is held for its first attempt: a claim whose replica
    died is taken over once the longest turn is surely over (every provider round at its read
    timeout, plus a minute)."""
    return read_timeout_s * max_rounds + 60
