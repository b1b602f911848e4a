"""The native kernels (ORT custom op, ExecuTorch kernel) against reference_paged_attention.

Needs the libraries from `make native`; the tests skip when they are missing.
"""

from __future__ import annotations

import contextlib
import math
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolkit import native
from toolkit.errors import KernelLibraryMissing, PagedKVError
from toolkit.paged_attention import SCALAR_ARG_NAMES, reference_paged_attention
from toolkit.quant import PRESETS, KVQuantSpec

try:
    ORT_LIB = native.ort_library_path()
except KernelLibraryMissing:
    ORT_LIB = None
try:
    ET_LIB = native.et_library_path()
except KernelLibraryMissing:
    ET_LIB = None

# Every code path the build has and this CPU runs (scalar and AVX2 everywhere on x86, AVX-512 where
# the CPU has it), forced per test through the library's own switch (PAGEDKV_ISA at start-up).
ORT_ISAS = native.available_isas(native.ort_kernels()) if ORT_LIB else ["auto"]


@contextlib.contextmanager
def forced_isa(lib, isa: str):
    native.set_isa(lib, isa)
    try:
        yield
    finally:
        native.set_isa(lib, "auto")


needs_ort = pytest.mark.skipif(ORT_LIB is None, reason="libpagedkv_ort.so not built (make native)")
needs_et = pytest.mark.skipif(ET_LIB is None, reason="libpagedkv_et.so not built (make native)")

FLOAT_DTYPES = {32: torch.float32, 16: torch.float16}


# ------------------------------------------------------------------------------------------------
# scenario: a pool + block tables + a list of calls (prefill chunks and decode steps, mixed)


