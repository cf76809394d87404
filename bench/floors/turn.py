"""A turn as the floor apps run it: the statements turnstore runs for it (bench/floors/
statements.py) straight on an asyncpg pool, the reply turnstore's fake provider gives, and
the answer's JSON. Both floor apps (bench/floors/bare.py, litestar_app.py) call this, so what
differs between them is the HTTP layer alone.

Only the path the bench measures is here: a conversation whose lease is free, a provider that
answers. A floor refuses what it does not handle (409, 404, 400) instead of waiting or
retrying, which turnstore does and the bench never asks for.

The rows are the bytes turnstore writes for the same request (the bench compares them): the
user's input item, then the fake provider's reasoning item (its ``encrypted_content`` is the
fake's seal) and message item; the text ``[fake-llm] <message> (history=<items>)``."""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec

from bench.floors.statements import Nulls, Statement, TurnStatements, turn_statements
from bench.server import ONE_OWNER
from service.store.postgres.running_turns import clock

OWNER = "anonymous"  # AUTH_MODE=none, as the bench serves turnstore
MOST = int(ONE_OWNER["OWNER_MAX_RUNNING_TURNS"])  # as the bench serves turnstore
PROVIDER, ENDPOINT, MODEL = "fake", "builtin", "fake-llm"  # the fake provider's origin
LEASE_S = 30.0  # TURN_LEASE_S (also the runs' heartbeat)
EVENTS_TTL_S = 600.0  # TURN_EVENTS_TTL_S
IDEMPOTENCY_TTL_S = 86_400.0  # IDEMPOTENCY_TTL_S
DELTAS = 4  # the fake provider's deltas per streamed reply
_SEAL_KEY = b"turnstore-fake-provider"  # the fake provider's: the same reasoning bytes
_JSON = msgspec.json.Encoder()


class ChatRequest(msgspec.Struct, forbid_unknown_fields=True):
    message: str
    conversation_id: str | None = None
    background: bool = False


class ChatResponse(msgspec.Struct):
    conversation_id: str
    message: str
    status: str
    incomplete_reason: str | None
    revision: int
    correlation_id: str


class ResponseCreate(msgspec.Struct, forbid_unknown_fields=True):
    input: str
    conversation: str


class Refused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self, correlation_id: str) -> bytes:
        detail = {"code": self.code, "message": self.message, "correlation_id": correlation_id}
        return _JSON.encode({"error": detail})


def _not_found() -> Refused:
    return Refused(404, "conversation_not_found", "Conversation not found.")


