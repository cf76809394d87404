"""The statements about conversations and turns, as the PostgreSQL adapter runs them.

Every statement about a conversation names it by its id (the future shard key, see
tests/system/test_scale_out.py) and, where it reads or writes one the client names, checks its owner
and keeps to the living: ``{live}`` stands for the retention filter, filled in once per store
by ``Statements`` (RETENTION_DAYS: a conversation idle for longer is gone at once for every
reader and writer, before ``turnstore purge`` deletes it).

So the statements here are templates, compiled per store; fragments (TURN, INFO, ...) are
pieces of them. The statements of runs, Idempotency-Keys, keys and the keyring depend on no
setting and are compiled where they are written.
"""

from __future__ import annotations

from migrations.commit_function import (
    COMMIT_RECEIPT,
    COMMIT_RUN,
    COMMIT_RUN_RECEIPT,
    COMMIT_V3,
    shredded,
)
from service.platform.crypto import OVERHEAD
from service.store.postgres.tx import Compiled, sql

LIVE = "{live}"  # the retention filter (see Statements)

# Lease writes do not wait for a synchronous standby (nor for their own WAL flush): a lease
# lost in a crash or failover costs a wait at most (the revision guards the data), while
# waiting would double the replication latency of every turn.
NO_SYNC_WAIT = "set_config('synchronous_commit', 'off', true)"
CHANNEL = "turnstore"  # the one NOTIFY channel; payloads are topics, "lease:<conversation>"

# A turn as read back: its place, its fields (in clear or sealed) and where it came from.
TURN = """
    turns.seq, turns.user_message, turns.assistant_message, turns.replay_items,
    turns.tool_calls, turns.sealed_user_message, turns.sealed_assistant_message,
    turns.sealed_replay_items, turns.sealed_tool_calls, turns.provider, turns.endpoint,
    turns.model, turns.context_from, turns.prompt_version, turns.status,
    turns.incomplete_reason, turns.created_at AS turn_created_at, turns.usage,
    turns.transcript, turns.sealed_transcript, turns.response, turns.sealed_response,
    turns.response_deleted, turns.turn_id, turns.compacted, turns.sealed_compacted,
    turns.kind, turns.key_fingerprint
"""
# The same without what its /v1 Response echoes (read only when the response is retrieved):
# what a turn reads of its window, and a history cache keeps, holds no echo of any request.
WINDOW_TURN = TURN.replace(
    "turns.response, turns.sealed_response",
    "NULL::json AS response, NULL::bytea AS sealed_response",
)
# A turn as written: the conversation_id, seq and created_at, then these (its sizes last).
TURN_VALUES = """
    user_message, assistant_message, replay_items, provider, endpoint, model, context_from,
    prompt_version, tool_calls, status, incomplete_reason, turn_id, sealed_user_message,
    sealed_assistant_message, sealed_replay_items, sealed_tool_calls, usage, transcript,
    sealed_transcript, response, sealed_response, compacted, sealed_compacted, items_bytes,
    opaque_bytes, turn_bytes, kind, key_fingerprint
"""
# The conversation's size as this release counts it (migration 0019: counted_bytes and the
# revision it counts up to; the older stored_bytes counted items alone, and is not read).
SIZE = """
    conversations.counted_bytes AS stored_bytes, conversations.counted_revision AS stored_revision
"""
INFO = f"""
    conversations.id, conversations.revision, conversations.created_at,
    conversations.updated_at, conversations.metadata, conversations.sealed_metadata,
    conversations.expires_at, {SIZE}, conversations.rewritten_at, conversations.context_start,
    conversations.forked_from
"""
HEAD = f"""
    conversations.revision, conversations.created_at, conversations.updated_at,
    conversations.context_start, conversations.owner, {SIZE}
"""
THE_CONVERSATION = f"conversations.id = :cid AND conversations.owner = :caller AND {LIVE}"
# The caller was shredded (migration 0019): what would be made for them is not.
SHREDDED = shredded(":caller")

# Only the turns after :after (0: all); the conversation row comes back even when none is
# newer, so a cache can revalidate with one query. The owner is checked before any turn is
# read: another owner's id costs as little as an unknown one.
LOAD = f"""
    SELECT {HEAD}, conversations.rewritten_at, {WINDOW_TURN}
    FROM conversations LEFT JOIN turns
        ON turns.conversation_id = conversations.id AND turns.seq > :after
    WHERE {THE_CONVERSATION}
    ORDER BY turns.seq
"""


