"""The PostgreSQL adapter: what the wiring (app.py, cli.py) builds.

statements.py, run_statements.py, idempotency.py   the SQL, as named statements
tx.py         the one way to the database: compiled statements on the asyncpg connection
rows.py       values into rows and back, sealed under the owner's key or in clear
store.py      PostgresStore (with adapter.py, edits.py, housekeeping.py)
run_store.py  PostgresRuns; listener.py PostgresNotifications
keyring.py, sealed.py, encrypting.py   encryption at rest; keys.py  API keys
"""

from service.store.postgres.encrypting import ClearRows
from service.store.postgres.keyring import CACHE_S as KEY_CACHE_S
from service.store.postgres.keyring import Keyring, destroy_key, live_keys, owner_digests
from service.store.postgres.keys import ApiKeyStore
from service.store.postgres.listener import PostgresNotifications
from service.store.postgres.run_store import PostgresRuns
from service.store.postgres.store import PostgresStore

__all__ = [
    "KEY_CACHE_S",
    "ApiKeyStore",
    "ClearRows",
    "Keyring",
    "PostgresNotifications",
    "PostgresRuns",
    "PostgresStore",
    "destroy_key",
    "live_keys",
    "owner_digests",
]