@dataclass(frozen=True)
class Reply:
    """The fake provider's reply to ``message`` after ``history`` user and assistant items."""

    text: str
    reasoning: dict[str, Any]
    message: dict[str, Any]
    replay_items: str  # the turn's three items as turnstore stores them
    sizes: int  # the bytes of those items, as the next turn's request holds them
    usage: dict[str, int]  # what the fake reports (service/providers/fake.py), as stored

    @classmethod
    def of(cls, message: str, history: int, history_bytes: int = 0) -> Reply:
        text = f"[fake-llm] {message}" + (f" (history={history})" if history else "")
        key = hashlib.sha256(f"{history}:{text}".encode()).hexdigest()[:48]
        rid = f"rs_{key}"
        seal = base64.b64encode(hashlib.sha256(_SEAL_KEY + rid.encode()).digest() * 4).decode()
        reasoning = {"type": "reasoning", "id": rid, "summary": [], "encrypted_content": seal}
        reply = {
            "type": "message",
            "id": f"msg_{key}",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        user = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": message}],
        }
        items = [msgspec.Raw(_JSON.encode(item)) for item in (user, reasoning, reply)]
        tokens_in = -(-(history_bytes + len(items[0])) // 4)
        tokens_out = -(-len(text) // 4) + 4  # its text, and its reasoning's four
        usage = {
            "input_tokens": tokens_in, "cached_tokens": 0, "output_tokens": tokens_out,
            "reasoning_tokens": 4, "total_tokens": tokens_in + tokens_out, "cache_write_tokens": 0,
        }  # fmt: skip
        size = sum(map(len, items))
        return cls(text, reasoning, reply, _JSON.encode(items).decode(), size, usage)

    def openai_usage(self) -> dict[str, Any]:
        usage = self.usage
        return {
            "input_tokens": usage["input_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage["reasoning_tokens"]},
            "total_tokens": usage["total_tokens"],
        }

    def deltas(self) -> list[str]:
        size = max(1, -(-len(self.text) // DELTAS))
        return [self.text[i : i + size] for i in range(0, len(self.text), size)]


@dataclass(frozen=True)
class Done:
    conversation_id: uuid.UUID
    reply: Reply
    revision: int


def check_message(message: str) -> None:
    """The contract's rule on a message (not empty or blank, no NUL), as a floor checks it."""
    if not message.strip() or "\x00" in message or len(message) > 100_000:
        raise Refused(400, "invalid_input", "message must be non-blank text without NUL.")


def parse_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw.removeprefix("conv_"))
    except ValueError:
        raise _not_found() from None


def sse(seq: int, name: str, data: bytes) -> bytes:
    """One Server-Sent Event, framed as Litestar frames turnstore's."""
    return b"id: %d\r\nevent: %s\r\ndata: %s\r\n\r\n" % (seq, name.encode(), data)


class Floor:
    """The turns of one floor process over its pool (10 connections, as DB_POOL_SIZE)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.sql: TurnStatements = turn_statements()
        # The floor's history cache: the revision it last saw of each conversation, so the
        # lease reads only newer turns, as turnstore's cache makes it do.
        self.seen: dict[uuid.UUID, int] = {}
        # The bytes of each conversation's replay items: the fake counts its input tokens
        # from them (service/providers/fake.py), and so does the floor.
        self.history_bytes: dict[uuid.UUID, int] = {}

    @classmethod
    async def open(cls, url: str) -> Floor:
        async def no_reset(_: asyncpg.Connection) -> None:
            return None  # as turnstore's pool: no statements when a connection is given back

        pool = await asyncpg.create_pool(
            url, min_size=10, max_size=10, max_queries=1 << 62, reset=no_reset,
            statement_cache_size=100, command_timeout=30,
            server_settings={"application_name": "turnstore-floor"},
        )  # fmt: skip
        return cls(pool)

    async def close(self) -> None:
        await self.pool.close()

    async def _fetch(self, statement: Statement, values: dict[str, Any]) -> list[Any]:
        async with self.pool.acquire() as conn:
            rows: list[Any] = await conn.fetch(statement.sql, *statement.args(Nulls(values)))
            return rows

    async def _lease(self, cid: uuid.UUID, holder: uuid.UUID, run: bool = False) -> int:
        """Take the conversation's lease (``run``: as the run ``holder``, which it begins);
        its revision."""
        rows = await self._fetch(self.sql.run_lease if run else self.sql.lease, {
            "cid": cid, "caller": OWNER, "holder": holder, "replaces": None,
            "queue": True, "after": self.seen.get(cid, 0), "most": MOST, **clock(LEASE_S),
        })  # fmt: skip
        if not rows:
            raise _not_found()
        if not rows[0]["acquired"]:
            raise Refused(409, "conversation_busy", "Another turn holds the conversation.")
        revision: int = rows[0]["revision"]
        return revision

    async def _take(self, holder: uuid.UUID) -> None:
        """A new conversation's first turn: its place among the owner's running turns."""
        rows = await self._fetch(self.sql.take, {
            "caller": OWNER, "holder": holder, "most": MOST, **clock(LEASE_S),
        })  # fmt: skip
        if not rows[0]["taken"]:
            raise Refused(429, "too_many_requests", "Too many turns of this owner at once.")

    def _commit_values(
        self, cid: uuid.UUID, holder: uuid.UUID, expected: int, message: str, reply: Reply,
        turn_id: uuid.UUID | None,
    ) -> tuple[Statement, dict[str, Any]]:  # fmt: skip
        values = {
            "user_message": message, "assistant_message": reply.text,
            "replay_items": reply.replay_items, "provider": PROVIDER, "endpoint": ENDPOINT,
            "model": MODEL, "context_from": 1, "prompt_version": None, "tool_calls": None,
            "status": "completed", "incomplete_reason": None, "turn_id": turn_id,
            "sealed_user_message": None, "sealed_assistant_message": None,
            "sealed_replay_items": None, "sealed_tool_calls": None,
            "cid": cid, "expected": expected, "context_start": 1, "caller": OWNER,
            "holder": holder, "idle_s": None, "expires_at": None, "ttl_s": IDEMPOTENCY_TTL_S,
            "idem_key": None, "usage": _JSON.encode(reply.usage).decode(),
            # Its sizes, as core/sizes.py counts them (its items and their commas; the sealed
            # reasoning among them; all it stores: its items and its two texts).
            "items_bytes": reply.sizes + 3, "opaque_bytes": len(_JSON.encode(reply.reasoning)) + 1,
            "turn_bytes": reply.sizes + len(message.encode()) + len(reply.text.encode()),
        }  # fmt: skip
        return self.sql.commit, values

    def _committed(self, cid: uuid.UUID, row: Any, reply: Reply) -> int:
        if row is None:
            self.seen.pop(cid, None)
            raise Refused(409, "conversation_conflict", "The conversation changed meanwhile.")
        revision: int = row["revision"]
        self.seen[cid] = revision
        self.history_bytes[cid] = self.history_bytes.get(cid, 0) + reply.sizes
        return revision

    async def _wake(self, cid: uuid.UUID, row: Any) -> None:
        """After a commit that released a lease other turns wait for (never in the bench)."""
        if row["lease_wanted"]:
            await self._fetch(self.sql.wake, {"topics": [f"lease:{cid}"]})

    async def turn(self, message: str, conversation: str | None) -> Done:
        """A plain turn: lease (none for a new conversation), the reply, the commit."""
        check_message(message)
        holder = uuid.uuid4()
        if conversation is None:
            cid, expected = uuid.uuid4(), 0
            await self._take(holder)
        else:
            cid = parse_id(conversation)
            expected = await self._lease(cid, holder)
        reply = Reply.of(message, 2 * expected, self.history_bytes.get(cid, 0))
        statement, values = self._commit_values(cid, holder, expected, message, reply, None)
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(statement.sql, *statement.args(Nulls(values)))
        revision = self._committed(cid, row, reply)
        await self._wake(cid, row)
        return Done(cid, reply, revision)

    async def create_conversation(self) -> uuid.UUID:
        """POST /v1/conversations (made before the measured turns)."""
        cid = uuid.uuid4()
        await self._fetch(self.sql.create_empty, {
            "cid": cid, "caller": OWNER, "revision": 0, "context_start": 1,
            "metadata": "{}", "sealed_metadata": None,
        })  # fmt: skip
        return cid

    async def start_stream(self, message: str, conversation: str | None) -> Streamed:
        """A streamed turn up to its first byte: the conversation checked (a missing one is
        a JSON 404, not a stream), the run made."""
        check_message(message)
        new = conversation is None
        cid = uuid.uuid4() if conversation is None else parse_id(conversation)
        if not new:
            rows = await self._fetch(self.sql.check, {"cid": cid, "caller": OWNER})
            if not rows:
                raise _not_found()
        run_id = uuid.uuid4()
        made = await self._fetch(self.sql.run_create, {
            "id": run_id, "cid": cid, "owner": OWNER, "background": False, "hb": LEASE_S,
            "caller": OWNER, "holder": run_id, "most": MOST, **clock(LEASE_S),
        })  # fmt: skip
        if not made[0]["taken"]:
            raise Refused(429, "too_many_requests", "Too many turns of this owner at once.")
        return Streamed(self, message, cid, new, run_id)


@dataclass
class Streamed:
    floor: Floor
    message: str
    conversation_id: uuid.UUID
    new: bool
    run_id: uuid.UUID

    async def events(self) -> AsyncIterator[tuple[int, str, bytes]]:
        """(seq, name, data) of each event: the deltas, then message.done once committed."""
        floor, sql, cid, run = self.floor, self.floor.sql, self.conversation_id, self.run_id
        holder = run  # a run holds its lease and its place as the run
        if self.new:
            expected = 0
            await floor._fetch(sql.run_begin, {"id": run, "cid": cid})
        else:
            expected = await floor._lease(cid, holder, run=True)
        reply = Reply.of(self.message, 2 * expected, floor.history_bytes.get(cid, 0))
        logged = []
        for seq, delta in enumerate(reply.deltas(), start=1):
            data = _JSON.encode({"delta": delta})
            logged.append(b'[%d,"message.delta",%s]' % (seq, data))
            yield seq, "message.delta", data
        await floor._fetch(sql.run_log, {
            "id": run, "cid": cid, "last": len(logged), "sealed_events": None,
            "events": (b"[" + b",".join(logged) + b"]").decode(),
        })  # fmt: skip
        statement, values = floor._commit_values(cid, holder, expected, self.message, reply, run)
        done_seq = len(logged) + 1
        async with floor.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(statement.sql, *statement.args(Nulls(values)))
            revision = floor._committed(cid, row, reply)
            done = _JSON.encode({
                "status": "completed", "incomplete_reason": None,
                "conversation_id": str(cid), "revision": revision, "turn_id": str(run),
                "usage": reply.openai_usage(),
            })  # fmt: skip
            ended = await conn.fetchrow(sql.run_commit.sql, *sql.run_commit.args(Nulls({
                "id": run, "cid": cid, "status": "completed", "revision": revision,
                "seq": done_seq,
                "ttl": EVENTS_TTL_S, "sealed_events": None,
                "events": (b'[[%d,"message.done",%s]]' % (done_seq, done)).decode(),
            })))  # fmt: skip
            if ended is None:
                raise Refused(409, "turn_interrupted", "The run ended before the commit.")
        await floor._wake(cid, row)
        yield done_seq, "message.done", done


def response_object(done: Done) -> dict[str, Any]:
    """The Response a /v1 turn answers (reasoning shown without its encrypted content)."""
    reasoning = {k: v for k, v in done.reply.reasoning.items() if k != "encrypted_content"}
    cid = done.conversation_id.hex
    return {
        "id": f"resp_{cid}{done.revision:08x}", "object": "response", "created_at": time.time(),
        "status": "completed", "model": MODEL, "output": [reasoning, done.reply.message],
        "incomplete_details": None, "error": None, "conversation": {"id": f"conv_{cid}"},
        "previous_response_id": None, "instructions": None, "metadata": {},
        "parallel_tool_calls": False, "tool_choice": "auto", "tools": [], "truncation": "auto",
        "store": True, "background": False, "text": {"format": {"type": "text"}}, "usage": None,
    }  # fmt: skip
