"""Kernels composed per op: a backend that provides only `linear` composes with the
core's reference for everything else, keeps fp32 parity with transformers, and shows
in `ninfer probe`; impossible forced choices fail naming the alternatives."""

from __future__ import annotations

import importlib.metadata
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from checkpoints import load_reference, write_tiny_llama, write_tiny_qwen3
from test_model_parity import BLOCK, CODECS, TOL, max_err, prompt, reference_logits
from test_plugin_host import fake_entry_points

from ninfer_core import ENTRY_POINT_GROUP, conformance, hookimpl
from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine import RuntimeSpec, Sequence, assemble_runtime
from ninfer_core.errors import UnknownNameError, UnsupportedChoiceError
from ninfer_core.kernels.compose import OPS, ComposedOps, compose_ops, plan_kernels
from ninfer_core.kernels.reference import TorchOps
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.plugin_types import KernelBackend, KernelOps
from ninfer_core.support import Support

CPU = probe_device(use_cuda=False)


class LinearOps:
    """Only `linear` (no packing: weights stay as loaded); counts its calls."""

    name = "fake-linear"

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.calls = 0

    def linear(self, x, w, b=None):
        self.calls += 1
        return F.linear(x, w, b)


class LinearOnlyBackend:
    name = "fake-linear"
    description = "test backend: F.linear only"
    priority = 10

    def supports(self, device) -> Support:
        return Support.yes()

    def provides(self, device) -> dict[str, Support]:
        return {"linear": Support.yes("wraps F.linear")}

    def create_ops(self, device) -> LinearOps:
        return LinearOps(getattr(device, "torch_device", device))


@hookimpl
def register_kernel_backends():
    return [LinearOnlyBackend()]


PLUGIN = types.SimpleNamespace(register_kernel_backends=register_kernel_backends)


def host():
    return create_host(extra_plugins=[("fake-linear", PLUGIN)])


def by_op(choices) -> dict[str, str]:
    return {c.op: c.backend for c in choices}


def test_the_fake_backend_keeps_the_contract():
    h = host()
    assert not h.failures
    assert not conformance.problems(h.kernel_backends.get("fake-linear"), KernelBackend)


def test_linear_comes_from_the_backend_that_provides_it_the_rest_from_the_reference():
    choices = plan_kernels(host(), CPU)
    assert by_op(choices) == {op: "torch" for op in OPS} | {"linear": "fake-linear"}
    ops = compose_ops(host(), CPU, choices)
    assert isinstance(ops, ComposedOps)
    assert not conformance.problems(ops, KernelOps)
    # Bound methods of the chosen objects, set once: no per-call lookup.
    assert isinstance(ops.linear.__self__, LinearOps)
    assert isinstance(ops.paged_attention.__self__, TorchOps)
    assert ops.prepare.__self__ is ops.paged_attention.__self__
    w = torch.zeros(2, 2)
    assert ops.pack_linear(w) is w  # the fake packs nothing: weights stay as loaded
    assert ops.packed_nbytes is None


def test_one_backend_for_every_op_is_that_backends_own_ops_object():
    h = create_host()
    ops = compose_ops(h, CPU, plan_kernels(h, CPU))
    assert type(ops) is TorchOps
    h = host()
    assert type(compose_ops(h, CPU, plan_kernels(h, CPU, "torch"))) is TorchOps


def test_gemm_backend_forces_the_ops_it_provides():
    h = host()
    assert set(by_op(plan_kernels(h, CPU, "torch")).values()) == {"torch"}
    assert by_op(plan_kernels(h, CPU, "fake-linear"))["linear"] == "fake-linear"


def test_kernel_override_beats_priority():
    choices = plan_kernels(host(), CPU, "auto", "linear=torch")
    assert by_op(choices)["linear"] == "torch"
    assert "--kernel linear=torch" in choices[0].reason


def test_impossible_kernel_overrides_fail_naming_the_alternatives():
    with pytest.raises(UnknownNameError) as info:
        plan_kernels(host(), CPU, "auto", "linear=nope")
    assert "fake-linear" in str(info.value) and "torch" in str(info.value)
    with pytest.raises(UnknownNameError) as info:
        plan_kernels(host(), CPU, "auto", "gemm=torch")
    assert all(op in str(info.value) for op in OPS)
    with pytest.raises(UnsupportedChoiceError) as info:
        plan_kernels(host(), CPU, "auto", "attention=fake-linear")
    message = str(info.value)
    assert "--kernel attention=fake-linear" in message and "alternatives: torch" in message


def test_kernel_option_on_the_command_line(capsys):
    assert main(["probe", "--kernel", "linear=nope"]) == 1
    err = capsys.readouterr().err
    assert "nope" in err and "torch" in err


@pytest.fixture
def installed(monkeypatch):
    """The fake backend installed as a third-party entry point."""
    module = "ninfer_test_fake_linear"
    mod = types.ModuleType(module)
    mod.register_kernel_backends = register_kernel_backends
    monkeypatch.setitem(sys.modules, module, mod)
    fake_entry_points(
        monkeypatch, [importlib.metadata.EntryPoint("fake-linear", module, ENTRY_POINT_GROUP)]
    )


def test_probe_shows_which_backend_serves_each_op(installed, capsys):
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "linear: fake-linear - highest priority providing it (10): wraps F.linear" in out
    for op in OPS:
        if op != "linear":
            assert f"{op}: torch (reference)" in out
    assert main(["probe", "--json"]) == 0
    ops = {r["op"]: r["backend"] for r in json.loads(capsys.readouterr().out)["kernel_ops"]}
    assert ops == {op: "torch" for op in OPS} | {"linear": "fake-linear"}


def test_serve_startup_prints_each_ops_backend(capsys):
    from ninfer_core.cli.serve import print_probe

    print_probe(host(), CPU, RuntimeConfig())
    out = capsys.readouterr().out
    assert "linear: fake-linear" in out and "rms_norm: torch (reference)" in out


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def ckpt(request, tmp_path_factory):
    writer = {"qwen3": write_tiny_qwen3, "llama": write_tiny_llama}[request.param]
    path = writer(tmp_path_factory.mktemp(request.param))
    return path, load_reference(path)


def test_fp32_parity_with_the_linear_only_backend(ckpt):
    path, ref = ckpt
    runtime = RuntimeConfig(dtype="fp32", kv_dtype="fp32")
    loaded = load_model(path, host=host(), device=CPU, runtime=runtime)
    assert by_op(loaded.kernels)["linear"] == "fake-linear"
    assert loaded.backend.startswith("linear=fake-linear,attention=torch")
    rt = assemble_runtime(
        loaded.model, loaded.config, torch.float32, CODECS["fp32"], RuntimeSpec(48, BLOCK)
    )
    ids = prompt(64)
    seq = Sequence(ids)
    got = torch.cat(
        [rt.runner.run([(seq, 40)], all_tokens=True)]
        + [rt.runner.run([(seq, 1)]) for _ in range(24)]
    )
    assert max_err(got, reference_logits(ref, ids)) <= TOL
    assert loaded.ops.linear.__self__.calls > 0
