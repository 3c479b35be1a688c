"""What stands between a socket and the routes: connection and size limits, timeouts, request ids.

Two layers, because uvicorn hands an ASGI app nothing until a request's headers are complete:
- `guarded_protocol()` wraps uvicorn's HTTP protocol class (one instance per connection). It
  answers a connection past `max_connections` with a 503 and closes it at once, and closes a
  connection whose headers do not arrive within `header_timeout` (408 when some had come).
- `RequestGuard`, an ASGI middleware, gives every request an id (the `x-request-id` header and
  the handlers' completion ids), reads the whole body before the route sees it (413 past
  `max_request_bytes`, by Content-Length or by counting, 408 past `body_timeout`), and answers an
  exception nothing else handled with a 500 that holds only the request id; the traceback goes
  to the log under that id.
Every refusal is OpenAI's error JSON with `Connection: close`, and is logged through a
`RateLimitFilter`: one line per kind of refusal per interval, never one per socket. This module
knows nothing of the engine or the routes.
"""
import asyncio
import json
import logging
import resource
import threading
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanovllm.entrypoints.openai.protocol import APIError
from nanovllm.entrypoints.openai.server_settings import RETRY_AFTER_SECONDS

logger = logging.getLogger("nanovllm")
# Refused connections and requests are logged here, at most once per kind per interval.
connection_logger = logging.getLogger("nanovllm.connections")
# One line per interval is enough to see a flood and small enough to survive one.
REJECTION_LOG_INTERVAL_S = 10.0
# What uvicorn logs per connection that a hostile client can make it log at will.
UVICORN_PER_CONNECTION_MESSAGES = ("Invalid HTTP request received.",)
# File descriptors kept for what is not a client connection: the engine's files, pipes, logs.
RESERVED_FDS = 128
REQUEST_ID_HEADER = b"x-request-id"


