"""KV quantization formats: bit packing, group-wise quantize/dequantize, Hadamard rotation (torch).

The spec, the presets and the record sizes live in toolkit/kv_spec.py (no torch) and are re-exported
here.

Storage of one token of one KV head (the "record"), for a quantized spec:

    codes  (uint8):   K bitstream (D * k_bits / 8 bytes) ++ V bitstream (D * v_bits / 8 bytes)
    scales (float16): K scales[nk] (++ K zeros[nk] if K asymmetric) ++ V scales[nv] (++ V zeros[nv])

where nk = head_dim / k_group and nv = head_dim / v_group are group COUNTS (the spec's k_group /
v_group are values per group). toolkit/POOL_FORMAT.md is the complete format, in one place.

Bit packing: value i of a head vector occupies bits [i*b, i*b + b) of its bitstream, least
significant bit first, so for 4 bits value 0 is the LOW nibble of byte 0 (ORT's int4 order).
Codes are unsigned. Symmetric: x = (u - 2^(b-1)) * scale, u in [1, 2^b - 1] (int4 stores value+8
like ORT's GroupQueryAttention). Asymmetric: x = u * scale + zero, u in [0, 2^b - 1], zero = group min.

Quantization rule (the native kernels reproduce it bit for bit):
    scale16 = fp16(amax / qmax)  (sym)   or   fp16((max - min) / (2^b - 1))  (asym)
    u = clamp(round_half_even(x / s), ...)  with s = scale16, or 1 where scale16 == 0
A group of zeros gets scale 0 and dequantizes to exact zeros (no division by zero).

Float specs (16 or 32 bits for both K and V) store K ++ V directly in a float16/float32 codes tensor.
"""

from __future__ import annotations

import math

import torch

from toolkit.kv_spec import (  # noqa: F401  (re-exported: the spec is part of this module's interface)
    FLOAT_BITS,
    PRESETS,
    QUANT_BITS,
    KVQuantSpec,
    RecordLayout,
    bytes_per_token,
    check_compact,
    fp16_bytes_per_token,
    fp_stage_bytes_per_sequence,
    record_layout,
    resolve_spec,
)

# ----------------------------------------------------------------------------------------------
# Hadamard rotation (fast Walsh-Hadamard transform, the same butterflies as the C++ kernels)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Hadamard transform along the last dim (power of two). Its own inverse."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    y = x
    while h < d:
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, d) * (1.0 / math.sqrt(d))


# ----------------------------------------------------------------------------------------------
# Bit packing


def _bit_positions(n: int, bits: int, device=None):
    pos = torch.arange(n, device=device) * bits
    return pos // 8, pos % 8