class Scenario:
    def __init__(self, spec: KVQuantSpec, hq, hkv, d, bs, lens, chunk, window=0, softcap=0.0, sinks=False,
                 holes=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        rnd = random.Random(seed)
        self.spec, self.hq, self.hkv, self.d, self.bs = spec, hq, hkv, d, bs
        self.window, self.softcap = window, softcap
        self.n_seq = len(lens)
        self.m = max(math.ceil(n / bs) for n in lens) + 1
        self.nb = self.n_seq * self.m + 2
        kg, vg = spec.groups(d)
        if spec.is_float:
            cw, sw, cdt = 2 * d, None, FLOAT_DTYPES[spec.k_bits]
        else:
            cw = d * spec.k_bits // 8 + d * spec.v_bits // 8
            sw = (d // kg) * (1 if spec.k_sym else 2) + (d // vg) * (1 if spec.v_sym else 2)
            cdt = torch.uint8
        self.codes = torch.zeros(self.nb, hkv, bs, cw, dtype=cdt)
        self.scales = torch.zeros((self.nb, hkv, bs, sw) if sw else (1, 1, 1, 1), dtype=torch.float16)
        uses_stage = not spec.is_float and (spec.fp_tail or spec.sink_blocks)
        self.stage = torch.zeros(self.n_seq if uses_stage else 1, 2, 2, hkv, bs, d, dtype=torch.float16)
        ids = list(range(self.nb))
        rnd.shuffle(ids)
        self.tables = torch.tensor(ids[: self.n_seq * self.m]).reshape(self.n_seq, self.m).to(torch.int64)
        self.sinks = (torch.randn(hq, generator=g) if sinks else torch.full((hq,), float("-inf"))).float()
        self.scale = 1.0 / math.sqrt(d)
        # calls: every call takes the next chunk (1..chunk tokens) of some unfinished sequences
        done = [0] * self.n_seq
        self.calls = []
        while any(done[s] < lens[s] for s in range(self.n_seq)):
            pos, seq = [], []
            for s in range(self.n_seq):
                if done[s] < lens[s] and rnd.random() < 0.7:
                    n = min(lens[s] - done[s], rnd.randint(1, chunk))
                    pos += list(range(done[s], done[s] + n))
                    seq += [s] * n
                    done[s] += n
            if not pos:
                continue
            t = len(pos)
            self.calls.append(dict(
                q=torch.randn(1, hq, t, d, generator=g), k=torch.randn(1, hkv, t, d, generator=g) * 2,
                v=torch.randn(1, hkv, t, d, generator=g), positions=torch.tensor(pos, dtype=torch.int64),
                seq_ids=torch.tensor(seq, dtype=torch.int64), holes=holes))

    def scalars(self, layer=3):
        s = self.spec
        kg, vg = s.groups(self.d)  # the op takes resolved group sizes
        return dict(layer=layer, k_bits=s.k_bits, v_bits=s.v_bits, k_group=kg, v_group=vg,
                    k_sym=s.k_sym, v_sym=s.v_sym, rotate=s.rotate, fp_tail=s.fp_tail, sink_blocks=s.sink_blocks,
                    scale=self.scale, window=self.window, softcap=self.softcap)

    def tables_for(self, call):
        t = self.tables.clone()
        if call["holes"] and self.window > 0:
            # blocks wholly outside every query's window were freed by a sliding policy: holes
            for s in range(self.n_seq):
                sel = call["seq_ids"] == s
                if sel.any():
                    lo = int(call["positions"][sel].min()) - self.window + 1
                    for b in range(self.m):
                        if (b + 1) * self.bs <= lo and not (b == 0 and self.spec.sink_blocks):
                            t[s, b] = -1
        return t


def _args(sc, call, codes, scales, stage, tables):
    return (call["q"], call["k"], call["v"], codes, scales, stage, call["positions"], call["seq_ids"], tables,
            sc.sinks, *sc.scalars().values())


def _assert_pools(name, got, want):
    for what, a, b in zip(("codes", "scales", "stage"), got, want):
        a = torch.as_tensor(a)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {what} dtype/shape"
        if a.dtype == torch.uint8:
            assert torch.equal(a, b), f"{name}: {what} differ at {(a != b).nonzero()[:5].tolist()}"
        else:
            assert torch.equal(a.view(torch.int16 if a.dtype == torch.float16 else torch.int32),
                               b.view(torch.int16 if b.dtype == torch.float16 else torch.int32)), f"{name}: {what} differ"


def _assert_out(name, got, want):
    got = torch.as_tensor(got)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# ORT


def _ort_session(sc: Scenario, threads: int = 1):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    cdt = {torch.uint8: TensorProto.UINT8, torch.float16: TensorProto.FLOAT16, torch.float32: TensorProto.FLOAT}
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, sc.hq, "T", sc.d]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, sc.hkv, "T", sc.d]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, sc.hkv, "T", sc.d]),
        helper.make_tensor_value_info("codes", cdt[sc.codes.dtype], list(sc.codes.shape)),
        helper.make_tensor_value_info("scales", TensorProto.FLOAT16, list(sc.scales.shape)),
        helper.make_tensor_value_info("stage", TensorProto.FLOAT16, list(sc.stage.shape)),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"]),
        helper.make_tensor_value_info("seq_ids", TensorProto.INT64, ["T"]),
        helper.make_tensor_value_info("block_tables", TensorProto.INT64, list(sc.tables.shape)),
        helper.make_tensor_value_info("sinks", TensorProto.FLOAT, [sc.hq]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "T", sc.hq, sc.d]),
        helper.make_tensor_value_info("codes_out", cdt[sc.codes.dtype], list(sc.codes.shape)),
        helper.make_tensor_value_info("scales_out", TensorProto.FLOAT16, list(sc.scales.shape)),
        helper.make_tensor_value_info("stage_out", TensorProto.FLOAT16, list(sc.stage.shape)),
    ]
    attrs = {k: (float(v) if isinstance(v, float) else int(v)) for k, v in sc.scalars().items()}
    node = helper.make_node("QuantizedPagedAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain="pagedkv", **attrs)
    graph = helper.make_graph([node], "qpa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("pagedkv", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.register_custom_ops_library(ORT_LIB)
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run_ort(sc: Scenario, sess=None):
    sess = sess or _ort_session(sc)
    pools = [sc.codes.numpy().copy(), sc.scales.numpy().copy(), sc.stage.numpy().copy()]
    ref_pools = (sc.codes.clone(), sc.scales.clone(), sc.stage.clone())
    for i, call in enumerate(sc.calls):
        tables = sc.tables_for(call)
        want = reference_paged_attention(*_args(sc, call, *ref_pools, tables))
        feed = dict(q=call["q"].numpy(), k=call["k"].numpy(), v=call["v"].numpy(), codes=pools[0], scales=pools[1],
                    stage=pools[2], positions=call["positions"].numpy(), seq_ids=call["seq_ids"].numpy(),
                    block_tables=tables.numpy(), sinks=sc.sinks.numpy())
        out, *pools = sess.run(None, feed)
        _assert_out(f"ort call {i}", out, want[0])
        _assert_pools(f"ort call {i}", [torch.from_numpy(p) for p in pools], want[1:])
        ref_pools = want[1:]


SPECS = ["default", "fp32", "fp16", "q8_0-q4_0", "et-int8", "k4v4", "best"]


@needs_ort
@pytest.mark.parametrize("isa", ORT_ISAS)
@pytest.mark.parametrize("spec", SPECS)
def test_ort_presets(spec, isa):
    sc = Scenario(PRESETS[spec], hq=8, hkv=2, d=64, bs=16, lens=[45, 1, 33], chunk=20, sinks=True, seed=1)
    with forced_isa(native.ort_kernels(), isa):
        _run_ort(sc)


@needs_ort
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    spec=st.sampled_from(SPECS),
    hkv=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 3, 4, 8]),
    d=st.sampled_from([64, 128]),
    bs=st.sampled_from([16, 32]),
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    chunk=st.sampled_from([1, 7, 33]),
    window=st.sampled_from([0, 0, 5, 24]),
    softcap=st.sampled_from([0.0, 0.0, 15.0]),
    sinks=st.booleans(),
    seed=st.integers(0, 1000),
    isa=st.sampled_from(ORT_ISAS),
)
def test_ort_random(spec, hkv, ratio, d, bs, lens, chunk, window, softcap, sinks, seed, isa):
    sc = Scenario(PRESETS[spec], hq=hkv * ratio, hkv=hkv, d=d, bs=bs, lens=lens, chunk=chunk, window=window,
                  softcap=softcap, sinks=sinks, holes=window > 0, seed=seed)
    with forced_isa(native.ort_kernels(), isa):
        _run_ort(sc)


