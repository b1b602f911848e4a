"""ONNX export: one `pagedkv::QuantizedPagedAttention` node per layer + a standard-op fallback function.

The compiled model is exported in its functional form (pools in, updated pools out). Each attention
layer becomes one node of the custom domain "pagedkv" carrying the op's scalar arguments as
attributes. The model also carries an ONNX *function* with the same domain and name, built by
exporting the op's plain-PyTorch reference to standard ONNX ops: stock onnxruntime inlines that
function; with the native kernel library registered (toolkit.native) ORT runs the kernel instead.
The per-layer values (scale, window, softcap) reach the function through attribute references.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper

from export.onnx_ops import (  # noqa: F401  (re-exported: the ONNX op names are part of this interface)
    DOMAIN, FLOAT_ATTRS, INT_ATTRS, OP_TYPE, OPSET, TENSOR_INPUTS, TENSOR_OUTPUTS, function_from_export,
    register_op_schema,
)
from toolkit.compiler import FunctionalPagedModel, PagedModel
from toolkit.errors import SpecError
from toolkit.manifest import LOGITS_ROWS, ONNX_POOL_KEY, compact_input_names, pool_identity
from toolkit.pool_layout import PoolLayout
from toolkit.paged_attention import SCALAR_ARG_NAMES, reference_paged_attention

def register_schema() -> None:
    """Tell onnx about the custom op (so the checker and onnxscript accept the node)."""
    register_op_schema(OP_TYPE, TENSOR_INPUTS, INT_ATTRS,
                       "Paged attention over a group-wise quantized KV block pool (see toolkit/paged_attention.py).")


# ----------------------------------------------------------------------------------------------
# The fallback function: the reference op exported to standard ops


class _ReferenceForExport(torch.nn.Module):
    def __init__(self, layout: PoolLayout):
        super().__init__()
        self.layout = layout

    def forward(self, q, k, v, codes, scales, stage, positions, seq_ids, block_tables, sinks, scale, window, softcap):
        s = self.layout.spec
        kg, vg = s.groups(self.layout.head_dim)
        return reference_paged_attention(
            q, k, v, codes, scales, stage, positions, seq_ids, block_tables, sinks, 0,
            s.k_bits, s.v_bits, kg, vg, s.k_sym, s.v_sym, s.rotate, s.fp_tail, s.sink_blocks, scale, window, softcap,
        )


def _pool_dims(layout: PoolLayout, nb) -> tuple:
    """Dynamic-shape specs of one layer's (codes, scales, stage): the block count is dynamic."""
    return ({0: nb}, None if layout.spec.is_float else {0: nb}, None)


def _example_op_inputs(layout: PoolLayout, num_heads: int, t: int = 3):
    codes, scales, stage = layout.allocate_layer()
    hkv, d = layout.num_kv_heads, layout.head_dim
    rows = stage.shape[0]
    return (
        torch.randn(1, num_heads, t, d), torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d),
        codes, scales, stage, torch.arange(t), torch.zeros(t, dtype=torch.int64),
        torch.zeros(rows, 2, dtype=torch.int64), torch.full((num_heads,), float("-inf")),
        torch.tensor(layout.head_dim**-0.5), torch.tensor(0), torch.tensor(0.0),
    )


def fallback_function(layout: PoolLayout, num_heads: int,
                      overload: str = "") -> tuple[onnx.FunctionProto, list[onnx.FunctionProto]]:
    """Export the reference op (T, M dynamic) and turn its graph into the FunctionProto pagedkv::OP_TYPE
    (the body bakes in layout.spec; an overload name for another spec's, see own_spec_overloads).

    Returns (function, helper functions the body calls)."""
    t, m = torch.export.Dim("T", min=1), torch.export.Dim("M", min=1)
    nb = torch.export.Dim("NB", min=2)
    pool_dims = _pool_dims(layout, nb)
    dyn = ({2: t}, {2: t}, {2: t}, *pool_dims, {0: t}, {0: t}, {1: m}, None, None, None, None)
    prog = torch.onnx.export(
        _ReferenceForExport(layout), _example_op_inputs(layout, num_heads), dynamo=True, dynamic_shapes=dyn,
        opset_version=OPSET, verbose=False,
    )
    fn, extra = function_from_export(prog, OP_TYPE, len(TENSOR_INPUTS), INT_ATTRS)
    fn.overload = overload
    return fn, extra