# What a turn reads of its window: the turns after {low}, but none before the turn whose
# later turns' items already reach :window_bytes (the bytes a turn may send,
# CONTEXT_MAX_REQUEST_BYTES; NULL: no bound). Each turn's items are measured as a request to
# :provider, :endpoint, :model carries them, by the sizes stored with it (migration 0019:
# its opaque items are left out of a request to another origin, core/window.py), so the
# measure reads none of them; a turn written before its sizes were is measured by its
# items' text (its brackets less: never more than what it adds to a request; one of another
# origin as nothing, which reads more rather than leave out what it would send). Items
# appended since the last turn moved the window start are then read only as far back as a
# request could carry them.
def window_cut(low: str) -> str:
    other = """(turns.provider IS NOT NULL AND (turns.provider, turns.endpoint, turns.model)
        IS DISTINCT FROM (:provider, :endpoint, :model))"""
    size = f"""coalesce(
        turns.items_bytes - CASE WHEN {other} THEN turns.opaque_bytes ELSE 0 END,
        CASE WHEN {other} THEN 0 ELSE
            coalesce(octet_length(CAST(turns.replay_items AS text)) - 2,
                     octet_length(turns.sealed_replay_items) - {OVERHEAD} - 2, 0)
            + coalesce(octet_length(CAST(turns.compacted AS text)) - 2,
                       octet_length(turns.sealed_compacted) - {OVERHEAD} - 2, 0)
        END)"""
    return f"""coalesce((
        SELECT min(sized.seq) FROM (
            SELECT turns.seq, sum({size}) OVER (ORDER BY turns.seq DESC) - {size} AS later
            FROM turns WHERE turns.conversation_id = :cid AND turns.seq > {low}
        ) AS sized
        WHERE sized.later < CAST(:window_bytes AS bigint)
    ), 0)"""


# The same for a turn (LEASE's turns, when a commit raced it): from its window start on.
WINDOW_LOW = "greatest(:after, conversations.context_start - 1)"
LOAD_WINDOW = f"""
    SELECT {HEAD}, conversations.rewritten_at, {WINDOW_TURN}
    FROM conversations LEFT JOIN turns
        ON turns.conversation_id = conversations.id AND turns.seq > {WINDOW_LOW}
        AND turns.seq >= {window_cut(WINDOW_LOW)}
    WHERE {THE_CONVERSATION}
    ORDER BY turns.seq
"""

# One turn of the owner's conversation (a response retrieved): the turn alone is read.
TURN_OF = f"""
    SELECT {HEAD}, {TURN}
    FROM conversations JOIN turns
        ON turns.conversation_id = conversations.id AND turns.seq = :seq
    WHERE {THE_CONVERSATION}
"""

# Some of its turns, :low <= seq <= :high, oldest or newest first, at most :n (a paged read:
# what a listing holds in memory is a page, whatever the conversation's size).
TURNS_OF = f"""
    SELECT {TURN}
    FROM conversations JOIN turns
        ON turns.conversation_id = conversations.id AND turns.seq BETWEEN :low AND :high
    WHERE {THE_CONVERSATION}
    ORDER BY turns.seq {{order}} LIMIT :n
"""

# OWNER_MAX_RUNNING_TURNS (migration 0018, running_turns.py): a turn's place among its owner's
# running turns, taken before the provider is called (:most NULL: no limit); ``taken`` false:
# the owner runs that many already. The commit (COMMIT_COUNTED) or FREE_TURN gives it back.
TAKE_TURN_CALL = """turnstore_take_turn(:caller, :holder, CAST(:now AS timestamptz),
    CAST(:until AS timestamptz), CAST(:most AS integer))"""
# A place being deleted by a take's sweep of expired ones is left to it (SKIP LOCKED: a
# commit never waits for a take, so the two cannot deadlock; one the keeper is renewing at
# that moment stays until it runs out).
FREE_TURN = """
    DELETE FROM owner_turns WHERE owner = :caller AND place IN (
        SELECT place FROM owner_turns WHERE owner = :caller AND holder = :holder
        FOR UPDATE SKIP LOCKED
    )
"""


# What each turn :low..:high holds (service/core/sizes.py: every column it stores, as stored):
# the size stored with it (migration 0019), else measured where it lies (which reads it, for
# a turn written before): an items column is stored as "[" + the items joined by "," + "]"
# (msgspec splices them), so its items are its length less the brackets and commas. A sealed
# turn written before is NULL (the process reads it to count it).
ITEMS_BYTES = """(octet_length(CAST({column} AS text)) - 2
    - greatest(json_array_length({column}) - 1, 0))"""
TURN_SIZES = f"""
    SELECT turns.seq, coalesce(turns.turn_bytes,
        {ITEMS_BYTES.format(column="turns.replay_items")}
        + coalesce({ITEMS_BYTES.format(column="turns.compacted")}, 0)
        + octet_length(turns.user_message) + octet_length(turns.assistant_message)
        + coalesce(octet_length(CAST(turns.transcript AS text)), 0)
        + coalesce(octet_length(CAST(turns.tool_calls AS text)), 0)
        + coalesce(octet_length(CAST(turns.response AS text)), 0)) AS size
    FROM conversations JOIN turns
        ON turns.conversation_id = conversations.id AND turns.seq BETWEEN :low AND :high
    WHERE {THE_CONVERSATION}
    ORDER BY turns.seq
"""

