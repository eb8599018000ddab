"""`Engine`: the model runner, the KV pool, the scheduler and the sampler, stepped in a loop.

It is the one decode loop: the server steps it on its own thread, `ninfer generate` and the
decode benches from theirs (`ninfer_core.generation`). The runner, store and pages come from
`runtime.build_runtime`, as they do for every other caller.

A step is three verbs: `schedule` (policy: who runs how many tokens), `run` (one forward over
the ragged batch), `postprocess` (sample, detokenize, check stops, finish). `step()` does one,
so tests and the bench drive the engine deterministically, with a fake clock if they like;
`start()` runs the same steps on a thread of their own, and `submit` bridges each request's
events into asyncio.

One lock guards the scheduler and the request table; it is held while deciding and while
postprocessing, never during the forward, so a `submit` or `cancel` waits at most for the
bookkeeping of a step, not for its compute. Events go out after the lock is released.

A fault is pinned on the request it comes from, so one client can never end another's stream:
a forward that raises is re-run sequence by sequence (`faults.run_isolated`), and after it
each sequence's logits row, sampled token and text step are checked or guarded on their own,
ending only their request with an `EngineStepError`. Only a bug in the step's bookkeeping
itself fails every live request (`StepThread._loop`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

import torch

from ninfer_core.device import DeviceInfo
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.constraints import advance, mask_grammar, mask_round_grammar
from ninfer_core.engine.engine_thread import StepThread
from ninfer_core.engine.fanout import can_fork, child_params, family_blocks, fork
from ninfer_core.engine.faults import run_isolated, unusable_rows
from ninfer_core.engine.model_runner import StepForward
from ninfer_core.engine.request import (
    EngineClosedError,
    EngineError,
    EngineStepError,
    EventStream,
    FinishEvent,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    InvalidRequestError,
    OverloadedError,
    QueueTimeoutError,
    RequestResult,
    RequestState,
    RequestTooLargeError,
)
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.engine.scheduler import Scheduler
from ninfer_core.engine.sequence import Sequence, SequenceStatus
from ninfer_core.engine.speculation import (
    Round,
    RowChooser,
    apply_proposals,
    build_drafter,
    draft_input,
    kept_end,
    max_drafts,
    rewind_states,
    settle_state,
    verify,
)
from ninfer_core.engine.stats import EngineCounters, StepOutcome
from ninfer_core.engine.token_extras import (
    batch_logprobs,
    mask_min_tokens,
    mask_round,
    round_acceptor,
)
from ninfer_core.loading import LoadedModel
from ninfer_core.plugin_host import PluginHost
from ninfer_core.sampling import Sampler, TokenLogprobs
from ninfer_core.sampling.grammar import GrammarCompiler
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.stats import SpecCounters, SpecUsage
from ninfer_core.spec.types import DraftInput
from ninfer_core.text import GenerationDefaults, Tokenizer, stop_token_ids

log = logging.getLogger(__name__)
#: The periodic speculation summary (`ninfer-serve` shows it without `-v`).
spec_log = logging.getLogger("ninfer_core.spec")
#: Seconds between two speculation summaries in the log, as vLLM's stats interval.
SPEC_LOG_INTERVAL_S = 10.0
Sink = Callable[[GenerationEvent], None]


class Engine(StepThread):
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        host: PluginHost,
        device: DeviceInfo,
        kv_dtype: str = "auto",
        compile_decode: bool = False,
        spec: SpecConfig | None = None,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.clock = config, clock
        model_cfg, artifact = loaded.config, loaded.artifact
        self.tokenizer = Tokenizer.from_artifact(artifact)
        defaults = GenerationDefaults.from_artifact(artifact)
        self.model_stop_ids = stop_token_ids(defaults, artifact.config, self.tokenizer.eos_token_id)
        self.max_context = config.context_for(model_cfg.max_position_embeddings)
        self.vocab_size = model_cfg.vocab_size
        #: The width of the final hidden states, and so of an embedding (`pooling.py`).
        self.hidden_size: int | None = getattr(model_cfg, "hidden_size", None)
        # Unset, the pool holds one context the model can serve, not the one asked for.
        pool = RuntimeSpec.for_tokens(
            config.kv_capacity or self.max_context, config.block_size, kv_dtype=kv_dtype,
            prefix_cache=config.prefix_cache, max_sequences=config.max_concurrency,
            compile_decode=compile_decode, state_snapshots=config.snapshot_count,
            snapshot_interval=config.state_snapshot_interval,
        )  # fmt: skip
        self.runtime = build_runtime(loaded, host, device, pool)
        self.kv_codec = self.runtime.kv_codec
        self.block_manager = self.runtime.block_manager
        self.runner = self.runtime.runner
        self.scheduler = Scheduler(
            config, self.block_manager, self.runtime.states, self.runtime.snapshots
        )
        self.sampler = Sampler(seed)
        self.counters = EngineCounters()
        #: Speculative decoding (`--spec`): the drafter, its options and the totals.
        self.drafter = self.spec_name = self.spec_options = None
        self.spec_counters = SpecCounters()
        if spec is not None and spec.enabled:
            self.spec_name, self.drafter, self.spec_options = build_drafter(
                host, device, loaded, self.runtime, spec
            )
            self.runner.keep_hidden = self.drafter.uses_hidden
        self._drafter_failed = False
        self._grammars: GrammarCompiler | None = None
        self._spec_logged_at = clock()
        self._spec_logged = SpecCounters()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._live: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._cancelled: set[str] = set()
        #: A forked request's id -> the ids of its completions (`engine/fanout.py`).
        self._families: dict[str, list[str]] = {}
        self._thread: threading.Thread | None = None
        self._closing = False

    # -- requests in -------------------------------------------------------------------------

    def add(self, request: GenerationRequest, sink: Sink | None = None) -> Sink:
        """Queue `request`; its events go to `sink` (a new `RequestResult` if None), which is
        returned. Raises at once when the request can never fit or the queue is full."""
        sink = sink if sink is not None else RequestResult(request.request_id)
        n = len(request.prompt_ids)
        vocab = self.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            bad = next(t for t in request.prompt_ids if not 0 <= t < vocab)
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
            )
        max_tokens = request.max_tokens or max(0, self.max_context - n)
        if request.pooling is not None:  # an embedding: the prompt alone (pooling.py)
            max_tokens = 0
            if n > self.max_context:
                raise RequestTooLargeError(
                    f"the input has {n} tokens; the context holds {self.max_context}"
                )
        elif not max_tokens or n + max_tokens > self.max_context:
            raise RequestTooLargeError(
                f"the prompt has {n} tokens and max_tokens is {max_tokens}: "
                f"{n + max_tokens} tokens; the context holds {self.max_context}"
            )
        if self.block_manager.blocks_for(n + max_tokens) > self.block_manager.num_blocks:
            raise RequestTooLargeError(
                f"prompt plus max_tokens is {n + max_tokens} tokens; the KV pool holds "
                f"{self.block_manager.num_blocks * self.config.block_size}"
            )
        self._check_fan_out(request, max_tokens)
        seq = Sequence(request.prompt_ids, max_tokens=max_tokens, cache_salt=request.cache_salt)
        seq.fan_out = request.n
        seq.embedding = request.pooling is not None
        state = RequestState(request, seq, sink, self.tokenizer, self._stop_ids(request))
        if self.drafter is not None:
            state.spec = SpecUsage()
        with self._lock:
            if self._closing:
                raise EngineClosedError("the engine is shutting down")
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            waiting = self.scheduler.queue_length_with_one_more()
            if waiting > self.config.max_pending_requests:
                retry = max(1, math.ceil(self.scheduler.estimate_retry_after()))
                raise OverloadedError(
                    f"{waiting - 1} requests are queued (the limit is "
                    f"{self.config.max_pending_requests}); retry in about {retry} s",
                    retry_after=retry,
                )
            self.scheduler.add(seq, self.clock(), request.deadline, request.pending_timeout_s)
            self._live[request.request_id] = self._by_seq[seq.seq_id] = state
            self._wake.notify()
        return sink

    def _stop_ids(self, request: GenerationRequest) -> set[int]:
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= set(self.model_stop_ids)
        return stop_ids

    def _check_fan_out(self, request: GenerationRequest, max_tokens: int) -> None:
        """Refuse an `n` this engine cannot serve (`engine/fanout.py` says why)."""
        n = request.n
        if n == 1:
            return
        if n > self.config.max_concurrency:
            raise InvalidRequestError(
                f"n={n} is more than this server runs at once (max concurrency "
                f"{self.config.max_concurrency})"
            )
        why = None
        if self.drafter is not None:
            why = "this server decodes speculatively"
        elif not can_fork(self.runtime.kv_store):
            why = f"the {self.kv_codec} KV store cannot copy a page"
        if why is not None:
            raise InvalidRequestError(f"n > 1 is not supported here: {why}")
        bm, prompt = self.block_manager, len(request.prompt_ids)
        if family_blocks(bm, prompt, max_tokens, n) > bm.num_blocks:
            raise RequestTooLargeError(
                f"the prompt's {prompt} tokens once plus n={n} times max_tokens={max_tokens} "
                f"need {family_blocks(bm, prompt, max_tokens, n)} KV blocks; the pool holds "
                f"{bm.num_blocks}"
            )

    def submit(self, request: GenerationRequest) -> EventStream:
        """Queue `request` and stream its events into the running event loop (starting the
        step thread if needed). Raises at once like `add`; a later queue timeout or failed
        step is raised by the stream."""
        stream = EventStream(request.request_id, self, asyncio.get_running_loop(), request.n)
        self.start()
        self.add(request, stream)
        return stream

    def cancel(self, request_id: str) -> bool:
        """End a request (the client went away); its pages return within one step. False if
        it is not (or no longer) live."""
        events: list[tuple[Sink, GenerationEvent]] = []
        with self._lock:
            ids = self._families.get(request_id, [request_id])
            lives = [self._live[i] for i in ids if i in self._live]
            if not lives:
                return False
            for live in lives:
                if live.seq.status is SequenceStatus.WAITING:
                    self._end(live, "cancelled", events)
                else:  # it may be in a forward right now: end it at the step boundary
                    self._cancelled.add(live.request_id)
                    self._wake.notify()
        self._emit(events)
        return True

    def estimated_wait_s(self) -> float:
        """Seconds a request submitted now would likely wait before it starts."""
        with self._lock:
            return self.scheduler.estimate_wait()

    # -- the step ------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._cancelled)

    def step(self) -> StepOutcome:
        """schedule -> run -> postprocess, once."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("the engine's own thread is stepping it")
        events: list[tuple[Sink, GenerationEvent]] = []
        outcome = StepOutcome()
        with self._lock:
            self._apply_cancels(events)
            now = self.clock()
            plan = self.scheduler.schedule(now)
            for seq in plan.expired:
                waited = now - seq.enqueued_at
                error = QueueTimeoutError(
                    f"the request waited {waited:.1f} s in the queue and did not start", waited
                )
                self._end(self._by_seq[seq.seq_id], "error", events, error=error)
            for seq, n in plan.batch:
                rid = self._by_seq[seq.seq_id].request_id
                if seq.is_prefilling:
                    outcome.prefill[rid] = n
                else:
                    outcome.decode.append(rid)
        proposing: tuple[list[Sequence], list[DraftInput]] | None = None
        if plan.batch:
            self.counters.steps += 1
            self.counters.prefill_tokens += plan.num_prefill_tokens
            self.counters.decode_tokens += plan.num_decode_tokens
            starts = [seq.num_computed_tokens for seq, _ in plan.batch]
            start = self.clock()
            # A failure is pinned on the sequences that fail alone too (faults.py): the
            # others go on, so one request's fault never ends another client's stream.
            # The final hidden states: for a drafter that reads them, and for the steps
            # that prefill an embedding request's prompt (`engine/pooling.py`).
            self.runner.keep_hidden = (
                self.drafter is not None and self.drafter.uses_hidden
            ) or any(seq.embedding for seq, _ in plan.batch)
            result = run_isolated(self.runner.step, plan.batch)
            begun = dict(zip((s.seq_id for s, _ in plan.batch), starts, strict=True))
            with self._lock:
                if self.runtime.states is not None:  # before anything can end a request
                    rewind_states(self.runtime.states, result.ok, begun)
                if not result.failed and not result.retried:
                    elapsed = self.clock() - start
                    self.scheduler.costs.observe(
                        plan.num_prefill_tokens, plan.num_decode_tokens, elapsed
                    )
                for seq, exc in result.failed:
                    if seq.status is SequenceStatus.RUNNING:
                        error = EngineStepError(f"the step failed: {type(exc).__name__}: {exc}")
                        self._end(self._by_seq[seq.seq_id], "error", events, error=error)
                self._apply_cancels(events)  # those that came during the forward
                accepted: dict[int, int] = {}
                if result.output is not None:
                    self._pool(result.ok, result.output, events)
                    self._postprocess(result.ok, result.output.logits, events, accepted)
                    self.scheduler.snapshot_prefills(result.ok)
                    if self.drafter is not None:
                        proposing = self._draft_inputs(result.ok, result.output, begun, accepted)
                outcome.still_prefilling = [
                    self._by_seq[s.seq_id].request_id
                    for s, _ in result.ok
                    if s.status is SequenceStatus.RUNNING and s.is_prefilling
                ]
        outcome.events = [event for _, event in events]
        self._emit(events)
        if proposing is not None:
            self._propose(*proposing)
            self._log_speculation()
        return outcome

    # -- speculation -------------------------------------------------------------------------

    def _draft_inputs(
        self,
        batch: list[tuple[Sequence, int]],
        output: StepForward,
        starts: dict[int, int],
        accepted: dict[int, int],
    ) -> tuple[list[Sequence], list[DraftInput]]:
        """What the drafter learns of each sequence that ran and still runs; each one that
        will draft gets the pages of its lookahead now (reserved at admission)."""
        seqs, inputs, offset = [], [], 0
        k = self.spec_options.num_tokens
        for seq, n in batch:
            if seq.status is SequenceStatus.RUNNING:
                budget = max_drafts(seq, k)
                if budget:
                    self.block_manager.allocate(seq, seq.num_pending_tokens + budget)
                item = draft_input(
                    seq, starts[seq.seq_id], kept_end(seq), offset, output.hidden, budget,
                    accepted.get(seq.seq_id),
                )  # fmt: skip
                seqs.append(seq)
                inputs.append(item)
            offset += n
        return seqs, inputs

    def _log_speculation(self) -> None:
        """Every `SPEC_LOG_INTERVAL_S`, one line on the rounds since the last (vLLM's
        figures: acceptance rate, mean tokens per round, acceptance by position)."""
        now = self.clock()
        if now - self._spec_logged_at < SPEC_LOG_INTERVAL_S:
            return
        total, last = self.spec_counters, self._spec_logged
        rounds, drafted = total.rounds - last.rounds, total.drafted - last.drafted
        if rounds:
            accepted = total.accepted - last.accepted
            old = last.accepted_per_pos + [0] * len(total.accepted_per_pos)
            by_pos = [(n - o) / rounds for n, o in zip(total.accepted_per_pos, old, strict=False)]
            spec_log.info(
                "speculation (%s): %d rounds, acceptance %.1f%% (%d of %d drafts), "
                "%.2f tokens per round, by position %s",
                self.spec_name, rounds, 100 * accepted / drafted, accepted, drafted,
                1 + accepted / rounds, " ".join(f"{r:.2f}" for r in by_pos),
            )  # fmt: skip
        self._spec_logged = dataclasses.replace(
            total, accepted_per_pos=list(total.accepted_per_pos)
        )
        self._spec_logged_at = now

    def _propose(self, seqs: list[Sequence], inputs: list[DraftInput]) -> None:
        """Ask the drafter for the next step's drafts (outside the lock: it computes). A
        drafter that fails proposes nothing this step; the sequences decode one token."""
        try:
            proposals = self.drafter.propose(inputs)
            apply_proposals(seqs, inputs, proposals, self.vocab_size)
        except Exception:
            if not self._drafter_failed:
                log.exception("the %s drafter failed; decoding without drafts", self.spec_name)
            self._drafter_failed = True
            for seq in seqs:
                seq.draft_ids, seq.draft_probs = [], None

    def _postprocess(
        self,
        batch: list[tuple[Sequence, int]],
        logits: torch.Tensor,
        events: list,
        accepted: dict[int, int],
    ) -> None:
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
                self._fail(live, "the model's logits for this request hold no finite value", events)
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
                self._fail(
                    live, f"sampled token id {token} is outside [0, {self.vocab_size})", events
                )
                continue
            try:
                self._accept(live, token, events, lp)
            except Exception as exc:
                log.exception("postprocessing request %s failed", live.request_id)
                self._fail(live, f"{type(exc).__name__}: {exc}", events)

    def _pool(self, batch: list[tuple[Sequence, int]], output: StepForward, events: list) -> None:
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
                self._fail(live, f"pooling: {type(exc).__name__}: {exc}", events)

    def _forked(self, live: RequestState, events: list) -> list[RequestState]:
        """`live`, and when its prompt is done and it asked for `n` > 1, its `n - 1` forks
        (`engine/fanout.py`), each a request of its own in the engine's tables that speaks
        for `live`'s id with its own `index`. A fork that fails ends the request."""
        seq = live.seq
        if seq.fan_out == 1:
            return [live]
        forks: list[Sequence] = []
        try:
            for _ in range(seq.fan_out - 1):
                forks.append(
                    fork(seq, self.block_manager, self.runtime.kv_store, self.runtime.states)
                )
        except Exception as exc:
            log.exception("forking request %s failed", live.request_id)
            for child in forks:
                self.block_manager.free(child)
                if child.state_slot is not None:
                    self.runtime.states.free(child.state_slot)
            seq.fan_out = 1
            self._fail(live, f"forking its completions: {type(exc).__name__}: {exc}", events)
            return []
        rid, family = live.request_id, [live]
        for index, child in enumerate(forks, 1):
            request = dataclasses.replace(
                live.request,
                request_id=f"{rid}#{index}",
                params=child_params(live.request.params, index),
                n=1,
            )
            state = RequestState(request, child, live.sink, self.tokenizer, self._stop_ids(request))
            state.index, state.event_id = index, live.event_id
            self._live[request.request_id] = self._by_seq[child.seq_id] = state
            family.append(state)
        self._families[rid] = [member.request_id for member in family]
        self.scheduler.adopt(seq, forks)
        return family

    def _verify(self, live: RequestState, round_: Round, rows: torch.Tensor, events: list) -> int:
        """Accept what the target agrees with of one sequence's drafts (`speculation.py`);
        returns the drafts accepted. A failure ends only this request.

        On a model with state, the state and computed count are at the forward's start
        (`rewind_states`) and stay there while the round is verified; a fully accepted
        round makes the step's state current and only then commits its blocks, a rejected
        one is replayed by the next step (`settle_state`)."""
        seq = live.seq
        if any(unusable_rows(rows)):
            self._fail(live, "the model's logits for this request hold no finite value", events)
            return 0
        try:
            masked = mask_round_grammar(
                mask_round(rows, live), live, round_.drafts, self._grammars_if(live)
            )
            chooser = RowChooser(self.sampler, live, round_, masked)
            accepted = verify(
                seq, round_, chooser,
                round_acceptor(live, rows, lambda t, lp: self._accept(live, t, events, lp)),
                self._advance(seq), live.spec,
            )  # fmt: skip
        except Exception as exc:
            log.exception("verifying the drafts of request %s failed", live.request_id)
            self._fail(live, f"{type(exc).__name__}: {exc}", events)
            return 0
        self.spec_counters.record(len(round_.drafts), accepted)
        states = self.runtime.states
        running = seq.status is SequenceStatus.RUNNING
        if states is not None and running and settle_state(states, seq, round_, accepted):
            self.block_manager.commit(seq)
        return accepted

    def _advance(self, seq: Sequence) -> Callable[[int], None]:
        """What `verify` does before each token: cover the tokens before it with the
        computed count and index the blocks that became full. Nothing on a model with
        state: a page a replay writes again must never be indexed, and the computed count
        stays with the state at the forward's start until the round is settled."""
        if self.runtime.states is not None:
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
        except Exception:
            log.exception("masking the batch by its grammars failed; masking row by row")
        rows = []
        for j, live in enumerate(lives):
            try:
                rows.append(mask_grammar(logits[j : j + 1], [live], self.grammars))
            except Exception as exc:
                self._fail(live, f"the grammar failed: {type(exc).__name__}: {exc}", events)
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
                self._fail(live, f"sampling failed: {type(exc).__name__}: {exc}", events)
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
                    self._fail(live, f"log probabilities: {type(exc).__name__}: {exc}", events)
                    tokens[j] = None
            return [None] * len(lives)

    def _accept(
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

    def _fail(self, live: RequestState, why: str, events: list) -> None:
        """End one request with an internal error; the rest of the step goes on."""
        if live.seq.status is not SequenceStatus.FINISHED:
            self._end(live, "error", events, error=EngineStepError(f"the step failed: {why}"))

    def _end(
        self,
        live: RequestState,
        reason: FinishReason,
        events: list,
        *,
        error: EngineError | None = None,
        matched: str | int | None = None,
        embedding: torch.Tensor | None = None,
    ) -> None:
        seq, rid = live.seq, live.request_id
        if seq.status is SequenceStatus.RUNNING:
            self.scheduler.finish(seq, snapshot=error is None)
            seq.draft_ids, seq.draft_probs = [], None
            if self.drafter is not None:
                self._release(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING:
            self.scheduler.remove_waiting(seq)
        del self._live[rid], self._by_seq[seq.seq_id]
        self._cancelled.discard(rid)
        family = self._families.get(live.event_id)
        if family is not None and not any(member in self._live for member in family):
            del self._families[live.event_id]
        if live.index == 0:  # a forked request's prompt is counted once
            self.counters.cached_tokens += seq.num_cached_tokens
        usage = live.usage()
        finish = FinishEvent(live.event_id, reason, usage, error, matched, live.index, embedding)
        events.append((live.sink, finish))
        # Ended before it forked (cancelled or refused while queued or prefilling): its
        # other completions end with it, so a consumer counting `n` finishes sees them all.
        unborn = dataclasses.replace(usage, completion_tokens=0)
        for index in range(1, seq.fan_out):
            events.append((live.sink, dataclasses.replace(finish, usage=unborn, index=index)))
        seq.fan_out = 1

    def _release(self, seq_id: int) -> None:
        try:
            self.drafter.release(seq_id)
        except Exception:
            log.exception("the %s drafter failed to release sequence %d", self.spec_name, seq_id)

    def _apply_cancels(self, events: list) -> None:
        for rid in list(self._cancelled):
            live = self._live.get(rid)
            if live is not None:
                self._end(live, "cancelled", events)
        self._cancelled.clear()

    @staticmethod
    def _emit(events: Iterable[tuple[Sink, GenerationEvent]]) -> None:
        for sink, event in events:
            try:
                sink(event)
            except Exception:  # one broken consumer must not stop the others' streams
                log.exception("event sink for %s failed", event.request_id)

    # -- for tests and the bench -----------------------------------------------------------

    def generate(self, requests: Iterable[GenerationRequest]) -> list[RequestResult]:
        """Run `requests` to the end by stepping in this thread; results in request order.
        Requests are added as the queue has room, so any number may be given."""
        results: list[RequestResult] = []
        for request in requests:
            while True:
                try:
                    results.append(self.add(request))
                    break
                except OverloadedError:
                    self.step()
        while self.has_work:
            self.step()
        return results

    def check_invariants(self) -> None:
        """The block manager's checks, with every live sequence as the holders, the
        state pool's, with the running sequences' slots as the held ones, and the state
        snapshots' index."""
        with self._lock:
            self.block_manager.check_invariants(list(self.scheduler))
            if self.runtime.states is not None:
                held = [s.state_slot for s in self.scheduler.running]
                self.runtime.states.check_invariants(held)
            if self.runtime.snapshots is not None:
                self.runtime.snapshots.check_invariants()
