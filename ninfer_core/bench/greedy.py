"""One greedy request run to its end in this thread: what the in-process benches time.

The decode, context, speculative and GPU-check benches all measure the same thing: a prompt
decoded greedily for exactly `new` tokens (EOS ignored, so every run has the same length and
the figures compare), stepped through `generation.stream` so the timings are the engine's
own. Built here once so the request every bench times is the same request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ninfer_core.engine.engine import Engine
    from ninfer_core.engine.request import GenerationRequest
    from ninfer_core.generation import GenerationStats


def greedy_request(prompt: list[int], new: int) -> GenerationRequest:
    """`prompt` for exactly `new` greedy tokens (EOS ignored): a bench's request, so runs of
    different engines or repeats of one produce the same number of tokens."""
    from ninfer_core.engine.request import GenerationRequest
    from ninfer_core.sampling import SamplingParams

    return GenerationRequest(
        prompt, SamplingParams(temperature=0.0), max_tokens=new, ignore_eos=True
    )


def greedy_stats(engine: Engine, prompt: list[int], new: int) -> GenerationStats:
    """Run `greedy_request(prompt, new)` through `engine` (its thread not running) to the
    end and return its figures and ids; the loop the benches share, so each times the
    engine the same way `ninfer generate` drives it."""
    from ninfer_core.generation import GenerationStats, stream

    stats = GenerationStats()
    for _ in stream(engine, greedy_request(prompt, new), stats):
        pass
    return stats