# A turn's commit: the conditional bump of its conversation (or the new conversation of its
# first turn, :expected 0), its row at the new revision and its Idempotency-Key completed
# (:idem_key NULL: none); none of it if the conversation moved on, is gone, or another turn's
# lease is live. The commit releases the lease; the turns queued for it are woken after it
# (see commit.py). It is a function (migration 0017) so that on Citus, called on
# its own, it runs whole on the worker that holds the conversation (one round trip, no
# two-phase commit); :idle_s is the retention (NULL: none).
COMMIT = f"""
    SELECT revision, created_at, updated_at, lease_wanted
    FROM {COMMIT_V3.call()}
"""
# The same, giving the turn's place among its owner's running turns back in the same
# statement (on Citus, where the place lives on the coordinator, FREE_TURN follows it).
COMMIT_COUNTED = f"WITH freed AS ({FREE_TURN}) {COMMIT}"
# A durable turn's commit that ends its run, with its last batch (migration 0022): the commit
# above, then the run's end, in one function, so that on Citus it too runs whole on the
# conversation's worker (a transaction around the two would route them one by one); whether a
# reader elsewhere follows the run. SQLSTATE RUN_ENDED_STATE if the run ended meanwhile.
COMMIT_RUN_CALL = f"""
    SELECT revision, created_at, updated_at, lease_wanted, watched
    FROM {COMMIT_RUN.call()}
"""
COMMIT_RUN_COUNTED = f"WITH freed AS ({FREE_TURN}) {COMMIT_RUN_CALL}"
# On Citus, a commit that completes an Idempotency-Key runs on the coordinator, where the keys
# are (placement.py): Citus sends a distributed function's call to its worker when the call is
# the statement's whole query (a WHERE does not stop it, measured), so the call is a CTE of its
# own, planned apart: the function runs on the coordinator and routes its statements on the
# conversation to its worker. The transaction writes that one worker and the coordinator's own
# table: no two-phase commit (deploy/SCALE-OUT.md, "Each owner's rows").
ON_COORDINATOR = "WITH here AS MATERIALIZED ({}) SELECT * FROM here"
# There the commit writes the key's receipt too, on the conversation's worker with the turn
# (receipts.py): a retry that finds the key in doubt (the coordinator's part lost) reads
# whether the turn committed.
COMMIT_RECEIPT_CALL = f"""
    SELECT revision, created_at, updated_at, lease_wanted
    FROM {COMMIT_RECEIPT.call()}
"""
COMMIT_RUN_RECEIPT_CALL = f"""
    SELECT revision, created_at, updated_at, lease_wanted, watched
    FROM {COMMIT_RUN_RECEIPT.call()}
"""
# Why a commit found no row: the conversation is gone, or it moved on.
EXISTS = f"SELECT 1 FROM conversations WHERE {THE_CONVERSATION}"

# Free for a new holder too when the holder is this replica's own turn that could not give
# its lease back (:replaces).
# :now (and :until, when a lease taken now runs out) come from the caller's clock, not now():
# Citus refuses a function that is not immutable inside CASE (timestamptz + interval is not).
TAKEABLE = """(
    conversations.lease_holder IS NULL
    OR conversations.lease_expires_at <= CAST(:now AS timestamptz)
    OR conversations.lease_holder = :holder OR conversations.lease_holder = :replaces
)"""


# A run's begin with its lease (leased's ``run``): a CTE after ``attempt``.
BEGUN = """, begun AS (
        UPDATE turn_runs SET status = 'in_progress', base_revision = attempt.revision
        FROM attempt
        WHERE turn_runs.id = :holder AND turn_runs.conversation_id = :cid
            AND turn_runs.status = 'queued' AND attempt.acquired
        RETURNING turn_runs.id
    )"""


