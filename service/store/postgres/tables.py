"""Table definitions used by the queries (migrations own the DDL)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

metadata = sa.MetaData()


class RawJSON(sa.types.TypeDecorator[str]):
    """A ``json`` column passed through as text: PostgreSQL's ``json`` keeps the bytes it was
    given, and turnstore never decodes replay items, so no (de)serialisation happens here."""

    impl = postgresql.JSON
    cache_ok = True

    def bind_processor(self, dialect: sa.Dialect) -> None:
        return None

    def result_processor(self, dialect: sa.Dialect, coltype: Any) -> None:
        return None


conversations = sa.Table(
    "conversations",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("context_start", sa.Integer, nullable=False),
    sa.Column("owner", sa.Text, nullable=False),
    # The turn lease (service/leases.py): the running turn, until when, and whether a turn
    # is queued for it.
    sa.Column("lease_holder", sa.Uuid),
    sa.Column("lease_expires_at", sa.DateTime(timezone=True)),
    sa.Column("lease_wanted", sa.Boolean, nullable=False),
    sa.Column("rewritten_at", sa.Integer, nullable=False),  # history before it changed then
    sa.Column("metadata", RawJSON),  # the OpenAI surface's string pairs: no part of the history
    sa.Column("sealed_metadata", sa.LargeBinary),  # encrypted instead (service/store/sealed.py)
)

# One row per committed turn: the transcript pair and that turn's replay items, keyed by
# (conversation_id, seq) where seq is the revision the turn created.
turns = sa.Table(
    "turns",
    metadata,
    sa.Column("conversation_id", sa.Uuid, primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    # Each of these four in clear or, encrypted, in its sealed_ column (service/store/sealed.py).
    sa.Column("user_message", sa.Text),
    sa.Column("assistant_message", sa.Text),
    sa.Column("replay_items", RawJSON),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("provider", sa.Text),
    sa.Column("endpoint", sa.Text),
    sa.Column("model", sa.Text),
    sa.Column("context_from", sa.Integer),
    sa.Column("prompt_version", sa.Text),
    sa.Column("tool_calls", RawJSON),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("incomplete_reason", sa.Text),
    sa.Column("turn_id", sa.Uuid),  # the run of a streamed or background turn
    sa.Column("sealed_user_message", sa.LargeBinary),
    sa.Column("sealed_assistant_message", sa.LargeBinary),
    sa.Column("sealed_replay_items", sa.LargeBinary),
    sa.Column("sealed_tool_calls", sa.LargeBinary),
)

idempotency_keys = sa.Table(
    "idempotency_keys",
    metadata,
    sa.Column("owner", sa.Text, primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("request_hash", sa.Text, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    # A done key names the commit it made (deleted with that conversation).
    sa.Column("conversation_id", sa.Uuid),
    sa.Column("revision", sa.Integer),
    sa.Column("turn_id", sa.Uuid),  # a background turn's run, answered to its retries
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
)

# Durable turns (service/runs.py): a run per streamed or background turn, and its events.
turn_runs = sa.Table(
    "turn_runs",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("conversation_id", sa.Uuid, nullable=False),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("background", sa.Boolean, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("revision", sa.Integer),
    sa.Column("error_code", sa.Text),
    sa.Column("error_message", sa.Text),
    sa.Column("cancel_requested", sa.Boolean, nullable=False),
    sa.Column("watched", sa.Boolean, nullable=False),
    sa.Column("last_event", sa.Integer, nullable=False),
    sa.Column("heartbeat_until", sa.DateTime(timezone=True), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("finished_at", sa.DateTime(timezone=True)),
    sa.Column("expires_at", sa.DateTime(timezone=True)),
)
turn_events = sa.Table(
    "turn_events",
    metadata,
    sa.Column("turn_id", sa.Uuid, primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),  # of the batch's last event
    sa.Column("events", RawJSON),  # [[seq, name, data], ...]
    sa.Column("sealed_events", sa.LargeBinary),  # the same, encrypted
)

# API keys (AUTH_MODE=api_key): only the SHA-256 of a key is stored.
api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("key_hash", sa.Text, primary_key=True),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True)),
)
