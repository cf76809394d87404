"""The PostgreSQL adapter of the store ports: short transactions, a conditional revision bump
per turn, Idempotency-Key claims completed inside that commit.

Every statement about a conversation filters by its id (the future shard key) and, with
RETENTION_DAYS, by idleness, so an expired conversation is gone at once for every reader
and writer, before `turnstore purge` deletes it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from uuid import UUID

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from service.errors import (
    ConversationConflict,
    ConversationNotFound,
    InvalidInput,
    PreconditionFailed,
    StorageError,
    TurnInterrupted,
)
from service.model import (
    ANONYMOUS,
    Append,
    Commit,
    Committed,
    Conversation,
    ConversationInfo,
    IdempotencyKey,
    LeaseAttempt,
    Origin,
    PageRequest,
    Precondition,
    RunEvent,
    Summary,
    ToolCallRecord,
    TranscriptPage,
    TranscriptTurn,
    Turn,
)
from service.store import idempotency as idem
from service.store import runs
from service.store.base import Readiness
from service.store.cursor import decode_cursor, encode_cursor
from service.store.pages import fitting, page_of
from service.store.tables import conversations as c
from service.store.tables import turns as t
from service.store.tx import Compiled, driver, read, transaction, written

_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_CALLS = msgspec.json.Decoder(list[ToolCallRecord])
_METADATA = msgspec.json.Decoder(dict[str, str])
_JSON = msgspec.json.Encoder()


class _Statements:
    """The adapter's statements, with the retention rule built in once."""

    def __init__(self, retention_days: float | None) -> None:
        live = (
            c.c.updated_at
            > sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, retention_days * 86_400)
            if retention_days
            else sa.true()
        )
        self.load = (
            sa.select(
                c.c.revision, c.c.created_at, c.c.updated_at, c.c.context_start, c.c.owner,
                c.c.rewritten_at,
                t.c.user_message, t.c.assistant_message, t.c.replay_items,
                t.c.provider, t.c.endpoint, t.c.model, t.c.context_from, t.c.prompt_version,
                t.c.tool_calls, t.c.status, t.c.incomplete_reason,
                t.c.created_at.label("turn_created_at"),
            )
            # Only the turns after :after (0: all); the conversation row comes back even when
            # none is newer, so a cache can revalidate with one query.
            .select_from(c.outerjoin(t, sa.and_(
                t.c.conversation_id == c.c.id, t.c.seq > sa.bindparam("after")
            )))
            # The owner is checked before any turn is read: another owner's id costs as
            # little as an unknown one.
            .where(c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live)
            .order_by(t.c.seq)
        )  # fmt: skip
        # No other turn's lease may be live: a holder whose lease ran out and was taken over
        # loses here, even if the revision still matches. The commit releases the lease; the
        # turns queued for it are woken after it (see ``append``).
        free = sa.or_(
            c.c.lease_holder.is_(None),
            c.c.lease_expires_at <= sa.func.now(),
            c.c.lease_holder == sa.bindparam("holder"),
        )
        new_row = insert(c).values(
            id=sa.bindparam("cid"),
            revision=sa.bindparam("revision"),
            created_at=sa.func.now(),
            updated_at=sa.func.now(),
            context_start=sa.bindparam("context_start"),
            owner=sa.bindparam("caller"),
            lease_wanted=False,
            metadata=sa.bindparam("metadata"),
        )
        # The first turn: a new conversation, or one made empty (revision 0) on /v1.
        self.create = new_row.on_conflict_do_update(
            index_elements=[c.c.id],
            set_={
                "revision": 1,
                "updated_at": sa.func.now(),
                "context_start": new_row.excluded.context_start,
                "lease_holder": None,
                "lease_expires_at": None,
            },
            where=sa.and_(c.c.revision == 0, c.c.owner == sa.bindparam("caller"), live, free),
        ).returning(c.c.revision, c.c.created_at, c.c.updated_at, c.c.lease_wanted)
        self.create_empty = new_row.returning(
            c.c.id, c.c.revision, c.c.created_at, c.c.updated_at, c.c.metadata
        )
        # A fork: the conversation row and turns 1..:at copied in one statement (the turns'
        # bytes, origins, window starts and prompt versions as they are); none of it is read
        # into the process. Its window starts where turn :at's did.
        self.fork = sa.text(f"""
            WITH src AS (
                SELECT id, metadata FROM conversations
                WHERE id = :src AND owner = :caller AND revision >= :at
                  AND {live.compile(compile_kwargs={"literal_binds": True})}
            ), forked AS (
                INSERT INTO conversations (id, revision, created_at, updated_at, context_start,
                                           owner, lease_wanted, metadata)
                SELECT :new, :at, now(), now(), coalesce((SELECT context_from FROM turns
                       WHERE conversation_id = :src AND seq = :at), 1), :caller, false, metadata
                FROM src
                RETURNING id, revision, created_at, updated_at, metadata
            ), copied AS (
                INSERT INTO turns ({", ".join(FORKED_COLUMNS)}, conversation_id)
                SELECT {", ".join(FORKED_COLUMNS)}, :new FROM turns
                WHERE conversation_id = (SELECT id FROM src) AND seq <= :at
            )
            SELECT * FROM forked
        """)  # fmt: skip
        # Removing the latest item (pop_item): the row locked, the last turn read, rewritten.
        self.lock_head = (
            sa.select(
                c.c.revision,
                sa.and_(c.c.lease_holder.is_not(None), c.c.lease_expires_at > sa.func.now())
                .label("leased"),
            )
            .where(c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live)
            .with_for_update()
        )  # fmt: skip
        self.turn_at = sa.select(
            *[t.c[name] for name in TURN_COLUMNS if name != "conversation_id"],
            t.c.created_at.label("turn_created_at"),
        ).where(t.c.conversation_id == sa.bindparam("cid"), t.c.seq == sa.bindparam("seq"))
        self.delete_turn = sa.delete(t).where(
            t.c.conversation_id == sa.bindparam("cid"), t.c.seq == sa.bindparam("seq")
        )
        self.insert_turn_at = sa.insert(t)
        self.rewritten = (
            sa.update(c)
            .where(c.c.id == sa.bindparam("cid"))
            .values(
                revision=c.c.revision + 1,
                rewritten_at=c.c.revision + 1,
                updated_at=sa.func.now(),
            )
            .returning(c.c.id, c.c.revision, c.c.created_at, c.c.updated_at, c.c.metadata)
        )
        self.describe = sa.select(
            c.c.id, c.c.revision, c.c.created_at, c.c.updated_at, c.c.metadata
        ).where(c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live)
        self.set_metadata = (
            sa.update(c)
            .where(c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live)
            .values(metadata=sa.bindparam("metadata"))
            .returning(c.c.id, c.c.revision, c.c.created_at, c.c.updated_at, c.c.metadata)
        )
        bumped = (
            sa.update(c)
            .where(
                c.c.id == sa.bindparam("cid"),
                c.c.revision == sa.bindparam("expected"),
                c.c.owner == sa.bindparam("caller"),
                live,
                free,
            )
            .values(
                revision=c.c.revision + 1,
                updated_at=sa.func.now(),
                # The window start only advances, and only together with a committed turn.
                context_start=sa.func.greatest(c.c.context_start, sa.bindparam("context_start")),
                lease_holder=None,
                lease_expires_at=None,
            )
            .returning(c.c.id, c.c.revision, c.c.created_at, c.c.updated_at, c.c.lease_wanted)
            .cte("bumped")
        )
        self.bump = sa.select(
            bumped.c.revision, bumped.c.created_at, bumped.c.updated_at, bumped.c.lease_wanted
        )
        renewed_until = sa.func.now() + sa.func.make_interval(
            0, 0, 0, 0, 0, 0, sa.bindparam("lease_s")
        )
        # Free for a new holder too when the holder is this replica's own turn that could not
        # give its lease back (:replaces).
        takeable = sa.or_(free, c.c.lease_holder == sa.bindparam("replaces"))
        attempt = (
            sa.update(c)
            .where(c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live)
            .values(
                lease_holder=sa.case((takeable, sa.bindparam("holder")), else_=c.c.lease_holder),
                lease_expires_at=sa.case((takeable, renewed_until), else_=c.c.lease_expires_at),
                lease_wanted=sa.case(
                    (takeable, sa.false()), else_=sa.or_(c.c.lease_wanted, sa.bindparam("queue"))
                ),
            )
            .returning(
                c.c.revision, c.c.created_at, c.c.updated_at, c.c.context_start, c.c.owner,
                c.c.rewritten_at,
                (c.c.lease_holder == sa.bindparam("holder")).label("acquired"),
                c.c.lease_expires_at,
            )
            .cte("attempt")
        )  # fmt: skip
        # The lease and the turns after :after in one statement (one round trip). The turns
        # are read in the statement's snapshot; the conversation's fields come from the
        # updated row, which may be newer if a commit raced the statement: the caller then
        # sees a revision ahead of the turns it got and reads again.
        self.lease = (
            sa.select(
                attempt,
                NO_SYNC_WAIT,
                t.c.user_message, t.c.assistant_message, t.c.replay_items,
                t.c.provider, t.c.endpoint, t.c.model, t.c.context_from, t.c.prompt_version,
                t.c.tool_calls, t.c.status, t.c.incomplete_reason, t.c.seq,
                t.c.created_at.label("turn_created_at"),
            )
            .select_from(attempt.outerjoin(t, sa.and_(
                t.c.conversation_id == sa.bindparam("cid"), t.c.seq > sa.bindparam("after")
            )))
            .order_by(t.c.seq)
        )  # fmt: skip
        # A transcript page: first the turns' sizes (octet_length reads no TOASTed text), so
        # that only the turns that fit the page are read.
        size = sa.func.octet_length(t.c.user_message) + sa.func.octet_length(t.c.assistant_message)
        self.page_sizes = {
            backwards: (
                sa.select(
                    c.c.revision, c.c.created_at, c.c.updated_at, c.c.context_start, c.c.owner,
                    sizes.c.seq, sizes.c.size,
                )
                .select_from(c.outerjoin(sizes, sa.true()))
                .where(c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live)
                .order_by(sizes.c.seq.desc() if backwards else sizes.c.seq)
            )
            for backwards, sizes in (
                (
                    backwards,
                    sa.select(t.c.seq, size.label("size"))
                    .where(
                        t.c.conversation_id == c.c.id,
                        t.c.seq > sa.bindparam("after"),
                        t.c.seq < sa.bindparam("before"),
                    )
                    .order_by(t.c.seq.desc() if backwards else t.c.seq)
                    .limit(sa.bindparam("fetch"))
                    .lateral("sizes"),
                )
                for backwards in (False, True)
            )
        }  # fmt: skip
        self.page_rows = (
            sa.select(
                t.c.seq, t.c.user_message, t.c.assistant_message, t.c.context_from,
                t.c.prompt_version, t.c.tool_calls,
            )
            .where(
                t.c.conversation_id == sa.bindparam("cid"),
                t.c.seq.in_(sa.bindparam("seqs", expanding=True)),
            )
            .order_by(t.c.seq)
        )  # fmt: skip
        self.exists = sa.select(sa.literal(1)).where(
            c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live
        )
        self.delete = (
            sa.delete(c)
            .where(c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live)
            .returning(c.c.revision)
        )
        self.insert_turn = sa.insert(t).values(created_at=sa.func.now())
        self.page = (
            sa.select(c.c.id, c.c.revision, c.c.created_at, c.c.updated_at)
            .where(
                c.c.owner == sa.bindparam("caller"),
                live,
                sa.tuple_(c.c.created_at, c.c.id)
                < sa.tuple_(sa.bindparam("before_at"), sa.bindparam("before_id")),
            )
            .order_by(c.c.created_at.desc(), c.c.id.desc())
            .limit(sa.bindparam("limit"))
        )
        expired = sa.select(c.c.id).where(sa.not_(live)).limit(sa.bindparam("batch"))
        self.purge = (
            sa.delete(c)
            .where(c.c.id.in_(expired.order_by(c.c.updated_at).with_for_update(skip_locked=True)))
            .returning(c.c.id)
        )


