"""The two workloads of `ninfer bench serve`, as requests to an OpenAI or Anthropic endpoint.

`coding`: a whole file of code (with a reviewer's Chinese notes in it) and an edit request.
`agent`: a system prompt, tool definitions, turns of tool calls with their JSON results, and
a question. Both are sized in characters (`build`), and `serve.calibrate` turns a token
target into characters with the server's own count. Every request starts with a salt, in
the system prompt and in the first tool's description (a chat template may put the tools
first), so no two requests share a prefix: a prefix cache would otherwise answer every
run after the first from memory and the bench would time nothing.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from ninfer_core.bench import serve_texts as texts
from ninfer_core.errors import NInferError

Scenario = Literal["coding", "agent"]
SCENARIOS: tuple[Scenario, ...] = ("coding", "agent")


@dataclass
class Conversation:
    """One request's prompt, API-neutral: OpenAI-style messages without the system one."""

    system: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)

    def chars(self) -> int:
        return len(json.dumps([self.system, self.messages, self.tools], ensure_ascii=False))


def parse_contexts(spec: str) -> list[int]:
    """`8k,32k,64k` → [8192, 32768, 65536]; plain numbers are tokens."""
    out = []
    for part in (p.strip().lower() for p in spec.split(",")):
        if not part:
            continue
        try:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
        except ValueError:
            raise NInferError(
                f"--contexts: token counts such as 8k,32k or 1000 (got {spec!r})"
            ) from None
    if not out or min(out) < 64:
        raise NInferError(f"--contexts: at least one length of 64 tokens or more (got {spec!r})")
    return out


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def salt_line(salt: int) -> str:
    return f"会话 session {salt:08x}"


def build(scenario: Scenario, chars: int, salt: int) -> Conversation:
    """A `scenario` prompt of about `chars` characters (of its JSON), salted."""
    return (_coding if scenario == "coding" else _agent)(max(chars, 200), salt)


