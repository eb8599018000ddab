"""Check and time every GPU kernel backend against the torch reference, on one machine.

For each kernel backend the plugin host registers (`--backends`, default torch, triton,
cupy, fla), every op it provides for the case's workload is:

(a) checked on fresh random data against a float reference (float64 math, or the
    reference's fp32 GEMM over the same dequantized weights): linear for each weight
    format at a decode (T=1) and a prefill (T=512) shape, paged attention over plain,
    int8 and rk8v4 pages (one step mixing decode rows and a prefill chunk), rms_norm,
    rope and silu_and_mul, and the Gated DeltaNet ops at Qwen3.5's head sizes
    (gated_delta_rule's output and final states, causal_conv1d; decode rows, one
    prefill sequence, and a step mixing both, against the reference run in float64;
    the reference's own fp32 rows time it beside the GPU backends); the table prints
    the max relative error per op (max|out - ref| / max|ref|) and flags one above the
    dtype's tolerance (exit status 1);
(b) timed with CUDA events (warm-up, then the median): decode GEMV as GB/s of weights
    read against a measured device copy bandwidth, prefill GEMM as TFLOP/s against a
    measured fp16 `torch.matmul` of 8192 x 8192;
(c) run end to end: prefill and decode tok/s of a Qwen3-0.6B-shaped random-weight model
    (fp16 and Q4G64), built and timed as `ninfer bench decode` does (`load_model`,
    `one_request_engine`, `generation.stream`), with `--gemm-backend NAME` forcing each
    backend where it serves an op; and int8-activation prefill against fp16.

`--quick` checks fewer shapes and a shorter model; `--budget-s` bounds the whole run
(sections left when it runs out say so). Without a CUDA device it prints one line and
exits 0, unless `--interpret`: then (a) alone runs on the CPU at tiny sizes, the Triton
kernels in Triton's interpreter (`TRITON_INTERPRET=1`, set before anything imports
Triton, since Triton reads it when a kernel module is imported), in fp16 and fp32
(the interpreter computes bf16 wrongly). That is how the test suite checks this script.

    python bench/gpu_check.py --quick          # about 4 minutes on an H100
    python bench/gpu_check.py --interpret --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("Q4G64", "Q5G64", "Q6G64", "W8G32", "Q4G32", "Q4G32M")
#: Relative error above which a result is flagged (output rounding plus accumulation).
TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 4e-2}


@dataclass(frozen=True)
class DeltaSizes:
    """The Gated DeltaNet shapes one run checks: key heads, value heads, head dim (Dk =
    Dv), conv width, and the steps (each a list of sequence lengths)."""

    key_heads: int
    value_heads: int
    head_dim: int
    width: int
    steps: tuple[tuple[int, ...], ...]

    @property
    def conv_dim(self) -> int:  # the conv runs over q | k | v
        return (2 * self.key_heads + self.value_heads) * self.head_dim


#: Qwen3.5's (16 key heads, 32 value heads of 128, conv width 4): 32 decode rows, a
#: 2048-token prompt, and a 512-token chunk beside 8 decode rows.
DELTA_GPU = DeltaSizes(16, 32, 128, 4, ((1,) * 32, (2048,), (512,) + (1,) * 8))
DELTA_INTERPRET = DeltaSizes(2, 4, 16, 4, ((1,) * 3, (40,), (20, 1, 3)))


@dataclass(frozen=True)
class Sizes:
    """The shapes one run checks."""

    #: (out, in) of each linear checked (and timed).
    linear: tuple[tuple[int, int], ...]
    formats: tuple[str, ...]
    decode_rows: int
    prefill_rows: int
    #: Query heads, KV heads, head dim.
    heads: tuple[int, int, int]
    #: (cached, new) tokens per sequence of the attention step.
    step: tuple[tuple[int, int], ...]
    block: int
    #: rms_norm / silu_and_mul width and rows.
    hidden: int
    rows: int
    dtypes: tuple[str, ...]


INTERPRET = Sizes(
    ((40, 96),), FORMATS, 1, 20, (4, 2, 64), ((16, 1), (8, 8)), 16, 96, 5, ("fp16", "fp32")
)
INTERPRET_QUICK = Sizes(
    ((40, 96),),
    ("Q4G64", "W8G32", "Q4G32M"),
    1,
    20,
    (4, 2, 32),
    ((16, 1), (0, 8)),
    16,
    96,
    5,
    ("fp16", "fp32"),
)
STEP_GPU = ((4000, 1), (1000, 1), (200, 1), (0, 512))
QUICK = Sizes(
    ((4096, 4096),), FORMATS, 1, 512, (16, 8, 128), STEP_GPU, 16, 4096, 512, ("fp16", "bf16")
)
FULL = Sizes(
    ((4096, 4096), (12288, 4096), (4096, 12288)),
    FORMATS,
    1,
    512,
    (32, 8, 128),
    STEP_GPU,
    16,
    8192,
    2048,
    ("fp16", "bf16"),
)


@dataclass
class Row:
    backend: str
    op: str
    case: str
    dtype: str
    err: float | None = None
    ms: float | None = None
    rate: str = ""
    note: str = ""

    @property
    def high(self) -> bool:
        return self.err is not None and not self.err <= TOLERANCE[self.dtype]


@dataclass
class Run:
    """What the checks share: the device, the backends' ops, the clock."""

    torch: Any
    device: Any
    where: str
    ops: dict[str, Any]
    backends: dict[str, Any]
    timed: bool
    deadline: float
    rows: list[Row] = field(default_factory=list)
    copy_gbs: float | None = None
    matmul_tflops: float | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any module imports Triton
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print(
            "no CUDA device: torch.cuda.is_available() is False (--interpret checks the "
            "Triton kernels on the CPU in Triton's interpreter)"
        )
        return 0
    from ninfer_core.device import probe_device
    from ninfer_core.plugin_host import create_host

    start = time.monotonic()
    deadline = start + args.budget_s
    device = probe_device(use_cuda=not args.interpret)
    host = create_host(warn=False)
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    if "torch" not in names:
        names.insert(0, "torch")
    print(device.describe())
    backends, ops = {}, {}
    for name in names:
        if name not in host.kernel_backends:
            print(f"backend {name}: not registered (known: {', '.join(host.kernel_backends)})")
            continue
        obj = host.kernel_backends.get(name)
        support = _supports(obj, device)
        if not support.ok:
            print(f"backend {name}: refused: {support.reason}")
            continue
        backends[name] = obj
        ops[name] = obj.create_ops(device)
        print(f"backend {name}: {support.reason or 'available'}")
    sizes = (
        (INTERPRET_QUICK if args.quick else INTERPRET)
        if args.interpret
        else (QUICK if args.quick else FULL)
    )
    if not args.interpret and torch.cuda.get_device_capability()[0] < 8:
        sizes = Sizes(**{**sizes.__dict__, "dtypes": ("fp16",)})  # bf16 needs SM80
    run = Run(
        torch,
        device,
        device.torch_device,
        ops,
        backends,
        not args.interpret,
        start + (args.budget_s * (1.0 if args.interpret else 0.6)),
    )
    if run.timed:
        measure_peaks(run)
        print(
            f"device copy {run.copy_gbs:.0f} GB/s; fp16 matmul 8192^3 "
            f"{run.matmul_tflops:.0f} TFLOP/s"
        )
    check_ops(run, sizes)
    print_table(run)
    if not args.interpret:
        run.deadline = deadline
        end_to_end(run, quick=args.quick, out=Path(args.out))
    print(f"done in {time.monotonic() - start:.0f} s")
    return 1 if any(r.high for r in run.rows) else 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes, a shorter model")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="no GPU: the Triton kernels' checks in Triton's interpreter, tiny sizes",
    )
    p.add_argument("--backends", default="torch,triton,cupy,fla", help="kernel backends to check")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop starting new work after this many seconds (default 420)",
    )
    p.add_argument(
        "--out",
        default=str(Path.home() / ".cache" / "ninfer" / "gpu-check"),
        help="where the end-to-end model is written (reused)",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------- helpers


def _supports(obj: Any, device: Any, workload: Any = None) -> Any:
    from ninfer_core.selection import ask_supports

    return ask_supports(obj, device, workload=workload)


def provided(obj: Any, device: Any, op: str, workload: Any) -> Any:
    """The backend's answer for `op` on this workload, as the host asks it."""
    from ninfer_core.kernels.compose import backend_provides
    from ninfer_core.support import Support

    return backend_provides(obj, device, workload).get(op, Support.no(f"does not provide {op}"))


def dtype_of(torch: Any, name: str) -> Any:
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def rel_err(out: Any, ref: Any) -> float:
    ref = ref.double()
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def cuda_ms(torch: Any, fn: Callable[[], Any], warmup: int = 3, iters: int = 15) -> float:
    """Median milliseconds of `fn` on the current stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def measure_peaks(run: Run) -> None:
    """Device copy bandwidth (1 GiB copied: read + write) and fp16 matmul throughput."""
    torch = run.torch
    src = torch.empty(1 << 29, dtype=torch.float16, device=run.where)
    dst = torch.empty_like(src)
    ms = cuda_ms(torch, lambda: dst.copy_(src))
    run.copy_gbs = 2 * src.numel() * 2 / ms / 1e6
    a = torch.randn(8192, 8192, dtype=torch.float16, device=run.where)
    ms = cuda_ms(torch, lambda: torch.matmul(a, a), iters=10)
    run.matmul_tflops = 2 * 8192**3 / ms / 1e9


def each_backend(run: Run, op: str, case: str, dtype: str, workload: Any) -> Iterator[tuple]:
    """(name, ops) of each backend serving `op` for `workload`; a refusal becomes a row."""
    for name, obj in run.backends.items():
        support = provided(obj, run.device, op, workload)
        if support.ok:
            yield name, run.ops[name]
        else:
            run.rows.append(Row(name, op, case, dtype, note=f"refused: {support.reason}"))


def record(run: Run, row: Row, fn: Callable[[], Any], ref: Any, rate: Callable | None) -> None:
    """Check `fn()` against `ref`, then (on a GPU) time it; `rate(ms)` -> text."""
    try:
        row.err = rel_err(fn(), ref)
        if run.timed and run.left() > 0:
            row.ms = cuda_ms(run.torch, fn)
            row.rate = rate(row.ms) if rate else ""
    except Exception as exc:  # one failing kernel is a row, not the end of the check
        row.note = _failed(exc)
    run.rows.append(row)


def _failed(exc: Exception) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"failed: {type(exc).__name__}: {first[:120]}"


# ------------------------------------------------------------------------ checks


def check_ops(run: Run, sizes: Sizes) -> None:
    for dtype in sizes.dtypes:
        for section in (check_linear, check_attention, check_pointwise, check_delta_rule):
            if run.left() <= 0:
                run.rows.append(Row("-", section.__name__[6:], "-", dtype, note="skipped: budget"))
                continue
            section(run, sizes, dtype)


def check_linear(run: Run, sizes: Sizes, dtype: str) -> None:
    from ninfer_core.kernels.workload import KernelWorkload
    from ninfer_core.quant.tensor import quantize

    torch = run.torch
    dt = dtype_of(torch, dtype)
    gen = torch.Generator().manual_seed(1)
    for n, k in sizes.linear:
        dense = torch.randn(n, k, generator=gen) / k**0.5
        for fmt in (*sizes.formats, dtype):
            if run.left() <= 0:
                run.rows.append(
                    Row("-", "linear", f"{fmt} {n}x{k} on", dtype, note="skipped: budget")
                )
                return
            if fmt == dtype:  # the dense weight itself, in the compute dtype
                w, nbytes = dense.to(run.where, dt), n * k * dt.itemsize
                ref_w = w.double()
            else:
                w = quantize(dense, fmt).to(run.where)
                nbytes, ref_w = w.nbytes, w.dequantize(torch.float64)
            workload = KernelWorkload(frozenset({fmt, dtype}), None, dt)
            packed: dict[str, Any] = {}
            for rows in (sizes.decode_rows, sizes.prefill_rows):
                x = torch.randn(rows, k, generator=gen).to(run.where, dt)
                ref = x.double() @ ref_w.T  # float64 over the exact dequantized weights
                case = f"{fmt} T={rows} {n}x{k}"
                for name, ops in each_backend(run, "linear", case, dtype, workload):
                    try:
                        if name not in packed:
                            packed[name] = ops.pack_linear(w, dtype=dt)
                    except Exception as exc:  # as `record` does: a row, not the end
                        run.rows.append(Row(name, "linear", case, dtype, note=_failed(exc)))
                        continue
                    p = packed[name]
                    if rows <= 8:  # decode: bound by reading the weights

                        def rate(ms: float, b: int = nbytes) -> str:
                            return f"{b / ms / 1e6:.0f} GB/s ({b / ms / 1e4 / run.copy_gbs:.0f}%)"
                    else:

                        def rate(ms: float, flop: int = 2 * rows * n * k) -> str:
                            tf = flop / ms / 1e9
                            return f"{tf:.1f} TFLOP/s ({100 * tf / run.matmul_tflops:.0f}%)"

                    row = Row(name, "linear", case, dtype)
                    record(run, row, lambda o=ops, x=x, p=p: o.linear(x, p), ref, rate)


def _attention_step(run: Run, sizes: Sizes, codec: str, dt: Any, seed: int) -> tuple:
    """A KV store holding random cached prefixes on the device, and one step's q/k/v
    (already written) with a float64 reference of its attention."""
    from ninfer_core.kv.layout import KVLayout
    from ninfer_core.model.attention_meta import AttentionMetadata, PagedSpan
    from ninfer_core.plugin_host import create_host

    torch = run.torch
    h, hkv, d = sizes.heads
    bs = sizes.block
    gen = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-(c + n) // bs) for c, n in sizes.step)
    layout = KVLayout(1, hkv, d, bs, pages_needed + 1)
    store = create_host(warn=False).kv_codecs.get(codec).allocate(layout, run.where, dt)
    pages = (torch.randperm(pages_needed, generator=gen) + 1).tolist()  # page 0 unused
    seqs = []
    for i, (cached, new) in enumerate(sizes.step):
        count = -(-(cached + new) // bs)
        table, pages = pages[:count], pages[count:]
        seqs.append(PagedSpan(i, cached, table, cached + new))
        if cached:
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(cached)])
            k, v = (torch.randn(cached, hkv, d, generator=gen).to(run.where, dt) for _ in "kv")
            store.write(0, slots.to(run.where), k, v)
    batch = [(s, n) for s, (_, n) in zip(seqs, sizes.step, strict=True)]

    def meta():
        return AttentionMetadata.build(batch, bs, run.where)

    first = meta()
    t = first.num_tokens
    q = torch.randn(t, h, d, generator=gen).to(run.where, dt)
    k_new, v_new = (torch.randn(t, hkv, d, generator=gen).to(run.where, dt) for _ in "kv")
    store.write(0, first.slot_mapping, k_new, v_new)  # what every backend writes again
    outs, start = [], 0
    for seq, qlen, ctx in zip(seqs, first.query_lens, first.context_lens, strict=True):
        k, v = store.gather(0, torch.tensor(seq.block_table, device=run.where), ctx)
        k = k.double().repeat_interleave(h // hkv, dim=1)  # [ctx, H, D]
        v = v.double().repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + qlen].double(), k) * d**-0.5
        pos = torch.arange(ctx - qlen, ctx, device=run.where)[:, None]
        keys = torch.arange(ctx, device=run.where)[None, :]
        scores = scores.masked_fill(keys > pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += qlen
    return store, meta, q, k_new, v_new, torch.cat(outs)


def check_attention(run: Run, sizes: Sizes, dtype: str) -> None:
    from ninfer_core.kernels.workload import KernelWorkload

    dt = dtype_of(run.torch, dtype)
    for codec in (dtype, "int8", "rk8v4"):
        if run.left() <= 0:
            run.rows.append(Row("-", "attention", f"{codec} on", dtype, note="skipped: budget"))
            return
        store, meta, q, k_new, v_new, ref = _attention_step(run, sizes, codec, dt, seed=2)
        longest = max(c + n for c, n in sizes.step)
        case = f"{codec} pages, {len(sizes.step)} seqs <= {longest}"
        workload = KernelWorkload(None, codec, dt)
        for name, ops in each_backend(run, "attention", case, dtype, workload):
            step_meta = meta()

            def attend(o=ops, m=step_meta, args=(q, k_new, v_new, store, 0)):
                o.prepare(m)
                return o.paged_attention(*args, m, sizes.heads[2] ** -0.5)

            record(run, Row(name, "attention", case, dtype), attend, ref, None)


def check_pointwise(run: Run, sizes: Sizes, dtype: str) -> None:
    from ninfer_core.kernels.workload import KernelWorkload

    torch = run.torch
    dt = dtype_of(torch, dtype)
    gen = torch.Generator().manual_seed(3)
    t, n = sizes.rows, sizes.hidden
    h, hkv, d = sizes.heads
    x = torch.randn(t, n, generator=gen).to(run.where, dt)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(run.where, dt)
    x64 = x.double()
    norm_ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    gate, up = (torch.randn(t, n, generator=gen).to(run.where, dt) for _ in "gu")
    silu_ref = torch.nn.functional.silu(gate.double()) * up.double()
    q = torch.randn(t, h, d, generator=gen).to(run.where, dt)
    k = torch.randn(t, hkv, d, generator=gen).to(run.where, dt)
    pos = torch.arange(t, dtype=torch.float64)[:, None] * 1e4 ** (
        -torch.arange(d // 2, dtype=torch.float64) / (d // 2)
    )
    cos, sin = (f(pos).to(run.where, dt) for f in (torch.cos, torch.sin))

    def rotate(v):  # float64 rotate_half over the rounded cos/sin
        c, s = cos.double()[:, None], sin.double()[:, None]
        v1, v2 = v.double().chunk(2, dim=-1)
        return torch.cat((v1 * c - v2 * s, v2 * c + v1 * s), dim=-1)

    rope_ref = torch.cat((rotate(q), rotate(k)), dim=1)
    workload = KernelWorkload(None, None, dt)
    cases = {
        "rms_norm": (lambda o: o.rms_norm(x, w, 1e-6), norm_ref, f"[{t}, {n}]"),
        "silu_and_mul": (lambda o: o.silu_and_mul(gate, up), silu_ref, f"[{t}, {n}]"),
        "rope": (
            lambda o: torch.cat(o.apply_rope(q, k, cos, sin), dim=1),
            rope_ref,
            f"[{t}, {h}+{hkv}, {d}]",
        ),
    }
    for op, (call, ref, case) in cases.items():
        for name, ops in each_backend(run, op, case, dtype, workload):
            nbytes = 3 * ref.numel() * dt.itemsize  # read two, write one (about)

            def rate(ms: float, b: int = nbytes) -> str:
                return f"{b / ms / 1e6:.0f} GB/s"

            record(run, Row(name, op, case, dtype), lambda c=call, o=ops: c(o), ref, rate)


def check_delta_rule(run: Run, sizes: Sizes, dtype: str) -> None:
    """gated_delta_rule (its output, then the final states) and causal_conv1d for each
    step of `DELTA_GPU` (`DELTA_INTERPRET` on the CPU), each backend against the
    reference run in float64 on the same inputs."""
    gen = run.torch.Generator().manual_seed(11)
    for lengths in (DELTA_GPU if run.timed else DELTA_INTERPRET).steps:
        _delta_step(run, DELTA_GPU if run.timed else DELTA_INTERPRET, lengths, dtype, gen)


def _delta_step(run: Run, shape: DeltaSizes, lengths: tuple[int, ...], dtype: str, gen) -> None:
    from ninfer_core.kernels import delta_rule
    from ninfer_core.kernels.workload import KernelWorkload

    torch = run.torch
    dt = dtype_of(torch, dtype)
    hk, hv, d = shape.key_heads, shape.value_heads, shape.head_dim
    t, b = sum(lengths), len(lengths)
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    same = len(set(lengths)) == 1
    case = f"{b}x{lengths[0]}" if same else f"{lengths[0]}+{b - 1} seqs"
    case += f" [{hk}/{hv}x{d}]"

    def rand(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=gen)).to(run.where)

    q, k, v = rand(t, hk, d).to(dt), rand(t, hk, d).to(dt), rand(t, hv, d).to(dt)
    g = torch.nn.functional.logsigmoid(rand(t, hv) + 3)  # fp32 log-decays near 1
    beta, s0 = torch.sigmoid(rand(t, hv)).to(dt), rand(b, hv, d, d, scale=0.1)
    x = rand(t, shape.conv_dim).to(dt)
    w, c0 = rand(shape.conv_dim, shape.width).to(dt), rand(b, shape.conv_dim, shape.width - 1)
    want_s = s0.double()
    want = delta_rule.gated_delta_rule(*(a.double() for a in (q, k, v, g, beta)), want_s, offsets)
    conv_ref = delta_rule.causal_conv1d(x.double(), w.double(), None, c0.double(), offsets)
    workload = KernelWorkload(None, None, dt)
    # every state read and written once, q, k, v read and o written
    moved = 2 * s0.numel() * 4 + (2 * q.numel() + 2 * v.numel()) * dt.itemsize
    for name, ops in each_backend(run, "gated_delta_rule", case, dtype, workload):
        states = s0.clone()
        row = Row(name, "gated_delta_rule", case, dtype)
        state_row = Row(name, "gated_delta_rule", f"{case} states", dtype)

        def step(o=ops, st=states):  # advances `states` in place: timed without a copy
            return o.gated_delta_rule(q, k, v, g, beta, st, offsets)

        try:
            row.err = rel_err(step(), want)
            state_row.err = rel_err(states, want_s)
            if run.timed and run.left() > 0:
                row.ms = cuda_ms(torch, step)
                row.rate = f"{moved / row.ms / 1e6:.0f} GB/s"
        except Exception as exc:  # one failing kernel is a row, not the end of the check
            row.note = _failed(exc)
        run.rows += [row, state_row]
    for name, ops in each_backend(run, "causal_conv1d", case, dtype, workload):

        def conv(o=ops):
            return o.causal_conv1d(x, w, None, c0.clone(), offsets)

        record(run, Row(name, "causal_conv1d", case, dtype), conv, conv_ref, None)


def print_table(run: Run) -> None:
    print(
        f"\n{'backend':<8} {'op':<16} {'dtype':<5} {'case':<34} {'max rel err':>11}  "
        f"{'ms':>8}  rate"
    )
    for r in run.rows:
        err = f"{r.err:.2e}" if r.err is not None else "-"
        flag = " HIGH" if r.high else ""
        ms = f"{r.ms:.3f}" if r.ms is not None else "-"
        print(
            f"{r.backend:<8} {r.op:<16} {r.dtype:<5} {r.case:<34} {err:>11}{flag}  {ms:>8}  "
            f"{r.rate}{r.note}"
        )
    high = [r for r in run.rows if r.high]
    checked = sum(r.err is not None for r in run.rows)
    print(f"\n{checked} checked, {len(high)} above tolerance {TOLERANCE}")


# ------------------------------------------------------------------- end to end


def end_to_end(run: Run, *, quick: bool, out: Path) -> None:
    """Prefill and decode tok/s of a Qwen3-0.6B-shaped model, per backend."""
    from ninfer_core.bench import checkpoint, context_models
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.convert import convert

    layers = 8 if quick else 28
    shape = context_models.Shape(1024, 3072, layers, 16, 8, 128, 1, 32)  # Qwen3-0.6B's layers
    config = context_models.dense_config(shape)
    folder = out / f"qwen3-shaped-{layers}l"
    if run.left() < 60:
        print("\nend to end: skipped (time budget)")
        return
    print(f"\nend to end: Qwen3-0.6B-shaped, {layers} layers, random weights ({folder})")
    if not (folder / "model.safetensors").is_file():
        context_models.write_folder(folder, config, checkpoint.state_dict(config))
    q4 = out / f"qwen3-shaped-{layers}l-q4.ninfer"
    if not q4.is_file():
        convert(folder, q4, recipe_name="q4")
    prompt_len, new = (256, 32) if quick else (512, 64)
    prompt = [int(i) for i in run.torch.randint(0, 256, (prompt_len,))]
    print(f"prompt {prompt_len} tokens, {new} new (greedy); fp16 compute")
    for model, path in (("fp16", folder), ("Q4G64", q4)):
        for name in run.backends:
            if run.left() < 20:
                print("  (time budget spent)")
                return
            runtime = RuntimeConfig(
                dtype="fp16", gemm_backend=name, max_context=prompt_len + new + 16
            )
            timed_generation(run, f"{model:<6} --gemm-backend {name}", path, runtime, prompt, new)
    for acts in ("auto", "int8"):
        if run.left() < 20:
            return
        runtime = RuntimeConfig(
            dtype="fp16", activation_dtype=acts, max_context=prompt_len + new + 16
        )
        timed_generation(run, f"Q4G64  activations {acts:<4}", q4, runtime, prompt, new)


def timed_generation(
    run: Run, label: str, path: Path, runtime: Any, prompt: list[int], new: int
) -> None:
    """One greedy request through the engine, after a warm-up one, as `ninfer bench
    decode` times it (`ninfer_core.bench.decode.run_ninfer`)."""
    from ninfer_core.bench.greedy import greedy_stats
    from ninfer_core.generation import one_request_engine
    from ninfer_core.kernels.compose import kernel_line
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host

    host = create_host(warn=False)
    engine = None
    try:
        loaded = load_model(path, host=host, device=run.device, runtime=runtime)
        engine = one_request_engine(loaded, host=host, device=run.device, runtime=runtime)
        greedy_stats(engine, prompt, 4)
        stats = greedy_stats(engine, prompt, new)
        print(
            f"  {label:<32} prefill {stats.prefill_tok_s:8.0f} tok/s  decode "
            f"{stats.decode_tok_s:7.1f} tok/s  {kernel_line(loaded.kernels)}"
        )
    except Exception as exc:  # a backend refusing the model is a line, not the end
        print(f"  {label:<32} {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    finally:
        if engine is not None:
            engine.close()
        run.torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
