"""Every promise on every writing route, by construction.

The OpenAPI document's writing operations (POST, PUT, PATCH, DELETE) are walked and each is
held to the contract's promises for writes (Limits, What commits):

- the same ``Idempotency-Key`` twice writes once, and the second answer is the first's; sent
  to two replicas at once, it writes once;
- a write past MAX_CONVERSATION_BYTES is ``422 conversation_full`` and keeps nothing;
- past the owner's write budget (OWNER_MAX_WRITE_BYTES_PER_MINUTE) it is ``429`` before any
  provider call, and keeps nothing;
- once its owner is shredded (a tombstone), it keeps nothing;
- with the database unreachable it is ``storage_error``, and the next request after the
  database is back succeeds at once.

``ROUTES`` has one row per writing operation, saying how to call it and what it does. A route
added to the API without its row fails ``test_every_writing_route_has_its_row``: its author
then says here which promises hold for it, and the tests below hold it to them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.api.errors import WRITE_ERRORS
from service.app import create_app
from service.core.errors import ConversationFull
from service.platform.settings import Settings
from service.providers.base import Compacted, ProviderEvent, ProviderRequest
from service.providers.fake import FakeProvider
from service.store.postgres import PostgresStore
from tests.support.helpers import serve
from tests.support.proxy import TcpProxy

WRITING = ("post", "put", "patch", "delete")


class CountingProvider(FakeProvider):
    """The built-in fake, counting the calls it gets (a limit is decided before any)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        self.calls += 1
        async for event in super().respond(request, stream=stream):
            yield event

    async def compact(self, request: ProviderRequest) -> Compacted:
        self.calls += 1
        return await super().compact(request)


@dataclass
class Ctx:
    """What a route's request names: a conversation with two turns (``cid``), its latest
    item, a stored /v1 response and a finished streamed turn."""

    cid: str
    item_id: str
    response_id: str
    turn_id: str
    revision: int = 2  # the conversation's

    @property
    def conv(self) -> str:
        return "conv_" + self.cid.replace("-", "")


Request = tuple[str, str, dict[str, Any]]  # method, path, httpx keyword arguments


@dataclass(frozen=True)
class Route:
    """A writing operation and what it does.

    ``request``: how to call it for a context (``big``: carrying ``size`` bytes of content
    more than it needs). ``effect``: ``adds`` content (counted against the conversation's size
    and the owner's write budget), ``edits`` or ``removes`` what is stored, ``marks`` a run
    (a cancel: the same answer again by itself), or ``relays`` (writes nothing at all).
    ``grows``: a write that can pass MAX_CONVERSATION_BYTES."""

    request: Callable[[Ctx, int], Request]
    effect: Literal["adds", "edits", "removes", "marks", "relays"]
    grows: bool = False
    why_not: dict[str, str] = field(default_factory=dict)  # promise -> why it does not apply

    @property
    def commits(self) -> bool:
        return self.effect in ("adds", "edits", "removes")


def _chat(stream: bool) -> Callable[[Ctx, int], Request]:
    def request(ctx: Ctx, big: int) -> Request:
        path = "/api/v1/chat/stream" if stream else "/api/v1/chat"
        body = {"message": "more " + "x" * big, "conversation_id": ctx.cid}
        return "POST", path, {"json": body}

    return request


def _tool(description: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "function", "name": "noop", "description": description,
            "parameters": parameters}  # fmt: skip


def _import(ctx: Ctx, big: int) -> Request:
    """An export of a conversation of one turn (service/core/export_lines.py), ``big`` bytes more."""
    said = "imported " + "x" * big
    head = {"id": ctx.cid, "metadata": {}, "created_at": "2026-01-01T00:00:00Z",
            "updated_at": "2026-01-01T00:00:00Z", "revision": 1, "window_start": 1}  # fmt: skip
    turn = {
        "revision": 1,
        "created_at": "2026-01-01T00:00:00Z",
        "messages": [{"role": "user", "content": said}, {"role": "assistant", "content": "ok"}],
        "replay_items": [{"type": "message", "role": "user", "content": said}],
    }
    body = (json.dumps(head) + "\n" + json.dumps(turn) + "\n").encode()
    return (
        "POST",
        "/api/v1/conversations/import",
        {
            "content": body,
            "headers": {"Content-Type": "application/x-ndjson"},
        },
    )


