"""The two routes. Kept apart from `__init__` so that litestar is imported only when a server
builds its routes, never when `ninfer generate` or `ninfer probe` load the plugin host."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import post
from litestar.params import JSONBody

from ninfer_core.serve.errors import ApiError
from ninfer_core.serve.state import ServeState


class TokenizeRequest(msgspec.Struct):
    """Other llama.cpp fields (`with_pieces`) are accepted and ignored."""

    content: str
    #: llama.cpp's name: add what the tokenizer's post-processor adds (a bos) or not.
    add_special: bool = False


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    content: str


def route_handlers(state: ServeState) -> list[Any]:
    """The handlers, closed over `state`; the server registers them once the model is loaded."""

    # `sync_to_thread=True`: a long text takes a while to encode, and must not stall the
    # event loop that streams other requests' tokens.
    @post("/tokenize", sync_to_thread=True, status_code=200, summary="Text to token ids")
    def tokenize(data: JSONBody[TokenizeRequest]) -> TokenizeResponse:
        # `encode_prompt` refuses (400, naming `content`) a text longer than the context,
        # without tokenizing all of it first.
        ids = state.encode_prompt(
            data.content, add_special_tokens=data.add_special, param="content"
        )
        return TokenizeResponse(ids)

    @post("/detokenize", sync_to_thread=True, status_code=200, summary="Token ids to text")
    def detokenize(data: JSONBody[DetokenizeRequest]) -> DetokenizeResponse:
        vocab = state.tokenizer.vocab_size
        bad = next((t for t in data.tokens if not 0 <= t < vocab), None)
        if bad is not None:  # the tokenizer would fail or invent text for it
            raise ApiError(
                400, "invalid_request", f"token id {bad} is outside [0, {vocab})", param="tokens"
            )
        return DetokenizeResponse(state.tokenizer.decode(data.tokens))

    return [tokenize, detokenize]
