"""``k3jax-router``: an async HTTP front end (FastAPI on uvicorn, httpx to the backends) that
forwards OpenAI-style requests to ``k3jax-serve`` backends.

Each request's session (the ``X-Session-Id`` header, else the body's ``user`` field, else a hash
of the prompt's first 512 tokens or characters, or for chat of the messages up to the first user
turn, so turns of one conversation share it) is routed by :class:`serving.fleet.Router`:
rendezvous primary/secondary with bounded loads, sticky, no flapping. A health checker polls
every backend's ``/health``; a backend that fails a check, or refuses or drops a request, is
marked down and the request is retried on the session's next cluster (a non-streamed request is
retried even if the backend died mid-request; a stream that already sent bytes cannot be: it ends
with an error event and ``[DONE]``). A backend's HTTP answer, 4xx included, is passed through
and never marks it down. Streams are passed through as they arrive; a client that leaves a
stream closes the backend connection (the backend aborts the request). The serving backend is
named in the ``X-K3jax-Backend`` response header. ``/metrics``: Prometheus counters per backend.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import threading

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from serving.fleet.routing import Router
from serving.http_base import APIError, BackgroundServer, error_body, install_error_handlers, read_json

log = logging.getLogger("k3jax.router")
_HOP_HEADERS = {"connection", "transfer-encoding", "keep-alive", "content-length", "date", "server"}


def session_of(headers, body: dict) -> str:
    """The routing key of a request (see the module docstring)."""
    sid = headers.get("X-Session-Id") or body.get("user")
    if sid:
        return str(sid)
    if "messages" in body and isinstance(body["messages"], list):
        head = []
        for m in body["messages"]:
            head.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
    else:
        prompt = body.get("prompt")
        head = prompt[:512] if isinstance(prompt, (list, str)) else prompt
    return "p" + hashlib.blake2b(json.dumps(head, sort_keys=True).encode(), digest_size=8).hexdigest()


class FleetRouter:
    """Routing state (thread-safe), metrics, and the async health checker and proxy client."""

    def __init__(self, backends, *, c: float = 1.25, health_interval_s: float = 1.0, timeout_s: float = 300.0,
                 max_body_bytes: int = 4 << 20):
        self.backends = [b.rstrip("/") for b in backends]
        if not self.backends:
            raise ValueError("at least one backend URL is needed")
        self.router = Router(self.backends, c=c)
        self.lock = threading.Lock()
        self.timeout_s = timeout_s
        self.health_interval_s = health_interval_s
        self.max_body_bytes = max_body_bytes
        self.registry = CollectorRegistry()
        self.m_requests = Counter("k3jax_router_requests", "requests sent to a backend", ["backend"],
                                  registry=self.registry)
        self.m_failures = Counter("k3jax_router_failures", "times a backend was marked down", ["backend"],
                                  registry=self.registry)
        self.m_stream_breaks = Counter("k3jax_router_stream_breaks", "streams cut by a backend failure", ["backend"],
                                       registry=self.registry)
        self.m_up = Gauge("k3jax_router_backend_up", "1 while a backend is routed to", ["backend"],
                          registry=self.registry)
        for b in self.backends:
            self.m_up.labels(b).set(1)
            self.m_requests.labels(b)
            self.m_failures.labels(b)
        self.client: httpx.AsyncClient | None = None
        self._checker: asyncio.Task | None = None
        self._closed = False

    def healthy(self) -> set[str]:
        with self.lock:
            return set(self.router.healthy)

    def mark(self, backend: str, up: bool):
        with self.lock:
            was = backend in self.router.healthy
            if up and not was:
                self.router.recover(backend)
                log.info("backend %s is up", backend)
            elif not up and was:
                self.router.fail(backend)
                self.m_failures.labels(backend).inc()
                log.warning("backend %s is down", backend)
            self.m_up.labels(backend).set(int(backend in self.router.healthy))

    def route(self, session: str) -> str:
        with self.lock:
            b = self.router.route(session)
        self.m_requests.labels(b).inc()
        return b

    async def start(self):
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self._checker = asyncio.create_task(self._check_loop())

    async def stop(self):
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
        if self.client is not None:
            await self.client.aclose()

    async def _check_one(self, b: str):
        try:
            r = await self.client.get(b + "/health", timeout=max(1.0, self.health_interval_s))
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        self.mark(b, ok)

    async def _check_loop(self):
        while not self._closed:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._check_one(b) for b in self.backends))

    def close(self):
        self._closed = True


def make_app(fleet: FleetRouter) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await fleet.start()
        yield
        await fleet.stop()

    app = FastAPI(title="k3jax-router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        up = fleet.healthy()
        body = {"status": "ok" if up else "no healthy backend",
                "backends": {b: ("up" if b in up else "down") for b in fleet.backends}}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(fleet.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        for b in sorted(fleet.healthy()):
            try:
                r = await fleet.client.get(b + "/v1/models", timeout=10)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            except httpx.HTTPError:
                fleet.mark(b, False)
        raise APIError(503, "no healthy backend")

    async def proxy(request: Request):
        body = await read_json(request, max_bytes=fleet.max_body_bytes, timeout_s=30.0)
        raw = json.dumps(body).encode()
        session = session_of(request.headers, body)
        path = request.url.path
        tried = set()
        while True:
            try:
                backend = fleet.route(session)
            except RuntimeError:
                raise APIError(503, "no healthy backend") from None
            if backend in tried:
                raise APIError(503, "every backend failed this request")
            tried.add(backend)
            resp = await _forward(fleet, request, backend, path, raw)
            if resp is not None:
                return resp
            fleet.mark(backend, False)

    app.post("/v1/completions")(proxy)
    app.post("/v1/chat/completions")(proxy)
    return app


async def _forward(fleet: FleetRouter, request: Request, backend: str, path: str, raw: bytes):
    """Relay one request; None if the backend failed before any byte reached the client."""
    headers = {"Content-Type": "application/json"}
    for h in ("authorization", "x-session-id", "x-request-id"):
        if h in request.headers:
            headers[h] = request.headers[h]
    try:
        resp = await fleet.client.send(fleet.client.build_request("POST", backend + path, content=raw, headers=headers),
                                       stream=True)
    except httpx.HTTPError as e:
        log.warning("backend %s failed: %r", backend, e)
        return None
    out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
    out_headers["X-K3jax-Backend"] = backend
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            data = await resp.aread()
        except httpx.HTTPError as e:
            log.warning("backend %s failed mid-response: %r", backend, e)
            return None
        finally:
            await resp.aclose()
        return Response(data, status_code=resp.status_code, headers=out_headers)
    it = resp.aiter_raw()
    try:
        first = await it.__anext__()
    except (httpx.HTTPError, StopAsyncIteration) as e:
        log.warning("stream from %s failed before any byte: %r", backend, e)
        await resp.aclose()
        return None

    async def relay():
        try:
            yield first
            try:
                async for chunk in it:
                    yield chunk
            except httpx.HTTPError as e:
                log.warning("stream from %s broke: %r", backend, e)
                fleet.m_stream_breaks.labels(backend).inc()
                fleet.mark(backend, False)
                msg = f"the backend serving this stream failed: {type(e).__name__}"
                yield f"\n\ndata: {json.dumps(error_body(502, msg))}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()

    return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)


def serve_router(backends, *, host="127.0.0.1", port=8080, **kw):
    """Build the router server; returns ``(server, fleet)``: ``server.run()`` serves in the
    foreground, ``server.start()`` / ``server.stop()`` on a thread."""
    fleet = FleetRouter(backends, **kw)
    return BackgroundServer(make_app(fleet), host, port), fleet


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3jax-router", description="Route OpenAI-style requests over k3jax-serve backends.")
    ap.add_argument("backends", nargs="+", help="backend base URLs, e.g. http://127.0.0.1:8001")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--load-bound", type=float, default=1.25)
    ap.add_argument("--health-interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout towards a backend (s)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server, _ = serve_router(a.backends, host=a.host, port=a.port, c=a.load_bound, health_interval_s=a.health_interval,
                             timeout_s=a.timeout)
    print(f"k3jax-router: listening on http://{a.host}:{server.port} for {len(a.backends)} backends", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    main()
