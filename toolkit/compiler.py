"""The compiler step: rewrite a HuggingFace causal LM so every attention layer calls the paged op.

    paged = compile(hf_model, spec="default", block_size=16, num_blocks=256, max_seqs=4)
    logits = paged(input_ids[None], positions, seq_ids, block_tables)

The rewrite goes through transformers' AttentionInterface: an attention function named "pagedkv"
is registered once and selected with `set_attn_implementation("pagedkv")`. The model is then
called with `use_cache=False` and explicit position ids; HF's RoPE / projections / MLPs stay as they
are, and only the attention core (cache write + attention) is replaced by the op. The pool tensors
are buffers of the returned `PagedModel` (mutable buffers when exported to ExecuTorch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface

import dataclasses

import toolkit.paged_attention  # noqa: F401  (registers torch.ops.pagedkv)
from toolkit.block_pool import LayerGroup, group_layout
from toolkit.errors import UnsupportedModelError
from toolkit.model_dims import ModelDims, text_config, layer_windows, model_dims  # noqa: F401  (re-exported)
from toolkit.kv_spec import check_group_spec, compact_spec_for
from toolkit.pool_layout import PoolLayout
from toolkit.quant import KVQuantSpec, resolve_spec

ATTN_NAME = "pagedkv"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "gpt2", "smollm3")


# ----------------------------------------------------------------------------------------------
# Preflight: reject what the op cannot express, before touching the model


def preflight(config) -> None:
    """Raise UnsupportedModelError naming the feature if the paged op cannot run this model exactly."""
    cfg = text_config(config)
    mt = getattr(cfg, "model_type", "?")
    checks = [
        (getattr(cfg, "attention_chunk_size", None), "chunked attention (attention_chunk_size) lives only in the mask"),
        (getattr(cfg, "alibi", False) or mt in ("bloom", "mpt"), "ALiBi position biases live only in the mask"),
        (getattr(cfg, "kv_lora_rank", None), "multi-head latent attention (MLA, kv_lora_rank) has different K/V head dims"),
        (getattr(cfg, "num_kv_shared_layers", 0), "KV-sharing layers (num_kv_shared_layers) read another layer's cache"),
        (getattr(cfg, "use_bidirectional_attention", False), "bidirectional attention is not causal"),
        (getattr(cfg, "is_encoder_decoder", False), "encoder-decoder models need cross-attention"),
        (getattr(cfg, "add_cross_attention", False), "cross-attention reads encoder states, not a KV cache"),
    ]
    for present, why in checks:
        if present:
            raise UnsupportedModelError(
                f"model type '{mt}' is not supported: {why}. pagedkv only rewrites plain causal self-attention."
            )
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type '{mt}' is not supported: its attention has not been validated against the paged op. "
            f"Supported: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    if getattr(cfg, "_attn_implementation", None) is None and not hasattr(cfg, "num_attention_heads"):
        raise UnsupportedModelError(f"model type '{mt}' has no num_attention_heads in its config.")


def layer_groups(config, num_blocks: int, sliding_blocks: int | None = None) -> list[LayerGroup]:
    """Layers grouped by attention type: the global group first (if any), then one per window.
    A global group gets num_blocks blocks, a sliding one sliding_blocks (default num_blocks)."""
    windows = layer_windows(config)
    out = []
    for w in sorted(set(windows)):  # 0 (global) first
        layers = tuple(i for i, x in enumerate(windows) if x == w)
        n = num_blocks if w == 0 or sliding_blocks is None else min(num_blocks, sliding_blocks)
        out.append(LayerGroup(w, layers, n))
    return out


CALL_TOKENS = 64  # tokens one sequence writes per call at most (the runtimes' prefill chunk)


def sliding_pool_blocks(config, block_size: int, max_seqs: int, call_tokens: int = CALL_TOKENS) -> int | None:
    """Blocks a sliding group's pools need so that max_seqs sequences can each hold their window and
    write call_tokens more (toolkit.block_pool.window_blocks_needed); None without sliding layers."""
    from toolkit.block_pool import window_blocks_needed

    windows = [w for w in layer_windows(config) if w]
    return max_seqs * window_blocks_needed(max(windows), block_size, call_tokens) if windows else None


def groups_manifest(groups) -> list[dict] | None:
    """The manifest's "groups" entry: None (left out) for one global group, as before groups existed."""
    if len(groups) == 1 and groups[0].window == 0:
        return None
    return [g.to_dict() for g in groups]