def own_spec_overloads(paged: PagedModel) -> dict[int, str]:
    """group index -> the overload name of the fallback function its layers' nodes call, for each layer
    group with its own spec (compile(sliding_spec=)): an ONNX function's body bakes in one spec, so another
    spec is another overload of pagedkv::QuantizedPagedAttention (IR version 10). The native kernel reads
    the spec from each node's attributes and ignores the overload."""
    return {g: f"group{g}" for g, grp in enumerate(paged.groups) if grp.spec is not None}


def set_overload(model: onnx.ModelProto, layers, overload: str) -> None:
    """Make the op nodes of these layers (their `layer` attribute) call the fallback overload `overload`."""
    want = set(layers)
    hit = set()
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == OP_TYPE:
            layer = next(a.i for a in node.attribute if a.name == "layer")
            if layer in want:
                node.overload = overload
                hit.add(layer)
    if hit != want:
        raise RuntimeError(f"the exported graph has no {OP_TYPE} node for layers {sorted(want - hit)}")
    model.ir_version = max(model.ir_version, 10)  # function overloads


# ----------------------------------------------------------------------------------------------
# The model


def _translate_op(q, k, v, codes, scales, stage, positions, seq_ids, block_tables, sinks, *scalars):
    from onnxscript.values import Opset

    custom = Opset(DOMAIN, 1)
    attrs = {}
    for name, value in zip(SCALAR_ARG_NAMES, scalars):
        attrs[name] = float(value) if name in FLOAT_ATTRS else int(value)
    return custom.QuantizedPagedAttention(
        q, k, v, codes, scales, stage, positions, seq_ids, block_tables, sinks, _outputs=4, **attrs
    )


def io_names(num_layers: int, num_groups: int = 1, compact_layers=()) -> tuple[list[str], list[str]]:
    """Graph inputs: ids, positions, seq_ids, one block table per layer group (block_tables,
    block_tables_1, ...; only the first for a model without sliding layers), the pools, the compact
    region's tensors of compact_layers (none without a compact region), then logits_rows (the rows of
    the call whose logits the graph computes). The compact region is an input only: the graph reads it."""
    from toolkit.compiler import group_table_names

    pools = [f"{kind}_{i}" for i in range(num_layers) for kind in ("codes", "scales", "stage")]
    inputs = (["input_ids", "positions", "seq_ids"] + group_table_names(range(num_groups)) + pools
              + compact_input_names(compact_layers) + [LOGITS_ROWS])
    outputs = ["logits"] + [f"{p}_out" for p in pools]
    return inputs, outputs


