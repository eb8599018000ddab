"""`ninfer bench engine`: scripted workloads through the engine, in process, real clock.

Three questions, each answered against a baseline measured in the same run:
- C1 / C2: with two long prompts submitted together, how long does the second wait for
  its first token, against "the first prompt's prefill + its own" (serial prefill)?
- Decode under load: a running stream's decode tok/s while another prompt prefills,
  against the same stream decoding alone.
- Agent turns: turn-N time to first token of a growing conversation with the prefix
  cache, against the same turn without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.config import opt
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import FinishEvent, GenerationEvent, GenerationRequest, TokenEvent
from ninfer_core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class EngineBenchConfig:
    """Workload sizes for `ninfer bench engine`."""

    prompt_tokens: int = opt(2048, "prompt length of each long request (C1, C2)")
    new_tokens: int = opt(32, "tokens generated per request")
    prefill_chunk: int = opt(512, "engine prefill chunk (token budget per step)")
    turns: int = opt(6, "turns of the agent conversation")
    turn_tokens: int = opt(384, "tokens each agent turn adds (tool output + user text)")


@dataclass
class Trace:
    """One request's submission time, each token's arrival time and ids, and its finish."""

    submitted: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish: FinishEvent | None = None

    def __call__(self, event: GenerationEvent) -> None:
        if isinstance(event, TokenEvent):
            self.token_times.extend([time.perf_counter()] * len(event.token_ids))
            self.token_ids.extend(event.token_ids)
        elif isinstance(event, FinishEvent):
            self.finish = event

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    def decode_tok_s(self, start: int = 1, end: int | None = None) -> float:
        times = self.token_times[start - 1 : end]
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    """Deterministic ids that do not share a prefix across different salts."""
    return [(salt * 7919 + i * 104729) % (vocab - 20) + 10 for i in range(n)]


def _engine(loaded: Any, host: Any, device: Any, cfg: EngineBenchConfig, **over: Any) -> Engine:
    max_context = max(cfg.prompt_tokens, cfg.turns * (cfg.turn_tokens + cfg.new_tokens)) + 64
    ec = EngineConfig(**{
        "max_concurrency": 2, "prefill_chunk": cfg.prefill_chunk, "max_context": max_context,
        "kv_capacity": 2 * max_context + 256, **over,
    })  # fmt: skip
    return Engine(loaded, ec, host=host, device=device)


def _run(engine: Engine, schedule: list[tuple[int, GenerationRequest]]) -> list[Trace]:
    """Step the engine, adding request j once `step >= schedule[j][0]`."""
    traces: list[Trace | None] = [None] * len(schedule)
    step = 0
    while True:
        for j, (at, request) in enumerate(schedule):
            if traces[j] is None and step >= at:
                traces[j] = Trace(time.perf_counter())
                engine.add(request, traces[j])
        if not engine.has_work and all(t is not None for t in traces):
            break
        engine.step()
        step += 1
    return [t for t in traces if t is not None]


def bench_concurrency(loaded, host, device, cfg: EngineBenchConfig) -> dict[str, float]:
    vocab = loaded.config.vocab_size
    eng = _engine(loaded, host, device, cfg, prefix_cache=False)

    def req(salt: int, n: int = cfg.prompt_tokens) -> GenerationRequest:
        return GenerationRequest(_prompt(n, salt, vocab), GREEDY, max_tokens=cfg.new_tokens,
                                 ignore_eos=True)  # fmt: skip

    _run(eng, [(0, req(99, 64))])  # warm-up
    [c1] = _run(eng, [(0, req(1))])
    first, second = _run(eng, [(0, req(2)), (0, req(3))])
    # Decode under load: a short-prompt stream runs alone, then beside a long prefill.
    [alone] = _run(eng, [(0, req(4, 32))])
    beside, _long = _run(eng, [(0, req(5, 32)), (4, req(6))])
    prefill_steps = -(-cfg.prompt_tokens // cfg.prefill_chunk)
    window = (5, 5 + prefill_steps)  # tokens produced while the long prompt prefills
    eng.close()
    serial = c1.ttft * 2
    return {
        "c1_ttft_s": c1.ttft,
        "c1_prefill_tok_s": cfg.prompt_tokens / c1.ttft,
        "c1_decode_tok_s": c1.decode_tok_s(),
        "c2_first_ttft_s": first.ttft,
        "c2_second_ttft_s": second.ttft,
        "c2_serial_ttft_s": serial,
        "c2_second_vs_serial": second.ttft / serial,
        "decode_alone_tok_s": alone.decode_tok_s(*window),
        "decode_during_prefill_tok_s": beside.decode_tok_s(*window),
    }


def bench_agent(loaded, host, device, cfg: EngineBenchConfig) -> dict[str, Any]:
    vocab = loaded.config.vocab_size
    out: dict[str, Any] = {}
    for cache in (True, False):
        eng = _engine(loaded, host, device, cfg, prefix_cache=cache, max_concurrency=1)
        history: list[int] = []
        ttfts, cached = [], []
        for turn in range(cfg.turns):
            history = history + _prompt(cfg.turn_tokens, 1000 + turn, vocab)
            request = GenerationRequest(list(history), GREEDY, max_tokens=cfg.new_tokens,
                                        ignore_eos=True)  # fmt: skip
            [trace] = _run(eng, [(0, request)])
            ttfts.append(trace.ttft)
            cached.append(trace.finish.usage.cached_tokens if trace.finish else 0)
            history += trace.token_ids  # the answer goes back, as an agent resends it
        eng.close()
        key = "cache" if cache else "no_cache"
        out[f"turn_ttft_s_{key}"] = ttfts
        out[f"cached_tokens_{key}"] = cached
    out["turn_n_ttft_ratio"] = out["turn_ttft_s_cache"][-1] / out["turn_ttft_s_no_cache"][-1]
    out["turn_n_prompt_tokens"] = cfg.turns * (cfg.turn_tokens + cfg.new_tokens) - cfg.new_tokens
    return out
