"""Chat templates: the model's Jinja template rendered the way transformers renders it.

A template ships with the model and is untrusted code, so it runs in Jinja's immutable
sandbox. The environment is configured like transformers' (`trim_blocks`, `lstrip_blocks`,
`loopcontrols`, its `tojson`, `raise_exception`, `strftime_now`, a guarded `namespace`, the
`{% generation %}` tag), so the prompt a model sees here is byte for byte the one it saw
under transformers.

Unlike Jinja's sandbox alone, a render is bounded in time and memory as well
(`template_sandbox.RenderLimits`): a template that loops, repeats or computes without end
fails its request with a one-line `ChatTemplateError` instead of hanging the server.

One deliberate difference: reaching a Python-internal attribute (`''.__class__`) fails at
once instead of rendering as an empty string, since no honest template does it and a
silently altered prompt is worse than a clear error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from ninfer_core.errors import ModelLoadError, NInferError
from ninfer_core.plugin_types import Artifact
from ninfer_core.safe_json import JSONLimitError, loads_limited
from ninfer_core.text.template_sandbox import (
    BoundedSandbox,
    RenderLimits,
    TemplateLimitError,
    render_bounded,
)
from ninfer_core.text.tokenizer import SpecialTokens

#: Names a message's reasoning arrives under; templates read the first (transformers aliases).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(NInferError):
    """The chat template could not render this conversation (a bad template or bad input)."""


# -- the sandboxed environment ------------------------------------------------------------


class _Sandbox(BoundedSandbox):
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        kind = type(obj).__name__
        raise SecurityError(
            f"access to attribute {attribute!r} of a {kind!r} object is not allowed"
        )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering keeps its body unchanged, and templates that use it must still parse."""

    tags = {"generation"}  # noqa: RUF012 - Jinja's own class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """A `namespace()` that refuses underscore names, which could shadow internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: self in args
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & for HTML; models were trained on plain json.dumps
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    if len(fmt) > 256:  # each directive can expand ~10x; real formats are a few characters
        raise TemplateLimitError(f"a strftime format of {len(fmt):,} characters")
    return datetime.now().strftime(fmt)


def make_environment(limits: RenderLimits | None = None) -> BoundedSandbox:
    """The sandbox chat templates run in, set up as transformers sets up its own, within
    `limits` of time and memory per render (`template_sandbox.py`)."""
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        limits=limits,
    )
    env.filters["tojson"] = env.bounded_filter("tojson", _tojson)
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_Namespace,
    )
    return env


# -- what the template is allowed to see --------------------------------------------------


def _plain(value: Any) -> Any:
    """Copy `value` as plain JSON-like data; anything else becomes an inert `<TypeName>`,
    so no object method the sandbox does not know about reaches the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value] if isinstance(value, list) else tuple(map(_plain, value))
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys (`content: null` trips templates) and alias reasoning fields."""
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"a chat message must be a mapping, got {type(message).__name__}"
            )
        msg = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        prepared.append(msg)
    return prepared


