"""ONNX form of the mixed-table op (the compact tier, issue 25): the node `pagedkv.QuantizedPagedAttentionMixed`
(toolkit/csrc/ort_op.cpp runs it natively) and its standard-op fallback function, built like the default
op's (export/onnx_export.py): the op's plain-PyTorch reference exported to standard ONNX ops, the spec and
the compact spec baked in, scale / window / softcap through attribute references. Stock onnxruntime
inlines the function; with the native kernel library registered ORT runs the kernel instead.

export_onnx emits one such node per global layer of a model compiled with a compact region
(translate_mixed_op) and adds the fallback function beside the default op's.
"""

from __future__ import annotations

import onnx
import torch

from export.onnx_ops import DOMAIN, FLOAT_ATTRS, OPSET, function_from_export, register_op_schema
from toolkit.paged_attention import COMPACT_SCALAR_ARG_NAMES, SCALAR_ARG_NAMES, reference_paged_attention
from toolkit.pool_layout import PoolLayout

MIXED_OP_TYPE = "QuantizedPagedAttentionMixed"
MIXED_TENSOR_INPUTS = ("q", "k", "v", "codes", "scales", "stage", "compact_codes", "compact_scales", "positions",
                       "seq_ids", "block_tables", "sinks")
MIXED_INT_ATTRS = tuple(n for n in SCALAR_ARG_NAMES + COMPACT_SCALAR_ARG_NAMES if n not in FLOAT_ATTRS)


def register_mixed_schema() -> None:
    """Tell onnx about the mixed node (so the checker and onnxscript accept it)."""
    register_op_schema(MIXED_OP_TYPE, MIXED_TENSOR_INPUTS, MIXED_INT_ATTRS,
                       "Paged attention over a quantized KV block pool whose block tables also name compact "
                       "blocks (see toolkit/POOL_FORMAT.md, Compact region).")


class _MixedReferenceForExport(torch.nn.Module):
    def __init__(self, layout: PoolLayout):
        super().__init__()
        self.layout = layout

    def forward(self, q, k, v, codes, scales, stage, ccodes, cscales, positions, seq_ids, block_tables, sinks, scale,
                window, softcap):
        s, c, d = self.layout.spec, self.layout.compact, self.layout.head_dim
        kg, vg = s.groups(d)
        ckg, cvg = c.groups(d)
        return reference_paged_attention(
            q, k, v, codes, scales, stage, positions, seq_ids, block_tables, sinks, 0,
            s.k_bits, s.v_bits, kg, vg, s.k_sym, s.v_sym, s.rotate, s.fp_tail, s.sink_blocks, scale, window, softcap,
            compact=(ccodes, cscales, c.k_bits, c.v_bits, ckg, cvg, c.k_sym, c.v_sym),
        )


def mixed_fallback_function(layout: PoolLayout, num_heads: int) -> tuple[onnx.FunctionProto, list[onnx.FunctionProto]]:
    """The reference mixed op (T, M, NB, NC dynamic) as the FunctionProto pagedkv::QuantizedPagedAttentionMixed,
    for a layout with a compact region. Returns (function, helper functions the body calls)."""
    if layout.compact is None:
        raise ValueError("the mixed op's fallback needs a pool layout with a compact region")
    t, m = torch.export.Dim("T", min=1), torch.export.Dim("M", min=1)
    nb, nc = torch.export.Dim("NB", min=2), torch.export.Dim("NC", min=2)
    codes, scales, stage = layout.allocate_layer()
    ccodes, cscales = layout.allocate_compact_layer()
    hkv, d, n = layout.num_kv_heads, layout.head_dim, 3
    example = (
        torch.randn(1, num_heads, n, d), torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d),
        codes, scales, stage, ccodes, cscales, torch.arange(n), torch.zeros(n, dtype=torch.int64),
        torch.zeros(stage.shape[0], 2, dtype=torch.int64), torch.full((num_heads,), float("-inf")),
        torch.tensor(d ** -0.5), torch.tensor(0), torch.tensor(0.0),
    )
    dyn = ({2: t}, {2: t}, {2: t}, {0: nb}, {0: nb}, None, {0: nc}, {0: nc}, {0: t}, {0: t}, {1: m}, None, None, None,
           None)
    prog = torch.onnx.export(_MixedReferenceForExport(layout), example, dynamo=True, dynamic_shapes=dyn,
                             opset_version=OPSET, verbose=False)
    return function_from_export(prog, MIXED_OP_TYPE, len(MIXED_TENSOR_INPUTS), MIXED_INT_ATTRS)


def translate_mixed_op(q, k, v, codes, scales, stage, ccodes, cscales, positions, seq_ids, block_tables, sinks,
                       *scalars):
    """torch.onnx translation of pagedkv::quantized_paged_attention_mixed_functional: one
    QuantizedPagedAttentionMixed node, the op's scalars (the default op's, then the compact spec's) as
    attributes."""
    from onnxscript.values import Opset

    custom = Opset(DOMAIN, 1)
    attrs = {name: float(value) if name in FLOAT_ATTRS else int(value)
             for name, value in zip(SCALAR_ARG_NAMES + COMPACT_SCALAR_ARG_NAMES, scalars)}
    return custom.QuantizedPagedAttentionMixed(q, k, v, codes, scales, stage, ccodes, cscales, positions, seq_ids,
                                               block_tables, sinks, _outputs=4, **attrs)