def export_onnx(paged: PagedModel, path: Path, progress=None) -> dict:
    """Write the .onnx file; returns its manifest entry (without sha256).

    A model with a compact region (compile(compact_blocks=N)) takes the region as inputs (one NC block
    dim, dynamic like NB) and its global layers are QuantizedPagedAttentionMixed nodes
    (export/onnx_mixed.py), with that node's fallback function beside the default op's; without one the
    graph is exactly the one exported before the compact tier."""
    from export.stages import StageClock

    register_schema()
    clock = StageClock(progress)
    layout = paged.layout
    if layout.num_blocks < 2:
        raise SpecError(f"a pool of {layout.num_blocks} block cannot be exported: use at least 2 blocks.")
    fmodel = FunctionalPagedModel(paged).eval()
    t, m = torch.export.Dim("T", min=1), torch.export.Dim("M", min=1)
    groups = paged.groups
    # the number of blocks stays dynamic so a runtime can size its pool; one dim per layer group
    # (groups' pools differ in size); "NB" alone for a model without sliding layers
    nbs = [torch.export.Dim("NB" if g == 0 else f"NB{g}", min=2) for g in range(len(groups))]
    pools = [x for trio in paged.pool_tensors() for x in trio]
    tables = [torch.zeros(layout.max_seqs, 2, dtype=torch.int64) for _ in groups]
    rows = torch.export.Dim("R", min=1)
    compact_layers = paged.compact_layers()
    compact, compact_dims = _compact_example(layout, compact_layers)
    example = (torch.zeros(1, 3, dtype=torch.int64), torch.arange(3), torch.zeros(3, dtype=torch.int64), *tables, *pools,
               *compact, torch.tensor([0, 2]))
    # the extra tables, *pools, *compact and logits_rows are one varargs entry
    pool_dims = [d for i in range(layout.num_layers) for d in _pool_dims(layout, nbs[paged.layer_group[i]])]
    dyn = ({1: t}, {0: t}, {0: t}, {1: m},
           tuple([{1: m}] * (len(groups) - 1) + pool_dims + compact_dims + [{0: rows}]))
    inputs, outputs = io_names(layout.num_layers, len(groups), compact_layers)
    table = {torch.ops.pagedkv.quantized_paged_attention_functional.default: _translate_op}
    if compact_layers:
        from export.onnx_mixed import register_mixed_schema, translate_mixed_op

        register_mixed_schema()
        table[torch.ops.pagedkv.quantized_paged_attention_mixed_functional.default] = translate_mixed_op
    with torch.no_grad():
        # torch.export first (torch.onnx mangles the varargs structure of dynamic_shapes)
        exported = torch.export.export(fmodel, example, dynamic_shapes=dyn, strict=False)
        clock.done("torch.export")
        prog = torch.onnx.export(
            exported, dynamo=True, opset_version=OPSET, input_names=inputs, output_names=outputs,
            custom_translation_table=table, optimize=True, verbose=False,
        )
    model = prog.model_proto
    clock.done("ONNX translation")
    # each op's fallback function where the graph has its nodes (the default op's: every layer but the
    # compact ones and those of a group with its own spec, whose nodes call an overload of it)
    own = own_spec_overloads(paged)
    plain = len(compact_layers) + sum(len(paged.groups[g].layers) for g in own) < layout.num_layers
    fns = [fallback_function(layout, paged.dims.num_heads)] if plain else []
    for g, overload in own.items():
        fns.append(fallback_function(paged.layer_layout(paged.groups[g].layers[0]), paged.dims.num_heads, overload))
        set_overload(model, paged.groups[g].layers, overload)
    if compact_layers:
        from export.onnx_mixed import mixed_fallback_function

        fns.append(mixed_fallback_function(layout, paged.dims.num_heads))
    for fn, extra in fns:
        add_function(model, fn, extra)
    if DOMAIN not in {o.domain for o in model.opset_import}:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    # what the graph bakes in about its pool, checked against the manifest when it is loaded
    model.metadata_props.add(key=ONNX_POOL_KEY, value=json.dumps(pool_identity(layout, groups)))
    clock.done("standard-op fallback functions")
    path = Path(path)
    onnx.save_model(model, str(path))
    clock.done("serializing")
    return {"file": path.name, "inputs": inputs, "outputs": outputs, "stages": clock.rows}


def _compact_example(layout: PoolLayout, compact_layers) -> tuple[list, list]:
    """Example compact tensors of each compact layer and their dynamic dims (one "NC" block dim; at
    least 2 blocks in the example, since torch.export specializes a size of 1)."""
    if not compact_layers:
        return [], []
    nc = torch.export.Dim("NC", min=2)
    lay = dataclasses.replace(layout, num_compact_blocks=max(2, layout.num_compact_blocks))
    tensors = [x for _ in compact_layers for x in lay.allocate_compact_layer()]
    return tensors, [{0: nc}] * len(tensors)


