"""``k3jax-router``: an HTTP front end that forwards OpenAI-style requests to ``k3jax-serve`` backends.

Each request's session (the ``X-Session-Id`` header, else the body's ``user`` field, else a hash
of the prompt's first 512 tokens or bytes, so turns of one conversation share it) is routed by
:class:`serving.fleet.Router`: rendezvous primary/secondary with bounded loads, sticky, no
flapping. A health checker polls every backend's ``/health``; a backend that fails a check, or
refuses or drops a request, is marked down and the request is retried on the session's next
cluster (a non-streamed request is retried even if the backend died mid-request; a stream that
already sent bytes cannot be, and is closed). The serving backend is named in the
``X-K3jax-Backend`` response header.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import logging
import threading
import urllib.parse
from http.server import ThreadingHTTPServer

from serving.fleet.routing import Router
from serving.http_base import JSONHandler

log = logging.getLogger("k3jax.router")
_HOP_HEADERS = {"connection", "transfer-encoding", "keep-alive", "content-length"}


def session_of(headers, body: dict) -> str:
    """The routing key of a request (see the module docstring)."""
    sid = headers.get("X-Session-Id") or body.get("user")
    if sid:
        return str(sid)
    prompt = body.get("prompt")
    head = prompt[:512] if isinstance(prompt, (list, str)) else prompt
    return "p" + hashlib.blake2b(json.dumps(head).encode(), digest_size=8).hexdigest()


class FleetRouter:
    """Routing state plus the health checker (thread-safe)."""

    def __init__(self, backends, *, c: float = 1.25, health_interval_s: float = 1.0, timeout_s: float = 300.0):
        self.backends = [b.rstrip("/") for b in backends]
        if not self.backends:
            raise ValueError("at least one backend URL is needed")
        self.router = Router(self.backends, c=c)
        self.lock = threading.Lock()
        self.timeout_s = timeout_s
        self.health_interval_s = health_interval_s
        self.stats = {b: {"requests": 0, "failures": 0} for b in self.backends}
        self._stop = threading.Event()
        self._checker = threading.Thread(target=self._check_loop, daemon=True)
        self._checker.start()

    def _conn(self, backend: str, timeout: float):
        u = urllib.parse.urlsplit(backend)
        return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)

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
                self.stats[backend]["failures"] += 1
                log.warning("backend %s is down", backend)

    def _check_loop(self):
        while not self._stop.wait(self.health_interval_s):
            for b in self.backends:
                try:
                    conn = self._conn(b, timeout=max(1.0, self.health_interval_s))
                    conn.request("GET", "/health")
                    ok = conn.getresponse().status == 200
                    conn.close()
                except OSError:
                    ok = False
                self.mark(b, ok)

    def route(self, session: str) -> str:
        with self.lock:
            b = self.router.route(session)
            self.stats[b]["requests"] += 1
            return b

    def close(self):
        self._stop.set()


def make_handler(fleet: FleetRouter):
    class Handler(JSONHandler):

        def do_GET(self):
            if self.path == "/health":
                up = fleet.healthy()
                body = {"status": "ok" if up else "no healthy backend",
                        "backends": {b: ("up" if b in up else "down") for b in fleet.backends}}
                self._json(200 if up else 503, body)
            elif self.path == "/metrics":
                with fleet.lock:
                    lines = []
                    for b, st in fleet.stats.items():
                        for k, v in st.items():
                            lines.append(f'k3jax_router_{k}_total{{backend="{b}"}} {v}')
                self._metrics(lines)
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                body = json.loads(raw or b"null")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
            except ValueError as e:
                return self._error(400, str(e))
            session = session_of(self.headers, body)
            tried = set()
            while True:
                try:
                    backend = fleet.route(session)
                except RuntimeError:
                    return self._error(503, "no healthy backend")
                if backend in tried:
                    return self._error(503, "every backend failed this request")
                tried.add(backend)
                if self._forward(backend, raw):
                    return
                fleet.mark(backend, False)

        def _forward(self, backend: str, raw: bytes) -> bool:
            """Relay one request; False if the backend failed before any byte reached the client."""
            try:
                conn = fleet._conn(backend, timeout=fleet.timeout_s)
                conn.request("POST", self.path, body=raw, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                if resp.getheader("Content-Type", "").startswith("text/event-stream"):
                    first = resp.read1(65536)
                    if not first:
                        return False
                else:
                    data = resp.read()
            except (OSError, http.client.HTTPException) as e:
                log.warning("backend %s failed: %r", backend, e)
                return False
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP_HEADERS:
                    self.send_header(k, v)
            self.send_header("X-K3jax-Backend", backend)
            if resp.getheader("Content-Type", "").startswith("text/event-stream"):
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    chunk = first
                    while chunk:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        chunk = resp.read1(65536)
                except (OSError, http.client.HTTPException) as e:
                    log.warning("stream from %s broke: %r", backend, e)
                self.close_connection = True
            else:
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            conn.close()
            return True

    return Handler


def serve_router(backends, *, host="127.0.0.1", port=8080, **kw):
    """Build the router server; returns ``(server, fleet)`` (call ``server.serve_forever``)."""
    fleet = FleetRouter(backends, **kw)
    server = ThreadingHTTPServer((host, port), make_handler(fleet))
    server.daemon_threads = True
    return server, fleet


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3jax-router", description="Route OpenAI-style requests over k3jax-serve backends.")
    ap.add_argument("backends", nargs="+", help="backend base URLs, e.g. http://127.0.0.1:8001")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--load-bound", type=float, default=1.25)
    ap.add_argument("--health-interval", type=float, default=1.0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server, _ = serve_router(a.backends, host=a.host, port=a.port, c=a.load_bound, health_interval_s=a.health_interval)
    print(f"k3jax-router: listening on http://{a.host}:{server.server_address[1]} for {len(a.backends)} backends", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    main()
