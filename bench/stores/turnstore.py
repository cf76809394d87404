"""turnstore's own store: CachedStore over PostgresStore's History (as served), the same
encrypting (ENCRYPTION_KEYS_FILE set, keyring in the same database), and PostgresStore's
History alone."""

from __future__ import annotations

from uuid import UUID

import msgspec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.database import sqlalchemy_url
from bench.workload import Payload
from service.core.model import Append, Origin, Turn
from service.platform.crypto import MasterKeys
from service.platform.db import create_engine
from service.store.cache import CachedStore
from service.store.ports import History
from service.store.postgres import Keyring, PostgresStore

ORIGIN = Origin("openai", "https://api.openai.com/v1", "gpt-5-mini")
POOL_SIZE = 10  # turnstore's default DB_POOL_SIZE (plus as many overflow): 20 at most


class TurnstoreSubject:
    tables = ("conversations", "turns")

    def __init__(self, name: str, store: History, engine: AsyncEngine) -> None:
        self.name = name
        self.store = store
        self._engine = engine

    async def turn(self, conversation: UUID, payload: Payload, history: int) -> None:
        loaded = await self.store.load(conversation)
        revision = loaded.revision if loaded else 0
        assert len(loaded.turns if loaded else []) == history
        items = [msgspec.Raw(raw) for raw in payload.raw_items]
        turn = Turn(payload.user_text, payload.assistant_text, items, ORIGIN)
        await self.store.append(Append(conversation, turn, revision))

    async def close(self) -> None:
        await self._engine.dispose()


async def open_cached(url: str) -> TurnstoreSubject:
    engine = create_engine(sqlalchemy_url(url), pool_size=POOL_SIZE)
    history = CachedStore(PostgresStore.over(engine).history, 64 * 1024 * 1024)
    return TurnstoreSubject("turnstore", history, engine)


async def open_encrypted(url: str) -> TurnstoreSubject:
    engine = create_engine(sqlalchemy_url(url), pool_size=POOL_SIZE)
    masters = MasterKeys({"bench": AESGCM(AESGCM.generate_key(bit_length=256))}, "bench")
    store = PostgresStore.over(engine, keyring=Keyring(engine, masters))
    history = CachedStore(store.history, 64 * 1024 * 1024)
    return TurnstoreSubject("turnstore-encrypted", history, engine)


async def open_uncached(url: str) -> TurnstoreSubject:
    engine = create_engine(sqlalchemy_url(url), pool_size=POOL_SIZE)
    return TurnstoreSubject("turnstore-nocache", PostgresStore.over(engine).history, engine)
