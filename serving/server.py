"""``k3jax-serve``: the engine loop behind an OpenAI-compatible HTTP API (FastAPI on uvicorn).

Endpoints:

- ``POST /v1/completions``: ``prompt`` as text, token ids, or a list of either (one choice set per
  prompt); ``echo`` prepends the prompt text.
- ``POST /v1/chat/completions``: ``messages`` rendered by the tokenizer's chat template when it
  has one (``tokenizer_config.json``'s ``chat_template``, through jinja2); otherwise by the
  fallback template: one ``"{role}: {content}\\n"`` line per message, then ``"assistant:"``.
- ``GET /v1/models``, ``GET /health`` (503 while the engine loop keeps failing), ``GET /metrics``
  (Prometheus: counters, gauges, and TTFT / inter-token / end-to-end latency and length histograms).

Parameters: ``max_tokens`` (completions default 16; chat default: the rest of the context) or
``max_completion_tokens``, ``temperature`` (default 0 = greedy; below 1e-5 samples greedily),
``top_p``, ``top_k`` (0 or -1: off), ``seed`` (an integer in ``[-2**63, 2**64 - 1]``; choice ``i``
of ``n`` uses ``seed + i``), ``n``, ``stop`` (strings, not included in the text), ``stop_token_ids``,
``ignore_eos``, ``stream`` with ``stream_options.include_usage``, ``user`` and ``model`` (must be
the served model's name), log probabilities (completions: ``logprobs`` = k, chat: ``logprobs: true``
with ``top_logprobs`` = k; k in ``[0, 20]``: the sampled token's log probability and the k most
likely tokens', in OpenAI's shapes, streamed with each token). The checkpoint's ``eos_token_id``
stops generation. Parameters the server does not implement (``best_of`` other than ``n``,
``suffix``, penalties, ``logit_bias``, tools, prompt log probabilities (``echo`` with ``logprobs``),
any unknown field) get a 400 that names them.

Tokenizers: the embedded model's bytes; a checkpoint's ``tokenizer.json`` (tokenizers) or Kimi's
``tiktoken.model`` with ``tokenizer_config.json`` (tiktoken); streamed text never splits a character.

Errors use OpenAI's JSON shape. Limits: request body size (413), body read timeout (408), a
bounded waiting queue (429 with ``Retry-After``), a per-request deadline; a client that goes away
(streaming or not) has its requests aborted and their slots and pages freed. A request whose
processing fails inside the engine fails alone (500 with the reason); the loop goes on.

Engines: ``--engine step`` (:class:`serving.step_engine.StepEngine`, the default) or ``--engine
reference`` (:class:`serving.engine.Engine`, the golden float32 path); the server uses only their
public interface (``submit``, ``step``, ``abort``, ``validate``, ``has_work``, ``fail_running``,
``stats``, ``num_waiting``, ``warmup``, ``metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
import time
import uuid
from typing import Literal

import jax.numpy as jnp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from k3jax.parallel import multihost
from k3jax.parallel.sharded_step import step_mesh
from serving.engine import EMBEDDED, SEED_MAX, SEED_MIN, Engine, EngineBase, RequestError, SamplingParams
from serving.http_base import APIError, BackgroundServer, error_body, error_response, install_error_handlers, read_json
from serving.step_engine import StepEngine
from serving.tokenizers import Detokenizer, load_tokenizer, render_chat, token_text_bytes

MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (the engines' limit too)

log = logging.getLogger("k3jax.server")


# ---------------------------------------------------------------- request models
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    logprobs: dict | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    logprobs: dict | None = None
    finish_reason: str | None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"]]
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unsupported parameter: {'.'.join(loc)}", param=loc[0])
    return APIError(400, f"{'.'.join(loc) or 'body'}: {err['msg']}" + (f" (got {err['input']!r:.80})" if "input" in err else ""),
                    param=loc[0] if loc else None)


def _unsupported(req: _Sampling):
    """400 for parameters given with a value the server does not implement."""
    checks = [("presence_penalty", req.presence_penalty != 0), ("frequency_penalty", req.frequency_penalty != 0),
              ("logit_bias", bool(req.logit_bias))]
    if isinstance(req, CompletionRequest):
        checks += [("suffix", req.suffix is not None), ("best_of", req.best_of is not None and req.best_of != req.n)]
    for name, bad in checks:
        if bad:
            raise APIError(400, f"parameter {name} is not supported by this server", param=name)
    k = _logprobs(req)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        name = "logprobs" if isinstance(req, CompletionRequest) else "top_logprobs"
        raise APIError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {k}", param=name)
    if isinstance(req, CompletionRequest) and req.echo and k is not None:
        raise APIError(400, "prompt log probabilities (echo with logprobs) are not supported by this server",
                       param="logprobs")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


def _logprobs(req: _Sampling) -> int | None:
    """The top alternatives asked for per token (None: no log probabilities)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


