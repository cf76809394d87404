"""The statements about durable turns: runs and their event batches.

A run, its events and its progress are written without waiting for a synchronous standby or
for their own WAL flush (``NO_SYNC_WAIT``): they are what a client saw, not what the
conversation keeps (a run lost in a crash is a turn that fails, as it would anyway), and the
commit of the turn (which ends its run, ``COMMIT``) waits as every commit does (and flushes
what came before it).
Readers elsewhere are woken only for runs that have one (``watched``): a NOTIFY takes a global
lock at commit, so it is not sent for nothing.
"""

from __future__ import annotations

from migrations.commit_function import CREATE_RUN, END_RUN, LOG_RUN
from service.store.postgres.statements import (
    NO_SYNC_WAIT,
    TAKE_TURN_CALL,
    THE_CONVERSATION,
    WAKE,
)
from service.store.postgres.tx import sql

UNFINISHED = "status IN ('queued', 'in_progress')"
# A run is found by its id; by its conversation's too when the caller knows it (:cid, NULL when
# not): on Citus that routes the statement to the conversation's worker instead of every shard.
HERE = "(CAST(:cid AS uuid) IS NULL OR conversation_id = :cid)"
R_HERE = "(CAST(:cid AS uuid) IS NULL OR r.conversation_id = :cid)"
LIVE = "(r.expires_at IS NULL OR r.expires_at > now())"
RUN_COLUMNS = """
    id, conversation_id, owner, background, status, heartbeat_until, created_at, last_event,
    cancel_requested, watched, response, sealed_response
"""
RUN_VALUES = """
    :id, :cid, :owner, :background, 'queued', now() + make_interval(secs => :hb), now(), 0,
    false, false, CAST(:response AS json), :sealed_response
"""
# Nothing is made for a shredded owner (SHREDDED_STATE). A function (migration 0022): on Citus
# run whole on the conversation's worker (an INSERT ... SELECT that reads the tombstones goes
# through the coordinator, in a two-phase commit); there with the run's home: run_homes.CREATE.
CREATE = sql(f"SELECT {CREATE_RUN.call()}")
# The same, when the run's turn has its place among its owner's running turns (running_turns.py), in
# the same statement; whether it had (nothing is made when not). Plain PostgreSQL only: on
# Citus the place is on the coordinator, taken by a statement of its own before CREATE.
CREATE_COUNTED = sql(f"""
    WITH slot AS (
        SELECT taken FROM {TAKE_TURN_CALL}
    ), made AS (
        INSERT INTO turn_runs ({RUN_COLUMNS}) SELECT {RUN_VALUES} FROM slot WHERE slot.taken
    )
    SELECT taken, {NO_SYNC_WAIT} FROM slot
""")
# The same, of a turn in a conversation that must exist (NewRun.existing): the run and its
# place only if the owner has the conversation, live, at a revision :if_match lists (NULL:
# any); its revision (no row: no such conversation) and whether the place was taken (NULL: the
# revision was not the one asked for). The early check of a streamed turn, folded into its
# run's creation. A template: the store's retention filter is filled in (Statements.living).
CREATE_COUNTED_IN = f"""
    WITH conversation AS (
        SELECT conversations.revision FROM conversations WHERE {THE_CONVERSATION}
    ), slot AS (
        SELECT taken.taken FROM conversation, LATERAL {TAKE_TURN_CALL} AS taken
        WHERE CAST(:if_match AS bigint[]) IS NULL
            OR conversation.revision = ANY(CAST(:if_match AS bigint[]))
    ), made AS (
        INSERT INTO turn_runs ({RUN_COLUMNS}) SELECT {RUN_VALUES} FROM slot WHERE slot.taken
    )
    SELECT conversation.revision, slot.taken, {NO_SYNC_WAIT}
    FROM conversation LEFT JOIN slot ON true
"""
# A batch logged with its run's progress, or the run ended without a commit (migration 0022):
# whether the batch was written (not if it was already: a retry) and whether readers elsewhere
# follow the run; no row if the run had ended. Functions: on Citus each runs whole on the
# conversation's worker (a statement whose CTE inserts is never routed there).
LOG = sql(f"SELECT written, watched FROM {LOG_RUN.call()}")
END = sql(f"SELECT written, watched FROM {END_RUN.call()}")
# A forked durable turn's commit ends its run (in the fork's transaction, after the turn row):
# no row means the run was interrupted meanwhile, and the whole commit is rolled back. Named by
# its conversation too. (Without a fork: statements.COMMIT_RUN_CALL, one function.)
COMMIT = sql(f"""
    WITH r AS (
        UPDATE turn_runs SET
            status = :status, revision = :revision, last_event = :seq, finished_at = now(),
            expires_at = now() + make_interval(secs => :ttl)
        WHERE conversation_id = :cid AND id = :id AND {UNFINISHED}
        RETURNING id, conversation_id, watched
    ), e AS (
        INSERT INTO turn_events (conversation_id, turn_id, seq, events, sealed_events)
        SELECT r.conversation_id, r.id, :seq, CAST(:events AS json), :sealed_events FROM r
        RETURNING 1
    )
    SELECT r.watched FROM r
""")
VIEW = """
    r.id, r.conversation_id, r.status, r.revision, r.error_code, r.error_message,
    r.last_event, r.background, (r.heartbeat_until < now()) AS stalled, r.base_revision,
    r.message_id, CAST(r.response AS text) AS response, r.sealed_response,
    r.created_at AS run_created_at
"""
READ = sql(f"""
    SELECT {VIEW}, t.seq, t.assistant_message, t.sealed_assistant_message
    FROM turn_runs r LEFT JOIN turns t
        ON t.conversation_id = r.conversation_id AND t.seq = r.revision
    WHERE r.id = :id AND {R_HERE} AND r.owner = :owner AND {LIVE}
""")
# The batches that hold events after :after (a batch's seq is its last event's).
READ_EVENTS = sql(f"""
    SELECT {VIEW}, e.seq, CAST(e.events AS text) AS events, e.sealed_events
    FROM turn_runs r LEFT JOIN turn_events e
        ON e.conversation_id = r.conversation_id AND e.turn_id = r.id AND e.seq > :after
    WHERE r.id = :id AND {R_HERE} AND r.owner = :owner AND {LIVE}
    ORDER BY e.seq
""")
WATCH = sql(f"""
    UPDATE turn_runs SET watched = true WHERE id = :id AND {HERE} AND NOT watched RETURNING id
""")
# (Citus refuses set_config in an UPDATE's RETURNING: it is the statement's own.)
BEGIN = sql(f"""
    WITH r AS (
        UPDATE turn_runs SET status = 'in_progress', base_revision = :base
        WHERE id = :id AND {HERE} AND status = 'queued'
        RETURNING id
    )
    SELECT r.id, {NO_SYNC_WAIT} FROM r
""")
# The run that makes a conversation's revision :base + 1 (a streamed response, named by that
# revision): of those that held the conversation there, one that did not fail nor was
# cancelled first (a run refused after its lease began it, before its provider call: its
# If-Match, its size, ...), then the latest.
RUN_AT = sql(f"""
    SELECT r.id FROM turn_runs r
    WHERE r.conversation_id = :cid AND r.owner = :owner AND r.base_revision = :base AND {LIVE}
    ORDER BY r.status IN ('failed', 'cancelled'), r.created_at DESC
    LIMIT 1
""")
CANCEL = sql(f"""
    UPDATE turn_runs SET cancel_requested = true
    WHERE id = :id AND {HERE} AND owner = :owner AND {UNFINISHED}
    RETURNING id
""")
# Runs found by their ids and (:cids, NULL when some are not known) their conversations': on
# Citus the heartbeat is made once per conversation (Adapter.each_group), each routed to its
# worker, and the read looks at those conversations' shards only.
AMONG = "(CAST(:cids AS uuid[]) IS NULL OR conversation_id = ANY(CAST(:cids AS uuid[])))"
RENEW = sql(f"""
    WITH r AS (
        UPDATE turn_runs SET heartbeat_until = now() + make_interval(secs => :hb)
        WHERE id = ANY(CAST(:ids AS uuid[])) AND {AMONG} AND {UNFINISHED}
        RETURNING id, cancel_requested, watched
    )
    SELECT r.id, r.cancel_requested, r.watched, {NO_SYNC_WAIT} FROM r
""")
CANCEL_REQUESTED = sql(f"""
    SELECT id FROM turn_runs WHERE id = ANY(CAST(:ids AS uuid[])) AND {AMONG} AND cancel_requested
""")
# A stalled run's next event number, read first so its terminal event can be sealed for its
# place (the batch is named by its event's number); the interruption is then written only if
# the run is still stalled at that event (no lock held in between: on Citus a FOR UPDATE by
# the run's id alone, on every shard, is refused).
STALLED = sql(f"""
    SELECT last_event + 1 FROM turn_runs
    WHERE id = :id AND {HERE} AND {UNFINISHED} AND heartbeat_until < now()
""")
INTERRUPT = sql(f"""
    WITH r AS (
        UPDATE turn_runs SET
            status = 'failed', error_code = 'turn_interrupted', error_message = :message,
            last_event = :last, finished_at = now(),
            expires_at = now() + make_interval(secs => :ttl)
        WHERE id = :id AND {HERE} AND {UNFINISHED} AND heartbeat_until < now()
            AND last_event + 1 = :last
        RETURNING id, conversation_id, watched
    ), e AS (
        INSERT INTO turn_events (conversation_id, turn_id, seq, events, sealed_events)
        SELECT conversation_id, id, :last, CAST(:events AS json), :sealed_events FROM r
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM e) AS written, r.watched FROM r
""")
# Readers elsewhere woken (from the server the client is connected to: on Citus a NOTIFY sent
# on a worker reaches no one), after the statement that made the news.
NOTIFY = sql(WAKE)
# (On Citus with the run's home: run_homes.py.)
FORGET_TEXT = f"""
    DELETE FROM turn_runs WHERE id = :id AND {HERE} AND owner = :owner AND NOT {UNFINISHED}
"""
FORGET = sql(FORGET_TEXT)
DELETE_OF = sql("DELETE FROM turn_runs WHERE conversation_id = ANY(CAST(:cids AS uuid[]))")
EXPIRED_TEXT = "DELETE FROM turn_runs WHERE expires_at < now()"
EXPIRED = sql(EXPIRED_TEXT)
DELETE_OWNED = sql("DELETE FROM turn_runs WHERE owner = :owner")
