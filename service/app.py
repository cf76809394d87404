"""The ASGI application: wiring only. ``service.app:app`` builds it from the environment.

This is the one module that names concrete adapters (PostgreSQL, the history cache, the
Responses API); everything else sees ports.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from litestar import Litestar, Router
from litestar._openapi.plugin import OpenAPIPlugin
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import (
    Components,
    OpenAPI,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Schema,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from service.api import console
from service.api.auth import authentication, build_authenticator, openapi_security
from service.api.bodies import StrictRequest
from service.api.chat import ChatController
from service.api.compat.conversations import OpenAIConversations
from service.api.compat.models import OpenAIModels
from service.api.compat.responses import OpenAIResponses
from service.api.conversations import ConversationController
from service.api.deps import UseCases, providers
from service.api.durable_turns import TurnController
from service.api.edge import Edge
from service.api.errors import error_response
from service.api.finding import UsageController
from service.api.limits import RequestRules, allowed_hosts, route_pattern
from service.api.ops import healthz, metrics, readyz
from service.api.schemas import ChatRequest, CompactRequest, ForkRequest
from service.api.transfer import TransferController
from service.core.plans import PlanRules
from service.core.sizes import SizeLimit
from service.core.window import Budget, SystemPrompt
from service.platform import heap, tracing
from service.platform.db import create_engine
from service.platform.logs import configure as configure_logging
from service.platform.providers_file import ProviderSpec
from service.platform.settings import Settings, SettingsError
from service.platform.shutdown import shutdown_on_signals
from service.platform.startup import resolve_database
from service.providers.anthropic import AnthropicEndpoint, AnthropicProvider
from service.providers.base import Provider
from service.providers.chat_completions import ChatEndpoint, ChatProvider
from service.providers.fake import FakeProvider
from service.providers.gemini import GeminiEndpoint, GeminiProvider
from service.providers.openai_responses import Endpoint, ResponsesProvider
from service.providers.routing import Routed
from service.providers.wire import WireLimits
from service.store.cache import CachedStore
from service.store.ports import ApiKeys, Backend, Closer, History, Operations
from service.store.postgres import (
    ApiKeyStore,
    Keyring,
    PostgresNotifications,
    PostgresStore,
    StoreConfig,
    owner_digests,
)
from service.store.postgres.secrets import SecretsReader
from service.tools.executor import ToolExecutor
from service.tools.registry import ToolRegistry
from service.usecases.conversations import Conversations
from service.usecases.exchange import Tooling
from service.usecases.kept_responses import KeptResponses
from service.usecases.leases import LeasePolicy, Leases
from service.usecases.owner_limits import WriteBudget
from service.usecases.relay import Relay
from service.usecases.responses import Responses
from service.usecases.restore import Restorer
from service.usecases.runs import TurnRuns
from service.usecases.secret_ids import IdsSource
from service.usecases.turns import TurnService
from service.usecases.write_gate import WriteGate

T = TypeVar("T")


def build_endpoint(settings: Settings) -> Endpoint:
    """The Responses API endpoint the settings name; ValueError naming what is missing."""
    if settings.llm_provider == "azure":
        endpoint, key, deployment = (
            settings.azure_endpoint,
            settings.azure_api_key,
            settings.azure_deployment,
        )
        if not (endpoint and key and deployment):
            raise ValueError("azure needs AZURE_OPENAI_ENDPOINT, _API_KEY and _DEPLOYMENT")
        return Endpoint.azure(endpoint, key, deployment)
    if not (settings.openai_api_key and settings.openai_model):
        raise ValueError("openai needs OPENAI_API_KEY and OPENAI_MODEL")
    return Endpoint.openai(settings.openai_base_url, settings.openai_api_key, settings.openai_model)


def build_provider(settings: Settings) -> Provider:
    """The provider the settings name: PROVIDERS_FILE's, routed by model, or LLM_PROVIDER's."""
    named = settings.providers()
    if named is not None:
        served = [(s.name, _named_provider(s, settings), s.models) for s in named.providers]
        return Routed(served, named.default_model)
    if settings.llm_provider == "fake":
        return FakeProvider()
    if settings.llm_provider == "anthropic":
        return _anthropic(anthropic_endpoint(settings), settings)
    if settings.llm_provider == "gemini":
        return GeminiProvider(gemini_endpoint(settings), _limits(settings))
    if settings.llm_provider == "chat":
        return ChatProvider(chat_endpoint(settings), _limits(settings))
    return _responses(build_endpoint(settings), settings)


def check_provider(settings: Settings) -> None:
    """What the settings' provider needs is there (ValueError naming what is missing), before
    a process starts serving; PROVIDERS_FILE was checked with the settings."""
    if settings.providers_file is None and settings.llm_provider in ("openai", "azure"):
        build_endpoint(settings)
    elif settings.providers_file is None and settings.llm_provider == "anthropic":
        anthropic_endpoint(settings)
    elif settings.providers_file is None and settings.llm_provider == "gemini":
        gemini_endpoint(settings)
    elif settings.providers_file is None and settings.llm_provider == "chat":
        chat_endpoint(settings)


def anthropic_endpoint(settings: Settings) -> AnthropicEndpoint:
    """The Messages API endpoint the settings name; ValueError naming what is missing."""
    key, model = settings.anthropic_api_key, settings.anthropic_model
    if not (key and model):
        raise ValueError("anthropic needs ANTHROPIC_API_KEY and ANTHROPIC_MODEL")
    return AnthropicEndpoint("anthropic", settings.anthropic_base_url, key, model)


def gemini_endpoint(settings: Settings) -> GeminiEndpoint:
    """The Gemini API endpoint the settings name; ValueError naming what is missing."""
    key, model = settings.gemini_api_key, settings.gemini_model
    if not (key and model):
        raise ValueError("gemini needs GEMINI_API_KEY and GEMINI_MODEL")
    return GeminiEndpoint("gemini", settings.gemini_base_url, key, model)


def chat_endpoint(settings: Settings) -> ChatEndpoint:
    """The Chat Completions server the settings name; ValueError naming what is missing (a
    key is optional: a local server has none)."""
    base_url, model = settings.chat_base_url, settings.chat_model
    if not (base_url and model):
        raise ValueError("chat needs CHAT_BASE_URL and CHAT_MODEL")
    return ChatEndpoint("chat", base_url, settings.chat_api_key, model)


def _named_provider(spec: ProviderSpec, settings: Settings) -> Provider:
    """One provider of PROVIDERS_FILE (its file was checked when the settings were made)."""
    if spec.kind == "fake":
        return FakeProvider(name=spec.name)
    model = spec.models[0]
    if spec.kind == "anthropic":
        assert spec.api_key is not None
        endpoint = AnthropicEndpoint(spec.name, spec.base_url, spec.api_key, model)
        return _anthropic(endpoint, settings)
    if spec.kind == "gemini":
        assert spec.api_key is not None
        gemini = GeminiEndpoint(spec.name, spec.base_url, spec.api_key, model)
        return GeminiProvider(gemini, _limits(settings))
    if spec.kind == "chat":
        assert spec.base_url is not None
        server = ChatEndpoint(spec.name, spec.base_url, spec.api_key, model)
        return ChatProvider(server, _limits(settings))
    if spec.kind == "azure":
        assert spec.base_url is not None and spec.api_key is not None
        return _responses(Endpoint.azure(spec.base_url, spec.api_key, model, spec.name), settings)
    base_url = spec.base_url or settings.openai_base_url
    return _responses(Endpoint.openai(base_url, spec.api_key, model, spec.name), settings)


def _anthropic(endpoint: AnthropicEndpoint, settings: Settings) -> Provider:
    return AnthropicProvider(endpoint, _limits(settings), max_tokens=settings.anthropic_max_tokens)


def _responses(endpoint: Endpoint, settings: Settings) -> Provider:
    return ResponsesProvider(endpoint, _limits(settings))


def _limits(settings: Settings) -> WireLimits:
    return WireLimits(
        settings.upstream_connect_timeout_s,
        settings.upstream_read_timeout_s,
        settings.upstream_max_body_bytes,
    )


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


def postgres_store(
    engine: AsyncEngine, settings: Settings, keyring: Keyring | None = None
) -> PostgresStore:
    """The PostgreSQL store ports (also for the CLI's commands)."""
    config = StoreConfig(
        retention_days=settings.retention_days,
        idempotency_ttl_s=settings.idempotency_ttl_s,
        idempotency_lease_s=settings.turn_lease_s,  # renewed while a write runs (write_gate.py)
        events_ttl_s=settings.turn_events_ttl_s,
        stored_response_ttl_s=settings.stored_response_ttl_days * 86_400,
        forks_per_minute=settings.owner_max_forks_per_minute,
        running_turns=settings.owner_max_running_turns,
    )
    return PostgresStore.over(engine, config, keyring)


def build_keyring(settings: Settings, engine: AsyncEngine, closers: list[Closer]) -> Keyring | None:
    """The keyring with ENCRYPTION_KEYS_FILE (None: stored in clear), in the data's database
    unless KEYRING_DATABASE_URL names another (whose pool is closed with the rest)."""
    masters = settings.master_keys()
    if masters is None:
        return None
    digest = owner_digests(engine)  # by the data's secrets, wherever the keyring lives
    if settings.keyring_database_url:
        engine = create_engine(settings.keyring_database_url, pool_size=2)
        closers.append(engine.dispose)
    return Keyring(engine, masters, digest)


def run_with_api_keys(url: str, action: Callable[[ApiKeyStore], Awaitable[T]]) -> T:
    """Run one API key operation against ``url`` with a pool of its own (for the CLI)."""

    async def main() -> T:
        engine = create_engine(url, pool_size=1)
        try:
            return await action(ApiKeyStore(engine))
        finally:
            await engine.dispose()

    return asyncio.run(main())


def postgres_backend(settings: Settings, *, store: PostgresStore | None = None) -> Backend:
    """PostgreSQL behind every port: the database of the settings (the embedded one unless
    DATABASE_URL names one), or the one of ``store`` (a store the caller made, e.g. a test's
    seam), which is then used as it is, without the history cache."""
    closers: list[Closer] = []
    url = settings.database_url
    if store is None:
        url, stop_database = resolve_database(settings)
        closers.append(_async(stop_database))
        engine = create_engine(
            url,
            pool_size=settings.db_pool_size,
            statement_cache_size=settings.db_statement_cache_size,
        )
        store = postgres_store(engine, settings, build_keyring(settings, engine, closers))
        cache = settings.history_cache_bytes
        if cache > 0:  # it wraps the one port it caches; the others are PostgreSQL's own
            store = replace(store, history=CachedStore(store.history, cache))
    assert url is not None  # a store handed in came with the settings' database
    engine = store.db.engine
    # Closed in reverse: the pool after everything that uses it (the listener pings through
    # it; a ping after the pool's disposal would open a connection nobody closes).
    closers.append(engine.dispose)
    listener = PostgresNotifications(settings.database_listen_url or url, engine)
    closers.append(listener.close)
    secrets = SecretsReader(engine)

    async def ids_secret() -> bytes:
        return (await secrets.get()).ids

    return Backend(store.stores(), listener, store.ops, ApiKeyStore(engine), closers, ids_secret)


@dataclass
class Services:
    """Everything the HTTP layer is wired to, and how to let it go at shutdown."""

    history: History  # as the use cases see it: through the history cache, if any
    ops: Operations
    cases: UseCases
    api_keys: ApiKeys | None
    closers: list[Closer] = field(default_factory=list)

    async def close(self) -> None:
        for close in reversed(self.closers):
            await close()


def build_services(
    settings: Settings, backend: Backend | None = None, provider: Provider | None = None
) -> Services:
    """The use cases over ``backend`` (PostgreSQL's unless one is handed in) and the
    provider (the settings' unless one is handed in)."""
    backend = backend or postgres_backend(settings)
    closers = list(backend.closers)
    provider = provider or build_provider(settings)
    closers.append(provider.close)
    tooling = build_tooling(settings)
    if tooling is not None:
        closers.append(_async(tooling.executor.shutdown))
    stores = backend.stores
    leases = Leases(stores.history, stores.places, backend.notifications, _lease_policy(settings))
    closers.append(leases.close)
    gate = WriteGate(
        stores.idempotency,
        lease_s=settings.turn_lease_s,
        budget=WriteBudget(settings.owner_max_write_bytes_per_minute),
    )
    closers.append(gate.close)
    prompt = settings.system_prompt_file
    turns = TurnService(
        stores.reads,
        provider,
        leases=leases,
        system_prompt=SystemPrompt.from_file(prompt) if prompt else None,
        budget=Budget(settings.context_max_turns, settings.context_max_request_bytes),
        tooling=tooling,
        gate=gate,
        size_limit=SizeLimit(settings.max_conversation_bytes),
    )
    runs = TurnRuns(
        turns,
        stores.run_writes,
        stores.run_reads,
        backend.notifications,
        heartbeat_s=settings.turn_lease_s,
        readers=settings.owner_max_event_readers,
    )
    closers.append(lambda: runs.close(settings.shutdown_grace_s))  # first: runs use the rest
    rules = PlanRules(
        max_message_chars=settings.max_message_chars,
        idempotency=stores.idempotency is not None,
        own_tools=turns.tool_names,
        models=settings.served_models(),
        configured_model=provider.origin.model,
        instructions=settings.instructions,
        compact_threshold=settings.compact_threshold(),
        compact_default=settings.compact_threshold_tokens,
        max_line_bytes=settings.max_body_bytes,
        max_import_bytes=2 * settings.max_conversation_bytes + settings.max_body_bytes,
    )
    ids = IdsSource(backend.ids_secret) if backend.ids_secret else IdsSource(os.urandom(32))
    restorer = Restorer(stores.reads, ids)
    size = SizeLimit(settings.max_conversation_bytes)
    conversations = Conversations(stores.reads, stores.history, stores.edits, restorer, size, gate)
    relay = Relay(restorer, provider, turns.prompt, rules)
    kept = KeptResponses(turns, runs, restorer, conversations)
    responses = Responses(turns, runs, relay, restorer, conversations, rules, kept)
    cases = UseCases(
        turns, runs, conversations, responses, kept, rules, settings.sse_keepalive_s, gate, ids
    )
    return Services(stores.history, backend.ops, cases, backend.api_keys, closers)


def _lease_policy(settings: Settings) -> LeasePolicy:
    return LeasePolicy(
        queue=settings.turn_concurrency == "queue",
        queue_wait_s=settings.turn_queue_wait_s,
        lease_s=settings.turn_lease_s,
        max_queued=settings.owner_max_queued_turns,
        window_bytes=settings.context_max_request_bytes,
    )


def create_app(
    settings: Settings | None = None,
    *,
    backend: Backend | None = None,
    provider: Provider | None = None,
) -> Litestar:
    """The app over ``backend`` (PostgreSQL's, see ``postgres_backend``, unless one is handed
    in) and ``provider`` (the settings', unless one is handed in)."""
    settings = settings or Settings.from_env()
    tracing.configure()
    services = build_services(settings, backend, provider)

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        # SIGTERM/SIGINT also end open streams (service/shutdown.py); everything else drains.
        with shutdown_on_signals():
            try:
                yield
            finally:
                await services.close()

    # The operations that have an owner: authenticated (by the guard, before the body is read).
    guard, owner = authentication(build_authenticator(settings, services.api_keys))
    components, security = openapi_security(settings)
    owned = _OneAppRouter(
        "/",
        route_handlers=[
            ChatController,
            ConversationController,
            UsageController,
            TransferController,
            TurnController,
            OpenAIConversations,
            OpenAIResponses,
            OpenAIModels,
        ],
        # AUTH_MODE=none: every request's owner is "anonymous", asked by the handler's
        # dependency; no guard (Litestar copies the route handler for each guard call).
        guards=[guard] if settings.auth_mode != "none" else [],
        security=security,
    )
    app = Litestar(
        route_handlers=[owned, healthz, readyz, metrics, console.router],
        dependencies={
            "ops": _constant(services.ops),
            **providers(owner, services.cases),
        },
        exception_handlers={Exception: error_response},
        request_max_body_size=settings.max_body_bytes,
        request_class=StrictRequest,
        lifespan=[lifespan],
        openapi_config=_openapi(components),
        logging_config=None,
        debug=False,
    )
    # The OpenAPI document is built when first asked for (GET /schema), not here: building it
    # is some 40% of an app's start-up, which every app (each test's too) would pay unread.
    app.plugins.get(OpenAPIPlugin).__class__ = _AmendedOpenAPI
    # Every request and response passes the edge (service/api/edge.py), outside the router:
    # unmatched routes too. No Litestar middleware: each route's stack stays the handler's.
    app.asgi_handler = Edge(app.asgi_handler, _rules(settings, app))
    return app


class _OneAppRouter(Router):
    """A router built for one app: Litestar deep-copies every router it registers (one router
    may serve several apps), a third of an app's start-up for this one's controllers; this one
    serves one app, so its copy is itself."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _OneAppRouter:
        return self


class _AmendedOpenAPI(OpenAPIPlugin):
    """Litestar's OpenAPI plugin, whose document, once built, gets turnstore's amendments."""

    __slots__ = ()

    def provide_openapi(self) -> OpenAPI:
        built = self._openapi is not None
        openapi = super().provide_openapi()
        if not built:
            _close_request_schemas(openapi)
            _document_event_streams(openapi)
        return openapi


def _close_request_schemas(openapi: OpenAPI) -> None:
    """Request bodies refuse unknown fields: the OpenAPI document says so too."""
    schemas = openapi.components.schemas or {}
    for struct in (ChatRequest, ForkRequest, CompactRequest):
        schema = schemas.get(struct.__name__)
        if isinstance(schema, Schema):
            schema.additional_properties = False


def _document_event_streams(openapi: OpenAPI) -> None:
    """``POST /v1/responses`` answers 200 with a Response, or with ``"stream": true`` its
    event stream: both are documented (Litestar documents one media type per status)."""
    operation = openapi.paths["/v1/responses"].post  # type: ignore[index]
    ok = operation.responses["200"] if operation and operation.responses else None
    if isinstance(ok, OpenAPIResponse) and ok.content is not None:
        field = Schema(type=OpenAPIType.STRING)
        stream = Schema(
            type=OpenAPIType.OBJECT,
            description="Server-Sent Events: OpenAI's, each an event name and its JSON data",
            properties={"event": field, "data": field, "id": field},
            required=["data"],
        )
        ok.content["text/event-stream"] = OpenAPIMediaType(schema=stream)


def _openapi(components: Components) -> OpenAPIConfig:
    # GET /schema is the OpenAPI document itself (the contract); a browsable UI is at
    # /schema/swagger (its assets served by turnstore: it works offline).
    plugins = [JsonRenderPlugin(path=["/", "/openapi.json"]), console.swagger_plugin("/swagger")]
    return OpenAPIConfig(
        title="turnstore",
        version="1",
        path="/schema",
        components=components,
        render_plugins=plugins,
    )


def _rules(settings: Settings, app: Litestar) -> RequestRules:
    hosts = allowed_hosts(settings.auth_mode, settings.allowed_hosts)
    return RequestRules(
        allowed_hosts=hosts,
        send_timeout_s=settings.client_send_timeout_s,
        routes=route_pattern(route.path for route in app.routes),
    )


def _constant(value: Any) -> Provide:
    return Provide(lambda: value, use_cache=True, sync_to_thread=False)


def _async(action: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        action()

    return run


@functools.cache
def _app_from_environment() -> Litestar:
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        sys.stderr.write(f"turnstore: {exc}\n")
        raise SystemExit(2) from None
    configure_logging(settings.log_format, settings.log_level.upper())
    app = create_app(settings)
    app.on_startup.append(heap.freeze_startup)  # served: after the lifespan's start
    return app


def __getattr__(name: str) -> Any:
    """``service.app:app`` for any ASGI server, built from the environment on first access."""
    if name == "app":
        return _app_from_environment()
    raise AttributeError(name)