ROUTES: dict[tuple[str, str], Route] = {
    ("post", "/api/v1/conversations/import"): Route(_import, "adds", grows=True),
    ("post", "/api/v1/chat"): Route(_chat(stream=False), "adds", grows=True),
    ("post", "/api/v1/chat/stream"): Route(_chat(stream=True), "adds", grows=True),
    ("post", "/api/v1/conversations/{conversation_id}/compact"): Route(
        lambda c, big: ("POST", f"/api/v1/conversations/{c.cid}/compact", {"json": {}}),
        "adds",
        why_not={"grows": "what it stores (kept messages and one item) replaces a window"},
    ),
    ("post", "/api/v1/conversations/{conversation_id}/fork"): Route(
        lambda c, big: (
            "POST",
            f"/api/v1/conversations/{c.cid}/fork",
            {"json": {"at_revision": c.revision}},
        ),
        "adds",
        grows=True,
    ),
    ("delete", "/api/v1/conversations/{conversation_id}"): Route(
        lambda c, big: ("DELETE", f"/api/v1/conversations/{c.cid}", {}), "removes"
    ),
    ("post", "/api/v1/turns/{turn_id}/cancel"): Route(
        lambda c, big: ("POST", f"/api/v1/turns/{c.turn_id}/cancel", {}), "marks"
    ),
    ("post", "/v1/conversations/{conversation_id}/items"): Route(
        lambda c, big: (
            "POST",
            f"/v1/conversations/{c.conv}/items",
            {"json": {"items": [{"role": "user", "content": "appended " + "x" * big}]}},
        ),
        "adds",
        grows=True,
    ),
    ("post", "/v1/conversations"): Route(
        lambda c, big: (
            "POST",
            "/v1/conversations",
            {"json": {"metadata": {"k": "v"}, "items": [{"role": "user", "content": "x" * big}]}},
        ),
        "adds",
        grows=True,
    ),
    ("delete", "/v1/conversations/{conversation_id}/items/{item_id}"): Route(
        lambda c, big: ("DELETE", f"/v1/conversations/{c.conv}/items/{c.item_id}", {}), "edits"
    ),
    ("post", "/v1/conversations/{conversation_id}"): Route(
        lambda c, big: ("POST", f"/v1/conversations/{c.conv}", {"json": {"metadata": {"a": "b"}}}),
        "edits",
    ),
    ("delete", "/v1/conversations/{conversation_id}"): Route(
        lambda c, big: ("DELETE", f"/v1/conversations/{c.conv}", {}), "removes"
    ),
    ("post", "/v1/responses/{response_id}/cancel"): Route(
        lambda c, big: ("POST", f"/v1/responses/{c.response_id}/cancel", {}), "marks"
    ),
    ("post", "/v1/responses/compact"): Route(
        lambda c, big: (
            "POST",
            "/v1/responses/compact",
            {"json": {"model": "fake-llm", "input": "x"}},
        ),
        "relays",
    ),
    ("post", "/v1/responses/input_tokens"): Route(
        lambda c, big: (
            "POST",
            "/v1/responses/input_tokens",
            {"json": {"model": "fake-llm", "input": "count me", "conversation": c.conv}},
        ),
        "relays",
    ),
    ("post", "/v1/responses"): Route(
        lambda c, big: (
            "POST",
            "/v1/responses",
            {
                "json": {
                    "model": "fake-llm",
                    "input": "asked",
                    "conversation": c.conv,
                    "tools": [_tool("x" * big)] if big else [],
                }
            },
        ),  # (what its Response echoes is stored too: a long tool description counts)
        "adds",
        grows=True,
    ),
    ("delete", "/v1/responses/{response_id}"): Route(
        lambda c, big: ("DELETE", f"/v1/responses/{c.response_id}", {}), "removes"
    ),
}