def leased(counted: bool, run: bool) -> str:
    """The lease and the turns a turn reads in one statement (one round trip): its window,
    from the committed window start on (context_start, never before the latest compacting
    turn), after :after (the revision a cache holds). The turns are read in the statement's
    snapshot; the conversation's fields come from the updated row,
    which may be newer if a commit raced the statement: the caller then sees a revision ahead
    of the turns it got and reads again.

    ``counted``: the turn's place among its owner's running turns is taken in the same
    statement, when the lease is free to take (``counted`` NULL: it was not, ``false``: the
    owner runs too many turns, and the lease stays as it was). On Citus the place lives on
    the coordinator, not the conversation's worker, so it is taken by a statement of its own
    (TAKE_TURN) and this one is not ``counted``.

    ``run``: the holder is a run's id (LeaseRequest.run): a lease taken begins the run at the
    revision it holds (queued -> in_progress, as BEGIN), in the same statement. Its row is on
    the conversation's worker on Citus, like the conversation's."""
    slot = f"""slot AS (
        SELECT taken.taken FROM conversations, LATERAL {TAKE_TURN_CALL} AS taken
        WHERE {THE_CONVERSATION} AND {TAKEABLE}
    ), """
    granted = f"({TAKEABLE} AND (SELECT taken FROM slot))" if counted else TAKEABLE
    wanted = f"({TAKEABLE} AND (SELECT NOT taken FROM slot))" if counted else "false"
    return f"""
    WITH {slot if counted else ""}attempt AS (
        UPDATE conversations SET
            lease_holder = CASE WHEN {granted} THEN CAST(:holder AS uuid)
                ELSE conversations.lease_holder END,
            lease_expires_at = CASE WHEN {granted} THEN CAST(:until AS timestamptz)
                ELSE conversations.lease_expires_at END,
            lease_wanted = CASE WHEN {granted} THEN false
                WHEN coalesce({wanted}, false) THEN conversations.lease_wanted
                ELSE conversations.lease_wanted OR :queue END
        WHERE {THE_CONVERSATION}
        RETURNING {HEAD}, conversations.rewritten_at,
            conversations.lease_holder = :holder AS acquired, conversations.lease_expires_at
    ){BEGUN if run else ""}
    SELECT attempt.revision, attempt.created_at, attempt.updated_at, attempt.context_start,
        attempt.owner, attempt.stored_bytes, attempt.stored_revision, attempt.rewritten_at,
        attempt.acquired, attempt.lease_expires_at,
        {"(SELECT taken FROM slot)" if counted else "NULL::boolean"} AS counted,
        {NO_SYNC_WAIT} AS no_sync_wait, {WINDOW_TURN}
    FROM attempt LEFT JOIN turns ON turns.conversation_id = :cid
        AND turns.seq > greatest(:after, attempt.context_start - 1)
        AND turns.seq >= {window_cut("greatest(:after, attempt.context_start - 1)")}
    ORDER BY turns.seq
"""


# A lease given back; whether turns are queued for it (they are woken after it, from the
# server the client is connected to: on Citus a NOTIFY sent by a worker reaches no one).
RELEASE_LEASE = """
    UPDATE conversations SET lease_holder = NULL, lease_expires_at = NULL
    WHERE id = :cid AND lease_holder = :holder
    RETURNING lease_wanted
"""
# This process's leases renewed until :until (a holder is one turn's: of one conversation);
# a lease write, so not waited for (NO_SYNC_WAIT: with a slow or paused standby, renewals that
# waited held the pool's connections the turns' commits needed).
RENEW_LEASES = f"""
    WITH r AS (
        UPDATE conversations SET lease_expires_at = CAST(:until AS timestamptz)
        WHERE id = ANY(CAST(:cids AS uuid[])) AND lease_holder = ANY(CAST(:holders AS uuid[]))
        RETURNING id
    )
    SELECT r.id, {NO_SYNC_WAIT} FROM r
"""
# Topics to wake once a commit is done.
WAKE = f"""
    SELECT pg_notify('{CHANNEL}', topic), {NO_SYNC_WAIT}
    FROM unnest(CAST(:topics AS text[])) AS topic
"""

# A transcript page: first the turns' sizes (octet_length reads no TOASTed text), so that
# only the turns that fit the page are read. (Sealed, their size is the ciphertext's less its
# fixed overhead.) ``{order}``: ASC, or DESC for a page read backwards.
PAGE_SIZES = f"""
    SELECT {HEAD}, sizes.seq, sizes.size
    FROM conversations LEFT JOIN LATERAL (
        SELECT turns.seq,
            coalesce(octet_length(turns.user_message),
                     octet_length(turns.sealed_user_message) - {OVERHEAD})
            + coalesce(octet_length(turns.assistant_message),
                       octet_length(turns.sealed_assistant_message) - {OVERHEAD}) AS size
        FROM turns
        WHERE turns.conversation_id = :cid AND turns.seq > :after AND turns.seq < :before
        ORDER BY turns.seq {{order}}
        LIMIT :fetch
    ) AS sizes ON true
    WHERE {THE_CONVERSATION}
    ORDER BY sizes.seq {{order}}
"""
PAGE_ROWS = """
    SELECT turns.seq, turns.user_message, turns.assistant_message, turns.context_from,
        turns.prompt_version, turns.tool_calls, turns.sealed_user_message,
        turns.sealed_assistant_message, turns.sealed_tool_calls, turns.usage, turns.model,
        turns.transcript, turns.sealed_transcript
    FROM turns
    WHERE turns.conversation_id = :cid AND turns.seq = ANY(CAST(:seqs AS int[]))
    ORDER BY turns.seq
"""

