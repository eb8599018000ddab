"""What the engine did: per step (for tests and the bench) and in total."""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer_core.engine.request import GenerationEvent


@dataclass
class StepOutcome:
    """What one step did, for tests and the bench."""

    #: Requests that ran a prefill chunk this step, and how many tokens.
    prefill: dict[str, int] = field(default_factory=dict)
    #: Requests that ran one decode token.
    decode: list[str] = field(default_factory=list)
    #: Requests whose prompt is still not fully computed after the step.
    still_prefilling: list[str] = field(default_factory=list)
    events: list[GenerationEvent] = field(default_factory=list)


@dataclass
class EngineCounters:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
