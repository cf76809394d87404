"""A turn request, validated before any I/O: what the turn service is asked to do."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import uuid
from dataclasses import dataclass

import msgspec

from service.core.errors import ConversationNotFound, InvalidInput, PreconditionFailed
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
class TurnPlan:
    conversation_id: uuid.UUID
    is_new: bool  # a new conversation's id is provisional until its first turn commits
    message: str
    if_match: Precondition
    owner: str = ANONYMOUS
    idempotency: IdempotencyKey | None = None
    background: bool = False  # runs on when its client goes away (service/runs.py)
    claimed: bool = False  # its Idempotency-Key is claimed already (a background turn's)
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

    def with_idempotency(self, key: IdempotencyKey) -> TurnPlan:
        return dataclasses.replace(self, idempotency=key)

    def forked(self, point: ForkPoint) -> TurnPlan:
        """This turn on a new conversation that begins as turns 1..point.revision of
        point.source (its If-Match, if any, is checked against the source)."""
        return dataclasses.replace(self, conversation_id=uuid.uuid4(), is_new=True, fork_of=point)


def make_plan(
    message: str,
    conversation_id: str | None,
    if_match: Precondition,
    *,
    max_message_chars: int,
    owner: str = ANONYMOUS,
    idempotency_key: str | None = None,
    background: bool = False,
    truncate: bool = True,
    items: tuple[msgspec.Raw, ...] = (),
) -> TurnPlan:
    if not items and not _VISIBLE.search(message):
        raise InvalidInput("message must not be empty or whitespace only.")
    if len(message) > max_message_chars:
        raise InvalidInput(f"message is longer than {max_message_chars} characters.")
    if "\x00" in message or not is_encodable(message):
        raise InvalidInput("message must be valid text without NUL characters.")
    idempotency = None
    if idempotency_key is not None:
        # Endpoint-agnostic: a retry may switch between /chat and /chat/stream. A plain turn
        # hashes as before background turns existed, so keys claimed before an upgrade (or on
        # a replica not yet upgraded) still match their retries.
        subject = [message, conversation_id, *([True] if background else [])]
        asked = msgspec.json.encode(subject)
        idempotency = IdempotencyKey(owner, idempotency_key, hashlib.sha256(asked).hexdigest())
    if conversation_id is None and if_match is not None:
        raise PreconditionFailed("If-Match needs an existing conversation.")
    return TurnPlan(
        conversation_id=(
            uuid.uuid4() if conversation_id is None else parse_conversation_id(conversation_id)
        ),
        is_new=conversation_id is None,
        message=message,
        if_match=if_match,
        owner=owner,
        idempotency=idempotency,
        background=background,
        truncate=truncate,
        items=items,
    )


def parse_conversation_id(raw: str) -> uuid.UUID:
    """A uuid, or the ``conv_<hex>`` the OpenAI surface shows for it."""
    try:
        return uuid.UUID(raw.removeprefix("conv_"))
    except ValueError:
        raise ConversationNotFound() from None  # malformed looks exactly like unknown


def check_precondition(if_match: Precondition, revision: int) -> None:
    if if_match is not None and revision not in if_match:
        raise PreconditionFailed()
