"""The PostgreSQL adapter of the store ports: short transactions, a conditional revision bump
per turn, Idempotency-Key claims completed inside that commit.

Every statement about a conversation filters by its id (the future shard key) and, with
RETENTION_DAYS, by idleness, so an expired conversation is gone at once for every reader
and writer, before `turnstore purge` deletes it.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from uuid import UUID

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import (
    ConversationConflict,
    ConversationNotFound,
    InvalidInput,
    PreconditionFailed,
    StorageError,
    TurnInterrupted,
)
from service.core.model import (
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
    Summary,
    ToolCallRecord,
    TranscriptPage,
    TranscriptTurn,
    Turn,
)
from service.platform.crypto import OVERHEAD, DataKey
from service.store.cursor import decode_cursor, encode_cursor
from service.store.pages import fitting, page_of
from service.store.ports import Readiness
from service.store.postgres import idempotency as idem
from service.store.postgres import run_store as runs
from service.store.postgres.keyring import Keyring
from service.store.postgres.sealed import (
    TURN_FIELDS,
    check_row,
    get,
    metadata_place,
    put,
    reading_key,
    sealed_turn_columns,
    turn_place,
    writing_key,
)
from service.store.postgres.tables import conversations as c
from service.store.postgres.tables import idempotency_keys as k
from service.store.postgres.tables import turns as t
from service.store.postgres.tx import Compiled, driver, read, transaction, written

log = logging.getLogger("turnstore.store")
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_CALLS = msgspec.json.Decoder(list[ToolCallRecord])
_METADATA = msgspec.json.Decoder(dict[str, str])
_JSON = msgspec.json.Encoder()


# A turn as read back: its place, its fields (in clear or sealed) and where it came from.
TURN_READ = (
    t.c.seq, t.c.user_message, t.c.assistant_message, t.c.replay_items, t.c.tool_calls,
    t.c.sealed_user_message, t.c.sealed_assistant_message, t.c.sealed_replay_items,
    t.c.sealed_tool_calls, t.c.provider, t.c.endpoint, t.c.model, t.c.context_from,
    t.c.prompt_version, t.c.status, t.c.incomplete_reason, t.c.created_at.label("turn_created_at"),
)  # fmt: skip
INFO = (c.c.id, c.c.revision, c.c.created_at, c.c.updated_at, c.c.metadata, c.c.sealed_metadata)


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
                c.c.rewritten_at, *TURN_READ,
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
        ).returning(c.c.id, c.c.revision, c.c.created_at, c.c.updated_at, c.c.lease_wanted)
        self.create_empty = new_row.values(
            sealed_metadata=sa.bindparam("sealed_metadata")
        ).returning(*INFO)
        # A fork: the conversation row and turns 1..:at copied in one statement (the turns'
        # bytes, origins, window starts and prompt versions as they are); none of it is read
        # into the process. Its window starts where turn :at's did.
        self.fork = sa.text(f"""
            WITH src AS (
                SELECT id, metadata FROM conversations
                WHERE id = :src AND owner = :caller AND revision >= :at
                  AND {live.compile(compile_kwargs={"literal_binds": True})}
                  AND sealed_metadata IS NULL AND NOT EXISTS (SELECT 1 FROM turns
                      WHERE conversation_id = :src AND seq <= :at
                        AND sealed_replay_items IS NOT NULL)
            ), forked AS (
                INSERT INTO conversations (id, revision, created_at, updated_at, context_start,
                                           owner, lease_wanted, metadata)
                SELECT :new, :at, now(), now(), coalesce((SELECT context_from FROM turns
                       WHERE conversation_id = :src AND seq = :at), 1), :caller, false, metadata
                FROM src
                RETURNING id, revision, created_at, updated_at, metadata, sealed_metadata
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
        self.turn_at = sa.select(*TURN_READ, t.c.turn_id).where(
            t.c.conversation_id == sa.bindparam("cid"), t.c.seq == sa.bindparam("seq")
        )
        # A fork made in the process, to seal its copy for its own place (with the keys).
        self.fork_source = (
            sa.select(
                c.c.metadata, c.c.sealed_metadata,
                sa.select(t.c.context_from)
                .where(t.c.conversation_id == c.c.id, t.c.seq == sa.bindparam("at"))
                .scalar_subquery().label("context_from"),
            )
            .where(c.c.id == sa.bindparam("src"), c.c.owner == sa.bindparam("caller"),
                   c.c.revision >= sa.bindparam("at"), live)
            .with_for_update(read=True)
        )  # fmt: skip
        self.fork_turns = (
            sa.select(*TURN_READ)
            .where(t.c.conversation_id == sa.bindparam("src"), t.c.seq <= sa.bindparam("at"))
            .order_by(t.c.seq)
        )
        self.fork_row = insert(c).values(
            id=sa.bindparam("new"), revision=sa.bindparam("at"), created_at=sa.func.now(),
            updated_at=sa.func.now(), context_start=sa.bindparam("context_start"),
            owner=sa.bindparam("caller"), lease_wanted=False, metadata=sa.bindparam("metadata"),
            sealed_metadata=sa.bindparam("sealed_metadata"),
        ).returning(*INFO)  # fmt: skip
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
            .returning(*INFO)
        )
        self.describe = sa.select(*INFO).where(
            c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live
        )
        self.set_metadata = (
            sa.update(c)
            .where(c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("caller"), live)
            .values(
                metadata=sa.bindparam("metadata"), sealed_metadata=sa.bindparam("sealed_metadata")
            )
            .returning(*INFO)
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
        )
        # A turn's commit in one statement (for a plain turn, in autocommit: one round trip):
        # the conditional bump (or the new conversation), the turn's row at the new revision
        # and its Idempotency-Key completed (:idem_key NULL: none); none of it if the bump
        # found no row.
        self.commit = {
            new: _one_statement(head.cte("head"), ttl=_in_seconds("ttl_s"))
            for new, head in ((False, bumped), (True, self.create))
        }
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
            sa.select(attempt, NO_SYNC_WAIT, *TURN_READ)
            .select_from(attempt.outerjoin(t, sa.and_(
                t.c.conversation_id == sa.bindparam("cid"), t.c.seq > sa.bindparam("after")
            )))
            .order_by(t.c.seq)
        )  # fmt: skip
        # A transcript page: first the turns' sizes (octet_length reads no TOASTed text), so
        # that only the turns that fit the page are read.
        # (Sealed, their size is the ciphertext's less its fixed overhead.)
        size = sa.func.coalesce(
            sa.func.octet_length(t.c.user_message),
            sa.func.octet_length(t.c.sealed_user_message) - OVERHEAD,
        ) + sa.func.coalesce(
            sa.func.octet_length(t.c.assistant_message),
            sa.func.octet_length(t.c.sealed_assistant_message) - OVERHEAD,
        )
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
                t.c.prompt_version, t.c.tool_calls, t.c.sealed_user_message,
                t.c.sealed_assistant_message, t.c.sealed_tool_calls,
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


