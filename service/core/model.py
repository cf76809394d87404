"""The conversation as the use case sees it: committed turns and what a new turn adds.

Replay items are kept as ``msgspec.Raw``: the provider's JSON bytes, never decoded into
Python objects, so they are stored and re-sent exactly as the provider defined them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from functools import cached_property
from typing import Literal
from uuid import UUID, uuid4

import msgspec

from service.core.errors import InvalidInput
from service.core.events import Done, RunEvent
from service.core.translate import form_of
from service.core.usage import Usage

Role = Literal["user", "assistant", "system", "developer"]  # a transcript message's
ReplyStatus = Literal["completed", "incomplete"]

ANONYMOUS = "anonymous"  # the one owner when AUTH_MODE=none: reserved for it
Metadata = dict[str, str]  # a conversation's /v1 metadata (no commit when it changes)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
_OWNER_NAME = re.compile(r"[^\x00-\x1f\x7f\ud800-\udfff]{1,256}")


def is_owner_name(name: object) -> bool:
    """Whether ``name`` can own conversations through a credential (an API key or a JWT
    ``sub``): 1-256 characters without control characters or lone surrogates, no surrounding
    space, and not the reserved anonymous owner of AUTH_MODE=none."""
    return (
        isinstance(name, str)
        and _OWNER_NAME.fullmatch(name) is not None
        and name == name.strip()
        and name != ANONYMOUS
    )


# The revisions an If-Match header accepts; None means "no precondition".
Precondition = frozenset[int] | None

MAX_ARGUMENT_CHARS = 4096  # a tool call's arguments, as the model proposed them


KEY_ID_CHARS = 12  # of an API key's hash: public, and enough to tell a deployment's keys apart


def key_hash(key: str) -> str:
    """What is stored of an API key (AUTH_MODE=api_key): its SHA-256, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key: str) -> str:
    """An API key's public name, safe to show and log: the start of its hash."""
    return key_hash(key)[:KEY_ID_CHARS]


def fingerprint(key: str | None) -> str | None:
    """What a turn records of the key its provider was called with (None: none): its public
    name, as for turnstore's own keys."""
    return key_id(key) if key else None


