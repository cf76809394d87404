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

``turnstore_commit_v3()``, which this release calls: 0019's ``turnstore_commit_v2()`` with the
turn's ``kind`` and ``key_fingerprint`` (0020's columns) and the turn's search terms
(``p_search_text``, words in clear for ``to_tsvector('simple', ...)``; ``p_search_terms``, the
terms made in the process: keyed words, models, metadata pairs) added to the conversation's
``search`` in the same statement, so a plain turn's commit stays one statement (one round
trip; on Citus one worker). On Citus (conversations distributed already) it is distributed
here, by ``p_cid`` with ``conversations`` as v2 is, so that this release's first commits run
on their conversation's worker before ``db distribute`` runs again.

Expand only: nullable columns without defaults, no rewrite, a new function; the release
before this one never reads them. (Its turns add no terms: a turn the old release commits
during a rolling upgrade is found by the words of the turns around it only.)

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07
"""

from collections.abc import Sequence

from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen: the text this migration runs (migrations/__init__.py). A term's digest in clear is
# sha256 of its kind, a colon and its value, hex, cut to 32 digits, after "_" and the kind
# (service/core/search.py computes the same). Citus refuses an UPDATE of a distributed table
# that calls a STABLE function on a column (convert_to, json_build_array, concat_ws are), so
# the backfill calls these, declared IMMUTABLE (they are, for the database's one encoding),
# made for it and dropped after it (PL/pgSQL: never inlined back into what they call).
HELPERS = {
    "turnstore_0021_term(text, text)": """(p_kind text, p_value text) RETURNS text
        LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN RETURN '_' || p_kind
            || left(encode(sha256(convert_to(p_kind || ':' || p_value, 'UTF8')), 'hex'), 32);
        END $$""",
    "turnstore_0021_pair(text, text)": """(p_key text, p_value text) RETURNS text
        LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN
            RETURN turnstore_0021_term('m', json_build_array(p_key, p_value)::text);
        END $$""",
    "turnstore_0021_said(text, text, json)": """(p_user text, p_assistant text,
        p_transcript json) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN
            RETURN concat_ws(' ', p_user, p_assistant, (
                SELECT string_agg(e.value ->> 1, ' ') FROM json_array_elements(p_transcript) e
            ));
        END $$""",
}
WORDS = """strip(to_tsvector('simple', coalesce((
    SELECT string_agg(turnstore_0021_said(t.user_message, t.assistant_message, t.transcript), ' ')
    FROM turns t WHERE t.conversation_id = c.id AND t.sealed_user_message IS NULL
), '')))"""
MODELS = """array_to_tsvector(coalesce((
    SELECT array_agg(DISTINCT turnstore_0021_term('o', t.model)) FROM turns t
    WHERE t.conversation_id = c.id AND t.model IS NOT NULL
), '{}'))"""
PAIRS = """array_to_tsvector(coalesce((
    SELECT array_agg(turnstore_0021_pair(p.key, p.value)) FROM json_each_text(c.metadata) AS p
), '{}'))"""
BACKFILL = f"""
    UPDATE conversations AS c SET search = {WORDS} || {MODELS} || {PAIRS}
    WHERE c.id IN (SELECT id FROM conversations WHERE search IS NULL LIMIT :batch)
"""


# 0019's refusal of a shredded owner's write (``{owner}``: the argument naming the owner).
REFUSAL = """IF EXISTS (SELECT 1 FROM owner_tombstones WHERE owner_tombstones.digest = \
sha256((SELECT secret FROM turnstore_secrets WHERE name = 'owners')
    || convert_to(CAST({owner} AS text), 'UTF8'))) THEN
        RAISE EXCEPTION 'the owner was shredded' USING ERRCODE = 'TSSHR';
    END IF;"""
# turnstore_commit_v3(), which this release calls (the module's docstring): 0019's v2 with the
# turn's kind and key fingerprint (0020's columns) and the conversation's search terms.
COMMIT_V3 = """
CREATE FUNCTION turnstore_commit_v3(p_cid uuid, p_expected integer, p_caller text, p_holder uuid, \
p_context_start integer, p_expires_at timestamptz, p_idle_s double precision, p_stored_bytes \
bigint, p_user_message text, p_assistant_message text, p_replay_items json, p_provider text, \
p_endpoint text, p_model text, p_context_from integer, p_prompt_version text, p_tool_calls json, \
p_status text, p_incomplete_reason text, p_turn_id uuid, p_sealed_user_message bytea, \
p_sealed_assistant_message bytea, p_sealed_replay_items bytea, p_sealed_tool_calls bytea, p_usage \
json, p_transcript json, p_sealed_transcript bytea, p_response json, p_sealed_response bytea, \
p_compacted json, p_sealed_compacted bytea, p_items_bytes integer, p_opaque_bytes integer, \
p_turn_bytes bigint, p_idem_key text, p_ttl_s double precision, p_claim uuid, p_kind text, \
p_key_fingerprint text, p_search_text text, p_search_terms text[],
    OUT revision integer, OUT created_at timestamptz, OUT updated_at timestamptz,
    OUT lease_wanted boolean)
RETURNS SETOF record LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := now();
    v_cutoff timestamptz := v_now - make_interval(secs => p_idle_s);
    v_head record;
    v_search tsvector := strip(to_tsvector('simple', coalesce(p_search_text, '')))
        || array_to_tsvector(coalesce(p_search_terms, '{}'));
