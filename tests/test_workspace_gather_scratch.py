"""The workspace estimate reads a KV store's decode scratch from the `KVStore` contract
(`gather_scratch_bytes`), not from a codec's internals: the built-in codecs keep the figures
they had, and a third-party store's declaration is what the estimate counts."""

from __future__ import annotations

import pytest
import torch
from test_memory_plan import CFG

from ninfer_core.conformance import ContractError
from ninfer_core.kv.layout import KVLayout
from ninfer_core.kv.plain import PlainKVStore
from ninfer_core.memory.workspace import estimate_workspace, gather_scratch, probe_store
from ninfer_core.plugin_host import create_host

#: Bytes per gathered value beside the bf16 copy, as measured for each built-in store.
BUILT_IN_BF16 = {"int8": 12, "rk8v4": 12, "fp8": 12, "fp16": 2 + 2, "bf16": 0, "fp32": 4 + 2}


@pytest.mark.parametrize(("codec", "scratch"), list(BUILT_IN_BF16.items()))
def test_built_in_stores_declare_the_figures_they_had(codec, scratch):
    store = probe_store(create_host().kv_codecs.get(codec), 128, torch.bfloat16)
    assert gather_scratch(store) == scratch


class OldStore:
    """A store written before `gather_scratch_bytes` existed: every other member."""

    gather_heads = None
    rotation = None
    write_layers = None
    save_pages = load_pages = None
    raw_pages = None

    def __init__(self, layout, device, compute_dtype) -> None:
        self.layout, self.device = layout, torch.device(device)
        self.dtype, self.compute_dtype = torch.bfloat16, compute_dtype
        self.nbytes = 0

    def write(self, layer, slots, k, v) -> None: ...

    def gather(self, layer, block_table, length=None): ...


class DeclaringCodec:
    """A third-party codec whose plain store declares `scratch` bytes of decode scratch
    (`declare=False`: an `OldStore`, which does not declare it at all)."""

    name, description = "declaring", "test codec"

    def __init__(self, scratch: int | None, declare: bool = True) -> None:
        self.scratch, self.declare = scratch, declare

    def supports(self, device):
        raise AssertionError("not asked")

    def bytes_per_token(self, num_layers, num_kv_heads, head_dim) -> int:
        return 4 * num_layers * num_kv_heads * head_dim

    def allocate(self, layout: KVLayout, device, compute_dtype=None):
        if not self.declare:
            return OldStore(layout, device, compute_dtype)
        store = PlainKVStore(layout, torch.bfloat16, device, compute_dtype)
        store.gather_scratch_bytes = self.scratch
        return store


def estimate(codec) -> int:
    return estimate_workspace(
        CFG, dtype=torch.bfloat16, kv_codec=codec, prefill_chunk=256, context=4096
    ).parts["attention"]


def test_the_estimate_counts_what_the_store_declares():
    gathered = 4096 * CFG.num_kv_heads * CFG.head_dim  # one sequence's K (or V)
    assert estimate(DeclaringCodec(7)) - estimate(DeclaringCodec(None)) == 7 * gathered
    assert estimate(DeclaringCodec(None)) == estimate(create_host().kv_codecs.get("bf16"))


def test_a_store_that_does_not_declare_it_is_refused_naming_the_member():
    with pytest.raises(ContractError, match=r"no gather_scratch_bytes \(declare it"):
        estimate(DeclaringCodec(None, declare=False))
