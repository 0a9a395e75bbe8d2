"""End to end: three k3jax-serve processes behind the HTTP router; one is killed mid-run. The
routing policy over HTTP on in-process stand-in backends: a shared system prompt spreads,
conversations and session ids stick, in-flight work is released."""

import asyncio
import collections
import http.client
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serving.fleet.http_router import serve_router
from serving.http_base import BackgroundServer


def _start_backend():
    # One decode and one prefill bucket (the prompts here fit 32 tokens), so warm-up compiles little.
    return subprocess.Popen(
        [sys.executable, "-m", "serving.server", "--port", "0", "--max-slots", "2", "--max-len", "256",
         "--prefill-chunk", "32", "--max-prefill-rows", "1", "--decode-buckets", "2", "--prefill-buckets", "32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait_listening(proc, deadline):
    for line in proc.stdout:
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain
            return m.group(1)
        if time.time() > deadline:
            break
    raise RuntimeError(f"backend did not start (exit code {proc.poll()})")


@pytest.fixture(scope="module")
def fleet():
    procs = [_start_backend()]
    try:
        deadline = time.time() + 300
        urls = [_wait_listening(procs[0], deadline)]
        # The others start once the first has compiled: they read its programs from the persistent
        # compilation cache the test run shares instead of compiling them again at the same time.
        procs += [_start_backend() for _ in range(2)]
        urls += [_wait_listening(p, deadline) for p in procs[1:]]
        server, router = serve_router(urls, port=0, health_interval_s=0.2, timeout_s=120)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield server.server_address[1], dict(zip(urls, procs)), router
        server.shutdown()
        router.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _post(port, body, session):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"X-Session-Id": session})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.getheader("X-K3jax-Backend"), data


def _complete(port, session, prompt, max_tokens=6):
    status, backend, data = _post(port, {"prompt": prompt, "max_tokens": max_tokens}, session)
    assert status == 200, data
    return backend, json.loads(data)["choices"][0]["token_ids"]


def test_sticky_routing_failover_and_streaming(fleet):
    port, procs, router = fleet
    sessions = [f"user{i}" for i in range(9)]
    first = {s: _complete(port, s, f"Hello from {s}") for s in sessions}
    assert len({b for b, _ in first.values()}) >= 2, "sessions spread over backends"
    for s in sessions:  # sticky: the same backend, and greedy decoding gives the same tokens
        assert _complete(port, s, f"Hello from {s}") == first[s]

    victim = max(procs, key=lambda b: sum(first[s][0] == b for s in sessions))
    moved = [s for s in sessions if first[s][0] == victim]
    results, errors = {}, []

    def worker(s):
        try:
            results[s] = _complete(port, s, f"Hello from {s}", max_tokens=48)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    time.sleep(0.05)
    procs[victim].kill()  # mid-run: these requests are in flight on it or about to be sent to it
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert set(results) == set(sessions), "every request was answered"
    for s in sessions:
        backend, tokens = results[s]
        assert tokens[:6] == first[s][1], "the same greedy output on whichever backend served it"
        if s not in moved:
            assert backend == first[s][0], "sessions on healthy backends do not move"
    # A request can only have come back from the victim if it finished before the kill; the
    # others failed over. Moved sessions go to their next-ranked healthy cluster and stay there.
    assert any(results[s][0] != victim for s in moved), "no request failed over"
    for s in moved:
        ranked = [b for b in router.affinity.ranking(s) if b != victim]
        again = _complete(port, s, "again")[0]
        assert again in ranked[:2]
        if results[s][0] != victim:
            assert results[s][0] == again

    deadline = time.time() + 10
    while victim in router.healthy() and time.time() < deadline:
        time.sleep(0.1)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    assert health["backends"][victim] == "down"

    # Streaming through the router.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "stream me", "max_tokens": 5, "stream": True}))
    resp = conn.getresponse()
    text = resp.read().decode()
    assert resp.status == 200 and text.rstrip().endswith("data: [DONE]")
    assert sum(1 for line in text.splitlines() if line.startswith("data: {")) == 6  # 5 tokens + the final chunk

    status, _, data = _post(port, {"prompt": "", "max_tokens": 2}, "x")
    assert status == 400, "a backend's 4xx passes through"

    # A backend's 4xx passes through and never marks it down.
    up = router.healthy()
    for _ in range(3):
        assert _post(port, {"prompt": "hi", "max_tokens": 2, "top_k": 1e300}, "x")[0] == 400
    assert router.healthy() == up

    # /metrics in Prometheus types.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    assert "# TYPE k3jax_router_requests_total counter" in text and "# TYPE k3jax_router_backend_up gauge" in text

    # A backend killed mid-stream: the stream ends with an error event, later requests are served.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "a long stream", "max_tokens": 200,
                                                             "stream": True}), headers={"X-Session-Id": "cut"})
    resp = conn.getresponse()
    backend = resp.getheader("X-K3jax-Backend")
    assert resp.status == 200 and backend in procs and backend != victim
    first = b""
    while b"data: {" not in first:
        first += resp.read1(4096)
    procs[backend].kill()
    rest = resp.read().decode()
    assert len(rest.split("data: {")) < 200, "killed mid-stream"
    events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), rest[-500:]
    backend2, tokens = _complete(port, "cut", "a long stream")
    assert backend2 not in (backend, victim) and len(tokens) >= 1


