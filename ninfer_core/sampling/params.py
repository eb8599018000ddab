"""`SamplingParams`: how one request turns logits into its next token.

Validation happens here, once, when a request is built, so that an impossible value fails as a
`ValueError` naming the field and the allowed range (an API frontend turns it into an HTTP 400)
instead of a NaN or an index error deep inside a decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Temperatures below this sample as greedy (as vLLM does): the distribution is all but argmax,
#: and dividing fp32 logits by a value much smaller overflows to inf and then NaN.
GREEDY_BELOW = 1e-5
#: Highest temperature accepted. Above ~100 the distribution is already all but uniform, and a
#: value past fp32's range (3.4e38) would turn into inf in the per-row column and make every
#: masked (-inf) logit NaN.
MAX_TEMPERATURE = 100.0
#: The repetition penalty's range. It divides positive logits, so a tiny value overflows them:
#: 1e-45 rounds to a denormal (or 0) in fp32 and the logits become inf/NaN. Values outside
#: [1/100, 100] have no use (vLLM and transformers only ask for > 0; we bound both sides).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
#: top_k beyond this is the same as "off" for any real vocabulary, and keeps the value an int32.
MAX_TOP_K = 2**31 - 1
#: Seeds are signed or unsigned 64-bit integers (OpenAI documents int64); the generator takes
#: the value modulo 2**64, so both halves map one to one onto its seed space.
MIN_SEED, SEED_BOUND = -(2**63), 2**64


def _number(name: str, value: object) -> float:
    """The value as a float; a bool, a string or a NaN/inf is refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings, applied in the order penalties → temperature → top-k →
    top-p → min-p → sample (the order vLLM and transformers use).

    The defaults sample from the model's own distribution with no filter and no penalty.
    """

    #: Divides the logits; 0 (anything below `GREEDY_BELOW`) means greedy argmax.
    temperature: float = 1.0
    #: Keep only the k most likely tokens; 0 or -1 turns the filter off.
    top_k: int = 0
    #: Keep the smallest set of most likely tokens whose probability reaches p; 1.0 is off.
    top_p: float = 1.0
    #: Drop tokens less likely than min_p times the most likely one; 0 is off.
    min_p: float = 0.0
    #: OpenAI semantics: subtracted once from every token already generated (-2..2).
    presence_penalty: float = 0.0
    #: OpenAI semantics: subtracted per occurrence in the generated tokens (-2..2).
    frequency_penalty: float = 0.0
    #: transformers/vLLM semantics, over prompt and generated tokens: a positive logit is
    #: divided by it and a negative one multiplied, so > 1 discourages repeats; 1 is off.
    repetition_penalty: float = 1.0
    #: A seed gives the request its own random stream, reproducible whatever shares the batch.
    seed: int | None = None

    def __post_init__(self) -> None:
        temperature = _number("temperature", self.temperature)
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), "
                f"got {temperature}"
            )
        top_k = self.top_k
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not -1 <= top_k <= MAX_TOP_K:
            raise ValueError(
                f"top_k must be an integer in 1..{MAX_TOP_K}, or 0 or -1 to turn it off; "
                f"got {top_k!r}"
            )
        top_p = _number("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {top_p}")
        min_p = _number("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 turns it off), got {min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 turns it off), got {value}")
        repetition = _number("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= repetition <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 turns it off), got {repetition}"
            )
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if seed is not None and not MIN_SEED <= seed < SEED_BOUND:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")

    @property
    def greedy(self) -> bool:
        """Argmax instead of a draw: top-k/top-p/min-p and the seed then change nothing."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """Whether the logits depend on the sequence's history at all."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def has_filters(self) -> bool:
        """Whether any of top-k, top-p or min-p removes tokens before the draw."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
