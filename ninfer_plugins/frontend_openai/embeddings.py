"""`POST /v1/embeddings`: text (or token ids) in, one vector per input out, in OpenAI's shape.

Each input is one engine request with `pooling` set (`engine/pooling.py`): it waits in the
same queue and prefills in the same steps as the completions beside it, and ends with the
pooled, L2-normalised final hidden state of the decoder (`--pooling last`, the default, or
`mean`). There is no separate embedding head: the model is served as it is.

`input` is a string, a list of strings, a list of token ids, or a list of token-id lists
(OpenAI's four forms), at most `MAX_INPUTS` of them; text is encoded with the tokenizer's
special tokens as its tokenizer.json says (for Qwen3-Embedding that appends the
`<|endoftext|>` its last-token pooling reads). The inputs of one request are submitted
`--max-concurrency` at a time, so a large batch neither fills the queue nor waits on itself,
and together they hold at most `--max-embedding-tokens` (300,000 by default, OpenAI's
limit): the work one call may ask for is bounded, and while it runs the streams beside it
keep their share of the time (`engine/pacing.py`).
`encoding_format` is `float` (a list of numbers) or `base64` (the little-endian float32 bytes,
what the `openai` SDK asks for by default and decodes). `dimensions` is taken only when it is
the model's own width: these vectors are not trained to be truncated.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import torch
from litestar import Request, Response, post
from litestar.openapi import ResponseSpec
from litestar.params import JSONBody
from msgspec import Struct

from ninfer_core.engine.request import FinishEvent, GenerationRequest
from ninfer_core.serve.cache_salt import cache_salt, tenant
from ninfer_core.serve.errors import ApiError
from ninfer_core.serve.limits import until_disconnect
from ninfer_core.serve.state import ServeState
from ninfer_plugins.frontend_openai.common import check_ids, check_model, refuse

#: Inputs per request at most (OpenAI's own limit).
MAX_INPUTS = 2048


class EmbeddingRequest(Struct, kw_only=True):
    #: A string, strings, token ids or token-id lists (msgspec takes one array-like per union).
    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    #: Only requests with the same salt share prefix-cache blocks (as in completions).
    cache_salt: str | None = None


class Embedding(Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def input_ids(state: ServeState, given: str | list) -> list[list[int]]:
    """Every input's token ids; a 400 naming `input` for an empty, mixed, out-of-vocabulary
    or too long one. Slow for long texts: called in a worker thread."""
    if isinstance(given, str):
        given = [given]
    if not given:
        raise refuse("input", "no input given")
    if all(isinstance(x, int) for x in given):
        given = [given]
    if len(given) > MAX_INPUTS:
        raise refuse("input", f"at most {MAX_INPUTS} inputs per request, got {len(given)}")
    if all(isinstance(x, str) for x in given):
        if any(not text for text in given):
            raise refuse("input", "an input is empty")
        return [state.encode_prompt(t, add_special_tokens=True, param="input") for t in given]
    if not all(isinstance(x, list) for x in given):
        raise refuse("input", "inputs are all text or all token-id lists, not a mixture")
    checked = []
    for given_ids in given:
        ids = check_ids(state, given_ids, "input", empty="an input is empty")
        if len(ids) > state.max_context:
            raise ApiError(
                400,
                "context_length_exceeded",
                f"an input has {len(ids)} tokens; this model's context is "
                f"{state.max_context} tokens",
                param="input",
            )
        checked.append(ids)
    return checked


async def embed_one(state: ServeState, request: GenerationRequest) -> FinishEvent:
    async for event in state.generate(request):
        if isinstance(event, FinishEvent):
            return event
    raise RuntimeError("the embedding request ended without a finish event")


async def embed_all(
    state: ServeState, inputs: list[list[int]], salt: str | None, who: str | None = None
) -> list[FinishEvent]:
    """Each input's finish (its vector), `--max-concurrency` inputs at a time. One that
    fails cancels the others (a TaskGroup), so the request fails whole and frees its pages."""
    window = state.engine.config.max_concurrency
    done: list[FinishEvent] = []
    for at in range(0, len(inputs), window):
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(
                    embed_one(
                        state,
                        GenerationRequest(
                            ids, pooling=state.options.pooling, cache_salt=salt, tenant=who
                        ),
                    )
                )
                for ids in inputs[at : at + window]
            ]
        done.extend(task.result() for task in tasks)
    return done


def encode(vector: torch.Tensor, encoding: str) -> list[float] | str:
    if encoding == "base64":
        data = vector.to(torch.float32).numpy().astype("<f4").tobytes()
        return base64.b64encode(data).decode("ascii")
    return vector.tolist()


def route_handlers(state: ServeState) -> list:
    @post(
        ["/v1/embeddings", "/embeddings"],
        status_code=200,
        summary="Create embeddings",
        responses={200: ResponseSpec(EmbeddingList, description="one vector per input")},
    )
    async def embeddings(request: Request, data: JSONBody[EmbeddingRequest]) -> Response:
        model = check_model(state, data.model)
        width = state.engine.hidden_size
        if data.dimensions is not None and data.dimensions != width:
            raise refuse(
                "dimensions",
                f"this model's embeddings have {width} dimensions and are not trained to be "
                "shortened; leave dimensions out",
            )
        if data.cache_salt is not None and not data.cache_salt:
            raise refuse("cache_salt", "must be a non-empty string")
        inputs = await asyncio.to_thread(input_ids, state, data.input)
        total, limit = sum(map(len, inputs)), state.options.max_embedding_tokens
        if total > limit:
            raise refuse(
                "input",
                f"the inputs have {total} tokens together; one request may send at most "
                f"{limit} (--max-embedding-tokens): split them over several requests",
            )
        salt = cache_salt(request.scope, data.cache_salt)
        try:
            finishes = await until_disconnect(
                request, embed_all(state, inputs, salt, tenant(request.scope))
            )
        except ExceptionGroup as group:  # the TaskGroup's: answer with the first failure
            while isinstance(group, ExceptionGroup):
                group = group.exceptions[0]
            raise group from None
        items = [
            Embedding(i, encode(f.embedding, data.encoding_format)) for i, f in enumerate(finishes)
        ]
        tokens = sum(f.usage.prompt_tokens for f in finishes)
        return Response(EmbeddingList(items, model, EmbeddingUsage(tokens, tokens)))

    return [embeddings]
