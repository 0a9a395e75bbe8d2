"""The serving step over a device mesh: tensor, expert and data parallelism by ``shard_map``.

A mesh with a ``tensor`` axis (and optionally an ``expert`` axis) splits the step's weights:

- over ``tensor``: the KDA heads (their fused q/k/v rows, conv channels, gates, output
  columns), the MLA heads (``q``/``q_b`` rows, ``w_uk``, ``w_uv``, output columns, the gate),
  the dense and shared-expert widths, and the LM head's vocabulary (unless it is the tied
  embedding). Each device's attention and dense outputs are partial sums, added by one
  all-reduce per sublayer; the logits of the sampled rows are all-gathered.
- over all the mesh's axes together: the routed experts. Every device routes every token (the
  router is replicated), multiplies only the tokens routed to its own experts (one grouped
  matmul, no expert weight moves), and the routed sums are all-reduced.

Each device runs :func:`k3jax.model.step.model_step` on its part with a config that counts its
own heads (:func:`local_config`) and its own page pool (:func:`local_layout`): the same pages
and page ids on every device (one allocator, one scheduler), each page holding the device's KDA
heads and a copy of every MLA latent (MLA's latent is shared by all heads, so it is replicated
over ``tensor``, as in the peers). Over ``expert`` the attention is replicated.

A ``data`` axis (first) gives data parallel attention with expert parallelism across it: each
data shard has its own batch and its own pool (its own scheduler in the engine), the routed
experts split over all the mesh's axes, and each MoE layer gathers every shard's tokens,
multiplies those routed to the device's experts and reduce-scatters the sums back (all-gather +
local grouped matmul: no expert weight moves; the shards step together).

Without a ``data`` axis, a step can split its prefill tokens over ``expert`` (context
parallelism, :meth:`MeshPlan.context_parallel`): the attention, otherwise replicated there, then
runs each device's part of a long prefill (KDA by KCP, MLA from every device's latents).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.model.config import ModelConfig
from k3jax.model.pool import PoolLayout
from k3jax.model.step import Parallel, layer_runs, set_layer

DATA, TENSOR, EXPERT = "data", "tensor", "expert"

# Per-head or per-channel weights split along their first (output) axis, and output
# projections split along their second (input) axis; keyed by the param's name.
_ROWS = {"qkv", "conv", "f_b", "dt_bias", "A_log", "b", "g", "g_b", "q", "q_b", "w_uk", "w_uv", "gate", "up"}
_COLS = {"o", "down"}
_INTERLEAVED = {"qkv", "conv"}  # [q | k | v] rows: regrouped so each device's slice is its own [q | k | v]


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A mesh with a ``tensor`` axis and optionally ``data`` (first) and ``expert`` axes (any
    other axis is refused)."""

    mesh: Mesh

    def __post_init__(self):
        names = self.mesh.axis_names
        if TENSOR not in names or set(names) - {DATA, TENSOR, EXPERT} or (DATA in names and names[0] != DATA):
            raise ValueError(f"the step's mesh needs a '{TENSOR}' axis, optionally a '{DATA}' axis first and an "
                             f"'{EXPERT}' axis, got axes {names}")

    @property
    def tp(self) -> int:
        return self.mesh.shape[TENSOR]

    @property
    def dp(self) -> int:
        """Data shards: each runs its own batch on its own pages (1: no ``data`` axis)."""
        return self.mesh.shape.get(DATA, 1)

    @property
    def data(self) -> str | None:
        return DATA if DATA in self.mesh.axis_names else None

    @property
    def pool_lead(self) -> tuple[int, ...]:
        """The pool's leading (per-device) dimensions: ``(tp,)``, or ``(dp, tp)``."""
        return (self.dp, self.tp) if self.data else (self.tp,)

    @property
    def pool_spec(self) -> P:
        return P(DATA, TENSOR) if self.data else P(TENSOR)

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The axes the routed experts split over: all of the mesh's, in its order."""
        return tuple(self.mesh.axis_names)

    @property
    def ep(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.expert_axes)

    @property
    def parallel(self) -> Parallel:
        return Parallel(tensor=TENSOR, experts=self.expert_axes, data=self.data)

    @property
    def context_axis(self) -> str | None:
        """The axis a step's prefill tokens can split over (KCP; see :class:`Parallel`):
        ``expert``, over which the attention is replicated; None without one, or with a ``data`` axis."""
        return EXPERT if self.mesh.shape.get(EXPERT, 1) > 1 and self.data is None else None

    def context_parallel(self) -> Parallel:
        """:attr:`parallel` with the prefill tokens split over :attr:`context_axis`."""
        if self.context_axis is None:
            raise ValueError(f"context parallelism needs an '{EXPERT}' axis and no '{DATA}' axis, got mesh "
                             f"{dict(self.mesh.shape)}")
        return self.parallel._replace(context=self.context_axis)

    def check(self, cfg: ModelConfig):
        """A clear error when the model does not split evenly over this mesh."""
        need = [("num_heads", cfg.num_heads, self.tp), ("linear_num_heads", cfg.linear_num_heads, self.tp)]
        if "dense" in cfg.mlp_types:
            need.append(("intermediate_size", cfg.intermediate_size, self.tp))
        if "moe" in cfg.mlp_types:
            need += [("num_experts", cfg.num_experts, self.ep),
                     ("shared expert width", cfg.moe_intermediate_size * cfg.n_shared_experts, self.tp)]
        if not cfg.tie_word_embeddings:
            need.append(("vocab_size", cfg.vocab_size, self.tp))
        for name, n, d in need:
            if n % d:
                raise ValueError(f"{name} = {n} does not split over {d} devices of mesh {dict(self.mesh.shape)}")