DESCRIBE = f"SELECT {INFO} FROM conversations WHERE {THE_CONVERSATION}"
# DELETE /v1/responses/{id}: the response is forgotten, its turn stays.
DELETE_RESPONSE = f"""
    UPDATE turns SET response_deleted = true
    FROM conversations
    WHERE turns.conversation_id = :cid AND turns.seq = :seq
        AND turns.response_deleted IS NOT TRUE
        AND conversations.id = turns.conversation_id AND {THE_CONVERSATION}
    RETURNING turns.seq
"""
# The same, its content erased too (DELETE /v1/responses/{id} of a stored response's latest
# turn: what only it held, its input, output and transcript, is readable nowhere afterwards).
# Only the latest turn (no later one holds it as its history); the conversation's size is
# counted again.
ERASE_RESPONSE = f"""
    WITH head AS (
        UPDATE conversations SET counted_bytes = NULL, counted_revision = NULL,
            stored_bytes = NULL, stored_revision = NULL
        WHERE {THE_CONVERSATION} AND conversations.revision = :seq
        RETURNING conversations.id
    )
    UPDATE turns SET response_deleted = true, user_message = '', assistant_message = '',
        replay_items = '[]', transcript = '[]', tool_calls = NULL, response = NULL,
        compacted = NULL, sealed_user_message = NULL, sealed_assistant_message = NULL,
        sealed_replay_items = NULL, sealed_tool_calls = NULL, sealed_transcript = NULL,
        sealed_response = NULL, sealed_compacted = NULL, items_bytes = 0, opaque_bytes = 0,
        turn_bytes = 2
    FROM head
    WHERE turns.conversation_id = head.id AND turns.seq = :seq
    RETURNING turns.seq
"""
SET_METADATA = f"""
    UPDATE conversations SET metadata = :metadata, sealed_metadata = :sealed_metadata
    WHERE {THE_CONVERSATION} AND NOT {SHREDDED}
    RETURNING {INFO}
"""
DELETE = f"DELETE FROM conversations WHERE {THE_CONVERSATION} RETURNING conversations.revision"
# The owner's conversations, newest first, from a cursor on.
LISTING = f"""
    SELECT conversations.id, conversations.revision, conversations.created_at,
        conversations.updated_at
    FROM conversations
    WHERE conversations.owner = :caller AND {LIVE}
        AND (conversations.created_at, conversations.id) < (:before_at, :before_id)
    ORDER BY conversations.created_at DESC, conversations.id DESC
    LIMIT :limit
"""

# Filters of the listing (service/core/search.py Finding), each served by an index: the dates
# by conversations_owner_created / conversations_owner_updated, the terms (words, metadata
# pairs, models) by conversations_search (GIN, migration 0021). :terms is a tsquery of terms
# (each quoted: service/store/postgres/terms.py), :q the words of q as PostgreSQL's simple
# configuration makes them (in clear), whole or split where core/search.py searchable splits.
FILTERS = {
    "created_after": "conversations.created_at > CAST(:created_after AS timestamptz)",
    "created_before": "conversations.created_at < CAST(:created_before AS timestamptz)",
    "updated_after": "conversations.updated_at > CAST(:updated_after AS timestamptz)",
    # A conversation is updated at or after it is made (both are now() of their statements),
    # so one updated before T was made before T too: said, it bounds the created index's walk
    # (without it, an old T walked every newer conversation of the owner).
    "updated_before": """conversations.updated_at < CAST(:updated_before AS timestamptz)
        AND conversations.created_at < CAST(:updated_before AS timestamptz)""",
    "terms": "conversations.search @@ CAST(:terms AS tsquery)",
    "q": "(conversations.search @@ plainto_tsquery('simple', :q) OR conversations.search"
    " @@ plainto_tsquery('simple', regexp_replace(:q, '[@./:]+', ' ', 'g')))",
}


def listing(filters: tuple[str, ...]) -> str:
    """LISTING with these FILTERS (by name) added."""
    return LISTING.replace(
        "ORDER BY", " ".join(f"AND {FILTERS[name]}" for name in filters) + " ORDER BY", 1
    )


# A conversation's search terms (migration 0021) grown by a write: the words of :text as the
# simple configuration makes them (in clear; NULL under encryption) and :terms (the terms the
# process made: keyed digests of words, metadata pairs, models).
SEARCH_ADD = """
    UPDATE conversations SET search = coalesce(conversations.search, ''::tsvector)
        || strip(to_tsvector('simple', coalesce(CAST(:text AS text), '')))
        || array_to_tsvector(CAST(:terms AS text[]))
    WHERE conversations.id = :cid
"""
# Its metadata pairs' terms replaced by :terms (its metadata was).
SEARCH_PAIRS = """
    UPDATE conversations SET search = ts_delete(coalesce(conversations.search, ''::tsvector),
        ARRAY(SELECT lexeme FROM unnest(coalesce(conversations.search, ''::tsvector))
              WHERE left(lexeme, 2) = '_m'))
        || array_to_tsvector(CAST(:terms AS text[]))
    WHERE conversations.id = :cid
"""
# Its search terms made again from its turns (a fork's, of the turns it holds): the words of
# turns in clear and every model, as migration 0021's backfill makes them, and :terms (the
# words of sealed turns and the metadata pairs, made by the process).
TERM = """'_' || {kind} || left(encode(sha256(convert_to({kind} || ':' || {value}, 'UTF8')),
    'hex'), 32)"""
SAID = """coalesce((
            SELECT string_agg(concat_ws(' ', t.user_message, t.assistant_message, (
                SELECT string_agg(e.value ->> 1, ' ') FROM json_array_elements(t.transcript) AS e
            )), ' ')
            FROM turns t WHERE t.conversation_id = :cid AND t.sealed_user_message IS NULL
        ), '')"""
