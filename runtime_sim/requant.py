"""Re-quantization of stored records without torch (the compact tier, issue 25): the numpy twin of
toolkit.quant.requantize, for runtimes that run without torch (the onnxruntime backend).

    codes, scales = requantize_np(codes, scales, spec, compact, head_dim)

Bit for bit the reference's numbers: every step is the same IEEE float32 operation in the same order
(dequantize: u * scale (+ zero); quantize: amax / qmax or (max - min) / levels, rounded to float16,
round-half-even of x / s, clamp), and the bit packing is the same LSB-first stream
(toolkit/POOL_FORMAT.md, "One record"). tests/test_export_compact.py compares the two.
"""

from __future__ import annotations

import numpy as np

from toolkit.kv_spec import KVQuantSpec, record_layout

_F16_MAX = np.float32(65504.0)


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """uint8 [..., n*bits/8] -> int32 codes [..., n] (value i in bits [i*bits, i*bits + bits), LSB first)."""
    stream = np.unpackbits(packed, axis=-1, bitorder="little")[..., :n * bits]
    stream = stream.reshape(*packed.shape[:-1], n, bits).astype(np.int32)
    return (stream << np.arange(bits, dtype=np.int32)).sum(-1, dtype=np.int32)


def pack_bits(u: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [..., n] (< 2^bits) -> uint8 [..., n*bits/8], the inverse of unpack_bits."""
    stream = (u.astype(np.int32)[..., None] >> np.arange(bits, dtype=np.int32)) & 1
    return np.packbits(stream.reshape(*u.shape[:-1], -1).astype(np.uint8), axis=-1, bitorder="little")


def dequantize(packed: np.ndarray, meta: np.ndarray, bits: int, group: int, sym: bool, d: int) -> np.ndarray:
    """toolkit.quant.dequantize: -> float32 [..., D]."""
    ng = d // group
    u = unpack_bits(packed, bits, d).astype(np.float32).reshape(*packed.shape[:-1], ng, group)
    scale = meta[..., :ng].astype(np.float32)[..., None]
    if sym:
        x = (u - np.float32(1 << (bits - 1))) * scale
    else:
        x = u * scale + meta[..., ng:2 * ng].astype(np.float32)[..., None]
    return x.reshape(*packed.shape[:-1], d)


def quantize(x: np.ndarray, bits: int, group: int, sym: bool) -> tuple[np.ndarray, np.ndarray]:
    """toolkit.quant.quantize: float32 [..., D] -> (codes uint8 [..., D*bits/8], scales float16 [..., G or 2G])."""
    d = x.shape[-1]
    g = x.astype(np.float32).reshape(*x.shape[:-1], d // group, group)
    if sym:
        qmax = np.float32((1 << (bits - 1)) - 1)
        scale16 = np.minimum(np.abs(g).max(-1) / qmax, _F16_MAX).astype(np.float16)
        s = np.where(scale16 == 0, np.float16(1), scale16).astype(np.float32)[..., None]
        u = np.clip(np.rint(g / s), -qmax, qmax) + np.float32(1 << (bits - 1))
        meta = scale16
    else:
        levels = np.float32((1 << bits) - 1)
        lo, hi = g.min(-1), g.max(-1)
        zero16 = np.clip(lo, -_F16_MAX, _F16_MAX).astype(np.float16)
        scale16 = np.minimum((hi - lo) / levels, _F16_MAX).astype(np.float16)
        s = np.where(scale16 == 0, np.float16(1), scale16).astype(np.float32)[..., None]
        u = np.clip(np.rint((g - zero16.astype(np.float32)[..., None]) / s), np.float32(0), levels)
        meta = np.concatenate((scale16, zero16), axis=-1)
    return pack_bits(u.astype(np.int32).reshape(x.shape), bits), meta


def requantize_np(codes: np.ndarray, scales: np.ndarray, src: KVQuantSpec, dst: KVQuantSpec,
                  head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """toolkit.quant.requantize in numpy: records in spec src -> the same tokens' records in spec dst."""
    d = head_dim
    a = record_layout(src, d)
    if src.is_float or dst.is_float:
        raise ValueError("requantize converts integer-code records; float pools store values, not codes.")
    if codes.shape[-1] != a.code_width or scales.shape[-1] != a.scale_width:
        raise ValueError(f"records of {src.describe()} have {a.code_width} code bytes and {a.scale_width} scales "
                         f"at head_dim {d}, got {codes.shape[-1]} and {scales.shape[-1]}.")
    kg, vg = src.groups(d)
    ckg, cvg = dst.groups(d)
    k = dequantize(codes[..., :a.k_code_bytes], scales[..., :a.k_scale_count], src.k_bits, kg, src.k_sym, d)
    v = dequantize(codes[..., a.k_code_bytes:], scales[..., a.k_scale_count:], src.v_bits, vg, src.v_sym, d)
    kc, km = quantize(k, dst.k_bits, ckg, dst.k_sym)
    vc, vm = quantize(v, dst.v_bits, cvg, dst.v_sym)
    return np.concatenate((kc, vc), axis=-1), np.concatenate((km, vm), axis=-1)
