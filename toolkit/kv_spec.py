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


# the fields a layer group's own spec may change (the record's widths); the others (rotate, fp_tail,
# sink_blocks) shape the stage rows and the sink, which every layer of a sequence shares
GROUP_SPEC_FIELDS = ("k_bits", "v_bits", "k_group", "v_group", "k_sym", "v_sym")


def check_group_spec(pool: KVQuantSpec, group: KVQuantSpec, head_dim: int, where: str = "the sliding spec") -> KVQuantSpec:
    """A layer group's own spec (e.g. `export --sliding-spec`) against the pool's: both quantized, equal but
    for GROUP_SPEC_FIELDS, valid for head_dim. Returns it; SpecError (one line) otherwise."""
    group.validate(head_dim)
    if pool.is_float or group.is_float:
        raise SpecError(f"{where} {group.describe()} with the pool's {pool.describe()}: a layer group's own spec "
                        "needs quantized specs on both sides (a float pool has one spec for every layer).")
    other = [f for f in ("rotate", "fp_tail", "sink_blocks") if getattr(group, f) != getattr(pool, f)]
    if other:
        raise SpecError(f"{where} differs from the pool's spec in {', '.join(other)}: a layer group may change "
                        f"only {', '.join(GROUP_SPEC_FIELDS)}; keep the others as in {pool.describe()}.")
    return group


def check_stored_group_spec(pool: KVQuantSpec, group: KVQuantSpec, head_dim: int, index: int, window: int,
                            where: str) -> KVQuantSpec:
    """The spec a manifest or a conversation file stores for layer group `index` (sliding window `window`, 0 for
    a global group): only a sliding group after the first may have its own (the first group's spec is the
    pool's), then check_group_spec. Returns it; SpecError (one line) otherwise."""
    if index == 0 or not window:
        raise SpecError(f"{where} gives layer group {index} ({'global' if not window else 'the first'}) its own "
                        "spec: only a sliding group after the first stores one")
    return check_group_spec(pool, group, head_dim, f"layer group {index}'s spec")


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


def _field_value(key: str, value, where: str):
    """A spec field's value from JSON/Python (exact types) or override text ("4", "true")."""
    want = {f.name: f.type for f in dataclasses.fields(KVQuantSpec)}[key]
    is_bool = want in (bool, "bool")
    if isinstance(value, str):
        text = value.strip().lower()
        if is_bool:
            if text not in ("1", "0", "true", "false", "yes", "no"):
                raise SpecError(f"spec field {key}={value!r} in {where}: use true or false.")
            return text in ("1", "true", "yes")
        try:
            return int(text)
        except ValueError:
            raise SpecError(f"spec field {key}={value!r} in {where}: expected an integer.") from None
    if is_bool and isinstance(value, bool):
        return value
    if not is_bool and isinstance(value, int) and not isinstance(value, bool):
        return value
    kind = "true or false" if is_bool else "an integer"
    raise SpecError(f"spec field {key}={value!r} in {where}: expected {kind}.")


def spec_from_dict(fields: dict, base: KVQuantSpec | None = None, where: str = "the spec") -> KVQuantSpec:
    """{field: value} over `base` (every field required when base is None), types checked."""
    if not isinstance(fields, dict):
        raise SpecError(f"{where} must be an object of spec fields, not {type(fields).__name__}.")
    names = [f.name for f in dataclasses.fields(KVQuantSpec)]
    unknown = [k for k in fields if k not in names]
    if unknown:
        raise SpecError(f"unknown spec field {unknown[0]!r} in {where}: fields are {', '.join(names)}.")
    if base is None:
        missing = [k for k in names if k not in fields]
        if missing:
            raise SpecError(f"{where} lacks the spec field {missing[0]!r}.")
        base = KVQuantSpec()
    return base.replace(**{k: _field_value(k, v, where) for k, v in fields.items()})


def resolve_spec(spec: "str | dict | KVQuantSpec") -> KVQuantSpec:
    """The one spec parser (CLI export/plan/eval/simulate and toolkit.compile):
    a preset name ("default"), a preset with field overrides ("default:v_group=16,rotate=false"),
    a dict of fields over the default preset ({"k_bits": 4}), or a KVQuantSpec. Not validated
    against a model here (`.validate(head_dim)` does that)."""
    if isinstance(spec, KVQuantSpec):
        return spec
    if isinstance(spec, dict):
        return spec_from_dict(spec, PRESETS["default"], "the spec dict")
    if not isinstance(spec, str):
        raise SpecError(f"a KV spec is a preset name, 'PRESET:field=value,...', a dict or a KVQuantSpec, "
                        f"not {type(spec).__name__}.")
    base, colon, overrides = spec.partition(":")
    base = base.strip()
    if base not in PRESETS:
        raise SpecError(f"unknown KV spec '{base}': choose one of {', '.join(PRESETS)} "
                        "(optionally with overrides, e.g. default:k_bits=6,v_group=16).")
    if not colon:
        return PRESETS[base]
    changes = {}
    names = [f.name for f in dataclasses.fields(KVQuantSpec)]
    for item in overrides.split(","):
        key, eq, value = (x.strip() for x in item.partition("="))
        if key not in names or not eq:
            names = ", ".join(names)
            raise SpecError(f"bad spec override '{item}' in '{spec}': write FIELD=VALUE with FIELD one of {names}.")
        changes[key] = value
    return spec_from_dict(changes, PRESETS[base], f"'{spec}'")


