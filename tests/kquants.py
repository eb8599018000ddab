"""Encoders for ggml's Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS super-blocks, for writing test
files.

gguf-py dequantizes K-quants but cannot write them (`gguf.quants.quantize` raises
NotImplementedError), so the tests encode their own: a plain absmax choice of scales, not
llama.cpp's search, which is all a test file needs. The layouts follow
`gguf.quants` (its classes of the same names); `test_gguf_kquants.py` checks that gguf-py
decodes what these write.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import IQ4_NL


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x, 1.0)


def _symmetric_scales(a: np.ndarray, sub_blocks: int, top: int, steps: int):
    """A symmetric K-quant's scales by absmax: `a` as [super-blocks, sub_blocks, weights]
    (float64), the fp16 `d` per super-block, each sub-block's integer scale `s` (0..steps,
    `d * s` reaching its largest |weight| / top) and the effective scale `d * s`."""
    x = a.astype(np.float64).reshape(-1, sub_blocks, 256 // sub_blocks)
    sub = np.abs(x).max(-1) / top
    d = _f16(sub.max(-1) / steps)
    s = np.clip(np.rint(sub / _safe(d.astype(np.float64))[:, None]), 0, steps)
    return x, d, s, d.astype(np.float64)[:, None] * s


def encode_q6_k(a: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 210]."""
    rows = a.shape[0]
    x, d, sc, eff = _symmetric_scales(a, 16, top=31, steps=127)
    sc = sc.astype(np.int8)
    q = np.clip(np.rint(x / _safe(eff)[..., None]), -32, 31) * (eff[..., None] > 0)
    u = (q + 32).astype(np.uint8).reshape(-1, 256)
    four = u.reshape(-1, 2, 2, 64)  # weight 128 h + 64 s + j
    ql = (four[:, :, 0] & 15) | ((four[:, :, 1] & 15) << 4)
    pairs = (u >> 4).reshape(-1, 2, 4, 32)  # weight 128 h + 32 t + j
    qh = pairs[:, :, 0] | (pairs[:, :, 1] << 2) | (pairs[:, :, 2] << 4) | (pairs[:, :, 3] << 6)
    parts = (ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8))
    blocks = np.concatenate([p.reshape(len(u), -1) for p in parts], axis=1)
    return blocks.reshape(rows, -1)


def _asymmetric_codes(a: np.ndarray, sub_blocks: int, top: int, steps: int):
    """An asymmetric K-quant by absmax: per super-block the fp16 `d` and `dmin`, per
    sub-block the integer scale `sc` and min `m` (0..steps; the weight is
    `u * d * sc - dmin * m`), and the codes `u` (0..top) as [super-blocks, sub_blocks,
    weights]."""
    x = a.astype(np.float64).reshape(-1, sub_blocks, 256 // sub_blocks)
    low = np.minimum(x.min(-1), 0.0)  # ggml's min is -dmin * m with m >= 0
    scale = (x.max(-1) - low) / top
    d, dmin = _f16(scale.max(-1) / steps), _f16((-low).max(-1) / steps)
    df, dmf = d.astype(np.float64), dmin.astype(np.float64)
    sc = np.clip(np.rint(scale / _safe(df)[:, None]), 0, steps).astype(np.uint8)
    m = np.clip(np.rint(-low / _safe(dmf)[:, None]), 0, steps).astype(np.uint8)
    eff, effm = df[:, None] * sc, dmf[:, None] * m
    u = np.clip(np.rint((x + effm[..., None]) / _safe(eff)[..., None]), 0, top)
    return d, dmin, sc, m, (u * (eff[..., None] > 0)).astype(np.uint8)


def _k_head(d, dmin, sc, m) -> np.ndarray:
    """Q4_K's and Q5_K's first 16 bytes: fp16 d and dmin, then the eight 6-bit (sc, m)
    pairs in 12 bytes."""
    packed = np.concatenate(
        (
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ),
        axis=1,
    )
    fp16 = (d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2))
    return np.concatenate((*fp16, packed), axis=1)


