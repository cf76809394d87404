"""OpenAI Agents SDK: SQLAlchemySession over asyncpg (one row per item, JSON text)."""

from __future__ import annotations

from uuid import UUID

from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from bench.database import sqlalchemy_url
from bench.workload import Payload


class AgentsSubject:
    name = "agents-sqlalchemy"
    tables = ("agent_sessions", "agent_messages")

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # One session object per conversation, kept: the SDK at its cheapest.
        self.sessions: dict[UUID, SQLAlchemySession] = {}

    async def turn(self, conversation: UUID, payload: Payload, history: int) -> None:
        session = self.sessions.get(conversation)
        if session is None:
            session = self.sessions[conversation] = SQLAlchemySession(
                str(conversation), engine=self.engine
            )
        items = await session.get_items()
        assert len(items) == 3 * history
        await session.add_items(payload.items)  # type: ignore[arg-type]

    async def close(self) -> None:
        await self.engine.dispose()


async def open_agents(url: str) -> AgentsSubject:
    engine = create_async_engine(sqlalchemy_url(url), pool_size=10, max_overflow=10)
    setup = SQLAlchemySession("setup", engine=engine, create_tables=True)
    await setup.get_items()  # creates the tables
    return AgentsSubject(engine)
