"""turnstore_commit(): a turn's commit as one function (migration 0017), as 0018 makes it
(it also records which revision ``stored_bytes`` counts, ``stored_revision``) and as 0019
makes it (a shredded owner's commit writes nothing); and 0019's ``turnstore_commit_v2()``,
which this release calls: it also stores what the turn's items take in a request
(``items_bytes``, ``opaque_bytes``) and in all (``turn_bytes``), and completes the turn's
Idempotency-Key only if this attempt still holds its claim (``claim``: else it raises
CLAIM_LOST_STATE and writes nothing). Each is written from here, so the versions differ only
where they say.

``shredded(owner)`` is the one test of a shred's tombstone (migration 0019) in SQL: the commit
function, and the statements that make a conversation or a running turn's place, ask it.
"""

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


def refuse_shredded(owner: str) -> str:
    """A PL/pgSQL statement that raises SHREDDED_STATE for a shredded owner."""
    return (
        f"IF {shredded(owner)} THEN\n"
        f"        RAISE EXCEPTION 'the owner was shredded' USING ERRCODE = '{SHREDDED_STATE}';\n"
        "    END IF;"
    )


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
# Its arguments: the conversation (the distribution argument, first), the commit's condition,
# the turn, the Idempotency-Key to complete (NULL: none).
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
SIGNATURE = ", ".join(kind for _, kind in ARGUMENTS)
COLUMNS = ", ".join(name for name, _ in TURN)
VALUES = ", ".join(f"p_{name}" for name, _ in TURN)
PARAMETERS = ", ".join(f"p_{name} {kind}" for name, kind in ARGUMENTS)

# turnstore_commit_v2 (0019): the turn's sizes are columns too (what its items take in a
# request, the opaque ones among them, and all it stores: core/sizes.py), and the claim of
# this attempt's Idempotency-Key comes last.
SIZES = (("items_bytes", "integer"), ("opaque_bytes", "integer"), ("turn_bytes", "bigint"))
TURN_V2 = (*TURN, *SIZES)
ARGUMENTS_V2 = (*ARGUMENTS[:-2], *SIZES, *ARGUMENTS[-2:], ("claim", "uuid"))
SIGNATURE_V2 = ", ".join(kind for _, kind in ARGUMENTS_V2)
# What a commit raises when its attempt no longer holds its Idempotency-Key's claim (it ran
# out, and another attempt took it over): it wrote nothing.
CLAIM_LOST_STATE = "TSKEY"

# Live: not expired, not idle past the retention (p_idle_s NULL: kept however idle); free:
# no other turn's lease is live.
LIVE_AND_FREE = """
    (c.expires_at IS NULL OR c.expires_at > v_now)
    AND (v_cutoff IS NULL OR c.updated_at > v_cutoff)
    AND (c.lease_holder IS NULL OR c.lease_expires_at <= v_now OR c.lease_holder = p_holder)
"""


def definition(
    *,
    counts_revision: bool,
    replace: bool = False,
    refuses_shredded: bool = False,
    v2: bool = False,
) -> str:
    """The function's SQL; ``counts_revision``: 0018's, which also writes
    ``stored_revision`` (the revision ``stored_bytes`` counts: NULL when that is NULL);
    ``refuses_shredded``: 0019's, which writes nothing for an owner a shred's tombstone names
    (it raises SHREDDED_STATE); ``v2``: turnstore_commit_v2 (see the module), which keeps the
    conversation's size in ``counted_bytes`` and ``counted_revision``: the size counted by
    this release (every column, core/sizes.py), apart from the one an older release counts
    (fewer columns) in ``stored_bytes``, which this release no longer reads."""
    name, size, counted = "turnstore_commit", "stored_bytes", "stored_revision"
    turn: tuple[tuple[str, str], ...] = TURN
    arguments: tuple[tuple[str, str], ...] = ARGUMENTS
    if v2:
        name, turn, arguments = "turnstore_commit_v2", TURN_V2, ARGUMENTS_V2
        size, counted = "counted_bytes", "counted_revision"
    parameters = ", ".join(f"p_{name} {kind}" for name, kind in arguments)
    columns = ", ".join(name for name, _ in turn)
    values = ", ".join(f"p_{name}" for name, _ in turn)
    claimed = (
        "AND k.state = 'running' AND k.claim_id = p_claim;\n"
        "        IF NOT FOUND THEN\n"
        "            RAISE EXCEPTION 'the claim of this Idempotency-Key was lost'"
        f" USING ERRCODE = '{CLAIM_LOST_STATE}';\n"
        "        END IF"
        if v2
        else ""
    )
    stored = stored_value = stored_new = stored_bump = ""
    if counts_revision:
        stored, stored_value = (
            f", {counted}",
            ", CASE WHEN p_stored_bytes IS NOT NULL THEN 1 END",
        )
        stored_new = f",\n            {counted} = excluded.{counted}"
        stored_bump = (
            f",\n            {counted} ="
            " CASE WHEN p_stored_bytes IS NOT NULL THEN c.revision + 1 END"
        )
    create = "CREATE OR REPLACE FUNCTION" if replace else "CREATE FUNCTION"
    refusal = refuse_shredded("p_caller") if refuses_shredded else ""
    return f"""
{create} {name}({parameters},
    OUT revision integer, OUT created_at timestamptz, OUT updated_at timestamptz,
    OUT lease_wanted boolean)
RETURNS SETOF record LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := now();
    v_cutoff timestamptz := v_now - make_interval(secs => p_idle_s);
    v_head record;
BEGIN
    {refusal}
    IF p_expected = 0 THEN
        INSERT INTO conversations AS c (
            id, revision, created_at, updated_at, context_start, owner, lease_wanted,
            expires_at, {size}{stored}
        ) VALUES (
            p_cid, 1, v_now, v_now, p_context_start, p_caller, false, p_expires_at,
            p_stored_bytes{stored_value}
        )
        ON CONFLICT (id) DO UPDATE SET
            revision = 1, updated_at = v_now, context_start = excluded.context_start,
            lease_holder = NULL, lease_expires_at = NULL, {size} = excluded.{size}{stored_new}
        WHERE c.revision = 0 AND c.owner = p_caller AND {LIVE_AND_FREE}
        RETURNING c.revision, c.created_at, c.updated_at, c.lease_wanted INTO v_head;
    ELSE
        UPDATE conversations AS c SET
            revision = c.revision + 1,
            updated_at = v_now,
            context_start = greatest(c.context_start, p_context_start),
            lease_holder = NULL,
            lease_expires_at = NULL,
            expires_at = CASE WHEN c.expires_at IS NOT NULL THEN p_expires_at END,
            {size} = p_stored_bytes{stored_bump}
        WHERE c.id = p_cid AND c.revision = p_expected AND c.owner = p_caller
            AND {LIVE_AND_FREE}
        RETURNING c.revision, c.created_at, c.updated_at, c.lease_wanted INTO v_head;
    END IF;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO turns (conversation_id, seq, created_at, {columns})
    VALUES (p_cid, v_head.revision, v_now, {values});
    IF p_idem_key IS NOT NULL THEN
        UPDATE idempotency_keys AS k SET
            state = 'done', conversation_id = p_cid, revision = v_head.revision,
            expires_at = v_now + make_interval(secs => p_ttl_s)
        WHERE k.owner = p_caller AND k.key = p_idem_key {claimed};
    END IF;
    revision := v_head.revision;
    created_at := v_head.created_at;
    updated_at := v_head.updated_at;
    lease_wanted := v_head.lease_wanted;
    RETURN NEXT;
END
$$
"""
