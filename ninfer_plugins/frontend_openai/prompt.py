"""A chat request made ready for the engine: its prompt ids and the parser of its answer.

Chat completions and the Responses API (`frontend_responses`) build the same prompt for the
same conversation, so that both endpoints answer alike; this is that one place. A forced
`tool_choice` ("required", a named function) prefills the answer with the opening of the
model's call form: the prompt ends with it and the `ChatOutput` has read it already, so the
call parses whole.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ninfer_core.serve.state import ServeState
from ninfer_core.text.tool_choice import call_opening, with_opening
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.conversation import (
    continuation,
    forced_call,
    template_kwargs,
    template_messages,
    template_tools,
)
from ninfer_plugins.frontend_openai.output import ChatOutput


def thinking_open(state: ServeState, prompt: list[int]) -> bool:
    """Whether the template opened a `<think>` block the answer starts inside."""
    return state.tokenizer.decode(prompt[-4:]).rstrip().endswith("<think>")


@dataclass
class ChatPrompt:
    ids: list[int]
    #: Reads the answer: reasoning, content and (when the request parses them) tool calls.
    output: ChatOutput
    #: The tools as the template saw them (None: no tools).
    tools: list[dict] | None


async def chat_prompt(state: ServeState, data: wire.ChatCompletionRequest) -> ChatPrompt:
    """The prompt of a chat request; every invalid part a 400 naming its field."""
    messages = template_messages(data.messages)
    tools, parse_tools = template_tools(data)
    kwargs = template_kwargs(data)
    opening = call_opening(state.template, forced_call(data))
    kwargs.update(continuation(data))

    def build() -> list[int]:
        return with_opening(state.tokenizer, state.render(messages, tools, **kwargs), opening)

    # Rendering and tokenizing a long conversation takes a while: off the event loop, so
    # /health and the other streams keep going meanwhile.
    ids = await asyncio.to_thread(build)
    output = ChatOutput(tools if parse_tools else None, thinking_open=thinking_open(state, ids))
    output.feed(opening)  # the prefilled start of a forced call: held, nothing to send
    return ChatPrompt(ids, output, tools)
