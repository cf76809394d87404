"""The PostgreSQL adapter: what the wiring (app.py, cli.py) builds."""

from service.store.postgres.encrypting import ClearRows
from service.store.postgres.keyring import CACHE_S as KEY_CACHE_S
from service.store.postgres.keyring import Keyring, destroy_key
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
]
