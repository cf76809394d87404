"""OpenAI / Azure OpenAI Responses API over httpx, with ``store=false``.

httpx failures map to domain errors in one place (``_translate``): connect/read/write/pool
timeouts -> UpstreamTimeout, every other ``httpx.HTTPError`` -> UpstreamError. Provider
bodies never reach the client: error messages are ours.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import msgspec

from service.errors import (
    ContentFiltered,
    ContextLengthExceeded,
    RateLimited,
    TurnstoreError,
    UpstreamError,
    UpstreamTimeout,
)
from service.providers.base import (
    ProviderEvent,
    ProviderRequest,
    Reply,
    ReplyStatus,
    TextDelta,
)
from service.settings import Settings

_INCLUDE = ["reasoning.encrypted_content"]


@dataclass(frozen=True)
class Endpoint:
    name: str  # "openai" or "azure"
    url: str
    headers: dict[str, str]
    model: str

    @classmethod
    def from_settings(cls, settings: Settings) -> Endpoint:
        if settings.llm_provider == "azure":
            if not (
                settings.azure_endpoint and settings.azure_api_key and settings.azure_deployment
            ):
                raise ValueError("azure needs AZURE_OPENAI_ENDPOINT, _API_KEY and _DEPLOYMENT")
            url = settings.azure_endpoint.rstrip("/") + "/openai/v1/responses"
            headers = {"api-key": settings.azure_api_key}
            return cls("azure", url, headers, settings.azure_deployment)
        if not (settings.openai_api_key and settings.openai_model):
            raise ValueError("openai needs OPENAI_API_KEY and OPENAI_MODEL")
        url = settings.openai_base_url.rstrip("/") + "/responses"
        headers = {"Authorization": f"Bearer {settings.openai_api_key}"}
        return cls("openai", url, headers, settings.openai_model)


class _RequestBody(msgspec.Struct, omit_defaults=True):
    model: str
    input: list[msgspec.Raw]
    store: bool
    include: list[str]
    stream: bool
    instructions: str | None = None


class _ErrorDetail(msgspec.Struct):
    code: str | None = None
    type: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail | None = None


class _IncompleteDetails(msgspec.Struct):
    reason: str | None = None


class _Response(msgspec.Struct):
    status: str | None = None
    output: list[msgspec.Raw] = []
    incomplete_details: _IncompleteDetails | None = None


class _Content(msgspec.Struct):
    type: str = ""
    text: str = ""


class _OutputItem(msgspec.Struct):
    type: str = ""
    content: list[_Content] | None = None


class _StreamEvent(msgspec.Struct):
    type: str
    delta: str | None = None
    item: msgspec.Raw | None = None
    response: _Response | None = None
    code: str | None = None
    error: _ErrorDetail | None = None


class ResponsesProvider:
    def __init__(
        self,
        endpoint: Endpoint,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_body_bytes: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._max_body_bytes = max_body_bytes
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)

    @classmethod
    def from_settings(
        cls, settings: Settings, transport: httpx.AsyncBaseTransport | None = None
    ) -> ResponsesProvider:
        return cls(
            Endpoint.from_settings(settings),
            connect_timeout_s=settings.upstream_connect_timeout_s,
            read_timeout_s=settings.upstream_read_timeout_s,
            max_body_bytes=settings.upstream_max_body_bytes,
            transport=transport,
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncIterator[ProviderEvent]:
        body = _RequestBody(
            model=self.endpoint.model,
            input=request.input_items,
            store=False,
            include=_INCLUDE,
            stream=stream,
            instructions=request.instructions,
        )
        async with self._post(msgspec.json.encode(body)) as response:
            if stream:
                async for event in self._read_stream(response):
                    yield event
            else:
                yield _reply(msgspec.json.decode(await self._read_body(response), type=_Response))

    @asynccontextmanager
    async def _post(self, content: bytes) -> AsyncIterator[httpx.Response]:
        headers = {**self.endpoint.headers, "Content-Type": "application/json"}
        with _translate():
            async with self._client.stream(
                "POST", self.endpoint.url, content=content, headers=headers
            ) as response:
                if response.status_code >= 400:
                    raise _http_error(response, await self._read_body(response, strict=False))
                yield response

    async def _read_body(self, response: httpx.Response, *, strict: bool = True) -> bytes:
        chunks: list[bytes] = []
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            if response.num_bytes_downloaded > self._max_body_bytes:
                if strict:
                    raise UpstreamError("The provider's response was too large.")
                break
        return b"".join(chunks)

    async def _read_stream(self, response: httpx.Response) -> AsyncIterator[ProviderEvent]:
        items: list[msgspec.Raw] = []
        data: list[str] = []
        async for line in response.aiter_lines():
            if response.num_bytes_downloaded > self._max_body_bytes:
                raise UpstreamError("The provider's response was too large.")
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
                continue
            if line or not data:
                continue  # "event:", "id:", comments; or a blank line with nothing pending
            event = msgspec.json.decode("\n".join(data), type=_StreamEvent)
            data.clear()
            if event.type == "response.output_text.delta" and event.delta:
                yield TextDelta(event.delta)
            elif event.type == "response.output_item.done" and event.item is not None:
                items.append(event.item)  # the .added copy may be incomplete
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response or _Response()
                yield _reply(_Response(final.status, items, final.incomplete_details))
                return
            elif event.type in ("response.failed", "error"):
                raise _error_from_code(event.code or (event.error.code if event.error else None))
        raise UpstreamError("The provider's stream ended before the response was complete.")


def _reply(response: _Response) -> Reply:
    reason = response.incomplete_details.reason if response.incomplete_details else None
    status: ReplyStatus
    if response.status == "completed":
        status = "completed"
    elif response.status == "incomplete" and reason in ("max_output_tokens", "content_filter"):
        status = "incomplete"
    else:
        raise UpstreamError(f"The provider's response was {response.status or 'unusable'}.")
    text = "".join(
        part.text
        for raw in response.output
        if (item := msgspec.json.decode(raw, type=_OutputItem)).type == "message"
        for part in item.content or ()
        if part.type == "output_text"
    )
    return Reply(text, status, reason, list(response.output))


def _http_error(response: httpx.Response, body: bytes) -> TurnstoreError:
    if response.status_code == 429:
        return RateLimited(retry_after=_retry_after(response.headers.get("retry-after")))
    try:
        code = msgspec.json.decode(body, type=_ErrorBody).error
    except msgspec.DecodeError:
        code = None
    if response.status_code == 400 and code is not None:
        return _error_from_code(code.code)
    return UpstreamError(f"The provider answered HTTP {response.status_code}.")


def _error_from_code(code: str | None) -> TurnstoreError:
    if code == "context_length_exceeded":
        return ContextLengthExceeded()
    if code in ("content_filter", "content_policy_violation"):
        return ContentFiltered()
    if code in ("rate_limit_exceeded",):
        return RateLimited()
    return UpstreamError("The provider reported an error.")


def _retry_after(value: str | None) -> str | None:
    """Pass on a plain Retry-After (seconds or HTTP-date), nothing else."""
    if value and len(value) <= 64 and value.isprintable():
        return value.strip()
    return None


class _translate:
    """Map httpx's exception hierarchy and malformed JSON onto the domain's."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, httpx.TimeoutException):
            raise UpstreamTimeout() from exc
        if isinstance(exc, httpx.HTTPError | httpx.StreamError):
            raise UpstreamError("The provider could not be reached or broke off.") from exc
        if isinstance(exc, msgspec.DecodeError | msgspec.ValidationError):
            raise UpstreamError("The provider answered something unparsable.") from exc
