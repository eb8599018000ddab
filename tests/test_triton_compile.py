"""The Triton backend's attention, norm and int8-activation kernels compiled for real
GPUs (SM80, SM86, SM90), with no GPU here: the other tests run them in Triton's
interpreter, which accepts Python that Triton's compiler refuses and says nothing about
tensor cores. Each kernel is compiled in the configuration the backend launches on a
GPU (its non-interpreter tile sizes), for the activation dtypes and page encodings it
reads; bf16 only where the backend serves it (SM80+, which all three targets are).
`test_triton_linear.py` does the same for the quantized linear kernels.

The builders below run in a child process (`compile_all`), where the kernel modules are
imported compiled; this test process imports them interpreted (`interpreted_module`)."""

from __future__ import annotations

import re

import pytest
from triton_helpers import compile_for_gpu, run_compile_script

SM80, SM86, SM90 = 80, 86, 90
#: Head dim of real models: int pages get 64-value scale groups (`kv.quant.group_size`).
D = 128
#: Query heads per KV head.
GQA = 4
#: Page encodings: (code dtype, bits, scale group, scaled) of `KVPages` pools.
PAGES = {
    "fp16": ("fp16", 16, D, False),
    "bf16": ("bf16", 16, D, False),
    "fp32": ("fp32", 32, D, False),
    "int8": ("i8", 8, 64, True),
    "int4": ("u8", 4, 64, True),  # rk8v4's V: two codes a byte
}
#: Integer MMA, s8 x s8 -> s32: `mma.sync` (SM80, SM86) or Hopper's warpgroup `wgmma`.
INT_MMA = re.compile(
    r"\b(?:mma\.sync|wgmma\.mma_async\.sync)\.aligned\.m\d+n\d+k\d+\S*\.s32\.s8\.s8\b"
)
#: The int8 GEMM formats (`table.INT8_ACT_FORMATS`): (bits, group).
INT8_FORMATS = {"W8G32": (8, 32), "Q4G64": (4, 64), "Q4G32": (4, 32)}


