"""Speculative decoding: drafts proposed by a `DraftStrategy` plugin, verified by the target.

- `types`: what the engine hands a drafter each step (`DraftInput`), what it gets back
  (`Proposal`), what a strategy sees of the target model (`DraftTarget`), and what its
  drafter will hold, for the memory plan (`DraftMemory`).
- `config`: `--spec`, `--draft-tokens`, `--lm-head-draft` (`SpecConfig`).
- `rejection`: the acceptance rule — greedy prefix match, and speculative rejection
  sampling that leaves the output distribution exactly the target's.
- `stats`: the counters people tune speculation by (vLLM's names on `/metrics`).

The mechanism lives in the engine (`engine/speculation.py`); strategies are plugins
(`ninfer_plugins/draft_*`), registered like any other.
"""