# ---------------------------------------------------------------- routing policy over HTTP (fake backends, no JAX)
def _fake_backend(name: str, delay_s: float):
    """A stand-in for k3jax-serve: answers after ``delay_s`` with its name; streams five events."""
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await request.json()
        await asyncio.sleep(delay_s)
        if body.get("stream"):
            async def events():
                for i in range(5):
                    yield f"data: {json.dumps({'backend': name, 'i': i})}\n\n"
                    await asyncio.sleep(delay_s)
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"backend": name}

    app.post("/v1/chat/completions")(complete)
    return BackgroundServer(app).start()


@pytest.fixture(scope="module")
def fake_fleet():
    backends = [_fake_backend(f"b{i}", 0.02) for i in range(3)]
    server, router = serve_router([b.url for b in backends], port=0, health_interval_s=0.2)
    server.start()
    yield server.port, router, {b.url: f"b{i}" for i, b in enumerate(backends)}
    server.stop()
    for b in backends:
        b.stop()


async def _send(port, bodies, headers=None, clients=12, path="/v1/completions"):
    """POST each body (at most ``clients`` at once); the backend that served each."""
    sem = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=60) as c:
        async def one(body):
            async with sem:
                r = await c.post(f"http://127.0.0.1:{port}{path}", json=body, headers=headers or {})
                assert r.status_code == 200, r.text
                return r.headers["X-K3jax-Backend"]
        return await asyncio.gather(*(one(b) for b in bodies))


SYSTEM_PROMPT = "You are a helpful assistant for the k3jax serving stack. " * 12  # 684 characters, every request


def test_shared_system_prompt_spreads_and_sessions_stick(fake_fleet):
    port, router, _ = fake_fleet
    firsts = [SYSTEM_PROMPT + f"User: question number {i}?" for i in range(60)]
    placed = asyncio.run(_send(port, [{"prompt": p, "max_tokens": 8} for p in firsts]))
    counts = collections.Counter(placed)
    assert len(counts) == 3 and max(counts.values()) <= 25 and min(counts.values()) >= 10, counts
    # The next turn of each conversation (the earlier prompt, an answer, a new question) stays.
    seconds = [p + " Assistant: an answer. User: and then?" for p in firsts]
    again = asyncio.run(_send(port, [{"prompt": p, "max_tokens": 8} for p in seconds], clients=1))  # one by one
    assert again == placed
    # A session id (header or user) sticks whatever the prompt, under concurrent load.
    for key, headers, extra in (("hdr", {"X-Session-Id": "alice"}, {}), ("user", None, {"user": "bob"})):
        got = asyncio.run(_send(port, [{"prompt": f"{key} {i}", "max_tokens": 8} | extra for i in range(24)],
                                headers=headers))
        assert len(set(got)) == 1, (key, got)
    # Chat without an id: conversations that share only a system message spread.
    chats = [{"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"question {i}"}]}
             for i in range(30)]
    assert len(set(asyncio.run(_send(port, chats, path="/v1/chat/completions")))) == 3
    assert all(v == 0 for v in router.affinity.inflight.values()) and all(v == 0 for v in router.affinity.work.values())


def test_inflight_work_is_released_however_a_request_ends(fake_fleet):
    port, router, _ = fake_fleet
    # A stream the client abandons after its first event, and one read to the end.
    for abandon in (True, False):
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                          json={"prompt": "stream", "stream": True}) as r:
                backend = r.headers["X-K3jax-Backend"]
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                if abandon:
                    assert router.affinity.inflight[backend] == 1
                else:
                    assert [ln for ln in lines if ln][-1] == "data: [DONE]"
    deadline = time.time() + 10
    while any(router.affinity.inflight.values()) and time.time() < deadline:
        time.sleep(0.02)
    assert all(v == 0 for v in router.affinity.inflight.values()) and all(v == 0 for v in router.affinity.work.values())
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    for line in ("# TYPE k3jax_router_inflight_requests gauge", "# TYPE k3jax_router_sessions gauge",
                 "# TYPE k3jax_router_tracked_sessions gauge", "# TYPE k3jax_router_outstanding_tokens gauge"):
        assert line in text, line
