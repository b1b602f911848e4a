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