CHANNEL = "turnstore"  # the one NOTIFY channel; payloads are topics, "lease:<conversation>"

# Lease writes do not wait for a synchronous standby (nor for their own WAL flush): a lease
# lost in a crash or failover costs a wait at most (the revision guards the data), while
# waiting would double the replication latency of every turn.
NO_SYNC_WAIT = sa.func.set_config("synchronous_commit", "off", True).label("no_sync_wait")


_NO_SYNC_WAIT = "set_config('synchronous_commit', 'off', true)"  # as NO_SYNC_WAIT, in SQL
_RELEASE = sa.text(
    "WITH released AS ("
    " UPDATE conversations SET lease_holder = NULL, lease_expires_at = NULL"
    f" WHERE id = :cid AND lease_holder = :holder RETURNING id, lease_wanted, {_NO_SYNC_WAIT})"
    f" SELECT pg_notify('{CHANNEL}', 'lease:' || id::text) FROM released WHERE lease_wanted"
)
_WAKE = sa.text(
    f"SELECT pg_notify('{CHANNEL}', topic), {_NO_SYNC_WAIT}"
    " FROM unnest(CAST(:topics AS text[])) AS topic"
)
_RENEW = sa.text(
    "UPDATE conversations c"
    " SET lease_expires_at = now() + make_interval(secs => :lease_s)"
    " FROM unnest(CAST(:cids AS uuid[]), CAST(:holders AS uuid[])) AS l(id, holder)"
    f" WHERE c.id = l.id AND c.lease_holder = l.holder RETURNING c.id, {_NO_SYNC_WAIT}"
)
_READINESS = sa.text(
    "SELECT to_regclass('alembic_version') IS NOT NULL AS migrated, "
    "NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off' AS writable"
)