def step_mesh(tensor: int, expert: int = 1, devices=None, data: int = 1) -> Mesh:
    """A ``data`` x ``tensor`` x ``expert`` mesh (the axes of size 1 but ``tensor`` left out) of
    the first devices (of ``devices``, default all of them)."""
    devices = jax.devices() if devices is None else devices
    if min(data, tensor, expert) < 1 or data * tensor * expert > len(devices):
        raise ValueError(f"a mesh of data {data} x tensor {tensor} x expert {expert} needs that many of the "
                         f"{len(devices)} devices")
    axes = [(n, d) for n, d in ((DATA, data), (TENSOR, tensor), (EXPERT, expert)) if d > 1 or n == TENSOR]
    names, shape = zip(*axes)
    return Mesh(np.array(devices[: math.prod(shape)]).reshape(shape), names)


def host_memory_if(mesh: Mesh | None):
    """A context that builds arrays in host memory when ``mesh`` is given (they are placed on the
    mesh shard by shard afterwards: no device holds the whole model on the way), else nothing."""
    return contextlib.nullcontext() if mesh is None else jax.default_device(jax.local_devices(backend="cpu")[0])


def local_config(cfg: ModelConfig, plan: MeshPlan) -> ModelConfig:
    """The config one device's part of the step sees: its own KDA and MLA heads."""
    plan.check(cfg)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // plan.tp,
                               linear_num_heads=cfg.linear_num_heads // plan.tp)


def local_layout(cfg: ModelConfig, lay: PoolLayout, plan: MeshPlan) -> PoolLayout:
    """Each device's page layout: the global ``page_tokens`` (the scheduler's pages), its own KDA
    heads, every MLA latent."""
    return PoolLayout.for_model(local_config(cfg, plan), page_tokens=lay.page_tokens, latent_dtype=lay.latent_dtype)


def _names(path) -> list[str]:
    """The dict keys on a param's path (``[layers|runs, ..., name]``; list indices and an MXFP4
    leaf's ``packed``/``scale`` left out)."""
    return [k.key for k in path if isinstance(getattr(k, "key", None), str)]


def _spec(path, leaf, plan: MeshPlan, cfg: ModelConfig) -> P:
    keys = _names(path)
    lead = 1 if keys[0] == "runs" else 0  # a scanned run's params carry a leading layer axis
    dims = [None] * leaf.ndim
    name = keys[-1]
    if keys[0] == "lm_head" and not cfg.tie_word_embeddings:
        dims[0] = TENSOR
    elif keys[0] in ("layers", "runs"):
        if name in ("gate_up", "down") and leaf.ndim == lead + 3:
            dims[lead] = plan.expert_axes  # routed experts [E, in, out]
        elif name in _ROWS:
            dims[lead] = TENSOR
        elif name in _COLS:
            dims[lead + 1] = TENSOR
    return P(*dims)


