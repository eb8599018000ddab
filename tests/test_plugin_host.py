"""The plugin host: entry-point loading, failures, allowlist, tracing, registries."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
import types
from pathlib import Path

import pytest

from ninfer_core import ENTRY_POINT_GROUP, hookimpl, hookspec, hookspecs
from ninfer_core.errors import DuplicateNameError, UnknownNameError
from ninfer_core.plugin_host import EXTENSION_POINTS, create_host
from ninfer_core.registry import Registry
from ninfer_core.spec.types import DraftMemory
from ninfer_core.support import Support

ROOT = Path(__file__).resolve().parents[1]


def builtin_entry_points() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["entry-points"][ENTRY_POINT_GROUP]


def fake_entry_points(monkeypatch, extra: list[importlib.metadata.EntryPoint]) -> None:
    """Add entry points to group `ninfer` as if a distribution had installed them."""
    real = importlib.metadata.entry_points

    def entry_points(**kw):
        found = list(real(**kw))
        if kw.get("group") == ENTRY_POINT_GROUP:
            found += extra
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


class Codec:
    def __init__(self, name: str, min_sm: int | None = None) -> None:
        self.name = name
        self.description = f"test codec {name}"
        self.min_sm = min_sm

    def supports(self, device) -> Support:
        if self.min_sm is None:
            return Support.yes()
        if device.cuda is None or device.cuda.sm_version < self.min_sm:
            return Support.no(f"needs SM{self.min_sm} or newer")
        return Support.yes()

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        return 4 * num_layers * num_kv_heads * head_dim

    def allocate(self, layout, device, compute_dtype=None):
        import torch

        from ninfer_core.kv.plain import PlainKVStore

        return PlainKVStore(layout, torch.float16, device, compute_dtype)


def codec_plugin(*codecs: Codec) -> types.SimpleNamespace:
    @hookimpl
    def register_kv_codecs():
        return list(codecs)

    return types.SimpleNamespace(register_kv_codecs=register_kv_codecs)


def test_every_builtin_entry_point_resolves():
    host = create_host()
    loaded = {p.name: p for p in host.plugins}
    assert not [f for f in host.failures if f.distribution == "ninfer"]
    for name, target in builtin_entry_points().items():
        assert name in loaded, f"built-in plugin {name} ({target}) did not load"
        assert loaded[name].distribution == "ninfer"
        assert loaded[name].module == target
    # Each built-in contributes to at least one registry.
    sources = {e.plugin for r in host.registries.values() for e in r.entries()}
    assert set(builtin_entry_points()) <= sources


def test_broken_plugin_is_reported_and_the_host_carries_on(monkeypatch):
    ep = importlib.metadata.EntryPoint("broken", "no_such_module_xyz", ENTRY_POINT_GROUP)
    fake_entry_points(monkeypatch, [ep])
    host = create_host()
    [failure] = [f for f in host.failures if f.plugin == "broken"]
    assert "no_such_module_xyz" in failure.reason
    assert "ModuleNotFoundError" in failure.reason
    assert "fp16" in host.kv_codecs  # the built-ins are all still there


def test_allowlist_limits_third_party_plugins(monkeypatch):
    mod = types.ModuleType("ninfer_test_codec_mod")
    mod.register_kv_codecs = codec_plugin(Codec("toyz")).register_kv_codecs
    monkeypatch.setitem(sys.modules, "ninfer_test_codec_mod", mod)
    ep = importlib.metadata.EntryPoint("toyz-plugin", "ninfer_test_codec_mod", ENTRY_POINT_GROUP)
    fake_entry_points(monkeypatch, [ep])
    assert "toyz" in create_host().kv_codecs
    monkeypatch.setenv("NINFER_PLUGINS", "something-else")
    host = create_host()
    assert "toyz" not in host.kv_codecs
    assert "fp16" in host.kv_codecs  # built-ins are not subject to the allowlist
    monkeypatch.setenv("NINFER_PLUGINS", "toyz-plugin")
    assert "toyz" in create_host().kv_codecs


def test_hosts_are_independent():
    with_toy = create_host(extra_plugins=[("toy", codec_plugin(Codec("toy-a")))])
    plain = create_host()
    assert "toy-a" in with_toy.kv_codecs
    assert "toy-a" not in plain.kv_codecs


def test_duplicate_name_is_refused_naming_both_sources():
    host = create_host(
        load_entry_points=False,
        extra_plugins=[("one", codec_plugin(Codec("dup"))), ("two", codec_plugin(Codec("dup")))],
    )
    [failure] = host.failures
    assert "registered twice" in failure.reason
    assert "one" in failure.reason and "two" in failure.reason


def test_registry_unknown_name_lists_known_ones():
    reg: Registry[int] = Registry("KV codec")
    reg.add("fp16", 1)
    reg.add("int8", 2)
    with pytest.raises(
        UnknownNameError, match=r"unknown KV codec 'fp9'; known KV codecs: fp16, int8"
    ):
        reg.get("fp9")
    with pytest.raises(DuplicateNameError):
        reg.add("fp16", 3)


def test_unknown_architecture_lists_known_ones():
    host = create_host()
    with pytest.raises(UnknownNameError) as info:
        host.family_for("GPTNeoXForCausalLM")
    assert "Qwen3ForCausalLM" in str(info.value)
    assert "LlamaForCausalLM" in str(info.value)


def test_a_misspelt_hook_leaves_that_plugin_out_and_the_host_carries_on():
    @hookimpl
    def register_kv_codec():  # missing the "s": matches no spec (pluggy's check_pending)
        return []

    typo = types.SimpleNamespace(register_kv_codec=register_kv_codec)
    host = create_host(
        load_entry_points=False,
        extra_plugins=[("typo", typo), ("fine", codec_plugin(Codec("fine-codec")))],
    )
    [failure] = host.failures
    assert failure.plugin == "typo" and failure.status == "broken"
    assert "register_kv_codec" in failure.reason
    assert "typo" not in {p.name for p in host.plugins}
    assert not host.pm.has_plugin("typo")
    assert host.kv_codecs.names() == ["fine-codec"]
    # A name the broken plugin may have provided fails naming what was left out.
    with pytest.raises(UnknownNameError, match=r"unknown KV codec 'typo-codec'.*'typo'.*broken"):
        host.kv_codecs.get("typo-codec")


def test_a_hook_taking_an_argument_no_spec_has_is_reported():
    @hookimpl
    def register_kv_codecs(colour):  # pluggy refuses this at register()
        return []

    host = create_host(
        load_entry_points=False,
        extra_plugins=[("odd", types.SimpleNamespace(register_kv_codecs=register_kv_codecs))],
    )
    [failure] = host.failures
    assert failure.plugin == "odd" and "colour" in failure.reason


def test_a_raising_hook_is_that_plugins_failure_alone():
    @hookimpl
    def register_kv_codecs():
        raise RuntimeError("no GPU here")

    host = create_host(
        load_entry_points=False,
        extra_plugins=[
            ("raises", types.SimpleNamespace(register_kv_codecs=register_kv_codecs)),
            ("fine", codec_plugin(Codec("fine-codec"))),
        ],
    )
    [failure] = host.failures
    assert failure.plugin == "raises" and "RuntimeError: no GPU here" in failure.reason
    assert host.kv_codecs.names() == ["fine-codec"]


def test_malformed_object_is_reported_not_registered():
    @hookimpl
    def register_kv_codecs():
        return [object()]

    host = create_host(
        load_entry_points=False,
        extra_plugins=[("bad", types.SimpleNamespace(register_kv_codecs=register_kv_codecs))],
    )
    assert len(host.kv_codecs) == 0
    assert "malformed" in host.failures[0].reason


def test_trace_switch_prints_every_registration_hook(capsys):
    create_host(trace=True)
    err = capsys.readouterr().err
    for point in EXTENSION_POINTS.values():
        if point.hook in ("register_draft_strategies", "register_frontends"):
            continue  # no built-in implements these yet
        assert point.hook in err
    # pluggy's own tracing: the call and its result, under our prefix and attribution.
    assert "[ninfer plugins]" in err
    assert "register_kv_codecs [hook]" in err
    assert "finish register_kv_codecs --> [[PlainKVCodec(fp16)" in err
    assert "register_kv_codecs from plugin 'kv-plain'" in err


def test_trace_env_variable_turns_pluggy_tracing_on(monkeypatch, capsys):
    monkeypatch.setenv("NINFER_TRACE_PLUGINS", "1")
    create_host(load_entry_points=False, extra_plugins=[("toy", codec_plugin(Codec("t")))])
    assert "finish register_kv_codecs -->" in capsys.readouterr().err
    monkeypatch.setenv("NINFER_TRACE_PLUGINS", "0")
    create_host(load_entry_points=False, extra_plugins=[("toy", codec_plugin(Codec("t")))])
    assert "register_kv_codecs" not in capsys.readouterr().err


def test_a_spec_can_grow_an_argument_without_breaking_plugins(monkeypatch):
    """Hooks are called by keyword: an implementation of the old, argument-less spec
    keeps working next to one that takes the new argument."""
    seen = []

    @hookspec
    def register_kv_codecs(device_hint):  # the spec, grown by one argument
        """Return KV codecs."""

    @hookimpl(specname="register_kv_codecs")
    def grown(device_hint):
        seen.append(device_hint)
        return [Codec("new-style")]

    monkeypatch.setattr(hookspecs, "register_kv_codecs", register_kv_codecs)
    host = create_host(
        load_entry_points=False,
        extra_plugins=[
            ("old", codec_plugin(Codec("old-style"))),
            ("new", types.SimpleNamespace(grown=grown)),
        ],
        hook_arguments={"device_hint": "cpu"},
    )
    assert not host.failures
    assert host.kv_codecs.names() == ["old-style", "new-style"]
    assert seen == ["cpu"]


def test_draft_strategies_and_frontends_fold_into_their_registries():
    class Named:
        def __init__(self, name: str) -> None:
            self.name, self.description = name, f"test {name}"

        def supports(self, device) -> Support:
            return Support.yes()

    class Api(Named):
        error_paths = ()  # errors keep the core shape
        error_body = None

        def route_handlers(self, app_state) -> list:
            return []

    class Draft(Named):
        def supports_model(self, target, options) -> Support:
            return Support.yes()

        def create(self, target, options):
            raise NotImplementedError  # never built: this test only registers

        def memory(self, artifact, config, options, dtype, codec, *, packed_bytes=None):
            return DraftMemory()  # holds nothing on the device

    @hookimpl
    def register_draft_strategies():
        return [Draft("echo-draft")]

    @hookimpl
    def register_frontends():
        return [Api("echo-api")]

    plugin = types.SimpleNamespace(
        register_draft_strategies=register_draft_strategies, register_frontends=register_frontends
    )
    host = create_host(load_entry_points=False, extra_plugins=[("echo", plugin)])
    assert host.draft_strategies.names() == ["echo-draft"]
    assert host.frontends.names() == ["echo-api"]
    assert host.draft_strategies.entry("echo-draft").plugin == "echo"


def test_every_extension_point_has_a_registry_and_a_row():
    host = create_host(load_entry_points=False)
    assert list(host.registries) == list(EXTENSION_POINTS)
    for name, point in EXTENSION_POINTS.items():
        assert point.point == name and point.hook == f"register_{name}"
        assert host.registry(name) is host.registries[name]
        assert point.exclusive == (point.option is not None)


def test_a_family_claiming_a_built_in_architecture_is_refused_not_fatal():
    from ninfer_plugins.model_dense import DenseFamily

    @hookimpl
    def register_model_families():
        return [DenseFamily("my-qwen", ("Qwen3ForCausalLM",), True, "a clashing family")]

    plugin = types.SimpleNamespace(register_model_families=register_model_families)
    host = create_host(extra_plugins=[("clash", plugin)])
    [failure] = [f for f in host.failures if f.plugin == "clash"]
    assert failure.status == "refused"
    assert "'my-qwen' claims architecture 'Qwen3ForCausalLM'" in failure.reason
    assert "'qwen3'" in failure.reason
    assert "my-qwen" not in host.model_families
    assert host.family_for("Qwen3ForCausalLM").name == "qwen3"
