"""The serving step over a mesh of fake CPU devices (tensor and expert parallelism by
``shard_map``) against the reference forward, on the ragged schedule of ``test_step``; its
compiled decode step's collectives; and clear errors for meshes the model does not split over."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from k3jax.model import load_hf_checkpoint
from k3jax.model.loader import HFCheckpoint
from k3jax.model.step import model_step, pack_batch, prepare_layer, prepare_params, stack_layers
from k3jax.parallel.sharded_step import (MeshPlan, allocate_pool, local_config, local_layout, place_streamed,
                                         shard_params, shard_step, step_mesh)
from tests.helpers import rel_rms
from tests.k3jax.test_step import BUCKET, SEVEN_LAYERS, Runner, _reference, _schedule, _seqs_with_shared_prefix, _tiny

# tiny with 8 KDA and 8 MLA heads (so 8 devices can split them) and the 7-layer scanned period
WIDE = dict(SEVEN_LAYERS, num_attention_heads=8, linear_num_heads=8)


class ShardedRunner(Runner):
    """``test_step.Runner`` with its params and pool on a mesh and its step in ``shard_map``."""

    def __init__(self, cfg, params, dtype, mesh, scan=False, context=False):
        super().__init__(cfg, params, dtype, scan=scan)
        self.plan = plan = MeshPlan(mesh)
        local_cfg, local_lay = local_config(cfg, plan), local_layout(cfg, self.lay, plan)
        self.params, specs = shard_params(cfg, self.params, plan)
        self.pool = allocate_pool(local_lay, self.N, plan)

        def body(params, pool, batch):
            return model_step(local_cfg, local_lay, self.kernels, BUCKET["num_decode"], params, pool, batch,
                              return_logits=True, par=plan.context_parallel() if context else plan.parallel)

        self._step = jax.jit(shard_step(plan, specs, body, num_batch=1), donate_argnums=1)

    def step(self, decode, prefill, window=1):
        batch = pack_batch(self.lay, decode, prefill, num_pages=self.N, window=window, **BUCKET)
        out, self.pool = self._step(self.params, self.pool, batch)
        return out


@pytest.mark.parametrize("config,axes,context", [
    pytest.param("wide", dict(tensor=2, expert=2), False, marks=pytest.mark.slow),  # CI time: K3 on these axes
    pytest.param("wide", dict(tensor=4), False, marks=pytest.mark.slow),
    pytest.param("wide", dict(tensor=8), False, marks=pytest.mark.slow), ("configs/tiny_k3.json", dict(tensor=2, expert=2), False),
    pytest.param("wide", dict(tensor=2, expert=2), True, marks=pytest.mark.slow),  # the engine's KCP test in CI
    pytest.param("configs/tiny_k3.json", dict(tensor=1, expert=4), True, marks=pytest.mark.slow)], ids=str)
def test_sharded_step_matches_forward(config, axes, context):
    """Prefill chunks, decode rows, idle rows and a shared page over three steps: the logits of
    every row equal the single-device reference's (float32; the sums run in another order); for
    Kimi Linear and for Kimi K3 (Block AttnRes, LatentMoE, gated MLA, the K3 KDA gates); with
    ``context`` the prefill tokens split over the expert axis (KCP: a row's KDA state crosses
    devices, its MLA queries read other devices' latents)."""
    cfg, params = _tiny(**WIDE) if config == "wide" else _tiny(config)
    seqs = _seqs_with_shared_prefix(cfg)
    ref = _reference(cfg, params, seqs)
    runner = ShardedRunner(cfg, params, jnp.float32, step_mesh(**axes), scan=True, context=context)
    assert runner.params["runs"]
    for seq, pos, lg in _schedule(runner, seqs):
        assert rel_rms(lg, ref[seq][pos]) < 1e-5, (seq, pos)
        assert np.argmax(lg) == np.argmax(ref[seq][pos])


def test_decode_step_sums_partials_and_moves_no_weights():
    """The compiled decode step on (tensor 2, expert 2): all-reduces of the partial sums, and the
    only all-gather is of the sampled rows' logits (vocabulary-split LM head): no expert or other
    weight is gathered, nothing goes all-to-all."""
    cfg, params = _tiny(**WIDE)
    runner = ShardedRunner(cfg, params, jnp.float32, step_mesh(tensor=2, expert=2), scan=True)
    batch = pack_batch(runner.lay, [], [], num_pages=runner.N, **dict(BUCKET, num_tokens=4, num_rows=4))
    hlo = runner._step.lower(runner.params, runner.pool, batch).compile().as_text()
    ops = re.findall(r"= (\S+) (all-reduce|all-gather|all-to-all)(?:-start)?\(", hlo)
    kinds = [k for _, k in ops]
    assert kinds.count("all-reduce") >= 2 and "all-to-all" not in kinds, kinds
    gathers = [shape for shape, k in ops if k == "all-gather"]
    assert gathers and all(re.fullmatch(rf"f32\[\d+,{cfg.vocab_size}\](\{{.*\}})?", s) for s in gathers), gathers


def test_meshes_the_model_does_not_split_over_are_refused():
    cfg, _ = _tiny()  # 2 heads of each kind
    with pytest.raises(ValueError, match="num_heads = 2 does not split over 4 devices"):
        local_config(cfg, MeshPlan(step_mesh(4)))
    with pytest.raises(ValueError, match="needs a 'tensor' axis"):
        MeshPlan(Mesh(np.array(jax.devices()[:2]), ("data",)))
    with pytest.raises(ValueError, match="needs that many"):
        step_mesh(4, 4)


def test_data_axis_gathers_tokens_and_no_weights():
    """The compiled decode step on (data 2, tensor 2): the MoE all-gathers the data shards'
    tokens (activations ``[2 T, ...]``) and reduce-scatters their sums back; the only other
    gathers are the logits' (over ``tensor``) and the step's outputs ``[2, R, ...]`` (over
    ``data``, so that any process reads every shard's). No weight is gathered."""
    cfg, params = _tiny()
    runner = ShardedRunner(cfg, params, jnp.float32, step_mesh(2, data=2))
    assert runner.pool.shape[:2] == (2, 2)
    T = R = 4
    batch = pack_batch(runner.lay, [], [], num_pages=runner.N, **dict(BUCKET, num_tokens=T, num_rows=R))
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), batch)  # one batch per data shard
    hlo = runner._step.lower(runner.params, runner.pool, stacked).compile().as_text()
    ops = re.findall(r"= (\S+) (all-reduce|all-gather|all-to-all|reduce-scatter)(?:-start)?\(", hlo)
    kinds = [k for _, k in ops]
    assert "reduce-scatter" in kinds and "all-to-all" not in kinds, kinds
    gathers = [shape for shape, k in ops if k == "all-gather"]
    tokens = rf"\w+\[{2 * T}(,\d+)*\]"  # a [2 T, ...] activation, routing weights or expert ids
    logits = rf"f32\[\d+,{cfg.vocab_size}\]"
    outputs = rf"\w+\[2,{R}(,\d+)?\]"
    assert gathers and all(re.fullmatch(rf"({tokens}|{logits}|{outputs})(\{{.*\}})?", s) for s in gathers), gathers


def test_a_checkpoint_is_placed_a_layer_at_a_time():
    """``place_streamed`` (the engine's path for a checkpoint on a mesh) reads each layer once,
    in turn, and gives the arrays, shardings and specs of preparing the whole checkpoint and
    placing it with ``shard_params``, the scanned runs stacked on the devices."""
    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden", "k3_tiny_mxfp4")
    ck = HFCheckpoint(path, keep_mxfp4=True)
    cfg, plan, dt = ck.cfg, MeshPlan(step_mesh(1, 2)), jnp.bfloat16
    reads = []

    def layer_of(i):
        reads.append(i)
        return prepare_layer(cfg, i, ck.layer(i), dt)

    got, specs = place_streamed(cfg, prepare_params(cfg, {**ck.top(), "layers": []}, dt), layer_of, plan)
    ck.check_all_taken()
    assert sorted(reads) == list(range(cfg.num_layers)) and got["runs"]
    _, ref = load_hf_checkpoint(path, keep_mxfp4=True)
    want, want_specs = shard_params(cfg, stack_layers(cfg, prepare_params(cfg, ref, dt)), plan)
    assert jax.tree.structure(got) == jax.tree.structure(want) and specs == want_specs
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))
