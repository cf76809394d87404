"""A request resolves one dependency (service/api/deps.py: two or more are resolved in an anyio
task group, ~8% of a turn's server CPU): ``api`` (Caller) or, for a write that honours
If-Match, ``writer`` (Writer), whose provider reads If-Match and Idempotency-Key, so the
OpenAPI document names those headers on the writer's routes. The listing's filters are the one
second dependency."""

from __future__ import annotations

from typing import Any

from litestar.testing import TestClient

from tests.support.helpers import Target


def _asked(handler: Any) -> set[str]:
    """The dependencies a request to ``handler`` resolves, theirs included."""
    provided = handler.resolve_dependencies()
    asked: set[str] = set()
    todo = [handler.parsed_fn_signature.parameters]
    while todo:
        for name in todo.pop():
            if name in provided and name not in asked:
                asked.add(name)
                todo.append(provided[name].parsed_fn_signature.parameters)
    return asked


def _routes(app: Any) -> dict[str, set[str]]:
    return {
        f"{method} {route.path}": _asked(handler)
        for route in app.routes
        for handler in getattr(route, "route_handlers", ())
        for method in handler.http_methods
        if method != "HEAD"
    }


def test_a_request_resolves_one_dependency() -> None:
    routes = _routes(Target().app())
    several = {route: asked for route, asked in routes.items() if len(asked) > 1}
    assert several == {"GET /api/v1/conversations": {"api", "filters"}}
    assert routes["POST /api/v1/chat"] == {"writer"}
    assert routes["GET /api/v1/conversations/{conversation_id:str}"] == {"api"}


def test_the_document_names_if_match_on_the_writers_routes() -> None:
    app = Target().app()
    writes = {route for route, asked in _routes(app).items() if "writer" in asked}
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        paths = client.get("/schema/openapi.json").json()["paths"]
    documented = {
        f"{method.upper()} {path}"
        for path, operations in paths.items()
        for method, operation in operations.items()
        if any(p["name"] == "If-Match" for p in operation.get("parameters", ()))
    }
    assert len(writes) == 9
    assert documented == {route.replace(":str", "") for route in writes}
