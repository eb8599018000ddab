"""What speculation did: per request (`SpecUsage`) and per engine (`SpecCounters`).

The engine's totals use vLLM's meanings, so its dashboards read `/metrics` unchanged:
`num_drafts` counts rounds that verified at least one draft, `num_draft_tokens` the drafts
verified, `num_accepted_tokens` those the target accepted, and `accepted_per_pos[i]` the
rounds whose draft at position i (0-based) was accepted. A round yields its accepted drafts
plus one token of the target's own (the correction, or the bonus when all were accepted),
so tokens per round = 1 + accepted / rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecUsage:
    """One request's speculative rounds."""

    #: Rounds that verified at least one draft.
    rounds: int = 0
    #: Drafts verified, and how many of them the target accepted.
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens a verifying forward yielded on average (1 + accepted drafts)."""
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    def add(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted

    def to_json(self) -> dict[str, float | int]:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_round": round(self.tokens_per_round, 4),
        }


@dataclass
class SpecCounters(SpecUsage):
    """The engine's totals, with acceptance by draft position."""

    #: accepted_per_pos[i]: rounds whose draft at position i was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def num_drafts(self) -> int:
        return self.rounds

    def record(self, drafted: int, accepted: int) -> None:
        self.add(drafted, accepted)
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