@needs_ort
@pytest.mark.parametrize("isa", ORT_ISAS)
@pytest.mark.parametrize("spec,window,sinks", [("default", 0, False), ("q8_0-q4_0", 100, True)])
def test_ort_long_decode_split_k(spec, window, sinks, isa):
    """Single-token decode over 8+ blocks takes the split-K path (parts merged at the end)."""
    sc = Scenario(PRESETS[spec], hq=6, hkv=2, d=64, bs=16, lens=[150], chunk=1, window=window, sinks=sinks, seed=7)
    with forced_isa(native.ort_kernels(), isa):
        _run_ort(sc)


@needs_ort
@pytest.mark.parametrize("isa", ORT_ISAS)
def test_ort_generic_bits(isa):
    with forced_isa(native.ort_kernels(), isa):
        for kb, vb, ks, vs in ((6, 5, True, False), (3, 2, False, True), (7, 8, True, True)):
            spec = KVQuantSpec(kb, vb, 32, 16, ks, vs, True, True, 1)
            _run_ort(Scenario(spec, hq=4, hkv=2, d=64, bs=16, lens=[40, 17], chunk=9, seed=kb))


@needs_ort
def test_isa_switch_reports_paths():
    """The path list is what the build and CPU have: scalar always; a name the build lacks is refused."""
    lib = native.ort_kernels()
    assert ORT_ISAS[0] == "scalar" and len(set(ORT_ISAS)) == len(ORT_ISAS)
    assert lib.pagedkv_active_isa() == native.ISAS[ORT_ISAS[-1]]  # auto picks the widest
    missing = [n for n in native.ISAS if n not in ORT_ISAS]
    for name in missing + ["sse9"]:
        with pytest.raises(PagedKVError, match="not available here"):
            native.set_isa(lib, name)
    assert lib.pagedkv_active_isa() == native.ISAS[ORT_ISAS[-1]]


@needs_ort
def test_ort_iobinding_in_place():
    import onnxruntime as ort

    sc = Scenario(PRESETS["default"], hq=4, hkv=2, d=64, bs=16, lens=[20], chunk=20, seed=5)
    sess = _ort_session(sc)
    call = sc.calls[0]
    pools = [ort.OrtValue.ortvalue_from_numpy(t.numpy().copy()) for t in (sc.codes, sc.scales, sc.stage)]
    ptrs = [p.data_ptr() for p in pools]
    b = sess.io_binding()
    for name, x in (("q", call["q"]), ("k", call["k"]), ("v", call["v"]), ("positions", call["positions"]),
                    ("seq_ids", call["seq_ids"]), ("block_tables", sc.tables), ("sinks", sc.sinks)):
        b.bind_cpu_input(name, x.numpy())
    b.bind_output("out")
    for name, p in zip(("codes", "scales", "stage"), pools):
        b.bind_ortvalue_input(name, p)
        b.bind_ortvalue_output(name + "_out", p)
    sess.run_with_iobinding(b)
    want = reference_paged_attention(*_args(sc, call, sc.codes, sc.scales, sc.stage, sc.tables))
    _assert_out("iobinding", b.copy_outputs_to_cpu()[0], want[0])
    assert [p.data_ptr() for p in pools] == ptrs
    _assert_pools("iobinding", [torch.from_numpy(p.numpy()) for p in pools], want[1:])


