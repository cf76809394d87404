"""What happens: the use cases, over the store ports and the provider port only.

turns.py            a turn: lease -> load -> If-Match -> window -> exchange -> one commit
exchange.py         one turn's calls: model -> tool calls -> model ... -> its answer
compaction.py       a long context turned into one opaque compaction item
runs.py, run.py     durable turns: a turn that survives its client, its events kept
heartbeat.py        the one loop that renews what this process holds
leases.py, locks.py the turn lease in PostgreSQL, and the in-process lock in front of it
responses.py        POST /v1/responses: a turn asked the OpenAI way (the command side)
kept_responses.py   a kept response's life after it: found, replayed, cancelled, deleted
relay.py            store: false calls, relayed with nothing kept
restore.py          items a client sends back, made the provider's stored bytes again
secret_ids.py       the deployment's own ids, made once from its secret on first use
conversations.py    reads, forks and item edits of a conversation
paging.py           turns read a page at a time, and what a conversation holds
write_gate.py       what every write passes through: its Idempotency-Key, the write budget
owner_limits.py     what one owner may hold open or write on this replica
"""
