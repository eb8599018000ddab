"""Sampling: per-request settings, penalties over a sequence's tokens, and the batch sampler.

The engine keeps one `SequenceTokens` per sequence, appends each accepted token to it, and
hands the batch's logits, params and histories to `Sampler.sample` once per step.
"""

from ninfer_core.sampling.logprobs import (
    LOGPROB_FLOOR,
    MAX_TOP_LOGPROBS,
    TokenLogprobs,
    token_logprobs,
)
from ninfer_core.sampling.params import GREEDY_BELOW, SamplingParams
from ninfer_core.sampling.penalties import SequenceTokens, apply_penalties, penalise
from ninfer_core.sampling.sampler import (
    Sampler,
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    draw,
    sanitize,
    warp_logits,
)

__all__ = [
    "GREEDY_BELOW",
    "LOGPROB_FLOOR",
    "MAX_TOP_LOGPROBS",
    "Sampler",
    "SamplingParams",
    "SequenceTokens",
    "TokenLogprobs",
    "apply_min_p",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k_top_p",
    "draw",
    "penalise",
    "sanitize",
    "token_logprobs",
    "warp_logits",
]
