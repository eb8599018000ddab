"""Meta-tests: every hook is documented and tested; every module imports without a GPU."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import ninfer_core
import plugins
from ninfer_core import hookspecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [
    name
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
    if hasattr(fn, "ninfer_spec")
]


def test_there_are_hooks():
    assert "register_kv_codecs" in HOOKS and len(HOOKS) == 6


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_docstring_and_docs(hook):
    assert inspect.getdoc(getattr(hookspecs, hook)), f"{hook} has no docstring"
    docs = (ROOT / "docs" / "plugins.md").read_text()
    assert f"### `{hook}`" in docs, f"{hook} is not documented in docs/plugins.md"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_exercised_by_a_test(hook):
    tests = "".join(
        p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_meta.py"
    )
    assert hook in tests, f"no test mentions {hook}"


def all_modules():
    for pkg in (ninfer_core, plugins):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            yield info.name


@pytest.mark.parametrize("module", sorted(all_modules()))
def test_module_imports_without_a_gpu(module):
    importlib.import_module(module)
