"""`Sampler`: one next token per sequence for a decode batch.

The transforms are vectorised over the batch with per-row parameters (a row with a filter
off gets the neutral value), so a batch costs the same few kernels whatever mix of settings it
holds. Only the draw itself splits: seeded rows draw from their own generators, one row at a
time, so that a seeded request's tokens never depend on which others share its batch.

Whatever the logits hold, a returned id is in [0, V) and depends only on the row: non-finite
values are made finite or impossible by `sanitize` (see there) before and after every
transform that can overflow, and a row left with nothing possible falls back to id 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_core.sampling.params import SamplingParams
from ninfer_core.sampling.penalties import SequenceTokens, apply_penalties

_NEG_INF = float("-inf")
_FP32_MAX = torch.finfo(torch.float32).max


def sanitize(logits: torch.Tensor) -> torch.Tensor:
    """logits: [R, V] fp32 -> [R, V] with NaN -> -inf and +inf -> fp32 max (new tensor).

    Why these choices: a NaN score says nothing about its token, so the token becomes
    impossible rather than poisoning the row's softmax (one NaN makes every probability NaN
    and the inverse-CDF draw land one past the vocabulary). A +inf score means "certain";
    as fp32 max it keeps that meaning (ties share the mass) without inf - inf = NaN in the
    softmax. -inf stays: that is how filters mark removed tokens. A row with no finite or
    +inf value left has nothing to choose from; `draw` and `argmax` then give id 0, the
    documented fallback (the engine ends such a sequence with an error before it gets here).
    """
    return torch.nan_to_num(logits, nan=_NEG_INF, posinf=_FP32_MAX, neginf=_NEG_INF)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits: [R, V], temperature: [R] (every entry > 0) -> [R, V]."""
    return logits / temperature.unsqueeze(1)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    k_max: int | None = None,
) -> torch.Tensor:
    """Mask to -inf what top-k and then top-p remove, sharing one sort.

    logits: [R, V]; top_k: [R] long in 1..V (V: off); top_p: [R] threshold 1 - p, or -1 for
    off. Ties at the k-th value all survive, and top-p drops the ascending prefix whose
    cumulative probability is <= 1 - p, always keeping the most likely token — the same rules
    as transformers' TopKLogitsWarper and TopPLogitsWarper.

    `k_max`, the largest k when every row has one, replaces the full-vocabulary sort by a
    top-k of the candidates (a sort of 150k entries per row costs ~10 ms a row on CPU).
    """
    vocab = logits.shape[1]
    kth = None
    if top_k is not None and k_max is not None and k_max < vocab:
        values, order = logits.topk(k_max, dim=-1)  # descending
        kth = values.gather(1, (top_k - 1).unsqueeze(1))  # k-th largest
        width = int((logits >= kth).sum(dim=-1).max())  # ties at the k-th value survive too
        if width > k_max:
            values, order = logits.topk(width, dim=-1)
        sorted_logits, order = values.flip(1), order.flip(1)  # ascending
        out = torch.full_like(logits, _NEG_INF)
    else:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        out = torch.empty_like(logits)
        if top_k is not None:
            kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))  # k-th largest
    if kth is not None:
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return out.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p × the top probability. logits: [R, V], min_p: [R]."""
    probs = logits.softmax(dim=-1)
    drop = probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(drop, _NEG_INF)


def warp_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature → top-k → top-p → min-p for non-greedy rows. logits: [R, V] fp32."""
    vocab, device = logits.shape[1], logits.device

    def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    # Dividing by a temperature < 1 can overflow a large logit to inf: sanitize again.
    logits = sanitize(apply_temperature(logits, column([p.temperature for p in params])))
    top_k = top_p = k_max = None
    if all(p.top_k > 0 for p in params):
        k_max = min(max(p.top_k for p in params), vocab)
    if any(p.top_k > 0 for p in params):
        top_k = column([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.long)
    if any(p.top_p < 1 for p in params):
        top_p = column([1 - p.top_p if p.top_p < 1 else -1.0 for p in params])
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p, k_max)
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, column([p.min_p for p in params]))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One categorical draw per row by inverse CDF. probs: [R, V] -> [R] long.

    One uniform per row instead of one per token (an exponential race or torch.multinomial
    costs ~15x more on CPU), no host sync on CUDA, and a seeded row consumes exactly one number
    of its stream per step. The CDF is fp64 so that rounding over ~150k terms cannot move mass.
    """
    # A NaN probability (a row with nothing possible: softmax of all -inf) counts as 0, so
    # such a row's cdf is all 0 and the search below lands on id 0, never past the end.
    cdf = probs.double().nan_to_num(nan=0.0).cumsum(dim=-1)  # [R, V]
    uniform = torch.rand(
        probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator
    )
    # u in (0, total]: the first index with cdf >= u has p > 0 (zero-probability tokens only
    # repeat the previous cdf value) and is never past the end: (1 - uniform) <= 1, so the
    # rounded product is <= total = cdf[-1].
    return torch.searchsorted(cdf, (1 - uniform) * cdf[:, -1:]).squeeze(1)


class Sampler:
    """Turns a batch of last-position logits into next tokens.

    Stateless apart from the shared generator for unseeded requests (one per device, seeded
    from `seed` so that a whole engine can be made reproducible in tests; random otherwise).
    Per-sequence state — tokens for penalties and a seeded request's own generator — lives
    in each sequence's `SequenceTokens`.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[SequenceTokens],
    ) -> torch.Tensor:
        """logits: [B, V] (fp32; other float dtypes are converted) -> token ids [B] long.

        Row i uses params[i] and histories[i]; the histories are read, never appended to —
        the caller appends the chosen token once it accepts it.
        """
        logits = self._check(logits, params, histories)
        if all(p.greedy and not p.has_penalties for p in params):
            return logits.argmax(dim=-1)  # fast path: no per-row work at all
        logits = self._penalise(logits, params, histories)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == len(params):
            return logits.argmax(dim=-1)
        random = [i for i, p in enumerate(params) if not p.greedy]
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        rows = logits if not greedy else logits[random]
        row_params = [params[i] for i in random]
        probs = warp_logits(rows, row_params).softmax(dim=-1)
        tokens[random] = self._draw(probs, row_params, [histories[i] for i in random])
        return tokens

    def probabilities(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[SequenceTokens],
    ) -> torch.Tensor:
        """The distribution `sample` draws from, [B, V] fp32; a greedy row is one-hot.

        Speculative verification needs this to accept a draft token with probability q/p.
        """
        logits = self._penalise(self._check(logits, params, histories), params, histories)
        probs = torch.zeros_like(logits)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        random = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            rows = torch.tensor(greedy, dtype=torch.long, device=logits.device)
            probs[rows, logits[rows].argmax(dim=-1)] = 1.0
        if random:
            warped = warp_logits(logits[random], [params[i] for i in random]).softmax(dim=-1)
            # A row with nothing possible is NaN here; `sample` draws id 0 from it: say so
            # (with `where`, not a branch, so that CUDA need not sync).
            fallback = torch.zeros_like(warped)
            fallback[:, 0] = 1.0
            probs[random] = torch.where(warped.isnan().any(dim=-1, keepdim=True), fallback, warped)
        return probs

    @staticmethod
    def penalised(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[SequenceTokens],
    ) -> torch.Tensor:
        """The logits every choice starts from, [B, V] fp32: sanitized, then penalised over
        each row's history (before temperature and the filters). What `logprobs` reports.
        A static method, so the engine reaches it whatever stands in for its sampler."""
        return Sampler._penalise(Sampler._check(logits, params, histories), params, histories)

    @staticmethod
    def _check(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[SequenceTokens],
    ) -> torch.Tensor:
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"logits must be a float [B, V] tensor, got {tuple(logits.shape)}")
        if not len(params) == len(histories) == logits.shape[0]:
            raise ValueError(
                f"batch of {logits.shape[0]} logits rows with {len(params)} params "
                f"and {len(histories)} histories"
            )
        return sanitize(logits.float())

    @staticmethod
    def _penalise(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[SequenceTokens],
    ) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return logits
        # A penalty can push a huge logit past fp32's range (x / 0.5, x + 2 * count): sanitize.
        if len(rows) == len(params):
            return sanitize(apply_penalties(logits, params, histories))
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        penalised = apply_penalties(
            logits[index], [params[i] for i in rows], [histories[i] for i in rows]
        )
        # out of place: the caller's logits stay
        return logits.index_copy(0, index, sanitize(penalised))

    def _draw(
        self,
        probs: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[SequenceTokens],
    ) -> torch.Tensor:
        """probs: [R, V] -> [R]; unseeded rows in one draw, seeded rows one by one."""
        device = probs.device
        tokens = torch.empty(probs.shape[0], dtype=torch.long, device=device)
        shared = [j for j, p in enumerate(params) if p.seed is None]
        if shared:
            rows = probs if len(shared) == len(params) else probs[shared]
            tokens[shared] = draw(rows, self._shared_generator(device))
        for j, (p, history) in enumerate(zip(params, histories, strict=True)):
            if p.seed is not None:
                tokens[j] = draw(probs[j : j + 1], self._own_generator(history, p.seed, device))[0]
        return tokens

    def generator_for(
        self, params: SamplingParams, history: SequenceTokens, device: torch.device
    ) -> torch.Generator:
        """The random stream a row draws from: its request's own when seeded, else the
        shared one (what speculative verification draws its acceptance tests from)."""
        if params.seed is not None:
            return self._own_generator(history, params.seed, device)
        return self._shared_generator(device)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()  # fresh entropy, as torch's default generator would have
            else:
                generator.manual_seed(self._seed % 2**64)
            self._shared[device] = generator
        return generator

    @staticmethod
    def _own_generator(history: SequenceTokens, seed: int, device: torch.device) -> torch.Generator:
        """The request's generator, seeded once on its first draw, so later draws continue it."""
        if history.generator is None:
            history.generator = torch.Generator(device=device)
            history.generator.manual_seed(seed % 2**64)
        return history.generator
