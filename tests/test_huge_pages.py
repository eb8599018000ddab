"""Weights moved into huge-page arenas and K/V pools collapsed in place
(`ninfer_core.memory.huge_pages`): the same tensor objects and values afterwards, views
still sharing their memory, storages viewed from outside left where they are, and a
model's forward unchanged bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.sequence import Sequence
from ninfer_core.generation import one_request_engine
from ninfer_core.loading import load_model
from ninfer_core.memory import huge_pages
from ninfer_core.plugin_host import create_host

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MIB = 1 << 20


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    return path.read_text().split("[")[1].split("]")[0]


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_consolidated_tensors_keep_their_values_identities_and_shared_memory():
    big = torch.randn(3 * MIB // 4)  # 3 MiB of fp32
    view = big[1000:5000].view(40, 100)  # another tensor over the same storage
    codes = torch.randint(0, 255, (300, 288), dtype=torch.uint8)  # small: many in one arena
    half = torch.randn(300, 18).half()
    kept = {name: t.clone() for name, t in {"big": big, "codes": codes, "half": half}.items()}
    ids = [id(t) for t in (big, view, codes, half)]
    report = huge_pages.consolidate([big, view, codes, half], min_bytes=0)
    assert [id(t) for t in (big, view, codes, half)] == ids
    assert torch.equal(big, kept["big"]) and torch.equal(codes, kept["codes"])
    assert torch.equal(half, kept["half"])
    assert view.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    assert torch.equal(view, kept["big"][1000:5000].view(40, 100))
    big[1000] = 7.0  # still one memory: a write shows through the view
    assert view[0, 0].item() == 7.0
    if huge_pages.unavailable() is None:
        assert report.moved == 3 * MIB + codes.numel() + half.numel() * 2
        # all four now in one arena, in the order given
        assert codes.data_ptr() > big.data_ptr() and half.data_ptr() > codes.data_ptr()
        assert big.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_a_storage_viewed_from_outside_the_list_stays_where_it_is():
    weights = torch.randn(MIB)  # 4 MiB
    outside = weights[10:]  # a view the caller does not list
    before = weights.data_ptr()
    report = huge_pages.consolidate([weights], min_bytes=0)
    assert weights.data_ptr() == before and outside.data_ptr() == before + 40
    assert report.moved == 0


def test_weights_smaller_than_the_least_worth_an_arena_stay_where_they_are():
    t = torch.randn(MIB)  # 4 MiB: less than MIN_CONSOLIDATED
    before = t.data_ptr()
    assert huge_pages.consolidate([t]).moved == 0 and t.data_ptr() == before


def test_switched_off_nothing_moves(monkeypatch):
    monkeypatch.setenv("NINFER_HUGE_PAGES", "0")
    t = torch.randn(MIB)
    before = t.data_ptr()
    report = huge_pages.consolidate([t], min_bytes=0)
    assert t.data_ptr() == before
    assert report.huge == 0 and report.moved == 0 and report.reason == "NINFER_HUGE_PAGES=0"
    assert "NINFER_HUGE_PAGES=0" in report.describe("weights")


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages here")
def test_where_the_kernel_grants_them_the_arenas_are_huge_pages():
    tensors = [torch.randn(256, 1024) for _ in range(24)]  # 24 MiB in 1 MiB pieces
    report = huge_pages.consolidate(tensors, min_bytes=0)
    assert report.moved == 24 * MIB
    if report.reason is None:  # every 2 MiB stretch asked for was collapsed
        assert report.huge == report.asked >= 24 * MIB
        assert _huge_bytes_at(tensors[0].data_ptr()) >= 24 * MIB


def test_collapse_leaves_the_pool_in_place():
    pool = torch.zeros(2, 4, MIB)  # 32 MiB, one allocation, its views handed out
    views = list(pool.unbind(0))
    before = pool.data_ptr()
    report = huge_pages.collapse(views)
    assert pool.data_ptr() == before and views[1].data_ptr() == before + 16 * MIB
    assert report.asked >= 28 * MIB and report.moved == 0


def _first_logits(monkeypatch, flag: str) -> tuple[torch.Tensor, int]:
    monkeypatch.setenv("NINFER_HUGE_PAGES", flag)
    monkeypatch.setattr(huge_pages, "MIN_CONSOLIDATED", 0)  # the built-in model is small
    host, device = create_host(), probe_device()
    runtime = RuntimeConfig(dtype="bf16", max_context=256)
    loaded = load_model(BUILTIN_ARTIFACT, host=host, device=device, runtime=runtime)
    engine = one_request_engine(loaded, host=host, device=device, runtime=runtime)
    seq = Sequence([(5 * i + 3) % 200 + 10 for i in range(40)])
    logits = [engine.runner.run([(seq, 40)])]
    for _ in range(4):
        seq.append_token(int(logits[-1][0].argmax()))
        logits.append(engine.runner.run([(seq, 1)]))
    ptr = loaded.model.layers[0].mlp.down_proj
    first = next(t for t in vars(ptr).values() if isinstance(t, torch.Tensor))
    return torch.cat(logits), first.data_ptr()


def test_a_models_forward_is_unchanged_bit_for_bit(monkeypatch):
    plain, plain_ptr = _first_logits(monkeypatch, "0")
    moved, moved_ptr = _first_logits(monkeypatch, "1")
    assert torch.equal(plain, moved)
    if huge_pages.unavailable() is None:
        assert moved_ptr != plain_ptr  # its weights did move