def group_table_names(groups) -> list[str]:
    """Graph input name of each group's block tables: 'block_tables' for the first (a model without
    sliding layers has only that one, as before groups existed), then block_tables_1, ..."""
    return ["block_tables"] + [f"block_tables_{g}" for g in range(1, len(groups))]


# ----------------------------------------------------------------------------------------------
# The attention function HF calls in every layer


@dataclass
class PagedContext:
    """What one forward pass hands every layer: pool tensors and the batch's paging metadata."""

    layout: PoolLayout
    pools: list  # per layer: (codes, scales, stage)
    positions: torch.Tensor  # [T] int64
    seq_ids: torch.Tensor  # [T] int64
    block_tables: list  # per layer group: [S, M] int64
    layer_group: tuple  # layer -> index of its group
    windows: tuple  # per group: 0 or the window its table was trimmed to
    layer_specs: tuple  # layer -> its KV spec (its group's own, else the pool's)
    functional: bool = False
    new_pools: dict = field(default_factory=dict)  # layer -> (codes, scales, stage), functional only
    compact_pools: dict = field(default_factory=dict)  # layer -> (compact codes, compact scales): the mixed op
    key_offsets: tuple | None = None  # layer -> [Hkv, D] subtracted from its keys (toolkit/key_offsets.py)


def op_scalar_args(spec: KVQuantSpec, head_dim: int, layer: int, scale: float, window: int, softcap: float):
    kg, vg = spec.groups(head_dim)
    return (
        layer, spec.k_bits, spec.v_bits, kg, vg, spec.k_sym, spec.v_sym, spec.rotate,
        spec.fp_tail, spec.sink_blocks, float(scale), int(window), float(softcap),
    )


def paged_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
    softcap=None, s_aux=None, **kwargs,
):
    ctx: PagedContext | None = kwargs.get("pagedkv")
    if ctx is None:
        raise UnsupportedModelError(
            "the model was compiled for pagedkv but called without paging metadata: call the PagedModel, "
            "not the inner HF model."
        )
    layer = module.layer_idx
    d = query.shape[-1]
    scale = scaling if scaling is not None else d**-0.5
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    if sinks is None:
        sinks = torch.full((query.shape[1],), float("-inf"))
    g = ctx.layer_group[layer]
    if ctx.windows[g] and ctx.windows[g] != (sliding_window or 0):
        raise UnsupportedModelError(
            f"layer {layer} attends with sliding_window={sliding_window}, but its layer group keeps only the last "
            f"{ctx.windows[g]} positions: the config's layer_types/sliding_window disagree with the model."
        )
    if ctx.key_offsets is not None:  # exact: the softmax ignores a shift common to every key (key_offsets.py)
        key = key - ctx.key_offsets[layer][None, :, None, :]
    scalars = op_scalar_args(ctx.layer_specs[layer], d, layer, scale, sliding_window or 0, softcap or 0.0)
    codes, scales, stage = ctx.pools[layer]
    tail = (ctx.positions, ctx.seq_ids, ctx.block_tables[g], sinks.float())
    if layer in ctx.compact_pools:  # the compact tier: the table may name compact blocks (ids >= num_blocks)
        c = ctx.layout.compact
        ckg, cvg = c.groups(d)
        args = (query, key, value, codes, scales, stage, *ctx.compact_pools[layer], *tail)
        more = (c.k_bits, c.v_bits, ckg, cvg, c.k_sym, c.v_sym)
        if ctx.functional:
            out, codes, scales, stage = torch.ops.pagedkv.quantized_paged_attention_mixed_functional(
                *args, *scalars, *more)
            ctx.new_pools[layer] = (codes, scales, stage)
        else:
            out = torch.ops.pagedkv.quantized_paged_attention_mixed(*args, *scalars, *more)
        return out.to(query.dtype), None
    args = (query, key, value, codes, scales, stage, *tail)
    if ctx.functional:
        out, codes, scales, stage = torch.ops.pagedkv.quantized_paged_attention_functional(*args, *scalars)
        ctx.new_pools[layer] = (codes, scales, stage)
    else:
        out = torch.ops.pagedkv.quantized_paged_attention(*args, *scalars)
    return out.to(query.dtype), None