class PostgresStore:
    """ConversationStore, IdempotencyStore and Operations over one engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        retention_days: float | None = None,
        idempotency_ttl_s: float = 86_400,
        idempotency_lease_s: float = 600,
        events_ttl_s: float = 600,
    ) -> None:
        self._engine = engine
        self._sql = _Statements(retention_days)
        # The statements of every turn go straight to the driver (see store/tx.py).
        dialect = engine.dialect
        self._load = Compiled(self._sql.load, dialect)
        self._create = Compiled(self._sql.create, dialect)
        self._create_empty = Compiled(self._sql.create_empty, dialect)
        self._fork = Compiled(self._sql.fork, dialect)
        self._bump = Compiled(self._sql.bump, dialect)
        self._lease = Compiled(self._sql.lease, dialect)
        self._insert_turn = Compiled(self._sql.insert_turn, dialect, list(TURN_COLUMNS))
        self._complete = Compiled(idem.COMPLETE, dialect)
        self._end_run = Compiled(runs.COMMIT, dialect)
        self._exists = Compiled(self._sql.exists, dialect)
        self._retention = retention_days
        self._idempotency_ttl_s = idempotency_ttl_s
        self._events_ttl_s = events_ttl_s
        # A claimed key whose replica died is taken over after this long.
        self._idempotency_lease_s = idempotency_lease_s

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    async def load(
        self, conversation_id: UUID, owner: str = ANONYMOUS, *, after_revision: int = 0
    ) -> Conversation | None:
        async with driver(self._engine, write=False) as conn:
            params = {"cid": conversation_id, "caller": owner, "after": after_revision}
            rows = await conn.fetch(self._load.sql, *self._load.args(params))
        if not rows:
            return None
        first = rows[0]
        turns = [_turn(row) for row in rows if row["replay_items"] is not None]
        return Conversation(
            id=conversation_id,
            revision=first["revision"],
            created_at=first["created_at"],
            updated_at=first["updated_at"],
            turns=turns,
            context_start=first["context_start"],
            owner=first["owner"],
            rewritten_at=first["rewritten_at"],
        )

    async def lease(
        self,
        conversation_id: UUID,
        owner: str,
        holder: UUID,
        *,
        lease_s: float,
        queue: bool,
        after_revision: int = 0,
        replaces: UUID | None = None,
    ) -> LeaseAttempt:
        params = {
            "cid": conversation_id,
            "caller": owner,
            "holder": holder,
            "replaces": replaces,
            "lease_s": lease_s,
            "queue": queue,
            "after": after_revision,
        }

        async def take() -> list[Any]:
            async with driver(self._engine, write=False) as conn:  # one statement: autocommit
                rows: list[Any] = await conn.fetch(self._lease.sql, *self._lease.args(params))
                return rows

        rows = await written(take)
        if not rows:
            return LeaseAttempt(conversation=None, acquired=False)
        first = rows[0]
        newest = rows[-1]["seq"] if rows[-1]["seq"] is not None else after_revision
        busy_until = None if first["acquired"] else first["lease_expires_at"]
        if first["revision"] > newest:
            # A commit raced the statement: its turn is not in the statement's snapshot (the
            # revision is the updated row's). Read again: callers (and the history cache)
            # must never get a revision ahead of its turns.
            again = await self.load(conversation_id, owner, after_revision=after_revision)
            acquired = first["acquired"] and again is not None
            return LeaseAttempt(again, acquired, busy_until)
        conversation = Conversation(
            id=conversation_id,
            revision=first["revision"],
            created_at=first["created_at"],
            updated_at=first["updated_at"],
            turns=[_turn(row) for row in rows if row["replay_items"] is not None],
            context_start=first["context_start"],
            owner=first["owner"],
            rewritten_at=first["rewritten_at"],
        )
        return LeaseAttempt(conversation, first["acquired"], busy_until)

    async def release_lease(self, conversation_id: UUID, holder: UUID) -> None:
        async def release() -> None:
            async with read(self._engine) as conn:
                await conn.execute(_RELEASE, {"cid": conversation_id, "holder": holder})

        await written(release)

    async def renew_leases(self, leases: Sequence[tuple[UUID, UUID]], lease_s: float) -> set[UUID]:
        cids, holders = [cid for cid, _ in leases], [holder for _, holder in leases]
        async with read(self._engine) as conn:
            rows = await conn.execute(
                _RENEW, {"cids": cids, "holders": holders, "lease_s": lease_s}
            )
            return {row[0] for row in rows}

    async def transcript(
        self, conversation_id: UUID, owner: str, page: PageRequest
    ) -> TranscriptPage | None:
        params = {
            "cid": conversation_id,
            "caller": owner,
            "after": page.after,
            "before": page.before if page.before is not None else 2**31 - 1,
            "fetch": page.limit + 1,  # one more than asked: is there more?
        }
        async with read(self._engine) as conn:
            sizes = (await conn.execute(self._sql.page_sizes[page.backwards], params)).all()
            if not sizes:
                return None
            chosen = fitting([(r.seq, r.size) for r in sizes if r.seq is not None], page)
            rows: Sequence[Any] = []
            if chosen:
                seqs = {"cid": conversation_id, "seqs": chosen}
                rows = (await conn.execute(self._sql.page_rows, seqs)).all()
        head = sizes[0]
        conversation = Conversation(
            id=conversation_id,
            revision=head.revision,
            created_at=head.created_at,
            updated_at=head.updated_at,
            context_start=head.context_start,
            owner=head.owner,
        )
        turns = [_transcript_turn(row) for row in rows]
        return page_of(conversation, turns, page, fetched=sum(r.seq is not None for r in sizes))

    async def append(self, append: Append) -> Commit:
        return await written(lambda: self._append(append))

    async def _append(self, append: Append) -> Commit:
        conversation_id, turn, idempotency = append.conversation_id, append.turn, append.idempotency
        params = {
            "cid": conversation_id,
            "expected": append.expected_revision,
            "context_start": turn.context_from,
            "caller": append.owner,
            "holder": append.lease,
            "revision": 1,
            "metadata": None,
        }
        statement = self._create if append.expected_revision == 0 else self._bump
        wake: list[str] = []  # topics to notify once committed
        async with driver(self._engine, write=True) as conn:
            if append.fork_of is not None:
                fork = {"src": append.fork_of.source, "at": append.fork_of.revision,
                        "caller": append.owner, "new": conversation_id}  # fmt: skip
                if await conn.fetchrow(self._fork.sql, *self._fork.args(fork)) is None:
                    raise ConversationNotFound()  # the source went meanwhile
            row = await conn.fetchrow(statement.sql, *statement.args(params))
            if row is None:
                raise await self._why_not(conn, params)
            revision = row["revision"]
            if row.get("lease_wanted"):  # turns wait for the lease this commit releases
                wake.append(f"lease:{conversation_id}")
            run = append.run
            new_turn = _turn_row(conversation_id, revision, turn, run.run_id if run else None)
            await conn.execute(self._insert_turn.sql, *self._insert_turn.args(new_turn))
            if idempotency is not None:
                done = idem.key_params(idempotency) | {
                    "cid": conversation_id,
                    "committed_revision": revision,
                    "ttl_s": self._idempotency_ttl_s,
                }
                await conn.execute(self._complete.sql, *self._complete.args(done))
            if run is not None:
                ended = await conn.fetchrow(self._end_run.sql, *self._end_run.args({
                    "id": run.run_id, "status": run.status, "revision": revision,
                    "seq": run.done_seq, "ttl": self._events_ttl_s,
                    "events": runs.batch([RunEvent(run.done_seq, "message.done",
                                                   run.done_data(revision))]),
                }))  # fmt: skip
                if ended is None:
                    raise TurnInterrupted()  # rolls the whole commit back
                if ended[0]:  # its events are followed elsewhere
                    wake.append(f"events:{run.run_id}")
        if wake:
            # In a transaction of its own: a NOTIFY takes a global lock until its transaction
            # has committed, replication wait included, so inside the commit it would line all
            # commits up behind each other.
            with contextlib.suppress(StorageError):  # those woken look again by themselves
                async with read(self._engine) as conn:
                    await conn.execute(_WAKE, {"topics": wake})
        return Commit(revision, row["created_at"], row["updated_at"])

    async def _why_not(self, conn: Any, params: dict[str, Any]) -> Exception:
        if params["expected"] == 0:
            return ConversationConflict()
        exists = await conn.fetchval(self._exists.sql, *self._exists.args(params))
        return ConversationConflict() if exists else ConversationNotFound()

    async def delete(
        self, conversation_id: UUID, owner: str = ANONYMOUS, if_match: Precondition = None
    ) -> None:
        await written(lambda: self._delete(conversation_id, owner, if_match))

    async def _delete(self, conversation_id: UUID, owner: str, if_match: Precondition) -> None:
        async with transaction(self._engine) as conn:
            params = {"cid": conversation_id, "caller": owner}
            revision = await conn.scalar(self._sql.delete, params)
            if revision is None:
                raise ConversationNotFound()
            if if_match is not None and revision not in if_match:
                raise PreconditionFailed()  # rolls the delete back
            await conn.execute(runs.DELETE_OF, {"cids": [conversation_id]})  # and their events

    async def create_conversation(
        self, owner: str, metadata: dict[str, str], turn: Turn | None = None
    ) -> ConversationInfo:
        return await written(lambda: self._create_conversation(owner, metadata, turn))

    async def _create_conversation(
        self, owner: str, metadata: dict[str, str], turn: Turn | None
    ) -> ConversationInfo:
        cid = uuid.uuid4()
        params = {
            "cid": cid, "caller": owner, "revision": 0 if turn is None else 1,
            "context_start": 1, "metadata": _JSON.encode(metadata).decode(),
        }  # fmt: skip
        async with driver(self._engine, write=True) as conn:
            row = await conn.fetchrow(self._create_empty.sql, *self._create_empty.args(params))
            if turn is not None:
                new_turn = _turn_row(cid, 1, turn, None)
                await conn.execute(self._insert_turn.sql, *self._insert_turn.args(new_turn))
        return _info(row)

    async def fork(self, conversation_id: UUID, owner: str, at_revision: int) -> ConversationInfo:
        params = {"src": conversation_id, "caller": owner, "at": at_revision, "new": uuid.uuid4()}

        async def fork() -> ConversationInfo:
            async with transaction(self._engine) as conn:
                row = (await conn.execute(self._sql.fork, params)).mappings().first()
                if row is None:
                    raise await self._why_no_fork(conn, params)
                return _info(row)

        return await written(fork)

    async def _why_no_fork(self, conn: Any, params: dict[str, Any]) -> Exception:
        exists = await conn.scalar(self._sql.describe, {"cid": params["src"], **params})
        if exists is None:
            return ConversationNotFound()
        return InvalidInput("at_revision must be a revision of the conversation.")

    async def pop_item(
        self,
        conversation_id: UUID,
        owner: str,
        rewrite: Callable[[Turn], Turn],
        if_match: Precondition = None,
    ) -> tuple[ConversationInfo, msgspec.Raw]:
        params = {"cid": conversation_id, "caller": owner}

        async def pop() -> tuple[ConversationInfo, msgspec.Raw]:
            async with transaction(self._engine) as conn:
                head = (await conn.execute(self._sql.lock_head, params)).mappings().first()
                if head is None:
                    raise ConversationNotFound()
                if if_match is not None and head["revision"] not in if_match:
                    raise PreconditionFailed()
                if head["leased"]:
                    raise ConversationConflict()  # a turn runs: it would commit on top
                revision = head["revision"]
                last = {"cid": conversation_id, "seq": revision}
                row = (await conn.execute(self._sql.turn_at, last)).mappings().first()
                last_turn = _turn(row) if row else None
                if row is None or last_turn is None or not last_turn.replay_items:
                    raise InvalidInput("The conversation has no item to remove.", param="item_id")
                rewritten = rewrite(last_turn)
                await conn.execute(self._sql.delete_turn, last)
                new = _turn_row(conversation_id, revision + 1, rewritten, row["turn_id"])
                await conn.execute(
                    self._sql.insert_turn_at, {**new, "created_at": row["turn_created_at"]}
                )
                done = (await conn.execute(self._sql.rewritten, params)).mappings().one()
                return _info(done), last_turn.replay_items[-1]

        return await written(pop)

    async def describe(self, conversation_id: UUID, owner: str) -> ConversationInfo | None:
        async with read(self._engine) as conn:
            params = {"cid": conversation_id, "caller": owner}
            row = (await conn.execute(self._sql.describe, params)).mappings().first()
        return None if row is None else _info(row)

    async def update_metadata(
        self,
        conversation_id: UUID,
        owner: str,
        metadata: dict[str, str],
        if_match: Precondition = None,
    ) -> ConversationInfo:
        params = {
            "cid": conversation_id,
            "caller": owner,
            "metadata": _JSON.encode(metadata).decode(),
        }

        async def update() -> ConversationInfo:
            async with transaction(self._engine) as conn:
                row = (await conn.execute(self._sql.set_metadata, params)).mappings().first()
                if row is None:
                    raise ConversationNotFound()
                if if_match is not None and row["revision"] not in if_match:
                    raise PreconditionFailed()  # rolls the update back
                return _info(row)

        return await written(update)

    async def list_conversations(
        self, owner: str, limit: int, after: str | None = None
    ) -> tuple[list[Summary], str | None]:
        """The owner's conversations, newest first, and the cursor of the next page."""
        before_at, before_id = decode_cursor(after)
        params = {"caller": owner, "limit": limit, "before_at": before_at, "before_id": before_id}
        async with read(self._engine) as conn:
            rows = (await conn.execute(self._sql.page, params)).all()
        page = [Summary(r.id, r.revision, r.created_at, r.updated_at) for r in rows]
        cursor = encode_cursor(page[-1]) if len(page) == limit else None
        return page, cursor

    async def claim(self, key: IdempotencyKey, turn_id: UUID | None = None) -> Committed | None:
        return await written(lambda: self._claim(key, turn_id))

    async def _claim(self, key: IdempotencyKey, turn_id: UUID | None) -> Committed | None:
        params = idem.key_params(key)
        async with transaction(self._engine) as conn:
            claimed = await conn.scalar(
                idem.CLAIM,
                {**params, "lease_s": self._idempotency_lease_s, "claimed_turn": turn_id},
            )
            if claimed is not None:
                return None
            row = (await conn.execute(idem.EXISTING, params)).one()
        return idem.answer(row, key)

    async def check(self, key: IdempotencyKey) -> None:
        async with read(self._engine) as conn:
            row = (await conn.execute(idem.LIVE, idem.key_params(key))).first()
        if row is not None:
            idem.answer(row, key)

    async def release(self, key: IdempotencyKey) -> None:
        async def release() -> None:
            async with read(self._engine) as conn:  # one statement: autocommit
                await conn.execute(idem.RELEASE, idem.key_params(key))

        await written(release)

    async def purge(self, batch: int = 500) -> int:
        """Delete expired Idempotency-Key records, and conversations idle past the
        retention a small batch per transaction so no lock is held long; concurrent purges
        skip each other's rows."""
        async with read(self._engine) as conn:
            await conn.execute(idem.EXPIRED)
            await conn.execute(runs.EXPIRED)  # runs whose events are past TURN_EVENTS_TTL_S
        total = 0
        while self._retention:
            async with transaction(self._engine) as conn:
                gone = (await conn.execute(self._sql.purge, {"batch": batch})).scalars().all()
                await conn.execute(runs.DELETE_OF, {"cids": list(gone)})
            total += len(gone)
            if len(gone) < batch:
                break
        return total

    async def readiness(self) -> Readiness:
        async with read(self._engine) as conn:
            state = (await conn.execute(_READINESS)).one()
            version = None
            if state.migrated:
                version = await conn.scalar(sa.text("SELECT version_num FROM alembic_version"))
        if not state.writable:
            # Sessions opened while the database is read-only stay so: start afresh next time.
            await self._engine.dispose()
        return Readiness(None if version is None else str(version), state.writable)

    def pool_in_use(self) -> int:
        return self._engine.sync_engine.pool.checkedout()  # type: ignore[attr-defined,no-any-return]

    async def close(self) -> None:
        await self._engine.dispose()


