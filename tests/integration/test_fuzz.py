"""Hostile input: schemathesis fuzzes every operation of the app's own OpenAPI schema over real
HTTP against real PostgreSQL, and hand-made requests probe the limits a generator won't find
(nesting depth, NaN, request head size). Whatever comes in: no 5xx but storage_error, every
error in the contract's envelope with the X-Correlation-Id of its response."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from litestar import Litestar
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    positive_data_acceptance,
)

from service.api.http_server import uvicorn_options
from service.app import create_app, run_with_api_keys
from service.platform.settings import Settings
from tests.support.helpers import CHAT, assert_error

EXAMPLES = 100  # per operation and mode: the whole run takes ~25 s


@contextmanager
def serve_in_thread(app: Litestar, **config: Any) -> Iterator[str]:
    """uvicorn on a loopback port in a thread of its own (schemathesis calls are blocking)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def base_url(database_url: str) -> Iterator[str]:
    app = create_app(Settings(database_url=database_url))
    with serve_in_thread(app, **uvicorn_options(Settings())) as url:
        yield url


@pytest.fixture(scope="module")
def api_key_url(database_url: str) -> Iterator[str]:
    app = create_app(Settings(database_url=database_url, auth_mode="api_key"))
    with serve_in_thread(app, **uvicorn_options(Settings())) as url:
        yield url


def assert_contract(response: Any) -> None:
    """The contract's promises for any response, whatever the request was."""
    status = response.status_code
    values = response.headers.get("x-correlation-id")  # schemathesis: a list per header
    cid = values if isinstance(values, str) or values is None else "".join(values)
    assert cid and (isinstance(values, str) or len(values) == 1), f"{status}: X-Correlation-Id"
    if status < 400:
        return
    body = json.loads(response.content)
    fields = {"code", "message", "correlation_id"}
    if urlsplit(str(response.request.url)).path.startswith("/v1/"):  # OpenAI's error shape
        fields |= {"type", "param"}
        assert response.headers.get("x-request-id") == values, "x-request-id"
    assert set(body) == {"error"} and set(body["error"]) == fields
    error = body["error"]
    assert error["correlation_id"] == cid
    assert isinstance(error["code"], str) and isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"] and "SELECT" not in error["message"]
    assert status < 500 or (status, error["code"]) == (500, "storage_error"), body


NOT_CHECKED = [
    # Replaced by `refused_valid_data` below: schemathesis' own version also fails a valid
    # request answered 409 or 412 (a conflict, a precondition), which are right answers.
    positive_data_acceptance,
    # Litestar 2 answers OPTIONS with the methods of a path's first handler only
    # (litestar-org/litestar#4169, fixed in 3.x).
    allow_header_conformance,
]
# Known gaps in the schema, to drop once fixed: the stream's 200 is documented as JSON.
KNOWN: dict[str, list[Any]] = {}


LABELS = [
    "POST /api/v1/chat",
    "POST /api/v1/chat/stream",
    "GET /api/v1/conversations",
    "GET /api/v1/conversations/{conversation_id}",
    "DELETE /api/v1/conversations/{conversation_id}",
]


def refused_valid_data(case: schemathesis.Case, response: Any) -> bool:
    """A schema-valid request answered 400: the schema promised more than the server takes.
    What a schema cannot say: "a cursor this API returned" (GET /conversations?after=):
    random ones are 400, as they should be."""
    cursor = case.operation.label == "GET /api/v1/conversations" and "after" in (case.query or {})
    # /v1 is OpenAI's wire format; what turnstore takes of it (its model only, a conversation
    # or the latest response, the fields it supports) is beyond what that schema says.
    openai = case.operation.path.startswith("/v1/")
    # Nor can it say "a revision this conversation has" (a fork point).
    fork = case.operation.label.endswith("/fork") and "at_revision must be" in response.text
    # JSON Schema counts 1.0 as an integer; an integer field here takes JSON integers only.
    integral_float = "Expected `int`, got `float`" in response.text
    # Nor "from before to, at most 366 days apart" (GET /api/v1/usage), nor "q holds a word
    # (a letter or digit of any script)".
    usage_range = "from must be before to" in response.text
    no_word = "q has no word to search for" in response.text
    refused = cursor or openai or fork or integral_float or usage_range or no_word
    return response.status_code == 400 and not refused


def fuzz(
    operation: schemathesis.APIOperation,
    mode: GenerationMode,
    base_url: str,
    calls: Counter[str],
    headers: dict[str, str],
    **fixed: Any,
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode, **fixed))
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def one(case: schemathesis.Case) -> None:
        calls[f"{mode} {operation.label}"] += 1
        response = case.call(base_url=base_url, headers=headers, timeout=30)
        assert_contract(response)
        if mode is GenerationMode.POSITIVE:
            assert not refused_valid_data(case, response), (case.body, response.text)
        excluded = NOT_CHECKED + KNOWN.get(operation.label, [])
        case.validate_response(response, excluded_checks=excluded, headers=headers)

    try:
        one()
    except Unsatisfiable:
        # No schema-invalid request exists for an operation without inputs (/healthz).
        assert mode is GenerationMode.NEGATIVE and not calls[f"{mode} {operation.label}"]


def new_conversation(base_url: str, headers: dict[str, str]) -> str:
    response = httpx.post(base_url + CHAT, json={"message": "seed"}, headers=headers)
    assert response.status_code == 200, response.text
    return str(response.json()["conversation_id"])


