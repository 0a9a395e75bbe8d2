"""HTTP plumbing shared by ``k3jax-serve`` and ``k3jax-router`` (stdlib only: no JAX at import)."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler

log = logging.getLogger("k3jax.http")


class JSONHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 handler base with JSON, error and plain-text replies; access logs at debug level."""

    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        log.debug(fmt, *args)

    def _reply(self, code: int, data: bytes, content_type: str):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self, code: int, obj):
        self._reply(code, json.dumps(obj).encode(), "application/json")

    def _error(self, code: int, msg: str):
        self._json(code, {"error": {"message": msg, "type": "invalid_request_error" if code < 500 else "server_error"}})

    def _metrics(self, lines):
        """Prometheus text exposition of ``lines``."""
        self._reply(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4")