AttentionInterface.register(ATTN_NAME, paged_attention_forward)


# ----------------------------------------------------------------------------------------------
# The compiled model


class PagedModel(nn.Module):
    """A HF causal LM whose attention runs on a paged, quantized KV pool held as buffers.

    forward(input_ids [1, T], positions [T], seq_ids [T], block_tables [S, M], *more_tables) -> logits
    [1, T, V]: one block table per layer group (`groups`; one for a model without sliding layers).
    Each layer's pool has its group's number of blocks. With a compact region (layout.num_compact_blocks
    > 0, compile(compact_blocks=N)) the global group's layers also hold compact_codes_i/compact_scales_i
    and call the mixed op (pagedkv::quantized_paged_attention_mixed): their table may name compact blocks.
    """

    def __init__(self, hf_model: nn.Module, layout: PoolLayout, groups: list[LayerGroup] | None = None,
                 key_offsets: list[torch.Tensor] | None = None):
        super().__init__()
        self.hf = hf_model
        self.layout = layout
        self.dims = model_dims(hf_model.config)
        self.groups = groups or [LayerGroup(0, tuple(range(layout.num_layers)), layout.num_blocks)]
        self.layer_group = tuple(next(g for g, grp in enumerate(self.groups) if i in grp.layers)
                                 for i in range(layout.num_layers))
        for i in range(layout.num_layers):
            codes, scales, stage = self.layer_layout(i).allocate_layer()
            self.register_buffer(f"codes_{i}", codes, persistent=False)
            self.register_buffer(f"scales_{i}", scales, persistent=False)
            self.register_buffer(f"stage_{i}", stage, persistent=False)
            if self.layer_layout(i).num_compact_blocks:
                ccodes, cscales = self.layer_layout(i).allocate_compact_layer()
                self.register_buffer(f"compact_codes_{i}", ccodes, persistent=False)
                self.register_buffer(f"compact_scales_{i}", cscales, persistent=False)
        self.has_key_offsets = key_offsets is not None
        if key_offsets is not None:
            check_key_offsets(key_offsets, self.dims)
            for i, off in enumerate(key_offsets):
                self.register_buffer(f"k_offset_{i}", off.float().clone())

    def key_offsets(self) -> tuple | None:
        """layer -> [Hkv, D] key offset (toolkit/key_offsets.py), or None when the model has none."""
        if not self.has_key_offsets:
            return None
        return tuple(getattr(self, f"k_offset_{i}") for i in range(self.layout.num_layers))

    def layer_layout(self, layer: int) -> PoolLayout:
        """The layout of one layer's pool tensors (its group's block count and spec; the compact region
        is the global group's only): toolkit.block_pool.group_layout."""
        return group_layout(self.layout, self.groups[self.layer_group[layer]])

    def compact_pool_tensors(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """layer -> (compact_codes, compact_scales) of each layer with a compact region ({} without one)."""
        return {i: (getattr(self, f"compact_codes_{i}"), getattr(self, f"compact_scales_{i}"))
                for i in range(self.layout.num_layers) if hasattr(self, f"compact_codes_{i}")}

    def pool_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [
            (getattr(self, f"codes_{i}"), getattr(self, f"scales_{i}"), getattr(self, f"stage_{i}"))
            for i in range(self.layout.num_layers)
        ]

    def reset_pool(self) -> None:
        for tensors in [*self.pool_tensors(), *self.compact_pool_tensors().values()]:
            for t in tensors:
                t.zero_()

    def compact_layers(self) -> list[int]:
        """The layers with a compact region (the global group's; [] without one), in order."""
        return [i for i in range(self.layout.num_layers) if self.layer_layout(i).num_compact_blocks]

    def run(self, input_ids, positions, seq_ids, tables, pools, functional: bool, logits_rows=None, compact=None):
        """logits_rows: indices into this call's T tokens whose logits are computed (the head, Gemma's
        262144 x 640 one a quarter of a prefill's time, runs on those rows only); None: every row.
        compact: layer -> (compact_codes, compact_scales) read instead of the buffers (the exported
        forms take the compact region as inputs); None: this model's own compact buffers."""
        if len(tables) != len(self.groups):
            raise UnsupportedModelError(
                f"{len(tables)} block table(s) given, the model has {len(self.groups)} layer group(s): pass one per group."
            )
        windows = tuple(g.window for g in self.groups)
        specs = tuple(self.layer_layout(i).spec for i in range(self.layout.num_layers))
        ctx = PagedContext(self.layout, pools, positions, seq_ids, list(tables), self.layer_group, windows, specs,
                           functional,
                           compact_pools=self.compact_pool_tensors() if compact is None else compact,
                           key_offsets=self.key_offsets())
        out = self.hf(
            input_ids=input_ids, position_ids=positions[None], use_cache=False, pagedkv=ctx, return_dict=True,
            logits_to_keep=0 if logits_rows is None else logits_rows,
        )
        return out.logits, ctx

    def forward(self, input_ids, positions, seq_ids, block_tables, *more_tables, logits_rows=None):
        tables = (block_tables, *more_tables)
        logits, _ = self.run(input_ids, positions, seq_ids, tables, self.pool_tensors(), functional=False,
                             logits_rows=logits_rows)
        return logits


class FunctionalPagedModel(nn.Module):
    """Pools as explicit inputs and outputs (for ONNX): forward(ids, pos, seq, tables, *more_tables, *pools,
    *compact_pools, logits_rows) -> (logits [1, R, V], *pools); one table per layer group, logits for the R
    rows logits_rows names (indices into the call's tokens: the last one of each sequence in a chat, all
    of them for teacher-forced evaluation).

    With a compact region, compact_pools are (compact_codes_i, compact_scales_i) of each layer of
    paged.compact_layers() (the global group's), inputs only: the mixed op reads them and never writes
    them (the runtime re-quantizes blocks into them between steps). Without one there are none, and the
    graph is the one exported before the compact tier existed."""

    def __init__(self, paged: PagedModel):
        super().__init__()
        self.paged = paged

    def forward(self, input_ids, positions, seq_ids, block_tables, *rest):
        n = self.paged.layout.num_layers
        g = len(self.paged.groups) - 1
        tables, pools = (block_tables, *rest[:g]), rest[g:g + 3 * n]
        layers = self.paged.compact_layers()
        flat_compact, logits_rows = rest[g + 3 * n:-1], rest[-1]
        compact = {i: tuple(flat_compact[2 * j:2 * j + 2]) for j, i in enumerate(layers)}
        grouped = [tuple(pools[3 * i : 3 * i + 3]) for i in range(n)]
        logits, ctx = self.paged.run(input_ids, positions, seq_ids, tables, grouped, functional=True,
                                     logits_rows=logits_rows, compact=compact)
        flat = [t for i in range(n) for t in ctx.new_pools[i]]
        return (logits, *flat)


def with_sliding_spec(groups: list[LayerGroup] | None, spec: KVQuantSpec, sliding: KVQuantSpec,
                      head_dim: int) -> list[LayerGroup] | None:
    """The layer groups with `sliding` as the spec of each sliding group (check_group_spec against the
    pool's `spec`); the global group keeps the pool's. A spec equal to the pool's sets nothing."""
    check_group_spec(spec, sliding, head_dim)
    if not groups or not any(g.window for g in groups):
        raise UnsupportedModelError("a sliding spec needs sliding-window layers; this model has only global ones "
                                    "(drop --sliding-spec).")
    if groups[0].window:
        raise UnsupportedModelError("every layer of this model slides: give their spec as --spec, not --sliding-spec.")
    if sliding == spec:
        return groups
    return [dataclasses.replace(g, spec=sliding) if g.window else g for g in groups]


def check_key_offsets(offsets, dims: ModelDims) -> None:
    """Key offsets (one [num_kv_heads, head_dim] finite float tensor per layer) against the model, or
    UnsupportedModelError naming what is wrong."""
    if len(offsets) != dims.num_layers:
        raise UnsupportedModelError(f"{len(offsets)} key offsets for a model of {dims.num_layers} layers: "
                                    "give one per layer (re-run the calibration).")
    want = (dims.num_kv_heads, dims.head_dim)
    for i, off in enumerate(offsets):
        if not isinstance(off, torch.Tensor) or tuple(off.shape) != want:
            shape = tuple(off.shape) if isinstance(off, torch.Tensor) else type(off).__name__
            raise UnsupportedModelError(f"the key offset of layer {i} has shape {shape}, expected {want}.")
        if not bool(torch.isfinite(off).all()):
            raise UnsupportedModelError(f"the key offset of layer {i} is not finite (NaN or Inf): re-run the calibration.")


def compile(
    model: nn.Module,
    spec: str | KVQuantSpec = "default",
    *,
    block_size: int = 16,
    num_blocks: int = 256,
    max_seqs: int = 4,
    sliding_blocks: int | None = None,
    groups: bool = True,
    compact_blocks: int = 0,
    sliding_spec: str | KVQuantSpec | None = None,
    compact_spec: str | KVQuantSpec | None = None,
    key_offsets: list[torch.Tensor] | None = None,
) -> PagedModel:
    """Rewrite `model`'s attention to the paged op (in place on the HF model) and wrap it with a pool.

    Layers are grouped by attention type (layer_groups): each group gets its own block tables, and
    the pools of a sliding group's layers have sliding_blocks blocks (default num_blocks). groups=False
    puts every layer in one group (one table, every layer holds every position, as before groups).

    compact_blocks=N > 0 adds a compact region of N blocks (the compact tier, issue 25; spec
    compact_spec_for(spec)) to the global group's layers, which then call the mixed op; 0 (the default)
    is exactly the model without one. compact_spec: the region's record fields (compact_spec_for; default
    COMPACT_SPEC).

    sliding_spec: the sliding groups' own KV spec (toolkit.kv_spec.check_group_spec: other bits, groups
    or symmetry than `spec`); None (the default): every layer stores `spec`.

    key_offsets: per layer a [num_kv_heads, head_dim] mean key subtracted from its keys before the op
    (toolkit/key_offsets.py: exact for the attention, and what lets low-bit keys hold on families with
    large per-channel key offsets); ignored for a float pool, which stores keys as they are."""
    preflight(model.config)
    spec = resolve_spec(spec)
    dims = model_dims(model.config)
    if dims.num_heads % dims.num_kv_heads:
        raise UnsupportedModelError(
            f"{dims.num_heads} query heads are not a multiple of {dims.num_kv_heads} KV heads."
        )
    compact = compact_spec_for(spec, dims.head_dim, compact_spec and resolve_spec(compact_spec)) \
        if compact_blocks else None
    layout = PoolLayout(spec, dims.num_layers, dims.num_kv_heads, dims.head_dim, block_size, num_blocks, max_seqs,
                        compact=compact, num_compact_blocks=compact_blocks)
    grouped = layer_groups(model.config, num_blocks, sliding_blocks) if groups else None
    if compact_blocks and grouped and grouped[0].window:
        raise UnsupportedModelError("compact_blocks needs global-attention layers (the compact tier holds aged "
                                    "blocks of the global layer group); this model has only sliding layers.")
    if sliding_spec is not None:
        grouped = with_sliding_spec(grouped, spec, resolve_spec(sliding_spec), dims.head_dim)
    model.set_attn_implementation(ATTN_NAME)
    model.eval()
    return PagedModel(model, layout, grouped, None if spec.is_float else key_offsets)
