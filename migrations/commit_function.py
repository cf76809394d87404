"""The schema's commit functions (and a durable turn's writes of its run: LOG_RUN, END_RUN,
COMMIT_RUN, migration 0022) as the code calls them: ``turnstore_commit_v3()``, which this
release calls (store/postgres/statements.py), ``turnstore_commit()``, which the release before
it calls during a rolling upgrade, and ``turnstore_commit_v2()``, which images built between
migrations 0019 and 0021 call; store/postgres/placement.py places all three on Citus. Each is
named here once with its arguments, in order, and its call and its signature are read from
that. The migrations that made them (0017 to 0022) carry their own text
(migrations/__init__.py); tests/system/test_placement.py checks that the two agree.

``shredded(owner)`` is the one test of a shred's tombstone (migration 0019) in SQL, as the
commit functions make it: the statements that make a conversation or a running turn's place
ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

# A tombstone names its owner by sha256(the deployment's "owners" secret || the owner's name)
# (store/postgres/secrets.py computes the same): never in clear.
DIGEST = """sha256((SELECT secret FROM turnstore_secrets WHERE name = 'owners')
    || convert_to(CAST({owner} AS text), 'UTF8'))"""
SHREDDED = "EXISTS (SELECT 1 FROM owner_tombstones WHERE owner_tombstones.digest = " + DIGEST + ")"
# What a write of a shredded owner raises (a SQLSTATE of turnstore's own): it wrote nothing.
SHREDDED_STATE = "TSSHR"


def shredded(owner: str) -> str:
    """Whether the owner named by the SQL expression ``owner`` was shredded."""
    return SHREDDED.format(owner=owner)


def digest(owner: str) -> str:
    """What a tombstone names the owner of the SQL expression ``owner`` by."""
    return DIGEST.format(owner=owner)


# The turn's columns as the function takes them, in order after the commit's own arguments.
TURN = (
    ("user_message", "text"),
    ("assistant_message", "text"),
    ("replay_items", "json"),
    ("provider", "text"),
    ("endpoint", "text"),
    ("model", "text"),
    ("context_from", "integer"),
    ("prompt_version", "text"),
    ("tool_calls", "json"),
    ("status", "text"),
    ("incomplete_reason", "text"),
    ("turn_id", "uuid"),
    ("sealed_user_message", "bytea"),
    ("sealed_assistant_message", "bytea"),
    ("sealed_replay_items", "bytea"),
    ("sealed_tool_calls", "bytea"),
    ("usage", "json"),
    ("transcript", "json"),
    ("sealed_transcript", "bytea"),
    ("response", "json"),
    ("sealed_response", "bytea"),
    ("compacted", "json"),
    ("sealed_compacted", "bytea"),
)
# turnstore_commit's arguments: the conversation (the distribution argument, first), the
# commit's condition, the turn, the Idempotency-Key to complete (NULL: none).
ARGUMENTS = (
    ("cid", "uuid"),
    ("expected", "integer"),
    ("caller", "text"),
    ("holder", "uuid"),
    ("context_start", "integer"),
    ("expires_at", "timestamptz"),
    ("idle_s", "double precision"),
    ("stored_bytes", "bigint"),  # the conversation's size with this turn (NULL: not counted)
    *TURN,
    ("idem_key", "text"),
    ("ttl_s", "double precision"),
)

# turnstore_commit_v2 (0019): the turn's sizes are columns too (what its items take in a
# request, the opaque ones among them, and all it stores: core/sizes.py), and the claim of
# this attempt's Idempotency-Key comes last.
SIZES = (("items_bytes", "integer"), ("opaque_bytes", "integer"), ("turn_bytes", "bigint"))
ARGUMENTS_V2 = (*ARGUMENTS[:-2], *SIZES, *ARGUMENTS[-2:], ("claim", "uuid"))
# What a commit raises when its attempt no longer holds its Idempotency-Key's claim (it ran
# out, and another attempt took it over): it wrote nothing.
CLAIM_LOST_STATE = "TSKEY"


@dataclass(frozen=True)
class Function:
    """A function of the schema: its name and its arguments in order (each its name without
    the ``p_`` the function gives it, and its SQL type)."""

    name: str
    arguments: tuple[tuple[str, str], ...]

    @property
    def signature(self) -> str:
        """As ``regprocedure`` reads it (DROP FUNCTION, Citus' create_distributed_function)."""
        return f"{self.name}({', '.join(kind for _, kind in self.arguments)})"

    def call(self) -> str:
        """A call that binds each argument by its name (``:cid``, ...)."""
        return f"{self.name}({', '.join(f':{name}' for name, _ in self.arguments)})"


# turnstore_commit_v3 (0021): the turn's origin also names its provider's kind and the
# fingerprint of the key it was called with (core/model.py's Origin), and the turn's search
# terms join its conversation's (store/postgres/terms.py: words in clear, terms made here).
SEARCH = (("search_text", "text"), ("search_terms", "text[]"))
ARGUMENTS_V3 = (*ARGUMENTS_V2, ("kind", "text"), ("key_fingerprint", "text"), *SEARCH)

# A durable turn's writes of its run (0022), each on its conversation's worker on Citus: the run
# made, a batch of events logged, the run ended without a commit, and the commit that ends it.
BATCH = (("events", "json"), ("sealed_events", "bytea"))
CREATE_RUN = Function(
    "turnstore_create_run",
    (
        ("cid", "uuid"),
        ("id", "uuid"),
        ("owner", "text"),
        ("background", "boolean"),
        ("hb", "double precision"),
        ("response", "json"),
        ("sealed_response", "bytea"),
    ),
)
LOG_RUN = Function(
    "turnstore_log_run",
    (("cid", "uuid"), ("id", "uuid"), ("last", "integer"), ("message_id", "text"), *BATCH),
)
END_RUN = Function(
    "turnstore_end_run",
    (
        ("cid", "uuid"),
        ("id", "uuid"),
        ("status", "text"),
        ("code", "text"),
        ("message", "text"),
        ("last", "integer"),
        ("revision", "integer"),
        ("ttl", "double precision"),
        *BATCH,
    ),
)
COMMIT_RUN = Function(
    "turnstore_commit_run",
    (
        *ARGUMENTS_V3,
        ("run", "uuid"),
        ("run_status", "text"),
        ("done_seq", "integer"),
        ("events_ttl_s", "double precision"),
        *BATCH,
    ),
)
# What turnstore_commit_run raises when the turn's run had ended meanwhile (interrupted): the
# whole commit rolled back.
RUN_ENDED_STATE = "TSRUN"

COMMIT = Function("turnstore_commit", ARGUMENTS)  # the previous release's (0017, 0018, 0019)
COMMIT_V2 = Function("turnstore_commit_v2", ARGUMENTS_V2)  # images between 0019 and 0020
COMMIT_V3 = Function("turnstore_commit_v3", ARGUMENTS_V3)  # this release's (0021)
# A keyed commit's with its receipt (0024: on Citus, run on the coordinator; receipts.py).
COMMIT_RECEIPT = Function("turnstore_commit_receipt", ARGUMENTS_V3)
COMMIT_RUN_RECEIPT = Function("turnstore_commit_run_receipt", COMMIT_RUN.arguments)
