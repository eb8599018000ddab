"""The CuPy backend: its probes and sizes here, its CUDA C source compiled by NVRTC
where libnvrtc is installed, and on a CUDA machine its kernels against a float64
reference for every format it reads (decode and prefill rows, odd sizes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ninfer_core.device import CudaInfo, DeviceInfo, probe_device, simulated_device
from ninfer_core.kernels.workload import KernelWorkload
from ninfer_core.quant.tensor import QuantizedTensor, quantize
from ninfer_plugins.backend_cupy import CupyBackend, kernels_cuda, table
from ninfer_plugins.backend_cupy import linear as cupy_linear

CPU = probe_device(use_cuda=False)
FORMATS = sorted(table.LINEAR_FORMATS)


@pytest.fixture
def cupy_present(monkeypatch):
    """Probe as if CuPy were installed (it is not needed to answer for a simulated card)."""
    monkeypatch.setattr(table, "cupy_installed", lambda: True)


# ---------------------------------------------------------------- probing, sizes


def test_refuses_without_cupy_naming_the_extra(monkeypatch):
    monkeypatch.setattr(table, "cupy_installed", lambda: False)
    support = CupyBackend().supports(simulated_device("h100"))
    assert not support.ok
    assert support.reason == "CuPy is not installed (pip install 'ninfer[cupy]')"


def test_refuses_a_machine_without_cuda(cupy_present):
    support = CupyBackend().provides(CPU)["linear"]
    assert not support.ok and "no CUDA device" in support.reason


def test_serves_linear_only_for_the_formats_and_dtypes_it_reads(cupy_present):
    ampere = simulated_device("rtx3090")
    backend = CupyBackend()
    assert set(backend.provides(ampere)) == {"linear"}
    for fmt in FORMATS:
        work = KernelWorkload(frozenset({fmt, "bf16"}), "fp16", torch.bfloat16)
        assert backend.provides(ampere, workload=work)["linear"].ok, fmt
    fake = KernelWorkload(frozenset({"Q3G64", "fp16"}), "fp16", torch.float16)
    refusal = backend.provides(ampere, workload=fake)["linear"]
    assert not refusal.ok and "no CuPy GEMV for Q3G64 weights" in refusal.reason
    turing = CudaInfo("NVIDIA T4", (7, 5), 16 << 30, 15 << 30)
    t4 = DeviceInfo(CPU.cpu, turing, simulated="t4")
    half = KernelWorkload(frozenset({"Q4G64"}), "fp16", torch.float16)
    assert backend.provides(t4, workload=half)["linear"].ok
    bf16 = backend.provides(t4, workload=KernelWorkload(None, "fp16", torch.bfloat16))["linear"]
    assert not bf16.ok and bf16.reason == "bf16 needs SM80+, this is SM75"
    ints = backend.provides(ampere, workload=KernelWorkload(None, None, torch.int8))["linear"]
    assert not ints.ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_weights_are_the_stored_bytes(fmt):
    shape = (37, 100)
    q = quantize(torch.randn(shape), fmt)
    packed = cupy_linear.pack_linear(q, torch.device("cpu"))
    assert isinstance(packed, cupy_linear.CupyWeight)
    assert packed.nbytes == q.nbytes == cupy_linear.packed_nbytes(fmt, shape)
    assert packed.q.packed.data_ptr() % cupy_linear.ALIGN == 0
    assert torch.equal(packed.q.packed, q.packed) and torch.equal(packed.q.scales, q.scales)
    assert cupy_linear.packed_nbytes("bf16", shape) is None


def test_off_the_gpu_linear_is_the_reference():
    q = quantize(torch.randn(24, 64), "Q4G64")
    x = torch.randn(3, 64)
    assert torch.equal(cupy_linear.linear(x, q), q.linear(x))
    packed = cupy_linear.pack_linear(q, torch.device("cpu"))
    assert torch.equal(cupy_linear.linear(x, packed), q.linear(x))
    dense = torch.randn(24, 64)
    assert torch.equal(cupy_linear.linear(x, dense), x @ dense.T)


# ------------------------------------------------------------ the CUDA C source


def _nvrtc() -> ctypes.CDLL:
    """libnvrtc from the `nvidia-cuda-nvrtc-cu12` wheel or the system, else skip."""
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        found = sorted(Path(folder, "lib").glob("libnvrtc.so*"))
        if found:
            return ctypes.CDLL(str(found[0]))
    name = ctypes.util.find_library("nvrtc")
    if name is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12 to compile the source)")
    return ctypes.CDLL(name)


def _compile(lib: ctypes.CDLL, source: str, arch: str) -> tuple[int, str, str]:
    """(nvrtcResult, log, PTX) of compiling `source` for `arch`."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None) == 0
    opts = [o.encode() for o in (*kernels_cuda.OPTIONS, f"--gpu-architecture={arch}")]
    result = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = ""
    if result == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, buf)
        ptx = buf.value.decode()
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return result, log.value.decode(errors="replace"), ptx


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_the_cuda_source_compiles_with_nvrtc_and_defines_every_kernel(arch):
    lib = _nvrtc()
    result, log, ptx = _compile(lib, kernels_cuda.SOURCE, arch)
    assert result == 0, log
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    want = {
        kernels_cuda.kernel_name(op, bits, mins, act)
        for op in ("gemv", "dequant")
        for bits, mins in kernels_cuda.LAYOUTS
        for act in kernels_cuda.ACTIVATIONS
    }
    assert want <= entries, sorted(want - entries)
    # every format the table serves has its layout compiled
    assert set(table.LINEAR_FORMATS.values()) <= set(kernels_cuda.LAYOUTS)


