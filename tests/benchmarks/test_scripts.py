"""The benchmark scripts: each imports, and none shadows a module when run as a script."""

import importlib
import importlib.util
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_shadows_no_module(name):
    # ``python benchmarks/NAME.py`` puts benchmarks/ first on sys.path: a script named like a
    # package (``serving``) or a standard module would be imported in its place.
    assert importlib.util.find_spec(name) is None, f"benchmarks/{name}.py shadows {name!r}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports(name):
    importlib.import_module(f"benchmarks.{name}")


def test_balanced_routing_zeroes_the_router_bias_and_spreads_wide_routers():
    """The decode floor counts the experts of uniform routing: at the 48B width a random bias
    decides a saturated router's top-k, and :func:`benchmarks.common.balanced_routing` removes it."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import balanced_routing
    from k3jax.model import ModelConfig, init_params
    from k3jax.model.model import route
    from serving.engine import CONFIGS

    cfg = ModelConfig.from_json(f"{CONFIGS}/tiny.json")
    params = init_params(cfg, jax.random.key(0))
    out = balanced_routing(params)
    flat, new = jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(out)
    for (path, x), y in zip(flat, new):
        biased = getattr(path[-1], "key", None) == "bias"
        np.testing.assert_array_equal(y, np.zeros_like(x) if biased else x)
    assert any(getattr(p[-1], "key", None) == "bias" for p, _ in flat)

    wide = dataclasses.replace(cfg, num_experts=256, num_experts_per_tok=8, n_group=1, topk_group=1)
    # the router at the 48B width; narrow experts and one layer, whose widths routing never reads
    one = dataclasses.replace(wide, hidden_size=2304, moe_intermediate_size=1, layer_types=("kda",),
                              mlp_types=("moe",))
    mlp = init_params(one, jax.random.key(1))["layers"][-1]["mlp"]
    x = jax.random.normal(jax.random.key(2), (64, 2304))
    distinct = lambda p: len(np.unique(np.asarray(route(wide, p, x)[1])))
    uniform = 256 * (1 - (1 - 8 / 256) ** 64)
    assert distinct(mlp) < 0.5 * uniform < 0.9 * uniform < distinct(balanced_routing(mlp))


def _softmax_sum(x, y):
    import jax.numpy as jnp

    s = x @ y
    return jnp.exp(s - s.max(-1, keepdims=True)).sum(-1)


def test_hlo_sources_name_the_code_behind_each_fusion():
    """A compiled module's instructions are traced to the named scopes, op and source line that
    made them (inside a scan: JAX's own parts of the op name are dropped)."""
    import inspect

    import jax
    import jax.numpy as jnp

    from benchmarks.common import hlo_sources

    x = jnp.ones((64, 64))
    scoped = jax.named_scope("softmax")(_softmax_sum)
    scanned = lambda x, y: jax.lax.scan(lambda c, _: (c + scoped(x, y)[0], None), 0.0, None, length=2)[0]
    sources = hlo_sources(jax.jit(scanned).lower(x, x).compile().as_text())
    first = inspect.getsourcelines(_softmax_sum)[1]
    dot, total = f"test_scripts.py:{first + 3} (_softmax_sum)", f"test_scripts.py:{first + 4} (_softmax_sum)"
    assert any(v == f"softmax/dot_general at {dot}" for v in sources.values()), sources
    assert any(v == f"softmax/reduce_sum at {total}" for v in sources.values()), sources
    assert not any("." in name for name in sources)  # "fusion.2" is kernel "fusion_2" in a GPU profile