def add_function(model: onnx.ModelProto, fn: onnx.FunctionProto, extra: list) -> None:
    """Add a fallback function (and the helper functions its body calls, once each) to the model."""
    have = {(f.domain, f.name, f.overload) for f in model.functions}
    for f in [fn] + extra:
        if (f.domain, f.name, f.overload) not in have:
            model.functions.append(f)
            have.add((f.domain, f.name, f.overload))
    for imp in fn.opset_import:
        if imp.domain not in {o.domain for o in model.opset_import}:
            model.opset_import.append(imp)


def fold_weight_transposes(model: onnx.ModelProto) -> int:
    """MatMul(x, Transpose(W)) with W an initializer -> MatMul(x, W^T) with W^T a new initializer.

    A tied LM head exports as the embedding table through a Transpose: the quantizer only takes a
    MatMul whose weight is an initializer, so the head would stay fp32 (and keep the fp32 table alive
    beside its quantized Gather copy). Returns the number of Transposes folded."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    users: dict[str, list] = {}
    for n in model.graph.node:
        for x in n.input:
            users.setdefault(x, []).append(n)
    folded = 0
    for n in list(model.graph.node):
        if n.op_type != "Transpose" or n.input[0] not in inits or len(inits[n.input[0]].dims) != 2:
            continue
        perm = [list(a.ints) for a in n.attribute if a.name == "perm"]
        if perm and perm[0] != [1, 0]:
            continue
        if not all(u.op_type == "MatMul" and list(u.input).index(n.output[0]) == 1 for u in users.get(n.output[0], [])):
            continue
        w = numpy_helper.to_array(inits[n.input[0]])
        model.graph.initializer.append(numpy_helper.from_array(w.T.copy(), name=n.output[0]))
        model.graph.node.remove(n)
        folded += 1
    return folded


def _blocks(w_t: np.ndarray, block_size: int) -> np.ndarray:
    """W^T [N, K] -> [N, ceil(K/bs), bs] blocks along K; a partial last block is padded with its last
    value (so the padding adds no new level; MatMulNBits ignores the codes past K)."""
    n, k = w_t.shape
    pad = -k % block_size
    if pad:
        w_t = np.pad(w_t, ((0, 0), (0, pad)), mode="edge")
    return w_t.reshape(n, -1, block_size)


def grid_steps(x: np.ndarray, levels: int = 16, tol: float = 1e-3) -> np.ndarray:
    """Per block (rows of x [B, bs]): the step a of an affine grid lo + a*q (lo = the block's min,
    q integer in 0..levels-1) that holds every value to within tol*a, or NaN where none was found.

    GGUF's 4-bit types dequantize to such grids per 32 values (Q4_0: d*(q-8), Q4_1: d*q+m, Q4_K
    sub-blocks: a*q+b). The candidate step is the smallest gap between distinct values, or a half or a
    third of it when a level between two present ones is missing. A constant block gets NaN here
    (it has no gap) and is exact through _constant_blocks."""
    lo = x.min(axis=1, keepdims=True)
    span = x.max(axis=1, keepdims=True) - lo
    gaps = np.diff(np.sort(x, axis=1), axis=1)
    gaps = np.where(gaps > tol * span, gaps, np.inf)  # equal values (up to rounding) are one level
    g = gaps.min(axis=1, keepdims=True)
    step = np.full(x.shape[0], np.nan, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        for div in (1, 2, 3):
            a = g / div
            k = (x - lo) / a
            ok = np.all(np.abs(k - np.rint(k)) <= tol, axis=1) & (np.rint(k).max(axis=1) <= levels - 1)
            ok &= np.isfinite(g[:, 0]) & np.isnan(step)
            step[ok] = a[ok, 0]
    return step


def pack_int4_affine(w: np.ndarray, block_size: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A MatMul weight W [K, N] -> MatMulNBits' (B uint8 [N, K/bs, bs/2], scales float32 [N*K/bs],
    zero_points float32 [N*K/bs], number of exact blocks), with W[k, n] = scale * (q - zp) per block
    of block_size along K.

    A block already on a 16-level affine grid (grid_steps) is stored exactly (up to float32 rounding
    of scale*(q-zp)): scale = the step, zp = -min/step, codes = the grid indices. Any other block is
    asymmetric round-to-nearest: scale = (max-min)/15, zp = -min/scale. A constant block c is exact:
    q = 0, scale = |c| (1 for 0), zp = -c/scale. Low nibble = even k (ORT's order)."""
    x = _blocks(np.asarray(w, dtype=np.float64).T, block_size)
    n, nb, bs = x.shape
    x = x.reshape(n * nb, bs)
    lo = x.min(axis=1)
    span = x.max(axis=1) - lo
    step = grid_steps(x)
    exact = np.isfinite(step)
    const = span == 0
    scale = np.where(exact, step, span / 15)
    codes = np.zeros_like(x)
    live = ~const
    codes[live] = np.clip(np.rint((x[live] - lo[live, None]) / scale[live, None]), 0, 15)
    # exact blocks: refit the step over the widest code span (the gap alone carries float32 rounding)
    top = codes.max(axis=1)
    refit = exact & (top > 0)
    scale[refit] = span[refit] / top[refit]
    scale[const] = np.where(lo[const] == 0, 1.0, np.abs(lo[const]))
    zp = -lo / scale
    q = codes.astype(np.uint8).reshape(n, nb, bs)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale.astype(np.float32), zp.astype(np.float32), int((exact | const).sum())