@needs_ort
def test_ort_errors():
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

    sc = Scenario(PRESETS["default"], hq=4, hkv=2, d=64, bs=16, lens=[20], chunk=20, seed=6)
    sess = _ort_session(sc)
    call = dict(q=torch.randn(1, 4, 20, 64), k=torch.randn(1, 2, 20, 64), v=torch.randn(1, 2, 20, 64),
                positions=torch.arange(20), seq_ids=torch.zeros(20, dtype=torch.int64))
    k = call["k"].clone()
    k[0, 1, 7, 3] = float("nan")
    feed = dict(q=call["q"].numpy(), k=k.numpy(), v=call["v"].numpy(), codes=sc.codes.numpy(),
                scales=sc.scales.numpy(), stage=sc.stage.numpy(), positions=call["positions"].numpy(),
                seq_ids=call["seq_ids"].numpy(), block_tables=sc.tables.numpy(), sinks=sc.sinks.numpy())
    with pytest.raises((Fail, InvalidArgument), match="non-finite K .* layer 3, sequence 0, position 7"):
        sess.run(None, feed)
    tables = sc.tables.clone()
    tables[0, 1] = -1
    feed.update(k=call["k"].numpy(), block_tables=tables.numpy())
    with pytest.raises((Fail, InvalidArgument), match="no valid block"):
        sess.run(None, feed)


# ------------------------------------------------------------------------------------------------
# ExecuTorch


class _PoolModule(torch.nn.Module):
    def __init__(self, sc: Scenario):
        super().__init__()
        self.register_buffer("codes", sc.codes.clone())
        self.register_buffer("scales", sc.scales.clone())
        self.register_buffer("stage", sc.stage.clone())
        self.kw = sc.scalars()

    def forward(self, q, k, v, positions, seq_ids, block_tables, sinks):
        out = torch.ops.pagedkv.quantized_paged_attention(
            q, k, v, self.codes, self.scales, self.stage, positions, seq_ids, block_tables, sinks, *self.kw.values())
        return out, self.codes.clone(), self.scales.clone(), self.stage.clone()


