"""Chat templates render byte for byte as transformers renders them, inside a sandbox."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from text_fixtures import (
    QWEN3_STYLE_TEMPLATE,
    TOOL_ROUND,
    TWO_TURNS,
    WEATHER_TOOL,
    DirTexts,
    reference_tokenizer,
    write_model_dir,
)

from ninfer_core.errors import ModelLoadError, NInferError
from ninfer_core.text import ChatTemplate, ChatTemplateError, Tokenizer

BOS_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('Only user and assistant roles are supported, got ' + m.role) }}"
    "{% endif %}"
    "[{{ m.role | upper }}] {{ m.content | trim }}{{ eos_token if m.role == 'assistant' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen")
    return write_model_dir(path, config={"chat_template": QWEN3_STYLE_TEMPLATE})


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> tuple[Tokenizer, ChatTemplate]:
    artifact = DirTexts(qwen_dir)
    tokenizer = Tokenizer.from_artifact(artifact)
    template = ChatTemplate.from_artifact(artifact, tokenizer.special_tokens)
    assert template is not None
    return tokenizer, template


@pytest.fixture(scope="module")
def qwen_ref(qwen_dir: Path) -> Any:
    return reference_tokenizer(qwen_dir)


CASES = [
    pytest.param(TWO_TURNS, [WEATHER_TOOL], {"add_generation_prompt": True}, id="tools-gen"),
    pytest.param(TWO_TURNS, None, {"add_generation_prompt": True}, id="no-tools"),
    pytest.param(
        TWO_TURNS,
        [WEATHER_TOOL],
        {"add_generation_prompt": True, "enable_thinking": False},
        id="no-thinking",
    ),
    pytest.param(TOOL_ROUND, [WEATHER_TOOL], {"add_generation_prompt": True}, id="tool-round"),
    pytest.param(TOOL_ROUND[:-1], [WEATHER_TOOL], {}, id="ends-on-assistant"),
    pytest.param(
        TOOL_ROUND[:5], [WEATHER_TOOL], {"add_generation_prompt": True}, id="ends-on-tool"
    ),
]


@pytest.mark.parametrize(("messages", "tools", "kwargs"), CASES)
def test_qwen3_style_matches_transformers(
    qwen: tuple[Tokenizer, ChatTemplate],
    qwen_ref: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> None:
    tokenizer, template = qwen
    ours = template.render(messages, tools=tools, **kwargs)
    theirs = qwen_ref.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    assert ours == theirs
    # and the prompt tokenizes identically (the template writes its own specials)
    assert tokenizer.encode(ours, add_special_tokens=False) == qwen_ref.encode(
        theirs, add_special_tokens=False
    )


def test_qwen3_style_renders_tool_calls_and_thinking(qwen: tuple[Tokenizer, ChatTemplate]) -> None:
    _, template = qwen
    text = template.render(TOOL_ROUND, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\n" in text
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in text  # tojson keeps ü, <, & as is
    no_think = template.render(TWO_TURNS, add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_continue_final_message_matches_transformers(
    qwen: tuple[Tokenizer, ChatTemplate], qwen_ref: Any
) -> None:
    messages = [*TWO_TURNS, {"role": "assistant", "content": "Sure, in Tokyo it is "}]
    ours = qwen[1].render(messages, continue_final_message=True)
    theirs = qwen_ref.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours == theirs
    assert ours.endswith("Sure, in Tokyo it is ")


def test_bos_and_raise_exception_match_transformers(tmp_path: Path) -> None:
    path = write_model_dir(
        tmp_path, config={"chat_template": BOS_TEMPLATE, "bos_token": "<s>"}, bos="<s>"
    )
    ref = reference_tokenizer(path)
    tokenizer = Tokenizer.from_artifact(DirTexts(path))
    template = ChatTemplate.from_artifact(DirTexts(path), tokenizer.special_tokens)
    assert template is not None
    chat = [m for m in TWO_TURNS if m["role"] != "system"]
    ours = template.render(chat, add_generation_prompt=True)
    assert ours == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<s>[USER] What's the weather in Paris?\n")
    assert "Let me look that up for you.<|im_end|>" in ours
    with pytest.raises(ChatTemplateError, match=r"Only user and assistant roles.*got system"):
        template.render(TWO_TURNS)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ messages.append({'role': 'x'}) }}",  # the immutable sandbox: no mutating inputs
        "{% set ns = namespace(__class__=1) %}",
    ],
)
def test_sandbox_refuses_python_internals(source: str) -> None:
    template = ChatTemplate(source)
    with pytest.raises(ChatTemplateError, match="sandbox") as info:
        template.render([{"role": "user", "content": "hi"}])
    assert isinstance(info.value, NInferError)


def test_template_helpers() -> None:
    source = (
        "{{ strftime_now('%Y') | length }}|{{ {'b': '<ü>', 'a': 1} | tojson(sort_keys=True) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
        "{% endfor %}|{% generation %}kept{% endgeneration %}|{{ dict(x=1).x }}"
    )
    chat = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    assert ChatTemplate(source).render(chat) == '4|{"a": 1, "b": "<ü>"}|one|kept|1'


def test_none_values_dropped_and_reasoning_aliased() -> None:
    source = "{{ messages[0].content is defined }}/{{ messages[0].reasoning_content }}"
    chat = [{"role": "assistant", "content": None, "reasoning": "because"}]
    assert ChatTemplate(source).render(chat) == "False/because"


def test_bad_templates_are_one_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match=r"does not parse \(line 1\)"):
        ChatTemplate("{% for %}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="failed: TypeError"):
        ChatTemplate("{{ 1 + messages[0].content }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ChatTemplate("x").render([])


def test_named_templates_and_sources(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    write_model_dir(tmp_path / "list", config={"chat_template": named})
    template = ChatTemplate.from_artifact(DirTexts(tmp_path / "list"))
    assert template is not None
    chat = [{"role": "user", "content": "x"}]
    assert template.render(chat) == "D"
    assert template.render(chat, tools=[WEATHER_TOOL]) == "T"
    assert template.render(chat, template_name="tool_use") == "T"
    with pytest.raises(ChatTemplateError, match=r"no chat template named 'rag'.*default, tool_use"):
        template.render(chat, template_name="rag")
    # chat_template.jinja wins over tokenizer_config.json, as in transformers
    write_model_dir(
        tmp_path / "jinja",
        config={"chat_template": "config"},
        extra_files={"chat_template.jinja": "file"},
    )
    from_file = ChatTemplate.from_artifact(DirTexts(tmp_path / "jinja"))
    assert from_file is not None and from_file.render(chat) == "file"
    write_model_dir(tmp_path / "none")
    assert ChatTemplate.from_artifact(DirTexts(tmp_path / "none")) is None
    (tmp_path / "none" / "tokenizer_config.json").write_text("{nope", encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        ChatTemplate.from_artifact(DirTexts(tmp_path / "none"))
