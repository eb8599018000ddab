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
from ninfer_core.kernels.workload import KernelWorkload
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.plugin_types import KernelBackend, KernelOps
from ninfer_core.selection import accepts_keyword, call_accepting
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
    attention_scratch = None

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


# -- what will run: weight formats, KV codec, compute dtype -----------------------------------


class PickyOps:
    """`linear` and attention from one object (bodies never run: plans only)."""

    name = "picky"

    def __init__(self, device) -> None:
        self.device = torch.device(device)

    def linear(self, x, w, b=None):
        return F.linear(x, w, b)

    def prepare(self, meta) -> None:
        pass

    def paged_attention(self, q, k_new, v_new, kv_store, layer, meta, scale):
        raise AssertionError("never called: plans only")


class PickyBackend:
    """Above the reference; `linear` for dense weights only, attention for plain KV only,
    and only fp32/bf16 activations (refused as a whole through `supports`)."""

    name = "picky"
    description = "test backend that reads the workload"
    priority = 20
    attention_scratch = None

    def __init__(self) -> None:
        self.seen = []

    def supports(self, device, *, workload=None) -> Support:
        if workload is not None and workload.compute_dtype == torch.float16:
            return Support.no("no fp16 kernels")
        return Support.yes()

    def provides(self, device, *, workload=None) -> dict[str, Support]:
        self.seen.append(workload)
        linear = attention = Support.yes()
        if workload is not None and workload.quantized_formats:
            formats = ", ".join(sorted(workload.quantized_formats))
            linear = Support.no(f"no kernel for {formats} weights")
        if workload is not None and workload.kv_codec not in (None, "fp32", "bf16"):
            attention = Support.no(f"no kernel for {workload.kv_codec} KV")
        return {"linear": linear, "attention": attention}

    def create_ops(self, device) -> PickyOps:
        return PickyOps(getattr(device, "torch_device", device))


#: Built-in backends that refuse a machine without a GPU (they are passed over on this one).
GPU_BACKENDS = frozenset({"triton", "cupy", "fla"})


