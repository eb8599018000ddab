"""The deployment guide's own command plans on a 24 GiB RTX 3090 (docs/memory.md).

The guide serves a 27B hybrid (Qwen3.5-27B's shapes: 64 layers, 3 Gated DeltaNet to 1 gated
attention, one MTP layer) with rk8v4 KV at 184,320 tokens, two sequences at once and MTP
with three drafts through a reduced head. Its memory account on the card: weights 16.67 GiB,
KV pool 5.61 GiB, 1.02 GiB left after startup. The folder here is header-only (names and
shapes from transformers' own `Qwen3_5ForCausalLM` on the meta device, the data a sparse
hole), written by `tools/guide_model.py`; the command is the guide's, copied as it is.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from ninfer_core.cli.main import main as ninfer
from ninfer_core.cli.serve import main as serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import guide_model

GIB = 1 << 30
#: The guide's flags after MODEL, as it prints them.
GUIDE = shlex.split("""--host 0.0.0.0 --port 18020 --model-id qwen3.8-27b --api-key KEY
  --max-context 184320 --kv-capacity 184320
  --max-concurrency 2 --max-pending-requests 16 --pending-timeout-ms 900000
  --prefill-chunk 1024 --kv-dtype rk8v4 --spec mtp --draft-tokens 3 --lm-head-draft""")
CARD = ["--device-spec", "rtx3090"]


@pytest.fixture(scope="module")
def guide_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("guide-27b")
    params = guide_model.write_guide_model(path)
    assert round(params / 1e9, 2) == 27.32  # the guide's model, MTP layer included
    return path


@pytest.fixture(scope="module")
def guide_plan(guide_folder) -> dict:
    """`ninfer plan --json` of the guide's command (run once: ~5 s)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ninfer(["plan", str(guide_folder), *GUIDE, *CARD, "--json"]) == 0
    return json.loads(out.getvalue())


def test_the_guides_command_plans_with_a_gib_to_spare(guide_plan):
    plan = guide_plan
    assert plan["memory"]["free"] == 23 * GIB
    assert plan["free_after_bytes"] >= 1.0 * GIB
    # The bf16 checkpoint (50 GiB) does not fit: `--recipe auto` quantizes it by `mixed`.
    assert plan["weights_bytes"] <= 16.7 * GIB
    assert plan["weights_dtype"] == "fp16, mixed recipe (--recipe auto: fp16 did not fit)"
    assert plan["pool_tokens"] == 184320 and plan["kv_codec"] == "rk8v4"
    # 16 gated-attention layers of rk8v4: K int8 and V int4 of 4 heads x 256, scales per 64.
    assert plan["kv_bytes_per_token"] == 16 * 4 * (256 + 128 + 2 * 4 * 2)
    assert plan["draft_strategy"] == "mtp"
    # The MTP layer at the recipe's widths, and the reduced head built while loading:
    # 131,072 rows of 5120 at 4 bits plus an fp16 scale per 64.
    head = 131_072 * (5120 // 2 + 5120 // 64 * 2)
    assert plan["draft"]["weights_bytes"] > head
    assert plan["draft"]["table_bytes"] >= 131_072 * 8  # the id map, int64
    # Triton's attention reads the pages in place: the workspace holds no context.
    assert plan["workspace"]["method"] == "estimate"
    assert plan["workspace"]["nbytes"] < 0.5 * GIB


def test_the_same_command_through_ninfer_serve_dry_run(guide_folder, guide_plan, capsys):
    """`ninfer-serve --dry-run` plans exactly as `ninfer plan` and exits 0 without loading."""
    with pytest.raises(SystemExit) as ended:  # ninfer-serve leaves with os._exit: patched
        _serve_exiting([str(guide_folder), *GUIDE, *CARD, "--dry-run"])
    assert ended.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"memory plan for {guide_folder} on NVIDIA GeForce RTX 3090")
    free = next(line for line in out.splitlines() if line.startswith("free after startup"))
    assert float(free.split()[3]) == round(guide_plan["free_after_bytes"] / GIB, 2)
    assert "listening" not in out


def test_a_simulated_card_only_plans(guide_folder, capsys):
    assert serve([str(guide_folder), *CARD]) == 2  # refused before anything starts
    assert "--device-spec plans for a card this machine may not have" in capsys.readouterr().err


def _serve_exiting(argv: list[str]) -> None:
    """`ninfer-serve` ends the process with `os._exit`; here that becomes SystemExit."""
    import os

    real = os._exit
    os._exit = sys.exit  # type: ignore[assignment]
    try:
        serve(argv)
    finally:
        os._exit = real
