"""A fork in PostgreSQL, wherever it is made: by Edits.fork, by the commit of a turn that makes
it (History.append with ``Append.fork_of``), and its place among its owner's forks of the
minute (OWNER_MAX_FORKS_PER_MINUTE, Places.take_fork)."""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime, timedelta

import asyncpg

from service.core.errors import (
    ConversationNotFound,
    InvalidInput,
    OwnerShredded,
    StorageError,
    TooManyRequests,
)
from service.core.sizes import held_bytes
from service.platform.crypto import DataKey
from service.store.postgres.adapter import Adapter
from service.store.postgres.rows import Rows
from service.store.postgres.terms import Terms
from service.store.postgres.tx import Params

log = logging.getLogger("turnstore.store")
FORK_WINDOW = timedelta(minutes=1)  # OWNER_MAX_FORKS_PER_MINUTE's


async def copy(
    db: Adapter,
    conn: asyncpg.Connection,
    fork: Params,
    key: DataKey | None,
    *,
    counted: bool = True,
) -> asyncpg.Record | None:
    """Make conversation :new as :src up to revision :at; its new row, or None if :src is
    gone or not that far. In clear, one statement copies it inside the database; sealed,
    each value is opened and sealed again for its new place. TooManyRequests past
    OWNER_MAX_FORKS_PER_MINUTE (``counted``: the fork's place among them is taken here;
    a turn's fork took it before its provider call, Places.take_fork)."""
    most = db.config.forks_per_minute
    if most is not None and counted:
        await take_slot(db, conn, fork, most)
    if key is None:
        row = await db.sql.fork.fetchrow(conn, fork)
        if row is not None:
            metadata = Rows(None, fork["new"]).metadata(row)
            await Terms(db, conn, fork["new"], None).rebuild((), metadata)
        return row
    source = await db.sql.fork_source.fetchrow(conn, fork)
    if source is None:
        return None
    old, new = Rows(key, fork["src"]), Rows(key, fork["new"])
    turns = [(row, old.turn(row)) for row in await db.sql.fork_turns.fetch(conn, fork)]
    row = await db.sql.new_conversation.fetchrow(
        conn,
        {
            "cid": new.conversation_id,
            "revision": fork["at"],
            "caller": fork["caller"],
            "context_start": source["context_from"] or 1,
            "expires_at": source["expires_at"],
            **new.metadata_columns(old.metadata(source)),
            "stored_bytes": held_bytes(turn for _, turn in turns),
            "forked_from": fork["src"],
        },
    )
    if row is None:  # the owner was shredded (see why_not)
        return None
    copies = [
        new.turn_columns(found["seq"], turn, None) | {"created_at": found["turn_created_at"]}
        for found, turn in turns
    ]
    await db.sql.turn_move.executemany(conn, copies)
    metadata = old.metadata(source)
    await Terms(db, conn, fork["new"], key).rebuild((turn for _, turn in turns), metadata)
    return row


async def take_slot(db: Adapter, conn: asyncpg.Connection, fork: Params, most: int) -> None:
    """This fork counted against its owner's last minute (statements.FORK_SLOT), or
    TooManyRequests with the seconds until the oldest of them leaves the minute."""
    now = datetime.now(UTC)
    await db.sql.fork_turnstile.execute(conn, {"caller": fork["caller"]})
    slot = await db.sql.fork_slot.fetchrow(
        conn,
        {
            "caller": fork["caller"],
            "new": fork["new"],
            "now": now,
            "since": now - FORK_WINDOW,
            "max": most,
        },
    )
    assert slot is not None  # the statement answers one row
    if not slot["made"]:
        wait = slot["oldest"] + FORK_WINDOW - now if slot["oldest"] else FORK_WINDOW
        raise TooManyRequests(
            f"At most {most} forks a minute (OWNER_MAX_FORKS_PER_MINUTE).",
            retry_after=str(max(1, math.ceil(wait.total_seconds()))),
        )


async def why_not(db: Adapter, conn: asyncpg.Connection, fork: Params) -> Exception:
    """Why ``copy`` made nothing."""
    if await db.sql.describe.fetchrow(conn, {"cid": fork["src"], **fork}) is None:
        return ConversationNotFound()
    if await db.sql.shredded.fetchval(conn, fork):
        return OwnerShredded()
    if db.keyring is None and await db.sql.sealed_source.fetchval(conn, fork):
        log.error("a fork of an encrypted conversation needs ENCRYPTION_KEYS_FILE")
        return StorageError("The conversation is encrypted and the keys are not available.")
    return InvalidInput("at_revision must be a revision of the conversation.")
