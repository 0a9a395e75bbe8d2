"""HTTP plumbing shared by ``k3jax-serve`` and ``k3jax-router`` (no JAX at import): OpenAI-shaped
errors, a capped and timed JSON body reader, exception handlers for FastAPI apps, and a uvicorn
server on a pre-bound socket (so port 0 resolves before serving starts)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("k3jax.http")

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    etype = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI):
    """Errors the app answers (ours, unknown routes, wrong methods) in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError):
        return error_response(e.status, e.message, param=e.param, code=e.code, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(e.status_code, msg, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError):
        return error_response(400, str(e))



async def read_json(request: Request, *, max_bytes: int, timeout_s: float) -> dict:
    """The request body as a JSON object, whatever its Content-Type (curl sends a form type).
    413 over ``max_bytes``, 408 when the body does not arrive within ``timeout_s`` (e.g. a
    Content-Length larger than the body), 400 for anything that is not a JSON object."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise APIError(400, f"bad Content-Length {cl!r}") from None
        if n > max_bytes:
            raise APIError(413, f"request body of {n} bytes exceeds the limit of {max_bytes} bytes")

    async def _read() -> bytes:
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > max_bytes:
                raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
        return bytes(buf)

    try:
        raw = await asyncio.wait_for(_read(), timeout_s)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    if not raw:
        raise APIError(400, "empty request body: send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket (port 0 picks a free one)."""
    sock = socket.create_server((host, port), backlog=backlog, reuse_port=False)
    sock.set_inheritable(True)
    return sock


class BackgroundServer:
    """uvicorn serving ``app`` on a pre-bound socket, in the foreground (:meth:`run`) or on a
    thread (:meth:`start` / :meth:`stop`)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 timeout_keep_alive: int = 30):
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                                    timeout_keep_alive=timeout_keep_alive, lifespan="on"))
        self.thread: threading.Thread | None = None
        self.done = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self):
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.done.set()

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        self.thread = threading.Thread(target=self.run, name="uvicorn", daemon=True)
        self.thread.start()
        waited = 0.0
        while not self.server.started and waited < timeout_s:
            threading.Event().wait(0.01)
            waited += 0.01
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start")
        return self

    def stop(self):
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)

    # The names of the former ``http.server`` based servers.
    serve_forever = run

    @property
    def server_address(self) -> tuple[str, int]:
        return self.host, self.port

    def shutdown(self):
        self.server.should_exit = True
        self.done.wait(10)
