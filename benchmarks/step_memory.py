"""The compiled serving step's temporary memory against its page pool, per bucket: a step that
copies the pool shows it here (the pool is donated and aliased, so its temporaries should be
activations only).

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.step_memory [--pages 40000]`` (the embedded
tiny model, the engine's default kernels; ``--paged`` adds the Pallas decode kernels on pages:
on the CPU they are interpreted, and the interpreter copies the pool, so ``--paged`` means
something only on the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

from k3jax.model.step import batch_shapes, flatten_batch, pack_batch
from pallas_kernels.kda.decode_pages import kda_decode_pages
from pallas_kernels.mla import paged_mla_decode
from serving.step_engine import StepEngine, _fed_step, default_step_kernels, load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=40000)
    ap.add_argument("--paged", action="store_true", help="the Pallas decode kernels on pages too")
    a = ap.parse_args()
    kernels = default_step_kernels(load_model("tiny")[0])
    if a.paged:
        kernels = dataclasses.replace(kernels, mla_decode=paged_mla_decode, kda_decode=kda_decode_pages)
    e = StepEngine("tiny", num_pages=a.pages, kernels=kernels, max_running=4, max_len=1024, token_budget=256,
                   decode_buckets=(4,), prefill_buckets=(256,), compile_cache=None)
    r = e.runner
    pool = r.pool.size * 4
    print(f"{jax.devices()[0].device_kind}: pool {pool / 2**30:.3f} GiB, {r.num_pages} pages", flush=True)
    for nd, tp in [(4, 0), (0, 256), (4, 256)]:
        batch = pack_batch(r.lay, [], [], num_decode=nd, num_tokens=nd + tp,
                           num_rows=nd + (r.max_prefill_rows if tp else 0), max_blocks=r.max_blocks,
                           num_pages=r.num_pages, to_device=False)
        ints, floats = flatten_batch(batch)
        m = _fed_step.lower(r.cfg, r.lay, r.kernels, nd, r.params, r.pool, r.last, ints, floats,
                            shapes=batch_shapes(batch), window=1, num_logprobs=r.num_logprobs,
                            sample_rows=not r.split_sampling).compile().memory_analysis()
        print(f"decode rows {nd}, prefill tokens {tp}: temporaries {m.temp_size_in_bytes / 2**30:.3f} GiB "
              f"({m.temp_size_in_bytes / pool:.2f} pools)", flush=True)


if __name__ == "__main__":
    main()
