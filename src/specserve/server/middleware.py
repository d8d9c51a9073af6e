"""The gate every HTTP request passes before its route: 401 without the API key, 503 while
draining, 413 for a body over the size limit.

Pure ASGI on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) wraps the
request's receive channel so that `Request.is_disconnected()` never sees the client leave, and a
non-streaming request whose client went away would run to its end holding KV blocks. Add no
BaseHTTPMiddleware to the app (tests/server/test_hard_edges.py checks the abort).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.server.protocol import error_body

# Paths behind the API key, and behind it too with protect_metrics (metrics, page data, API docs).
API_PATHS = ("/v1", "/admin", "/tokenize", "/detokenize")
OBSERVABILITY_PATHS = ("/metrics", "/stats", "/docs", "/redoc", "/openapi.json")


class BodyTooLargeError(HTTPException):
    """Raised from `receive` once a body streams in past the limit; FastAPI re-raises an
    HTTPException met while reading a body, so the app's handler answers it (with body_too_large)."""

    def __init__(self) -> None:
        super().__init__(413)


def body_too_large(limit: int) -> dict[str, Any]:
    """The 413 error body."""
    return error_body(
        f"The request body is larger than this server's limit of {limit:,} bytes "
        "(--max-request-bytes); send a smaller request.",
        code="request_too_large",
    )


class AccessGate:
    """Refuses, before any route runs, a request without the API key (401), while the server
    drains every API request (503 + Retry-After: the listener stays open, so clients get an
    answer they can act on instead of a refused connection), and a body over max_body_bytes
    (413: from Content-Length before reading, or as soon as a chunked body passes the limit).

    Starlette's own body limit (FastAPI's max_body_size) answers a too-large Content-Length with
    plain text that replaces any response the app sends, hence this one with OpenAI's shape."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        protect_metrics: bool,
        is_draining: Callable[[], bool],
        retry_after_s: int,
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        # Compared as bytes: a header may hold any byte, and hmac.compare_digest refuses str
        # with non-ASCII characters (a TypeError, hence a 500, before this gate compared bytes).
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.protected = API_PATHS + (OBSERVABILITY_PATHS if protect_metrics else ())
        self.is_draining = is_draining
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if (
            self.expected is not None
            and path.startswith(self.protected)
            and not self._authorized(scope)
        ):
            body = error_body(
                "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                "authentication_error",
                code="invalid_api_key",
            )
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, send
            )
            return
        if self.is_draining() and path.startswith(API_PATHS):
            body = error_body(
                "The server is shutting down and takes no new requests; retry on another "
                "replica or after it restarts.",
                "service_unavailable",
                code="draining",
            )
            headers = {"Retry-After": str(self.retry_after_s)}
            await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)
            return
        declared = next(
            (value for name, value in scope["headers"] if name == b"content-length"), b"0"
        )
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await JSONResponse(body_too_large(self.max_body_bytes), status_code=413)(
                scope, receive, send
            )
            return
        await self.app(scope, self._limited(receive), send)

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that raises BodyTooLargeError once the body passes the limit."""
        total = 0

        async def limited() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_body_bytes:
                    raise BodyTooLargeError
            return message

        return limited

    def _authorized(self, scope: Scope) -> bool:
        assert self.expected is not None
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)
