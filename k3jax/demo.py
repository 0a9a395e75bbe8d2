"""A first run: chunked KDA on random inputs, checked against the token-by-token reference.

Usage: ``python -m k3jax.demo [--T 1000] [--heads 4] [--dim 64]``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda import chunk_kda, kda_gate, l2norm, naive_recurrent_kda
from k3jax.ops.segments import chunk_kda_segmented


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=1000, help="tokens")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64, help="K = V")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    B, T, H, K = 1, a.T, a.heads, a.dim
    ks = jax.random.split(jax.random.key(a.seed), 6)
    q = l2norm(jax.random.normal(ks[0], (B, T, H, K)))
    k = l2norm(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, K))
    g = kda_gate(jax.random.normal(ks[3], (B, T, H, K)), jnp.zeros(H), jnp.zeros(H * K), lower_bound=-5.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    print(f"k3jax demo on {jax.devices()[0].platform}: B={B} T={T} H={H} K=V={K}, K3 gate (bound -5)")
    rel = lambda x, r: float(np.linalg.norm(np.asarray(x) - np.asarray(r)) / np.linalg.norm(np.asarray(r)))
    t0 = time.perf_counter()
    o_ref, S_ref = jax.block_until_ready(jax.jit(naive_recurrent_kda)(q, k, v, g, beta))
    print(f"  naive_recurrent_kda      {time.perf_counter() - t0:6.2f} s (incl. compile)")
    ok = True
    runs = [("chunk_kda (C=64)", jax.jit(chunk_kda)),
            ("chunk_kda_segmented (P=4)", jax.jit(lambda *x: chunk_kda_segmented(*x, num_segments=4)))]
    for name, f in runs:
        t0 = time.perf_counter()
        o, S = jax.block_until_ready(f(q, k, v, g, beta))
        eo, es = rel(o, o_ref), rel(S, S_ref)
        good = eo <= 5e-4 and es <= 2e-3
        ok &= good
        print(f"  {name:26s} {time.perf_counter() - t0:6.2f} s  rel err out {eo:.2e} state {es:.2e}  {'OK' if good else 'FAIL'}")
    print("all checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
