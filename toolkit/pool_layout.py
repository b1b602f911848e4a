"""The tensors that hold a paged KV pool, as plain data.

Every attention layer owns three tensors (separate allocations, so a phone never needs one big
buffer); block ids and block tables are shared by all layers:

    codes  [num_blocks, kv_heads, block_size, code_width]   uint8 (float16/float32 for float specs)
           heads-first: one block of one KV head is a contiguous run of block_size records.
    scales [num_blocks, kv_heads, block_size, scale_width]  float16 (shape [1,1,1,1] for float specs)
    stage  [max_seqs, 2, 2, kv_heads, block_size, head_dim] float16: per sequence slot,
           [sink|tail] x [K|V] float copies of the first block and of the block being filled
           (shape [1,2,2,kv_heads,block_size,head_dim] when the spec keeps neither).

A token at position p of sequence s lives in slot block_tables[s, p // block_size] * block_size
+ p % block_size. Block table entries of -1 are holes (no block): their keys are skipped.

A pool may also have a compact region (the compact tier, issue 25): per layer two more tensors
    compact_codes  [num_compact_blocks, kv_heads, block_size, compact code_width]   uint8
    compact_scales [num_compact_blocks, kv_heads, block_size, compact scale_width]  float16
holding aged blocks re-quantized to the `compact` spec. Block ids num_blocks .. num_blocks +
num_compact_blocks - 1 in a block table name compact block id - num_blocks. A layout without one
(num_compact_blocks 0, the default) is exactly the pool it was before.
toolkit/POOL_FORMAT.md documents the whole format (records, rotation, float copies, attention rule).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from toolkit.errors import SpecError
from toolkit.kv_spec import KVQuantSpec, bytes_per_token, check_compact, fp_stage_bytes_per_sequence, record_layout

# element sizes of the pool's dtypes (by name: no torch import for the runtimes that do not need it)
ELEMENT_BYTES = {"uint8": 1, "float16": 2, "float32": 4}

VALID_BLOCK_SIZES = (16, 32)  # the one list (the native runner checks the same two)

# The fewest blocks a pool sized from a byte budget may have (export --pool-mb, run/chat --pool-mb /
# --pool-fraction, the Android runner's budget): the ONNX graph's block dimension is exported with min=2
# (torch.export specializes a size of 1), so a runtime pool of 1 block could not be fed to it.
MIN_POOL_BLOCKS = 2

# Pool tensors start on a cache line: numpy's large allocations start 16 bytes past one, and then every
# 64-byte row load of a record straddles two lines (the core bench's 16K step with BENCH_POOL_OFFSET=16
# measured ~1-3% slower than with 0).
POOL_ALIGN = 64


def zeros_aligned(shape: tuple, dtype, align: int = POOL_ALIGN):
    """A zeroed C-contiguous numpy array whose data starts at a multiple of `align` bytes (a view into a
    slightly larger buffer, which it keeps alive)."""
    import numpy as np

    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    buf = np.zeros(n + align, dtype=np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + n].view(dt).reshape(shape)


def check_block_size(block_size: int) -> None:
    if block_size not in VALID_BLOCK_SIZES:
        raise SpecError(f"block size {block_size!r} is invalid: use 16 or 32 tokens per block.")


@dataclass(frozen=True)
class PoolLayout:
    spec: KVQuantSpec
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    max_seqs: int
    compact: KVQuantSpec | None = None  # the compact region's spec (None: no compact region)
    num_compact_blocks: int = 0

    def __post_init__(self):
        check_block_size(self.block_size)
        if self.num_compact_blocks < 0 or (self.num_compact_blocks > 0) != (self.compact is not None):
            raise SpecError(f"num_compact_blocks={self.num_compact_blocks} with compact={self.compact}: a compact "
                            "region needs both a compact spec and at least one block (or neither).")
        if self.compact is not None:
            check_compact(self.spec, self.compact, self.head_dim)
        if self.num_blocks < 1:
            raise SpecError(f"num_blocks={self.num_blocks}: the pool needs at least one block.")
        if self.max_seqs < 1:
            raise SpecError(f"max_seqs={self.max_seqs}: allow at least one sequence.")
        self.spec.validate(self.head_dim)

    @property
    def uses_stage(self) -> bool:
        return not self.spec.is_float and bool(self.spec.fp_tail or self.spec.sink_blocks)

    @property
    def codes_dtype_name(self) -> str:
        return {32: "float32", 16: "float16"}.get(self.spec.k_bits, "uint8")

    @property
    def codes_dtype(self):
        """The codes tensor's torch.dtype."""
        import torch

        return getattr(torch, self.codes_dtype_name)

    def codes_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_kv_heads, self.block_size, record_layout(self.spec, self.head_dim).code_width)

    def scales_shape(self) -> tuple[int, ...]:
        if self.spec.is_float:
            return (1, 1, 1, 1)
        return (self.num_blocks, self.num_kv_heads, self.block_size, record_layout(self.spec, self.head_dim).scale_width)

    def stage_shape(self) -> tuple[int, ...]:
        rows = self.max_seqs if self.uses_stage else 1
        return (rows, 2, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def compact_codes_shape(self) -> tuple[int, ...]:
        """The compact region's codes tensor (0 blocks when there is none)."""
        width = record_layout(self.compact, self.head_dim).code_width if self.compact else 0
        return (self.num_compact_blocks, self.num_kv_heads, self.block_size, width)

    def compact_scales_shape(self) -> tuple[int, ...]:
        width = record_layout(self.compact, self.head_dim).scale_width if self.compact else 0
        return (self.num_compact_blocks, self.num_kv_heads, self.block_size, width)

    @property
    def compact_bytes_per_token(self) -> int:
        """Pool bytes one token in the compact region costs, all layers (0 without a region)."""
        if self.compact is None:
            return 0
        return bytes_per_token(self.compact, self.num_kv_heads, self.head_dim, self.num_layers)

    def is_compact_block(self, block_id: int) -> bool:
        """Whether a block-table entry names the compact region (ids >= num_blocks)."""
        return block_id >= self.num_blocks

    def layer_tensor_bytes(self) -> dict[str, int]:
        out = {
            "codes": math.prod(self.codes_shape()) * ELEMENT_BYTES[self.codes_dtype_name],
            "scales": math.prod(self.scales_shape()) * 2,
            "stage": math.prod(self.stage_shape()) * 2,
        }
        if self.num_compact_blocks:
            out["compact_codes"] = math.prod(self.compact_codes_shape())
            out["compact_scales"] = math.prod(self.compact_scales_shape()) * 2
        return out

    @property
    def largest_allocation_bytes(self) -> int:
        return max(self.layer_tensor_bytes().values())

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_tensor_bytes().values()) * self.num_layers

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.spec, self.num_kv_heads, self.head_dim, self.num_layers)

    @property
    def fixed_bytes(self) -> int:
        """Bytes of the pool that do not depend on its block count, all layers: the stage rows, the
        float specs' scales placeholder and the compact region (if any). total_bytes == num_blocks * block_size * bytes_per_token + this."""
        return self.total_bytes - self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def stage_bytes_per_sequence(self) -> int:
        return fp_stage_bytes_per_sequence(self.spec, self.block_size, self.num_kv_heads, self.head_dim, self.num_layers)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def allocate_layer_numpy(self) -> tuple:
        """Fresh zeroed (codes, scales, stage) numpy arrays for one layer (runtimes without torch), each
        starting on a cache line (POOL_ALIGN)."""
        return (
            zeros_aligned(self.codes_shape(), self.codes_dtype_name),
            zeros_aligned(self.scales_shape(), "float16"),
            zeros_aligned(self.stage_shape(), "float16"),
        )

    def allocate_layer(self) -> tuple:
        """The same as torch tensors (sharing the arrays' memory)."""
        import torch

        return tuple(torch.from_numpy(a) for a in self.allocate_layer_numpy())

    def allocate_compact_layer(self) -> tuple:
        """Fresh zeroed (compact_codes, compact_scales) torch tensors for one layer's compact region."""
        import torch

        return (torch.from_numpy(zeros_aligned(self.compact_codes_shape(), "uint8")),
                torch.from_numpy(zeros_aligned(self.compact_scales_shape(), "float16")))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["spec"] = asdict(self.spec)
        del d["compact"], d["num_compact_blocks"]  # a pool without a compact region: the dict as before
        if self.num_compact_blocks:
            d.update(compact=asdict(self.compact), num_compact_blocks=self.num_compact_blocks,
                     compact_codes_shape=list(self.compact_codes_shape()),
                     compact_scales_shape=list(self.compact_scales_shape()))
        d.update(
            codes_shape=list(self.codes_shape()),
            scales_shape=list(self.scales_shape()),
            stage_shape=list(self.stage_shape()),
            codes_dtype=self.codes_dtype_name,
            bytes_per_token=self.bytes_per_token,
            largest_allocation_bytes=self.largest_allocation_bytes,
            total_bytes=self.total_bytes,
        )
        return d

    @staticmethod
    def from_dict(d: dict) -> "PoolLayout":
        keys = ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "max_seqs")
        compact = KVQuantSpec(**d["compact"]) if d.get("compact") else None
        return PoolLayout(spec=KVQuantSpec(**d["spec"]), compact=compact,
                          num_compact_blocks=int(d.get("num_compact_blocks", 0)), **{k: d[k] for k in keys})