# (and the words of what the parser keeps whole, split where core/search.py searchable does)
SEARCH_REBUILD = f"""
    UPDATE conversations SET search = strip(to_tsvector('simple', {SAID})
            || to_tsvector('simple', regexp_replace({SAID}, '[@./:]+', ' ', 'g')))
        || array_to_tsvector(coalesce((
            SELECT array_agg(DISTINCT {TERM.format(kind="'o'", value="t.model")})
            FROM turns t WHERE t.conversation_id = :cid AND t.model IS NOT NULL), '{{}}'))
        || array_to_tsvector(CAST(:terms AS text[]))
    WHERE conversations.id = :cid
"""

# What the owner's committed turns cost, from :since to :until, summed by {key} (a day in UTC,
# a model, a conversation): each turn's stored usage (a conversation with a turn in the range
# was updated since its start: conversations_owner_updated finds them).
USAGE_KEYS = {
    "day": "to_char(turns.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
    "model": "coalesce(turns.model, '')",
    "conversation": "CAST(conversations.id AS text)",
}
TOKENS = (
    "input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens", "reasoning_tokens"
)  # fmt: skip
SUMS = ", ".join(
    f"CAST(coalesce(sum(CAST(turns.usage ->> '{name}' AS bigint)), 0) AS bigint) AS {name}"
    for name in TOKENS
)
USAGE = f"""
    SELECT {{key}} AS key, count(*) AS turns,
        {SUMS}
    FROM conversations JOIN turns ON turns.conversation_id = conversations.id
    WHERE conversations.owner = :caller AND {{live}}
        AND conversations.updated_at >= CAST(:since AS timestamptz)
        AND turns.created_at >= CAST(:since AS timestamptz)
        AND turns.created_at < CAST(:until AS timestamptz)
    GROUP BY 1
    ORDER BY 1
"""

# A conversation made without a turn (or with one written after it, see TURN_INSERT), and a
# fork's copy made in the process (sealed, each value sealed again for its new place).
# Nothing is made for a shredded owner (no row: see SHREDDED).
NEW_CONVERSATION = f"""
    INSERT INTO conversations (
        id, revision, created_at, updated_at, context_start, owner, lease_wanted, metadata,
        sealed_metadata, expires_at, counted_bytes, counted_revision, forked_from
    ) SELECT
        :cid, :revision, now(), now(), :context_start, :caller, false, :metadata,
        :sealed_metadata, CAST(:expires_at AS timestamptz), CAST(:stored_bytes AS bigint),
        CASE WHEN CAST(:stored_bytes AS bigint) IS NOT NULL THEN CAST(:revision AS integer) END,
        CAST(:forked_from AS uuid)
    WHERE NOT {SHREDDED}
    RETURNING {INFO}
"""
TURN_INSERT = f"""
    INSERT INTO turns (conversation_id, seq, created_at, {TURN_VALUES})
    VALUES (
        :conversation_id, :seq, now(), :user_message, :assistant_message, :replay_items,
        :provider, :endpoint, :model, :context_from, :prompt_version, :tool_calls, :status,
        :incomplete_reason, :turn_id, :sealed_user_message, :sealed_assistant_message,
        :sealed_replay_items, :sealed_tool_calls, :usage, :transcript, :sealed_transcript,
        :response, :sealed_response, :compacted, :sealed_compacted, :items_bytes, :opaque_bytes,
        :turn_bytes, :kind, :key_fingerprint
    )
"""
# The same with its first time kept (a turn moved or copied).
TURN_MOVE = TURN_INSERT.replace("now()", ":created_at")

