"""The built-in model's corpus: Python's own standard library, and agent transcripts.

Everything is built from material every machine with Python already holds, so the
model can be retrained anywhere, offline:

- **code**: the standard library's `.py` sources (tests and IDLE left out);
- **docs**: chats asking what a stdlib function or class does, answered with the first
  paragraph of its own docstring, or asking for it and answered with its source;
- **tools**: synthetic agent transcripts (system prompt, tool definitions, a user
  request, the assistant's JSON tool call, the tool's result, the final answer),
  rendered through the same chat template the server uses.

The held-out split is chosen by a hash of each file's path inside the standard library
(not by position), so it stays the same when files are added; transcripts for the
held-out split come from their own seed.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ninfer_core.builtin_model import CHAT_TEMPLATE
from ninfer_core.builtin_tools import TOOLS, UNITS
from ninfer_core.text.chat_template import ChatTemplate

#: documents are separated by this token, as in Qwen's pretraining
DOC_SEP = "<|endoftext|>"
#: one file in HELDOUT_MODULUS goes to the held-out split
HELDOUT_MODULUS = 16
SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "turtledemo"}
MAX_FILE_CHARS = 60_000


@dataclass(frozen=True)
class Corpus:
    """Training and held-out text per source (lists of documents)."""

    code: list[str]
    docs: list[str]
    tools: list[str]


def stdlib_files() -> list[Path]:
    """The standard library's sources in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not SKIP_PARTS & set(p.relative_to(root).parts) and p.stat().st_size > 200
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(path: Path) -> bool:
    rel = path.relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
    return zlib.crc32(rel.encode()) % HELDOUT_MODULUS == 0


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text[:MAX_FILE_CHARS]


