"""Helpers shared by the speculative-decoding tests: a scripted drafter put in a strategy's
place, stepping an engine to the end while counting its mixed steps, and the `DraftTarget`
a strategy is built for on the CPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_core.engine.engine import Engine
from ninfer_core.loading import LoadedModel
from ninfer_core.spec.types import DraftInput, DraftOptions, DraftTarget, Proposal


class ScriptedDrafter:
    """Proposes what the reference run produced after the sequence's tokens, with every
    `wrong_every`-th proposed token replaced by another id (so rounds reject too).

    It keeps every input it was given (`inputs`: what the engine told it, e.g. `accepted`)
    and every sequence it was told had ended (`released`)."""

    uses_hidden = False

    def __init__(self, references: list[list[int]], wrong_every: int = 4) -> None:
        self.references, self.wrong_every = references, wrong_every
        #: The target's vocabulary size, set by `speculate_with` (a wrong id stays in it).
        self.vocab = 0
        self.calls = 0
        self.inputs: list[DraftInput] = []
        self.released: list[int] = []

    def propose(self, inputs: Sequence[DraftInput]) -> list[Proposal]:
        out = []
        for item in inputs:
            self.inputs.append(item)
            tokens = list(item.token_ids)
            ref = next((r for r in self.references if r[: len(tokens)] == tokens), None)
            if ref is None or not item.max_drafts:
                out.append(Proposal())
                continue
            drafts = ref[len(tokens) : len(tokens) + item.max_drafts]
            for i in range(len(drafts)):
                self.calls += 1
                if self.calls % self.wrong_every == 0:
                    drafts[i] = (drafts[i] + 1) % self.vocab
            out.append(Proposal(drafts))
        return out

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


def speculate_with(engine: Engine, drafter: ScriptedDrafter, k: int) -> Engine:
    """`engine` with `drafter` in place of a strategy's (what `--spec` would build), told the
    target's vocabulary size as a strategy learns it from its `DraftTarget`."""
    drafter.vocab = engine.vocab_size
    engine.drafter, engine.spec_name, engine.spec_options = drafter, "scripted", DraftOptions(k)
    return engine


def mixed_steps(engine: Engine) -> int:
    """Step `engine` until it has no work, checking its invariants after every step; the
    number of steps that ran a prefill chunk beside decodes (rounds)."""
    mixed = 0
    while engine.has_work:
        outcome = engine.step()
        mixed += bool(outcome.prefill) and bool(outcome.decode)
        engine.check_invariants()
    return mixed


def cpu_target(loaded: LoadedModel, host, *, block_size: int, num_blocks: int) -> DraftTarget:
    """What a strategy sees of `loaded` on the CPU, with an fp32 KV pool of `num_blocks` pages
    of `block_size` tokens (the engine builds its own in `engine/speculation.py`)."""
    return DraftTarget(
        artifact=loaded.artifact,
        config=loaded.config,
        model=loaded.model,
        kv_codec=host.kv_codecs.get("fp32"),
        block_size=block_size,
        num_blocks=num_blocks,
        device=torch.device("cpu"),
    )
