"""The op's scalar arguments are described once (the schema in toolkit/paged_attention.py, defaults
from KVQuantSpec) and repeated by every host; this checks each copy against that description, so a
new argument or a changed default cannot reach one place and not another. No native build needed:
the C++ sources are read as text."""

import dataclasses
import re
from pathlib import Path

import pytest

from toolkit.compiler import op_scalar_args
from toolkit.kv_spec import KVQuantSpec
from toolkit.paged_attention import INPLACE_ARGS, SCALAR_ARG_NAMES

CSRC = Path(__file__).resolve().parents[1] / "toolkit" / "csrc"

# the spec fields behind the scalars, with KVQuantSpec's defaults (group sizes resolved for head_dim 64)
SPEC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KVQuantSpec)}
CPP_VALUE = {"true": True, "false": False}


def _cpp(value: str):
    return CPP_VALUE[value] if value in CPP_VALUE else float(value.rstrip("f"))


def test_schema_lists_the_scalars_in_order():
    scalars = [m.group(2) for m in re.finditer(r"(int|float|bool) (\w+)", INPLACE_ARGS)]
    assert tuple(scalars) == SCALAR_ARG_NAMES


def test_compiler_passes_them_in_schema_order():
    spec = KVQuantSpec(6, 5, 32, 16, False, True, False, True, 0)
    args = dict(zip(SCALAR_ARG_NAMES, op_scalar_args(spec, 64, layer=3, scale=0.25, window=7, softcap=9.0)))
    want = dict(layer=3, k_bits=6, v_bits=5, k_group=32, v_group=16, k_sym=False, v_sym=True, rotate=False,
                fp_tail=True, sink_blocks=0, scale=0.25, window=7, softcap=9.0)
    assert args == want


