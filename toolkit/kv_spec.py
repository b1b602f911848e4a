"""The KV quantization spec (plain data), the named presets and the exact record sizes.

No torch here: the runtimes, the planner and the CLI size pools from these without importing it.
The quantization itself (bit packing, group-wise quantize/dequantize, Hadamard rotation) is in
toolkit/quant.py, which re-exports these names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolkit.errors import SpecError

FLOAT_BITS = (16, 32)
QUANT_BITS = tuple(range(2, 9))


@dataclass(frozen=True)
class KVQuantSpec:
    """How K and V are stored in the pool. Plain data; `validate(head_dim)` checks it against a model.

    k_bits / v_bits: 32 or 16 (float, both equal) or 2..8 (group-wise integer codes).
    k_group / v_group: values per scale along head_dim; 0 means the whole head_dim (per token).
    k_sym / v_sym: symmetric (scale only) or asymmetric (scale + zero point).
    rotate: apply an orthonormal Hadamard rotation along head_dim to K/Q and V before quantizing
        (undone on the output; attention scores are unchanged in exact arithmetic).
    fp_tail: keep the sequence's last, still-filling block in float16 (it is quantized too, and that
        copy is used once the block is no longer the last one).
    sink_blocks: 0 or 1; keep the sequence's first block (the attention sink) in float16.
    """

    k_bits: int = 8
    v_bits: int = 4
    k_group: int = 64
    v_group: int = 32
    k_sym: bool = True
    v_sym: bool = False
    rotate: bool = True
    fp_tail: bool = True
    sink_blocks: int = 1

    @property
    def is_float(self) -> bool:
        return self.k_bits in FLOAT_BITS

    def validate(self, head_dim: int | None = None) -> "KVQuantSpec":
        for name, bits in (("k_bits", self.k_bits), ("v_bits", self.v_bits)):
            if bits not in FLOAT_BITS + QUANT_BITS:
                raise SpecError(f"{name}={bits} is not supported: use 32 or 16 (float) or 2..8 (integer codes).")
        if (self.k_bits in FLOAT_BITS) != (self.v_bits in FLOAT_BITS) or (
            self.is_float and self.k_bits != self.v_bits
        ):
            raise SpecError(
                f"k_bits={self.k_bits} with v_bits={self.v_bits}: a float pool stores K and V with the same "
                "float type (both 16 or both 32); otherwise quantize both (2..8 bits)."
            )
        if self.sink_blocks not in (0, 1):
            raise SpecError(f"sink_blocks={self.sink_blocks} is not supported: use 0 or 1.")
        if self.is_float and (self.rotate or self.fp_tail or self.sink_blocks):
            raise SpecError(
                "rotate / fp_tail / sink_blocks only apply to quantized pools; turn them off for a float pool."
            )
        if head_dim is not None and not self.is_float:
            if self.rotate and head_dim & (head_dim - 1):
                raise SpecError(
                    f"rotate=True needs a power-of-two head_dim (Hadamard), got {head_dim}: use rotate=False."
                )
            for name, group in (("k_group", self.k_group), ("v_group", self.v_group)):
                g = group or head_dim
                if g <= 0 or head_dim % g:
                    raise SpecError(
                        f"{name}={group} does not divide head_dim={head_dim}: pick a divisor of {head_dim} "
                        f"(e.g. {_divisors_hint(head_dim)}) or 0 for one group per token."
                    )
            for name, bits in (("k_bits", self.k_bits), ("v_bits", self.v_bits)):
                if (head_dim * bits) % 8:
                    raise SpecError(f"head_dim={head_dim} * {name}={bits} is not a whole number of bytes.")
        return self

    def groups(self, head_dim: int) -> tuple[int, int]:
        """Group sizes along head_dim for K and V, with 0 resolved to head_dim."""
        return (self.k_group or head_dim, self.v_group or head_dim)

    def replace(self, **changes) -> "KVQuantSpec":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        if self.is_float:
            return f"fp{self.k_bits} K/V"
        k = f"K{self.k_bits}{'s' if self.k_sym else 'a'}/g{self.k_group or 'D'}"
        v = f"V{self.v_bits}{'s' if self.v_sym else 'a'}/g{self.v_group or 'D'}"
        extras = [x for x, on in (("rot", self.rotate), ("tail", self.fp_tail), ("sink", self.sink_blocks)) if on]
        return " ".join([k, v] + extras)


def _divisors_hint(n: int) -> str:
    return ", ".join(str(d) for d in (8, 16, 32, 64, 128) if n % d == 0) or "1"


# Named specs. "default" is what `pagedkv` uses unless told otherwise.
PRESETS: dict[str, KVQuantSpec] = {
    "fp32": KVQuantSpec(32, 32, 0, 0, True, True, False, False, 0),
    "fp16": KVQuantSpec(16, 16, 0, 0, True, True, False, False, 0),
    "default": KVQuantSpec(),
    # K7/V5 with rotation, float tail and sink: the most accurate preset at ~0.41x fp16.
    "best": KVQuantSpec(7, 5, 64, 32, True, False, True, True, 1),
    # 4-bit K and V, symmetric, for the tightest memory budget (~0.28x fp16).
    "k4v4": KVQuantSpec(4, 4, 32, 32, True, True, True, True, 1),
    # 5-bit K, 4-bit V (~0.30x fp16): at low bits the key error dominates, one more K bit fixes most of it.
    "k5v4": KVQuantSpec(5, 4, 64, 64, True, True, True, True, 1),
    # Comparators: llama.cpp q8_0 K + q4_0 V (blocks of 32 along head_dim, one fp16 scale)...
    "q8_0-q4_0": KVQuantSpec(8, 4, 32, 32, True, True, False, False, 0),
    # ...and ExecuTorch's quantized KV cache: int8 per-token asymmetric K and V.
    "et-int8": KVQuantSpec(8, 8, 0, 0, False, False, False, False, 0),
}


def resolve_spec(name_or_spec: str | KVQuantSpec) -> KVQuantSpec:
    if isinstance(name_or_spec, KVQuantSpec):
        return name_or_spec
    if name_or_spec not in PRESETS:
        raise SpecError(f"unknown KV spec '{name_or_spec}': choose one of {', '.join(PRESETS)}.")
    return PRESETS[name_or_spec]


# ----------------------------------------------------------------------------------------------
# Record sizes


@dataclass(frozen=True)
class RecordLayout:
    """Byte/element counts of one token-head record, derived from a spec and head_dim."""

    head_dim: int
    k_code_bytes: int  # uint8 count (float specs: float elements)
    v_code_bytes: int
    k_scale_count: int  # float16 count (scales, then zeros if asymmetric)
    v_scale_count: int

    @property
    def code_width(self) -> int:
        return self.k_code_bytes + self.v_code_bytes

    @property
    def scale_width(self) -> int:
        return self.k_scale_count + self.v_scale_count


def record_layout(spec: KVQuantSpec, head_dim: int) -> RecordLayout:
    spec.validate(head_dim)
    if spec.is_float:
        return RecordLayout(head_dim, head_dim, head_dim, 0, 0)
    kg, vg = spec.groups(head_dim)
    return RecordLayout(
        head_dim,
        head_dim * spec.k_bits // 8,
        head_dim * spec.v_bits // 8,
        (head_dim // kg) * (1 if spec.k_sym else 2),
        (head_dim // vg) * (1 if spec.v_sym else 2),
    )


def bytes_per_token(spec: KVQuantSpec, num_kv_heads: int, head_dim: int, num_layers: int = 1) -> int:
    """Exact pool bytes one cached token costs (codes + fp16 scales/zeros), all layers and KV heads.

    The per-sequence float16 tail/sink blocks are a fixed cost per conversation, not per token; see
    `fp_stage_bytes_per_sequence`.
    """
    rec = record_layout(spec, head_dim)
    if spec.is_float:
        per_head = 2 * head_dim * spec.k_bits // 8
    else:
        per_head = rec.code_width + 2 * rec.scale_width
    return per_head * num_kv_heads * num_layers


def fp_stage_bytes_per_sequence(
    spec: KVQuantSpec, block_size: int, num_kv_heads: int, head_dim: int, num_layers: int = 1
) -> int:
    """Float16 bytes each live sequence holds for its float tail and sink blocks (K and V, all layers)."""
    if spec.is_float or not (spec.fp_tail or spec.sink_blocks):
        return 0
    return 2 * 2 * 2 * block_size * num_kv_heads * head_dim * num_layers


def fp16_bytes_per_token(num_kv_heads: int, head_dim: int, num_layers: int = 1) -> int:
    return 2 * 2 * head_dim * num_kv_heads * num_layers