def _typed(kernel, typed: dict[str, str], consts: dict) -> dict[str, str]:
    """`typed`'s types, and i32 for the rest of `kernel`'s runtime arguments (strides,
    sizes)."""
    return {a: typed.get(a, "i32") for a in kernel.arg_names if a not in consts}


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def attend(act: str, k_enc: str, v_enc: str, few_rows: bool, arch: int):
    """`attention._attend` as `_launch_few` (split-KV partials) or `_launch_many`
    (prefill tiles) launch it."""
    from ninfer_plugins.backend_triton import attention as A

    block_m = max(16 if few_rows else A.PREFILL_ROWS_BLOCK, _pow2(GQA))
    block_d = max(16, _pow2(D))
    part = "fp32" if few_rows else act
    sig = {"Q": f"*{act}", "Out": f"*{act}", "OP": f"*{part}", "ML": f"*{part}"}
    sig.update(SEQS="*i32", TILES="*i32", BT="*i32", qk_scale="fp32")
    consts = dict(D=D, G=GQA, ROWS=block_m // GQA, BLOCK_M=block_m, BLOCK_N=A.KEY_BLOCK)
    consts.update(BLOCK_D=block_d, SPLIT=few_rows, PRECISION="ieee" if act == "fp32" else None)
    for pool, enc in (("K", k_enc), ("V", v_enc)):
        dtype, bits, group, scaled = PAGES[enc]
        sig[pool] = f"*{dtype}"
        sig[pool + "S"] = "*fp16" if scaled else f"*{dtype}"
        consts.update({f"{pool}_BITS": bits, f"{pool}_GROUP": group, f"{pool}_SCALED": scaled})
    warps = 4 if block_m * block_d <= 64 * 128 else 8
    kernel = compile_for_gpu(
        A._attend, _typed(A._attend, sig, consts), consts, arch, num_warps=warps
    )
    if act != "fp32":  # fp32 multiplies in full fp32 ("ieee"): FMA, not tensor cores
        assert "mma" in kernel.asm["ptx"], f"attention {act} {k_enc}/{v_enc}: no MMA"
    return kernel


def merge(act: str, arch: int):
    from ninfer_plugins.backend_triton import attention as A

    sig = {"OP": "*fp32", "ML": "*fp32", "Out": f"*{act}", "ROWS_T": "*i32"}
    consts = dict(D=D, BLOCK_D=D, BLOCK_S=8)
    return compile_for_gpu(A._merge, _typed(A._merge, sig, consts), consts, arch)


def write_plain(act: str, page: str, arch: int):
    from ninfer_plugins.backend_triton import attention as A

    sig = {"K": f"*{act}", "V": f"*{act}", "SLOTS": "*i64", "KP": f"*{page}", "VP": f"*{page}"}
    consts = dict(D=D, BLOCK_H=8, BLOCK_D=D)
    return compile_for_gpu(A._write_plain, _typed(A._write_plain, sig, consts), consts, arch)


def norms(act: str, weight: str, arch: int) -> list:
    """RMSNorm (x in `act`, weight and output in `weight`), SiLU-and-mul and RoPE."""
    from ninfer_plugins.backend_triton import norms as N

    sig = {"X": f"*{act}", "W": f"*{weight}", "Y": f"*{weight}", "eps": "fp32"}
    consts = dict(BLOCK=N._ROW_BLOCK)
    done = [compile_for_gpu(N._rms_norm, _typed(N._rms_norm, sig, consts), consts, arch)]
    sig = dict.fromkeys(["G", "U", "Out"], f"*{weight}")
    consts = dict(BLOCK=N._ELEMENT_BLOCK)
    done.append(
        compile_for_gpu(N._silu_and_mul, _typed(N._silu_and_mul, sig, consts), consts, arch)
    )
    sig = dict.fromkeys(["Q", "K", "COS", "SIN", "QO", "KO"], f"*{weight}")
    consts = dict(HALF=D // 2, BLOCK_H=32, BLOCK_HKV=8, BLOCK_HALF=D // 2)
    done.append(compile_for_gpu(N._rope, _typed(N._rope, sig, consts), consts, arch))
    return done


def quantize(act: str, arch: int):
    from ninfer_plugins.backend_triton import int8_linear as I

    kernel = I._quantize_rows_kernel
    sig = {"x_ptr": f"*{act}", "xq_ptr": "*i8", "sx_ptr": "*fp32"}
    consts = dict(BLOCK=I._QUANT_BLOCK, QMAX=I.QMAX)
    return compile_for_gpu(kernel, _typed(kernel, sig, consts), consts, arch)


def int8_gemm(act: str, fmt: str, arch: int, config: tuple[int, int, int, int]):
    """The W8/Q4 x int8 GEMM in one of `int8_linear._GPU_CONFIGS`; it must multiply on
    integer tensor cores."""
    from ninfer_plugins.backend_triton import int8_linear as I

    bits, group = INT8_FORMATS[fmt]
    block_m, block_n, warps, stages = config
    sig = {"xq_ptr": "*i8", "sx_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*fp16"}
    sig.update(b_ptr=f"*{act}", y_ptr=f"*{act}")
    consts = dict(BITS=bits, GROUP=group, HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n)
    kernel = I._int8_gemm_kernel
    sig = _typed(kernel, sig, consts)
    done = compile_for_gpu(kernel, sig, consts, arch, num_warps=warps, num_stages=stages)
    assert INT_MMA.search(done.asm["ptx"]), f"{fmt} {act} SM{arch}: no int8 MMA in the PTX"
    return done


KV = (("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32"), ("int8", "int8"), ("int8", "int4"))


def compile_all() -> None:
    """Every kernel variant above; run in a process without the interpreter."""
    from ninfer_plugins.backend_triton import attention, int8_linear

    assert not (attention._INTERPRET or int8_linear._INTERPRETING), "imported interpreted"
    # Attention: every page encoding in few-row (split-KV) and prefill tiles with fp16
    # activations, and few-row with fp32, on SM90; fp32 and bf16 prefill tiles once;
    # 8-bit codes and bf16 again on SM80 and SM86.
    for k_enc, v_enc in KV:
        attend("fp16", k_enc, v_enc, True, SM90)
        attend("fp16", k_enc, v_enc, False, SM90)
        attend("fp32", k_enc, v_enc, True, SM90)
    attend("fp32", "fp32", "fp32", False, SM90)  # fp32 prefill tiles: FMA, slow to compile
    attend("bf16", "bf16", "bf16", True, SM90)
    attend("fp16", "int8", "int8", False, SM80)
    attend("bf16", "bf16", "bf16", True, SM80)
    attend("fp16", "int8", "int4", True, SM86)
    attend("bf16", "int8", "int4", False, SM86)
    for arch in (SM80, SM86, SM90):
        for act in ("fp16", "bf16", "fp32"):
            merge(act, arch)
            write_plain(act, act, arch)
            norms(act, act, arch)
            quantize(act, arch)
        norms("fp32", "bf16", arch)  # the fp32 residual stream of a bf16 model
        for fmt in INT8_FORMATS:
            int8_gemm("fp16", fmt, arch, int8_linear._GPU_CONFIGS[0])
    write_plain("fp32", "fp16", SM90)  # fp16 pages under fp32 activations
    int8_gemm("bf16", "Q4G32", SM90, int8_linear._GPU_CONFIGS[-1])
    int8_gemm("fp32", "W8G32", SM80, int8_linear._GPU_CONFIGS[1])
    print("compiled")


@pytest.mark.slow
def test_kernels_compile_for_gpus(tmp_path):
    """Attention (`_attend` few-row and prefill, over fp16, bf16, fp32, int8 and int4
    pages; `_merge`; the plain KV write), the norms and RoPE, and the int8 activation
    quantizer and W8/Q4 int8 GEMM compile to cubins for SM80, SM86 and SM90; the 16-bit
    attention matmuls run on MMA, and the int8 GEMM on integer (s8 x s8 -> s32) MMA."""
    out = run_compile_script("import test_triton_compile as t; t.compile_all()", tmp_path)
    assert "compiled" in out
