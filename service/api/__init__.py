"""The HTTP layer: thin controllers over the use cases, one Api dependency each.

chat.py, conversations.py, durable_turns.py   the /api/v1 routes
compat/                     the OpenAI surface (/v1): its routes, commands and views
ops.py                      probes and metrics for operators (/healthz, /readyz, ...)
schemas.py, bodies.py       /api/v1 bodies (msgspec), and the strict decoding of any body
headers.py                  the headers the API reads and writes (If-Match, ETag, ...)
errors.py                   the one error mapping: each surface's envelope, documented
auth.py                     who is asking (API keys)
deps.py                     what a controller gets injected: the caller and the use cases
                            (Api; Writer for a write, with its If-Match and Idempotency-Key)
edge.py, limits.py          checks every request passes before any route, and send bounds
sse.py                      Server-Sent Events: streams, keep-alives, one terminal event
correlation.py, observe.py  X-Correlation-Id per request, and HTTP request metrics
http_server.py              the ASGI server's settings
console/                    the static console at /console and the Swagger UI
"""
