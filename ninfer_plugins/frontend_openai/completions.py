"""`POST /v1/completions`: raw text (or token ids) in, its continuation out; no template.

One prompt per request (a list of one is accepted, as clients often send it). Text is
encoded with the tokenizer's special tokens (a BOS where the model has one); token ids are
taken as they are, once checked against the vocabulary.

`logprobs: k` (0..5, OpenAI's legacy range) gives each generated token's log probability
and its k most likely alternatives in the legacy shape; a stream's chunks carry the tokens
that arrived with their text. The prompt's own log probabilities (`echo` with `logprobs`)
are not computed: that combination is a 400.

`n` > 1 asks for several continuations of the prompt (`CompletionChoices`), served by the
same loop as one (`choices.py`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from litestar import Request, Response, post
from litestar.openapi import ResponseSpec
from litestar.params import JSONBody
from msgspec import UNSET, UnsetType

from ninfer_core.engine.request import FinishEvent, TokenEvent
from ninfer_core.serve.state import ServeState
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.choices import Choices, Head, reply
from ninfer_plugins.frontend_openai.common import (
    TokenLog,
    check_ids,
    check_model,
    generation_request,
    new_id,
    now,
    refuse,
    refuse_unsupported,
)
from ninfer_plugins.frontend_openai.constraints import request_constraint
from ninfer_plugins.frontend_openai.logprobs import CompletionLogprobs, token_texts

#: The most alternatives per token the legacy completions API takes (OpenAI's limit).
MAX_COMPLETION_LOGPROBS = 5


def prompt_ids(state: ServeState, prompt: str | list) -> tuple[list[int], str | None]:
    """(the prompt's ids, its text when it came as text)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise refuse("prompt", f"one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise refuse("prompt", "the prompt is empty")
        return state.encode_prompt(prompt, add_special_tokens=True, param="prompt"), prompt
    if not all(isinstance(t, int) for t in prompt):
        raise refuse("prompt", "a prompt is text or a list of token ids, not a mixture")
    return check_ids(state, prompt, "prompt", empty="the prompt is empty"), None


def finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def route_handlers(state: ServeState) -> list:
    @post(
        ["/v1/completions", "/completions"],
        status_code=200,
        summary="Create a text completion",
        responses={
            200: ResponseSpec(
                wire.Completion,
                description="the completion, or with "
                "stream=true an event stream of completion chunks",
            )
        },
    )
    async def completions(request: Request, data: JSONBody[wire.CompletionRequest]) -> Response:
        model = check_model(state, data.model)
        refuse_unsupported(data)
        if data.suffix:
            raise refuse("suffix", "insertion (suffix) is not supported by this server")
        if data.logprobs is not None:
            if not 0 <= data.logprobs <= MAX_COMPLETION_LOGPROBS:
                raise refuse(
                    "logprobs", f"must be in 0..{MAX_COMPLETION_LOGPROBS}, got {data.logprobs}"
                )
            if data.echo:
                raise refuse(
                    "logprobs", "the prompt's log probabilities (with echo) are not computed"
                )
        if data.best_of not in (None, 1):
            raise refuse("best_of", "only best_of=1 is supported")
        if data.best_of is not None and (data.n or 1) > 1:
            raise refuse("best_of", "n > 1 returns every choice; best_of is not taken with it")
        # Tokenizing a long text takes a while: off the event loop.
        ids, text = await asyncio.to_thread(prompt_ids, state, data.prompt)
        constraint = await request_constraint(state, data, data.response_format)
        gen = generation_request(
            state,
            data,
            ids,
            data.max_tokens,
            scope=request.scope,
            prompt_param="prompt",
            logprobs=data.logprobs,
            constraint=constraint,
        )
        echo = (text if text is not None else state.tokenizer.decode(ids)) if data.echo else ""
        events = state.generate(gen)
        head = Head(new_id("cmpl"), now(), model)
        extras = ChoiceExtras(
            None if data.logprobs is None else CompletionLogprobs(token_texts(state.tokenizer)),
            ids if data.return_token_ids else None,
        )
        return await reply(request, data, events, CompletionChoices(head, gen.n, echo, extras))

    return [completions]


@dataclass
class ChoiceExtras:
    """A choice's log probabilities (`logprobs` set) and vLLM's `return_token_ids`
    (`prompt_ids` set; the prompt's ids go on the first choice piece only)."""

    logprobs: CompletionLogprobs | None = None
    prompt_ids: list[int] | None = None

    @property
    def asked(self) -> bool:
        """Whether a chunk goes out for tokens whose text is held back (it has their ids)."""
        return self.logprobs is not None or self.prompt_ids is not None

    def own(self) -> ChoiceExtras:
        """A copy for one choice: its own log-probability offsets, the prompt's ids shared."""
        lp = self.logprobs
        return ChoiceExtras(
            None if lp is None else CompletionLogprobs(lp.texts, lp.offset), self.prompt_ids
        )

    def fill(self, choice: wire.CompletionChoice, log: TokenLog, *, first: bool) -> None:
        if self.logprobs is not None:
            choice.logprobs = self.logprobs.take(log.logprobs)
        if self.prompt_ids is not None:
            choice.token_ids = log.ids
            if first:
                choice.prompt_token_ids = self.prompt_ids


class CompletionChoices(Choices):
    """A completions request's choices: each its text (the echoed prompt first), token log
    and log-probability offsets; the prompt's ids go on each choice's first piece."""

    def __init__(self, head: Head, n: int, echo: str, extras: ChoiceExtras) -> None:
        super().__init__(head, n)
        self.echo = echo
        self.extras = [extras.own() for _ in range(n)]
        self.texts = [[echo] for _ in range(n)]
        self.logs = [TokenLog() for _ in range(n)]
        self.sent = [False] * n

    def record(self, event: TokenEvent) -> None:
        self.texts[event.index].append(event.text)
        self.logs[event.index].add(event)

    # -- a stream ------------------------------------------------------------------------

    def opening(self) -> list[str]:
        return [self._chunk(index, self.echo) for index in range(self.n)] if self.echo else []

    def token(self, event: TokenEvent) -> list[str]:
        self.logs[event.index].add(event)
        if event.text or self.extras[event.index].asked:
            return [self._chunk(event.index, event.text)]
        return []

    def finish(self, event: FinishEvent, stats: wire.SpecStats | UnsetType) -> list[str]:
        return [self._chunk(event.index, "", finish_reason(event.reason), stats)]

    def usage_chunk(self, spent: wire.Usage) -> str:
        return wire.encode(wire.Completion(*self.head, [], spent))

    def _chunk(
        self,
        index: int,
        text: str,
        reason: str | None = None,
        stats: wire.SpecStats | UnsetType = UNSET,
    ) -> str:
        choice = wire.CompletionChoice(index, text, reason)
        self.extras[index].fill(choice, self.logs[index].take(), first=not self.sent[index])
        self.sent[index] = True
        return wire.encode(wire.Completion(*self.head, [choice], spec_stats=stats))

    # -- a whole answer ------------------------------------------------------------------

    def answer(self, finishes: list[FinishEvent], spent: wire.Usage) -> wire.Completion:
        choices = []
        for finish in finishes:
            i = finish.index
            choice = wire.CompletionChoice(i, "".join(self.texts[i]), finish_reason(finish.reason))
            self.extras[i].fill(choice, self.logs[i], first=True)
            choices.append(choice)
        return wire.Completion(*self.head, choices, spent)
