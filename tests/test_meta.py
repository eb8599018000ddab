"""Meta-tests: every hook is documented and tested; every module imports without a GPU."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import ninfer_core
import ninfer_plugins
from ninfer_core import conformance, hookspecs, plugin_types

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


#: Run-time objects a kind's plugins build, documented in that kind's section.
BUILT_BY = {
    "artifact_readers": [plugin_types.Artifact],
    "model_families": [plugin_types.CausalLM],
    "kv_codecs": [plugin_types.KVStore],
    "kernel_backends": [plugin_types.KernelOps],
    "draft_strategies": [plugin_types.Drafter],
}


def doc_section(heading: str) -> str:
    """The text of docs/plugins.md under `heading`, up to the next heading."""
    docs = (ROOT / "docs" / "plugins.md").read_text()
    body = docs.split(heading + "\n", 1)[1]
    return re.split(r"^#{2,3} ", body, maxsplit=1, flags=re.M)[0]


@pytest.mark.parametrize("point", list(hookspecs.EXTENSION_POINTS.values()), ids=lambda p: p.point)
def test_docs_state_every_member_of_each_kinds_contract(point):
    """docs/plugins.md and the protocols in plugin_types.py cannot drift apart."""
    shared = {m.name for m in conformance.members(plugin_types.Plugin)}
    section = doc_section(f"### `{point.hook}`")
    for protocol in [point.protocol, *BUILT_BY.get(point.point, [])]:
        for member in conformance.members(protocol):
            if protocol is point.protocol and member.name in shared:
                continue  # stated once, under "Every object's shape"
            assert re.search(rf"`{member.name}\b", section), (
                f"docs/plugins.md, section {point.hook}, does not state "
                f"{protocol.__name__}.{member.name}"
            )
    assert point.protocol.__name__ in section


def test_docs_state_the_members_every_object_shares():
    section = doc_section("## Every object's shape")
    for member in conformance.members(plugin_types.Plugin):
        assert f"`{member.name}" in section


def all_modules():
    for pkg in (ninfer_core, ninfer_plugins):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            yield info.name


@pytest.mark.parametrize("module", sorted(all_modules()))
def test_module_imports_without_a_gpu(module):
    importlib.import_module(module)
