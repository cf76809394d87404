"""Where conversations, runs and Idempotency-Key claims are kept.

ports.py        the ports, each what one kind of caller needs (Reads, History, Edits, Places,
                RunWrites, RunReads, IdempotencyStore, Operations, ApiKeys, Notifications),
                and Stores/Backend, which carry one backend's ports to the wiring
cache.py        the replica-local history cache: the History port over History, nothing else
postgres/       the PostgreSQL adapter: one class per port over one adapter value
cursor.py, pages.py, subscribers.py   what every backend shares: the listing cursor, how
                transcript pages are cut, this process's notification subscribers
"""