FORKED_COLUMNS = (
    "seq", "user_message", "assistant_message", "replay_items", "created_at", "provider",
    "endpoint", "model", "context_from", "prompt_version", "tool_calls", "status",
    "incomplete_reason",
)  # fmt: skip
TURN_COLUMNS = (
    "conversation_id", "seq", "user_message", "assistant_message", "replay_items",
    "provider", "endpoint", "model", "context_from", "prompt_version", "tool_calls",
    "status", "incomplete_reason", "turn_id",
)  # fmt: skip


def _transcript_turn(row: Any) -> TranscriptTurn:
    return TranscriptTurn(
        number=row.seq,
        user_message=row.user_message,
        assistant_message=row.assistant_message,
        context_from=row.context_from or 1,
        prompt_version=row.prompt_version,
        tool_calls=_CALLS.decode(row.tool_calls) if row.tool_calls else (),
    )


def _info(row: Any) -> ConversationInfo:
    metadata = row["metadata"]
    return ConversationInfo(
        id=row["id"],
        revision=row["revision"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        metadata=_METADATA.decode(metadata) if metadata else {},
    )


def _turn(row: Any) -> Turn:
    return Turn(
        user_message=row["user_message"],
        assistant_message=row["assistant_message"],
        replay_items=_ITEMS.decode(row["replay_items"]),
        origin=Origin(row["provider"], row["endpoint"], row["model"]) if row["provider"] else None,
        context_from=row["context_from"] or 1,
        prompt_version=row["prompt_version"],
        tool_calls=_CALLS.decode(row["tool_calls"]) if row["tool_calls"] else (),
        status=row["status"],
        incomplete_reason=row["incomplete_reason"],
        created_at=row["turn_created_at"],
    )


def _turn_row(
    conversation_id: UUID, seq: int, turn: Turn, turn_id: UUID | None
) -> dict[str, object]:
    return {
        "turn_id": turn_id,
        "conversation_id": conversation_id,
        "seq": seq,
        "user_message": turn.user_message,
        "assistant_message": turn.assistant_message,
        "replay_items": msgspec.json.encode(turn.replay_items).decode(),
        "provider": turn.origin.provider if turn.origin else None,
        "endpoint": turn.origin.endpoint if turn.origin else None,
        "model": turn.origin.model if turn.origin else None,
        "context_from": turn.context_from,
        "prompt_version": turn.prompt_version,
        "tool_calls": msgspec.json.encode(turn.tool_calls).decode() if turn.tool_calls else None,
        "status": turn.status,
        "incomplete_reason": turn.incomplete_reason,
    }