class ToolStatus(StrEnum):
    OK = "OK"
    INVALID = "INVALID"
    UNKNOWN_TOOL = "UNKNOWN_TOOL"
    BUSY = "BUSY"
    BUDGET = "BUDGET"
    NOT_FOUND = "NOT_FOUND"
    TIMEOUT = "TIMEOUT"
    TOOL_ERROR = "TOOL_ERROR"


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call as proposed and as decided (service/tools/gate.py). ``name`` and
    ``arguments`` are clipped, so a record is bounded whatever the model sent; ``result`` is
    set for OK only."""

    call_id: str
    name: str
    arguments: str
    accepted: bool  # passed size, strict JSON, registry and schema
    status: ToolStatus
    result: str | None
    duration_ms: float  # in the gate, from the call to its record
    truncated: bool = False  # the tool returned more than the cap; ``result`` is its start

    def output(self) -> str:
        """The ``output`` of the function_call_output item sent back to the model."""
        result = self.result if self.status is ToolStatus.OK else None
        output: dict[str, object] = {"status": str(self.status), "result": result}
        if self.truncated:
            output["truncated"] = True
        return json.dumps(output, ensure_ascii=False)


@dataclass(frozen=True)
class Origin:
    """Which provider, endpoint and model produced a turn's replay items. Opaque items (the
    ``encrypted_content`` of reasoning, thinking signatures, compaction items) only open where
    they were made: the provider, endpoint and model tell one origin from another.

    Each turn also records the provider's ``kind`` (``openai``, ``azure``, ``anthropic``,
    ``fake``...) and a fingerprint of the key it was called with (``fingerprint``; None: no
    key), for an operator's eyes and an export: they tell no origin apart, as a rotated key of
    the same account opens what the old one was given (a turn written before they were kept
    has neither)."""

    provider: str
    endpoint: str
    model: str
    kind: str | None = field(default=None, compare=False)
    key_fingerprint: str | None = field(default=None, compare=False)

    def with_model(self, model: str | None) -> Origin:
        return self if model is None or model == self.model else replace(self, model=model)


Said = tuple[str, str]  # one message of a transcript: (role, text)


def plain(user_message: str, assistant_message: str) -> tuple[Said, ...]:
    """The messages of a plain turn: its user message and the reply. Such a turn stores no
    transcript (``Turn.transcript`` None): its messages are derived from the two."""
    return (("user", user_message), ("assistant", assistant_message))


@dataclass(frozen=True)
class Turn:
    """One user message and the accepted reply, as it is committed."""

    user_message: str
    assistant_message: str
    replay_items: list[msgspec.Raw]
    origin: Origin | None = None  # None: recorded before origins were (schema 0001)
    context_from: int = 1  # the first earlier turn the model saw for this turn
    prompt_version: str | None = None  # the system prompt's version, if there was one
    tool_calls: Sequence[ToolCallRecord] = ()  # every tool call of the turn, in order
    status: ReplyStatus = "completed"
    incomplete_reason: str | None = None  # with status "incomplete": max_output_tokens
    created_at: datetime | None = None  # when it was committed (None: not committed yet)
    usage: Usage | None = None  # of the turn's provider calls (None: not reported, or none)
    # Its messages as people read them, of every role (None: recorded before they were, the
    # user and the assistant message then).
    transcript: tuple[Said, ...] | None = None
    # What the OpenAI surface records of the response this turn made: the JSON of what it
    # echoes of its request and when it was created (None: an /api/v1 turn).
    response: msgspec.Raw | None = None
    response_deleted: bool = False  # DELETE /v1/responses/{id}: the turn and its items stay
    turn_id: UUID | None = None  # the run that made it (a streamed or background turn)
    # The compacted context the turn was sent on instead of the earlier turns: the user
    # messages the provider kept, then its opaque compaction item. Later windows start here
    # (service/core/window.py); the transcript keeps every turn.
    compacted: Sequence[msgspec.Raw] = ()
    # The revision it made, as read back (None: not committed yet). Revisions have gaps: the
    # removal of an item moves the latest turn to the next revision (``pop_item``).
    number: int | None = None

    @cached_property
    def replay_bytes(self) -> int:
        """Its replay items' bytes, counted once per turn (a turn is read into memory once and
        then sent with every turn of its window: its size is asked each time)."""
        return sum(map(len, self.replay_items))

    @cached_property
    def responses_only(self) -> bool:
        """Whether its items (compacted context too) are all Responses items, none of a
        provider's form (core/translate/), looked at once per turn: a request to the
        Responses API would otherwise look at each again with every later turn."""
        return all(form_of(item) is None for item in (*self.compacted, *self.replay_items))

    @cached_property
    def stored_bytes(self) -> int:
        """What it stores (service/core/sizes.py ``turn_bytes``), counted once per turn: the
        history cache counts every turn it holds again at each turn of the conversation."""
        size = self.replay_bytes + sum(map(len, self.compacted))
        size += _utf8(self.user_message) + _utf8(self.assistant_message)
        if self.transcript is not None:
            size += len(_JSON.encode(self.transcript))
        if self.tool_calls:
            size += len(_JSON.encode(self.tool_calls))
        if self.response is not None:
            size += len(self.response)
        return size


_JSON = msgspec.json.Encoder()


def _utf8(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


@dataclass(frozen=True)
class Conversation:
    id: UUID
    revision: int
    created_at: datetime
    updated_at: datetime
    # The turns held: every turn of revision ``first``..``revision``, in order (each with its
    # number). A turn holds its window (from ``context_start``), a reader all or those after
    # a revision.
    turns: list[Turn] = field(default_factory=list)
    context_start: int = 1  # turns before this one are outside the model's context
    owner: str = ANONYMOUS
    rewritten_at: int = 0  # the revision at which earlier history last changed (a removal)
    first: int = 1  # the turns held are those from this revision on
    # What it holds (MAX_CONVERSATION_BYTES, service/core/sizes.py) up to ``stored_revision``
    # as its row stores it; None: not counted (forked, an item removed).
    stored_bytes: int | None = None
    stored_revision: int | None = None

    @property
    def replay_items(self) -> list[msgspec.Raw]:
        """Of the turns held."""
        return [item for turn in self.turns for item in turn.replay_items]

    @property
    def last(self) -> Turn | None:
        """The latest turn (held whenever there is one: every read reaches the revision)."""
        return self.turns[-1] if self.turns and self.complete else None

    @property
    def complete(self) -> bool:
        """Whether the turns held reach the revision (a revision's turn is always there)."""
        if not self.turns:
            return self.revision < self.first
        return self.turns[-1].number == self.revision

    def since(self, start: int) -> list[Turn]:
        """The turns held of revision ``start`` on."""
        return since(self.turns, start)


def since(turns: list[Turn], start: int) -> list[Turn]:
    """Those of ``turns`` (read back, in order) of revision ``start`` on."""
    first = turns[0].number if turns else None
    if first is not None and first >= start:  # all of them (most often): no turn looked at
        return list(turns)
    return [turn for turn in turns if turn.number is None or turn.number >= start]


@dataclass(frozen=True)
class ConversationInfo:
    """A conversation without its turns, with its metadata (the OpenAI surface's)."""

    id: UUID
    revision: int  # 0: no turn yet
    created_at: datetime
    updated_at: datetime
    metadata: dict[str, str]
    stored_response: bool = False  # made for a stored /v1 response: it expires
    # The text and items it holds (service/core/sizes.py; None: not counted since it was
    # forked, edited or written by an older release).
    stored_bytes: int | None = None
    stored_revision: int | None = None  # the revision stored_bytes counts up to
    rewritten_at: int = 0  # the revision at which earlier history last changed (a removal)
    context_start: int = 1  # the window start: turns before it are outside the model's context
    forked_from: UUID | None = None  # the conversation it was forked from (None: not a fork)


@dataclass(frozen=True)
class TranscriptTurn:
    """A committed turn as people read it (no replay items)."""

    number: int  # the revision it made
    user_message: str
    assistant_message: str
    context_from: int
    prompt_version: str | None
    tool_calls: Sequence[ToolCallRecord]
    said: tuple[Said, ...] | None = None  # every message, when more than the user/assistant pair
    usage: Usage | None = None
    model: str | None = None  # that made its reply (None: recorded before origins were)

    def messages(self) -> tuple[Said, ...]:
        if self.said is None:
            return plain(self.user_message, self.assistant_message)
        return self.said


@dataclass(frozen=True)
class TranscriptPage:
    """Some consecutive turns of a conversation (``conversation`` has no turns of its own)."""

    conversation: Conversation
    turns: list[TranscriptTurn]
    more_before: bool  # earlier turns exist
    more_after: bool  # later turns exist


@dataclass(frozen=True)
class PageRequest:
    """Which turns a transcript page holds: after ``after``, before ``before`` (None: up to the
    latest), at most ``limit`` of them and about ``max_bytes`` of text (one at least). With
    ``before`` alone, the latest turns before it; otherwise the first turns after ``after``."""

    after: int = 0
    before: int | None = None
    limit: int = 50
    max_bytes: int = 1_048_576

    @property
    def backwards(self) -> bool:
        return self.before is not None and self.after == 0


@dataclass(frozen=True)
class Summary:
    """A conversation in a listing (no turns)."""

    id: UUID
    revision: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class IdempotencyKey:
    owner: str
    key: str
    request_hash: str  # of what the request asked, so a reused key with another body is caught
    # This attempt's claim of the key: a write completes the key only while it holds it (one
    # that lost it, its lease run out and taken over by another attempt, writes nothing).
    claim: UUID = field(default_factory=uuid4, compare=False)
    # The conversation this attempt writes (None: not known when it claims the key), recorded
    # with its claim: on Citus a retry that finds the claim's outcome in doubt reads the
    # attempt's receipt on that conversation's worker (store/postgres/receipts.py).
    conversation: UUID | None = field(default=None, compare=False)

    def writing(self, conversation: UUID) -> IdempotencyKey:
        """This attempt, writing ``conversation``."""
        return replace(self, conversation=conversation)

    def making(self) -> IdempotencyKey:
        """This attempt, writing a conversation it makes: its id fixed now (``conversation``),
        so that a retry knows where it would be."""
        return self.writing(uuid4())

    @classmethod
    def of(cls, owner: str, key: str, *subject: str | bytes) -> IdempotencyKey:
        """``owner``'s ``key`` for a request that asks ``subject`` (its route, then what a
        retry must repeat exactly: its path's ids, its body)."""
        digest = hashlib.sha256()
        for part in subject:
            data = part.encode() if isinstance(part, str) else part
            digest.update(len(data).to_bytes(8, "big") + data)
        return cls(owner, key, digest.hexdigest())


@dataclass(frozen=True)
class Removal:
    """A write that takes committed content away from ``owner``'s conversation (History's
    ``delete``, ``pop_item``, ``delete_response``), completing ``idempotency`` (the
    Idempotency-Key claim it came with; None: none) in its own transaction."""

    conversation_id: UUID
    owner: str = ANONYMOUS
    idempotency: IdempotencyKey | None = None


@dataclass(frozen=True)
class Append:
    """A turn to commit to ``owner``'s conversation, if it is still at ``expected_revision``
    (0: create the conversation with this turn) and no other turn holds its lease.
    ``idempotency``, claimed before, is completed in the same transaction; ``lease``, the
    holder's id, is released by it. With ``fork_of``, the conversation is first made as that
    fork (at ``expected_revision``), in the same transaction: a turn that fails leaves no
    fork behind (its place among its owner's forks was taken before its provider call:
    Places.take_fork)."""

    conversation_id: UUID
    turn: Turn
    expected_revision: int
    owner: str = ANONYMOUS
    idempotency: IdempotencyKey | None = None
    lease: UUID | None = None
    run: RunCommit | None = None
    fork_of: ForkPoint | None = None  # create the conversation as this fork first (same commit)
    # A new conversation made for a stored /v1 response: it expires STORED_RESPONSE_TTL_DAYS
    # after its last turn (a fork of one does too).
    stored_response: bool = False
    stored_bytes: int | None = None  # what the conversation holds with this turn (None: unknown)


@dataclass(frozen=True)
class ForkPoint:
    """Turns 1..``revision`` of conversation ``source``: where a fork begins."""

    source: UUID
    revision: int


RunStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
FINISHED: frozenset[str] = frozenset({"completed", "incomplete", "failed", "cancelled"})


@dataclass(frozen=True)
class NewRun:
    """A streamed or background turn about to run (service/usecases/runs.py)."""

    id: UUID
    conversation_id: UUID
    owner: str
    background: bool
    response: msgspec.Raw | None = None  # what its /v1 Response echoes (see Turn.response)
    # Made only if its conversation exists, its owner's, at a revision ``if_match`` lists (None:
    # any): the early check of a streamed turn, in the run's creation (RunWrites.create_run).
    existing: bool = False
    if_match: Precondition = None


@dataclass(frozen=True)
class RunEnd:
    """How a run ended that did not commit: its status, error and last events (the terminal
    one last)."""

    status: RunStatus
    error_code: str | None
    error_message: str | None
    events: Sequence[RunEvent]
    revision: int | None = None  # an Idempotency-Key replay of a committed turn names it


@dataclass(frozen=True)
class RunCommit:
    """What a durable turn's commit also writes: the run's end and its ``message.done``,
    whose revision is the one the commit makes."""

    run_id: UUID
    status: RunStatus
    done_seq: int  # the number of its message.done
    done: Done


@dataclass(frozen=True)
class Renewed:
    """Of the runs whose heartbeats were renewed: those asked to stop, and those a reader
    follows from elsewhere."""

    cancelled: frozenset[UUID] = frozenset()
    watched: frozenset[UUID] = frozenset()


@dataclass(frozen=True)
class RunView:
    """A run as readers see it."""

    id: UUID
    conversation_id: UUID
    status: RunStatus
    revision: int | None
    message: str | None  # the committed reply
    error_code: str | None
    error_message: str | None
    last_event: int
    background: bool
    stalled: bool  # unfinished, and its replica stopped renewing its heartbeat
    base_revision: int | None = None  # its turn held the conversation here (None: not yet)
    message_id: str | None = None  # the provider's id of the message it streamed
    response: msgspec.Raw | None = None  # what its /v1 Response echoes (see Turn.response)
    created_at: datetime | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass(frozen=True)
class LeaseRequest:
    """A try for a conversation's turn lease: ``holder`` for ``lease_s`` seconds, unless
    another holder's lease is live (or the live one is ``replaces``: a turn of the caller's
    that could not give it back). ``queue``: a refused caller will wait, so the holder's
    release must wake it. The conversation comes back as ``load`` reads it after
    ``after_revision``, with the turns of its window: from its window start on, but not
    further back than ``window_bytes`` of replay items reach from its latest turn (the turn
    that crosses that is read too; None: no bound), so that what one turn reads stays within
    what it could send (CONTEXT_MAX_REQUEST_BYTES) to ``window_origin``, whatever was
    appended since the last turn moved the window start. ``run``: ``holder`` is a queued
    run's id, and the lease, when taken, begins it at the revision it holds (RunWrites.
    begin_run's write, without a round trip of its own)."""

    conversation_id: UUID
    owner: str
    holder: UUID
    lease_s: float
    queue: bool
    after_revision: int = 0
    replaces: UUID | None = None
    window_bytes: int | None = None
    window_origin: Origin | None = None  # what the turn's request is for (None: not known)
    run: bool = False


@dataclass(frozen=True)
class LeaseAttempt:
    """One try for a conversation's turn lease, and the conversation as it is now (its turns
    after the revision the caller already has)."""

    conversation: Conversation | None  # None: unknown, deleted, expired or another owner's
    acquired: bool
    busy_until: datetime | None = None  # not acquired: when the holder's lease runs out
    crowded: bool = False  # not acquired: the owner runs OWNER_MAX_RUNNING_TURNS turns


@dataclass(frozen=True)
class Commit:
    """What the store reports after a successful append."""

    revision: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class Committed:
    """Where an earlier attempt with the same Idempotency-Key committed its turn (and its
    run, for a background turn), or its other write: the conversation it made or changed, at
    the revision it left (a deletion names none: the conversation is gone)."""

    conversation_id: UUID | None
    revision: int | None
    turn_id: UUID | None = None

    @property
    def turn(self) -> tuple[UUID, int]:
        """The conversation and revision of a committed turn (a write that made one)."""
        assert self.conversation_id is not None and self.revision is not None
        return self.conversation_id, self.revision


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidInput(f"metadata: at most {MAX_METADATA_PAIRS} pairs.", param="metadata")
    if any("\x00" in text for pair in metadata.items() for text in pair):
        raise InvalidInput("metadata: a key or value holds a NUL character.", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidInput(
                f"metadata: keys at most {MAX_METADATA_KEY} characters, values at most "
                f"{MAX_METADATA_VALUE}.",
                param="metadata",
            )
    return metadata
