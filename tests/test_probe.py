"""Capability probing and selection: simulated cards, refusals with reasons, `ninfer probe`."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from ninfer_core import hookimpl
from ninfer_core.cli.main import main
from ninfer_core.device import DEVICE_SPECS, probe_device, simulated_device
from ninfer_core.errors import UnknownNameError, UnsupportedChoiceError
from ninfer_core.plugin_host import create_host
from ninfer_core.selection import choose, probe
from ninfer_core.support import Support


class Fp8LikeCodec:
    """Stands in for a codec that needs SM89+ (as e4m3 KV does)."""

    name = "fp8-test"
    description = "test codec that needs SM89"

    def supports(self, device) -> Support:
        if device.cuda is None:
            return Support.no("needs a CUDA device")
        if device.cuda.sm_version < 89:
            return Support.no(f"needs SM89 or newer, found SM{device.cuda.sm_version}")
        return Support.yes()

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_layers * num_kv_heads * head_dim

    def allocate(self, layout, device, compute_dtype=None):
        raise NotImplementedError("never allocated: this test codec only answers supports()")


@hookimpl
def register_kv_codecs():
    return [Fp8LikeCodec()]


def host_with_fp8():
    return create_host(extra_plugins=[("fp8-test", types.SimpleNamespace(
        register_kv_codecs=register_kv_codecs))])  # fmt: skip


def test_real_cpu_probe_reads_this_machine():
    device = probe_device(use_cuda=False)
    assert device.kind == "cpu"
    assert device.cpu.cores >= 1
    assert device.cpu.memory_bytes > 1 << 30
    assert device.torch_device == "cpu"


@pytest.mark.parametrize(
    ("spec", "sm", "gib"),
    [("rtx3090", 86, 24), ("rtx4090", 89, 24), ("h100", 90, 80), ("h200", 90, 141)],
)
def test_simulated_cards(spec, sm, gib):
    device = simulated_device(spec)
    assert device.kind == "cuda"
    assert device.cuda.sm_version == sm
    assert device.cuda.total_memory == gib << 30
    assert device.simulated == spec
    assert simulated_device("cpu").cuda is None


def test_unknown_device_spec_lists_known_ones():
    with pytest.raises(UnknownNameError, match="rtx3090"):
        simulated_device("rtx9999")


def test_sm86_refuses_an_sm89_codec_with_the_reason_and_alternatives():
    host = host_with_fp8()
    report = choose(host, "kv_codecs", simulated_device("rtx3090"), "auto")
    by_name = {c.name: c for c in report.candidates}
    assert by_name["fp8-test"].status == "refused"
    assert "SM89" in by_name["fp8-test"].reason and "SM86" in by_name["fp8-test"].reason
    assert report.chosen == "fp16"
    with pytest.raises(UnsupportedChoiceError) as info:
        choose(host, "kv_codecs", simulated_device("rtx3090"), "fp8-test")
    message = str(info.value)
    assert "--kv-dtype fp8-test" in message and "SM89" in message
    assert "fp16" in message  # names the alternatives


def test_sm89_takes_the_codec_that_sm86_refuses():
    host = host_with_fp8()
    report = choose(host, "kv_codecs", simulated_device("rtx4090"), "fp8-test")
    assert report.chosen == "fp8-test"


def test_unknown_backend_name_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="torch"):
        choose(create_host(), "kernel_backends", probe_device(use_cuda=False), "tirton")


def test_auto_backend_on_cpu_is_torch():
    reports = {r.point: r for r in probe(create_host(), probe_device(use_cuda=False))}
    assert reports["kernel_backends"].chosen == "torch"
    assert reports["kv_codecs"].chosen == "bf16"
    readers = reports["artifact_readers"].candidates
    assert [c.status for c in readers if c.name == "hf-safetensors"] == ["available"]


def test_probe_cli_json(capsys):
    assert main(["probe", "--device-spec", "rtx3090", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"]["cuda"]["sm"] == [8, 6]
    points = {p["point"]: p for p in out["extension_points"]}
    assert points["kv_codecs"]["chosen"] == "fp16"
    assert {c["name"] for c in points["kernel_backends"]["candidates"]} >= {"torch"}


def test_probe_cli_text_and_forced_refusal(capsys):
    assert main(["probe", "--device-spec", "h100"]) == 0
    out = capsys.readouterr().out
    assert "SM90" in out and "kv codecs -> fp16" in out
    assert main(["probe", "--gemm-backend", "nope"]) == 1
    known = capsys.readouterr().err.split("known kernel backends: ")[1]  # installed ones too
    assert "torch" in known.strip().split(", ")


def test_plugins_cli_lists_distributions(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["plugins"]}
    assert rows["kv-plain"]["distribution"] == "ninfer"
    assert any(item == "KV codec fp16" for item in rows["kv-plain"]["provides"])


def test_importing_the_core_touches_no_gpu_stack():
    code = (
        "import sys, ninfer_core, ninfer_core.hookspecs, ninfer_core.plugin_host, "
        "ninfer_core.selection, ninfer_core.device\n"
        "bad = [m for m in ('triton', 'cupy', 'torch.cuda') if m in sys.modules]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_device_spec_has_a_name():
    for key, cuda in DEVICE_SPECS.items():
        assert key == "cpu" or cuda.name


def test_probe_with_a_model_shows_kv_bytes_per_token(tmp_path, capsys):
    from checkpoints import write_tiny_qwen3

    write_tiny_qwen3(tmp_path)  # 3 layers, 2 KV heads of 16
    assert main(["probe", str(tmp_path), "--json"]) == 0
    sizes = json.loads(capsys.readouterr().out)["kv_bytes_per_token"]
    values = 3 * 2 * 16  # per token, for K (and again for V)
    assert sizes["fp16"] == 2 * values * 2
    assert sizes["fp32"] == 2 * values * 4
    assert sizes["int8"] == 2 * (values + 3 * 2 * 2)  # one fp16 scale per head vector of 16
    assert main(["probe", str(tmp_path), "--device-spec", "rtx3090"]) == 0
    assert f"{2 * values * 2} B/token" in capsys.readouterr().out