@pytest.mark.parametrize("auth", ["none", "api_key"])
def test_the_whole_api_under_fuzzing(
    auth: str, request: pytest.FixtureRequest, database_url: str
) -> None:
    """Schema-valid and schema-invalid requests to every operation, through schemathesis'
    Hypothesis strategies (its pytest plugin does not run under pytest 9): the contract's
    checks above plus schemathesis' own (status codes, headers and bodies as documented).
    With AUTH_MODE=api_key every request carries a valid key (schema-valid requests only:
    the key would spoil a schema-invalid request that lacks one). With real conversation ids
    too, so that reads, turns and deletes get past the 404."""
    headers: dict[str, str] = {}
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    if auth == "api_key":
        base_url = request.getfixturevalue("api_key_url")
        key = run_with_api_keys(database_url, lambda keys: keys.create("fuzzer"))
        headers, modes = {"Authorization": f"Bearer {key}"}, [GenerationMode.POSITIVE]
    else:
        base_url = request.getfixturevalue("base_url")
    config = SchemathesisConfig.discover()
    # A body over MAX_BODY_BYTES (a long message of 4-byte escapes) is rightly refused as 413.
    rejection = config.projects.default.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    api_schema = schemathesis.openapi.from_url(f"{base_url}/schema/openapi.json", config=config)
    calls: Counter[str] = Counter()
    for result in api_schema.get_all_operations():
        operation = result.ok()
        for mode in modes:
            fuzz(operation, mode, base_url, calls, headers)
        if "{conversation_id}" in operation.path:
            cid = new_conversation(base_url, headers)
            fixed = {"path_parameters": {"conversation_id": cid}}
            fuzz(operation, GenerationMode.POSITIVE, base_url, calls, headers, **fixed)
    assert all(calls[f"positive {label}"] > 0 for label in LABELS), calls
    # Only these have inputs a request can get wrong against the schema.
    assert all(calls[f"negative {label}"] > 0 for label in LABELS[:3] if len(modes) > 1), calls


# --- hand-made hostile input ---------------------------------------------------------------


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('{"message": ' + json.dumps(nested(40)) + "}", "Expected `str`, got `array`"),
        ('{"message": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "unknown field `x`"),
        ('{"message": NaN}', "malformed"),
        ('{"message": "hi", "conversation_id": Infinity}', "malformed"),
        ('{"message": -1e999}', "out of range"),
        ('{"message": "hi", "message": "ho"}', "duplicate key"),
        (b'{"message": "\xff\xfe"}', "Invalid UTF-8"),
        ('{"message": "hi"} {}', "trailing characters"),
    ],
)
def test_bodies_that_are_not_strict_json(base_url: str, body: str | bytes, why: str) -> None:
    for path in (CHAT, f"{CHAT}/stream"):
        response = httpx.post(
            base_url + path, content=body, headers={"Content-Type": "application/json"}
        )
        error = assert_error(response, 400, "invalid_input")
        assert why in error["message"]


def test_request_head_size_is_limited(base_url: str) -> None:
    fits = httpx.get(f"{base_url}/healthz", headers={"X-Padding": "a" * 12_000})
    assert fits.status_code == 200
    for headers in ({"X-Padding": "a" * 20_000}, {f"X-H{i}": "v" * 40 for i in range(600)}):
        response = httpx.get(f"{base_url}/api/v1/conversations", headers=headers)
        assert "16384 bytes" in assert_error(response, 400, "invalid_input")["message"]
    long_target = httpx.get(f"{base_url}/api/v1/conversations?after={'a' * 17_000}")
    assert_error(long_target, 400, "invalid_input")


@pytest.mark.parametrize(
    "header",
    [
        b"X-Padding-%d: " + b"a" * 1000 + b"\r\n",  # many headers
        b"a" * 1000,  # one header value that never ends
    ],
)
def test_a_trickled_request_head_is_cut_off_by_the_server(base_url: str, header: bytes) -> None:
    """A head arriving piece by piece is refused by the server once 16 KiB are buffered
    (h11 by itself, httptools through service/http_server.py): a client cannot make it hold
    an unbounded head. No envelope: the app never sees the request."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: ")
        try:
            for i in range(200):
                conn.sendall(header.replace(b"%d", str(i).encode()))
                time.sleep(0.002)
        except OSError:
            pass  # the server closed the connection while we were still sending
        answer = conn.recv(1024)
    assert answer.startswith(b"HTTP/1.1 400"), answer


def test_bodies_and_kept_alive_connections_are_not_counted_as_head(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for _ in range(3):  # one connection: each request's head is counted on its own
            big = client.post(CHAT, json={"message": "x" * 90_000})
            assert big.status_code == 200, big.text
            assert client.get("/healthz", headers={"X-Padding": "a" * 12_000}).status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/conversations/not-a-uuid",
        "/api/v1/conversations/" + "0" * 5000,
        "/api/v1/conversations/%00",
        "/api/v1/conversations/%FF%FE",
        "/api/v1/conversations/00000000-0000-0000-0000-00000000000g",
    ],
)
def test_ids_of_the_wrong_shape_are_unknown(base_url: str, path: str) -> None:
    assert_error(httpx.get(base_url + path), 404, "conversation_not_found")
    assert_error(httpx.delete(base_url + path), 404, "conversation_not_found")
    chat = httpx.post(base_url + CHAT, json={"message": "hi", "conversation_id": path[23:]})
    assert chat.status_code in (400, 404)
    assert_contract(chat)