BEGIN
    {refusal}
    IF p_expected = 0 THEN
        INSERT INTO conversations AS c (
            id, revision, created_at, updated_at, context_start, owner, lease_wanted,
            expires_at, counted_bytes, counted_revision, search
        ) VALUES (
            p_cid, 1, v_now, v_now, p_context_start, p_caller, false, p_expires_at,
            p_stored_bytes, CASE WHEN p_stored_bytes IS NOT NULL THEN 1 END, v_search
        )
        ON CONFLICT (id) DO UPDATE SET
            revision = 1, updated_at = v_now, context_start = excluded.context_start,
            lease_holder = NULL, lease_expires_at = NULL, counted_bytes = excluded.counted_bytes,
            counted_revision = excluded.counted_revision,
            search = coalesce(c.search, ''::tsvector) || excluded.search
        WHERE c.revision = 0 AND c.owner = p_caller AND \n\
    (c.expires_at IS NULL OR c.expires_at > v_now)
    AND (v_cutoff IS NULL OR c.updated_at > v_cutoff)
    AND (c.lease_holder IS NULL OR c.lease_expires_at <= v_now OR c.lease_holder = p_holder)

        RETURNING c.revision, c.created_at, c.updated_at, c.lease_wanted INTO v_head;
    ELSE
        UPDATE conversations AS c SET
            revision = c.revision + 1,
            updated_at = v_now,
            context_start = greatest(c.context_start, p_context_start),
            lease_holder = NULL,
            lease_expires_at = NULL,
            expires_at = CASE WHEN c.expires_at IS NOT NULL THEN p_expires_at END,
            counted_bytes = p_stored_bytes,
            counted_revision = CASE WHEN p_stored_bytes IS NOT NULL THEN c.revision + 1 END,
            search = coalesce(c.search, ''::tsvector) || v_search
        WHERE c.id = p_cid AND c.revision = p_expected AND c.owner = p_caller
            AND \n\
    (c.expires_at IS NULL OR c.expires_at > v_now)
    AND (v_cutoff IS NULL OR c.updated_at > v_cutoff)
    AND (c.lease_holder IS NULL OR c.lease_expires_at <= v_now OR c.lease_holder = p_holder)

        RETURNING c.revision, c.created_at, c.updated_at, c.lease_wanted INTO v_head;
    END IF;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO turns (conversation_id, seq, created_at, user_message, assistant_message, \
replay_items, provider, endpoint, model, context_from, prompt_version, tool_calls, status, \
incomplete_reason, turn_id, sealed_user_message, sealed_assistant_message, sealed_replay_items, \
sealed_tool_calls, usage, transcript, sealed_transcript, response, sealed_response, compacted, \
sealed_compacted, items_bytes, opaque_bytes, turn_bytes, kind, key_fingerprint)
    VALUES (p_cid, v_head.revision, v_now, p_user_message, p_assistant_message, p_replay_items, \
p_provider, p_endpoint, p_model, p_context_from, p_prompt_version, p_tool_calls, p_status, \
p_incomplete_reason, p_turn_id, p_sealed_user_message, p_sealed_assistant_message, \
p_sealed_replay_items, p_sealed_tool_calls, p_usage, p_transcript, p_sealed_transcript, \
p_response, p_sealed_response, p_compacted, p_sealed_compacted, p_items_bytes, p_opaque_bytes, \
p_turn_bytes, p_kind, p_key_fingerprint);
    IF p_idem_key IS NOT NULL THEN
        UPDATE idempotency_keys AS k SET
            state = 'done', conversation_id = p_cid, revision = v_head.revision,
            expires_at = v_now + make_interval(secs => p_ttl_s)
        WHERE k.owner = p_caller AND k.key = p_idem_key AND k.state = 'running' AND k.claim_id = \
p_claim;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'the claim of this Idempotency-Key was lost' USING ERRCODE = 'TSKEY';
        END IF;
    END IF;
    revision := v_head.revision;
    created_at := v_head.created_at;
    updated_at := v_head.updated_at;
    lease_wanted := v_head.lease_wanted;
    RETURN NEXT;
END
$$
"""
SIGNATURE_V3 = (
    "uuid, integer, text, uuid, integer, timestamptz, double precision, bigint, text, text, "
    "json, text, text, text, integer, text, json, text, text, uuid, bytea, bytea, bytea, bytea, "
    "json, json, bytea, json, bytea, json, bytea, integer, integer, bigint, text, "
    "double precision, uuid, text, text, text, text[]"
)


def upgrade() -> None:
    live.add_column_alone(op, "conversations", "search", "tsvector")
    live.add_column_alone(op, "conversations", "forked_from", "uuid")
    live.create_index_concurrently(
        op, "conversations_search", "conversations USING gin", "search", where=""
    )
    live.create_index_concurrently(
        op, "conversations_owner_updated", "conversations", "owner, updated_at DESC, id DESC"
    )
    for signature, definition in HELPERS.items():
        op.execute(f"CREATE OR REPLACE FUNCTION {signature.split('(')[0]}{definition}")
    live.backfill(op, BACKFILL, batch=500)
    for signature in reversed(HELPERS):
        op.execute(f"DROP FUNCTION {signature}")
    op.execute(COMMIT_V3.replace("{refusal}", REFUSAL.replace("{owner}", "p_caller")))
    if live.distributed(op.get_bind()):
        op.execute(
            "SELECT create_distributed_function("
            f"'turnstore_commit_v3({SIGNATURE_V3})', 'p_cid', colocate_with := 'conversations')"
        )


def downgrade() -> None:
    op.execute(f"DROP FUNCTION turnstore_commit_v3({SIGNATURE_V3})")
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