def param_specs(cfg: ModelConfig, params, plan: MeshPlan):
    """The ``PartitionSpec`` of every serving param (with or without :func:`stack_layers`)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: _spec(path, x, plan, cfg), params)


def _regroup_qkv(x, lead: int, tp: int):
    """``[q | k | v]`` rows (axis ``lead``) as ``[q_0 | k_0 | v_0 | q_1 | ...]``: device ``d``'s
    contiguous slice is its heads' q, k and v."""
    s = x.shape
    y = x.reshape(*s[:lead], 3, tp, s[lead] // (3 * tp), *s[lead + 1 :])
    return jnp.swapaxes(y, lead, lead + 1).reshape(s)


def shard_params(cfg: ModelConfig, params, plan: MeshPlan):
    """Serving params placed on the mesh by :func:`param_specs` (the fused q/k/v rows regrouped
    per device first). Returns ``(params, specs)``."""
    plan.check(cfg)

    def regroup(path, x):
        keys = _names(path)
        if keys[-1] in _INTERLEAVED and keys[0] in ("layers", "runs"):
            return _regroup_qkv(x, 1 if keys[0] == "runs" else 0, plan.tp)
        return x

    params = jax.tree_util.tree_map_with_path(regroup, params)
    specs = param_specs(cfg, params, plan)
    placed = jax.tree.map(lambda x, s: put_global(x, NamedSharding(plan.mesh, s)), params, specs)
    return placed, specs


def put_global(x, sharding: NamedSharding) -> jax.Array:
    """``x`` (host or local data, the same on every process) as a global array of ``sharding``:
    each process places only its own devices' slices (with several processes, no check that the
    data agree and no collective, unlike ``jax.device_put``)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def allocate_pool(lay_local: PoolLayout, num_pages: int, plan: MeshPlan) -> jax.Array:
    """A zeroed pool ``u32[tp, num_pages, page_words]`` (``[dp, tp, ...]`` with a ``data`` axis):
    device ``d`` of the tensor axis holds ``[d]`` (replicated over ``expert``)."""
    shape = (*plan.pool_lead, num_pages, lay_local.page_words)
    return jax.jit(lambda: jnp.zeros(shape, jnp.uint32), out_shardings=NamedSharding(plan.mesh, plan.pool_spec))()


def shard_step(plan: MeshPlan, specs, body, num_batch: int, num_more: int = 0):
    """``body(params, pool, *args) -> (out, pool, *more)``, one device's step, as a function of
    the mesh-placed params, the pool (:func:`allocate_pool`) and ``num_batch`` batch arguments;
    the ``num_more`` others come back the same way. Batch arguments and those results are
    replicated (the step's sums and gathers make every device's equal), or with a ``data`` axis
    stacked ``[dp, ...]``, one per data shard. ``out`` comes back replicated (stacked ``[dp, ...]``
    with a ``data`` axis: gathered, so that any process can read every shard's, as process 0 of
    several must)."""
    stacked = plan.data is not None
    unstack = lambda tree: jax.tree.map(lambda x: x[0], tree) if stacked else tree
    stack = lambda tree: jax.tree.map(lambda x: x[None], tree) if stacked else tree
    lead = len(plan.pool_lead)  # the pool's per-device dimensions, each of size 1 on a device

    def local(params, pool, *args):
        out, pool, *more = body(params, pool[(0,) * lead], *unstack(args))
        if stacked:
            out = jax.tree.map(lambda x: jax.lax.all_gather(x, DATA), out)
        return (out, pool[(None,) * lead], *stack(more))

    batch = P(DATA) if stacked else P()
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(specs, plan.pool_spec, *([batch] * num_batch)),
                         out_specs=(P(), plan.pool_spec, *([batch] * num_more)), check_vma=False)


def device_param_bytes(params, specs, mesh: Mesh) -> int:
    """The bytes of ``params`` one device holds when they are placed by ``specs`` on ``mesh``."""
    def one(x, spec):
        axes = [a for d in spec if d is not None for a in (d if isinstance(d, tuple) else (d,))]
        return x.size * x.dtype.itemsize // math.prod(mesh.shape[a] for a in axes)
    return sum(jax.tree.leaves(jax.tree.map(one, params, specs)))


def place_layer(cfg: ModelConfig, layer, plan: MeshPlan):
    """One serving layer (:func:`k3jax.model.step.prepare_layer`'s) on the mesh, regrouped and
    placed shard by shard as :func:`shard_params` would place it among the layers."""
    return shard_params(cfg, {"layers": [layer]}, plan)[0]["layers"][0]


def place_streamed(cfg: ModelConfig, top, layer_of, plan: MeshPlan, scan: bool = True):
    """Serving params on the mesh built one layer at a time: ``top`` (the prepared params outside
    the layers) and ``layer_of(i)``, layer ``i`` prepared in host memory, placed before the next
    is made (the host never holds more than one layer; each device only its shards). With
    ``scan`` the runs of :func:`k3jax.model.step.layer_runs` are stacked on the devices (a stack
    allocated on the mesh, each layer written into it in place), as :func:`k3jax.model.step.stack_layers`
    lays them out. Returns ``(params, specs)`` as :func:`shard_params`."""
    params, _ = shard_params(cfg, top, plan)
    runs = layer_runs(cfg) if scan else ()
    scanned = {s + n * per + j for s, per, c in runs for n in range(c) for j in range(per)}
    layers = [None if i in scanned else place_layer(cfg, layer_of(i), plan) for i in range(cfg.num_layers)]
    stacked = []
    for s, per, c in runs:
        group = []
        for j in range(per):
            first = place_layer(cfg, layer_of(s + j), plan)
            shardings = jax.tree.map(lambda a: NamedSharding(plan.mesh, P(None, *a.sharding.spec)), first)
            stack = jax.jit(lambda t: jax.tree.map(lambda a: jnp.zeros((c, *a.shape), a.dtype), t),
                            out_shardings=shardings)(first)
            put = jax.jit(set_layer, donate_argnums=0, out_shardings=shardings)  # in place, sharded
            stack = put(stack, 0, first)
            del first
            for n in range(1, c):
                stack = put(stack, n, place_layer(cfg, layer_of(s + n * per + j), plan))
            group.append(stack)
        stacked.append(group)
    params = dict(params, layers=layers, runs=stacked) if scan else dict(params, layers=layers)
    return params, param_specs(cfg, params, plan)
