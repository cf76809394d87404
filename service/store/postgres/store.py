"""Every store port of one PostgreSQL database: one class each, composed over one adapter value
(adapter.py), none inheriting another. What the wiring hands out (service/app.py) and the
command line uses; a test swaps a port for a seam of its own with ``dataclasses.replace``."""

from __future__ import annotations

from dataclasses import dataclass, fields

from sqlalchemy.ext.asyncio import AsyncEngine

from service.store.ports import (
    Edits,
    History,
    IdempotencyStore,
    Operations,
    Places,
    Reads,
    RunReads,
    RunWrites,
    Stores,
)
from service.store.postgres.adapter import Adapter, StoreConfig
from service.store.postgres.claims import PostgresIdempotency
from service.store.postgres.edits import PostgresEdits
from service.store.postgres.history import PostgresHistory
from service.store.postgres.housekeeping import PostgresOperations
from service.store.postgres.keyring import Keyring
from service.store.postgres.owners import PostgresOwners
from service.store.postgres.places import PostgresPlaces
from service.store.postgres.reads import PostgresReads
from service.store.postgres.run_homes import KnownRuns
from service.store.postgres.run_store import PostgresRunReads, PostgresRunWrites


@dataclass(frozen=True)
class PostgresStore:
    db: Adapter
    reads: Reads
    history: History
    edits: Edits
    places: Places
    run_writes: RunWrites
    run_reads: RunReads
    idempotency: IdempotencyStore
    ops: Operations
    owners: PostgresOwners  # the shred's (`turnstore owners shred`): no use case's

    @classmethod
    def over(
        cls, engine: AsyncEngine, config: StoreConfig | None = None, keyring: Keyring | None = None
    ) -> PostgresStore:
        """Every port over ``engine``, with the limits of ``config`` (None: StoreConfig()'s) and
        ``keyring`` (None: what users said is stored in clear)."""
        db = Adapter(engine, config, keyring)
        runs = KnownRuns(db)
        return cls(
            db=db,
            reads=PostgresReads(db),
            history=PostgresHistory(db),
            edits=PostgresEdits(db),
            places=PostgresPlaces(db),
            run_writes=PostgresRunWrites(db, runs),
            run_reads=PostgresRunReads(db, runs),
            idempotency=PostgresIdempotency(db),
            ops=PostgresOperations(db),
            owners=PostgresOwners(db),
        )

    def stores(self) -> Stores:
        """The ports the use cases are handed (service/app.py build_services): every one that
        Stores names, as this store holds it (a test's seam too)."""
        return Stores(**{port.name: getattr(self, port.name) for port in fields(Stores)})