# A fork in clear: the conversation row and turns 1..:at copied in one statement (the turns'
# bytes, origins, window starts and prompt versions as they are); none of it is read into
# the process. Its window starts where turn :at's did. A source with anything sealed is not
# copied here (see FORK_SOURCE).
FORKED = """
    seq, user_message, assistant_message, replay_items, created_at, provider, endpoint, model,
    context_from, prompt_version, tool_calls, status, incomplete_reason, usage, transcript,
    response, compacted, items_bytes, opaque_bytes, turn_bytes, kind, key_fingerprint
"""
FORK = f"""
    WITH src AS (
        SELECT id, metadata, expires_at FROM conversations
        WHERE id = :src AND owner = :caller AND revision >= :at AND {LIVE}
            AND NOT {SHREDDED} AND sealed_metadata IS NULL AND NOT EXISTS (
                SELECT 1 FROM turns
                WHERE conversation_id = :src AND seq <= :at AND sealed_replay_items IS NOT NULL
            )
    ), forked AS (
        INSERT INTO conversations (
            id, revision, created_at, updated_at, context_start, owner, lease_wanted, metadata,
            expires_at, forked_from
        )
        SELECT :new, :at, now(), now(),
            coalesce((SELECT context_from FROM turns
                      WHERE conversation_id = :src AND seq = :at), 1),
            :caller, false, metadata, expires_at, :src
        FROM src
        RETURNING id, revision, created_at, updated_at, metadata, sealed_metadata, expires_at,
            counted_bytes AS stored_bytes, counted_revision AS stored_revision, rewritten_at,
            context_start, forked_from
    ), copied AS (
        INSERT INTO turns ({FORKED}, conversation_id)
        SELECT {FORKED}, :new FROM turns
        WHERE conversation_id = (SELECT id FROM src) AND seq <= :at
    )
    SELECT * FROM forked
"""
# OWNER_MAX_FORKS_PER_MINUTE, in the fork's transaction: an owner's forks are counted one at
# a time (a transaction lock on the owner), over the minute before :now; older rows are
# pruned, and this fork's is added while there is room. Its row goes if the fork rolls back.
FORK_TURNSTILE = "SELECT pg_advisory_xact_lock(hashtextextended('forks:' || :caller, 0))"
FORK_SLOT = """
    WITH pruned AS (
        DELETE FROM owner_forks WHERE owner = :caller AND made_at <= :since
    ), recent AS (
        SELECT count(*) AS n, min(made_at) AS oldest FROM owner_forks
        WHERE owner = :caller AND made_at > :since
    ), made AS (
        INSERT INTO owner_forks (owner, conversation_id, made_at)
        SELECT :caller, :new, :now FROM recent WHERE recent.n < :max
        RETURNING made_at
    )
    SELECT recent.oldest, EXISTS (SELECT 1 FROM made) AS made FROM recent
"""
# A fork's place among its owner's forks of the minute, given back (the turn that was to make
# it failed: it made none).
FREE_FORK = "DELETE FROM owner_forks WHERE owner = :caller AND conversation_id = :new"
# A fork made in the process: the source's row (kept from changing meanwhile) and its turns.
FORK_SOURCE = f"""
    SELECT conversations.metadata, conversations.sealed_metadata, conversations.expires_at,
        (SELECT turns.context_from FROM turns
         WHERE turns.conversation_id = :src AND turns.seq = :at) AS context_from
    FROM conversations
    WHERE conversations.id = :src AND conversations.owner = :caller
        AND conversations.revision >= :at AND {LIVE}
    FOR SHARE
"""
FORK_TURNS = f"""
    SELECT {TURN} FROM turns
    WHERE turns.conversation_id = :src AND turns.seq <= :at
    ORDER BY turns.seq
"""
# Why a fork found nothing to copy, with no keyring: is the source encrypted?
SEALED_SOURCE = """
    SELECT EXISTS (SELECT 1 FROM conversations WHERE id = :src AND sealed_metadata IS NOT NULL)
        OR EXISTS (SELECT 1 FROM turns
                   WHERE conversation_id = :src AND sealed_replay_items IS NOT NULL)
"""

# Removing the latest item (pop_item): the row locked, the last turn read, rewritten.
LOCK_HEAD = f"""
    SELECT conversations.revision,
        conversations.lease_holder IS NOT NULL
            AND conversations.lease_expires_at > now() AS leased
    FROM conversations
    WHERE {THE_CONVERSATION} AND NOT {SHREDDED}
    FOR UPDATE
"""
TURN_AT = f"""
    SELECT {TURN} FROM turns
    WHERE turns.conversation_id = :cid AND turns.seq = :seq
"""
DELETE_TURN = "DELETE FROM turns WHERE turns.conversation_id = :cid AND turns.seq = :seq"
REWRITTEN = f"""
    UPDATE conversations SET
        revision = conversations.revision + 1,
        rewritten_at = conversations.revision + 1,
        updated_at = now(),
        stored_bytes = NULL,
        stored_revision = NULL,
        counted_bytes = NULL,
        counted_revision = NULL
    WHERE conversations.id = :cid
    RETURNING {INFO}
"""

# Housekeeping: conversations idle past the retention, a batch at a time (concurrent purges
# skip each other's rows); an owner's, a batch at a time.
PURGE_PICK = f"""
    SELECT conversations.id FROM conversations
    WHERE NOT ({LIVE})
    ORDER BY conversations.updated_at
    LIMIT :batch
"""
# Those picked, deleted if still gone (no lock taken while picking: on Citus a FOR UPDATE
# over every shard is refused; a concurrent purge that deleted one first is waited for, and
# the row is then not there).
PURGE = f"""
    DELETE FROM conversations
    WHERE conversations.id = ANY(CAST(:ids AS uuid[])) AND NOT ({LIVE})
    RETURNING conversations.id
"""
OWNED = """
    DELETE FROM conversations WHERE id IN (
        SELECT id FROM conversations WHERE owner = :owner LIMIT :batch
    )
    RETURNING id
"""
OWNER_SEALED = """
    SELECT EXISTS (
        SELECT 1 FROM conversations c JOIN turns t ON t.conversation_id = c.id
        WHERE c.owner = :owner AND t.sealed_replay_items IS NOT NULL
    ) OR EXISTS (
        SELECT 1 FROM conversations WHERE owner = :owner AND sealed_metadata IS NOT NULL
    )
"""
READINESS = """
    SELECT to_regclass('alembic_version') IS NOT NULL AS migrated,
        NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'
            AS writable
"""
SCHEMA_VERSION = "SELECT version_num FROM alembic_version"


