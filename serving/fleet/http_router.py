"""``k3jax-router``: an async HTTP front end (FastAPI on uvicorn, httpx to the backends) that
forwards OpenAI-style requests to ``k3jax-serve`` backends.

Each request's session is the ``X-Session-Id`` header, else the body's ``user`` field (both
sticky while their backend is healthy), else for chat a hash of the messages through the first
user turn (turns of one conversation repeat them; conversations that share only a system prompt
differ in them), else for completions the conversation the prompt continues
(:meth:`serving.fleet.affinity.Affinity.prompt_session`: an earlier prompt this one extends,
never just a shared system prompt). Sessions are placed by :class:`serving.fleet.affinity.Affinity`:
backends that were sent the longest prefix of the prompt first, then the rendezvous ranking,
under bounds on both the sessions per backend and the outstanding work (the estimated tokens of
in-flight requests), no flapping; its state is pruned by size and age. A health checker polls
every backend's ``/health``; a backend that fails a check, or refuses or drops a request, is
marked down and the request is retried on the session's next cluster (a non-streamed request is
retried even if the backend died mid-request; a stream that already sent bytes cannot be: it ends
with an error event and ``[DONE]``). A backend's HTTP answer, 4xx included, is passed through
and never marks it down. Streams are passed through as they arrive; a client that leaves a
stream closes the backend connection (the backend aborts the request). The serving backend is
named in the ``X-K3jax-Backend`` response header. ``/metrics``: Prometheus counters per backend,
gauges of in-flight requests, outstanding tokens and sessions per backend.
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.fleet.affinity import Affinity
from serving.http_base import APIError, BackgroundServer, error_body, install_error_handlers, read_json

log = logging.getLogger("k3jax.router")
_HOP_HEADERS = {"connection", "transfer-encoding", "keep-alive", "content-length", "date", "server"}


def explicit_session(headers, body: dict) -> str | None:
    """The session id the client sent: the ``X-Session-Id`` header, else the body's ``user``."""
    sid = headers.get("X-Session-Id") or body.get("user")
    return str(sid) if sid else None


def chat_opening(body: dict) -> str:
    """A chat request's session without an id: a hash of its messages through the first user turn."""
    head = []
    for m in body.get("messages") or []:
        head.append(m)
        if isinstance(m, dict) and m.get("role") == "user":
            break
    return "c" + hashlib.blake2b(json.dumps(head, sort_keys=True).encode(), digest_size=8).hexdigest()


def chat_text(body: dict) -> str:
    """A chat request's messages as one text whose prefixes are the earlier turns' (for prefix matching)."""
    msgs = body.get("messages")
    return "".join(json.dumps(m, sort_keys=True) for m in msgs) if isinstance(msgs, list) else ""


def _int(x, default: int) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 else default


def estimate_cost(body: dict) -> int:
    """A request's work in tokens, for balancing: prompt (text counted at 4 characters a token)
    plus ``max_tokens``, times ``n``."""
    if isinstance(body.get("messages"), list):
        prompt = sum(len(str(m.get("content") or "")) if isinstance(m, dict) else 0 for m in body["messages"]) // 4
        out = _int(body.get("max_completion_tokens", body.get("max_tokens")), 256)
    else:
        p = body.get("prompt")
        prompt = len(p) // 4 if isinstance(p, str) else len(p) if isinstance(p, list) else 0
        out = _int(body.get("max_tokens"), 16)
    return (prompt + out) * max(1, min(_int(body.get("n"), 1), 64))


class _AffinityCollector:
    def __init__(self, fleet: "FleetRouter"):
        self.fleet = fleet

    def collect(self):
        a = self.fleet.affinity
        with self.fleet.lock:
            rows = [(b, a.inflight[b], a.work[b], a.count[b]) for b in a.backends]
            sessions, prompts, moved = len(a.sessions), a.num_prompts, a.moved_for_load
        for name, doc, i in (("k3jax_router_inflight_requests", "requests in flight per backend", 1),
                             ("k3jax_router_outstanding_tokens", "estimated tokens in flight per backend", 2),
                             ("k3jax_router_sessions", "sessions placed on each backend", 3)):
            g = GaugeMetricFamily(name, doc, labels=["backend"])
            for r in rows:
                g.add_metric([r[0]], r[i])
            yield g
        yield GaugeMetricFamily("k3jax_router_tracked_sessions", "sessions in the routing table", value=sessions)
        yield GaugeMetricFamily("k3jax_router_indexed_prompts", "prompts in the continuation index", value=prompts)
        yield CounterMetricFamily("k3jax_router_sessions_moved_for_load",
                                  "sessions without an id moved off an overloaded backend", value=moved)


