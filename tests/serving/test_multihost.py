"""The step engine over two processes (jax.distributed on loopback, gloo collectives): one
``k3jax-serve`` per process, two fake CPU devices each, one data 2 x tensor 2 mesh over the four
(so each process holds one data shard's lane, whose results process 0 reads); process 0 serves
HTTP and sends each step to process 1."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import jax
import jax.numpy as jnp

from k3jax.model import ModelConfig, forward, init_cache, init_params
from serving.engine import CONFIGS

PROMPT, MAX_TOKENS = [5, 6, 7, 8, 9, 10, 11], 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy_reference() -> list[int]:
    cfg = ModelConfig.from_json(f"{CONFIGS}/tiny.json")
    params = init_params(cfg, jax.random.key(0))  # the embedded model's weights (seed 0)
    fwd = jax.jit(lambda ids, cache: forward(cfg, params, ids, cache))
    logits, cache = fwd(jnp.asarray(PROMPT), init_cache(cfg, 64))
    toks = [int(jnp.argmax(logits[-1]))]
    for _ in range(MAX_TOKENS - 1):
        logits, cache = fwd(jnp.asarray(toks[-1:]), cache)
        toks.append(int(jnp.argmax(logits[-1])))
    return toks


def _wait_healthy(port: int, procs, timeout_s: float = 400):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert all(p.poll() is None for p in procs), "a server process exited during start-up"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the two-process server did not become healthy")


def test_two_processes_serve_a_request_and_stop_together(tmp_path):
    coordinator, port = _free_port(), _free_port()
    flags = ["--engine", "step", "--dtype", "float32", "--max-slots", "2", "--max-len", "64", "--prefill-chunk", "32",
             "--max-prefill-rows", "1", "--decode-buckets", "2", "--prefill-buckets", "32", "--tensor-parallel", "2",
             "--data-parallel", "2", "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
             "--port", str(port)]
    procs, logs = [], []
    for i in (0, 1):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / f"cache{i}"),
                   XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
        logs.append(open(tmp_path / f"process{i}.log", "wb"))
        procs.append(subprocess.Popen([sys.executable, "-m", "serving.server", *flags, "--process-id", str(i)],
                                      env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    try:
        _wait_healthy(port, procs)
        body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        want = _greedy_reference()  # both choices, one in each lane (process 1's devices hold lane 1)
        assert [c["token_ids"] for c in out["choices"]] == [want, want]
        procs[0].terminate()  # SIGTERM: process 0 shuts down and stops process 1's step loop
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
        assert b"process 0 stopped serving" in (tmp_path / "process1.log").read_bytes()
    finally:
        for p, f in zip(procs, logs):
            if p.poll() is None:
                p.kill()
            f.close()
