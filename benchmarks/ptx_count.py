"""Static PTX instruction counts and register use of the GPU Pallas kernels, on a machine without a GPU.

The Triton IR that Pallas lowers for an abstract H200 is compiled for ``sm_90`` by the ``triton``
package's compiler (an optional tool, not a k3jax dependency: ``pip install triton``), and its
bundled ``ptxas -v`` reports registers and spills. The kernels are unrolled apart from their
``fori_loop`` bodies, so the static count tracks the executed count. For the verify kernel,
static count x warps x programs gave 481 M against 462 M executed in Nsight Compute on the H200.
This is a proxy for issue-bound kernels, not a timing: speed is claimed only from a device run.

    python -m benchmarks.ptx_count prefill            # kernels A, B, the scan and the outputs
    python -m benchmarks.ptx_count prefill_bounded    # the same with K3 gates (gate_lower_bound=-5)
    python -m benchmarks.ptx_count verify --lines     # plus instructions per source line
    python -m benchmarks.ptx_count verify_deltas --tiling 16:1   # block_v 16 on one warp
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from jax import export
from jax._src.pallas.triton import pallas_call_registration
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from benchmarks.common import window_step
from pallas_kernels.kda import _window, prefill

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
_TRITON = "__gpu$xla.gpu.triton"


def capture_triton_modules(fn, *args):
    """The Triton IR (with source locations) of every Pallas kernel in ``jax.jit(fn)(*args)``, lowered
    for an abstract H200: a list of ``(kernel name, num_warps, num_stages, module text)``."""
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def spy(jaxpr, grid_mapping, *a, **kw):
        result = lower(jaxpr, grid_mapping, *a, **kw)
        modules.append(result.module.operation.get_asm(enable_debug_info=True))
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = spy
    try:
        mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=H200)
        with use_abstract_mesh(mesh):
            exported = export.export(jax.jit(fn), platforms=["cuda"],
                                     disabled_checks=[export.DisabledSafetyCheck.custom_call(_TRITON)])(*args)
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower
    text = exported.mlir_module()
    # Each custom call's backend config names the kernel and its warps and stages, in call order.
    configs = re.findall(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    if len(configs) != len(modules):
        raise RuntimeError(f"found {len(configs)} Triton calls for {len(modules)} lowered kernels")
    return [(name, int(warps), int(stages), m) for (name, stages, warps), m in zip(configs, modules)]


_LINES_PER_FILE = 100_000


def _flatten_locations(module: str):
    """Rewrite named and call-site locations to file locations, encoded as line numbers of one
    file (the PTX names a single file per kernel): ``index * 100000 + line``. Returns the module
    and the source paths by index."""
    defs = dict(re.findall(r"^(#loc\d*) = (loc\(.*\))$", module, re.M))
    paths = []

    @functools.cache
    def resolve(ref, depth=0):
        body = defs.get(ref, "")
        m = re.match(r'loc\("([^"]+)":(\d+):(\d+)', body)
        if m:
            if m.group(1) not in paths:
                paths.append(m.group(1))
            line = (paths.index(m.group(1)) + 1) * _LINES_PER_FILE + int(m.group(2))
            return f'loc("kernel":{line}:{m.group(3)})'
        m = re.match(r'loc\(callsite\((#loc\d*) at', body) or re.match(r'loc\("[^"]*"\((#loc\d*)\)\)', body)
        return resolve(m.group(1), depth + 1) if m and depth < 64 else "loc(unknown)"

    flat = re.sub(r"^(#loc\d*) = loc\(.*\)$", lambda m: f"{m.group(1)} = {resolve(m.group(1))}", module, flags=re.M)
    return flat, paths


def _ptxas_info(ptxas, ptx, tmp):
    """``ptxas -v`` output; the bundled ptxas may be older than the PTX version Triton writes, so a
    rejected ``.version`` is lowered to the one ptxas names."""
    path = os.path.join(tmp, "kernel.ptx")
    for _ in range(2):
        with open(path, "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True,
                              text=True).stderr
        newest = re.search(r"current version is '([\d.]+)'", info)
        if not newest:
            return info
        ptx = re.sub(r"^\.version \S+", f".version {newest.group(1)}", ptx, flags=re.M)
    return info


def compile_ptx(module: str, num_warps: int, num_stages: int) -> dict:
    """Compile one Triton module for sm_90: instruction counts, per-line counts, registers, spills."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise SystemExit("benchmarks.ptx_count needs the triton compiler: pip install triton") from e

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ttir")
        flat, paths = _flatten_locations(module)
        with open(src, "w") as f:
            f.write(flat)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps, "num_stages": num_stages})
        ptx = kernel.asm["ptx"]
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        info = _ptxas_info(ptxas, ptx, tmp)
    ops, lines, where = collections.Counter(), collections.Counter(), None
    for line in ptx.splitlines():
        m = re.match(r"^\s*\.loc\s+\d+\s+(\d+)", line)
        if m:
            index, number = divmod(int(m.group(1)), _LINES_PER_FILE)
            where = (paths[index - 1] if 0 < index <= len(paths) else None, number)
        elif re.match(r"^\s+[a-z]", line):
            ops[line.split()[0].split(".")[0]] += 1
            lines[where] += 1
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return dict(instructions=sum(ops.values()), ops=ops, lines=lines, registers=int(regs.group(1)) if regs else None,
                spill_bytes=int(spills.group(1)) if spills else None, shared_bytes=kernel.metadata.shared)


