"""`SequenceStatePool`: the per-sequence states of a model's state layers, one slot each.

A layer that declares a `SequenceState` (`ninfer_core.model.caches`) keeps a fixed-size
state per running sequence. The pool holds `num_slots` of them per layer; the engine gives
a sequence a slot when it is admitted (zeroed: a sequence starts from the zero state) and
takes it back when the sequence ends, however it ends.

Every slot is double-buffered. A step reads each sequence's current state and writes the
next one into the slot's other buffer; only when the whole forward has succeeded does
`StepStates.commit` make the written buffer current. A forward that raises half-way
leaves every state as it was before the step, so the engine can re-run the step sequence
by sequence (`engine/faults.py`) without applying any update twice, exactly as re-writing
the same paged K/V slots is harmless. The price is twice the state memory, which the
memory plan counts (`STATE_BUFFERS`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_core.errors import NInferError
from ninfer_core.model.caches import ModelCaches

#: Buffers per slot: the current state and the one a step writes.
STATE_BUFFERS = 2


class OutOfStateSlotsError(NInferError):
    """Every state slot is taken (admission checks `num_free` first)."""


class SequenceStatePool:
    """`num_slots` per-sequence states of every state layer of a model, on `device`."""

    def __init__(self, caches: ModelCaches, num_slots: int, device: torch.device | str) -> None:
        if num_slots <= 0:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots, self.device = num_slots, torch.device(device)
        #: layer -> one [STATE_BUFFERS * num_slots, *shape] tensor per state tensor; row
        #: `buffer * num_slots + slot`.
        self.buffers: dict[int, tuple[torch.Tensor, ...]] = {
            layer: tuple(
                torch.zeros(STATE_BUFFERS * num_slots, *t.shape, dtype=t.dtype, device=device)
                for t in state.tensors
            )
            for layer, state in caches.state_layers.items()
        }
        #: Which buffer of each slot is current.
        self.current = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self._free = list(range(num_slots))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in self.buffers.values() for b in bufs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot, its current state zeroed."""
        if not self._free:
            raise OutOfStateSlotsError(f"all {self.num_slots} sequence state slots are taken")
        slot = self._free.pop(0)
        row = int(self.current[slot]) * self.num_slots + slot
        for bufs in self.buffers.values():
            for buf in bufs:
                buf[row].zero_()
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not taken")
        self._free.append(slot)

    def revert(self, slot: int) -> None:
        """Make `slot`'s state before its last step current again: a speculative round
        that rejected a draft consumed tokens the sequence does not keep, and the state
        before the step is still in the slot's other buffer (`engine/speculation.py`).

        Valid only after the step that wrote the slot and before the next step writes it
        (that step overwrites the buffer this makes stale); reverting twice in that window
        makes the step's state current again.
        """
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not taken")
        self.current[slot] = 1 - self.current[slot]

    def step(self, slots: Sequence[int]) -> StepStates:
        """The states of one step's sequences, in batch order (one slot per sequence)."""
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        return StepStates(self, index)

    def check_invariants(self, held: Sequence[int]) -> None:
        """Raise AssertionError unless every slot is either free or held, exactly once."""
        free, held = list(self._free), list(held)
        problems = []
        if len(set(free)) != len(free) or len(set(held)) != len(held):
            problems.append(f"a state slot is listed twice: free {free}, held {held}")
        if set(free) & set(held):
            problems.append(f"state slots both free and held: {sorted(set(free) & set(held))}")
        if len(set(free) | set(held)) != self.num_slots:
            problems.append(f"free {sorted(free)} + held {sorted(held)} != {self.num_slots} slots")
        if problems:
            raise AssertionError("; ".join(problems))

    @property
    def bytes_per_snapshot(self) -> int:
        """Bytes `save` copies: one buffer of one slot, every state layer."""
        return self.nbytes // (STATE_BUFFERS * self.num_slots)

    def save(self, slot: int) -> dict[int, tuple[torch.Tensor, ...]]:
        """Copies of `slot`'s current state, per layer (a prefix-cache snapshot,
        `engine/state_snapshots.py`): the state after the tokens the slot has consumed."""
        row = int(self.current[slot]) * self.num_slots + slot
        return {layer: tuple(b[row].clone() for b in bufs) for layer, bufs in self.buffers.items()}

    def restore(self, slot: int, saved: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """Make `saved` (from `save`) `slot`'s current state, as if it had consumed the
        tokens the saved slot had."""
        row = int(self.current[slot]) * self.num_slots + slot
        for layer, bufs in self.buffers.items():
            for buf, value in zip(bufs, saved[layer], strict=True):
                buf[row].copy_(value)


class StepStates:
    """What a forward sees of the state pool: read the batch's current states, write the
    next ones; `commit` (by the runner, after the forward) makes them current."""

    def __init__(self, pool: SequenceStatePool, slots: torch.Tensor) -> None:
        self.pool, self.slots = pool, slots
        current = pool.current[slots]
        self._read = current * pool.num_slots + slots
        self._write = (1 - current) * pool.num_slots + slots
        self._written: set[int] = set()

    @property
    def batch_size(self) -> int:
        return int(self.slots.shape[0])

    @property
    def read_rows(self) -> torch.Tensor:
        """[B] int64: the rows of each state buffer holding the batch's current states
        (what a graph reads; `read` selects them)."""
        return self._read

    def read(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s states of the batch: one [B, *shape] tensor per state tensor."""
        return tuple(buf.index_select(0, self._read) for buf in self.pool.buffers[layer])

    def write(self, layer: int, values: Sequence[torch.Tensor]) -> None:
        """The batch's next states of layer `layer` (as `read` returns them)."""
        bufs = self.pool.buffers[layer]
        if len(values) != len(bufs):
            raise ValueError(f"layer {layer} keeps {len(bufs)} state tensors, got {len(values)}")
        for buf, value in zip(bufs, values, strict=True):
            buf.index_copy_(0, self._write, value.to(buf.dtype))
        self._written.add(layer)

    def commit(self) -> None:
        """The written states become current. Every state layer must have written: a
        layer that did not would make a stale buffer current."""
        missing = sorted(set(self.pool.buffers) - self._written)
        if missing:
            raise RuntimeError(f"state layers {missing} wrote no state this step")
        self.pool.current[self.slots] = 1 - self.pool.current[self.slots]
