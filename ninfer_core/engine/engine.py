"""`Engine`: the model runner, the KV pool, the scheduler and the sampler, stepped in a loop.

It is the one decode loop: the server steps it on its own thread, `ninfer generate` and the
decode benches from theirs (`ninfer_core.generation`). The runner, store and pages come from
`runtime.build_runtime`, as they do for every other caller.

A step is three verbs: `schedule` (policy: who runs how many tokens), `run` (one forward over
the ragged batch), `postprocess` (sample, detokenize, check stops, finish: `Postprocessor`, in
`postprocess.py`; the drafter's glue is in `drafting.py`). `step()` does one, so tests and the
bench drive the engine deterministically, with a fake clock if they like; `start()` runs the
same steps on a thread of their own, and `submit` bridges each request's events into asyncio.

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
from ninfer_core.engine.admission import admitted_max_tokens, check_fan_out
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.drafting import SpecLog, draft_inputs
from ninfer_core.engine.engine_thread import StepThread
from ninfer_core.engine.fanout import child_params, fork, release
from ninfer_core.engine.faults import run_isolated
from ninfer_core.engine.postprocess import Postprocessor
from ninfer_core.engine.request import (
    EngineClosedError,
    EngineError,
    EngineStepError,
    EventStream,
    FinishEvent,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    OverloadedError,
    QueueTimeoutError,
    RequestResult,
    RequestState,
)
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.engine.scheduler import Scheduler
from ninfer_core.engine.sequence import Sequence, SequenceStatus
from ninfer_core.engine.speculation import (
    apply_proposals,
    build_drafter,
    rewind_states,
)
from ninfer_core.engine.stats import EngineCounters, StepOutcome
from ninfer_core.loading import LoadedModel
from ninfer_core.plugin_host import PluginHost
from ninfer_core.sampling import Sampler
from ninfer_core.sampling.grammar import GrammarCompiler
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.stats import SpecCounters, SpecUsage
from ninfer_core.spec.types import DraftInput
from ninfer_core.text import GenerationDefaults, Tokenizer, stop_token_ids

log = logging.getLogger(__name__)
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
        self.counters = EngineCounters()
        #: Speculative decoding (`--spec`): the drafter, its options and the totals.
        self.drafter = self.spec_name = self.spec_options = None
        self.spec_counters = SpecCounters()
        if spec is not None and spec.enabled:
            self.spec_name, self.drafter, self.spec_options = build_drafter(
                host, device, loaded, self.runtime, spec
            )
        self._drafter_failed = False
        self._spec_log = SpecLog(clock())
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._live: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._cancelled: set[str] = set()
        #: A forked request's id -> the ids of its completions (`engine/fanout.py`).
        self._families: dict[str, list[str]] = {}
        self._thread: threading.Thread | None = None
        self._closing = False
        #: Sampling, masks, log probabilities, verification and accepting tokens; its
        #: `sampler` is the engine's.
        self.postprocess = Postprocessor(
            tokenizer=self.tokenizer, vocab_size=self.vocab_size,
            model_stop_ids=self.model_stop_ids, sampler=Sampler(seed),
            block_manager=self.block_manager, states=self.runtime.states,
            spec_counters=self.spec_counters, by_seq=self._by_seq,
            end=self._end,
            forked=self._forked,
        )  # fmt: skip

    # -- requests in -------------------------------------------------------------------------

    def add(self, request: GenerationRequest, sink: Sink | None = None) -> Sink:
        """Queue `request`; its events go to `sink` (a new `RequestResult` if None), which is
        returned. Raises at once when the request can never fit or the queue is full."""
        sink = sink if sink is not None else RequestResult(request.request_id)
        max_tokens = admitted_max_tokens(
            request, vocab_size=self.vocab_size, max_context=self.max_context,
            block_manager=self.block_manager,
        )  # fmt: skip
        check_fan_out(
            request, max_tokens, max_concurrency=self.config.max_concurrency,
            speculative=self.drafter is not None, kv_store=self.runtime.kv_store,
            kv_codec=self.kv_codec, block_manager=self.block_manager,
        )  # fmt: skip
        seq = Sequence(request.prompt_ids, max_tokens=max_tokens, cache_salt=request.cache_salt)
        seq.fan_out = request.n
        seq.embedding = request.pooling is not None
        seq.tenant, seq.priority = request.tenant, request.priority
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
                raise self._overloaded(
                    f"{waiting - 1} requests are queued (the limit is "
                    f"{self.config.max_pending_requests})"
                )
            per_key = self.config.max_pending_per_key
            if per_key and request.tenant is not None:
                queued = self.scheduler.waiting_of(request.tenant)
                if queued >= per_key:
                    raise self._overloaded(
                        f"this API key has {queued} requests queued (the limit is {per_key})"
                    )
            self.scheduler.add(seq, self.clock(), request.deadline, request.pending_timeout_s)
            self._live[request.request_id] = self._by_seq[seq.seq_id] = state
            self._wake.notify()
        return sink

    def _overloaded(self, why: str) -> OverloadedError:
        """The 429 for a queue that is full (`why`), with when a place should free up."""
        retry = max(1, math.ceil(self.scheduler.estimate_retry_after()))
        return OverloadedError(f"{why}; retry in about {retry} s", retry_after=retry)

    def _stop_ids(self, request: GenerationRequest) -> set[int]:
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= set(self.model_stop_ids)
        return stop_ids

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
                    self.scheduler.observe(plan, elapsed)
                for seq, exc in result.failed:
                    if seq.status is SequenceStatus.RUNNING:
                        error = EngineStepError(f"the step failed: {type(exc).__name__}: {exc}")
                        self._end(self._by_seq[seq.seq_id], "error", events, error=error)
                self._apply_cancels(events)  # those that came during the forward
                accepted: dict[int, int] = {}
                if result.output is not None:
                    self.postprocess.pool(result.ok, result.output, events)
                    self.postprocess.run(result.ok, result.output.logits, events, accepted)
                    self._capture_prefill_states(result.ok)
                    if self.drafter is not None:
                        proposing = draft_inputs(
                            result.ok, result.output, begun, accepted,
                            self.spec_options.num_tokens, self.block_manager,
                        )  # fmt: skip
                outcome.still_prefilling = [
                    self._by_seq[s.seq_id].request_id
                    for s, _ in result.ok
                    if s.status is SequenceStatus.RUNNING and s.is_prefilling
                ]
        outcome.events = [event for _, event in events]
        self._emit(events)
        if proposing is not None:
            self._propose(*proposing)
            self._spec_log.maybe_log(self.clock(), self.spec_counters, self.spec_name)
        return outcome

    # -- speculation -------------------------------------------------------------------------

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

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles requests' constraints for this model's vocabulary (`Postprocessor`)."""
        return self.postprocess.grammars

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
                release(child, self.block_manager, self.runtime.states)
            seq.fan_out = 1
            self.postprocess.fail(
                live, f"forking its completions: {type(exc).__name__}: {exc}", events
            )
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

    def _capture_prefill_states(self, ran: list[tuple[Sequence, int]]) -> None:
        """After a step: snapshot the states of the prompts whose chunk ended at a capture
        point (`StateSnapshots.chunk` chose where); their full blocks are committed by
        then. Here, after the step, rather than in the scheduler: it copies the state
        layers' tensors."""
        snapshots = self.runtime.snapshots
        if snapshots is None:
            return
        for seq, _ in ran:
            if seq.status is SequenceStatus.RUNNING and snapshots.at_capture_point(seq):
                snapshots.capture(seq, seq.num_computed_tokens)

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
            if error is None and self.runtime.snapshots is not None:  # a sound state
                self.runtime.snapshots.capture(seq, seq.state_position)
            self.scheduler.finish(seq)
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
