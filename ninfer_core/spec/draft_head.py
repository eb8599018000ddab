"""The head a drafter picks its tokens with: the model's own, or a reduced one (`--lm-head-draft`).

Drafting runs the head once per draft token; over a 150k vocabulary that GEMV reads as many
bytes as a few decoder layers. `--lm-head-draft` replaces it, while drafting only, by the rows
of the N tokens the target most often produces (ranked over a corpus by how often the
target's argmax was that token; special tokens always kept; rows in rank order), with an id
map back to real token ids. Verification always uses the full head, so the output is the
same either way; a reduced head only changes how often drafts are accepted.

In a `.ninfer` artifact the reduced head is the component `draft_head` (written by
`ninfer draft-head build`): `draft_head.weight` [N, hidden] in the head's format and
`draft_head.token_ids` [N], the real id of each row.
"""

from __future__ import annotations

from typing import Protocol

import torch

#: The artifact component and tensor names of a reduced draft head.
COMPONENT = "draft_head"
WEIGHT = "draft_head.weight"
TOKEN_IDS = "draft_head.token_ids"


class DraftHead(Protocol):
    """Turns a drafter's final hidden states into draft token ids (real vocabulary ids)."""

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> [R] int64, each row's most likely token."""
        ...


class FullHead:
    """The target's own head (`CausalLM.compute_logits`)."""

    def __init__(self, model) -> None:
        self.model = model

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).argmax(dim=-1)