def _in_seconds(name: str) -> Any:
    return sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.bindparam(name))


def _one_statement(head: Any, *, ttl: Any) -> Any:
    """The commit statement over ``head``, a CTE returning the committed conversation row."""
    given = [name for name in TURN_COLUMNS if name not in ("conversation_id", "seq")]
    row = sa.select(
        *[sa.cast(sa.bindparam(name), t.c[name].type) for name in given],
        head.c.id, head.c.revision, sa.func.now(),
    )  # fmt: skip
    inserted = (
        sa.insert(t)
        .from_select([*given, "conversation_id", "seq", "created_at"], row)
        .returning(t.c.seq)
        .cte("inserted")
    )
    completed = (
        sa.update(k)
        .where(k.c.owner == sa.bindparam("caller"), k.c.key == sa.bindparam("idem_key"))
        .values(state="done", conversation_id=head.c.id, revision=head.c.revision, expires_at=ttl)
        .returning(k.c.key)
        .cte("completed")
    )
    return sa.select(
        head.c.revision, head.c.created_at, head.c.updated_at, head.c.lease_wanted
    ).add_cte(inserted, completed)


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
_OWNER_SEALED = sa.text(
    "SELECT EXISTS (SELECT 1 FROM conversations c JOIN turns t ON t.conversation_id = c.id"
    " WHERE c.owner = :owner AND t.sealed_replay_items IS NOT NULL)"
    " OR EXISTS (SELECT 1 FROM conversations WHERE owner = :owner"
    " AND sealed_metadata IS NOT NULL)"
)
_OWNED = sa.text(
    "DELETE FROM conversations WHERE id IN"
    " (SELECT id FROM conversations WHERE owner = :owner LIMIT :batch) RETURNING id"
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
        keyring: Keyring | None = None,
    ) -> None:
        self._engine = engine
        # With a keyring (ENCRYPTION_KEYS_FILE), what users said is written sealed.
        self._keyring = keyring
        self._sql = _Statements(retention_days)
        # The statements of every turn go straight to the driver (see store/tx.py).
        dialect = engine.dialect
        self._load = Compiled(self._sql.load, dialect)
        self._create_empty = Compiled(self._sql.create_empty, dialect)
        self._fork = Compiled(self._sql.fork, dialect)
        self._fork_source = Compiled(self._sql.fork_source, dialect)
        self._fork_turns = Compiled(self._sql.fork_turns, dialect)
        self._fork_row = Compiled(self._sql.fork_row, dialect)
        self._insert_turn_at = Compiled(self._sql.insert_turn_at, dialect, list(FORK_COPY))
        self._one_statement = {
            new: Compiled(statement, dialect) for new, statement in self._sql.commit.items()
        }
        self._lease = Compiled(self._sql.lease, dialect)
        self._insert_turn = Compiled(self._sql.insert_turn, dialect, list(TURN_COLUMNS))
        self._end_run = Compiled(runs.COMMIT, dialect)
        self._exists = Compiled(self._sql.exists, dialect)
        self._describe = Compiled(self._sql.describe, dialect)
        self._retention = retention_days
        self._idempotency_ttl_s = idempotency_ttl_s
        self._events_ttl_s = events_ttl_s
        # A claimed key whose replica died is taken over after this long.
        self._idempotency_lease_s = idempotency_lease_s

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    @property
    def keyring(self) -> Keyring | None:
        return self._keyring

    async def load(
        self, conversation_id: UUID, owner: str = ANONYMOUS, *, after_revision: int = 0
    ) -> Conversation | None:
        async with driver(self._engine, write=False) as conn:
            params = {"cid": conversation_id, "caller": owner, "after": after_revision}
            rows = await conn.fetch(self._load.sql, *self._load.args(params))
        if not rows:
            return None
        first = rows[0]
        turns = await self._turns(conversation_id, owner, rows)
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
            turns=await self._turns(conversation_id, owner, rows),
            context_start=first["context_start"],
            owner=first["owner"],
            rewritten_at=first["rewritten_at"],
        )
        return LeaseAttempt(conversation, first["acquired"], busy_until)

    async def _turns(self, conversation_id: UUID, owner: str, rows: Sequence[Any]) -> list[Turn]:
        """The turns of rows read with TURN_READ (a row without one: the conversation alone)."""
        rows = [row for row in rows if row["seq"] is not None]
        key = await reading_key(self._keyring, owner, rows, TURN_FIELDS)
        return [_turn(row, conversation_id, key) for row in rows]

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
        rows = [row._mapping for row in rows]
        key = await reading_key(self._keyring, owner, rows, TURN_FIELDS)
        turns = [_transcript_turn(row, conversation_id, key) for row in rows]
        return page_of(conversation, turns, page, fetched=sum(r.seq is not None for r in sizes))

    async def append(self, append: Append) -> Commit:
        # Before the transaction: no keyring lookup inside it.
        key = await writing_key(self._keyring, append.owner)
        return await written(lambda: self._append(append, key))

    async def _append(self, append: Append, key: DataKey | None) -> Commit:
        """The commit statement (see ``_Statements.commit``); a turn that makes its fork or
        ends its run does those in the same transaction (the run's end rolls it all back if
        the run was interrupted meanwhile), a plain one is that statement alone."""
        cid, expected, run = append.conversation_id, append.expected_revision, append.run
        revision = expected + 1  # the commit's, if it happens (the turn's place for sealing)
        params = {
            **_turn_row(cid, revision, append.turn, run.run_id if run else None, key),
            "cid": cid, "expected": expected, "context_start": append.turn.context_from,
            "caller": append.owner, "holder": append.lease, "revision": 1, "metadata": None,
            "ttl_s": self._idempotency_ttl_s,
            "idem_key": append.idempotency.key if append.idempotency else None,
        }  # fmt: skip
        statement = self._one_statement[expected == 0]
        wake: list[str] = []  # topics to notify once committed
        plain = append.fork_of is None and run is None
        async with driver(self._engine, write=not plain) as conn:
            if append.fork_of is not None:
                fork = {"src": append.fork_of.source, "at": append.fork_of.revision,
                        "caller": append.owner, "new": cid}  # fmt: skip
                if await self._copy(conn, fork, key) is None:
                    raise await self._why_no_fork(conn, fork)  # the source went meanwhile
            row = await conn.fetchrow(statement.sql, *statement.args(params))
            if row is None:
                raise await self._why_not(conn, params)
            if row["lease_wanted"]:  # turns wait for the lease this commit released
                wake.append(f"lease:{cid}")
            if run is not None:
                done_event = run.done.event(run.done_seq, revision)
                events = runs.sealed_batch(key, run.run_id, [done_event])
                ended = await conn.fetchrow(self._end_run.sql, *self._end_run.args({
                    "id": run.run_id, "status": run.status, "revision": revision,
                    "seq": run.done_seq, "ttl": self._events_ttl_s, **events,
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
        return Commit(row["revision"], row["created_at"], row["updated_at"])

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
        key = await writing_key(self._keyring, owner)
        return await written(lambda: self._create_conversation(owner, metadata, turn, key))

    async def _create_conversation(
        self, owner: str, metadata: dict[str, str], turn: Turn | None, key: DataKey | None
    ) -> ConversationInfo:
        cid = uuid.uuid4()
        params = {
            "cid": cid, "caller": owner, "revision": 0 if turn is None else 1,
            "context_start": 1, **_metadata_columns(key, cid, metadata),
        }  # fmt: skip
        async with driver(self._engine, write=True) as conn:
            row = await conn.fetchrow(self._create_empty.sql, *self._create_empty.args(params))
            if turn is not None:
                new_turn = _turn_row(cid, 1, turn, None, key)
                await conn.execute(self._insert_turn.sql, *self._insert_turn.args(new_turn))
        return _info(row, key)

    async def fork(self, conversation_id: UUID, owner: str, at_revision: int) -> ConversationInfo:
        params = {"src": conversation_id, "caller": owner, "at": at_revision, "new": uuid.uuid4()}
        key = await writing_key(self._keyring, owner)

        async def fork() -> ConversationInfo:
            async with driver(self._engine, write=True) as conn:
                row = await self._copy(conn, params, key)
                if row is None:
                    raise await self._why_no_fork(conn, params)
                return _info(row, key)

        return await written(fork)

    async def _copy(self, conn: Any, fork: dict[str, Any], key: DataKey | None) -> Any:
        """Make conversation :new as :src up to revision :at; its new row, or None if :src is
        gone or not that far. In clear, one statement copies it inside the database; sealed,
        each value is opened and sealed again for its new place."""
        if key is None:
            return await conn.fetchrow(self._fork.sql, *self._fork.args(fork))
        source = await conn.fetchrow(self._fork_source.sql, *self._fork_source.args(fork))
        if source is None:
            return None
        src, new = fork["src"], fork["new"]
        metadata = get(key, metadata_place(src), source["metadata"], source["sealed_metadata"])
        row = await conn.fetchrow(self._fork_row.sql, *self._fork_row.args({
            **fork, "context_start": source["context_from"] or 1,
            **_metadata_columns(key, new, _METADATA.decode(metadata) if metadata else {}),
        }))  # fmt: skip
        turns = await conn.fetch(self._fork_turns.sql, *self._fork_turns.args(fork))
        copies = [
            _turn_row(new, r["seq"], _turn(r, src, key), None, key)
            | {"created_at": r["turn_created_at"]}
            for r in turns
        ]
        await conn.executemany(
            self._insert_turn_at.sql, [self._insert_turn_at.args(copy) for copy in copies]
        )
        return row

    async def _why_no_fork(self, conn: Any, params: dict[str, Any]) -> Exception:
        exists = await conn.fetchrow(self._describe.sql, *self._describe.args(
            {"cid": params["src"], **params}
        ))  # fmt: skip
        if exists is None:
            return ConversationNotFound()
        if self._keyring is None and await conn.fetchval(_SEALED_SOURCE, params["src"]):
            log.error("a fork of an encrypted conversation needs ENCRYPTION_KEYS_FILE")
            return StorageError("The conversation is encrypted and the keys are not available.")
        return InvalidInput("at_revision must be a revision of the conversation.")

    async def pop_item(
        self,
        conversation_id: UUID,
        owner: str,
        rewrite: Callable[[Turn], Turn],
        if_match: Precondition = None,
    ) -> tuple[ConversationInfo, msgspec.Raw]:
        params = {"cid": conversation_id, "caller": owner}
        key = await writing_key(self._keyring, owner)

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
                rows = [row] if row is not None else []
                opening = key or await reading_key(self._keyring, owner, rows, TURN_FIELDS)
                last_turn = _turn(row, conversation_id, opening) if row else None
                if row is None or last_turn is None or not last_turn.replay_items:
                    raise InvalidInput("The conversation has no item to remove.", param="item_id")
                rewritten = rewrite(last_turn)
                await conn.execute(self._sql.delete_turn, last)
                new = _turn_row(conversation_id, revision + 1, rewritten, row["turn_id"], key)
                await conn.execute(
                    self._sql.insert_turn_at, {**new, "created_at": row["turn_created_at"]}
                )
                done = (await conn.execute(self._sql.rewritten, params)).mappings().one()
                return await self._info_of(done, owner), last_turn.replay_items[-1]

        return await written(pop)

    async def describe(self, conversation_id: UUID, owner: str) -> ConversationInfo | None:
        async with read(self._engine) as conn:
            params = {"cid": conversation_id, "caller": owner}
            row = (await conn.execute(self._sql.describe, params)).mappings().first()
        return None if row is None else await self._info_of(row, owner)

    async def update_metadata(
        self,
        conversation_id: UUID,
        owner: str,
        metadata: dict[str, str],
        if_match: Precondition = None,
    ) -> ConversationInfo:
        key = await writing_key(self._keyring, owner)
        params = {
            "cid": conversation_id,
            "caller": owner,
            **_metadata_columns(key, conversation_id, metadata),
        }

        async def update() -> ConversationInfo:
            async with transaction(self._engine) as conn:
                row = (await conn.execute(self._sql.set_metadata, params)).mappings().first()
                if row is None:
                    raise ConversationNotFound()
                if if_match is not None and row["revision"] not in if_match:
                    raise PreconditionFailed()  # rolls the update back
                return _info(row, key)

        return await written(update)

    async def _info_of(self, row: Any, owner: str) -> ConversationInfo:
        return _info(row, await reading_key(self._keyring, owner, [row], ["metadata"]))

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
        data_key = await writing_key(self._keyring, key.owner)
        return await written(lambda: self._claim(key, turn_id, data_key))

    async def _claim(
        self, key: IdempotencyKey, turn_id: UUID | None, data_key: DataKey | None
    ) -> Committed | None:
        params = idem.key_params(key, data_key)
        async with transaction(self._engine) as conn:
            claimed = await conn.scalar(
                idem.CLAIM,
                {**params, "lease_s": self._idempotency_lease_s, "claimed_turn": turn_id},
            )
            if claimed is not None:
                return None
            row = (await conn.execute(idem.EXISTING, params)).one()
        return idem.answer(row, key, data_key)

    async def check(self, key: IdempotencyKey) -> None:
        async with read(self._engine) as conn:
            row = (await conn.execute(idem.LIVE, idem.key_params(key))).first()
        if row is not None:
            data_key = None if self._keyring is None else await self._keyring.for_read(key.owner)
            idem.answer(row, key, data_key)

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

    async def owner_has_sealed_rows(self, owner: str) -> bool:
        async with read(self._engine) as conn:
            return bool(await conn.scalar(_OWNER_SEALED, {"owner": owner}))

    async def delete_owner(self, owner: str, batch: int = 500) -> int:
        """Delete all of ``owner``'s conversations (with their turns, runs and events) and
        Idempotency-Key records, a batch per transaction; the number of conversations."""
        total = 0
        while True:
            async with transaction(self._engine) as conn:
                result = await conn.execute(_OWNED, {"owner": owner, "batch": batch})
                gone = list(result.scalars())
                await conn.execute(runs.DELETE_OF, {"cids": gone})
            total += len(gone)
            if len(gone) < batch:
                break
        async with transaction(self._engine) as conn:
            await conn.execute(runs.DELETE_OWNED, {"owner": owner})
            await conn.execute(idem.DELETE_OWNED, {"owner": owner})
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
        keyring = self._keyring is None or await self._keyring.ready()
        return Readiness(None if version is None else str(version), state.writable, keyring)

    def pool_in_use(self) -> int:
        return self._engine.sync_engine.pool.checkedout()  # type: ignore[attr-defined,no-any-return]

    async def close(self) -> None:
        await self._engine.dispose()


SEALED_COLUMNS = tuple(f"sealed_{name}" for name in TURN_FIELDS)
FORKED_COLUMNS = (
    "seq", "user_message", "assistant_message", "replay_items", "created_at", "provider",
    "endpoint", "model", "context_from", "prompt_version", "tool_calls", "status",
    "incomplete_reason",
)  # fmt: skip
TURN_COLUMNS = (
    "conversation_id", "seq", "user_message", "assistant_message", "replay_items",
    "provider", "endpoint", "model", "context_from", "prompt_version", "tool_calls",
    "status", "incomplete_reason", "turn_id", *SEALED_COLUMNS,
)  # fmt: skip
FORK_COPY = (*TURN_COLUMNS, "created_at")
_SEALED_SOURCE = (
    "SELECT EXISTS (SELECT 1 FROM conversations WHERE id = $1 AND sealed_metadata IS NOT NULL)"
    " OR EXISTS (SELECT 1 FROM turns WHERE conversation_id = $1"
    " AND sealed_replay_items IS NOT NULL)"
)


def _field(row: Any, key: DataKey | None, cid: UUID, name: str) -> Any:
    """A turn's field from a row read with its clear and sealed columns."""
    return get(key, turn_place(cid, row["seq"], name), row[name], row[f"sealed_{name}"])


_TRANSCRIPT = ("user_message", "assistant_message", "tool_calls")
_REQUIRED = ("user_message", "assistant_message", "replay_items")


def _transcript_turn(row: Any, cid: UUID, key: DataKey | None) -> TranscriptTurn:
    check_row(row, _TRANSCRIPT, _REQUIRED[:2], turn_place(cid, row["seq"], "*"))
    calls = _field(row, key, cid, "tool_calls")
    return TranscriptTurn(
        number=row["seq"],
        user_message=_field(row, key, cid, "user_message"),
        assistant_message=_field(row, key, cid, "assistant_message"),
        context_from=row["context_from"] or 1,
        prompt_version=row["prompt_version"],
        tool_calls=_CALLS.decode(calls) if calls else (),
    )


def _metadata_columns(key: DataKey | None, cid: UUID, metadata: dict[str, str]) -> dict[str, Any]:
    clear, sealed = put(key, metadata_place(cid), _JSON.encode(metadata).decode())
    return {"metadata": clear, "sealed_metadata": sealed}


def _info(row: Any, key: DataKey | None) -> ConversationInfo:
    metadata = get(key, metadata_place(row["id"]), row["metadata"], row["sealed_metadata"])
    return ConversationInfo(
        id=row["id"],
        revision=row["revision"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        metadata=_METADATA.decode(metadata) if metadata else {},
    )


def _turn(row: Any, cid: UUID, key: DataKey | None) -> Turn:
    check_row(row, TURN_FIELDS, _REQUIRED, turn_place(cid, row["seq"], "*"))
    calls = _field(row, key, cid, "tool_calls")
    return Turn(
        user_message=_field(row, key, cid, "user_message"),
        assistant_message=_field(row, key, cid, "assistant_message"),
        replay_items=_ITEMS.decode(_field(row, key, cid, "replay_items")),
        origin=Origin(row["provider"], row["endpoint"], row["model"]) if row["provider"] else None,
        context_from=row["context_from"] or 1,
        prompt_version=row["prompt_version"],
        tool_calls=_CALLS.decode(calls) if calls else (),
        status=row["status"],
        incomplete_reason=row["incomplete_reason"],
        created_at=row["turn_created_at"],
    )


def _turn_row(
    conversation_id: UUID, seq: int, turn: Turn, turn_id: UUID | None, key: DataKey | None
) -> dict[str, object]:
    encrypted = {
        "user_message": turn.user_message,
        "assistant_message": turn.assistant_message,
        "replay_items": msgspec.json.encode(turn.replay_items).decode(),
        "tool_calls": msgspec.json.encode(turn.tool_calls).decode() if turn.tool_calls else None,
    }
    return {
        "turn_id": turn_id,
        "conversation_id": conversation_id,
        "seq": seq,
        **sealed_turn_columns(key, conversation_id, seq, encrypted),
        "provider": turn.origin.provider if turn.origin else None,
        "endpoint": turn.origin.endpoint if turn.origin else None,
        "model": turn.origin.model if turn.origin else None,
        "context_from": turn.context_from,
        "prompt_version": turn.prompt_version,
        "status": turn.status,
        "incomplete_reason": turn.incomplete_reason,
    }
