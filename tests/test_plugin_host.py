"""The plugin host: entry-point loading, failures, allowlist, tracing, registries."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
import types
from pathlib import Path

import pytest

from ninfer_core import ENTRY_POINT_GROUP, hookimpl
from ninfer_core.errors import DuplicateNameError, NInferError, UnknownNameError
from ninfer_core.plugin_host import EXTENSION_POINTS, create_host
from ninfer_core.registry import Registry
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


def test_check_pending_catches_a_misspelt_hook():
    @hookimpl
    def register_kv_codec():  # missing the "s": matches no spec
        return []

    typo = types.SimpleNamespace(register_kv_codec=register_kv_codec)
    with pytest.raises(NInferError, match="register_kv_codec"):
        create_host(load_entry_points=False, extra_plugins=[("typo", typo)])


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
    for hook_name, _ in EXTENSION_POINTS.values():
        if hook_name in ("register_draft_strategies", "register_frontends"):
            continue  # no built-in implements these yet
        assert hook_name in err
    assert "kv-plain" in err


def test_draft_strategies_and_frontends_fold_into_their_registries():
    class Named:
        def __init__(self, name: str) -> None:
            self.name, self.description = name, f"test {name}"

        def supports(self, device) -> Support:
            return Support.yes()

    @hookimpl
    def register_draft_strategies():
        return [Named("echo-draft")]

    @hookimpl
    def register_frontends():
        return [Named("echo-api")]

    plugin = types.SimpleNamespace(
        register_draft_strategies=register_draft_strategies, register_frontends=register_frontends
    )
    host = create_host(load_entry_points=False, extra_plugins=[("echo", plugin)])
    assert host.draft_strategies.names() == ["echo-draft"]
    assert host.frontends.names() == ["echo-api"]
    assert host.draft_strategies.entry("echo-draft").plugin == "echo"