# ----------------------------------------------------------------------------------------------
# Pool size from a byte budget: the one formula (the Android runner's Runner::Impl computes its twin in
# C++ from the manifest's pool fields: android_demo/native/src/runner.cpp, budget_blocks)


def budget_terms(layout: PoolLayout, groups=None) -> tuple[int, int]:
    """(bytes of one more block, bytes that do not depend on the block count) of the pool a budget sizes.

    groups (toolkit.block_pool.LayerGroup list, as in the manifest; None: every layer in one group): the
    budget sizes group 0's block count; every other group's pools keep their num_blocks (a sliding
    group's window) and count as fixed, each layer's block in its group's spec (the pool's if it has none)."""
    def block_bytes(spec, layers: int) -> int:
        return bytes_per_token(spec, layout.num_kv_heads, layout.head_dim, layers) * layout.block_size

    if not groups:
        return block_bytes(layout.spec, layout.num_layers), layout.fixed_bytes
    fixed = layout.fixed_bytes + sum(block_bytes(g.spec or layout.spec, len(g.layers)) * g.num_blocks
                                     for g in groups[1:])
    return block_bytes(layout.spec, len(groups[0].layers)), fixed


def blocks_for_budget(layout: PoolLayout, budget_bytes: float, groups=None) -> int:
    """The most blocks (of group 0, with groups) whose whole pool fits in budget_bytes; 0 if none. Only
    the layout's shape counts, not its own num_blocks."""
    per_block, fixed = budget_terms(layout, groups)
    return max(0, int((budget_bytes - fixed) // per_block))


def budget_too_small(layout: PoolLayout, what: str, groups=None) -> str:
    """The one-line error for a budget that holds fewer than MIN_POOL_BLOCKS blocks; `what` names the
    budget as the user gave it (e.g. "--pool-mb 0.01")."""
    per_block, fixed = budget_terms(layout, groups)
    need = fixed + MIN_POOL_BLOCKS * per_block
    return (f"{what} is too small: it holds fewer than {MIN_POOL_BLOCKS} blocks of {layout.block_size} tokens; the "
            f"smallest pool needs {need} bytes ({need / 2**20:.3f} MiB: {per_block} B per block + "
            f"{fixed} B that do not depend on the block count): raise it.")


def budget_blocks(layout: PoolLayout, budget_bytes: float, what: str, groups=None) -> int:
    """blocks_for_budget, at least MIN_POOL_BLOCKS (else SpecError with budget_too_small's message)."""
    blocks = blocks_for_budget(layout, budget_bytes, groups)
    if blocks < MIN_POOL_BLOCKS:
        raise SpecError(budget_too_small(layout, what, groups))
    return blocks
