"""A third-party plugin package (contrib/ninfer-kv-toy): installed it is listed, probed and
used; not installed, it is gone."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer_core.kv.layout import KVLayout

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "contrib" / "ninfer-kv-toy"


def ninfer(*args: str, pythonpath: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("NINFER_PLUGINS", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-m", "ninfer_core.cli.main", *args, "--json"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def toy_installed() -> bool:
    try:
        importlib.metadata.distribution("ninfer-kv-toy")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def toy_target(tmp_path_factory) -> str:
    """The package pip-installed into a folder of its own: on sys.path = installed."""
    if toy_installed():
        pytest.skip("ninfer-kv-toy is installed in this environment; covered by the next tests")
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(TOY)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(target)


def kv_candidates(report: dict) -> dict[str, dict]:
    [kv] = [p for p in report["extension_points"] if p["point"] == "kv_codecs"]
    return {c["name"]: c for c in kv["candidates"]}


def test_installed_then_gone(toy_target):
    listed = {p["name"]: p for p in ninfer("plugins", pythonpath=toy_target)["plugins"]}
    assert listed["kv-toy"]["distribution"] == "ninfer-kv-toy"
    assert "KV codec toy-int16" in listed["kv-toy"]["provides"]
    report = ninfer("probe", "--kv-dtype", "toy-int16", pythonpath=toy_target)
    assert kv_candidates(report)["toy-int16"]["status"] == "chosen"
    gone = {p["name"] for p in ninfer("plugins")["plugins"]}
    assert "kv-toy" not in gone
    assert "toy-int16" not in kv_candidates(ninfer("probe"))


needs_install = pytest.mark.skipif(not toy_installed(), reason="ninfer-kv-toy not installed")


@needs_install
def test_pip_installed_plugin_is_listed_selected_and_refused():
    listed = {p["name"]: p for p in ninfer("plugins")["plugins"]}
    assert listed["kv-toy"]["distribution"] == "ninfer-kv-toy"
    cpu = kv_candidates(ninfer("probe", "--kv-dtype", "toy-int16"))["toy-int16"]
    assert cpu["status"] == "chosen" and cpu["distribution"] == "ninfer-kv-toy"
    gpu = kv_candidates(ninfer("probe", "--device-spec", "rtx3090"))["toy-int16"]
    assert gpu["status"] == "refused" and "CPU only" in gpu["reason"]


@needs_install
def test_toy_codec_round_trips_against_float64():
    from ninfer_kv_toy import ToyInt16Codec

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=6)
    store = ToyInt16Codec().allocate(layout, "cpu", compute_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(7, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(7, 2, 16, generator=gen, dtype=torch.float64)
    table = torch.tensor([5, 2])  # tokens 0..7 live in pages 5 then 2
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(7)])
    store.write(1, slots, k.float(), v.float())
    k_out, v_out = store.gather(1, table, length=7)
    bound = k.abs().amax(-1, keepdim=True) / 32767  # one quantisation step per vector
    assert ((k_out.double() - k).abs() <= bound).all()
    assert ((v_out.double() - v).abs() <= v.abs().amax(-1, keepdim=True) / 32767).all()