def _doc_chats(path: Path, source: str, template: ChatTemplate) -> Iterator[str]:
    """Chats about the documented top-level functions and classes of one module."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    module = path.stem if path.stem != "__init__" else path.parent.name
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        first = doc.split("\n\n")[0].strip()
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        ask = f"What does the {kind} `{module}.{node.name}` do?"
        yield template.render(
            [{"role": "user", "content": ask}, {"role": "assistant", "content": first}]
        )
        body = ast.get_source_segment(source, node)
        if body and len(body) < 2500:
            ask = f"Write the {kind} `{node.name}` from `{module}`: {first.splitlines()[0]}"
            yield template.render(
                [
                    {"role": "user", "content": ask},
                    {"role": "assistant", "content": f"```python\n{body}\n```"},
                ]
            )


def build_corpus(*, transcripts: int, heldout_transcripts: int, seed: int) -> tuple[Corpus, Corpus]:
    """(training, held-out) corpora."""
    template = ChatTemplate(CHAT_TEMPLATE)
    train = Corpus([], [], [])
    held = Corpus([], [], [])
    for path in stdlib_files():
        text = _read(path)
        if not text:
            continue
        split = held if is_heldout(path) else train
        split.code.append(text)
        split.docs.extend(_doc_chats(path, text, template))
    train.tools.extend(transcript(random.Random(seed + i), template) for i in range(transcripts))
    held.tools.extend(
        transcript(random.Random(10**9 + seed + i), template) for i in range(heldout_transcripts)
    )
    return train, held


# --- synthetic agent transcripts -----------------------------------------------------

CITIES = [
    "Paris", "Berlin", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Austin", "Pune",
    "Madrid", "Seoul", "Nairobi", "Quito", "Hanoi", "Dublin", "Perth",
]  # fmt: skip
NAMES = ["Ada", "Linus", "Grace", "Guido", "Barbara", "Ken", "Margaret", "Dennis", "Frances"]
FILES = [
    "src/app.py", "README.md", "setup.cfg", "data/users.csv", "notes.txt", "main.py",
    "tests/test_api.py", "config.toml", "Makefile", "docs/index.md",
]  # fmt: skip
PATTERNS = ["TODO", "def main", "import json", "class User", "raise ValueError", "async def"]
CONDITIONS = ["sunny", "cloudy", "light rain", "snow", "windy", "clear", "fog"]
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a coding assistant. Use the tools when they help.",
    "You are NInfer's demo assistant. Answer briefly.",
]


def _weather(rng: random.Random) -> tuple[str, dict, str, str]:
    city, unit = rng.choice(CITIES), rng.choice(UNITS)
    ask = rng.choice(
        ["What's the weather in {c}?", "Is it cold in {c} right now?", "Weather for {c}, please."]
    ).format(c=city)
    args = {"city": city, "unit": unit} if rng.random() < 0.6 else {"city": city}
    deg = rng.randint(-10, 35)
    cond = rng.choice(CONDITIONS)
    result = json.dumps({"city": city, "temperature": deg, "unit": args.get("unit", "celsius"),
                         "condition": cond})  # fmt: skip
    answer = f"It is {deg} degrees and {cond} in {city}."
    return ask, args, result, answer


def _calc(rng: random.Random) -> tuple[str, dict, str, str]:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op = rng.choice(["+", "-", "*"])
    expr = f"{a} {op} {b}"
    value = eval(expr)  # two integers and one operator, built above
    ask = rng.choice(["What is {e}?", "Compute {e}.", "Can you work out {e} for me?"]).format(
        e=expr
    )
    return ask, {"expression": expr}, json.dumps({"result": value}), f"{expr} = {value}."


def _open_file(rng: random.Random) -> tuple[str, dict, str, str]:
    path = rng.choice(FILES)
    lines = rng.randint(3, 400)
    ask = rng.choice(["Show me {p}.", "What is in {p}?", "Open {p}."]).format(p=path)
    result = json.dumps({"path": path, "lines": lines, "text": f"# {path}\n..."})
    return ask, {"path": path}, result, f"{path} has {lines} lines; it starts with a header."


def _search(rng: random.Random) -> tuple[str, dict, str, str]:
    pattern = rng.choice(PATTERNS)
    hits = rng.sample(FILES, rng.randint(0, 3))
    ask = f"Where do we use `{pattern}`?"
    result = json.dumps({"matches": [{"file": f, "line": rng.randint(1, 300)} for f in hits]})
    answer = (
        f"`{pattern}` appears in {', '.join(hits)}." if hits else f"No file contains `{pattern}`."
    )
    return ask, {"pattern": pattern}, result, answer


def _email(rng: random.Random) -> tuple[str, dict, str, str]:
    name = rng.choice(NAMES)
    to = f"{name.lower()}@example.com"
    subject = rng.choice(["Meeting", "Release notes", "Lunch", "Build failed"])
    ask = f"Email {name} ({to}) about: {subject}."
    args = {"to": to, "subject": subject, "body": f"Hi {name}, about {subject.lower()}."}
    return ask, args, json.dumps({"status": "sent"}), f"Done: the email to {name} was sent."


SCENARIOS = {
    "get_weather": _weather,
    "calculator": _calc,
    "read_file": _open_file,
    "search_code": _search,
    "send_email": _email,
}


def transcript(rng: random.Random, template: ChatTemplate) -> str:
    """One rendered agent conversation: a call, its result, and the answer."""
    name = rng.choice(sorted(SCENARIOS))
    others = rng.sample([t for t in TOOLS if t != name], rng.randint(0, 2))
    tools = [TOOLS[t] for t in sorted([name, *others])]
    ask, args, result, answer = SCENARIOS[name](rng)
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    messages = [
        {"role": "system", "content": rng.choice(SYSTEMS)},
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": answer},
    ]
    return template.render(messages, tools=tools)


def write_heldout(held: Corpus, out: Path) -> dict[str, Path]:
    """The held-out split as text files `ninfer eval-ppl` reads."""
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "code": out / "heldout-code.txt",
        "tools": out / "heldout-tools.txt",
    }
    files["code"].write_text(DOC_SEP.join(held.code), encoding="utf-8")
    files["tools"].write_text(DOC_SEP.join(held.tools), encoding="utf-8")
    return files
