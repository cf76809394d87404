"""What the tests run the service over: the in-memory backend of the unit layer, and the pieces
the PostgreSQL and Citus layers share (a keyring of a fresh master key, the tables a test
empties)."""

from __future__ import annotations

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy.ext.asyncio import AsyncEngine

from service.platform.crypto import MasterKeys
from service.store.ports import Backend
from service.store.postgres import Keyring
from tests.support.memory import MemoryStore

# What `engine` empties before each test (committed data: race tests need it), on PostgreSQL
# and on the Citus cluster (the lists each layer has always emptied).
TABLES = (
    "conversations, idempotency_keys, turn_runs, owner_keys, owner_tombstones, owner_forks,"
    " owner_turns"
)
CITUS_TABLES = "conversations, idempotency_keys, turn_runs, owner_keys, api_keys, owner_tombstones"


def keyring_for(engine: AsyncEngine, backend: str) -> Keyring | None:
    """A keyring of a fresh master key for an ``*-encrypted`` backend; None (in clear) else."""
    if not backend.endswith("-encrypted"):
        return None
    return Keyring(engine, MasterKeys({"k1": AESGCM(AESGCM.generate_key(bit_length=256))}, "k1"))


def memory_backend(store: MemoryStore | None = None) -> Backend:
    """Every store port over one MemoryStore (no database): what the unit layer hands to
    ``create_app(backend=...)``."""
    store = store or MemoryStore()
    return Backend(store, store, store.notifications, store, store)