class RateLimitFilter(logging.Filter):
    """Lets the first record of each message template through, then at most one per interval;
    the next one that passes says how many were left out. `templates` (None: all) limits which
    messages are counted; others always pass."""

    def __init__(self, interval_s: float = REJECTION_LOG_INTERVAL_S, templates: tuple[str, ...] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s, self.templates, self.clock = interval_s, templates, clock
        self._last: dict[str, tuple[float, int]] = {}  # template -> (when one last passed, dropped since)
        self._lock = threading.Lock()  # uvicorn logs from the event loop, handlers from threads too

    def filter(self, record: logging.LogRecord) -> bool:
        template = str(record.msg)
        if self.templates is not None and template not in self.templates:
            return True
        now = self.clock()
        with self._lock:
            last, dropped = self._last.get(template, (None, 0))
            if last is not None and now - last < self.interval_s:
                self._last[template] = (last, dropped + 1)
                return False
            self._last[template] = (now, 0)
        if dropped:
            record.msg = f"{template} [{dropped} more like it in the last {now - last:.0f} s not logged]"
        return True


_connection_filter = RateLimitFilter()
_uvicorn_filter = RateLimitFilter(templates=UVICORN_PER_CONNECTION_MESSAGES)


def install_log_limits() -> None:
    """Rate-limit the per-connection log lines (idempotent: a logger keeps one filter once)."""
    connection_logger.addFilter(_connection_filter)
    logging.getLogger("uvicorn.error").addFilter(_uvicorn_filter)


def error_json(status: int, message: str, code: str, type: str = "invalid_request_error") -> bytes:
    return json.dumps(APIError(status, message, type=type, code=code).body()).encode()


def _raw_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response, written straight to a socket that is closed next."""
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
             f"content-length: {len(body)}", "connection: close",
             *(f"{name}: {value}" for name, value in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# ---- connections (below ASGI) ----

def guarded_protocol(base: type[asyncio.Protocol], max_connections: int, header_timeout: float) -> type:
    """A subclass of uvicorn's HTTP protocol class `base` (h11 or httptools; both make
    `self.cycle` when a request's headers are complete) enforcing the connection cap and the
    header timeout."""

    class GuardedProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None
        _partial = False  # bytes of the next request's headers have come

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                connection_logger.warning("refused a connection: %d are open, the most allowed "
                                          "(--max-connections)", max_connections)
                self._close_with(503, f"the server has {max_connections} connections open, the most it allows; "
                                      "retry later", "too_many_connections",
                                 {"retry-after": str(RETRY_AFTER_SECONDS)})
                return
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            self._partial = True
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are complete: the app has it now
                self._stop_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # kept alive: the next request's headers are due
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._stop_timer()
            self._partial = False
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_late)

        def _stop_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            if not self._partial:  # an idle connection (uvicorn's keep-alive timeout may be longer)
                self.transport.close()
                return
            connection_logger.warning("closed a connection whose request headers were not complete within "
                                      "%s s (--header-timeout)", header_timeout)
            self._close_with(408, f"the request headers did not arrive within {header_timeout} s", "request_timeout")

        def _close_with(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
            self.transport.write(_raw_response(status, error_json(status, message, code), headers))
            self.transport.close()  # reads nothing more; what was written is still sent

    return GuardedProtocol


def connection_cap(wanted: int) -> int:
    """`wanted` connections, or fewer if this process may not open that many file descriptors
    (raising the soft limit towards the hard one first): past the fd limit, accept() fails in a
    loop instead of a client hearing 503."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        allowed = max(1, soft - RESERVED_FDS)
        logger.warning("max_connections=%d lowered to %d: this process may open only %d files (ulimit -n); "
                       "raise the limit or pass a lower --max-connections", wanted, allowed, soft)
        return allowed
    return wanted


# ---- requests (ASGI) ----

class RequestGuard:
    """ASGI middleware for every HTTP request: an id, a bounded and timed body, and a 500 that
    leaks nothing. The body is read whole before the app runs and handed to it in one message;
    later receive() calls (a disconnect) go to the server as usual."""

    def __init__(self, app: ASGIApp, max_request_bytes: int, body_timeout: float):
        self.app, self.max_bytes, self.body_timeout = app, max_request_bytes, body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []),
                                                   (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        async def respond(status: int, body: bytes, close: bool) -> None:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            # After a refused body the connection is closed: what is left of the body is never read.
            await send_with_id({"type": "http.response.start", "status": status,
                                "headers": headers + [(b"connection", b"close")] * close})
            await send_with_id({"type": "http.response.body", "body": body})

        async def refuse(status: int, message: str, code: str) -> None:
            await respond(status, error_json(status, message, code), close=True)

        body = await self._read_body(scope, receive, refuse)
        if body is None:  # refused, or the client left
            return
        replayed = False

        async def receive_body() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, receive_body, send_with_id)
        except Exception:
            # Nothing handled it: a bug. The log gets the traceback under the request id; the
            # client gets the id alone (exception text can hold paths, prompts or secrets).
            logger.exception("request %s %s failed (request id %s)", scope["method"], scope["path"], request_id)
            if not started:
                await respond(500, error_json(500, internal_error_message(request_id), "internal_error",
                                              type="server_error"), close=False)

    async def _read_body(self, scope: Scope, receive: Receive, refuse) -> bytes | None:
        """The whole body, or None once the request is refused (413, 408) or the client left."""
        for name, value in scope["headers"]:
            if name == b"content-length" and value.strip().isdigit() and int(value) > self.max_bytes:
                connection_logger.warning("refused a request body over %d bytes by its Content-Length "
                                          "(--max-request-bytes)", self.max_bytes)
                await refuse(413, too_large_message(self.max_bytes), "request_too_large")
                return None
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                connection_logger.warning("refused a request whose body was not complete within %s s "
                                          "(--body-timeout)", self.body_timeout)
                await refuse(408, f"the request body did not arrive within {self.body_timeout} s", "request_timeout")
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:  # no Content-Length (chunked), or a wrong one
                connection_logger.warning("refused a request body over %d bytes (--max-request-bytes)",
                                          self.max_bytes)
                await refuse(413, too_large_message(self.max_bytes), "request_too_large")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def too_large_message(max_bytes: int) -> str:
    return f"the request body is larger than this server's limit of {max_bytes} bytes"


def internal_error_message(request_id: str) -> str:
    return f"the server failed on this request (request id {request_id}); its log has the details"
