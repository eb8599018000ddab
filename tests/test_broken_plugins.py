"""A broken third-party plugin is reported, not fatal to every command.

The plugin below is installed the way pip would (a fake entry point) and has one
misspelt hook, which pluggy's `check_pending` catches. `ninfer plugins` and `ninfer
probe` list it with the error; `ninfer generate` warns and runs without it, and
fails at startup only when configured to use what it would have provided.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import sys
import types

import pytest
from test_plugin_host import Codec, fake_entry_points

from ninfer_core import ENTRY_POINT_GROUP, hookimpl
from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.cli.main import main

MODULE = "ninfer_test_typo_plugin"

#: The small demo model, named: with no MODEL, `generate` may pick SmolLM2 (slower here).
DEMO = str(BUILTIN_ARTIFACT)


@pytest.fixture
def typo_plugin(monkeypatch):
    """Entry point `typo-codecs`: a good `register_kv_codecs` and a misspelt hook."""
    mod = types.ModuleType(MODULE)

    @hookimpl
    def register_kv_codecs():
        return [Codec("typo-codec")]

    @hookimpl
    def register_frontend():  # missing the "s"
        return []

    mod.register_kv_codecs, mod.register_frontend = register_kv_codecs, register_frontend
    monkeypatch.setitem(sys.modules, MODULE, mod)
    ep = importlib.metadata.EntryPoint("typo-codecs", MODULE, ENTRY_POINT_GROUP)
    fake_entry_points(monkeypatch, [ep])


def test_ninfer_plugins_lists_the_broken_plugin_with_its_error(typo_plugin, capsys):
    assert main(["plugins", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    [row] = [f for f in out["failures"] if f["name"] == "typo-codecs"]
    assert row["status"] == "broken" and "register_frontend" in row["reason"]
    assert "kv-plain" in {p["name"] for p in out["plugins"]}  # the rest still loads
    assert main(["plugins"]) == 0
    assert "typo-codecs" in capsys.readouterr().out


def test_ninfer_probe_lists_the_broken_plugin_with_its_error(typo_plugin, capsys):
    assert main(["probe", "--device-spec", "rtx3090", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    [row] = [f for f in out["plugin_failures"] if f["plugin"] == "typo-codecs"]
    assert row["status"] == "broken" and "register_frontend" in row["reason"]
    assert main(["probe"]) == 0
    assert "plugin typo-codecs (?) not loaded" in capsys.readouterr().out


def test_generate_warns_and_runs_without_the_broken_plugin(typo_plugin, capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="ninfer_core.plugin_host"):
        code = main(["generate", DEMO, "--prompt", "Hello", "--greedy", "--max-new", "2"])
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip()
    assert any("typo-codecs" in r.getMessage() and "broken" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_generate_fails_at_startup_when_configured_for_the_broken_plugin(typo_plugin, capsys):
    code = main(
        ["generate", DEMO, "--prompt", "Hello", "--max-new", "2", "--kv-dtype", "typo-codec"]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "unknown KV codec 'typo-codec'" in err
    assert "plugin 'typo-codecs' (?) broken" in err and "register_frontend" in err