def _routes(*, where: Callable[[Route], bool]) -> list[Any]:
    return [
        pytest.param(key, route, id=f"{key[0].upper()} {key[1]}")
        for key, route in ROUTES.items()
        if where(route)
    ]


COMMITS = _routes(where=lambda r: r.commits)
ADDS = _routes(where=lambda r: r.effect == "adds")
GROWS = _routes(where=lambda r: r.grows)
ANY = _routes(where=lambda r: True)


# --- the document ---------------------------------------------------------------------------


def test_every_writing_route_has_its_row(database_url: str) -> None:
    """A writing operation of the OpenAPI document without a row here fails: its author says
    which promises hold for it (and the tests hold it to them)."""
    schema = create_app(Settings(database_url=database_url)).openapi_schema
    documented = {
        (method, path)
        for path, item in schema.paths.items()
        for method in WRITING
        if getattr(item, method) is not None
    }
    assert documented - set(ROUTES) == set(), "writing routes without a row in ROUTES"
    assert set(ROUTES) - documented == set(), "rows for routes the document does not have"


@pytest.mark.parametrize(("key", "route"), COMMITS)
def test_every_route_that_commits_takes_an_idempotency_key(
    database_url: str, key: tuple[str, str], route: Route
) -> None:
    schema = create_app(Settings(database_url=database_url)).openapi_schema
    operation = getattr(schema.paths[key[1]], key[0])
    headers = {p.name for p in operation.parameters or [] if p.param_in == "header"}
    assert "Idempotency-Key" in headers


@pytest.mark.parametrize(("key", "route"), COMMITS)
def test_every_route_that_commits_documents_what_the_gate_may_answer(
    database_url: str, key: tuple[str, str], route: Route
) -> None:
    schema = create_app(Settings(database_url=database_url)).openapi_schema
    operation = getattr(schema.paths[key[1]], key[0])
    documented = {int(status) for status in operation.responses or {}}
    assert {error.status for error in WRITE_ERRORS} <= documented
    if route.effect == "adds":
        assert ConversationFull.status in documented


# --- the app, a context, what is stored -----------------------------------------------------


@asynccontextmanager
async def app_client(
    database_url: str, provider: FakeProvider | None = None, **settings: Any
) -> AsyncIterator[httpx.AsyncClient]:
    config = Settings(database_url=database_url, **settings)
    app = create_app(config, provider=provider or FakeProvider())
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client


async def prepare(client: httpx.AsyncClient) -> Ctx:
    """A conversation with two turns, its latest item, a stored response, a finished turn."""
    first = await client.post("/api/v1/chat", json={"message": "one"})
    assert first.status_code == 200, first.text
    cid = first.json()["conversation_id"]
    streamed = await client.post(
        "/api/v1/chat/stream", json={"message": "two", "conversation_id": cid}
    )
    assert streamed.status_code == 200, streamed.text
    conv = "conv_" + cid.replace("-", "")
    items = await client.get(f"/v1/conversations/{conv}/items", params={"limit": 1})
    assert items.status_code == 200, items.text
    stored = await client.post("/v1/responses", json={"model": "fake-llm", "input": "stored"})
    assert stored.status_code == 200, stored.text
    return Ctx(
        cid, items.json()["data"][0]["id"], stored.json()["id"], streamed.headers["x-turn-id"]
    )


async def call(
    client: httpx.AsyncClient, route: Route, ctx: Ctx, *, big: int = 0, key: str | None = None
) -> httpx.Response:
    method, path, kwargs = route.request(ctx, big)
    headers = {**kwargs.pop("headers", {}), **({"Idempotency-Key": key} if key else {})}
    return await client.request(method, path, headers=headers, **kwargs)


