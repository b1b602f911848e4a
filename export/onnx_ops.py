"""The custom-domain ONNX ops' names, schemas and the helper that turns an exported reference op into
their standard-op fallback function: shared by the default op (export/onnx_export.py) and the mixed-table
op (export/onnx_mixed.py)."""

from __future__ import annotations

import onnx
from onnx import helper

from toolkit.paged_attention import SCALAR_ARG_NAMES

DOMAIN = "pagedkv"
OP_TYPE = "QuantizedPagedAttention"
OPSET = 21
TENSOR_INPUTS = ("q", "k", "v", "codes", "scales", "stage", "positions", "seq_ids", "block_tables", "sinks")
TENSOR_OUTPUTS = ("out", "codes_out", "scales_out", "stage_out")
FLOAT_ATTRS = ("scale", "softcap")
INT_ATTRS = tuple(n for n in SCALAR_ARG_NAMES if n not in FLOAT_ATTRS)
# the attributes the fallback body reads (the rest describe the spec, which the body has baked in)
_REF_ATTRS = {"scale": onnx.AttributeProto.FLOAT, "window": onnx.AttributeProto.INT, "softcap": onnx.AttributeProto.FLOAT}


def register_op_schema(op_type: str, tensor_inputs, int_attrs, doc: str) -> None:
    """Tell onnx about one of our ops (so the checker and onnxscript accept its node): its tensor inputs,
    the 4 outputs, its int attributes and FLOAT_ATTRS."""
    if onnx.defs.has(op_type, DOMAIN):
        return
    O = onnx.defs.OpSchema
    schema = O(
        op_type,
        DOMAIN,
        1,
        doc=doc,
        inputs=[O.FormalParameter(n, "T" + str(i)) for i, n in enumerate(tensor_inputs)],
        outputs=[O.FormalParameter(n, "U" + str(i)) for i, n in enumerate(TENSOR_OUTPUTS)],
        type_constraints=[
            ("T" + str(i), ["tensor(float)", "tensor(float16)", "tensor(uint8)", "tensor(int64)"], "")
            for i in range(len(tensor_inputs))
        ]
        + [("U" + str(i), ["tensor(float)", "tensor(float16)", "tensor(uint8)"], "") for i in range(4)],
        attributes=[O.Attribute(n, O.AttrType.INT) for n in int_attrs]
        + [O.Attribute(n, O.AttrType.FLOAT) for n in FLOAT_ATTRS],
    )
    onnx.defs.register_schema(schema)


def function_from_export(prog, op_type: str, n_tensor_inputs: int, int_attrs) -> tuple[onnx.FunctionProto, list]:
    """An exported reference op (its first n_tensor_inputs graph inputs are tensors, then scale, window
    and softcap) as the FunctionProto pagedkv::op_type: the scalar inputs become attribute references,
    the initializers constants. Returns (function, helper functions the body calls)."""
    g = prog.model_proto.graph
    names = [i.name for i in g.input]
    nodes = []
    for name, (attr, kind) in zip(names[n_tensor_inputs:], _REF_ATTRS.items()):
        a = onnx.AttributeProto(name="value_float" if kind == onnx.AttributeProto.FLOAT else "value_int",
                                ref_attr_name=attr, type=kind)
        nodes.append(helper.make_node("Constant", [], [name], name=f"attr_{attr}"))
        nodes[-1].attribute.append(a)
    for init in g.initializer:
        nodes.append(helper.make_node("Constant", [], [init.name], value=init))
    nodes.extend(g.node)
    fn = helper.make_function(
        DOMAIN, op_type, names[:n_tensor_inputs], [o.name for o in g.output], nodes,
        opset_imports=list(prog.model_proto.opset_import),
        attributes=list(int_attrs) + list(FLOAT_ATTRS),
    )
    return fn, list(prog.model_proto.functions)
