"""langchain-postgres: PostgresChatMessageHistory over a psycopg pool (one JSONB row per
message; the reasoning item rides in the AIMessage's additional_kwargs, as langchain-openai
keeps it)."""

from __future__ import annotations

from uuid import UUID

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_postgres import PostgresChatMessageHistory
from psycopg_pool import AsyncConnectionPool

from bench.database import libpq_url
from bench.workload import Payload

TABLE = "lc_messages"


def messages(payload: Payload) -> list[BaseMessage]:
    reply = AIMessage(
        content=payload.assistant_text,
        id=payload.message_item["id"],
        additional_kwargs={"reasoning": payload.reasoning_item},
    )
    return [HumanMessage(payload.user_text), reply]


class LangchainSubject:
    name = "langchain-postgres"
    tables = (TABLE,)

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    async def turn(self, conversation: UUID, payload: Payload, history: int) -> None:
        async with self.pool.connection() as conn:
            read = PostgresChatMessageHistory(TABLE, str(conversation), async_connection=conn)
            earlier = await read.aget_messages()
        assert len(earlier) == 2 * history
        async with self.pool.connection() as conn:
            write = PostgresChatMessageHistory(TABLE, str(conversation), async_connection=conn)
            await write.aadd_messages(messages(payload))

    async def close(self) -> None:
        await self.pool.close()


async def open_langchain(url: str) -> LangchainSubject:
    pool = AsyncConnectionPool(libpq_url(url), min_size=10, max_size=20, open=False)
    await pool.open()
    async with pool.connection() as conn:
        await PostgresChatMessageHistory.acreate_tables(conn, TABLE)
    return LangchainSubject(pool)