def _prefill_case(B=1, T=1024, H=2, K=128, V=128, num_segments=1, **kw):
    spec = jax.ShapeDtypeStruct
    args = (spec((B, T, H, K), jnp.bfloat16), spec((B, T, H, K), jnp.bfloat16), spec((B, T, H, V), jnp.bfloat16),
            spec((B, T, H, K), jnp.float32), spec((B, T, H), jnp.bfloat16))
    return functools.partial(prefill.chunk_kda, backend="gpu", interpret=False, num_segments=num_segments,
                             recurrence="triton", **kw), args


def _window_case(mode, T, B=4, H=2, K=128, V=128, **tiling):
    """A window kernel at serving sizes; a mode that replays given deltas takes them (f32) for
    ``v`` (commit) or as the previous window (fused commit + verify)."""
    spec = jax.ShapeDtypeStruct
    x, u = spec((B, T, H, K), jnp.bfloat16), spec((B, T, H, V), jnp.float32)
    args = (spec((2 * B, H, K, V), jnp.float32), spec((B,), jnp.int32), spec((B,), jnp.int32), x, x,
            spec((B, T, H, V), jnp.bfloat16), spec((B, T, H, K), jnp.float32), spec((B, T, H), jnp.bfloat16), u)
    return window_step(mode, **tiling), args


CASES = {
    "prefill": _prefill_case,
    "prefill_segments": lambda: _prefill_case(num_segments=3),  # + the summary pass, recurrence at block_v 64
    "prefill_bounded": lambda: _prefill_case(gate_lower_bound=-5.0),  # K3 gates: the intra-chunk products without the span check
    "verify": lambda **t: _window_case(_window.VERIFY, 8, **t),
    "verify_deltas": lambda **t: _window_case(_window.VERIFY_DELTAS, 8, **t),
    "commit": lambda **t: _window_case(_window.COMMIT, 8, **t),
    "commit_deltas": lambda **t: _window_case(_window.COMMIT_DELTAS, 8, **t),
    "fused_deltas": lambda **t: _window_case(_window.COMMIT_VERIFY_DELTAS, 8, **t),
    "decode": lambda **t: _window_case(_window.DECODE, 1, **t),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--lines", action="store_true", help="also print the source lines with the most instructions")
    ap.add_argument("--tiling", default=None, help="window kernels: block_v:num_warps (default: the kernels' rules)")
    a = ap.parse_args()
    tiling = {}
    if a.tiling:
        if a.case.startswith("prefill"):
            ap.error("--tiling is for the window kernels")
        bv, nw = map(int, a.tiling.split(":"))
        tiling = dict(block_v=bv, num_warps=nw, prefetch=False)
    fn, args = CASES[a.case](**tiling)
    for name, warps, stages, module in capture_triton_modules(fn, *args):
        r = compile_ptx(module, warps, stages)
        print(f"{name}: {r['instructions']} PTX instructions per thread, {r['registers']} registers, "
              f"{r['spill_bytes']} spill bytes, {r['shared_bytes']} shared bytes ({warps} warps, {stages} stages); "
              f"top: {', '.join(f'{op} {n}' for op, n in r['ops'].most_common(6))}")
        if a.lines:
            for (path, line), n in r["lines"].most_common(12):
                code = ""
                if path and os.path.exists(path):
                    code = open(path).read().splitlines()[line - 1].strip()[:80]
                print(f"  {n:6d}  {os.path.basename(path or '?')}:{line}  {code}")


if __name__ == "__main__":
    main()
