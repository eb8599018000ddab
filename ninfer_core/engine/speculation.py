"""Speculative rounds in the engine: choose the drafter, verify its drafts, hand it the step.

A decoding sequence with k drafts runs k + 1 tokens in the step's one forward (its pending
token, then the drafts), beside the other sequences' decode tokens and prefill chunks; the
forward's logits rows verify the drafts (`verify`). Rejected drafts are rolled back by
rewinding the sequence's computed-token count: their K/V slots lie past it and the next
forward writes over them, so nothing is copied. Tokens are accepted one at a time through
the same path a non-speculative step takes (`Postprocessor.accept`), with the computed count and
the prefix cache's commit advanced before each, so penalties, stop strings, `max_tokens` and
the cache index see exactly what a run without speculation sees. The prefix cache indexes
only full blocks of computed tokens, and the count never covers a rejected draft, so no
cached block ever holds one.

Drafts never reach past `max_tokens` (`max_drafts`), so the pages reserved at admission for
prompt plus `max_tokens` already cover every position a round can write: admission needs
no extra reservation, and a round never waits for pages.

**Models with per-sequence state** (the hybrid Gated DeltaNet family) cannot rewind a
count: after the forward, each state layer's state has consumed all k + 1 tokens, drafts
included. Such a round is rolled back by *replay from the last committed state*. Right after
the forward the state is put back to the step's start (`SequenceStatePool.revert`: the
double buffer still holds it) and the computed count with it (`rewind_states`); the round
is verified without moving either. If every draft was accepted, the step's state is made
current again (`settle_state`). Otherwise the sequence's pending tokens are now the ones the
forward began with, the accepted drafts and the correction token, and the next step runs
them all again, beside the drafts proposed after them. A request that ends inside a round
thus always ends with a state of tokens it kept (`Sequence.state_position`), and the prefix
cache is committed once, after a fully accepted round, never for a page a replay rewrites.

Why replay and not one state per draft position (vLLM's way): per-draft slots need k + 1
more states per sequence. A Qwen3.6-27B-shaped model (48 Gated DeltaNet layers) keeps
149.5 MiB of fp32 state per sequence, so at k = 3 that is 4 x 149.5 MiB ~ 598 MiB more per
sequence, while its q4 plan on a 24 GiB RTX 3090 is already 0.37 GiB short. Replay needs no
memory beyond the existing double buffer, and the replayed rows ride in the next forward,
which in a memory-bound decode step reads the weights once for all its rows. Its cost: after
a round that rejected a draft, the next forward re-runs the j + 1 accepted tokens before the
correction token. `max_drafts` keeps each sequence at k + 1 rows a step at most (replayed
rows take the place of drafts), so a drafter that keeps missing cannot make the replay grow:
once the pending tokens fill the k + 1 rows the step runs them without drafts and commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ninfer_core import conformance
from ninfer_core.engine.sequence import Sequence as Seq
from ninfer_core.errors import UnsupportedChoiceError
from ninfer_core.kv.state import SequenceStatePool
from ninfer_core.plugin_types import Drafter
from ninfer_core.sampling import Sampler
from ninfer_core.sampling.sampler import draw
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.rejection import accept_row, greedy_round, speculative_round
from ninfer_core.spec.stats import SpecUsage
from ninfer_core.spec.types import DraftInput, DraftOptions, DraftTarget

log = logging.getLogger(__name__)


def build_drafter(
    host, device, loaded, runtime, config: SpecConfig
) -> tuple[str, Drafter, DraftOptions]:
    """The drafter `--spec` names for `loaded` on `device`: (strategy name, drafter, options).

    Refused at startup, never in a request: a strategy the device refuses, or one that needs
    what the model lacks (MTP weights, a draft head), raises `UnsupportedChoiceError` with
    the reason and the strategies that would run.
    """
    from ninfer_core.selection import choose

    name = choose(host, "draft_strategies", device, config.spec).chosen
    options = config.options
    target = DraftTarget(
        artifact=loaded.artifact,
        config=loaded.config,
        model=loaded.model,
        kv_codec=host.kv_codecs.get(runtime.kv_codec),
        block_size=runtime.block_size,
        num_blocks=runtime.block_manager.num_blocks,
        device=next(loaded.model.parameters()).device,
        compile_steps=runtime.runner.compiled is not None,
    )
    strategies = {e.name: e.obj for e in host.draft_strategies.entries()}
    support = strategies[name].supports_model(target, options)
    if not support.ok:
        others = [
            other
            for other, strategy in strategies.items()
            if other != name and _model_ok(strategy, target, options)
        ]
        raise UnsupportedChoiceError(
            f"--spec {name}: {support.reason}; strategies this model supports: "
            f"{', '.join(others) or 'none'}"
        )
    drafter = strategies[name].create(target, options)
    conformance.check(drafter, Drafter, f"the drafter draft strategy {name!r} created")
    refusal = runtime.runner.compile_rounds(options.num_tokens)
    if refusal is not None:  # the rounds run eagerly; only their speed differs
        log.warning("--compile-decode: speculative rounds run eagerly: %s", refusal)
    return name, drafter, options


def _model_ok(strategy, target: DraftTarget, options: DraftOptions) -> bool:
    try:
        return strategy.supports_model(target, options).ok
    except Exception:  # a probe that crashes refuses
        return False


@dataclass
class Round:
    """One sequence's drafts under verification, taken off the sequence for the step."""

    drafts: list[int]
    #: [k, vocab] draft distributions, or None for one-hot drafts.
    probs: torch.Tensor | None
    #: The sequence's tokens with its pending ones but no draft (L + 1): the position of
    #: the first draft.
    base: int

    @classmethod
    def take(cls, seq: Seq) -> Round:
        drafts, probs = seq.draft_ids, seq.draft_probs
        seq.draft_ids, seq.draft_probs = [], None
        return cls(drafts, probs, len(seq.token_ids))