def test_a_broken_source_fails_to_compile():
    """The compile check can fail: NVRTC rejects a source with an error."""
    result, log, _ = _compile(_nvrtc(), kernels_cuda.SOURCE + "\nint broken(;\n", "compute_80")
    assert result != 0 and "error" in log


# ----------------------------------------------------------- on a CUDA device


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CuPy kernels run on NVIDIA GPUs only")
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install 'ninfer[cupy]')")


def reference_weights(q: QuantizedTensor) -> np.ndarray:
    """float64 [rows, cols] from the stored bytes, decoded independently of the codec:
    little-endian bit stream per row, offset-binary codes, fp16 scales (and mins)."""
    fmt = q.fmt
    rows, cols = q.shape
    raw = q.packed.cpu().numpy()
    bits = np.unpackbits(raw, axis=1, bitorder="little")  # [rows, padded * bits]
    stored = bits.reshape(rows, -1, fmt.bits).astype(np.int64) @ (1 << np.arange(fmt.bits))
    scales = np.repeat(q.scales.cpu().numpy().astype(np.float64), fmt.group, axis=1)
    if fmt.mins:
        mins = np.repeat(q.mins.cpu().numpy().astype(np.float64), fmt.group, axis=1)
        w = stored * scales + mins
    else:
        w = (stored - (1 << (fmt.bits - 1))) * scales
    return w[:, :cols]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_reference_decoder_agrees_with_the_codec(fmt):
    """The oracle the GPU tests use, checked here against `QuantizedTensor`."""
    gen = torch.Generator().manual_seed(5)
    q = quantize(torch.randn(5, 70, generator=gen), fmt)
    np.testing.assert_allclose(reference_weights(q), q.dequantize(torch.float64).numpy(), rtol=1e-6)


TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_matches_a_float64_reference(fmt, dtype):
    _need_cuda()
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("bf16 needs SM80+")
    gen = torch.Generator().manual_seed(7)
    rows, cols = 37, 100  # neither a multiple of a group nor of a warp
    q = quantize(torch.randn(rows, cols, generator=gen), fmt)
    w64 = reference_weights(q)
    ops = CupyBackend().create_ops("cuda")
    packed = ops.pack_linear(q.to("cuda"), dtype=dtype)
    for t in (1, 7, 33):
        for with_bias in (False, True):
            x = torch.randn(t, cols, generator=gen).to("cuda", dtype)
            b = torch.randn(rows, generator=gen).to("cuda", dtype) if with_bias else None
            y = ops.linear(x, packed, b)
            assert y.dtype == dtype and y.shape == (t, rows)
            want = x.double().cpu().numpy() @ w64.T
            if b is not None:
                want = want + b.double().cpu().numpy()
            err = np.abs(y.double().cpu().numpy() - want).max() / np.abs(want).max()
            assert err < TOL[dtype], (fmt, dtype, t, with_bias, err)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_dequantize_kernel_rounds_as_the_codec(fmt):
    """Bit for bit `QuantizedTensor.dequantize`: fp32 math, one cast to the dtype."""
    _need_cuda()
    gen = torch.Generator().manual_seed(3)
    q = quantize(torch.randn(19, 200, generator=gen), fmt).to("cuda")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(cupy_linear.dequantize(q, dtype), q.dequantize(dtype)), dtype


@pytest.mark.gpu
def test_kernels_run_on_torchs_current_stream():
    _need_cuda()
    q = quantize(torch.randn(64, 256), "Q4G64").to("cuda")
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    want = x.double() @ torch.from_numpy(reference_weights(q)).cuda().T
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = cupy_linear.linear(x, cupy_linear.pack_linear(q, x.device))
        big = cupy_linear.linear(x.repeat(10, 1), cupy_linear.pack_linear(q, x.device))
    stream.synchronize()
    assert (y.double() - want).abs().max() / want.abs().max() < TOL[torch.float16]
    assert (big[:4].double() - want).abs().max() / want.abs().max() < TOL[torch.float16]
