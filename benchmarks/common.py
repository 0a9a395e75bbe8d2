"""Shared benchmark helpers: timing, input generation, hardware-limit accounting."""

from __future__ import annotations

import json
import os
import re
import statistics
import time

import jax

# Ceilings measured on the lent H200 (docs/benchmarks.md, BENCHMARKS.md).
HBM_BYTES_PER_S = 3.6e12
BF16_FLOPS_PER_S = 790e12


def balanced_routing(params):
    """``params`` with every MoE router's score-correction bias zeroed, so that random weights
    route decode rows as a trained model does (its bias balances the load; the decode floor
    counts the experts of uniform routing). A random router saturates its sigmoid scores (logits
    of std about 2.4 at the 48B width), so a random bias decides the top-k: with the bias of
    :func:`k3jax.model.init_params`, 64 rows picked 72 distinct experts of 256 in a layer of the
    48B shape, with it zeroed 220 (uniform routing: 222)."""
    import jax.numpy as jnp

    zero = lambda path, x: jnp.zeros_like(x) if getattr(path[-1], "key", None) == "bias" else x
    return jax.tree_util.tree_map_with_path(zero, params)


def random_model(cfg, mxfp4: bool = False):
    """Random step-format weights for ``cfg`` (bf16, :func:`balanced_routing`); ``mxfp4``: the
    routed experts packed in MXFP4 as Kimi K3's checkpoint has them (Kimi-Linear-48B's 98 GB
    become 29 GB: all 27 layers fit one H100)."""
    import jax.numpy as jnp

    from k3jax.model.step import random_params

    return balanced_routing(random_params(cfg, jax.random.key(0), jnp.bfloat16, mxfp4=mxfp4))


def time_jax(f, inputs, *, warmup=3, repeats=20):
    """Median seconds of ``f(*inputs[i % len(inputs)])`` with inputs rotated, after warm-up."""
    for i in range(warmup):
        jax.block_until_ready(f(*inputs[i % len(inputs)]))
    ts = []
    for i in range(repeats):
        x = inputs[i % len(inputs)]
        t0 = time.perf_counter()
        jax.block_until_ready(f(*x))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def time_back_to_back_calls(call, wait, *, steps=10, rounds=5):
    """Seconds per call of ``call()`` issued ``steps`` times without waiting, then ``wait(last
    result)``: the same host clock for any library (JAX: ``jax.block_until_ready``; torch:
    ``lambda _: torch.cuda.synchronize()``), so launch gaps count on both sides and the one sync
    latency is spread over the round. Median over rounds, after one warm-up call."""
    wait(call())
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = call()
        wait(out)
        ts.append((time.perf_counter() - t0) / steps)
    return statistics.median(ts)


def kernel_seconds(f, steps=20) -> dict:
    """Device seconds per call of ``f()`` (no arguments; it returns what to wait on) by GPU kernel
    name, from a ``jax.profiler`` trace of ``steps`` calls. Unlike wall-clock timers it excludes
    host dispatch, which dominates calls of a few microseconds of device work (one-row decode
    windows). Empty without a GPU."""
    import collections
    import glob
    import gzip
    import tempfile

    jax.block_until_ready(f())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                out = f()
            jax.block_until_ready(out)
        (path,) = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as fh:
            events = json.load(fh)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    per_kernel = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and "GPU" in names.get(e["pid"], ""):
            per_kernel[e["name"]] += e["dur"] * 1e-6 / steps
    return dict(per_kernel)