def verify(
    seq: Seq,
    round_: Round,
    choose_row: Callable[[int], tuple[int, bool]],
    accept: Callable[[int], bool],
    advance: Callable[[int], None],
    usage: SpecUsage,
) -> int:
    """Accept tokens of one round in order; returns how many drafts were accepted.

    `choose_row(i)` decides row i (the token to emit and whether it is draft i accepted);
    `accept(token)` hands a token to the request and says whether the request ended.
    `advance(n)` comes before each token, n being the tokens before it (`round_.base + i`):
    the engine makes the computed count cover them and indexes the blocks that became full,
    as a step without speculation would have (a model with state keeps both at the step's
    start instead, see the module). `usage` counts the round before any token goes out, so
    the usage a finishing token reports has it.
    """
    usage.add(len(round_.drafts), 0)
    accepted = 0
    for i in range(len(round_.drafts) + 1):
        advance(round_.base + i)
        token, is_draft = choose_row(i)
        accepted += is_draft
        usage.accepted += is_draft
        if accept(token) or not is_draft:
            break
    return accepted


class RowChooser:
    """How one request's verification rows become tokens (greedy, or rejection sampling).

    Without penalties a row's distribution does not depend on which drafts before it were
    accepted, so the whole round is decided at once (`greedy_round`, `speculative_round`:
    one argmax or one softmax for every row). With penalties, each row is penalised over
    the tokens accepted so far and decided as it comes (`accept_row`)."""

    def __init__(self, sampler: Sampler, live, round_: Round, rows: torch.Tensor) -> None:
        self.sampler, self.live, self.round, self.rows = sampler, live, round_, rows
        params = self.params = live.request.params
        #: The round's tokens when decided at once (accepted drafts, then one more).
        self.tokens: list[int] | None = None
        if params.greedy and not params.has_penalties:
            self.tokens = greedy_round(rows.argmax(dim=-1).tolist(), round_.drafts)
        elif not params.has_penalties:
            m, history = rows.shape[0], live.history
            p = sampler.probabilities(rows, [params] * m, [history] * m)
            generator = sampler.generator_for(params, history, p.device)
            self.tokens = speculative_round(p, round_.drafts, round_.probs, generator)

    def __call__(self, i: int) -> tuple[int, bool]:
        if self.tokens is not None:
            return self.tokens[i], i < len(self.tokens) - 1
        drafts = self.round.drafts
        # The row's distribution after penalties over the tokens accepted so far (the
        # history grows as tokens are accepted), exactly what `Sampler.sample` draws from.
        live = self.live
        p = self.sampler.probabilities(self.rows[i : i + 1], [self.params], [live.history])[0]
        if self.params.greedy:  # one-hot: no draw
            token = int(p.argmax())
            return token, i < len(drafts) and token == drafts[i]
        generator = self.sampler.generator_for(self.params, live.history, p.device)
        if i == len(drafts):  # every draft accepted: the bonus token from the last row
            return int(draw(p[None], generator)[0]), False
        q = None if self.round.probs is None else self.round.probs[i]
        return accept_row(p, drafts[i], q, generator)