def _tag_final_message(messages: list[dict[str, Any]]) -> str:
    """Mark the end of the last message's text so the render can be cut there."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, str):
        messages[-1]["content"] = content + _CONTINUE_TAG
        return content
    for block in reversed(content if isinstance(content, list) else []):
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            text = block["text"]
            block["text"] = text + _CONTINUE_TAG
            return text
    raise ChatTemplateError("continue_final_message needs a final message with text to continue")


def _cut_at_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in rendered or final_text.strip() not in rendered:
        raise ChatTemplateError(
            "the chat template dropped the final message it was asked to continue"
        )
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()  # the template trimmed the message's trailing space


# -- the template -------------------------------------------------------------------------


class ChatTemplate:
    """One model's chat template(s), compiled on first use."""

    def __init__(
        self,
        templates: str | Mapping[str, str],
        special_tokens: SpecialTokens | Mapping[str, str] | None = None,
        limits: RenderLimits | None = None,
    ) -> None:
        #: name -> template source; a single template is named "default"
        self.templates = {"default": templates} if isinstance(templates, str) else dict(templates)
        if isinstance(special_tokens, SpecialTokens):
            special_tokens = special_tokens.template_vars()
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.limits = limits or RenderLimits()
        self._env = make_environment(self.limits)
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_artifact(
        cls, artifact: Artifact, special_tokens: SpecialTokens | Mapping[str, str] | None = None
    ) -> ChatTemplate | None:
        """The template from `chat_template.jinja`, else `tokenizer_config.json`'s
        `chat_template` (a string or a list of `{name, template}`), else `chat_template.json`;
        None when the model has none."""
        where = str(getattr(artifact, "path", "the model"))
        if (text := artifact.read_text("chat_template.jinja")) is not None:
            return cls(text, special_tokens)
        for name in ("tokenizer_config.json", "chat_template.json"):
            raw = artifact.read_text(name)
            try:
                value = loads_limited(raw).get("chat_template") if raw is not None else None
            except (ValueError, AttributeError) as exc:  # bad JSON, too deep, not an object
                detail = f" ({exc})" if isinstance(exc, JSONLimitError) else ""
                raise ModelLoadError(
                    f"{name} in {where} is not a valid JSON object{detail}"
                ) from None
            if isinstance(value, str):
                return cls(value, special_tokens)
            if isinstance(value, list):
                try:
                    named = {t["name"]: t["template"] for t in value}
                except (TypeError, KeyError):
                    raise ModelLoadError(
                        f"{name} in {where}: chat_template list entries need 'name' and 'template'"
                    ) from None
                return cls(named, special_tokens)
        return None

    def select(self, name: str | None = None, has_tools: bool = False) -> str:
        """Which template to use: the one named, else `tool_use` when tools are given and
        the model has one, else `default` (transformers' rule)."""
        if name is None:
            name = "tool_use" if has_tools and "tool_use" in self.templates else "default"
        if name not in self.templates:
            known = ", ".join(sorted(self.templates))
            raise ChatTemplateError(f"no chat template named {name!r}; this model has: {known}")
        return name

    def _compile(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            try:
                self._compiled[name] = self._env.from_string(self.templates[name])
            except TemplateSyntaxError as exc:
                raise ChatTemplateError(
                    f"chat template {name!r} does not parse (line {exc.lineno}): {exc.message}"
                ) from None
            except TemplateLimitError as exc:
                raise ChatTemplateError(f"chat template {name!r} is refused: {exc}") from None
            except Exception as exc:  # a parser recursing too deep, a compile-time fold
                raise ChatTemplateError(
                    f"chat template {name!r} does not compile: {type(exc).__name__}: {exc}"
                ) from None
        return self._compiled[name]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        template_name: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, like transformers'
        `apply_chat_template(..., tokenize=False)`.

        `kwargs` reach the template as variables (`enable_thinking=False`, ...) and win
        over the special-token variables (`bos_token`, `eos_token`) of the same name.
        `continue_final_message` leaves the last message open for the model to continue
        (an assistant prefill).
        """
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be set"
            )
        name = self.select(template_name, has_tools=tools is not None)
        template = self._compile(name)
        chat = _prepare_messages(messages)
        final_text = _tag_final_message(chat) if continue_final_message else None
        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            rendered = render_bounded(
                template,
                self.limits,
                dict(
                    messages=chat,
                    tools=_plain(list(tools)) if tools is not None else None,
                    documents=_plain(list(documents)) if documents is not None else None,
                    add_generation_prompt=add_generation_prompt,
                    **variables,
                ),
            )
        except TemplateLimitError as exc:
            raise ChatTemplateError(f"chat template {name!r} was stopped: {exc}") from None
        except SecurityError as exc:
            raise ChatTemplateError(
                f"chat template {name!r} was refused by the sandbox: {exc}"
            ) from None
        except TemplateError as exc:  # raise_exception() lands here with the template's words
            raise ChatTemplateError(
                f"chat template {name!r} rejected the conversation: {exc}"
            ) from None
        except Exception as exc:  # untrusted code: any failure is the template's or the input's
            raise ChatTemplateError(
                f"chat template {name!r} failed: {type(exc).__name__}: {exc}"
            ) from None
        return rendered if final_text is None else _cut_at_tag(rendered, final_text)
