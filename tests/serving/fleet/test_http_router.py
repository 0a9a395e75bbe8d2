"""End to end: three k3jax-serve processes behind the HTTP router; one is killed mid-run."""

import http.client
import json
import re
import subprocess
import sys
import threading
import time

import pytest

from serving.fleet.http_router import serve_router


def _start_backend():
    return subprocess.Popen(
        [sys.executable, "-m", "serving.server", "--port", "0", "--max-slots", "2", "--max-len", "256",
         "--prefill-chunk", "64"],
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
    procs = [_start_backend() for _ in range(3)]
    try:
        deadline = time.time() + 300
        urls = [_wait_listening(p, deadline) for p in procs]
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
        ranked = [b for b in router.router.ranking(s) if b != victim]
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
