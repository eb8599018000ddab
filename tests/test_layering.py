"""The layering holds: the import graph of ninfer_core and ninfer_plugins has no forbidden arrow.

Data flows down (docs/architecture.md): cli -> serve -> engine -> model / kv, and the core
never reaches into a built-in plugin. Every import counts — at module level, inside a
function (a lazy import), under `if TYPE_CHECKING:`, relative or absolute — and so does a
module named by a string literal to `importlib.import_module` / `__import__` or as a value
of a dict literal (the lazy export tables in `engine/__init__.py`, `artifact/__init__.py`
and `cli/main.py`). The checker itself is tested on small packages written to `tmp_path`
with one forbidden import planted in each.
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ninfer_core", "ninfer_plugins")


@dataclass(frozen=True)
class Rule:
    """Nothing under `source` may import anything under `target` (dotted prefixes)."""

    source: str
    target: str
    why: str


RULES = (
    Rule("ninfer_core.model", "ninfer_core.engine",
         "the model takes its batch as model/attention_meta.py; the engine builds it"),
    Rule("ninfer_core.model", "ninfer_core.serve", "the model knows nothing of HTTP"),
    Rule("ninfer_core.kv", "ninfer_core.engine",
         "KV stores are below the engine; the engine wires them (engine/runtime.py)"),
    Rule("ninfer_core.engine", "ninfer_core.serve", "serve drives the engine, never back"),
    Rule("ninfer_core.engine", "ninfer_core.cli", "the command line drives the engine"),
    Rule("ninfer_core", "ninfer_plugins",
         "built-ins register by entry points like any plugin; the core names none"),
    Rule("ninfer_core", "plugins", "the built-ins' old top-level name"),
    Rule("ninfer_plugins", "ninfer_core.cli", "a plugin serves every command, not one"),
)  # fmt: skip


@dataclass(frozen=True)
class Arrow:
    source: str
    target: str
    path: Path
    line: int


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every `.py` of `packages` under `root`."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _named_module(node: ast.AST) -> str | None:
    """A string literal that names a module to import: `import_module("x")`, `__import__("x")`."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    fn = node.func
    name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
    arg = node.args[0]
    if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
        return arg.value if isinstance(arg.value, str) else None
    return None


