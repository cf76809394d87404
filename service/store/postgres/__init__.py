"""The PostgreSQL adapter: what the wiring (app.py, cli.py) builds.

store.py      PostgresStore: every store port, one class each, over one adapter value
adapter.py    that value (engine, statements, keyring, StoreConfig's limits, running turns'
              places) and what several ports do with it
reads.py      Reads: the conversation, the listing, transcript pages, turns and their sizes
history.py    History: load, a turn's lease and window read, the removals; commit.py its commit
edits.py      Edits: new conversations, forks (forks.py, shared with the commit), metadata
places.py     Places: leases, running turns' places (running_turns.py), forks' places
run_store.py  RunWrites and RunReads: durable turns' runs and events; run_homes.py where
              each run is (its conversation: on Citus read by the run's id alone)
claims.py     IdempotencyStore; housekeeping.py Operations; owners.py the owners' shred
listener.py   PostgresNotifications; keys.py ApiKeyStore (API keys)
statements.py, run_statements.py, idempotency.py   the SQL, as named statements
tx.py         the one way to the database: compiled statements on the asyncpg connection
rows.py       values into rows and back, sealed under the owner's key or in clear
keyring.py, sealed.py, encrypting.py   encryption at rest; secrets.py the deployment's secrets
placement.py  where each table lives on Citus (`turnstore db distribute`)
"""

from service.store.postgres.adapter import Adapter, StoreConfig
from service.store.postgres.encrypting import ClearRows
from service.store.postgres.keyring import CACHE_S as KEY_CACHE_S
from service.store.postgres.keyring import Keyring, destroy_key, live_keys, owner_digests
from service.store.postgres.keys import ApiKeyStore
from service.store.postgres.listener import PostgresNotifications
from service.store.postgres.store import PostgresStore

__all__ = [
    "KEY_CACHE_S",
    "Adapter",
    "ApiKeyStore",
    "ClearRows",
    "Keyring",
    "PostgresNotifications",
    "PostgresStore",
    "StoreConfig",
    "destroy_key",
    "live_keys",
    "owner_digests",
]