class FleetRouter:
    """Routing state (thread-safe), metrics, and the async health checker and proxy client."""

    def __init__(self, backends, *, c: float = 1.25, health_interval_s: float = 1.0, timeout_s: float = 300.0,
                 max_body_bytes: int = 4 << 20, max_sessions: int = 65536, session_ttl_s: float = 3600.0):
        self.backends = list(dict.fromkeys(b.rstrip("/") for b in backends))
        if not self.backends:
            raise ValueError("at least one backend URL is needed")
        self.affinity = Affinity(self.backends, c=c, max_sessions=max_sessions, max_prompts=max_sessions,
                                 ttl_s=session_ttl_s)
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
        self.registry.register(_AffinityCollector(self))
        for b in self.backends:
            self.m_up.labels(b).set(1)
            self.m_requests.labels(b)
            self.m_failures.labels(b)
        self.client: httpx.AsyncClient | None = None
        self._checker: asyncio.Task | None = None
        self._closed = False

    def healthy(self) -> set[str]:
        with self.lock:
            return set(self.affinity.healthy)

    def mark(self, backend: str, up: bool):
        with self.lock:
            was = backend in self.affinity.healthy
            if up and not was:
                self.affinity.recover(backend)
                log.info("backend %s is up", backend)
            elif not up and was:
                self.affinity.fail(backend)
                self.m_failures.labels(backend).inc()
                log.warning("backend %s is down", backend)
            self.m_up.labels(backend).set(int(backend in self.affinity.healthy))

    def session(self, headers, body: dict) -> tuple[str, bool, list[bytes]]:
        """``(session, explicit, prompt blocks)`` of a request (see the module docstring)."""
        sid = explicit_session(headers, body)
        chat = "messages" in body
        prompt = chat_text(body) if chat else body.get("prompt")
        with self.lock:
            if sid is None and not chat:
                session, blocks = self.affinity.prompt_key(prompt)
                return session, False, blocks
            blocks = self.affinity.blocks(prompt)
        return (sid, True, blocks) if sid is not None else (chat_opening(body), False, blocks)

    def route(self, session: str, explicit: bool = False, cost: int = 1, blocks=()) -> str:
        with self.lock:
            b = self.affinity.route(session, explicit=explicit, cost=cost, blocks=blocks)
        self.m_requests.labels(b).inc()
        return b

    def lease(self, backend: str, cost: int):
        """Count a request as in flight on ``backend``; returns its idempotent release."""
        with self.lock:
            self.affinity.begin(backend, cost)
        done = False

        def release():
            nonlocal done
            if not done:
                done = True
                with self.lock:
                    self.affinity.end(backend, cost)
        return release

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
        session, explicit, blocks = fleet.session(request.headers, body)
        cost = estimate_cost(body)
        path = request.url.path
        tried = set()
        while True:
            try:
                backend = fleet.route(session, explicit, cost, blocks)
            except RuntimeError:
                raise APIError(503, "no healthy backend") from None
            if backend in tried:
                raise APIError(503, "every backend failed this request")
            tried.add(backend)
            resp = await _forward(fleet, request, backend, path, raw, fleet.lease(backend, cost))
            if resp is not None:
                return resp
            fleet.mark(backend, False)

    app.post("/v1/completions")(proxy)
    app.post("/v1/chat/completions")(proxy)
    return app


class _Relay(StreamingResponse):
    """A streamed response that runs ``on_close`` however it ends (finished, client gone, cancelled),
    even if its body iterator never started."""

    def __init__(self, content, *, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


async def _forward(fleet: FleetRouter, request: Request, backend: str, path: str, raw: bytes, release):
    """Relay one request; None if the backend failed before any byte reached the client.
    ``release`` is called once the backend is done with it."""
    headers = {"Content-Type": "application/json"}
    for h in ("authorization", "x-session-id", "x-request-id"):
        if h in request.headers:
            headers[h] = request.headers[h]
    try:
        resp = await fleet.client.send(fleet.client.build_request("POST", backend + path, content=raw, headers=headers),
                                       stream=True)
    except httpx.HTTPError as e:
        log.warning("backend %s failed: %r", backend, e)
        release()
        return None
    except BaseException:
        release()
        raise
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
            release()
        return Response(data, status_code=resp.status_code, headers=out_headers)
    it = resp.aiter_raw()
    try:
        first = await it.__anext__()
    except (httpx.HTTPError, StopAsyncIteration) as e:
        log.warning("stream from %s failed before any byte: %r", backend, e)
        await resp.aclose()
        release()
        return None
    except BaseException:
        await resp.aclose()
        release()
        raise

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

    async def close():
        await resp.aclose()
        release()

    return _Relay(relay(), status_code=resp.status_code, headers=out_headers, on_close=close)


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
    ap.add_argument("--load-bound", type=float, default=1.25,
                    help="a backend takes a new session only under this times the average sessions and work")
    ap.add_argument("--max-sessions", type=int, default=65536, help="sessions (and indexed prompts) kept")
    ap.add_argument("--session-ttl", type=float, default=3600.0, help="seconds a session is kept without a request")
    ap.add_argument("--health-interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout towards a backend (s)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server, _ = serve_router(a.backends, host=a.host, port=a.port, c=a.load_bound, health_interval_s=a.health_interval,
                             timeout_s=a.timeout, max_sessions=a.max_sessions, session_ttl_s=a.session_ttl)
    print(f"k3jax-router: listening on http://{a.host}:{server.port} for {len(a.backends)} backends", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    main()
