"""conversations: what finds them (search terms, the fork they came from) and the indexes that
serve the listing's filters

- ``search`` (tsvector, stripped: lexemes without positions): what ``q``, ``model`` and
  ``metadata[KEY]`` filters match, under one GIN index. Its lexemes are the transcript's words
  as ``to_tsvector('simple', ...)`` makes them (in clear), and terms that start with ``_``
  (which the parser never makes): ``_w`` + a keyed digest of a word (under encryption at rest,
  by the owner's data key: nothing here reveals a word, and a shred makes them unmatchable),
  ``_m`` + a digest of a metadata pair (keyed under encryption), ``_o`` + a digest of a model
  a turn used. NULL: not computed yet (a row this migration's backfill has not reached).
- ``forked_from``: the conversation a fork was made from (NULL: none, or made before this).
- indexes: ``conversations_search`` (GIN on ``search``) and ``conversations_owner_updated``
  (the ``updated_after`` / ``updated_before`` filters and the usage totals' range), built
  concurrently; ``created_*`` are served by ``conversations_owner_created``.

The backfill computes ``search`` of rows in clear from their turns and metadata, a batch of
conversations at a time outside the schema change (a sealed row gets its model terms only: its
words and metadata are sealed, and the next write of the release adds its own terms).

Expand only: nullable columns without defaults, no rewrite; the release before this one never
reads them. (Its turns add no terms: a turn the old release commits during a rolling upgrade
is found by the words of the turns around it only.)

NOTE for the merge: written as 0020 on 0019; the lead renumbers it on top of 0020
(``kind``, ``key_fingerprint``).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from collections.abc import Sequence

from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen: the text this migration runs (migrations/__init__.py). A term's digest in clear is
# sha256 of its kind, a colon and its value, hex, cut to 32 digits, after "_" and the kind
# (service/core/search.py computes the same).
TERM = (
    "'_' || {kind} || left(encode(sha256(convert_to({kind} || ':' || {value}, 'UTF8')), 'hex'), 32)"
)
WORDS = """strip(to_tsvector('simple', coalesce((
    SELECT string_agg(concat_ws(' ', t.user_message, t.assistant_message, (
        SELECT string_agg(e.value ->> 1, ' ') FROM json_array_elements(t.transcript) AS e
    )), ' ')
    FROM turns t WHERE t.conversation_id = c.id AND t.sealed_user_message IS NULL
), '')))"""
MODELS = (
    "array_to_tsvector(coalesce((SELECT array_agg(DISTINCT "
    + TERM.format(kind="'o'", value="t.model")
    + ") FROM turns t WHERE t.conversation_id = c.id AND t.model IS NOT NULL), '{}'))"
)
PAIRS = (
    "array_to_tsvector(coalesce((SELECT array_agg("
    + TERM.format(kind="'m'", value="json_build_array(p.key, p.value)::text")
    + ") FROM json_each_text(c.metadata) AS p), '{}'))"
)
BACKFILL = f"""
    UPDATE conversations AS c SET search = {WORDS} || {MODELS} || {PAIRS}
    WHERE c.id IN (SELECT id FROM conversations WHERE search IS NULL LIMIT :batch)
"""


def upgrade() -> None:
    live.add_column_alone(op, "conversations", "search", "tsvector")
    live.add_column_alone(op, "conversations", "forked_from", "uuid")
    live.create_index_concurrently(
        op, "conversations_search", "conversations USING gin", "search", where=""
    )
    live.create_index_concurrently(
        op, "conversations_owner_updated", "conversations", "owner, updated_at DESC, id DESC"
    )
    live.backfill(op, BACKFILL, batch=500)


def downgrade() -> None:
    live.drop_index_concurrently(op, "conversations_owner_updated")
    live.drop_index_concurrently(op, "conversations_search")
    op.drop_column("conversations", "forked_from")
    op.drop_column("conversations", "search")


def losses(connection: Connection) -> dict[str, int]:
    """The forks' sources (``forked_from``): the search terms are computed again from the
    turns by the next upgrade (those of sealed rows by their next writes)."""
    return live.nonzero(
        {
            "conversations.forked_from": live.count(
                connection, "conversations", "forked_from IS NOT NULL"
            )
        }
    )