# ---------------------------------------------------------------- engine loop
class EngineLoop:
    """Runs ``engine.step()`` on a background thread whenever there is work, isolating failures:
    a request whose sampling fails is finished with an ``error:`` reason by the engine alone; a
    step that raises fails the requests that were in it (``engine.fail_running``: each finishes
    with the reason, its pages and slot freed) and the loop goes on with the rest. ``/health`` is
    503 only while steps keep failing: after ``UNHEALTHY_AFTER`` failed steps in a row, until a
    step succeeds or ``RETRY_AFTER_S`` pass without a failure (a router that stopped sending
    requests then sends one again: without it the loop would stay unhealthy for want of work)."""

    UNHEALTHY_AFTER = 5  # consecutive failed steps
    RETRY_AFTER_S = 30.0

    def __init__(self, engine: EngineBase):
        self.engine = engine
        self.wake = threading.Event()
        self.stop = False
        self.error: BaseException | None = None
        self.consecutive_failures = 0
        self.last_failure = 0.0  # time.monotonic() of the last failed step
        self.step_failures = 0
        self.failed: dict[int, str] = {}
        self.tracked: dict[int, object] = {}  # rid -> engine request, until it finishes
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    @property
    def healthy(self) -> bool:
        failing = (self.consecutive_failures >= self.UNHEALTHY_AFTER
                   and time.monotonic() - self.last_failure < self.RETRY_AFTER_S)
        return self.thread.is_alive() and not failing

    def _run(self):
        while not self.stop:
            if not self.engine.has_work():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                self.engine.step()
                self.consecutive_failures = 0
            except Exception as e:  # noqa: BLE001 - isolate, keep serving
                log.exception("engine step failed")
                self.error, self.step_failures = e, self.step_failures + 1
                self.consecutive_failures += 1
                self.last_failure = time.monotonic()
                try:
                    self._isolate(e)
                except Exception:  # noqa: BLE001
                    log.exception("isolating a failed step failed")
                time.sleep(min(0.01 * 2 ** self.consecutive_failures, 1.0))

    def _isolate(self, e: BaseException):
        reason = f"error: the engine failed while serving this request: {e!r}"
        for r in self.engine.fail_running(e):
            self.failed.setdefault(r.rid, reason)

    def submit(self, prompt, sp, on_token):
        req = self.engine.submit(prompt, sp, on_token)
        with self.lock:
            self.tracked[req.rid] = req
        self.wake.set()
        return req

    def untrack(self, req):
        with self.lock:
            self.tracked.pop(req.rid, None)
        self.failed.pop(req.rid, None)

    def abort(self, req, reason: str = "abort"):
        self.engine.abort(req, reason)
        self.wake.set()


# ---------------------------------------------------------------- metrics
class _EngineCollector:
    """Engine counters (``engine.metrics``) and gauges (``engine.stats()``) read at scrape time."""

    GAUGES = {"running": ("k3jax_num_requests_running", "requests being served (holding a slot)"),
              "waiting": ("k3jax_num_requests_waiting", "requests queued"),
              "free_slots": ("k3jax_free_slots", "free request slots"),
              "free_pages": ("k3jax_pool_free_pages", "free (or evictable) pages in the page pool")}

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def collect(self):
        eng = self.loop.engine
        m = dict(eng.metrics)
        for k, v in sorted(m.items()):
            if k == "ttft_sum_s":
                continue
            yield _counter(f"k3jax_{k}", f"engine counter {k}", v)
        stats = eng.stats()
        for k, v in sorted(stats.items()):
            if k in self.GAUGES:
                yield _gauge(*self.GAUGES[k], v)
            elif k == "prefix_cache_hit_tokens":
                yield _counter("k3jax_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", v)
            elif k not in m and isinstance(v, (int, float)) and not isinstance(v, bool):
                yield _gauge(f"k3jax_engine_{k}", f"engine statistic {k}", v)
        yield _counter("k3jax_engine_step_failures", "engine steps that raised (their requests failed)",
                       self.loop.step_failures)
        yield _gauge("k3jax_healthy", "1 while the engine loop serves", int(self.loop.healthy))