def split_zero_points(zp: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Float zero points [N*nb] -> (MatMulNBits' 4-bit zero points, uint8 [N * ceil(nb/2)], low nibble
    = even block; the fractions left over, float32 [N, nb]).

    onnxruntime's fast int4 kernels take only 4-bit integer zero points: a float zero point sends the
    MatMul to a dequantize-every-call path (~70x slower at decode on this machine). So zp = zi + f with
    zi = clip(round(zp), 0, 15), and the f part is added back outside the kernel (int4_matmul_nodes)."""
    zp = zp.reshape(n, -1).astype(np.float64)
    zi = np.clip(np.rint(zp), 0, 15)
    q = zi.astype(np.uint8)
    if q.shape[1] % 2:
        q = np.pad(q, ((0, 0), (0, 1)))
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1), (zp - zi).astype(np.float32)


def int4_matmul_nodes(a: str, y: str, w: np.ndarray, prefix: str, block_size: int = 32, accuracy_level: int = 4,
                      done: dict | None = None) -> tuple[list, list, int]:
    """Y = A @ W as int4: (nodes, initializers, exact blocks).

    MatMulNBits(A, B, scales, 4-bit zp) computes A @ (s*(q - zi)); the fraction f of each block's zero
    point adds -s*f * sum(A over the block): BlockSums = A @ Ind (Ind [K, nb] 0/1, one per K) and
    BlockSums @ C (C [nb, N] = -s*f), one small fp32 MatMul (nb = K/32 rows: ~3% of the int4 work).
    Left out when every fraction is 0 (e.g. Q4_0 weights). `done` caches what is shared between calls
    (Ind per K, BlockSums per input); pass the same dict for every MatMul of one graph."""
    from onnx import numpy_helper

    done = {} if done is None else done
    k, n = w.shape
    packed, scales, zps, exact = pack_int4_affine(w, block_size)
    zi, frac = split_zero_points(zps, n)
    inits = [numpy_helper.from_array(packed, f"{prefix}_Q4"), numpy_helper.from_array(scales, f"{prefix}_scales"),
             numpy_helper.from_array(zi, f"{prefix}_zp")]
    nbits = helper.make_node("MatMulNBits", [a, f"{prefix}_Q4", f"{prefix}_scales", f"{prefix}_zp"], [y],
                             name=f"{prefix}_MatMulNBits", domain="com.microsoft", K=k, N=n, bits=4,
                             block_size=block_size, accuracy_level=accuracy_level)
    if not frac.any():
        return [nbits], inits, exact
    nodes = []
    nb = frac.shape[1]
    ind = f"int4_block_indicator_{k}x{block_size}"
    if ind not in done:
        done[ind] = True
        inits.append(numpy_helper.from_array(
            (np.arange(k)[:, None] // block_size == np.arange(nb)[None, :]).astype(np.float32), ind))
    sums = done.get((a, ind))
    if sums is None:
        sums = done[(a, ind)] = f"{a}_int4_block_sums"
        nodes.append(helper.make_node("MatMul", [a, ind], [sums], name=f"{sums}_MatMul"))
    corr = -(scales.reshape(n, nb) * frac).T.astype(np.float32)
    inits.append(numpy_helper.from_array(np.ascontiguousarray(corr), f"{prefix}_zp_correction"))
    nbits.output[0] = f"{prefix}_int4_main"
    nodes += [nbits,
              helper.make_node("MatMul", [sums, f"{prefix}_zp_correction"], [f"{prefix}_int4_corr"],
                               name=f"{prefix}_corr_MatMul"),
              helper.make_node("Add", [f"{prefix}_int4_main", f"{prefix}_int4_corr"], [y], name=f"{prefix}_Add")]
    return nodes, inits, exact


def quantize_matmuls_int4(model: onnx.ModelProto, block_size: int = 32, accuracy_level: int = 4) -> dict:
    """Every MatMul whose weight is a 2-D float32 initializer -> int4_matmul_nodes (MatMulNBits packed by
    pack_int4_affine). Weights that are no longer used are dropped.
    Returns {"int4_blocks": total blocks, "int4_exact_blocks": blocks stored without rounding}."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    total = exact = 0
    done: dict = {}
    nodes = []
    for i, node in enumerate(model.graph.node):
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is None or len(w.dims) != 2 or w.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        new, new_inits, ex = int4_matmul_nodes(node.input[0], node.output[0], numpy_helper.to_array(w),
                                               f"{node.name or 'matmul'}_{i}", block_size, accuracy_level, done)
        nodes += new
        model.graph.initializer.extend(new_inits)
        total += -(-w.dims[0] // block_size) * w.dims[1]
        exact += ex
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {x for nd in model.graph.node for x in nd.input} | {o.name for o in model.graph.output}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    if total and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {"int4_blocks": total, "int4_exact_blocks": exact}


def quantize_weights_int4(path: Path, block_size: int = 32, embedding: bool = False, accuracy_level: int = 4) -> dict:
    """Rewrite the .onnx in place with MatMul weights as int4 MatMulNBits (quantize_matmuls_int4:
    lossless for weights that already lie on a 4-bit grid, such as a GGUF Q4 model's dequantization,
    when accuracy_level is 0; level 4, the default, made one-token MatMuls 2-5x faster here but rounds
    activations to int8 per block: SmolLM2 Q4_1 at ctx 512, KLD 0.0038 against 0.0008 at level 0);
    with embedding=True the token embedding's Gather too, as int4 GatherBlockQuantized by onnxruntime's
    quantizer (blocks of block_size along the hidden dim: SmolLM2's 113 MB fp32 table becomes ~16 MB),
    and a tied head's Transpose is folded first so that the head is int4 too and no fp32 copy of the
    table is left. Returns quantize_matmuls_int4's block counts."""
    import logging

    model = onnx.load(str(path))
    if embedding:
        fold_weight_transposes(model)
    stats = quantize_matmuls_int4(model, block_size, accuracy_level)
    if embedding:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
        logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
        quant = MatMulNBitsQuantizer(model, block_size=block_size, is_symmetric=True, accuracy_level=4,
                                     op_types_to_quantize=("Gather",), quant_axes=(("Gather", 1),))
        quant.process()
        model = quant.model.model
    onnx.save_model(model, str(path))
    return stats
