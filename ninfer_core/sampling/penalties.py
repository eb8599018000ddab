"""Repetition, frequency and presence penalties, and the per-sequence token history they read.

A decode step comes every few tens of milliseconds, so a penalty must not cost a Python pass
over the whole context each step. `SequenceTokens` keeps dense per-vocabulary tensors (a prompt
mask and output counts) that it builds once, on first use, and then updates with only the
tokens appended since the last step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ninfer_core.sampling.params import SamplingParams


class SequenceTokens:
    """The prompt and generated tokens of one sequence, as the sampler needs them.

    The engine makes one per sequence at admission and calls `append`/`extend` with every
    accepted token (and `truncate` if it takes tokens back). It also carries the sequence's
    own random stream (`generator`) when its request has a seed, so that the stream lives and
    dies with the sequence. Penalty tensors exist only for sequences that use penalties.
    """

    __slots__ = ("_counts", "_output", "_prompt_mask", "_synced", "generator", "prompt_ids")

    def __init__(self, prompt_ids: Iterable[int], output_ids: Iterable[int] = ()) -> None:
        self.prompt_ids: tuple[int, ...] = tuple(prompt_ids)
        self._output: list[int] = list(output_ids)
        #: The request's own generator; created by the `Sampler` on the first seeded draw.
        self.generator: torch.Generator | None = None
        self._prompt_mask: torch.Tensor | None = None  # [V] bool
        self._counts: torch.Tensor | None = None  # [V] fp32
        self._synced = 0  # how many of _output are already in _counts

    @property
    def output_ids(self) -> Sequence[int]:
        """The generated tokens so far (read-only by contract: change them through methods)."""
        return self._output

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self._output)

    def append(self, token_id: int) -> None:
        self._output.append(int(token_id))

    def extend(self, token_ids: Iterable[int]) -> None:
        self._output.extend(int(t) for t in token_ids)

    def truncate(self, num_output: int) -> None:
        """Keep only the first `num_output` generated tokens (a rejected speculative tail)."""
        if not 0 <= num_output <= len(self._output):
            raise ValueError(f"cannot truncate {len(self._output)} output tokens to {num_output}")
        if self._counts is not None and num_output < self._synced:
            dropped = self._output[num_output : self._synced]
            ids = torch.tensor(dropped, dtype=torch.long, device=self._counts.device)
            self._counts.index_add_(0, ids, torch.full_like(ids, -1, dtype=self._counts.dtype))
            self._synced = num_output
        del self._output[num_output:]

    def prompt_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[V] bool, True for every token id in the prompt; built once (O(prompt))."""
        mask = self._prompt_mask
        if mask is None or mask.shape[0] != vocab_size or mask.device != device:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if self.prompt_ids:
                mask[torch.tensor(self.prompt_ids, dtype=torch.long, device=device)] = True
            self._prompt_mask = mask
        return mask

    def output_counts(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[V] fp32, how often each token id was generated; O(new tokens) per call."""
        counts = self._counts
        if counts is None or counts.shape[0] != vocab_size or counts.device != device:
            counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self._counts, self._synced = counts, 0
        if self._synced < len(self._output):
            ids = torch.tensor(self._output[self._synced :], dtype=torch.long, device=device)
            counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            self._synced = len(self._output)
        return counts


def penalise(
    logits: torch.Tensor,
    *,
    seen: torch.Tensor | None,
    counts: torch.Tensor | None,
    repetition: torch.Tensor | None,
    frequency: torch.Tensor | None,
    presence: torch.Tensor | None,
) -> torch.Tensor:
    """The penalties as tensor algebra, in vLLM's order: repetition, frequency, presence.

    logits, seen (bool), counts: [P, V]; the penalties: [P]. A `None` term is skipped.
    """
    if repetition is not None and seen is not None:
        rep = repetition.unsqueeze(1)
        # Dividing a positive logit and multiplying a negative one both lower it for rep > 1.
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if counts is not None:
        if frequency is not None:
            logits = logits - frequency.unsqueeze(1) * counts
        if presence is not None:
            logits = logits - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[SequenceTokens],
) -> torch.Tensor:
    """Penalise the rows of `logits` [P, V] (fp32) from their params and histories; new tensor.

    Only the terms some row uses are computed, and the prompt mask is built only for rows
    with a repetition penalty (the other rows get an all-False mask row, so a penalty of 1
    there costs nothing).
    """
    vocab, device = logits.shape[1], logits.device
    want_rep = any(p.repetition_penalty != 1 for p in params)
    want_freq = any(p.frequency_penalty != 0 for p in params)
    want_pres = any(p.presence_penalty != 0 for p in params)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)

    counts = None
    if want_freq or want_pres or want_rep:
        counts = torch.stack([h.output_counts(vocab, device) for h in histories])
    seen = repetition = None
    if want_rep:
        no_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        masks = [
            h.prompt_mask(vocab, device) if p.repetition_penalty != 1 else no_prompt
            for p, h in zip(params, histories, strict=True)
        ]
        seen = torch.stack(masks) | (counts > 0)
        repetition = column([p.repetition_penalty for p in params])
    return penalise(
        logits,
        seen=seen,
        counts=counts,
        repetition=repetition,
        frequency=column([p.frequency_penalty for p in params]) if want_freq else None,
        presence=column([p.presence_penalty for p in params]) if want_pres else None,
    )