def max_drafts(seq: Seq, k: int) -> int:
    """Drafts `seq` may propose: none while prefilling, never past `max_tokens`, and no
    more than leave its next step at k + 1 rows.

    A round writes K/V up to position `len(token_ids) - 1 + drafts`; staying below
    `max_length` keeps it inside the pages admission reserved. A sequence has one pending
    token, except on a state model after a rolled-back round (the tokens it replays): those
    take the place of drafts, so a drafter that keeps missing cannot grow the replay past
    k + 1 rows, and a step whose pending tokens fill them commits the state.
    """
    if seq.is_prefilling:
        return 0
    room = min(k + 1 - seq.num_pending_tokens, seq.max_length - len(seq.token_ids))
    return max(0, room)


def kept_end(seq: Seq) -> int:
    """The end of the positions a step computed and kept: the computed count while the
    prompt is prefilled; after that every token but the pending last one, which on a state
    model after a rolled-back round is past the computed count (rewound for the replay)."""
    if seq.is_prefilling:
        return seq.num_computed_tokens
    return len(seq.token_ids) - 1


def draft_input(
    seq: Seq,
    start: int,
    end: int,
    offset: int,
    hidden: torch.Tensor | None,
    budget: int,
    accepted: int | None,
) -> DraftInput:
    """What the drafter learns of `seq` after a step whose forward began at position
    `start` and kept positions up to `end` (`kept_end`), its rows at `offset` of the flat
    batch."""
    rows = None if hidden is None else hidden[offset : offset + end - start]
    return DraftInput(
        seq_id=seq.seq_id,
        token_ids=seq.token_ids,
        start=start,
        end=end,
        block_table=seq.block_table,
        max_drafts=budget,
        hidden=rows,
        accepted=accepted,
    )


def rewind_states(
    states: SequenceStatePool, batch: Sequence[tuple[Seq, int]], starts: dict[int, int]
) -> None:
    """Right after the forward, put each round's state and computed count back to where
    its forward began (`starts`, by sequence id), before anything can end its request: the
    state then never counts a draft, whatever happens to the round (see the module)."""
    for seq, _ in batch:
        if seq.draft_ids:
            states.revert(seq.state_slot)
            seq.state_position = seq.num_computed_tokens = starts[seq.seq_id]


def settle_state(states: SequenceStatePool, seq: Seq, round_: Round, accepted: int) -> bool:
    """After verifying a round of a state model whose request still runs: True when every
    draft was accepted, and the step's state, which consumed exactly the kept tokens, is
    current again; else the state stays at the forward's start and the next step replays."""
    if accepted < len(round_.drafts):
        return False
    states.revert(seq.state_slot)  # the second revert in the window: the step's state
    seq.state_position = seq.num_computed_tokens = round_.base + accepted
    return True


def apply_proposals(
    seqs: Sequence[Seq], inputs: Sequence[DraftInput], proposals: Sequence, vocab: int
) -> None:
    """Put each proposal on its sequence, cut to its budget; a malformed one is dropped."""
    if len(proposals) != len(inputs):
        raise ValueError(f"{len(proposals)} proposals for {len(inputs)} sequences")
    for seq, item, proposal in zip(seqs, inputs, proposals, strict=True):
        ids = [int(t) for t in proposal.token_ids][: item.max_drafts]
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"a draft token id is outside [0, {vocab})")
        probs = proposal.probs
        if probs is not None and ids:
            if probs.dim() != 2 or probs.shape[0] < len(ids) or probs.shape[1] != vocab:
                raise ValueError(f"draft probabilities of shape {tuple(probs.shape)}")
            probs = probs[: len(ids)].float()
        seq.draft_ids, seq.draft_probs = ids, (probs if ids else None)


__all__ = [
    "Round",
    "RowChooser",
    "apply_proposals",
    "build_drafter",
    "draft_input",
    "kept_end",
    "max_drafts",
    "rewind_states",
    "settle_state",
    "verify",
]
