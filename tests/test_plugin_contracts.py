"""Every plugin kind's contract is checked when the host is built.

Objects are generated from the protocols themselves (`conformance.members`), so a
member added to a protocol is covered here without a new test: a conforming object
of each kind registers, and one missing any method, or with a method short of an
argument the core passes, is refused naming plugin, object and method, and
`ninfer plugins` lists it as refused.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import sys
import types

import pytest
from test_plugin_host import fake_entry_points

from ninfer_core import ENTRY_POINT_GROUP, conformance, hookimpl
from ninfer_core.cli.main import main
from ninfer_core.conformance import ContractError
from ninfer_core.hookspecs import EXTENSION_POINTS
from ninfer_core.plugin_host import create_host
from ninfer_core.plugin_types import Artifact, CausalLM, KernelOps, KVStore
from ninfer_core.support import Support

POINTS = list(EXTENSION_POINTS.values())
RUNTIME_PROTOCOLS = [Artifact, CausalLM, KVStore, KernelOps]

DATA = {
    "description": "a generated test object",
    "priority": 0,
    "architectures": ("GeneratedForCausalLM",),
    "error_paths": (),
}


def _function(name: str, sig: inspect.Signature):
    """A function `name(self, ...)` with `sig`'s parameters (annotations dropped)."""
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    text = str(sig.replace(parameters=params, return_annotation=sig.empty))
    scope: dict = {"Support": Support}
    body = "Support.yes()" if name == "supports" else "None"
    exec(f"def {name}(self{', ' if params else ''}{text[1:-1]}): return {body}", scope)
    return scope[name]


def attrs_for(protocol: type, name: str, *, drop: str = "", short: str = "") -> dict:
    """Class attributes of an object of `protocol`: every member, less `drop`, with
    method `short` missing its last parameter."""
    attrs: dict = {"__repr__": lambda self: f"Generated({name!r})"}
    for m in conformance.members(protocol):
        if m.name == drop:
            continue
        if m.kind == "method":
            assert m.signature is not None
            sig = m.signature
            if m.name == short:
                sig = sig.replace(parameters=list(sig.parameters.values())[:-1])
            attrs[m.name] = _function(m.name, sig)
        elif m.kind == "optional":
            attrs[m.name] = () if m.name == "error_paths" else None
        else:
            attrs[m.name] = name if m.name == "name" else DATA.get(m.name)
    return attrs


def generated(protocol: type, name: str, **how: str) -> object:
    return type("Generated", (), attrs_for(protocol, name, **how))()


def plugin_returning(point, obj) -> types.SimpleNamespace:
    def register():
        return [obj]

    register.__name__ = point.hook
    return types.SimpleNamespace(**{point.hook: hookimpl(register)})


def methods_of(protocol: type, *, with_params: bool = False) -> list[str]:
    return [
        m.name
        for m in conformance.members(protocol)
        if m.kind == "method" and (not with_params or m.signature.parameters)  # type: ignore[union-attr]
    ]


def cases(*, with_params: bool):
    return [
        pytest.param(p, method, id=f"{p.point}-{method}")
        for p in POINTS
        for method in methods_of(p.protocol, with_params=with_params)
    ]


@pytest.mark.parametrize("point", POINTS, ids=[p.point for p in POINTS])
def test_a_conforming_object_of_every_kind_registers(point):
    obj = generated(point.protocol, "good-one")
    host = create_host(
        load_entry_points=False, extra_plugins=[("gen", plugin_returning(point, obj))]
    )
    assert not host.failures
    assert host.registry(point.point).names() == ["good-one"]
    assert host.registry(point.point).entry("good-one").plugin == "gen"


def _refused(point, obj) -> str:
    host = create_host(
        load_entry_points=False, extra_plugins=[("gen", plugin_returning(point, obj))]
    )
    assert len(host.registry(point.point)) == 0
    [failure] = host.failures
    assert failure.plugin == "gen" and failure.status == "refused"
    return failure.reason


@pytest.mark.parametrize(("point", "method"), cases(with_params=False))
def test_an_object_missing_a_method_is_refused_naming_it(point, method):
    reason = _refused(point, generated(point.protocol, "bad-one", drop=method))
    assert "Generated('bad-one')" in reason and point.kind in reason
    assert f"no {method}" in reason


@pytest.mark.parametrize(("point", "method"), cases(with_params=True))
def test_a_method_short_of_an_argument_is_refused_naming_it(point, method):
    reason = _refused(point, generated(point.protocol, "bad-one", short=method))
    missing = list(conformance.members(point.protocol))
    sig = next(m.signature for m in missing if m.name == method)
    last = list(sig.parameters)[-1]  # type: ignore[union-attr]
    assert "Generated('bad-one')" in reason
    assert f"{method}(" in reason and last in reason