def _counter(name, doc, v):
    c = CounterMetricFamily(name, doc)
    c.add_metric([], v)
    return c


def _gauge(name, doc, v):
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], v)
    return g


class Metrics:
    def __init__(self, loop: EngineLoop):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(loop))
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        toks = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
        r = self.registry
        self.ttft = Histogram("k3jax_time_to_first_token_seconds", "time to first token", buckets=lat, registry=r)
        self.itl = Histogram("k3jax_inter_token_latency_seconds", "time between tokens of a choice", buckets=lat,
                             registry=r)
        self.e2e = Histogram("k3jax_e2e_request_latency_seconds", "request arrival to last token", buckets=lat,
                             registry=r)
        self.prompt_len = Histogram("k3jax_request_prompt_tokens", "prompt length", buckets=toks, registry=r)
        self.output_len = Histogram("k3jax_request_generation_tokens", "generated tokens per choice", buckets=toks,
                                    registry=r)
        from prometheus_client import Counter

        self.http = Counter("k3jax_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                            registry=r)


# ---------------------------------------------------------------- serving one request
class _Choice:
    """One engine request as the async side sees it: tokens, text (stop strings applied) and state."""

    def __init__(self, index: int, tokenizer, stop: list[str], stop_ids: set[int], prefix_text: str = "",
                 logprobs: bool = False, prompt_index: int = 0):
        self.index, self.detok, self.stop, self.stop_ids = index, Detokenizer(tokenizer), stop, stop_ids
        self.prompt_index = prompt_index  # which prompt of the request it continues
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text, self.sent, self.token_ids = prefix_text, 0, []
        self.logprobs: list | None = [] if logprobs else None  # per token in token_ids: (offset, entry)
        self.events = 0  # engine tokens seen (tokens after a stop string included)
        self.start = len(prefix_text)  # stop strings are searched after the echoed prompt
        self.req = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.last_t: float | None = None

    def add(self, tok: int, logprobs=None) -> bool:
        """A generated token (with its engine log-probability entry when asked); True when a stop
        string ended the choice."""
        if self.finish_reason is not None:
            return False
        self.token_ids.append(tok)
        if self.logprobs is not None:
            self.logprobs.append((len(self.text), logprobs))
        if tok in self.stop_ids:
            return False
        return self._extend(self.detok.add(tok))

    def _extend(self, delta: str) -> bool:
        if not delta:
            return False
        search_from = max(self.start, len(self.text) - self.holdback)
        self.text += delta
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"
            return True
        return False

    def finish(self, engine_reason: str, failed: str | None):
        if self.finish_reason is not None:
            return
        reason = failed or engine_reason
        if reason.startswith(("error", "rejected")):
            self.error = reason
            self.finish_reason = "error"
            return
        self._extend(self.detok.flush())
        if self.finish_reason is None:
            self.finish_reason = {"stop": "stop", "length": "length"}.get(reason, reason)

    def pending_text(self) -> str:
        """Text not yet streamed (keeping back what could start a stop string while running)."""
        end = len(self.text) if self.finish_reason is not None else max(self.sent, len(self.text) - self.holdback)
        out = self.text[self.sent : end]
        self.sent = end
        return out


class App:
    """The FastAPI application around one engine loop."""

    def __init__(self, engine: EngineBase, tokenizer, *, model_name: str = "k3jax-tiny", max_waiting: int = 256,
                 max_body_bytes: int = 4 << 20, body_timeout_s: float = 30.0, request_timeout_s: float = 600.0,
                 loop: EngineLoop | None = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.loop = loop or EngineLoop(engine)
        self.max_waiting, self.max_body_bytes = max_waiting, max_body_bytes
        self.body_timeout_s, self.request_timeout_s = body_timeout_s, request_timeout_s
        self.eos = engine.cfg.eos_token_id
        self.metrics = Metrics(self.loop)
        self.created = int(time.time())
        self.app = self._build()

    # ---- routes
    def _build(self) -> FastAPI:
        app = FastAPI(title="k3jax-serve", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)

        app.add_middleware(_CountStatus, counter=self.metrics.http)

        @app.get("/health")
        async def health():
            ok = self.loop.healthy
            body = {"status": "ok"} if ok else {"status": f"unhealthy: {self.loop.error!r}"}
            return JSONResponse(body, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "k3jax", "max_model_len": self.engine.max_len}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await read_json(request, max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s)
            try:
                req = CompletionRequest.model_validate(body)
            except ValidationError as e:
                raise _validation_error(e) from None
            return await self._serve(request, req, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await read_json(request, max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s)
            try:
                req = ChatRequest.model_validate(body)
            except ValidationError as e:
                raise _validation_error(e) from None
            return await self._serve(request, req, chat=True)

        return app

    # ---- request -> engine requests
    def _prompts(self, req, chat: bool) -> list[tuple[list[int], str]]:
        """``(token ids, prompt text for echo)`` per prompt."""
        try:
            if chat:
                msgs = []
                for m in req.messages:
                    content = m.content if isinstance(m.content, str) or m.content is None else \
                        "".join(p.text for p in m.content)
                    msgs.append({"role": m.role, "content": content or ""} | ({"name": m.name} if m.name else {}))
                text = render_chat(self.tokenizer, msgs)
                return [(self.tokenizer.encode(text), text)]
            p = req.prompt
            if isinstance(p, str):
                return [(self.tokenizer.encode(p), p)]

            def ids(x):  # checked before they are decoded for echo (a tokenizer may raise on them)
                self.engine.check_tokens(x)
                return list(x), self.tokenizer.decode(x)

            if all(isinstance(t, int) for t in p):
                return [ids(p)]
            return [(self.tokenizer.encode(x), x) if isinstance(x, str) else ids(x) for x in p]
        except RequestError as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") is valid JSON but no UTF-8 text
            raise APIError(400, f"the text is not valid Unicode: {e.reason} at {e.start}",
                           param="messages" if chat else "prompt") from None

    def _params(self, req, chat: bool, prompt_len: int) -> list[SamplingParams]:
        max_tokens = req.max_tokens
        if chat and req.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != req.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
            max_tokens = req.max_completion_tokens
        if max_tokens is None and chat and prompt_len >= self.engine.max_len:
            raise APIError(400, f"the conversation ({prompt_len} tokens) leaves no room to answer within max_len "
                           f"{self.engine.max_len}", param="messages")
        if max_tokens is None:
            max_tokens = self.engine.max_len - prompt_len if chat else 16
        stop_ids = tuple(req.stop_token_ids or ())
        if self.eos is not None and not req.ignore_eos and self.eos not in stop_ids:
            stop_ids += (self.eos,)
        top_k = 0 if req.top_k == -1 else req.top_k
        if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
            raise APIError(400, f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {req.seed}", param="seed")
        out = []
        lp = {} if _logprobs(req) is None else {"logprobs": _logprobs(req)}
        for i in range(req.n):
            seed = None if req.seed is None else (req.seed if i == 0 else (req.seed + i) % 2**64)
            out.append(SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=top_k,
                                      top_p=req.top_p, seed=seed, stop_token_ids=stop_ids, **lp))
        return out

    async def _serve(self, request: Request, req, chat: bool):
        t_arrival = time.perf_counter()
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist (this server serves {self.model_name!r})",
                           param="model", code="model_not_found")
        _unsupported(req)
        prompts = self._prompts(req, chat)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must not be empty", param="stop")
        plan = []  # (prompt ids, prompt text, params)
        for ids, text in prompts:
            sps = self._params(req, chat, len(ids))
            for sp in sps:
                try:
                    self.engine.validate(ids, sp)
                except RequestError as e:
                    raise APIError(400, str(e)) from None
                plan.append((ids, text, sp))
        if len(plan) > self.max_waiting:  # would never fit the queue: not worth a retry
            raise APIError(400, f"{len(plan)} choices (prompts x n) exceed the server's queue of {self.max_waiting}",
                           param="n")
        waiting = self.engine.num_waiting
        if waiting + len(plan) > self.max_waiting:
            raise APIError(429, f"the server is busy ({waiting} requests waiting): retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        aio = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        choices: list[_Choice] = []

        def callback(index):
            def on_token(tok):  # engine thread: must never raise
                try:
                    aio.call_soon_threadsafe(events.put_nowait, (index, tok, time.perf_counter()))
                except RuntimeError:
                    pass
            return on_token

        for i, (ids, text, sp) in enumerate(plan):
            c = _Choice(i, self.tokenizer, stop, set(sp.stop_token_ids), text if (not chat and req.echo) else "",
                        logprobs=sp.logprobs is not None, prompt_index=i // req.n)  # each prompt's n in turn
            try:
                c.req = self.loop.submit(ids, sp, callback(i))
            except RequestError as e:  # validated above; kept for safety
                for d in choices:
                    self.loop.abort(d.req)
                raise APIError(400, str(e)) from None
            self.metrics.prompt_len.observe(len(ids))
            choices.append(c)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        ctx = _Ctx(rid, int(time.time()), t_arrival, chat, choices,
                   sum(len(ids) for ids, _ in prompts), events, time.perf_counter() + self.request_timeout_s)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(ctx, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, ctx)

    def _on_event(self, ctx: "_Ctx", index: int, tok, t: float):
        """Apply one engine event to its choice; True when the choice just finished."""
        c = ctx.choices[index]
        if tok is None:
            r = c.req.result
            failed = self.loop.failed.get(c.req.rid)
            c.finish(r.finish_reason if r is not None else "error: the request was lost", failed)
            self.loop.untrack(c.req)
            self.metrics.output_len.observe(len(c.token_ids))
            if not c.done_observed:
                c.done_observed = True
                ctx.remaining -= 1
            return True
        if c.last_t is None:
            self.metrics.ttft.observe(t - ctx.t_arrival)
        else:
            self.metrics.itl.observe(t - c.last_t)
        c.last_t = t
        entry = None
        if c.logprobs is not None:  # the engine appends a token's entry before announcing the token
            lps = c.req.logprobs
            entry = lps[c.events] if c.events < len(lps) else None
        c.events += 1
        if c.add(tok, entry):  # a stop string: the engine request is no longer needed
            self.loop.abort(c.req, "stop")
        return False

    async def _next(self, ctx: "_Ctx", request: Request | None):
        """The next engine event, or None after 0.25 s without one; at most every 0.25 s the
        deadline and (non-streaming) the client's connection are checked."""
        try:
            ev = await asyncio.wait_for(ctx.events.get(), 0.25)
        except TimeoutError:
            ev = None
        now = time.perf_counter()
        if ev is None or now - ctx.last_check > 0.25:
            ctx.last_check = now
            if now > ctx.deadline:
                raise APIError(504, f"the request did not finish within {self.request_timeout_s:g} s")
            if request is not None and await request.is_disconnected():
                raise _Disconnected()
        return ev

    def _cleanup(self, ctx: "_Ctx"):
        for c in ctx.choices:
            if not c.req.finished.is_set():
                self.loop.abort(c.req)
            self.loop.untrack(c.req)
        self.metrics.e2e.observe(time.perf_counter() - ctx.t_arrival)

    async def _complete(self, request: Request, ctx: "_Ctx"):
        try:
            while ctx.remaining:
                ev = await self._next(ctx, request)
                if ev is not None:
                    self._on_event(ctx, *ev)
        except _Disconnected:
            log.info("client left: aborted %s", ctx.rid)
            return Response(status_code=499)
        finally:
            self._cleanup(ctx)
        errors = [c.error for c in ctx.choices if c.error]
        if errors:
            e = errors[0]
            status = 503 if e.startswith("rejected") else 500
            raise APIError(status, e, code="engine_error")
        usage = ctx.usage()
        if ctx.chat:
            return ChatResponse(id=ctx.rid, created=ctx.created, model=self.model_name, usage=usage, choices=[
                ChatChoice(index=c.index, message=ChatChoiceMessage(content=c.text), finish_reason=c.finish_reason,
                           logprobs=self._logprobs_out(c, 0, True)) for c in ctx.choices]).model_dump()
        return CompletionResponse(id=ctx.rid, created=ctx.created, model=self.model_name, usage=usage, choices=[
            CompletionChoice(index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason,
                             logprobs=self._logprobs_out(c, 0, False)) for c in ctx.choices]).model_dump()

    def _token(self, tok: int) -> tuple[str, list[int]]:
        """A token as logprobs name it: its text (``bytes:\\xNN..`` when it is not whole UTF-8)
        and its bytes."""
        return token_text_bytes(self.tokenizer, tok)

    def _logprobs_out(self, c: _Choice, start: int, chat: bool, end: int | None = None) -> dict | None:
        """Choice ``c``'s log probabilities for its tokens ``start:end`` in OpenAI's shape:
        completions ``{tokens, token_logprobs, top_logprobs, text_offset}``, chat ``{content: [...]}``."""
        if c.logprobs is None:
            return None
        rows = list(zip(c.token_ids[start:end], c.logprobs[start:end]))
        if chat:
            content = []
            for tok, (_, e) in rows:
                name, raw = self._token(tok)
                top = []
                for t, lp in (e[1] if e else []):
                    n, b = self._token(t)
                    top.append({"token": n, "logprob": lp, "bytes": b})
                content.append({"token": name, "logprob": e[0] if e else None, "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, (offset, e) in rows:
            out["tokens"].append(self._token(tok)[0])
            out["token_logprobs"].append(e[0] if e else None)
            out["top_logprobs"].append({self._token(t)[0]: lp for t, lp in (e[1] if e else [])})
            out["text_offset"].append(offset)
        return out

    async def _stream(self, ctx: "_Ctx", include_usage: bool):
        base = {"id": ctx.rid, "object": "chat.completion.chunk" if ctx.chat else "text_completion",
                "created": ctx.created, "model": self.model_name}

        def chunk(choices, usage=None):
            d = dict(base, choices=choices)
            if include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        def choice(c: _Choice, text: str, tok: list[int], finish):
            lp = self._logprobs_out(c, len(c.token_ids) - 1, ctx.chat) if tok else None
            if ctx.chat:
                return {"index": c.index, "delta": {"content": text} if text or finish is None else {},
                        "logprobs": lp, "finish_reason": finish}
            return {"index": c.index, "text": text, "token_ids": tok, "logprobs": lp, "finish_reason": finish}

        try:
            if ctx.chat:
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in ctx.choices])
            elif any(c.text for c in ctx.choices):  # echo
                yield chunk([choice(c, c.pending_text(), [], None) for c in ctx.choices])
            while ctx.remaining:
                try:
                    ev = await self._next(ctx, None)
                except APIError as e:
                    yield _error_event(e.status, e.message)
                    return
                if ev is None:
                    continue
                index, tok, _ = ev
                c = ctx.choices[index]
                was_done = c.finish_reason is not None
                done = self._on_event(ctx, *ev)
                if c.error:
                    yield _error_event(503 if c.error.startswith("rejected") else 500, c.error)
                    return
                if was_done and not done:
                    continue  # tokens after a stop string
                if tok is None:
                    text = c.pending_text()
                    if not was_done or text:
                        yield chunk([choice(c, text, [], c.finish_reason)])
                    continue
                text = c.pending_text()
                yield chunk([choice(c, text, [tok], c.finish_reason if c.finish_reason == "stop" and not was_done
                                    else None)])
            if include_usage:
                d = dict(base, choices=[], usage=ctx.usage().model_dump())
                yield f"data: {json.dumps(d)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self._cleanup(ctx)


_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


class _CountStatus:
    """Pure ASGI middleware: counts responses by endpoint and status and answers an unexpected
    exception with a 500 in OpenAI's shape (no body buffering, so streaming and disconnect
    detection are untouched)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        started = False

        async def send_wrapper(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.labels(path if path in _ROUTES else "other", str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as e:  # noqa: BLE001 - answer 500 in OpenAI's shape and keep the connection
            log.exception("request failed")
            if started:
                raise
            await error_response(500, f"internal error: {e!r}")(scope, receive, send_wrapper)


def _error_event(status: int, message: str) -> str:
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n"


class _Disconnected(Exception):
    pass


class _Ctx:
    def __init__(self, rid, created, t_arrival, chat, choices, prompt_tokens, events, deadline):
        self.rid, self.created, self.t_arrival, self.chat, self.choices = rid, created, t_arrival, chat, choices
        self.prompt_tokens, self.events, self.deadline = prompt_tokens, events, deadline
        self.remaining = len(choices)
        self.last_check = time.perf_counter()
        for c in choices:
            c.done_observed = False

    def usage(self) -> Usage:
        out = sum(len(c.token_ids) for c in self.choices)
        per_prompt = {}  # a prompt's cached tokens: the most any of its choices found (counted once, as its tokens)
        for c in self.choices:
            if c.req.result is not None:
                per_prompt[c.prompt_index] = max(per_prompt.get(c.prompt_index, 0), c.req.result.num_cached_tokens)
        cached = sum(per_prompt.values())
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=out, total_tokens=self.prompt_tokens + out,
                     prompt_tokens_details={"cached_tokens": cached})


def build_app(engine: EngineBase, tokenizer, **kw) -> App:
    """The FastAPI app (``.app``) and its engine loop (``.loop``) for ``engine``."""
    return App(engine, tokenizer, **kw)


def serve(engine: EngineBase, tokenizer, *, host="127.0.0.1", port=8000, model_name="k3jax-tiny", **kw):
    """Start the engine loop and bind the HTTP server; returns ``(server, app)``: ``server.run()``
    serves in the foreground, ``server.start()`` / ``server.stop()`` on a thread; ``server.port``."""
    a = App(engine, tokenizer, model_name=model_name, **kw)
    return BackgroundServer(a.app, host, port, log_level="warning"), a


def positive_ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="k3jax-serve", description="Serve a Kimi Linear model over an OpenAI-compatible API.")
    ap.add_argument("--model", default="tiny", help="'tiny' (embedded default), 'tiny-k3' (an embedded tiny Kimi K3) "
                                                     "or a Hugging Face checkpoint directory")
    ap.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    ap.add_argument("--engine", choices=("step", "reference"), default="step",
                    help="step: serving.StepEngine (the serving step on the unified page pool; the default); "
                         "reference: serving.Engine (the golden float32 path on per-slot caches)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-slots", type=int, default=4, help="requests decoded together")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=256,
                    help="prefill tokens per step (step engine: the step's token budget, decode rows included)")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--speculative", type=int, default=0,
                    help="draft tokens per step for greedy requests (n-gram prompt lookup; 0 = off)")
    ap.add_argument("--spec-backoff", type=int, default=16,
                    help="most plain steps a request waits after windows with no accepted draft (0 = never wait)")
    ap.add_argument("--max-prefill-rows", type=int, default=4, help="step engine: prefill chunks per step")
    ap.add_argument("--decode-buckets", type=positive_ints, default=None,
                    help="step engine: compiled decode batch sizes, e.g. 1,4 (default: powers of four)")
    ap.add_argument("--prefill-buckets", type=positive_ints, default=None,
                    help="step engine: compiled prefill token counts, e.g. 64,256 (default: powers of four from 64)")
    ap.add_argument("--mixed-decode-buckets", type=positive_ints, default=None,
                    help="step engine: decode rows of the compiled steps that also prefill (default: the largest "
                         "decode bucket only; give the decode buckets to compile every pair)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="step engine: weights and activations (float32 for exact comparisons)")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="step engine: devices the heads, dense widths and vocabulary split over")
    ap.add_argument("--expert-parallel", type=int, default=1,
                    help="step engine: a second mesh axis the routed experts split over (with --tensor-parallel's)")
    ap.add_argument("--data-parallel", type=int, default=1,
                    help="step engine: data shards (a third mesh axis), each with its own batch, pages, prefix cache "
                         "and scheduler (--max-slots each; a request goes to the lane caching most of its prompt, then the "
                         "least busy); the routed experts split "
                         "over all three axes")
    ap.add_argument("--context-parallel-from", type=int, default=None,
                    help="step engine with --expert-parallel (no --data-parallel): steps with at least this many "
                         "prefill tokens split them over the expert axis (KCP), where attention is otherwise "
                         "replicated")
    ap.add_argument("--coordinator", default=None,
                    help="step engine on several hosts: process 0's host:port for jax.distributed (one k3jax-serve "
                         "per host, the same flags on each; process 0 serves HTTP, the others run its steps)")
    ap.add_argument("--num-processes", type=int, default=1, help="with --coordinator: the processes (hosts)")
    ap.add_argument("--process-id", type=int, default=0, help="with --coordinator: this process's index")
    ap.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20)
    ap.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline in seconds")
    return ap


def make_engine(a: argparse.Namespace):
    """The engine the parsed flags ask for (not warmed up)."""
    sharded = a.data_parallel * a.tensor_parallel * a.expert_parallel > 1 or a.coordinator is not None
    if a.engine == "step":
        return StepEngine(a.model, dtype=getattr(jnp, a.dtype), max_running=a.max_slots, max_len=a.max_len,
                          token_budget=a.prefill_chunk, max_prefill_rows=a.max_prefill_rows, prefix_cache=not a.no_prefix_cache,
                          decode_buckets=a.decode_buckets, prefill_buckets=a.prefill_buckets,
                          mixed_decode_buckets=a.mixed_decode_buckets, speculative=a.speculative, spec_backoff=a.spec_backoff,
                          mesh=step_mesh(a.tensor_parallel, a.expert_parallel, data=a.data_parallel) if sharded else None,
                          context_parallel_from=a.context_parallel_from)
    if sharded or a.context_parallel_from is not None:
        raise ValueError("--data-parallel, --tensor-parallel, --expert-parallel and --context-parallel-from need "
                         "--engine step")
    return Engine(a.model, max_slots=a.max_slots, max_len=a.max_len, prefill_chunk=a.prefill_chunk,
                  prefix_cache=not a.no_prefix_cache, speculative=a.speculative, spec_backoff=a.spec_backoff)


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    if a.speculative < 0 or a.spec_backoff < 0:
        ap.error("--speculative and --spec-backoff must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if a.coordinator is None and (a.num_processes != 1 or a.process_id != 0):
        ap.error("--num-processes and --process-id need --coordinator")
    if a.coordinator is not None:
        if a.engine != "step":
            ap.error("--coordinator needs --engine step")
        try:
            multihost.initialize(a.coordinator, a.num_processes, a.process_id)
        except ValueError as e:
            ap.error(str(e))
    print(f"k3jax-serve: loading {a.model} ({a.engine} engine) ...", flush=True)
    try:
        engine = make_engine(a)
    except ValueError as e:
        ap.error(str(e))
    if not multihost.is_lead():
        print(f"k3jax-serve: process {a.process_id} runs process 0's steps", flush=True)
        engine.runner.follow()
        return 0
    # SIGTERM as Ctrl-C: uvicorn re-raises the signal after its shutdown; the default action would
    # end the process before it stops the other processes of a multi-host engine.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    app = None
    try:
        tokenizer = load_tokenizer(a.model)
        print("k3jax-serve: compiling ...", flush=True)
        t0 = time.perf_counter()
        engine.warmup()
        print(f"k3jax-serve: warm in {time.perf_counter() - t0:.1f} s", flush=True)
        name = a.served_model_name or (f"k3jax-{a.model}" if a.model in EMBEDDED else a.model)
        server, app = serve(engine, tokenizer, host=a.host, port=a.port, model_name=name, max_waiting=a.max_waiting,
                            max_body_bytes=a.max_body_bytes, request_timeout_s=a.request_timeout)
        print(f"k3jax-serve: listening on http://{a.host}:{server.port}  "
              f"(try: curl -s localhost:{server.port}/v1/completions -d '{{\"prompt\": \"Hello\", \"max_tokens\": 8}}')",
              flush=True)
        server.run()
    except KeyboardInterrupt:
        pass
    finally:  # however process 0 ends, the others stop too (else they wait in the step channel)
        if app is not None:
            app.loop.stop = True
            app.loop.thread.join(timeout=60)
        if isinstance(engine, StepEngine) and (app is None or not app.loop.thread.is_alive()):
            engine.runner.stop_followers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
