"""The ASGI application: wiring only. ``service.app:app`` builds it from the environment."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Router
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin

from service.api.chat import ChatController
from service.api.conversations import ConversationController
from service.api.correlation import add_correlation_header
from service.api.errors import error_response
from service.api.limits import head_limit_middleware
from service.api.ops import healthz, metrics, readyz
from service.auth import authentication, build_authenticator, openapi_security
from service.context import Budget, SystemPrompt
from service.db import create_engine, resolve_database
from service.exchange import Tooling
from service.keys import ApiKeyStore
from service.logs import configure as configure_logging
from service.logs import correlation_middleware
from service.providers.base import Provider
from service.providers.fake import FakeProvider
from service.providers.responses import ResponsesProvider
from service.settings import Settings
from service.shutdown import shutdown_on_signals
from service.store.base import ConversationStore
from service.store.cache import CachedStore
from service.store.idempotency import IdempotencyStore
from service.store.postgres import PostgresStore
from service.tools.base import ToolRegistry
from service.tools.gate import ToolExecutor
from service.turns import TurnService


def build_provider(settings: Settings) -> Provider:
    if settings.llm_provider == "fake":
        return FakeProvider()
    return ResponsesProvider.from_settings(settings)


def build_tooling(settings: Settings) -> Tooling | None:
    registry = ToolRegistry.from_spec(settings.tools)
    if not len(registry):
        return None
    return Tooling(
        registry,
        ToolExecutor(settings.tool_workers),
        call_budget=settings.tool_call_budget,
        timeout_s=settings.tool_timeout_s,
        max_rounds=settings.tool_max_rounds,
    )


def create_app(
    settings: Settings | None = None,
    *,
    store: ConversationStore | None = None,
    provider: Provider | None = None,
    api_keys: ApiKeyStore | None = None,
) -> Litestar:
    settings = settings or Settings.from_env()
    stop_database: Callable[[], None] = lambda: None  # noqa: E731
    idempotency: IdempotencyStore | None = None
    if store is None:
        url, stop_database = resolve_database(settings)
        engine = create_engine(
            url,
            pool_size=settings.db_pool_size,
            statement_cache_size=settings.db_statement_cache_size,
        )
        store = PostgresStore(
            engine,
            retention_days=settings.retention_days,
            idempotency_ttl_s=settings.idempotency_ttl_s,
        )
        # A claimed key whose replica died is taken over once the longest turn is surely over.
        lease_s = settings.upstream_read_timeout_s * settings.tool_max_rounds + 60
        idempotency = IdempotencyStore(engine, ttl_s=settings.idempotency_ttl_s, lease_s=lease_s)
        api_keys = api_keys or ApiKeyStore(engine)
        if settings.history_cache_bytes > 0:
            store = CachedStore(store, settings.history_cache_bytes)
    guard, owner = authentication(build_authenticator(settings, api_keys))
    provider = provider or build_provider(settings)
    prompt = settings.system_prompt_file
    tooling = build_tooling(settings)
    turns = TurnService(
        store,
        provider,
        max_message_chars=settings.max_message_chars,
        system_prompt=SystemPrompt.from_file(prompt) if prompt else None,
        budget=Budget(settings.context_max_turns, settings.context_max_request_bytes),
        tooling=tooling,
        idempotency=idempotency,
    )

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        # SIGTERM/SIGINT also end open streams (service/shutdown.py); everything else drains.
        with shutdown_on_signals():
            try:
                yield
            finally:
                await provider.close()
                await store.close()
                stop_database()
                if tooling is not None:
                    tooling.executor.shutdown()

    def constant(value: Any) -> Provide:
        return Provide(lambda: value, use_cache=True, sync_to_thread=False)

    # The operations that have an owner: authenticated (by the guard, before the body is read).
    components, security = openapi_security(settings)
    owned = Router(
        "/",
        route_handlers=[ChatController, ConversationController],
        guards=[guard],
        security=security,
    )
    return Litestar(
        route_handlers=[owned, healthz, readyz, metrics],
        dependencies={
            "settings": constant(settings),
            "store": constant(store),
            "turns": constant(turns),
            "owner": Provide(owner),  # the guard's result (service/auth.py)
        },
        exception_handlers={Exception: error_response},
        before_send=[add_correlation_header],
        middleware=[correlation_middleware, head_limit_middleware],
        request_max_body_size=settings.max_body_bytes,
        lifespan=[lifespan],
        openapi_config=OpenAPIConfig(
            title="turnstore",
            version="1",
            path="/schema",
            components=components,
            # GET /schema is the OpenAPI document itself (the contract); a browsable UI is at
            # /schema/swagger.
            render_plugins=[
                JsonRenderPlugin(path=["/", "/openapi.json"]),
                SwaggerRenderPlugin(path="/swagger"),
            ],
        ),
        logging_config=None,
        debug=False,
    )


def __getattr__(name: str) -> Any:
    """``service.app:app`` for any ASGI server, built from the environment on first access."""
    if name == "app":
        configure_logging(os.environ.get("LOG_FORMAT", "json"))
        return create_app()
    raise AttributeError(name)
