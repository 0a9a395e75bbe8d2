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