async def stored(engine: AsyncEngine) -> list[tuple[Any, ...]]:
    """Everything a write could have stored (not leases, places, runs or keys)."""
    queries = (
        "SELECT id, revision, updated_at, context_start, metadata::text, expires_at"
        " FROM conversations ORDER BY id",
        "SELECT conversation_id, seq, user_message, assistant_message, replay_items::text,"
        " response_deleted, compacted::text FROM turns ORDER BY conversation_id, seq",
    )
    async with engine.connect() as conn:
        return [tuple(row) for query in queries for row in (await conn.execute(text(query))).all()]


async def counts(engine: AsyncEngine) -> tuple[int, ...]:
    """How much is stored: conversations, turns, the sum of revisions, responses forgotten,
    conversations with metadata."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT (SELECT count(*) FROM conversations),"
                    " (SELECT count(*) FROM turns),"
                    " (SELECT coalesce(sum(revision), 0) FROM conversations),"
                    " (SELECT count(*) FROM turns WHERE response_deleted),"
                    " (SELECT count(*) FROM conversations WHERE metadata::text <> '{}')"
                )
            )
        ).one()
    return tuple(row)


def code_of(response: httpx.Response) -> str | None:
    """The error code of a JSON error, or of a stream's terminal error event."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data:") and '"error"' in line:
                payload = json.loads(line[5:])
                error = payload.get("error") or payload.get("response", {}).get("error")
                if isinstance(error, dict):
                    return str(error.get("code"))
        return None
    if response.status_code < 400:
        return None
    return str(response.json()["error"]["code"])


def succeeded(response: httpx.Response) -> bool:
    return response.status_code < 300 and code_of(response) is None


# --- Idempotency-Key ------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "route"), COMMITS)
async def test_the_same_key_twice_writes_once_and_answers_the_same(
    database_url: str, engine: AsyncEngine, key: tuple[str, str], route: Route
) -> None:
    async with app_client(database_url) as client:
        ctx = await prepare(client)
        first = await call(client, route, ctx, key="once")
        assert succeeded(first), first.text
        after_first = await stored(engine)
        again = await call(client, route, ctx, key="once")
        assert again.status_code == first.status_code, again.text
        assert await stored(engine) == after_first  # the retry wrote nothing
        if first.headers.get("content-type", "").startswith("application/json"):
            assert _ids(again.json()) == _ids(first.json())
        if "etag" in first.headers:
            assert again.headers["etag"] == first.headers["etag"]


def _ids(body: Any) -> Any:
    """What a retry must answer as the first attempt did: ids, revisions, what was deleted
    (not correlation ids, nor when a retry's answer was made)."""
    if isinstance(body, list):
        return [_ids(item) for item in body]
    if not isinstance(body, dict):
        return body
    kept = ("id", "conversation_id", "revision", "object", "deleted", "data", "status")
    return {name: _ids(value) for name, value in body.items() if name in kept}


@pytest.mark.parametrize(("key", "route"), COMMITS)
async def test_the_same_key_on_two_replicas_at_once_writes_once(
    database_url: str, engine: AsyncEngine, key: tuple[str, str], route: Route
) -> None:
    """Two replicas (two apps, two pools) get the same request with the same key at once: it
    is written once, exactly as a single request writes it."""
    async with app_client(database_url) as one, app_client(database_url) as two:
        ctx = await prepare(one)
        before = await counts(engine)
        alone = await call(one, route, ctx, key="alone")
        assert succeeded(alone), alone.text
        once = tuple(b - a for a, b in zip(before, await counts(engine), strict=True))
        ctx = await prepare(two)
        before = await counts(engine)
        answers = await asyncio.gather(
            call(one, route, ctx, key="raced"), call(two, route, ctx, key="raced")
        )
        raced = tuple(b - a for a, b in zip(before, await counts(engine), strict=True))
        assert raced == once, [a.text for a in answers]
        assert any(succeeded(a) for a in answers), [a.text for a in answers]
        for answer in answers:
            assert succeeded(answer) or code_of(answer) == "request_in_progress", answer.text


# --- MAX_CONVERSATION_BYTES -----------------------------------------------------------------


