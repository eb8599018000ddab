"""What chat and completions share: the model check, the generation request, usage (with
the `spec_stats` extension), and the stream's framing."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request
from litestar.response import ServerSentEvent
from msgspec import UNSET, UnsetType

from ninfer_core.engine.request import (
    FinishEvent,
    GenerationEvent,
    GenerationRequest,
    TokenEvent,
)
from ninfer_core.engine.request import Usage as EngineUsage
from ninfer_core.sampling import MAX_TOP_LOGPROBS, TokenLogprobs
from ninfer_core.sampling.grammar import Constraint
from ninfer_core.serve.cache_salt import cache_salt, tenant
from ninfer_core.serve.errors import ApiError, invalid
from ninfer_core.serve.limits import until_disconnect
from ninfer_core.serve.state import ServeState
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.errors import error_body

#: Stop strings are checked against every new piece of text: their number and length are
#: bounded so that one request cannot slow every other one's decode. No real client comes
#: near these (OpenAI's own API takes 4); the Anthropic frontend applies the same caps.
MAX_STOPS = 64
MAX_STOP_CHARS = 256
#: The most choices a request may ask for (`n`) before the server's own limit, its
#: `--max-concurrency` (the `n` completions decode at once), is checked.
MAX_CHOICES = 128
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def check_model(state: ServeState, model: str | None) -> str:
    """The model the request is for: the served one when it names none (as vLLM and
    llama.cpp take it) or one of `--model-aliases`; naming another is a 404."""
    if model is None or state.options.serves(model):
        return state.options.model_id
    raise ApiError(
        404,
        "not_found",
        f"the model {model!r} does not exist; this server serves {state.options.model_id!r}",
        param="model",
    )


def refuse(param: str, why: str) -> ApiError:
    return invalid(f"{param}: {why}", param=param)


def refuse_unsupported(data: wire.SamplingFields) -> None:
    """Options this server cannot honour are refused rather than quietly ignored."""
    if data.n is not None and not 1 <= data.n <= MAX_CHOICES:
        raise refuse("n", f"must be in 1..{MAX_CHOICES}, got {data.n}")
    if data.logit_bias:
        raise refuse("logit_bias", "not supported by this server")
    stop_strings(data.stop)  # checked before the prompt is rendered: 100k stops cost nothing


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise refuse("stop", f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise refuse("stop", "stop sequences must not be empty")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise refuse(
            "stop", f"a stop sequence has at most {MAX_STOP_CHARS} characters, got {longest}"
        )
    return stops


def check_ids(state: ServeState, ids: list[int], param: str, *, empty: str) -> list[int]:
    """A prompt given as token ids, copied; a 400 naming `param` when it is empty (`empty`:
    the message) or holds an id outside the vocabulary."""
    if not ids:
        raise refuse(param, empty)
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise refuse(param, f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    return list(ids)


def generation_request(
    state: ServeState,
    data: wire.SamplingFields,
    prompt_ids: list[int],
    max_tokens: int | None,
    *,
    scope: Mapping[str, Any],
    prompt_param: str = "messages",
    logprobs: int | None = None,
    constraint: Constraint | None = None,
) -> GenerationRequest:
    """The engine request: sampling over the server's defaults, the budget within the
    context, stops, the prefix-cache salt (from the request's ASGI `scope` and its
    `cache_salt`), `min_tokens`, and `logprobs` (alternatives per token, None: none);
    every invalid value a 400 naming its field (`prompt_param`: the field that carried
    the prompt). `data.n` > 1 asks for that many choices of the one prompt
    (`engine/fanout.py`), at most what the server decodes at once."""
    n = data.n or 1
    stops = stop_strings(data.stop)
    limit = state.engine.config.max_concurrency
    if n > limit:
        raise refuse("n", f"{n} choices is more than this server decodes at once ({limit})")
    params = state.sampling(**{name: getattr(data, name) for name in SAMPLING})
    budget = state.max_tokens(max_tokens, len(prompt_ids), prompt_param=prompt_param)
    least = min_tokens(data.min_tokens, budget)
    return GenerationRequest(
        prompt_ids,
        params,
        max_tokens=budget,
        stop=stops,
        ignore_eos=data.ignore_eos,
        cache_salt=cache_salt(scope, data.cache_salt),
        tenant=tenant(scope),
        priority=data.priority,
        logprobs=logprobs,
        min_tokens=least,
        constraint=constraint,
        n=n,
    )


def min_tokens(value: int | None, budget: int) -> int:
    """vLLM's `min_tokens`: 0 .. the request's token budget, else a 400 naming it."""
    if value is None:
        return 0
    if value < 0:
        raise refuse("min_tokens", f"must be at least 0, got {value}")
    if value > budget:
        raise refuse("min_tokens", f"{value} is more than the token budget ({budget})")
    return value


@dataclass(frozen=True)
class StreamExtras:
    """What a stream sends beyond the text: a usage chunk (`stream_options.include_usage`)
    and the request's `spec_stats` (`return_spec_stats`), in that usage chunk when there is
    one, else on the finish chunk, so a client gets them without asking for usage too."""

    include_usage: bool = False
    spec_stats: bool = False

    @classmethod
    def asked(cls, data: wire.SamplingFields) -> StreamExtras:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return cls(include_usage, data.return_spec_stats)

    def on_finish(self, u: EngineUsage) -> wire.SpecStats | UnsetType:
        """`spec_stats` for the finish chunk: only when no usage chunk follows."""
        return UNSET if self.include_usage else spec_stats(u, self.spec_stats)

    def usage_chunk(self, u: EngineUsage) -> wire.Usage | None:
        """The last chunk's usage, or None when the client did not ask for that chunk."""
        return usage(u, with_spec=self.spec_stats) if self.include_usage else None