def _struct_fields(text: str, struct: str) -> list[tuple[str, str]]:
    body = re.search(r"struct " + struct + r" \{(.*?)\n\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    return re.findall(r"(\w+) = ([\w.+-]+)", body)


def test_host_header_op_scalars():
    fields = _struct_fields((CSRC / "pagedkv_host.h").read_text(), "OpScalars")
    assert tuple(n for n, _ in fields) == SCALAR_ARG_NAMES
    for name, value in fields:
        if name in SPEC_DEFAULTS:
            assert _cpp(value) == SPEC_DEFAULTS[name], f"OpScalars.{name} defaults to {value}"


def test_core_params_defaults_match_the_spec():
    fields = dict(_struct_fields((CSRC / "pagedkv_core.h").read_text(), "PagedAttnParams"))
    for name, default in SPEC_DEFAULTS.items():
        assert _cpp(fields[name]) == default, f"PagedAttnParams.{name} defaults to {fields[name]}"


def test_onnxruntime_host_reads_every_attribute_with_the_spec_default():
    text = (CSRC / "ort_op.cpp").read_text()
    reads = re.findall(r"s\.(\w+) = get[if]\(\"(\w+)\", ([\w.]+)\)", text)
    assert tuple(field for field, _, _ in reads) == SCALAR_ARG_NAMES
    assert all(field == attr for field, attr, _ in reads)
    for name, _, value in reads:
        if name in SPEC_DEFAULTS:
            assert _cpp(value) == SPEC_DEFAULTS[name], f"ort_op.cpp: {name} defaults to {value}"


def test_executorch_kernel_signature():
    text = (CSRC / "et_kernel.cpp").read_text()
    sig = re.search(r"Tensor& sinks,(.*?)Tensor& out\)", text, re.S).group(1)
    assert tuple(re.findall(r"(?:int64_t|double|bool) (\w+)", sig)) == SCALAR_ARG_NAMES


def test_c_entry_point_order():
    text = (CSRC / "c_call.cpp").read_text()
    reads = re.findall(r"s\.(\w+) = [^;]*scalars\[(\d+)\]", text)
    assert [name for name, _ in reads] == list(SCALAR_ARG_NAMES)
    assert [int(i) for _, i in reads] == list(range(len(SCALAR_ARG_NAMES)))


@pytest.mark.parametrize("name", SCALAR_ARG_NAMES)
def test_onnx_export_declares_each_attribute(name):
    from export.onnx_export import FLOAT_ATTRS, INT_ATTRS

    assert (name in FLOAT_ATTRS) != (name in INT_ATTRS)


# ---- the mixed-table op (the compact tier): the compact spec's scalars, described once as
# COMPACT_SCALAR_ARG_NAMES after the default op's, with COMPACT_SPEC's values as the hosts' defaults

def _compact_defaults():
    from toolkit.kv_spec import COMPACT_SPEC

    # ck_bits <- k_bits, ..., cv_sym <- v_sym; groups are multiples of 64 (head_dim 64: as given)
    return {"c" + name: getattr(COMPACT_SPEC, name) for name in ("k_bits", "v_bits", "k_group", "v_group", "k_sym",
                                                                 "v_sym")}


def test_mixed_schema_lists_the_scalars_in_order():
    from toolkit.paged_attention import COMPACT_SCALAR_ARG_NAMES, MIXED_INPLACE_ARGS

    scalars = [m.group(2) for m in re.finditer(r"(int|float|bool) (\w+)", MIXED_INPLACE_ARGS)]
    assert tuple(scalars) == SCALAR_ARG_NAMES + COMPACT_SCALAR_ARG_NAMES
    assert set(_compact_defaults()) == set(COMPACT_SCALAR_ARG_NAMES)


def test_host_header_compact_scalars():
    from toolkit.paged_attention import COMPACT_SCALAR_ARG_NAMES

    fields = _struct_fields((CSRC / "pagedkv_host.h").read_text(), "CompactScalars")
    assert tuple(n for n, _ in fields) == COMPACT_SCALAR_ARG_NAMES
    want = _compact_defaults()
    for name, value in fields:
        assert _cpp(value) == want[name], f"CompactScalars.{name} defaults to {value}"


def test_core_params_compact_defaults():
    fields = dict(_struct_fields((CSRC / "pagedkv_core.h").read_text(), "PagedAttnParams"))
    for name, default in _compact_defaults().items():
        assert _cpp(fields[name]) == default, f"PagedAttnParams.{name} defaults to {fields[name]}"


def test_onnxruntime_host_reads_every_compact_attribute():
    from toolkit.paged_attention import COMPACT_SCALAR_ARG_NAMES

    text = (CSRC / "ort_op.cpp").read_text()
    reads = re.findall(r"compact\.(\w+) = get[if]\(\"(\w+)\", ([\w.]+)\)", text)
    assert tuple(field for field, _, _ in reads) == COMPACT_SCALAR_ARG_NAMES
    want = _compact_defaults()
    for field, attr, value in reads:
        assert field == attr and _cpp(value) == want[field], f"ort_op.cpp: {field} read as {attr}, default {value}"


def test_executorch_mixed_kernel_signature():
    from toolkit.paged_attention import COMPACT_SCALAR_ARG_NAMES

    text = (CSRC / "et_kernel.cpp").read_text()
    body = text[text.index("quantized_paged_attention_mixed_out("):]
    from toolkit.paged_attention import MIXED_INPLACE_ARGS

    params = re.search(r"\((.*?)Tensor& out\)", body, re.S).group(1)
    assert re.findall(r"Tensor& (\w+)", params) == re.findall(r"Tensor(?:\(\w!\))? (\w+)", MIXED_INPLACE_ARGS)
    sig = re.search(r"Tensor& sinks,(.*?)Tensor& out\)", body, re.S).group(1)
    assert tuple(re.findall(r"(?:int64_t|double|bool) (\w+)", sig)) == SCALAR_ARG_NAMES + COMPACT_SCALAR_ARG_NAMES
    assert '"quantized_paged_attention_mixed.out", quantized_paged_attention_mixed_out' in text


def test_c_entry_point_mixed_order():
    from toolkit.paged_attention import COMPACT_SCALAR_ARG_NAMES

    text = (CSRC / "c_call.cpp").read_text()
    reads = re.findall(r"compact\.(\w+) = [^;]*scalars\[(\d+)\]", text)
    assert [name for name, _ in reads] == list(COMPACT_SCALAR_ARG_NAMES)
    n = len(SCALAR_ARG_NAMES)
    assert [int(i) for _, i in reads] == list(range(n, n + len(COMPACT_SCALAR_ARG_NAMES)))


def test_onnx_mixed_node_declares_each_attribute():
    from export.onnx_export import FLOAT_ATTRS
    from export.onnx_mixed import MIXED_INT_ATTRS
    from toolkit.paged_attention import COMPACT_SCALAR_ARG_NAMES

    names = SCALAR_ARG_NAMES + COMPACT_SCALAR_ARG_NAMES
    assert tuple(n for n in names if n not in FLOAT_ATTRS) == MIXED_INT_ATTRS
    assert set(FLOAT_ATTRS) <= set(names)
