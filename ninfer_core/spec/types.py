"""The data a draft strategy exchanges with the engine (the contract's value types).

A step's forward computes some positions of each running sequence: a prefill chunk, or a
decoding sequence's pending token plus the drafts it was verifying. After verification the
engine calls `Drafter.propose` once with a `DraftInput` per sequence that ran: the
positions whose K/V are now kept (rejected drafts already rolled back), the target's final
hidden states of exactly those positions (for a drafter that reads them), and how many
drafts it may propose to follow the sequence's last, not yet computed, token. The drafter
answers with a `Proposal` per input; the next step verifies it.

Positions are the sequence's own token indices. Token `j`'s K/V live in page
`block_table[j // block_size]` at offset `j % block_size`; a drafter that keeps per-token
state of its own (the MTP layer's K/V) keeps it in a pool of the same page geometry,
indexed by the same block table, so it needs no allocator: the engine has already grown
`block_table` to cover every position the drafts can reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ninfer_core.model.config import ModelConfig
    from ninfer_core.plugin_types import Artifact, CausalLM, KVCodec


@dataclass(frozen=True, slots=True)
class DraftInput:
    """One sequence after a step's verification."""

    seq_id: int
    #: Every accepted token, prompt first. When `max_drafts > 0` the last one is the token
    #: the drafts follow: sampled, not yet run through the target (its K/V are not written).
    token_ids: Sequence[int]
    #: Positions `start:end` were computed by this step's forward and kept: a prefill
    #: chunk, or a decode's pending token plus its accepted drafts. `end` is the
    #: sequence's computed-token count now, except on a model with state after a round
    #: that rejected a draft: that round is replayed (`engine/speculation.py`), its
    #: computed count is back at `start` and the next step's input starts there again,
    #: so a drafter that keeps per-position state (the MTP layer's K/V) rewrites it from
    #: `start` on, whatever it saw before.
    start: int
    end: int
    #: Pages of the sequence, covering positions `0 : end + max_drafts` at least.
    block_table: Sequence[int]
    #: Drafts to propose at most (0: still prefilling, or no room before `max_tokens`);
    #: a drafter may propose fewer, or none.
    max_drafts: int
    #: The target's final hidden states (after the final norm) of positions `start:end`,
    #: [end - start, hidden], when the drafter's `uses_hidden`; None otherwise.
    hidden: torch.Tensor | None = None
    #: Of the drafts proposed for it last step, how many the target accepted (None: it
    #: verified no drafts this step).
    accepted: int | None = None


@dataclass(frozen=True, slots=True)
class Proposal:
    """Up to `max_drafts` tokens to follow a sequence's last token, in order."""

    token_ids: Sequence[int] = ()
    #: [len(token_ids), vocab] fp32: the distribution q each draft was drawn from, for
    #: rejection sampling. None: every draft is one-hot (q = 1 at the draft token), as for
    #: argmax and n-gram drafts.
    probs: torch.Tensor | None = None


#: Nothing to propose (a sequence still prefilling, or no match).
NO_PROPOSAL = Proposal()


#: Rows of a reduced head built while loading, as upstream NInfer's (of Qwen3.5's 248,320).
DEFAULT_DRAFT_ROWS = 131_072


@dataclass(frozen=True)
class DraftOptions:
    """What the user asked of speculation (`SpecConfig`, checked)."""

    #: Drafts per round at most (`--draft-tokens`).
    num_tokens: int = 3
    #: `--lm-head-draft`: while drafting only, a reduced head of the most frequent tokens.
    lm_head_draft: bool = False
    #: `--draft-vocab`: rows of a reduced head built while loading (the artifact ships none).
    draft_vocab: int = DEFAULT_DRAFT_ROWS


@dataclass(frozen=True)
class DraftTarget:
    """What a strategy sees of the model it drafts for."""

    #: The opened artifact: a strategy reads its own weights from it (`mtp.*`, `draft_head.*`).
    artifact: Artifact
    config: ModelConfig
    #: The loaded target (`embed`, `compute_logits`, `ops`, `dtype`), to share embedding
    #: and head with, and to compute with the same kernels; its `mtp_layer` is its
    #: family's MTP layer, for a drafter that runs it (None: a dense one).
    model: CausalLM
    #: The codec of the target's KV pool: a drafter with K/V of its own allocates them with
    #: it, in the same page geometry (`block_size` × `num_blocks`).
    kv_codec: KVCodec
    block_size: int
    num_blocks: int
    device: torch.device
    #: The engine runs its steps through compiled graphs (`--compile-decode`): a drafter
    #: may capture its own small forwards too (the `mtp` draft steps do).
    compile_steps: bool = False


@dataclass(frozen=True, slots=True)
class DraftMemory:
    """What a strategy's drafter will hold on the device, answered before anything loads
    (`DraftStrategy.memory`), so the startup memory plan counts it beside the target's.

    The plan adds `fixed_bytes` to what it subtracts before sizing the KV pool, and
    `kv_bytes_per_token` to the cost of every token of the pool: a drafter's per-token
    state lives in pages of the target's geometry, as many pages as the target's pool.
    """

    #: Its own weights as loaded and packed (an MTP layer, a reduced head); the target's
    #: embedding and head, which it shares, are the target's.
    weights_bytes: int = 0
    #: Other buffers of a fixed size it keeps for its lifetime (lookup tables, id maps).
    table_bytes: int = 0
    #: Its K/V (or other state) per token of the pool's pages, over all its layers.
    kv_bytes_per_token: int = 0

    @property
    def fixed_bytes(self) -> int:
        """What it holds whatever the pool's size: weights and tables."""
        return self.weights_bytes + self.table_bytes