def pack_bits(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes [..., n] (values < 2^bits) into uint8 [..., n*bits/8], LSB first.

    Written with integer * / // % (no shifts) so that it exports to standard ONNX ops."""
    n = u.shape[-1]
    if bits == 8:
        return u.to(torch.uint8)
    nbytes = n * bits // 8
    byte, shift = _bit_positions(n, bits, u.device)
    v = u.to(torch.int32) * (2 ** shift).to(torch.int32)  # u << shift: at most 15 bits
    out = torch.zeros(*u.shape[:-1], nbytes + 1, dtype=torch.int32, device=u.device)
    out.index_add_(-1, byte, v % 256)
    out.index_add_(-1, byte + 1, v // 256)
    return out[..., :nbytes].to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., n*bits/8] -> int32 codes [..., n]."""
    if bits == 8:
        return packed.to(torch.int32)
    byte, shift = _bit_positions(n, bits, packed.device)
    p = torch.nn.functional.pad(packed.to(torch.int32), (0, 1))
    word = p[..., byte] + p[..., byte + 1] * 256
    return (word // (2 ** shift).to(torch.int32)) % (1 << bits)


# ----------------------------------------------------------------------------------------------
# Group-wise quantization of head vectors


def quantize(x: torch.Tensor, bits: int, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float32 -> (packed codes uint8 [..., D*bits/8], scales float16 [..., G or 2G])."""
    d = x.shape[-1]
    g = x.reshape(*x.shape[:-1], d // group, group).float()
    if sym:
        qmax = (1 << (bits - 1)) - 1
        scale16 = (g.abs().amax(-1) / qmax).clamp(max=65504.0).to(torch.float16)
        s = torch.where(scale16 == 0, torch.ones_like(scale16), scale16).float().unsqueeze(-1)
        u = torch.round(g / s).clamp(-qmax, qmax) + (1 << (bits - 1))
        meta = scale16
    else:
        levels = (1 << bits) - 1
        lo, hi = g.amin(-1), g.amax(-1)
        zero16 = lo.clamp(-65504.0, 65504.0).to(torch.float16)
        scale16 = ((hi - lo) / levels).clamp(max=65504.0).to(torch.float16)
        s = torch.where(scale16 == 0, torch.ones_like(scale16), scale16).float().unsqueeze(-1)
        u = torch.round((g - zero16.float().unsqueeze(-1)) / s).clamp(0, levels)
        meta = torch.cat((scale16, zero16), dim=-1)
    return pack_bits(u.to(torch.int32).reshape(x.shape), bits), meta


def dequantize(packed: torch.Tensor, meta: torch.Tensor, bits: int, group: int, sym: bool, d: int) -> torch.Tensor:
    """Inverse of quantize: -> float32 [..., D]."""
    u = unpack_bits(packed, bits, d).float()
    u = u.reshape(*u.shape[:-1], d // group, group)
    ng = d // group
    scale = meta[..., :ng].float().unsqueeze(-1)
    if sym:
        x = (u - (1 << (bits - 1))) * scale
    else:
        x = u * scale + meta[..., ng : 2 * ng].float().unsqueeze(-1)
    return x.reshape(*u.shape[:-2], d)


def fake_quantize(x: torch.Tensor, bits: int, group: int, sym: bool) -> torch.Tensor:
    """quantize followed by dequantize: the values attention sees for a quantized token."""
    packed, meta = quantize(x, bits, group, sym)
    return dequantize(packed, meta, bits, group, sym, x.shape[-1])


# ----------------------------------------------------------------------------------------------
# Re-quantization of stored records (the compact tier, POOL_FORMAT.md "Compact region")


def requantize(codes: torch.Tensor, scales: torch.Tensor, src: KVQuantSpec, dst: KVQuantSpec,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Records in spec `src` -> the same tokens' records in spec `dst`: the stored codes dequantized,
    then quantized with dst's rule (the float values are gone; rotation, if any, stays as stored).

    codes [..., src code_width] uint8, scales [..., src scale_width] float16 -> (codes [..., dst
    code_width] uint8, scales [..., dst scale_width] float16). The reference every other
    implementation of the conversion reproduces bit for bit."""
    d = head_dim
    a, b = record_layout(src, d), record_layout(dst, d)
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
    assert kc.shape[-1] + vc.shape[-1] == b.code_width and km.shape[-1] + vm.shape[-1] == b.scale_width
    return torch.cat((kc, vc), dim=-1), torch.cat((km, vm), dim=-1)


def compact_block(codes: torch.Tensor, scales: torch.Tensor, compact_codes: torch.Tensor,
                  compact_scales: torch.Tensor, src: int, dst: int, spec: KVQuantSpec, compact: KVQuantSpec,
                  head_dim: int) -> None:
    """One layer's block `src` of the default region re-quantized (`requantize`) into block `dst` of its
    compact region, in place. Nothing else changes: the default block stays as it was until the
    block pool frees it, and the block table then names num_blocks + dst (POOL_FORMAT.md)."""
    compact_codes[dst], compact_scales[dst] = requantize(codes[src], scales[src], spec, compact, head_dim)