def _et_program(sc: Scenario, max_t: int | None):
    """The op in a .pte on the ExecuTorch runtime; T up to max_t tokens per call (None: the first
    call's T only)."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    native.load_executorch_kernels()
    mod = _PoolModule(sc)
    c = sc.calls[0]
    ex_args = (c["q"], c["k"], c["v"], c["positions"], c["seq_ids"], sc.tables, sc.sinks)
    t = torch.export.Dim("T", min=1, max=max_t) if max_t else None
    dyn = ({2: t}, {2: t}, {2: t}, {0: t}, {0: t}, None, None) if max_t else None
    ep = torch.export.export(mod, ex_args, dynamic_shapes=dyn, strict=False)
    prog = to_edge_transform_and_lower(ep).to_executorch()
    program = Runtime.get().load_program(prog.buffer)
    return program, program.load_method("forward")  # the method needs its program alive


ET_ISAS = native.available_isas(native.load_executorch_kernels()) if ET_LIB else []


@needs_et
@pytest.mark.parametrize(
    "spec,isa",
    [(s, "auto") for s in ("default", "fp32", "q8_0-q4_0", "k4v4")] + [("default", i) for i in ET_ISAS[:-1]],
)
def test_executorch_kernel(spec, isa):
    """Each spec on the best path, and the default spec on every other path of the ExecuTorch library."""
    sc = Scenario(PRESETS[spec], hq=6, hkv=2, d=64, bs=16, lens=[40, 3, 21], chunk=16, sinks=True,
                  window=0, seed=11)
    max_t = max(len(c["positions"]) for c in sc.calls)
    _program, method = _et_program(sc, max(max_t, 2))
    ref_pools = (sc.codes.clone(), sc.scales.clone(), sc.stage.clone())
    with forced_isa(native.load_executorch_kernels(), isa):
        for i, call in enumerate(sc.calls):
            want = reference_paged_attention(*_args(sc, call, *ref_pools, sc.tables))
            got = method.execute([call["q"], call["k"], call["v"], call["positions"], call["seq_ids"], sc.tables,
                                  sc.sinks])
            _assert_out(f"et {isa} call {i}", got[0], want[0])
            _assert_pools(f"et {isa} call {i}", got[1:], want[1:])
            ref_pools = want[1:]


def test_each_host_library_keeps_its_own_core():
    """The core is built with hidden symbols: with the ExecuTorch library loaded RTLD_GLOBAL, the
    onnxruntime library still calls its own copy (its own thread setting), and the other way round."""
    et, ort = native.load_executorch_kernels(), native.ort_kernels()
    try:
        assert native.set_kernel_threads(ort, 1) == 1
        assert native.set_kernel_threads(et, 3) == 3
        assert ort.pagedkv_num_threads() == 1 and et.pagedkv_num_threads() == 3
        with pytest.raises(PagedKVError, match="threads=-1"):
            native.set_kernel_threads(ort, -1)
        assert ort.pagedkv_num_threads() == 1  # nothing changed by the bad call
    finally:
        native.set_kernel_threads(ort, 0)
        native.set_kernel_threads(et, 0)


def _long_decode_call(hkv=2, ratio=4, d=64, ctx=32768, seed=5):
    """One decode step over ctx cached tokens (random pool bytes): enough work that the op goes
    parallel (the core's kParallelMinWork), split into 12 items of ~0.1 ms or more each."""
    sc = Scenario(PRESETS["default"], hq=hkv * ratio, hkv=hkv, d=d, bs=16, lens=[1], chunk=1, seed=seed)
    g = torch.Generator().manual_seed(seed)
    sc.m = ctx // 16 + 2
    sc.nb = sc.m + 1
    sc.codes = torch.randint(0, 256, (sc.nb,) + tuple(sc.codes.shape[1:]), generator=g, dtype=torch.uint8)
    sc.scales = (torch.rand((sc.nb,) + tuple(sc.scales.shape[1:]), generator=g) * 0.05).half()
    sc.tables = torch.randperm(sc.nb, generator=g)[: sc.m].reshape(1, sc.m)
    sc.calls = [dict(q=torch.randn(1, sc.hq, 1, d, generator=g), k=torch.randn(1, hkv, 1, d, generator=g),
                     v=torch.randn(1, hkv, 1, d, generator=g), positions=torch.tensor([ctx], dtype=torch.int64),
                     seq_ids=torch.zeros(1, dtype=torch.int64), holes=False)]
    return sc


def _threads_seen(run, lib, calls=60):
    """The most threads any of `calls` runs of the op used. A worker that wakes late may find every
    item taken (more often when other processes hold the cores), so a long call and several tries."""
    most = 0
    for _ in range(calls):
        run()
        most = max(most, native.last_call_threads(lib))
        if most >= 2:
            break
    return most


@needs_ort
def test_hosts_run_the_op_on_their_threads_ort():
    """onnxruntime: the op's parallel work runs on the session's intra-op threads, whatever the core's
    own pool is set to; the output does not depend on the thread count."""
    sc = _long_decode_call()
    call = sc.calls[0]
    feed = dict(q=call["q"].numpy(), k=call["k"].numpy(), v=call["v"].numpy(), codes=sc.codes.numpy(),
                scales=sc.scales.numpy(), stage=sc.stage.numpy(), positions=call["positions"].numpy(),
                seq_ids=call["seq_ids"].numpy(), block_tables=sc.tables.numpy(), sinks=sc.sinks.numpy())
    lib = native.ort_kernels()
    outs = {}
    try:
        native.set_kernel_threads(lib, 2)  # the core's own pool: not used by this host
        for n in (1, 2):
            sess = _ort_session(sc, threads=n)
            outs[n] = sess.run(None, feed)[0]
            assert native.last_call_pool(lib) == "host"
            assert _threads_seen(lambda: sess.run(None, feed), lib) == n
    finally:
        native.set_kernel_threads(lib, 0)
    want = reference_paged_attention(*_args(sc, call, sc.codes, sc.scales, sc.stage, sc.tables))[0]
    for n in outs:
        _assert_out(f"{n} threads", outs[n], want)
    assert np.array_equal(outs[1], outs[2])


@needs_et
def test_hosts_run_the_op_on_their_threads_et():
    """ExecuTorch: the op's parallel work runs on ExecuTorch's threadpool (the linears' pool). Whether
    its worker takes part in a given call depends on the machine's load (pthreadpool wakes it; when it
    comes late the calling thread has taken every item), so only the 1-thread case counts threads."""
    from executorch.extension.pybindings import portable_lib

    sc = _long_decode_call(seed=6)
    call = sc.calls[0]
    _program, method = _et_program(sc, None)
    args = [call["q"], call["k"], call["v"], call["positions"], call["seq_ids"], sc.tables, sc.sinks]
    lib = native.load_executorch_kernels()
    before = portable_lib._threadpool_get_thread_count()
    outs = {}
    try:
        native.set_kernel_threads(lib, 2)  # the core's own pool: not used by this host
        for n in (1, 2):
            portable_lib._unsafe_reset_threadpool(n)
            outs[n] = method.execute(args)[0]
            assert native.last_call_pool(lib) == "host"
            if n == 1:  # the core's own pool (2 threads) is not used
                assert _threads_seen(lambda: method.execute(args), lib) == 1
    finally:
        portable_lib._unsafe_reset_threadpool(before)
        native.set_kernel_threads(lib, 0)
    assert torch.equal(outs[1], outs[2])


# ------------------------------------------------------------------------------------------------
# Mixed default/compact block tables (the compact tier, issue 25): the native mixed op on every code
# path, onnxruntime's QuantizedPagedAttentionMixed and ExecuTorch's quantized_paged_attention_mixed.out
# against the reference op (pagedkv::quantized_paged_attention_mixed's plain-PyTorch form).


def _mixed_call(spec_name, compact, hkv=2, grp=3, d=64, bs=16, prefill=(70, 45), extra=(3, 1), window=0,
                softcap=0.0, sinks=False, seed=0):
    """Sequences prefilled by the reference op, then some of their full blocks moved to the compact
    region (toolkit.quant.compact_block; the table names num_blocks + compact id), and one more call of
    `extra` tokens per sequence: the mixed op's arguments (pools are fresh copies each time)."""
    from toolkit.pool_layout import PoolLayout
    from toolkit.quant import compact_block

    spec = PRESETS[spec_name]
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    n_seqs, hq = len(prefill), hkv * grp
    total = [a + b for a, b in zip(prefill, extra)]
    width = max(math.ceil(n / bs) for n in total)
    nd = n_seqs * width + 1
    moved = [[c for c in range(p // bs) if rnd.random() < 0.6] for p in prefill]
    if not any(moved):
        moved[0] = [1]
    nc = sum(len(m) for m in moved) + 2  # two compact blocks the table never names
    lay = PoolLayout(spec, 1, hkv, d, bs, nd, n_seqs, compact=compact, num_compact_blocks=nc)
    codes, scales, stage = lay.allocate_layer()
    ccodes, cscales = lay.allocate_compact_layer()
    ccodes.random_(0, 255, generator=g)  # garbage the table never names must not matter
    tables = torch.randperm(nd, generator=g)[: n_seqs * width].reshape(n_seqs, width)
    kg, vg = spec.groups(d)
    scalars = (3, spec.k_bits, spec.v_bits, kg, vg, spec.k_sym, spec.v_sym, spec.rotate, spec.fp_tail,
               spec.sink_blocks, d ** -0.5, window, softcap)
    ckg, cvg = compact.groups(d)
    cscalars = (compact.k_bits, compact.v_bits, ckg, cvg, compact.k_sym, compact.v_sym)
    sink_logits = torch.randn(hq, generator=g) if sinks else torch.full((hq,), float("-inf"))
    qkv = [(torch.randn(1, hq, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g) * 2,
            torch.randn(1, hkv, n, d, generator=g)) for n in total]
    prefill_calls = []
    for s, n in enumerate(prefill):
        call = (*(x[:, :, :n].contiguous() for x in qkv[s]), torch.arange(n), torch.full((n,), s))
        prefill_calls.append(call)
        _, codes, scales, stage = reference_paged_attention(*call[:3], codes, scales, stage, *call[3:], tables,
                                                            sink_logits, *scalars)
    mixed = tables.clone()
    free = iter(torch.randperm(nc, generator=g).tolist())
    for s in range(n_seqs):
        for col in moved[s]:
            dst = next(free)
            compact_block(codes, scales, ccodes, cscales, int(tables[s, col]), dst, spec, compact, d)
            mixed[s, col] = nd + dst
    q, k, v = (torch.cat([qkv[s][i][:, :, a:a + n] for s, (a, n) in enumerate(zip(prefill, extra))], 2)
               for i in range(3))
    pos = torch.cat([torch.arange(a, a + n) for a, n in zip(prefill, extra)])
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(extra)])
    return dict(q=q, k=k, v=v, pools=(codes, scales, stage), compact=(ccodes, cscales), positions=pos, seq_ids=seq,
                tables=mixed, sinks=sink_logits, scalars=scalars, cscalars=cscalars, prefill_calls=prefill_calls,
                plain_tables=tables, empty_pools=lay.allocate_layer())


def _mixed_reference(c):
    base = (c["q"], c["k"], c["v"], *c["pools"], c["positions"], c["seq_ids"], c["tables"], c["sinks"], *c["scalars"])
    return reference_paged_attention(*base, compact=(*c["compact"], *c["cscalars"]))


K4V3 = KVQuantSpec(4, 3, 64, 64, True, False, True, True, 1)  # toolkit.kv_spec.COMPACT_SPEC
MIXED_CASES = {
    "default+compact": dict(spec_name="default", compact=K4V3),                    # q shared (K8 g64 / K4 widened)
    "best+compact": dict(spec_name="best", compact=K4V3, sinks=True),              # both regions widened
    "default+k4v2g32": dict(spec_name="default", compact=KVQuantSpec(4, 2, 32, 32, True, False, True, True, 1),
                            window=40),                                            # own q, wider scale records
    "k4v4+compact": dict(spec_name="k4v4", compact=K4V3, grp=4, softcap=20.0),     # own q (K4 vs widened K8)
    "default+k4av4": dict(spec_name="default", compact=KVQuantSpec(4, 4, 32, 32, False, True, True, True, 1), bs=32,
                          prefill=(100, 70), extra=(2, 5)),                        # asym K, not widened, own q
    "default+compact-decode": dict(spec_name="default", compact=K4V3, prefill=(300,), extra=(1,)),  # split-K
}


@needs_ort
@pytest.mark.parametrize("isa", ORT_ISAS)
@pytest.mark.parametrize("case", list(MIXED_CASES))
def test_native_mixed_tables(case, isa):
    """The core's mixed op (its C entry point) on each code path: the reference's output and pools (the
    compact region only read)."""
    from toolkit.native_op import _lib, call_native

    c = _mixed_call(**MIXED_CASES[case])
    want = _mixed_reference(c)
    pools = [t.clone() for t in c["pools"]]
    compact = [t.clone() for t in c["compact"]]
    lib = _lib()
    with forced_isa(lib, isa):
        out = call_native(lib, c["q"], c["k"], c["v"], *pools, c["positions"], c["seq_ids"], c["tables"], c["sinks"],
                          *c["scalars"], *c["cscalars"], compact=compact)
    _assert_out(f"mixed {case} {isa}", out, want[0])
    _assert_pools(f"mixed {case} {isa}", pools, want[1:])
    assert all(torch.equal(a, b) for a, b in zip(compact, c["compact"])), "the compact region was written"


@needs_ort
def test_native_op_context_runs_the_mixed_op():
    """Inside native_op() the mixed in-place op runs on the core (same bits as the C entry point)."""
    from toolkit.native_op import native_op

    c = _mixed_call(**MIXED_CASES["default+compact"])
    want = _mixed_reference(c)
    pools = [t.clone() for t in c["pools"]]
    with native_op():
        out = torch.ops.pagedkv.quantized_paged_attention_mixed(
            c["q"], c["k"], c["v"], *pools, *c["compact"], c["positions"], c["seq_ids"], c["tables"], c["sinks"],
            *c["scalars"], *c["cscalars"])
    _assert_out("native_op mixed", out, want[0])
    _assert_pools("native_op mixed", pools, want[1:])


def _ort_mixed_session(c):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from toolkit.paged_attention import COMPACT_SCALAR_ARG_NAMES

    def info(name, x, elem=None):
        return helper.make_tensor_value_info(name, elem or {torch.uint8: TensorProto.UINT8,
                                                            torch.float16: TensorProto.FLOAT16,
                                                            torch.float32: TensorProto.FLOAT,
                                                            torch.int64: TensorProto.INT64}[x.dtype], list(x.shape))

    names = ["q", "k", "v", "codes", "scales", "stage", "compact_codes", "compact_scales", "positions", "seq_ids",
             "block_tables", "sinks"]
    tensors = [c["q"], c["k"], c["v"], *c["pools"], *c["compact"], c["positions"], c["seq_ids"], c["tables"], c["sinks"]]
    inputs = [info(n, x) for n, x in zip(names, tensors)]
    t = c["q"].shape[2]
    outputs = [info("out", torch.empty(1, t, c["q"].shape[1], c["q"].shape[3])),
               *[info(n + "_out", x) for n, x in zip(("codes", "scales", "stage"), c["pools"])]]
    attrs = {k: (float(v) if isinstance(v, float) else int(v))
             for k, v in zip(SCALAR_ARG_NAMES + COMPACT_SCALAR_ARG_NAMES, c["scalars"] + c["cscalars"])}
    node = helper.make_node("QuantizedPagedAttentionMixed", names, [o.name for o in outputs], domain="pagedkv",
                            **attrs)
    model = helper.make_model(helper.make_graph([node], "qpa_mixed", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("pagedkv", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.register_custom_ops_library(ORT_LIB)
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess, dict(zip(names, [x.numpy() for x in tensors]))


@needs_ort
@pytest.mark.parametrize("isa", ORT_ISAS)
def test_ort_mixed_tables(isa):
    c = _mixed_call(**MIXED_CASES["best+compact"])
    want = _mixed_reference(c)
    sess, feed = _ort_mixed_session(c)
    with forced_isa(native.ort_kernels(), isa):
        out, *pools = sess.run(None, feed)
    _assert_out(f"ort mixed {isa}", out, want[0])
    _assert_pools(f"ort mixed {isa}", [torch.from_numpy(p) for p in pools], want[1:])


@needs_ort
def test_ort_mixed_errors():
    """A new token whose block is a compact one, and a compact region of another spec: clear errors."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

    c = _mixed_call(**MIXED_CASES["default+compact"])
    sess, feed = _ort_mixed_session(c)
    tables = c["tables"].clone()
    tables[0, 70 // 16] = c["pools"][0].shape[0]  # the block of position 70: compact block 0
    with pytest.raises((Fail, InvalidArgument), match="maps to compact block"):
        sess.run(None, dict(feed, block_tables=tables.numpy()))
    c2 = dict(c, compact=(c["compact"][0][..., :-1].contiguous(), c["compact"][1]))
    sess2, feed2 = _ort_mixed_session(c2)
    with pytest.raises((Fail, InvalidArgument), match="compact record widths"):
        sess2.run(None, feed2)


class _MixedPoolModule(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        for name, x in zip(("codes", "scales", "stage", "compact_codes", "compact_scales"),
                           (*c["empty_pools"], *c["compact"])):
            self.register_buffer(name, x.clone())
        self.scalars = c["scalars"] + c["cscalars"]

    def forward(self, q, k, v, positions, seq_ids, block_tables, sinks):
        out = torch.ops.pagedkv.quantized_paged_attention_mixed(
            q, k, v, self.codes, self.scales, self.stage, self.compact_codes, self.compact_scales, positions, seq_ids,
            block_tables, sinks, *self.scalars)
        return out, self.codes.clone(), self.scales.clone(), self.stage.clone()


@needs_et
@pytest.mark.parametrize("isa", ["auto"] + ET_ISAS[:-1])
def test_executorch_mixed_tables(isa):
    """quantized_paged_attention_mixed.out in a .pte (pools and the compact region as buffers) on the
    ExecuTorch runtime. A program's mutable buffers start empty (their initial values are not
    serialized): the prefill calls run there first, with the table naming no compact block (the
    default op's reading), then the mixed call; the compact region is a constant of the program."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    native.load_executorch_kernels()
    c = _mixed_call(**MIXED_CASES["default+compact"], seed=4)
    want = _mixed_reference(c)
    args = (c["q"], c["k"], c["v"], c["positions"], c["seq_ids"], c["tables"], c["sinks"])
    t = torch.export.Dim("T", min=1, max=128)
    dyn = ({2: t}, {2: t}, {2: t}, {0: t}, {0: t}, None, None)
    ep = torch.export.export(_MixedPoolModule(c), args, dynamic_shapes=dyn, strict=False)
    prog = to_edge_transform_and_lower(ep).to_executorch()
    program = Runtime.get().load_program(prog.buffer)
    method = program.load_method("forward")
    with forced_isa(native.load_executorch_kernels(), isa):
        for q, k, v, pos, seq in c["prefill_calls"]:
            method.execute([q, k, v, pos, seq, c["plain_tables"], c["sinks"]])
        got = method.execute(list(args))
    _assert_out(f"et mixed {isa}", got[0], want[0])
    _assert_pools(f"et mixed {isa}", got[1:], want[1:])


COMPACT_CANDIDATES = [K4V3, KVQuantSpec(5, 2, 64, 64, True, False, True, True, 1),
                      KVQuantSpec(4, 2, 32, 32, True, False, True, True, 1),
                      KVQuantSpec(3, 3, 32, 32, False, False, True, True, 1),
                      KVQuantSpec(4, 3, 16, 16, True, True, True, True, 1)]


@needs_ort
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    spec=st.sampled_from(["default", "best", "k5v4"]),
    compact=st.sampled_from(COMPACT_CANDIDATES),
    hkv=st.sampled_from([1, 2]),
    grp=st.sampled_from([1, 3, 4]),
    d=st.sampled_from([64, 128]),
    bs=st.sampled_from([16, 32]),
    blocks=st.lists(st.integers(2, 5), min_size=1, max_size=2),
    extra=st.integers(1, 4),
    window=st.sampled_from([0, 0, 40]),
    softcap=st.sampled_from([0.0, 0.0, 15.0]),
    sinks=st.booleans(),
    seed=st.integers(0, 1000),
    isa=st.sampled_from(ORT_ISAS),
)
def test_native_mixed_random(spec, compact, hkv, grp, d, bs, blocks, extra, window, softcap, sinks, seed, isa):
    """Random mixed tables (spec pairs, shapes, windows, softcap, sinks) on a random code path: the
    reference's output and pools."""
    from hypothesis import assume

    from toolkit.errors import SpecError
    from toolkit.kv_spec import check_compact
    from toolkit.native_op import _lib, call_native

    try:
        check_compact(PRESETS[spec], compact, d)
    except SpecError:
        assume(False)
    prefill = tuple(b * bs + seed % bs for b in blocks)
    c = _mixed_call(spec, compact, hkv=hkv, grp=grp, d=d, bs=bs, prefill=prefill, extra=(extra,) * len(prefill),
                    window=window, softcap=softcap, sinks=sinks, seed=seed)
    want = _mixed_reference(c)
    pools = [t.clone() for t in c["pools"]]
    lib = _lib()
    with forced_isa(lib, isa):
        out = call_native(lib, c["q"], c["k"], c["v"], *pools, c["positions"], c["seq_ids"], c["tables"], c["sinks"],
                          *c["scalars"], *c["cscalars"], compact=c["compact"])
    _assert_out(f"mixed random {isa}", out, want[0])
    _assert_pools(f"mixed random {isa}", pools, want[1:])
