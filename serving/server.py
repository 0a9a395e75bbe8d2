"""``k3jax-serve``: the engine loop behind an OpenAI-compatible HTTP API.

Endpoints: ``POST /v1/completions`` (``prompt`` as text or a list of token ids; ``max_tokens``,
``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_token_ids``, ``stream``), ``GET /health``,
``GET /metrics`` (Prometheus text). Bad input gets a 400 with the reason and never reaches the
loop; a client that disconnects while streaming has its request aborted and its pages freed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from serving.engine import Engine, RequestError, SamplingParams
from serving.http_base import JSONHandler

log = logging.getLogger("k3jax.server")


class ByteTokenizer:
    """UTF-8 bytes as token ids (the embedded default model's vocabulary of 256)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint directory's tokenizer through ``tokenizers`` (when installed)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class NoTokenizer:
    """For checkpoints without a tokenizer file: prompts must be token-id lists."""

    def encode(self, text: str) -> list[int]:
        raise RequestError("this model has no tokenizer (no tokenizer.json in its directory): send the prompt as token ids")

    def decode(self, ids: list[int]) -> str:
        return ""


def load_tokenizer(model: str):
    """The embedded model's byte tokenizer, a checkpoint's ``tokenizer.json``, or :class:`NoTokenizer`."""
    if model == "tiny":
        return ByteTokenizer()
    path = os.path.join(model, "tokenizer.json")
    if os.path.exists(path):
        return HFTokenizer(path)
    log.warning("no tokenizer.json in %s: prompts must be token-id lists", model)
    return NoTokenizer()


class EngineLoop:
    """Runs ``engine.step()`` on a background thread whenever there is work."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.wake = threading.Event()
        self.stop = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            if not self.engine.has_work():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as e:  # keep serving; the failure is visible in /health and the log
                log.exception("engine step failed")
                self.error = e
                time.sleep(0.1)

    def submit(self, prompt, sp, on_token):
        req = self.engine.submit(prompt, sp, on_token)
        self.wake.set()
        return req


def _parse(body: dict, tokenizer, engine: Engine):
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    else:
        raise RequestError("prompt must be a string or a list of token ids")
    try:
        sp = SamplingParams(
            max_tokens=int(body.get("max_tokens", 16)), temperature=float(body.get("temperature", 0.0)),
            top_k=int(body.get("top_k", 0)), top_p=float(body.get("top_p", 1.0)),
            seed=None if body.get("seed") is None else int(body["seed"]),
            stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids", ())),
        )
    except (TypeError, ValueError) as e:
        raise RequestError(f"bad sampling parameter: {e}") from None
    engine.validate(ids, sp)
    return ids, sp


def make_handler(loop: EngineLoop, tokenizer, model_name: str):
    engine = loop.engine

    class Handler(JSONHandler):

        def do_GET(self):
            if self.path == "/health":
                ok = loop.error is None and loop.thread.is_alive()
                self._json(200 if ok else 503, {"status": "ok" if ok else f"unhealthy: {loop.error!r}"})
            elif self.path == "/metrics":
                m = dict(engine.metrics)
                if engine.cache is not None:
                    m.update({f"cache_{k}": v for k, v in engine.cache.metrics.items()})
                lines = []
                for k, v in sorted(m.items()):
                    name = f"k3jax_{k}" + ("_total" if not k.endswith("_s") else "")
                    lines += [f"# TYPE {name} counter", f"{name} {v}"]
                self._metrics(lines)
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):
            if self.path != "/v1/completions":
                return self._error(404, f"no route {self.path}")
            try:
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"null")
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                ids, sp = _parse(body, tokenizer, engine)
            except (RequestError, json.JSONDecodeError, ValueError) as e:
                return self._error(400, str(e))
            tokens: queue.Queue = queue.Queue()
            req = loop.submit(ids, sp, tokens.put)
            created = int(time.time())
            if not body.get("stream"):
                req.finished.wait()
                r = req.result
                if r.finish_reason.startswith("rejected"):
                    return self._error(503, r.finish_reason)
                return self._json(200, {
                    "id": f"cmpl-{r.request_id}", "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": tokenizer.decode(r.token_ids), "token_ids": r.token_ids,
                                 "finish_reason": r.finish_reason}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(r.token_ids),
                              "total_tokens": len(ids) + len(r.token_ids), "cached_tokens": r.num_cached_tokens},
                })
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                while True:
                    tok = tokens.get()
                    if tok is None:
                        r = req.result
                        chunk = {"choices": [{"index": 0, "text": "", "finish_reason": r.finish_reason}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
                        self.wfile.flush()
                        break
                    chunk = {"id": f"cmpl-{req.rid}", "object": "text_completion", "created": created, "model": model_name,
                             "choices": [{"index": 0, "text": tokenizer.decode([tok]), "token_ids": [tok],
                                          "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                engine.abort(req)  # the client went away: free its slot and pages
                loop.wake.set()
            self.close_connection = True

    return Handler


def serve(engine: Engine, tokenizer, *, host="127.0.0.1", port=8000, model_name="k3jax-tiny"):
    """Start the engine loop and the HTTP server; returns ``(server, loop)`` (call ``server.serve_forever``)."""
    loop = EngineLoop(engine)
    server = ThreadingHTTPServer((host, port), make_handler(loop, tokenizer, model_name))
    server.daemon_threads = True
    return server, loop


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3jax-serve", description="Serve a Kimi Linear model over an OpenAI-compatible API.")
    ap.add_argument("--model", default="tiny", help="'tiny' (embedded default) or a Hugging Face checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-slots", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--speculative", type=int, default=0,
                    help="draft tokens per step for greedy requests (n-gram prompt lookup; 0 = off)")
    ap.add_argument("--spec-backoff", type=int, default=16,
                    help="most plain steps a request waits after windows with no accepted draft (0 = never wait)")
    a = ap.parse_args(argv)
    if a.speculative < 0 or a.spec_backoff < 0:
        ap.error("--speculative and --spec-backoff must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(f"k3jax-serve: loading {a.model} ...", flush=True)
    engine = Engine(a.model, max_slots=a.max_slots, max_len=a.max_len, prefill_chunk=a.prefill_chunk,
                    prefix_cache=not a.no_prefix_cache, speculative=a.speculative, spec_backoff=a.spec_backoff)
    tokenizer = load_tokenizer(a.model)
    print("k3jax-serve: compiling (first request shapes) ...", flush=True)
    t0 = time.perf_counter()
    engine.warmup(prefill=False)
    engine.generate([[3] * 8], max_tokens=2)
    print(f"k3jax-serve: warm in {time.perf_counter() - t0:.1f} s", flush=True)
    server, _ = serve(engine, tokenizer, host=a.host, port=a.port, model_name=a.model)
    print(f"k3jax-serve: listening on http://{a.host}:{server.server_address[1]}  "
          f"(try: curl -s localhost:{server.server_address[1]}/v1/completions -d '{{\"prompt\": \"Hello\", \"max_tokens\": 8}}')",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
