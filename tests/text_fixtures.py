"""Shared fixtures for the text-layer tests: a folder-backed artifact and a tiny tokenizer.

The tokenizer is trained on the spot (byte-level BPE, a few hundred tokens, ~0.1 s) so the
tests need no model download, and it is saved in the Hugging Face layout so transformers can
load the very same folder as the independent reference.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

# The reference tokenizers load from local folders only; never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "What is the weather like in Paris today? Let me check the forecast.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "<tool_call> </tool_call> <think> </think> <tool_response> </tool_response>",
    "天气很好。我们去公园吧！日本語のテキストも少し。",
    "Emoji time: 😀🎉👍🏽 and accents: café, naïve, Zürich.",
] * 4


class DirTexts:
    """An `Artifact` stand-in that only knows how to read text files from a folder."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def read_text(self, name: str) -> str | None:
        file = self.path / name
        return file.read_text(encoding="utf-8") if file.is_file() else None


def train_backend(vocab_size: int = 400, bos: str | None = None) -> BackendTokenizer:
    """A byte-level BPE like Qwen's; with `bos`, a post-processor that prepends it."""
    specials = [*SPECIALS, *([bos] if bos else [])]
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if bos:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_model_dir(
    path: Path,
    config: dict[str, Any] | None = None,
    bos: str | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Save tokenizer.json + tokenizer_config.json (+ any extra files) into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    train_backend(bos=bos).save(str(path / "tokenizer.json"))
    base: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    base.update(config or {})
    (path / "tokenizer_config.json").write_text(json.dumps(base), encoding="utf-8")
    for name, text in (extra_files or {}).items():
        (path / name).write_text(text, encoding="utf-8")
    return path


def reference_tokenizer(path: Path) -> Any:
    """The same folder loaded by transformers, the independent reference."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


# A chat template written to behave like the real Qwen3 one: a system+tools block, ChatML
# turns, assistant tool calls as <tool_call> JSON, grouped tool responses, reasoning
# blocks after the last user query, and `enable_thinking=False` closing an empty <think>.
QWEN3_STYLE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
        and not(message.content.startswith('<tool_response>')
        and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                    .split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')
                    + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Current weather for a city, with "quotes" & <brackets> — and ünïcode.',
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

TWO_TURNS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "Let me look that up for you."},
    {"role": "user", "content": "And in 東京? 😀"},
]

TOOL_ROUND = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
            },
        ],
    },
    {"role": "tool", "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "tool", "content": '{"temp": 18, "sky": "rain"}'},
    {"role": "assistant", "content": "<think>\nSummarise.\n</think>\n\nParis 21°C, Tokyo 18°C."},
    {"role": "user", "content": "Thanks!", "name": None},
]