def imports(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            for alias in node.names:
                # `from pkg import sub` imports the module pkg.sub when there is one.
                sub = f"{origin}.{alias.name}"
                yield (sub if sub in known else origin), node.lineno
        elif (name := _named_module(node)) is not None:
            yield name, node.lineno
        elif isinstance(node, ast.Dict):
            for value in node.values:  # lazy export tables: {"Name": "pkg.module"}
                if isinstance(value, ast.Constant) and value.value in known:
                    yield value.value, value.lineno


def arrows(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Arrow]:
    """Every import of every module of `packages` under `root`."""
    found = modules(root, packages)
    known = set(found)
    return [
        Arrow(module, target, path, line)
        for module, path in found.items()
        for target, line in imports(module, path, known)
    ]


def violations(root: Path, packages: tuple[str, ...] = PACKAGES, rules=RULES) -> list[str]:
    """One line per forbidden arrow: where, what, and which rule it breaks."""
    out = []
    for a in arrows(root, packages):
        for rule in rules:
            if _under(a.source, rule.source) and _under(a.target, rule.target):
                where = f"{a.path.relative_to(root)}:{a.line}"
                out.append(f"{where}: {a.source} imports {a.target} ({rule.why})")
    return out


# ---- the real tree --------------------------------------------------------------------


def test_the_tree_has_no_forbidden_import():
    found = violations(ROOT)
    assert not found, "forbidden imports (docs/architecture.md, layering):\n" + "\n".join(found)


def test_the_checker_sees_the_real_graph():
    """Not vacuous: the scan reaches both packages and sees the arrows that are allowed."""
    edges = {(a.source, a.target) for a in arrows(ROOT)}
    assert len(modules(ROOT)) > 100
    assert ("ninfer_core.engine.model_runner", "ninfer_core.model.attention_meta") in edges
    assert any(_under(s, "ninfer_core.serve") and _under(t, "ninfer_core.engine")
               for s, t in edges)  # fmt: skip  # serve -> engine is allowed
    assert any(_under(s, "ninfer_plugins") and _under(t, "ninfer_core.serve")
               for s, t in edges)  # fmt: skip
    # a lazy import inside a function, and a lazy export table, are arrows too
    assert ("ninfer_core.memory.planner", "ninfer_core.model.weights") in edges
    assert ("ninfer_core.engine", "ninfer_core.engine.runtime") in edges


# ---- the checker on planted imports ---------------------------------------------------

#: A small package shaped like ours, with only allowed imports.
CLEAN = {
    "ninfer_core/__init__.py": "",
    "ninfer_core/cli/__init__.py": "",
    "ninfer_core/cli/main.py": "import ninfer_core.serve.app\nimport ninfer_core.engine.engine\n",
    "ninfer_core/serve/__init__.py": "",
    "ninfer_core/serve/app.py": "from ninfer_core.engine.engine import Engine\n",
    "ninfer_core/engine/__init__.py": "_EXPORTS = {'Engine': 'ninfer_core.engine.engine'}\n",
    "ninfer_core/engine/engine.py": "from ninfer_core.model.batch import Batch\nEngine = 1\n",
    "ninfer_core/model/__init__.py": "",
    "ninfer_core/model/batch.py": "from ninfer_core.kv import layout\nBatch = 1\n",
    "ninfer_core/model/dense.py": "from . import batch\n",
    "ninfer_core/kv/__init__.py": "",
    "ninfer_core/kv/layout.py": "",
    "ninfer_plugins/__init__.py": "",
    "ninfer_plugins/kv_plain.py": "from ninfer_core.kv.layout import *\n",
    "ninfer_plugins/frontend.py": "from ninfer_core.serve.app import *\n",
}

#: (file, source appended to it, the arrow that must be reported)
PLANTED = [
    ("ninfer_core/model/dense.py",
     "def f():\n    from ninfer_core.engine.engine import Engine\n",
     "ninfer_core.model.dense imports ninfer_core.engine.engine"),
    ("ninfer_core/model/dense.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ninfer_core.serve import app\n",
     "ninfer_core.model.dense imports ninfer_core.serve.app"),
    ("ninfer_core/kv/layout.py",
     "from ninfer_core import engine\n",
     "ninfer_core.kv.layout imports ninfer_core.engine"),
    ("ninfer_core/engine/engine.py",
     "from ..serve.app import x\n",
     "ninfer_core.engine.engine imports ninfer_core.serve.app"),
    ("ninfer_core/engine/__init__.py",
     "_MORE = {'main': 'ninfer_core.cli.main'}\n",
     "ninfer_core.engine imports ninfer_core.cli.main"),
    ("ninfer_core/serve/app.py",
     "def f():\n    import ninfer_plugins.kv_plain\n",
     "ninfer_core.serve.app imports ninfer_plugins.kv_plain"),
    ("ninfer_core/cli/main.py",
     "import importlib\nimportlib.import_module('ninfer_plugins.frontend')\n",
     "ninfer_core.cli.main imports ninfer_plugins.frontend"),
    ("ninfer_core/model/batch.py",
     "class A:\n    def m(self):\n        from plugins.backend_torch import TorchOps\n",
     "ninfer_core.model.batch imports plugins.backend_torch"),
    ("ninfer_plugins/frontend.py",
     "def f():\n    from ninfer_core.cli.main import main\n",
     "ninfer_plugins.frontend imports ninfer_core.cli.main"),
]  # fmt: skip


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_clean_package_passes(tmp_path):
    assert violations(_write(tmp_path, CLEAN)) == []


@pytest.mark.parametrize(("file", "planted", "arrow"), PLANTED, ids=[p[2] for p in PLANTED])
def test_a_planted_forbidden_import_is_reported(tmp_path, file, planted, arrow):
    files = dict(CLEAN)
    files[file] += planted
    found = violations(_write(tmp_path, files))
    assert len(found) == 1 and arrow in found[0], found
    assert found[0].startswith(file + ":")


def test_a_lazy_model_to_engine_import_planted_in_a_copy_of_the_tree_fails(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.ninfer"))  # fmt: skip
    dense = tmp_path / "ninfer_core" / "model" / "dense.py"
    dense.write_text(
        dense.read_text() + "\n\ndef _planted():\n    from ninfer_core.engine import Engine\n"
    )
    found = violations(tmp_path)
    assert len(found) == 1, found
    assert "ninfer_core/model/dense.py" in found[0]
    assert "ninfer_core.model.dense imports ninfer_core.engine" in found[0]