def cpu_side(passed_over: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """`OpChoice.passed_over` without the GPU backends this CPU machine refuses."""
    return tuple(p for p in passed_over if p[0] not in GPU_BACKENDS)


def picky_host(backend: PickyBackend | None = None):
    backend = backend or PickyBackend()

    @hookimpl
    def register_kernel_backends():
        return [backend]

    plugin = types.SimpleNamespace(register_kernel_backends=register_kernel_backends)
    return create_host(extra_plugins=[("picky", plugin)])


def test_provides_sees_the_workload_and_refused_ops_fall_back_with_the_reason():
    backend = PickyBackend()
    h = picky_host(backend)
    dense = KernelWorkload(frozenset({"bf16"}), "bf16", torch.bfloat16)
    assert by_op(plan_kernels(h, CPU, workload=dense)) == {op: "torch" for op in OPS} | {
        "linear": "picky",
        "attention": "picky",
    }
    assert backend.seen[-1] is dense
    quantized = KernelWorkload(frozenset({"bf16", "Q6G64"}), "rk8v4", torch.bfloat16)
    choices = {c.op: c for c in plan_kernels(h, CPU, workload=quantized)}
    assert choices["linear"].backend == "torch" and choices["attention"].backend == "torch"
    assert cpu_side(choices["linear"].passed_over) == (("picky", "no kernel for Q6G64 weights"),)
    assert "picky (no kernel for Q6G64 weights)" in choices["linear"].describe()
    assert "picky (no kernel for rk8v4 KV)" in choices["attention"].describe()
    assert not cpu_side(choices["rms_norm"].passed_over)  # picky never provided it
    assert {"backend": "picky", "reason": "no kernel for Q6G64 weights"} in choices[
        "linear"
    ].to_json()["passed_over"]


def test_supports_may_refuse_the_whole_workload():
    h = picky_host()
    half = KernelWorkload(frozenset({"fp16"}), "fp16", torch.float16)
    choices = plan_kernels(h, CPU, workload=half)
    assert set(by_op(choices).values()) == {"torch"}
    assert all(cpu_side(c.passed_over) == (("picky", "no fp16 kernels"),) for c in choices)
    with pytest.raises(UnsupportedChoiceError, match="no fp16 kernels"):
        plan_kernels(h, CPU, "picky", workload=half)


def test_a_forced_op_the_workload_rules_out_fails_naming_reason_and_alternatives():
    h = picky_host()
    quantized = KernelWorkload(frozenset({"fp32", "Q4G64"}), "fp32", torch.float32)
    with pytest.raises(UnsupportedChoiceError) as info:
        plan_kernels(h, CPU, "auto", "linear=picky", workload=quantized)
    message = str(info.value)
    assert "--kernel linear=picky" in message and "no kernel for Q4G64 weights" in message
    assert "weights Q4G64+fp32, KV fp32, compute fp32" in message
    assert "alternatives: torch" in message
    # --gemm-backend: the ops it refuses fall back, saying why
    choices = {c.op: c for c in plan_kernels(h, CPU, "picky", workload=quantized)}
    assert choices["attention"].backend == "picky"
    assert choices["linear"].backend == "torch"
    assert cpu_side(choices["linear"].passed_over) == (("picky", "no kernel for Q4G64 weights"),)


def test_a_backend_written_before_the_workload_is_asked_with_the_device_alone():
    """`LinearOnlyBackend.provides(self, device)` (and `supports(self, device)`) predate the
    workload: the host passes it only to signatures that take it (as pluggy does)."""
    workload = KernelWorkload(frozenset({"Q4G64"}), "int8", torch.bfloat16)
    assert by_op(plan_kernels(host(), CPU, workload=workload))["linear"] == "fake-linear"
    assert not conformance.problems(LinearOnlyBackend(), KernelBackend)
    assert not conformance.problems(PickyBackend(), KernelBackend)

    def takes_kwargs(device, **kwargs):
        return kwargs

    assert accepts_keyword(takes_kwargs, "workload")
    assert call_accepting(takes_kwargs, CPU, workload=workload) == {"workload": workload}
    assert call_accepting(LinearOnlyBackend().provides, CPU, workload=workload)["linear"].ok


def test_probe_names_one_backend_only_when_it_serves_every_op(installed, capsys):
    """fake-linear has the highest priority but serves `linear` alone: the summary line must
    not name it as the kernel backend."""
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "kernel backends -> fake-linear\n" not in out
    assert "kernel backends -> linear=fake-linear,attention=torch," in out
    served = {line.split()[1]: line for line in out.splitlines() if " serves " in line}
    assert served["torch"].split()[0] == "chosen"
    assert served["torch"].endswith(
        "serves attention, rms_norm, rope, silu_and_mul, gated_delta_rule, causal_conv1d"
    )
    assert served["fake-linear"].endswith("serves linear")
    assert main(["probe", "--kernel", "linear=torch", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [kernels] = [p for p in report["extension_points"] if p["point"] == "kernel_backends"]
    assert kernels["chosen"] == "torch"
    status = {c["name"]: c["status"] for c in kernels["candidates"]}
    assert status["torch"] == "chosen" and status["fake-linear"] == "not chosen"
    assert report["kernel_workload"] == {
        "weight_formats": None,
        "kv_codec": "bf16",
        "compute_dtype": "bf16",
    }


def test_probe_with_a_quantized_model_asks_for_its_weight_formats(tmp_path, capsys):
    from checkpoints import write_tiny_qwen3

    from ninfer_core.convert import convert

    out = tmp_path / "tiny-q4.ninfer"
    convert(write_tiny_qwen3(tmp_path / "hf", hidden_size=64), out, recipe_name="q4")
    backend = PickyBackend()
    h = picky_host(backend)
    loaded = load_model(out, host=h, device=CPU, runtime=RuntimeConfig(dtype="bf16"))
    assert "Q4G64" in loaded.workload.weight_formats and loaded.workload.kv_codec == "bf16"
    assert loaded.workload.compute_dtype == torch.bfloat16
    linear = next(c for c in loaded.kernels if c.op == "linear")
    [(name, why)] = cpu_side(linear.passed_over)
    assert linear.backend == "torch" and name == "picky" and "Q4G64" in why
    # `ninfer probe MODEL` reads the same formats from the headers alone.
    assert main(["probe", str(out), "--json"]) == 0
    formats = json.loads(capsys.readouterr().out)["kernel_workload"]["weight_formats"]
    assert "Q4G64" in formats and "bf16" in formats


def test_a_runtime_over_another_codec_is_checked_against_the_attention_chosen_at_load(ckpt):
    from ninfer_core.engine import build_runtime

    path, _ = ckpt
    h = picky_host()
    loaded = load_model(path, host=h, device=CPU, runtime=RuntimeConfig(dtype="fp32"))
    assert by_op(loaded.kernels)["attention"] == "picky" and loaded.workload.kv_codec == "fp32"
    build_runtime(loaded, h, CPU, RuntimeSpec(8, BLOCK, kv_dtype="bf16"))  # picky reads bf16
    with pytest.raises(UnsupportedChoiceError) as info:
        build_runtime(loaded, h, CPU, RuntimeSpec(8, BLOCK, kv_dtype="int8"))
    message = str(info.value)
    assert "composed from kernel backend 'picky' for KV codec 'fp32'" in message
    assert "no kernel for int8 KV" in message and "--kv-dtype int8" in message


# -- ops the contract grew later ---------------------------------------------------------


class OldOps(LinearOps):
    """Every op the contract had before the linear-attention ones, and nothing else."""

    name = "old-ops"

    def prepare(self, meta) -> None:
        pass

    def rms_norm(self, x, w, eps):
        return x

    def silu_and_mul(self, gate, up):
        return gate

    def apply_rope(self, q, k, cos, sin):
        return q, k

    def paged_attention(self, q, k_new, v_new, kv_store, layer, meta, scale):
        return q


class OldBackend(LinearOnlyBackend):
    """Claims every op (`provides` None), written before `gated_delta_rule` existed."""

    name = "old-ops"
    provides = None

    def create_ops(self, device) -> OldOps:
        return OldOps(getattr(device, "torch_device", device))


def test_a_backend_whose_ops_predate_the_linear_attention_ops_gets_them_from_the_reference():
    from ninfer_core.kernels.compose import LATER_OPS, composed_choices

    @hookimpl
    def register_kernel_backends():
        return [OldBackend()]

    h = create_host(
        extra_plugins=[
            ("old", types.SimpleNamespace(register_kernel_backends=register_kernel_backends))
        ]
    )
    planned = plan_kernels(h, CPU, "old-ops")
    assert set(by_op(planned).values()) == {"old-ops"}
    assert conformance.problems(OldOps("cpu"), KernelOps)  # not a full ops object alone
    ops = compose_ops(h, CPU, planned)
    assert isinstance(ops, ComposedOps) and not conformance.problems(ops, KernelOps)
    assert isinstance(ops.linear.__self__, OldOps)
    assert isinstance(ops.gated_delta_rule.__self__, TorchOps)
    assert isinstance(ops.causal_conv1d.__self__, TorchOps)
    record = {c.op: c for c in composed_choices(ops, planned)}
    for op in LATER_OPS:
        assert record[op].backend == "torch"
        assert record[op].passed_over == (("old-ops", f"its ops have no {op}"),)
    assert record["linear"].backend == "old-ops"
    # A backend whose ops have them keeps its own object: nothing recorded differently.
    torch_choices = plan_kernels(h, CPU, "torch")
    torch_ops = compose_ops(h, CPU, torch_choices)
    assert type(torch_ops) is TorchOps
    assert composed_choices(torch_ops, torch_choices) == torch_choices