_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"(?: stack_frame_id=(\d+))?')
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def hlo_sources(hlo_text: str) -> dict[str, str]:
    """Where each instruction of a compiled module's HLO text (``compiled.as_text()``) comes
    from, ``{name: "scopes/op at file:line (function)"}``: its op name without JAX's
    transformation parts (the ``jax.named_scope`` names the model gives its sublayers, then the
    op) and its innermost source frame where the text has the tables. A profile's XLA kernels are
    named after their fusion instructions, so this names the model code behind them (its keys
    spell HLO's ``.N`` suffixes ``_N``, as kernel names do)."""
    tables = {k: {} for k in _TABLES}
    table, found = None, {}
    for line in hlo_text.splitlines():
        s = line.strip()
        if s in tables:
            table = tables[s]
            continue
        if table is not None and (m := re.match(r"(\d+) (.*)", s)):
            table[int(m.group(1))] = m.group(2)
            continue
        table = None
        if m := _INSTRUCTION.match(line):
            found[m.group(1)] = (m.group(2), m.group(3))

    def frame(i: str | None) -> str:
        loc = re.search(r"file_location_id=(\d+)", tables["StackFrames"].get(int(i or -1), ""))
        if not loc:
            return ""
        d = dict(re.findall(r"(\w+)=(\d+)", tables["FileLocations"].get(int(loc.group(1)), "")))
        name = lambda t, k: tables[t].get(int(d.get(k, -1)), "?").strip('"')
        return f" at {os.path.basename(name('FileNames', 'file_name_id'))}:{d.get('line')} " \
               f"({name('FunctionNames', 'function_name_id')})"

    # named as a GPU profile names the kernels: HLO's "input_reduce_fusion.1" is "input_reduce_fusion_1" there
    return {n.replace(".", "_"): _scoped_op(op) + frame(sf) for n, (op, sf) in found.items()}


_TRANSFORMS = re.compile(r"^(jit\(.*\)|pjit|while|body|cond|eval_jaxpr|closed_call|checkpoint|remat|shard_map|"
                         r"jvp\(.*\)|transpose\(.*\)|vmap\(.*\)|custom_jvp_call|custom_vjp_call)$")


def _scoped_op(op_name: str) -> str:
    """``jit(step)/while/body/kda_layer/short_conv/mul`` -> ``kda_layer/short_conv/mul``."""
    return "/".join(p for p in op_name.split("/") if not _TRANSFORMS.match(p)) or op_name


def device_seconds(f, steps=20):
    """Total of :func:`kernel_seconds`: the device time per call of ``f()``."""
    return sum(kernel_seconds(f, steps).values())


def time_torch(f, inputs, *, warmup=3, repeats=20):
    """Median seconds of a CUDA torch callable, timed with CUDA events."""
    import torch

    for i in range(warmup):
        f(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    ts = []
    for i in range(repeats):
        x = inputs[i % len(inputs)]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f(*x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def to_torch(x):
    """A JAX device array as a torch tensor on the same device, without a host copy."""
    import torch

    return torch.from_dlpack(x)


def kda_flops_per_token_head(C: int, K: int, V: int) -> float:
    """FLOPs of the chunked algorithm per token and value head (Akk, Aqk, solve, state matmuls)."""
    return 4 * C * K + C * (K + V) + 6 * K * V + 2 * C * V


def hw_fraction(seconds: float, bytes_moved: float, flops: float) -> dict:
    """Fraction of the bandwidth or matmul limit, whichever bounds the work."""
    t_bw, t_fl = bytes_moved / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S
    bound = "memory" if t_bw >= t_fl else "compute"
    return {"limit_s": max(t_bw, t_fl), "bound": bound, "fraction_of_limit": max(t_bw, t_fl) / seconds}


def kda_prefill_hw(seconds: float, tokens_x_heads: int) -> dict:
    """:func:`hw_fraction` of a bf16 chunked KDA prefill with K = V = 128 and 64-token chunks:
    q, k, v, o in bf16, g in f32, beta, per token and head."""
    bytes_moved = tokens_x_heads * (4 * 128 * 2 + 128 * 4 + 2)
    return hw_fraction(seconds, bytes_moved, tokens_x_heads * kda_flops_per_token_head(64, 128, 128))


def write_json(rows, name: str):
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    return path


def window_step(mode, **tiling):
    """:func:`pallas_kernels.kda.decode_gpu.window_call` in ``mode`` on one argument list for every
    mode, ``(pool, slot_ids, num_accepted, q, k, v, g, beta, deltas)``: a replay-only mode drops q
    (and with ``deltas_in`` replays ``deltas`` in place of v and beta); a fused mode first replays
    the same window (from ``deltas`` with ``deltas_in``). ``tiling``: block_v, num_warps, prefetch."""
    from pallas_kernels.kda import decode_gpu

    def call(pool, ids, n, q, k, v, g, beta, deltas):
        prev = ((k, deltas, g) if mode.deltas_in else (k, v, g, beta)) if mode.replay_first else None
        if mode.replay_only:
            q, v, beta = (None, deltas, None) if mode.deltas_in else (None, v, beta)
        return decode_gpu.window_call(pool, ids, n, q, k, v, g, beta, mode=mode, scale=k.shape[-1] ** -0.5,
                                      prev=prev, **tiling)

    return call
