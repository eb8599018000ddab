"""`POST /v1/messages/count_tokens`: the prompt's length, rendered exactly as a request is.

Agents call this to decide when to compact a conversation, so it must count what
`/v1/messages` would feed the model — same conversion, same template, same tokenizer —
not an estimate.
"""

from __future__ import annotations

import asyncio

from litestar import post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from ninfer_plugins.frontend_anthropic import convert
from ninfer_plugins.frontend_anthropic.context import Context
from ninfer_plugins.frontend_anthropic.wire import CountTokensRequest


@post("/messages/count_tokens", status_code=200, summary="Count a message's input tokens")
async def count_tokens(
    data: JSONBody[CountTokensRequest], anthropic: NamedDependency[Context]
) -> dict[str, int]:
    anthropic.check_model(data.model)
    prompt = convert.to_prompt(data)
    # Counted whole: a client asks in order to learn how far over the context it is.
    ids = await asyncio.to_thread(convert.render, anthropic.state, prompt, whole=True)
    return {"input_tokens": len(ids)}