# The specs `pagedkv export` chooses from when no --spec is given, by their KLD on the calibration text
# (toolkit/calibration.py), measured on the model being exported, never picked by model name: the first
# while its KLD is at most DEFAULT_PREFERRED_KLD, else the one of lower KLD. They take exactly the same
# bytes at every head_dim (K8/V4 and K7/V5, 0.414x fp16), so the pool's size does not depend on the
# choice, but not the same time: K8/V4 runs the kernels' fused 8/4-bit path, K7/V5 widens its codes first
# (3.1x the attention step on avx2, 1.9x on avx512-vnni, at SmolLM2's dims and 16K keys). On the
# calibration text default measures 0.00085 (SmolLM2), 0.00091 (Gemma 3 270M), 0.00046 (Qwen2.5-1.5B);
# best 0.00017-0.00032 (benchmarks/default_spec.py).
DEFAULT_CANDIDATES = ("default", "best")
DEFAULT_PREFERRED_KLD = 0.001


# The specs `pagedkv eval`, `pagedkv plan` and the benchmarks compare unless told otherwise.
DEFAULT_SPECS = ["fp16", "q8_0-q4_0", "et-int8", "default", "best", "k4v4", "k5v4"]


def parse_spec(text: "str | KVQuantSpec | tuple") -> "tuple[str, KVQuantSpec]":
    """A table row's (name, spec): 'default' | 'default:v_group=16,v_sym=true' (named as written) |
    (name, KVQuantSpec) | KVQuantSpec (named by describe()). Text goes through resolve_spec."""
    if isinstance(text, tuple):
        return text[0], text[1]
    if isinstance(text, KVQuantSpec):
        return text.describe(), text
    return text, resolve_spec(text)


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


# ----------------------------------------------------------------------------------------------
# The compact tier: aged blocks re-quantized to a spec of fewer bytes (issue 25)


# The compact tier's spec, chosen by benchmarks/compact_tier.py (BENCHMARKS.md, "The compact tier"):
# K4 symmetric / V3 asymmetric, groups of 64, rotated: 0.242x fp16 bytes per token at head_dim 64. On
# SmolLM2 over an 8K wikitext-2 stream with blocks older than 1K tokens compact: PPL +0.25%, KLD 0.0024,
# top-1 97.6% vs all-default (K5/V2, the same bytes: +0.30%, 0.0034, 97.0%). At low bits the K error
# dominates: every K3 per-token candidate cost +6% PPL at 2K.
COMPACT_SPEC = KVQuantSpec(4, 3, 64, 64, True, False, True, True, 1)


def compact_spec_for(spec: KVQuantSpec, head_dim: int, compact: KVQuantSpec | None = None) -> KVQuantSpec:
    """The compact tier's spec for a conversation in `spec`: `compact`'s record fields (default COMPACT_SPEC;
    e.g. `export --compact-spec`) with the conversation's rotation, fp_tail and sink_blocks (checked)."""
    return check_compact(spec, (compact or COMPACT_SPEC).replace(rotate=spec.rotate, fp_tail=spec.fp_tail,
                                                                 sink_blocks=spec.sink_blocks), head_dim)


def check_compact(spec: KVQuantSpec, compact: KVQuantSpec, head_dim: int) -> KVQuantSpec:
    """`compact` as the compact tier of a conversation in `spec`, or SpecError: both quantized, the same
    rotation (queries are rotated once per call, for every block they read) and fewer record bytes.
    Only its record fields count (bits, groups, sym); fp_tail and sink_blocks are the conversation's."""
    spec.validate(head_dim)
    compact.validate(head_dim)
    if spec.is_float or compact.is_float:
        raise SpecError("the compact tier re-quantizes integer codes: use quantized specs for both "
                        f"(got {spec.describe()} -> {compact.describe()}).")
    if compact.rotate != spec.rotate:
        raise SpecError(f"compact spec rotate={compact.rotate} differs from the conversation's rotate={spec.rotate}: "
                        "a query reads both tiers in one frame; set rotate to match.")
    if bytes_per_token(compact, 1, head_dim) >= bytes_per_token(spec, 1, head_dim):
        raise SpecError(f"compact spec {compact.describe()} takes {bytes_per_token(compact, 1, head_dim)} bytes per "
                        f"token-head, not fewer than {spec.describe()}'s {bytes_per_token(spec, 1, head_dim)}: "
                        "lower its bits.")
    return compact