@pytest.mark.parametrize(("key", "route"), GROWS)
async def test_a_write_past_the_conversation_size_keeps_nothing(
    database_url: str, engine: AsyncEngine, key: tuple[str, str], route: Route
) -> None:
    limit = 16 * 1024
    async with app_client(database_url) as roomy:
        ctx = await prepare(roomy)
        if key[1].endswith("/fork"):  # what a fork holds is its source's: it holds more now
            grown = await roomy.post(
                "/api/v1/chat", json={"message": "y" * 20_000, "conversation_id": ctx.cid}
            )
            assert grown.status_code == 200, grown.text
            ctx.revision = grown.json()["revision"]
    # Any other write passes the limit with what it brings alone (big: the limit's bytes).
    async with app_client(database_url, max_conversation_bytes=limit) as client:
        before = await stored(engine)
        refused = await call(client, route, ctx, big=limit)
        assert code_of(refused) == "conversation_full", refused.text
        assert await stored(engine) == before


# --- the owner's write budget ---------------------------------------------------------------


@pytest.mark.parametrize(("key", "route"), ADDS)
async def test_past_the_write_budget_nothing_is_kept_and_the_provider_is_not_called(
    database_url: str, engine: AsyncEngine, key: tuple[str, str], route: Route
) -> None:
    budget = 4096
    async with app_client(database_url) as roomy:
        ctx = await prepare(roomy)
    provider = CountingProvider()
    async with app_client(
        database_url, provider, owner_max_write_bytes_per_minute=budget
    ) as client:
        spent = await client.post("/api/v1/chat", json={"message": "z" * 2 * budget})
        assert spent.status_code == 200, spent.text  # a full bucket admits it, and is in debt
        before, calls = await stored(engine), provider.calls
        refused = await call(client, route, ctx)
        assert code_of(refused) == "too_many_requests", refused.text
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert provider.calls == calls
        assert await stored(engine) == before


# --- the shred ------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "route"), _routes(where=lambda r: r.effect in ("adds", "edits")))
async def test_a_shredded_owner_writes_nothing(
    database_url: str, engine: AsyncEngine, key: tuple[str, str], route: Route
) -> None:
    """From its tombstone on (the shred's first step, `turnstore owners shred`), nothing of
    the owner commits, on any route, whatever a replica holds in memory."""
    async with app_client(database_url) as client:
        ctx = await prepare(client)
        await PostgresStore.over(engine).owners.tombstone(
            "anonymous"
        )  # AUTH_MODE=none: the one owner
        before = await stored(engine), await owned(engine)
        refused = await call(client, route, ctx, key="after-the-shred")
        assert not succeeded(refused), refused.text
        assert code_of(refused) == "conversation_not_found", refused.text
        assert (await stored(engine), await owned(engine)) == before


async def owned(engine: AsyncEngine) -> list[tuple[Any, ...]]:
    """The other rows an owner's writes make: Idempotency-Key claims, runs, forks, places."""
    queries = (
        "SELECT owner, key, state FROM idempotency_keys ORDER BY owner, key",
        "SELECT id, status FROM turn_runs ORDER BY id",
        "SELECT conversation_id FROM owner_forks ORDER BY conversation_id",
        "SELECT owner, place FROM owner_turns ORDER BY owner, place",
    )
    async with engine.connect() as conn:
        return [tuple(row) for query in queries for row in (await conn.execute(text(query))).all()]


# --- the database unreachable ---------------------------------------------------------------


@pytest.mark.parametrize(("key", "route"), ANY)
async def test_a_database_failure_is_storage_error_and_the_next_request_succeeds(
    database_url: str, engine: AsyncEngine, key: tuple[str, str], route: Route
) -> None:
    proxy = TcpProxy.to(database_url)
    async with proxy, app_client(proxy.url(database_url)) as client:
        ctx = await prepare(client)
        proxy.cut()
        failed = await call(client, route, ctx)
        assert code_of(failed) == "storage_error", failed.text
        if not failed.headers.get("content-type", "").startswith("text/event-stream"):
            assert failed.status_code == 500
        proxy.restore()
        again = await call(client, route, ctx)
        assert succeeded(again), again.text


# --- two replica processes ------------------------------------------------------------------