class Statements:
    """The statements of one store, compiled once for asyncpg, with its retention filter."""

    def __init__(self, retention_days: float | None) -> None:
        # A stored response's conversation goes when it expires; any with RETENTION_DAYS when
        # it has been idle that long.
        live = "(conversations.expires_at IS NULL OR conversations.expires_at > now())"
        if retention_days:
            idle = f"make_interval(secs => {retention_days * 86_400!r})"
            live += f" AND conversations.updated_at > now() - {idle}"

        def compiled(template: str) -> Compiled:
            return sql(template.replace(LIVE, live))

        self.load = compiled(LOAD)
        self.load_window = compiled(LOAD_WINDOW)
        self.turn_of = compiled(TURN_OF)
        self.turns_of = {  # newest first?
            False: compiled(TURNS_OF.replace("{order}", "ASC")),
            True: compiled(TURNS_OF.replace("{order}", "DESC")),
        }
        self.turn_sizes = compiled(TURN_SIZES)
        self.lease = {
            (counted, run): compiled(leased(counted, run))
            for counted in (False, True)
            for run in (False, True)
        }
        self.commit = {counted: compiled(COMMIT_COUNTED if counted else COMMIT)
                       for counted in (False, True)}  # fmt: skip
        self.commit_run = {counted: compiled(COMMIT_RUN_COUNTED if counted else COMMIT_RUN_CALL)
                           for counted in (False, True)}  # fmt: skip
        # Keyed, on Citus (not counted there): on the coordinator.
        self.commit_keyed = compiled(ON_COORDINATOR.format(COMMIT_RECEIPT_CALL))
        self.commit_run_keyed = compiled(ON_COORDINATOR.format(COMMIT_RUN_RECEIPT_CALL))
        self.idle_s = retention_days * 86_400 if retention_days else None  # for the commit
        self.exists = compiled(EXISTS)
        self.release_lease = compiled(RELEASE_LEASE)
        self.renew_leases = compiled(RENEW_LEASES)
        self.wake = compiled(WAKE)
        self.page_sizes = {  # backwards?
            False: compiled(PAGE_SIZES.replace("{order}", "ASC")),
            True: compiled(PAGE_SIZES.replace("{order}", "DESC")),
        }
        self.page_rows = compiled(PAGE_ROWS)
        self.describe = compiled(DESCRIBE)
        self.delete_response = {
            False: compiled(DELETE_RESPONSE),
            True: compiled(ERASE_RESPONSE),
        }  # erase?
        self.set_metadata = compiled(SET_METADATA)
        self.delete = compiled(DELETE)
        self.page = compiled(LISTING)  # a page of the listing
        self._listings: dict[tuple[str, ...], Compiled] = {}
        self._living: dict[str, Compiled] = {}
        self.search_add = compiled(SEARCH_ADD)
        self.search_pairs = compiled(SEARCH_PAIRS)
        self.search_rebuild = compiled(SEARCH_REBUILD)
        self.usage = {key: compiled(USAGE.replace("{key}", sql_key))
                      for key, sql_key in USAGE_KEYS.items()}  # fmt: skip
        self._compiled = compiled
        self.new_conversation = compiled(NEW_CONVERSATION)
        self.turn_insert = compiled(TURN_INSERT)
        self.turn_move = compiled(TURN_MOVE)
        self.fork = compiled(FORK)
        self.fork_turnstile = compiled(FORK_TURNSTILE)
        self.fork_slot = compiled(FORK_SLOT)
        self.free_fork = compiled(FREE_FORK)
        self.fork_source = compiled(FORK_SOURCE)
        self.fork_turns = compiled(FORK_TURNS)
        self.sealed_source = compiled(SEALED_SOURCE)
        self.shredded = compiled(f"SELECT {SHREDDED}")
        self.lock_head = compiled(LOCK_HEAD)
        self.turn_at = compiled(TURN_AT)
        self.delete_turn = compiled(DELETE_TURN)
        self.rewritten = compiled(REWRITTEN)
        self.purge_pick = compiled(PURGE_PICK)
        self.purge = compiled(PURGE)
        self.owned = compiled(OWNED)
        self.owner_sealed = compiled(OWNER_SEALED)
        self.readiness = compiled(READINESS)
        self.schema_version = compiled(SCHEMA_VERSION)

    def living(self, template: str) -> Compiled:
        """Another module's statement with this store's retention filter (compiled the first
        time it is asked)."""
        found = self._living.get(template)
        if found is None:
            found = self._living[template] = self._compiled(template)
        return found

    def listing(self, filters: tuple[str, ...]) -> Compiled:
        """A page of the listing with these FILTERS (compiled the first time it is asked)."""
        found = self._listings.get(filters)
        if found is None:
            found = self._listings[filters] = self._compiled(listing(filters))
        return found
