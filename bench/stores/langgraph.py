"""LangGraph: a one-node graph over MessagesState with AsyncPostgresSaver as checkpointer.
A turn is one ainvoke with the user message; the node checks the history it was handed
and returns the reply (the same AIMessage as for langchain-postgres)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from bench.database import libpq_url
from bench.stores.langchain import messages
from bench.workload import Payload


async def model(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
    settings = config["configurable"]
    assert len(state["messages"]) == settings["expect"]
    return {"messages": [settings["reply"]]}


class LanggraphSubject:
    name = "langgraph"
    tables = ("checkpoints", "checkpoint_blobs", "checkpoint_writes")

    def __init__(self, pool: AsyncConnectionPool, graph: Any) -> None:
        self.pool = pool
        self.graph = graph

    async def turn(self, conversation: UUID, payload: Payload, history: int) -> None:
        user, reply = messages(payload)
        configurable = {"thread_id": str(conversation), "reply": reply, "expect": 2 * history + 1}
        await self.graph.ainvoke({"messages": [user]}, {"configurable": configurable})

    async def close(self) -> None:
        await self.pool.close()


async def open_langgraph(url: str) -> LanggraphSubject:
    connection = {"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}
    pool = AsyncConnectionPool(
        libpq_url(url), min_size=10, max_size=20, kwargs=connection, open=False
    )
    await pool.open()
    saver = AsyncPostgresSaver(pool)  # type: ignore[arg-type]
    await saver.setup()
    graph = (
        StateGraph(MessagesState)
        .add_node("model", model)
        .add_edge(START, "model")
        .add_edge("model", END)
        .compile(checkpointer=saver)
    )
    return LanggraphSubject(pool, graph)
