"""`Postprocessor`: the third verb of a step, from a forward's logits to each request's tokens.

It samples the rows of the sequences that want a token (after `min_tokens` and grammar masks),
computes the log probabilities a request asked for, verifies speculative rounds, folds
embedding requests' hidden states into their poolers, and hands each token to its request.
Everything here runs under the engine's lock, so it may touch the block manager and the
request table; ending a request is the engine's (`Engine._end`), handed in as `end`, so the
bookkeeping of an ending stays in one place. A fault is pinned on its own request: a row, a
token or a text step that fails ends only the request it belongs to (`fail`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.constraints import (
    GrammarFailed,
    advance,
    mask_grammar,
    mask_round_grammar,
)
from ninfer_core.engine.faults import unusable_rows
from ninfer_core.engine.model_runner import StepForward
from ninfer_core.engine.request import EngineError, EngineStepError, FinishReason, RequestState
from ninfer_core.engine.sequence import Sequence, SequenceStatus
from ninfer_core.engine.speculation import Round, RowChooser, settle_state, verify
from ninfer_core.engine.token_extras import (
    batch_logprobs,
    mask_min_tokens,
    mask_round,
    round_acceptor,
)
from ninfer_core.sampling import Sampler, TokenLogprobs
from ninfer_core.sampling.grammar import GrammarCompiler
from ninfer_core.spec.stats import SpecCounters
from ninfer_core.text import Tokenizer

if TYPE_CHECKING:
    from ninfer_core.kv.state import SequenceStatePool

log = logging.getLogger(__name__)


class EndRequest(Protocol):
    """`Engine._end`: take a request out of the scheduler and the tables, and queue its
    finish event."""

    def __call__(
        self,
        live: RequestState,
        reason: FinishReason,
        events: list,
        *,
        error: EngineError | None = None,
        matched: str | int | None = None,
        embedding: torch.Tensor | None = None,
    ) -> None: ...


class Postprocessor:
    """Turns one forward's output into tokens and events for the requests that ran; the
    engine owns one and calls `pool` and `run` after each forward."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        vocab_size: int,
        model_stop_ids: tuple[int, ...],
        sampler: Sampler,
        block_manager: BlockManager,
        states: SequenceStatePool | None,
        spec_counters: SpecCounters,
        by_seq: dict[int, RequestState],
        end: EndRequest,
        forked: Callable[[RequestState, list], list[RequestState]],
    ) -> None:
        self.tokenizer, self.vocab_size, self.model_stop_ids = tokenizer, vocab_size, model_stop_ids
        self.sampler, self.block_manager, self.states = sampler, block_manager, states
        self.spec_counters = spec_counters
        #: The engine's table (shared, not copied): a sequence's id -> its request.
        self._by_seq = by_seq
        self._end, self._forked = end, forked
        self._grammars: GrammarCompiler | None = None

    def run(
        self,
        batch: list[tuple[Sequence, int]],
        logits: torch.Tensor,
        events: list,
        accepted: dict[int, int],
    ) -> None:
        """Sample the next token of each sequence whose prompt is done (all `n` of a forked
        one) and verify each speculative round, recording in `accepted` how many drafts of
        each sequence were kept (the drafter learns it); `logits` has one row per token run."""
        rows: list[int] = []
        lives: list[RequestState] = []
        rounds: list[tuple[RequestState, Round, torch.Tensor]] = []
        end = 0
        for seq, _ in batch:
            first, end = end, end + 1 + len(seq.draft_ids)
            if seq.status is not SequenceStatus.RUNNING:
                continue  # cancelled while it ran
            if seq.draft_ids:  # its rows verify drafts: accepted token by token below
                rounds.append((self._by_seq[seq.seq_id], Round.take(seq), logits[first:end]))
                continue
            self.block_manager.commit(seq)
            if seq.num_pending_tokens == 0:  # prompt done or a decode: sample its next token
                for live in self._forked(self._by_seq[seq.seq_id], events):  # n > 1: all n
                    rows.append(first)
                    lives.append(live)
        for live, round_, verify_rows in rounds:
            accepted[live.seq.seq_id] = self._verify(live, round_, verify_rows, events)
        if not rows:
            return
        if rows != list(range(logits.shape[0])):  # a decode step samples every row: no copy
            logits = logits[rows]
        # Per sequence from here: a row, a token or a text step that fails ends its own request.
        keep = []
        for j, (live, dead) in enumerate(zip(lives, unusable_rows(logits), strict=True)):
            if dead:
                self.fail(live, "the model's logits for this request hold no finite value", events)
            else:
                keep.append(j)
        if len(keep) < len(lives):
            lives, logits = [lives[j] for j in keep], logits[keep]
        tokens = self._sample(self._masked(logits, lives, events), lives, events)
        logprobs = self._logprobs(logits, lives, tokens, events)
        for live, token, lp in zip(lives, tokens, logprobs, strict=True):
            if token is None:
                continue
            if not 0 <= token < self.vocab_size:
                self.fail(
                    live, f"sampled token id {token} is outside [0, {self.vocab_size})", events
                )
                continue
            try:
                self.accept(live, token, events, lp)
            except GrammarFailed as exc:
                self.refuse(live, exc, events)
            except Exception as exc:
                log.exception("postprocessing request %s failed", live.request_id)
                self.fail(live, f"{type(exc).__name__}: {exc}", events)

    def pool(self, batch: list[tuple[Sequence, int]], output: StepForward, events: list) -> None:
        """Fold each embedding request's rows of the step into its pooler, and end those
        whose prompt is done with their vector (`engine/pooling.py`); they sample nothing.
        A failure ends only its own request."""
        offset = 0
        for seq, n in batch:
            start, offset = offset, offset + n  # n counts its drafts, if any
            if not seq.embedding or seq.status is not SequenceStatus.RUNNING:
                continue
            live = self._by_seq[seq.seq_id]
            try:
                if output.hidden is None:
                    raise RuntimeError("the step kept no hidden states")
                live.pooler.feed(output.hidden[start : start + n])
                if seq.num_pending_tokens == 0:
                    self.block_manager.commit(seq)  # its full blocks serve later prompts
                    self._end(live, "stop", events, embedding=live.pooler.result())
            except Exception as exc:
                log.exception("pooling request %s failed", live.request_id)
                self.fail(live, f"pooling: {type(exc).__name__}: {exc}", events)

    def _verify(self, live: RequestState, round_: Round, rows: torch.Tensor, events: list) -> int:
        """Accept what the target agrees with of one sequence's drafts (`speculation.py`);
        returns the drafts accepted. A failure ends only this request.

        On a model with state, the state and computed count are at the forward's start
        (`rewind_states`) and stay there while the round is verified; a fully accepted
        round makes the step's state current and only then commits its blocks, a rejected
        one is replayed by the next step (`settle_state`)."""
        seq = live.seq
        if any(unusable_rows(rows)):
            self.fail(live, "the model's logits for this request hold no finite value", events)
            return 0
        try:
            masked = mask_round_grammar(
                mask_round(rows, live), live, round_.drafts, self._grammars_if(live)
            )
            chooser = RowChooser(self.sampler, live, round_, masked)
            accepted = verify(
                seq, round_, chooser,
                round_acceptor(live, rows, lambda t, lp: self.accept(live, t, events, lp)),
                self._advance(seq), live.spec,
            )  # fmt: skip
        except GrammarFailed as exc:
            self.refuse(live, exc, events)
            return 0
        except Exception as exc:
            log.exception("verifying the drafts of request %s failed", live.request_id)
            self.fail(live, f"{type(exc).__name__}: {exc}", events)
            return 0
        self.spec_counters.record(len(round_.drafts), accepted)
        states = self.states
        running = seq.status is SequenceStatus.RUNNING
        if states is not None and running and settle_state(states, seq, round_, accepted):
            self.block_manager.commit(seq)
        return accepted

    def _advance(self, seq: Sequence) -> Callable[[int], None]:
        """What `verify` does before each token: cover the tokens before it with the
        computed count and index the blocks that became full. Nothing on a model with
        state: a page a replay writes again must never be indexed, and the computed count
        stays with the state at the forward's start until the round is settled."""
        if self.states is not None:
            return lambda n: None

        def advance(n: int) -> None:
            seq.num_computed_tokens = n
            self.block_manager.commit(seq)

        return advance

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles requests' constraints for this model's vocabulary (made on first use:
        an engine that never sees a constraint never builds the tokenizer trie)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.model_stop_ids)
        return self._grammars

    def _grammars_if(self, live: RequestState) -> GrammarCompiler | None:
        return self.grammars if live.request.constraint is not None else None

    def _masked(
        self, logits: torch.Tensor, lives: list[RequestState], events: list
    ) -> torch.Tensor:
        """The step's rows with `min_tokens` and the grammars applied; a grammar that fails
        ends its own request (its row is left as it is; its token is then dropped)."""
        logits = mask_min_tokens(logits, lives)
        if not any(live.request.constraint is not None for live in lives):
            return logits
        try:
            return mask_grammar(logits, lives, self.grammars)
        except GrammarFailed:
            pass  # a request's own grammar: found and ended row by row below
        except Exception:
            log.exception("masking the batch by its grammars failed; masking row by row")
        rows = []
        for j, live in enumerate(lives):
            try:
                rows.append(mask_grammar(logits[j : j + 1], [live], self.grammars))
            except GrammarFailed as exc:
                self.refuse(live, exc, events)
                rows.append(logits[j : j + 1])
            except Exception as exc:
                self.fail(live, f"the grammar failed: {type(exc).__name__}: {exc}", events)
                rows.append(logits[j : j + 1])
        return torch.cat(rows)

    def _sample(self, logits: torch.Tensor, lives: list[RequestState], events: list) -> list:
        """One token per row (None where its request ended): the batch in one call, and if
        that raises, row by row, so that only the rows that fail alone end their request."""
        if not lives:
            return []
        params = [live.request.params for live in lives]
        histories = [live.history for live in lives]
        try:
            return self.sampler.sample(logits, params, histories).tolist()
        except Exception:
            log.exception("sampling the batch failed; sampling its rows one by one")
        tokens: list[int | None] = []
        for j, live in enumerate(lives):
            try:
                row = self.sampler.sample(
                    logits[j : j + 1], params[j : j + 1], histories[j : j + 1]
                )
                tokens.append(int(row[0]))
            except Exception as exc:
                self.fail(live, f"sampling failed: {type(exc).__name__}: {exc}", events)
                tokens.append(None)
        return tokens

    def _logprobs(
        self, logits: torch.Tensor, lives: list[RequestState], tokens: list, events: list
    ) -> list[TokenLogprobs | None]:
        """The sampled tokens' log probabilities, for the requests that ask (`logprobs`);
        if that fails, the requests that asked end (their token set to None), the rest go on."""
        valid = [t if t is not None and 0 <= t < self.vocab_size else None for t in tokens]
        try:
            return batch_logprobs(logits, lives, valid)
        except Exception as exc:
            log.exception("computing log probabilities failed")
            for j, live in enumerate(lives):
                if live.request.logprobs is not None and tokens[j] is not None:
                    self.fail(live, f"log probabilities: {type(exc).__name__}: {exc}", events)
                    tokens[j] = None
            return [None] * len(lives)

    def accept(
        self, state: RequestState, token: int, events: list, logprobs: TokenLogprobs | None = None
    ) -> bool:
        """Hand `token` (with its log probabilities, when asked) to its request; True when
        that ended the request."""
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} is outside [0, {self.vocab_size})")
        if state.seq.status is SequenceStatus.FINISHED:  # its grammar failed in this step
            return True
        complete = advance(state, token)  # its grammar, when it has one: may raise
        event, stop, at_limit = state.accept(token, logprobs, last=complete)
        events.append((state.sink, event))
        if stop.finished:
            self._end(state, "stop", events, matched=stop.matched)
        elif complete:
            self._end(state, "stop", events)
        elif at_limit:
            self._end(state, "length", events)
        return stop.finished or complete or at_limit

    def refuse(self, live: RequestState, error: GrammarFailed, events: list) -> None:
        """End one request for its own grammar: a 400-class error and one bounded log line."""
        log.warning("request %s: %s", live.request_id, error)
        if live.seq.status is not SequenceStatus.FINISHED:
            self._end(live, "error", events, error=error)

    def fail(self, live: RequestState, why: str, events: list) -> None:
        """End one request with an internal error; the rest of the step goes on."""
        if live.seq.status is not SequenceStatus.FINISHED:
            self._end(live, "error", events, error=EngineStepError(f"the step failed: {why}"))