def _k_runs(u: np.ndarray) -> np.ndarray:
    """Low nibbles [n, 8, 32] -> Q4_K's and Q5_K's 128 bytes: run i holds sub-blocks 2i
    (low nibbles) and 2i + 1 (high)."""
    low = u & 15
    return (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)


def encode_q4_k(a: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 144]."""
    rows = a.shape[0]
    d, dmin, sc, m, u = _asymmetric_codes(a, 8, top=15, steps=63)  # u: [n, 8, 32]
    return np.concatenate((_k_head(d, dmin, sc, m), _k_runs(u)), axis=1).reshape(rows, -1)


def encode_q5_k(a: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 176]."""
    rows = a.shape[0]
    d, dmin, sc, m, u = _asymmetric_codes(a, 8, top=31, steps=63)  # u: [n, 8, 32]
    qh = sum((u[:, b] >> 4) << b for b in range(8)).astype(np.uint8)  # weight 32 b + j: bit b
    parts = (_k_head(d, dmin, sc, m), qh, _k_runs(u))
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def _pairs(u: np.ndarray) -> np.ndarray:
    """2-bit values [n, 256] -> Q2_K's and Q3_K's 64 bytes: weight 128 h + 32 s + j in
    bits 2s, 2s + 1 of byte 32 h + j."""
    four = (u & 3).reshape(-1, 2, 4, 32)
    return sum(four[:, :, s] << (2 * s) for s in range(4)).astype(np.uint8).reshape(-1, 64)


def encode_q3_k(a: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 110]."""
    rows = a.shape[0]
    x, d, s, eff = _symmetric_scales(a, 16, top=4, steps=31)
    q = np.clip(np.rint(x / _safe(eff)[..., None]), -4, 3) * (eff[..., None] > 0)
    u = (q + 4).astype(np.uint8).reshape(-1, 256)  # 0..7
    hbits = (u >> 2).reshape(-1, 8, 32)  # weight 32 b + j: bit b of byte j
    hmask = sum(hbits[:, b] << b for b in range(8)).astype(np.uint8)
    sc = (s + 32).astype(np.uint8)  # 6 bits, the scale sc - 32
    low = (sc[:, 0:8] & 15) | ((sc[:, 8:16] & 15) << 4)
    top = sum(((sc[:, 4 * t : 4 * t + 4] >> 4) & 3) << (2 * t) for t in range(4)).astype(np.uint8)
    parts = (hmask, _pairs(u), low, top, d.view(np.uint8).reshape(-1, 2))
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def encode_q2_k(a: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 84]."""
    rows = a.shape[0]
    d, dmin, sc, m, u = _asymmetric_codes(a, 16, top=3, steps=15)
    u = u.reshape(-1, 256)
    parts = (sc | (m << 4), _pairs(u), d.view(np.uint8).reshape(-1, 2),
             dmin.view(np.uint8).reshape(-1, 2))  # fmt: skip
    return np.concatenate(parts, axis=1).reshape(rows, -1)


#: IQ4_NL's and IQ4_XS's values.
IQ4_VALUES = np.array(IQ4_NL.kvalues)


def encode_iq4_xs(a: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 136]."""
    rows = a.shape[0]
    x, d, s, eff = _symmetric_scales(a, 8, top=127, steps=31)
    nib = np.abs((x / _safe(eff)[..., None])[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)
    qs = (nib[..., :16] | (nib[..., 16:] << 4)).reshape(-1, 128)  # sub-block: j, j + 16
    ls = (s + 32).astype(np.uint16)  # 6 bits, the scale ls - 32
    low = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    high = sum(((ls[:, k] >> 4) & 3) << (2 * k) for k in range(8)).astype(np.uint16)
    parts = (d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2), low, qs)
    return np.concatenate(parts, axis=1).reshape(rows, -1)


ENCODERS = {
    "Q2_K": encode_q2_k, "Q3_K": encode_q3_k, "Q4_K": encode_q4_k, "Q5_K": encode_q5_k,
    "Q6_K": encode_q6_k, "IQ4_XS": encode_iq4_xs,
}  # fmt: skip
