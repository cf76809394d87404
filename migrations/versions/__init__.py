"""The data's migrations, oldest first (version table ``alembic_version``); each one's
docstring says what it changes and what its downgrade loses (migrations/__init__.py: each
carries its own SQL).

- 2026_11_30_0001_conversations_and_turns.py: conversations and their append-only turns
- 2026_11_30_0002_turn_origin.py: which provider, endpoint and model made a turn's items
- 2026_11_30_0003_context_window.py: the committed window start; what the model saw per turn
- 2026_11_30_0004_tool_calls.py: a turn's tool calls, as proposed and as the gate ruled
- 2026_11_30_0005_owners_keys_idempotency.py: owners, API keys, Idempotency-Keys, retention
- 2026_11_30_0006_turn_status_idempotency_by_reference.py: a turn's status; a key names its
  commit
- 2026_11_30_0007_turn_leases.py: turn leases: which turn may call the provider now
- 2026_11_30_0008_durable_turns.py: durable turns: runs and the events their clients saw
- 2026_11_30_0009_conversation_metadata.py: conversation metadata; conversations without turns
- 2026_11_30_0010_history_rewrites.py: when a conversation's earlier history last changed
- 2026_11_30_0011_encryption_at_rest.py: sealed columns beside the clear ones
- 2026_12_02_0012_turn_events_conversation_id.py: the events' distribution column on Citus
- 2026_12_02_0013_usage_transcript_response.py: usage, a transcript, a response's record
- 2026_12_02_0014_stored_responses.py: /v1 responses kept, resumed and deleted
- 2026_12_02_0015_compaction.py: the compacted context a turn ran on
- 2026_12_02_0016_conversation_size_owner_forks.py: a conversation's size; owners' recent forks
- 2026_12_02_0017_commit_function.py: turnstore_commit(): a turn's commit as one function
- 2026_12_07_0018_owner_turns.py: each owner's running turns; which revision a size counts
- 2026_12_07_0019_secrets_tombstones.py: the deployment's secrets, shred tombstones,
  turnstore_commit_v2()
- 2026_12_07_0020_turn_kind_key.py: a turn's provider kind and key fingerprint
- 2026_12_07_0021_finding.py: conversations' search terms and the fork they came from; the
  indexes of the listing's filters; turnstore_commit_v3()
- 2026_12_07_0022_run_functions.py: a durable turn's writes of its run as functions, each on
  its conversation's worker on Citus
- 2026_12_07_0023_run_homes.py: each durable turn's conversation, found by the turn's id alone
  (on Citus a plain table on the coordinator)
- 2026_12_08_0024_idempotency_receipts.py: a keyed write's receipt beside its conversation
  (written and read on Citus only), and the conversation each claim writes
"""
