"""What the tests run the service over: the in-memory backend of the unit layer, and the pieces
the PostgreSQL and Citus layers share (a keyring of a fresh master key, the tables a test
empties)."""

from __future__ import annotations

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy.ext.asyncio import AsyncEngine

from service.platform.crypto import MasterKeys
from service.platform.settings import Settings
from service.store.ports import Backend
from service.store.postgres import Keyring
from tests.support.memory import MemoryStore

# What `engine` empties before each test (committed data: race tests need it), on PostgreSQL
# and on the Citus cluster (the lists each layer has always emptied).
TABLES = (
    "conversations, idempotency_keys, turn_runs, owner_keys, owner_tombstones, owner_forks,"
    " owner_turns, run_homes, idempotency_receipts"
)
CITUS_TABLES = (
    "conversations, idempotency_keys, turn_runs, owner_keys, api_keys, owner_tombstones, run_homes,"
    " idempotency_receipts"
)


def keyring_for(engine: AsyncEngine, backend: str) -> Keyring | None:
    """A keyring of a fresh master key for an ``*-encrypted`` backend; None (in clear) else."""
    if not backend.endswith("-encrypted"):
        return None
    return Keyring(engine, MasterKeys({"k1": AESGCM(AESGCM.generate_key(bit_length=256))}, "k1"))


def memory_store(settings: Settings) -> MemoryStore:
    """A MemoryStore kept as the settings say (what ``service.app.postgres_store`` reads)."""
    return MemoryStore(
        retention_days=settings.retention_days,
        idempotency_ttl_s=settings.idempotency_ttl_s,
        idempotency_lease_s=settings.turn_lease_s,
        events_ttl_s=settings.turn_events_ttl_s,
        stored_response_ttl_s=settings.stored_response_ttl_days * 86_400,
        forks_per_minute=settings.owner_max_forks_per_minute,
        running_turns=settings.owner_max_running_turns,
    )


def memory_backend(store: MemoryStore, ids_secret: bytes) -> Backend:
    """Every store port over one MemoryStore (no database): what the unit layer hands to
    ``create_app(backend=...)``. Apps on the same store and secret are replicas of one
    deployment: each reads the other's conversations, runs and response ids."""

    async def secret() -> bytes:
        return ids_secret

    return Backend(store, store.notifications, store, ids_secret=secret)  # type: ignore[arg-type]