def spec_stats(u: EngineUsage, asked: bool) -> wire.SpecStats | UnsetType:
    """The request's speculative rounds when it asked (`return_spec_stats`) and the engine
    speculates; else `UNSET`, which leaves the field out rather than sending a null that
    would read as "asked, nothing to say"."""
    if not asked or u.spec is None:
        return UNSET
    return msgspec.convert(u.spec.to_json(), wire.SpecStats)


def usage(u: EngineUsage, *, with_spec: bool = False) -> wire.Usage:
    """OpenAI's usage; with `with_spec` (the request's `return_spec_stats`) also
    `spec_stats`, as usage is where a response accounts for its own request."""
    return wire.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details=wire.PromptTokensDetails(cached_tokens=u.cached_tokens),
        spec_stats=spec_stats(u, with_spec),
    )


async def collect(
    events: AsyncIterator[GenerationEvent],
    feed: Callable[[str], Any],
    tokens: TokenLog | None = None,
) -> FinishEvent:
    """Run a generation to its end, handing each text delta to `feed` (and each event's
    token ids and log probabilities to `tokens`)."""
    async for event in events:
        if isinstance(event, FinishEvent):
            return event
        feed(event.text)
        if tokens is not None:
            tokens.add(event)
    raise RuntimeError("the generation ended without a finish event")


@dataclass
class TokenLog:
    """Token ids and log probabilities gathered from events, handed out in pieces: a
    stream puts what it holds on the next chunk it sends (`take`), so the chunks' pieces
    joined are the whole answer's, whatever text the parser held back meanwhile."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, event: TokenEvent) -> None:
        self.ids.extend(event.token_ids)
        if event.logprobs:
            self.logprobs.extend(event.logprobs)

    def take(self) -> TokenLog:
        taken = TokenLog(self.ids, self.logprobs)
        self.ids, self.logprobs = [], []
        return taken


def logprobs_asked(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """Chat's `logprobs` / `top_logprobs` as the engine's count of alternatives (None: no
    log probabilities); OpenAI's rules: `top_logprobs` in 0..20 and only with `logprobs`."""
    if top_logprobs is not None:
        if not logprobs:
            raise refuse("top_logprobs", "requires logprobs: true")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise refuse("top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}")
    return (top_logprobs or 0) if logprobs else None


async def first_event(request: Request, events: AsyncIterator[GenerationEvent]) -> GenerationEvent:
    """Wait for a stream's first event before answering 200, so that an overload or a queue
    timeout still gets its own status; a client leaving meanwhile cancels the request."""
    try:
        return await until_disconnect(request, anext(events))
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise


def sse(chunks: AsyncIterator[str]) -> ServerSentEvent:
    """OpenAI's framing: one JSON object per `data:` line, then `data: [DONE]`; an error after
    the stream started goes out as an `{"error": ...}` object, which the SDK raises."""

    async def framed() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except ApiError as exc:
            yield msgspec.json.encode(error_body(exc)).decode()
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        yield "[DONE]"

    return ServerSentEvent(framed())