def test_a_subclass_that_inherits_a_protocol_stub_is_refused():
    point = EXTENSION_POINTS["kv_codecs"]

    class Lazy(point.protocol):  # type: ignore[misc,valid-type]
        name, description = "lazy", "implements nothing but supports"

        def supports(self, device) -> Support:
            return Support.yes()

    assert "allocate is not implemented" in _refused(point, Lazy())


def test_a_non_string_name_is_refused():
    point = EXTENSION_POINTS["kv_codecs"]
    obj = generated(point.protocol, "x")
    obj.name = 3  # type: ignore[attr-defined]
    assert "name is 3, not a non-empty string" in _refused(point, obj)


def test_a_codec_without_compute_dtype_is_refused_at_startup_not_in_generate():
    """The issue's example: a codec written to the old docs failed deep in `generate`."""
    point = EXTENSION_POINTS["kv_codecs"]

    class OldCodec:
        name, description = "old-codec", "allocate(layout, device) only"

        def supports(self, device) -> Support:
            return Support.yes()

        def bytes_per_token(self, num_layers, num_kv_heads, head_dim) -> int:
            return 1

        def allocate(self, layout, device):
            raise AssertionError("never called")

    reason = _refused(point, OldCodec())
    assert "allocate(layout, device)" in reason and "compute_dtype" in reason


@pytest.mark.parametrize("point", POINTS, ids=[p.point for p in POINTS])
def test_ninfer_plugins_lists_a_refused_object(point, monkeypatch, capsys):
    module = f"ninfer_test_malformed_{point.point}"
    method = methods_of(point.protocol)[-1]
    plugin = plugin_returning(point, generated(point.protocol, "bad-one", drop=method))
    mod = types.ModuleType(module)
    setattr(mod, point.hook, getattr(plugin, point.hook))
    monkeypatch.setitem(sys.modules, module, mod)
    ep = importlib.metadata.EntryPoint("malformed", module, ENTRY_POINT_GROUP)
    fake_entry_points(monkeypatch, [ep])
    assert main(["plugins", "--json"]) == 0
    failures = json.loads(capsys.readouterr().out)["failures"]
    [row] = [f for f in failures if f["name"] == "malformed"]
    assert row["status"] == "refused"
    assert f"no {method}" in row["reason"] and "Generated('bad-one')" in row["reason"]
    assert main(["plugins"]) == 0
    assert "REFUSED" in capsys.readouterr().out


@pytest.mark.parametrize("protocol", RUNTIME_PROTOCOLS, ids=lambda p: p.__name__)
def test_runtime_objects_are_checked_against_their_protocol(protocol):
    conformance.check(generated(protocol, "ok"), protocol, "a generated object")
    for method in methods_of(protocol):
        with pytest.raises(ContractError, match=rf"a generated object .*: no {method}\b"):
            conformance.check(
                generated(protocol, "bad", drop=method), protocol, "a generated object"
            )


def test_optional_members_must_be_declared_but_may_be_none():
    store = generated(KVStore, "s")
    assert store.rotation is None and store.gather_heads is None  # type: ignore[attr-defined]
    del type(store).rotation
    [problem] = conformance.problems(store, KVStore)
    assert problem.startswith("no rotation (declare it")


def test_an_optional_callable_is_checked_when_present():
    store = generated(KVStore, "s")
    type(store).gather_heads = lambda self, layer, block_table: None  # no length, no rotated
    [problem] = conformance.problems(store, KVStore)
    assert problem.startswith("gather_heads(layer, block_table) cannot be called")


def test_the_built_in_runtime_objects_conform():
    """The real model, ops, artifact and KV store of the built-in model keep the contract."""
    from ninfer_core.builtin_model import default_model
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.kv.layout import KVLayout
    from ninfer_core.loading import load_model

    host, device = create_host(), probe_device(use_cuda=False)
    loaded = load_model(default_model(), host=host, device=device, runtime=RuntimeConfig())
    assert not conformance.problems(loaded.model, CausalLM)
    assert not conformance.problems(loaded.ops, KernelOps)
    assert not conformance.problems(loaded.artifact, Artifact)
    cfg = loaded.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 2)
    for codec in host.kv_codecs:
        store = codec.allocate(layout, "cpu", compute_dtype=loaded.dtype)
        assert not conformance.problems(store, KVStore), codec.name


def test_a_backend_built_on_the_ops_base_class_declares_the_optional_members():
    """Subclassing `ninfer_core.model.ops.KernelOps` is enough: its optional members
    (`packed_nbytes`) are declared there at their defaults."""
    from ninfer_core.model.ops import KernelOps as OpsBase

    class LinearOnly(OpsBase):
        name = "linear-only"

        def linear(self, x, w, b=None):
            return x

        def rms_norm(self, x, w, eps):
            return x

        def silu_and_mul(self, gate, up):
            return gate

        def apply_rope(self, q, k, cos, sin):
            return q, k

        def paged_attention(self, q, k_new, v_new, kv_store, layer, meta, scale):
            return q

    ops = LinearOnly("cpu")
    assert ops.packed_nbytes is None
    assert not conformance.problems(ops, KernelOps)