def _code_lines() -> list[str]:
    """The bundled files as one listing, a reviewer's note every 40 lines."""
    lines: list[str] = []
    for name, source in texts.code_files():
        lines.append(f"# ===== file: {name} =====")
        for i, line in enumerate(source.splitlines(), 1):
            lines.append(line)
            if i % 40 == 0:
                note = texts.CODE_NOTES[(len(lines) // 40) % len(texts.CODE_NOTES)]
                lines.append(f"# 审阅: {note}")
    return lines


def _take_lines(lines: list[str], start: int, chars: int) -> str:
    """Lines from `start` (wrapping round) until `chars` characters; the last one cut."""
    out, used, i = [], 0, start
    while used < chars:
        line = lines[i % len(lines)]
        out.append(line[: chars - used])
        used += len(line) + 1
        i += 1
    return "\n".join(out)


def _coding(chars: int, salt: int) -> Conversation:
    rng = random.Random(0)  # the salt alone varies: calibration needs size ∝ chars
    system = f"{salt_line(salt)}\n{texts.SYSTEM_CODING}"
    ask = rng.choice(texts.EDIT_REQUESTS)
    head = "请阅读下面这个文件 (read the whole file first)：\n\n```python\n"
    tail = f"\n```\n\n{ask}"
    # json.dumps escapes newlines and quotes: code grows ~5% in the measured characters
    budget = max(int((chars - len(system) - len(head) - len(tail) - 80) / 1.05), 100)
    code = _take_lines(_code_lines(), 0, budget)
    return Conversation(system, [{"role": "user", "content": head + code + tail}])


def _tool(name: str, description: str, **props: tuple[str, str]) -> dict[str, Any]:
    """A tool definition, OpenAI's shape; `props`: name → (JSON type, description)."""
    schema = {
        "type": "object",
        "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
        "required": list(props)[:1],
    }
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": schema}}  # fmt: skip


def _tools(salt: int) -> list[dict[str, Any]]:
    return [
        _tool("read_file", f"读取仓库中的一个文件 (read a file in the repository). "
              f"{salt_line(salt)}", path=("string", "相对路径, e.g. src/app.py"),
              start_line=("integer", "从第几行开始 (1-based)")),
        _tool("search_code", "在仓库中搜索代码 (ripgrep syntax)，返回匹配的行",
              pattern=("string", "正则表达式"), glob=("string", "文件过滤, e.g. *.py")),
        _tool("run_tests", "运行测试并返回结果摘要 (pytest)",
              target=("string", "测试文件或测试用例"), timeout_s=("integer", "超时秒数")),
        _tool("web_search", "搜索网页，返回标题、摘要和链接",
              query=("string", "搜索词，中文或英文都可以")),
        _tool("edit_file", "修改文件：把 old 替换成 new (exact match)",
              path=("string", "相对路径"), old=("string", "原文"), new=("string", "新文本")),
    ]  # fmt: skip


def _agent(chars: int, salt: int) -> Conversation:
    rng = random.Random(0)  # the salt alone varies: calibration needs size ∝ chars
    conv = Conversation(
        f"{salt_line(salt)}\n{texts.SYSTEM_AGENT}",
        [{"role": "user", "content": rng.choice(texts.AGENT_TASKS)}],
        # a short context has room for fewer tools (the full set is ~2,000 characters)
        _tools(salt)[: max(1, min(5, chars // 1500))],
    )
    question = rng.choice(texts.AGENT_QUESTIONS)
    lines, files = _code_lines(), texts.code_files()
    turn, at, size = 0, 0, conv.chars()
    while (room := int((chars - size - len(question) - 300) / 1.1)) >= 400:
        name, args, result = _tool_turn(turn, rng, lines, files, at, max(room, 100))
        at += 120
        call_id = f"call_{turn:03d}"
        note = "" if turn % 3 else rng.choice(texts.PARAGRAPHS)[:60] + " 我先看一下。"
        conv.messages.append(
            {
                "role": "assistant",
                "content": note,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": name,
                            "arguments": json.dumps(args, ensure_ascii=False),
                        },
                    }
                ],
            }
        )
        conv.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": json.dumps(result, ensure_ascii=False)})  # fmt: skip
        # counted as it grows: re-measuring the whole conversation each turn is quadratic
        size += len(json.dumps(conv.messages[-2:], ensure_ascii=False)) + 2
        turn += 1
    # what no whole turn fits into: the user's notes before the question, to the character
    if (rest := chars - size - len(question) - 30) > 0:
        question = f"补充说明：{_prose(rest)}\n\n{question}"
    conv.messages.append({"role": "user", "content": question})
    return conv


def _prose(chars: int) -> str:
    """The bundled paragraphs in turn, cut at `chars` characters."""
    text, i = "", 0
    while len(text) < chars:
        text += texts.PARAGRAPHS[i % len(texts.PARAGRAPHS)]
        i += 1
    return text[:chars]


def _tool_turn(
    turn: int, rng: random.Random, lines: list[str], files: tuple, at: int, room: int
) -> tuple[str, dict[str, Any], Any]:
    """One tool call and its JSON result, at most about `room` characters."""
    kind = turn % 4
    if kind == 0:  # a file read: code
        name = files[(turn // 4) % len(files)][0]
        code = _take_lines(lines, at, min(room, 6000))
        return "read_file", {"path": f"src/{name}"}, {"path": f"src/{name}", "content": code}
    if kind == 1:  # search hits: code lines with places
        hits, used = [], 0
        while used < min(room, 2500):
            n = rng.randrange(len(lines))
            hit = {"path": f"src/{files[n % len(files)][0]}", "line": n % 900 + 1,
                   "text": lines[n].strip()[:160]}  # fmt: skip
            hits.append(hit)
            used += len(json.dumps(hit, ensure_ascii=False))
        return "search_code", {"pattern": "def |class "}, {"matches": hits, "truncated": False}
    if kind == 2:  # test output: counts and a Chinese summary
        failed = rng.randrange(0, 4)
        output = _take_lines(lines, at + 37, min(room, 1500))
        summary = rng.choice(texts.PARAGRAPHS)
        return "run_tests", {"target": "tests/"}, {"passed": rng.randrange(40, 300),
            "failed": failed, "duration_s": round(rng.uniform(1, 90), 2),
            "summary": summary[: max(room // 4, 20)], "output": output}  # fmt: skip
    results, used = [], 0  # web search: Chinese titles and snippets
    while used < min(room, 2500):
        p = texts.PARAGRAPHS[rng.randrange(len(texts.PARAGRAPHS))]
        item = {"title": p[:18], "snippet": p, "url": f"https://example.org/{rng.randrange(10**6)}"}
        results.append(item)
        used += len(json.dumps(item, ensure_ascii=False))
    return "web_search", {"query": "python 性能 排查"}, {"results": results}


# -- the bodies of the two APIs ------------------------------------------------------------


def openai_body(conv: Conversation, model: str, max_tokens: int, extras: dict[str, Any]) -> dict:
    """A streamed `/v1/chat/completions` body with usage in the last chunk."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": conv.system}, *conv.messages], **extras,
    }  # fmt: skip
    if conv.tools:
        body["tools"] = conv.tools
    return body


def anthropic_body(conv: Conversation, model: str, max_tokens: int, extras: dict[str, Any]) -> dict:
    """A streamed `/v1/messages` body: tool calls become `tool_use` blocks, tool results
    `tool_result` blocks in a user turn, and a user text straight after them joins that turn
    (the API wants user and assistant turns to alternate)."""
    messages: list[dict[str, Any]] = []
    for m in conv.messages:
        if m["role"] == "assistant":
            blocks: list[dict[str, Any]] = (
                [{"type": "text", "text": m["content"]}] if m["content"] else []
            )
            for call in m.get("tool_calls", []):
                fn = call["function"]
                blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"],
                               "input": json.loads(fn["arguments"])})  # fmt: skip
            messages.append({"role": "assistant", "content": blocks})
            continue
        block = (
            {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if m["role"] == "tool"
            else {"type": "text", "text": m["content"]}
        )
        if messages and messages[-1]["role"] == "user":
            messages[-1]["content"].append(block)
        else:
            messages.append({"role": "user", "content": [block]})
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "system": conv.system, "messages": messages, **extras,
    }  # fmt: skip
    if conv.tools:
        body["tools"] = [
            {"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]}
            for t in conv.tools
        ]  # fmt: skip
    return body
