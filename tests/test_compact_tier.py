"""The compact tier (issue 25): aged blocks re-quantized to a compact spec in a second pool region.

- toolkit.quant.requantize (dequantize the stored codes, quantize to the compact spec) and compact_block
  (one block of one layer, in place): exact to the reference, nothing else in the pool changes;
- the mixed-table op (pagedkv::quantized_paged_attention_mixed[_functional]) against an independent
  naive per-query loop, and a table without compact blocks gives the default op's bits;
- PoolLayout's compact region (shapes, bytes, dict round trip; a layout without one is unchanged).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import naive_attention_loop
import toolkit.paged_attention  # noqa: F401  (defines torch.ops.pagedkv)
from toolkit.errors import PagedKVError, SpecError
from toolkit.kv_spec import check_compact, record_layout
from toolkit.paged_attention import reference_paged_attention
from toolkit.pool_layout import PoolLayout
from toolkit.quant import PRESETS, KVQuantSpec, compact_block, dequantize, hadamard, quantize, requantize

K4V3 = KVQuantSpec(4, 3, 64, 64, True, False, True, True, 1)
K5V2 = KVQuantSpec(5, 2, 64, 64, True, False, True, True, 1)
COMPACTS = [K4V3, K5V2, KVQuantSpec(4, 2, 32, 32, True, False, True, True, 1)]


def _records(spec, shape, d, seed=0):
    """Records the op would write for random (rotated) K/V of the given leading shape."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(*shape, d, generator=g) * 2, torch.randn(*shape, d, generator=g)
    kg, vg = spec.groups(d)
    kc, km = quantize(k, spec.k_bits, kg, spec.k_sym)
    vc, vm = quantize(v, spec.v_bits, vg, spec.v_sym)
    return torch.cat((kc, vc), -1), torch.cat((km, vm), -1)


def _read(codes, scales, spec, d):
    rec = record_layout(spec, d)
    kg, vg = spec.groups(d)
    k = dequantize(codes[..., :rec.k_code_bytes], scales[..., :rec.k_scale_count], spec.k_bits, kg, spec.k_sym, d)
    v = dequantize(codes[..., rec.k_code_bytes:], scales[..., rec.k_scale_count:], spec.v_bits, vg, spec.v_sym, d)
    return k, v


# ----------------------------------------------------------------------------------------------
# Re-quantization


@pytest.mark.parametrize("compact", COMPACTS, ids=lambda s: s.describe())
@pytest.mark.parametrize("src_name", ["default", "best"])
def test_requantize_is_quantize_of_the_dequantized_codes(src_name, compact):
    src, d = PRESETS[src_name], 64
    codes, scales = _records(src, (3, 16), d)
    ccodes, cscales = requantize(codes, scales, src, compact, d)
    rec = record_layout(compact, d)
    assert ccodes.dtype == torch.uint8 and cscales.dtype == torch.float16
    assert ccodes.shape == (3, 16, rec.code_width) and cscales.shape == (3, 16, rec.scale_width)
    # K and V separately: the compact record is the compact quantizer applied to what the default codes say
    k, v = _read(codes, scales, src, d)
    kg, vg = compact.groups(d)
    want_kc, want_km = quantize(k, compact.k_bits, kg, compact.k_sym)
    want_vc, want_vm = quantize(v, compact.v_bits, vg, compact.v_sym)
    assert torch.equal(ccodes, torch.cat((want_kc, want_vc), -1))
    assert torch.equal(cscales, torch.cat((want_km, want_vm), -1))
    # and reads back within half a compact step of the default values (+ fp16 rounding of scale/zero)
    kc, vc = _read(ccodes, cscales, compact, d)
    for x, y, bits, group, sym, meta in ((k, kc, compact.k_bits, kg, compact.k_sym, want_km),
                                        (v, vc, compact.v_bits, vg, compact.v_sym, want_vm)):
        step = meta[..., : d // group].float().repeat_interleave(group, -1)
        span = x.reshape(*x.shape[:-1], d // group, group).abs().amax(-1).repeat_interleave(group, -1)
        assert bool(((x - y).abs() <= step / 2 + span * 2e-3 + 1e-6).all()), (bits, sym)


def test_compact_block_changes_only_its_destination():
    src, compact, d, hkv, bs = PRESETS["default"], K4V3, 64, 2, 16
    lay = PoolLayout(src, 1, hkv, d, bs, 6, 1, compact=compact, num_compact_blocks=3)
    codes, scales = _records(src, (6, hkv, bs), d, seed=1)
    ccodes, cscales = (torch.randint(0, 255, t.shape, dtype=torch.uint8) if i == 0 else torch.randn(t.shape).half()
                       for i, t in enumerate(lay.allocate_compact_layer()))
    before = [t.clone() for t in (codes, scales, ccodes, cscales)]
    compact_block(codes, scales, ccodes, cscales, 4, 1, src, compact, d)
    want_c, want_s = requantize(before[0][4], before[1][4], src, compact, d)
    assert torch.equal(ccodes[1], want_c) and torch.equal(cscales[1], want_s)
    assert torch.equal(codes, before[0]) and torch.equal(scales, before[1])
    for now, was in ((ccodes, before[2]), (cscales, before[3])):
        assert torch.equal(now[[0, 2]], was[[0, 2]])


def test_check_compact_errors():
    d = 64
    assert check_compact(PRESETS["default"], K4V3, d) == K4V3
    with pytest.raises(SpecError, match="rotate"):
        check_compact(PRESETS["default"], K4V3.replace(rotate=False), d)
    with pytest.raises(SpecError, match="not fewer"):
        check_compact(PRESETS["k4v4"], PRESETS["best"], d)
    with pytest.raises(SpecError, match="quantized"):
        check_compact(PRESETS["fp16"], K4V3, d)
    with pytest.raises(SpecError, match="k_group"):
        check_compact(PRESETS["default"], K4V3.replace(k_group=48), d)


# ----------------------------------------------------------------------------------------------
# Pool layout


def test_layout_without_compact_region_is_unchanged():
    lay = PoolLayout(PRESETS["default"], 30, 3, 64, 16, 100, 2)
    d = lay.to_dict()
    assert "compact" not in d and "num_compact_blocks" not in d
    assert PoolLayout.from_dict(d) == lay
    assert set(lay.layer_tensor_bytes()) == {"codes", "scales", "stage"}


def test_layout_with_compact_region():
    base = PoolLayout(PRESETS["default"], 30, 3, 64, 16, 100, 2)
    lay = PoolLayout(PRESETS["default"], 30, 3, 64, 16, 100, 2, compact=K4V3, num_compact_blocks=50)
    rec = record_layout(K4V3, 64)
    assert lay.compact_codes_shape() == (50, 3, 16, rec.code_width)
    assert lay.compact_scales_shape() == (50, 3, 16, rec.scale_width)
    assert lay.total_bytes == base.total_bytes + 50 * 16 * lay.compact_bytes_per_token
    assert lay.compact_bytes_per_token == 30 * 3 * (rec.code_width + 2 * rec.scale_width)
    assert PoolLayout.from_dict(lay.to_dict()) == lay
    assert lay.is_compact_block(100) and not lay.is_compact_block(99)
    with pytest.raises(SpecError, match="compact region"):
        PoolLayout(PRESETS["default"], 30, 3, 64, 16, 100, 2, compact=K4V3)
    with pytest.raises(SpecError, match="rotate"):
        PoolLayout(PRESETS["default"], 30, 3, 64, 16, 100, 2, compact=K4V3.replace(rotate=False), num_compact_blocks=4)


# ----------------------------------------------------------------------------------------------
# The mixed-table op


def _scalars(spec, d, scale, window=0, softcap=0.0):
    kg, vg = spec.groups(d)
    return (0, spec.k_bits, spec.v_bits, kg, vg, spec.k_sym, spec.v_sym, spec.rotate, spec.fp_tail,
            spec.sink_blocks, scale, window, softcap)


def _compact_scalars(c, d):
    kg, vg = c.groups(d)
    return (c.k_bits, c.v_bits, kg, vg, c.k_sym, c.v_sym)


def naive_mixed(q_tok, hist_k, hist_v, p, spec, compact, compact_cols, bs, scale, window, sinks):
    """One query [Hq, D] over raw (unrotated) history [Hkv, p+1, D]: float16 for the sink block and the
    query's own block, the compact spec re-quantized from the default one for the logical blocks in
    compact_cols, the default spec otherwise. No tables, slots, stages or codes."""
    d = q_tok.shape[1]

    def seen(j, kj, vj):
        if (spec.sink_blocks and j < bs) or (spec.fp_tail and j // bs == p // bs):
            return kj.half().float(), vj.half().float()
        c, s = _records_of(kj, vj, spec, d)
        if j // bs in compact_cols:
            return _read(*requantize(c, s, spec, compact, d), compact, d)
        return _read(c, s, spec, d)

    rot = hadamard if spec.rotate else (lambda x: x)
    return naive_attention_loop(q_tok, hist_k, hist_v, p, rot, seen, scale, window, 0.0, sinks)


def _records_of(k, v, spec, d):
    kg, vg = spec.groups(d)
    kc, km = quantize(k[None], spec.k_bits, kg, spec.k_sym)
    vc, vm = quantize(v[None], spec.v_bits, vg, spec.v_sym)
    return torch.cat((kc, vc), -1)[0], torch.cat((km, vm), -1)[0]


@st.composite
def mixed_scenarios(draw):
    spec = PRESETS[draw(st.sampled_from(["default", "best", "k5v4"]))]
    compact = draw(st.sampled_from(COMPACTS))
    hkv, grp, bs = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3])), draw(st.sampled_from([16, 32]))
    n_seqs = draw(st.integers(1, 2))
    prefill = [draw(st.integers(2 * bs, 5 * bs)) for _ in range(n_seqs)]
    extra = [draw(st.integers(1, 4)) for _ in range(n_seqs)]  # tokens of the mixed call, per sequence
    full = [n // bs for n in prefill]
    # logical blocks moved to the compact region: full blocks, never the one the mixed call writes into
    cols = [sorted(draw(st.sets(st.integers(0, f - 1), max_size=f))) for f in full]
    window = draw(st.sampled_from([0, 0, 40]))
    seed = draw(st.integers(0, 2**16))
    return spec, compact, hkv, grp, bs, prefill, extra, cols, window, seed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mixed_scenarios())
def test_mixed_table_matches_naive(sc):
    spec, compact, hkv, grp, bs, prefill, extra, cols, window, seed = sc
    d, hq = 64, hkv * grp
    g = torch.Generator().manual_seed(seed)
    n_seqs = len(prefill)
    total = [a + b for a, b in zip(prefill, extra)]
    width = max(math.ceil(n / bs) for n in total)
    nd = n_seqs * width + 1
    nc = sum(len(c) for c in cols) + 1
    lay = PoolLayout(spec, 1, hkv, d, bs, nd, n_seqs, compact=compact, num_compact_blocks=nc)
    codes, scales, stage = lay.allocate_layer()
    ccodes, cscales = lay.allocate_compact_layer()
    tables = torch.randperm(nd, generator=g)[: n_seqs * width].reshape(n_seqs, width)
    q_all = [torch.randn(hq, n, d, generator=g) for n in total]
    k_all = [torch.randn(hkv, n, d, generator=g) * 2 for n in total]
    v_all = [torch.randn(hkv, n, d, generator=g) for n in total]
    sinks = torch.full((hq,), float("-inf"))
    scale = d ** -0.5
    sc_args = _scalars(spec, d, scale, window)
    for s in range(n_seqs):  # prefill with the default op
        n = prefill[s]
        _, codes, scales, stage = reference_paged_attention(
            q_all[s][None, :, :n], k_all[s][None, :, :n], v_all[s][None, :, :n], codes, scales, stage,
            torch.arange(n), torch.full((n,), s), tables, sinks, *sc_args)
    # move the chosen blocks to the compact region; the table names nd + compact id
    mixed_tables = tables.clone()
    free = iter(torch.randperm(nc, generator=g).tolist())
    for s in range(n_seqs):
        for col in cols[s]:
            dst = next(free)
            compact_block(codes, scales, ccodes, cscales, int(tables[s, col]), dst, spec, compact, d)
            mixed_tables[s, col] = nd + dst
    call = [(s, prefill[s], extra[s]) for s in range(n_seqs)]
    q = torch.cat([q_all[s][:, a:a + n] for s, a, n in call], 1)[None]
    k = torch.cat([k_all[s][:, a:a + n] for s, a, n in call], 1)[None]
    v = torch.cat([v_all[s][:, a:a + n] for s, a, n in call], 1)[None]
    pos = torch.cat([torch.arange(a, a + n) for s, a, n in call])
    seq = torch.cat([torch.full((n,), s) for s, a, n in call])
    c_args = _compact_scalars(compact, d)
    pools = [t.clone() for t in (codes, scales, stage)]
    out = torch.ops.pagedkv.quantized_paged_attention_mixed(q, k, v, *pools, ccodes, cscales, pos, seq, mixed_tables,
                                                            sinks, *sc_args, *c_args)
    f_out, f_codes, f_scales, f_stage = torch.ops.pagedkv.quantized_paged_attention_mixed_functional(
        q, k, v, codes, scales, stage, ccodes, cscales, pos, seq, mixed_tables, sinks, *sc_args, *c_args)
    assert torch.equal(out, f_out)
    assert torch.equal(pools[0], f_codes) and torch.equal(pools[1], f_scales) and torch.equal(pools[2], f_stage)
    i = 0
    for s, a, n in call:
        for p in range(a, a + n):
            want = naive_mixed(q_all[s][:, p], k_all[s][:, :p + 1], v_all[s][:, :p + 1], p, spec, compact,
                               set(cols[s]), bs, scale, window, sinks)
            torch.testing.assert_close(out[0, i], want, rtol=2e-5, atol=2e-5)
            i += 1


def _decode_setup(spec_name="default", seed=3):
    spec, d, hkv, hq, bs, n = PRESETS[spec_name], 64, 2, 6, 16, 70
    g = torch.Generator().manual_seed(seed)
    lay = PoolLayout(spec, 1, hkv, d, bs, 8, 1, compact=K4V3, num_compact_blocks=4)
    codes, scales, stage = lay.allocate_layer()
    ccodes, cscales = lay.allocate_compact_layer()
    ccodes.random_(0, 255, generator=g)  # garbage the table never names must not matter
    tables = torch.tensor([[5, 2, 7, 0, 3, 1]])
    sc = _scalars(spec, d, d ** -0.5)
    sinks = torch.full((hq,), float("-inf"))
    _, codes, scales, stage = reference_paged_attention(
        torch.randn(1, hq, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g),
        torch.randn(1, hkv, n, d, generator=g), codes, scales, stage, torch.arange(n), torch.zeros(n, dtype=torch.int64),
        tables, sinks, *sc)
    step = (torch.randn(1, hq, 1, d, generator=g), torch.randn(1, hkv, 1, d, generator=g),
            torch.randn(1, hkv, 1, d, generator=g))
    return spec, d, lay, (codes, scales, stage), (ccodes, cscales), tables, sc, sinks, step, n


def test_table_without_compact_blocks_gives_the_default_ops_bits():
    spec, d, lay, pools, cpools, tables, sc, sinks, (q, k, v), n = _decode_setup()
    pos, seq = torch.tensor([n]), torch.tensor([0])
    want = reference_paged_attention(q, k, v, *pools, pos, seq, tables, sinks, *sc)
    got = torch.ops.pagedkv.quantized_paged_attention_mixed_functional(
        q, k, v, *pools, *cpools, pos, seq, tables, sinks, *sc, *_compact_scalars(K4V3, d))
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_block_moved_unchanged_gives_the_same_bits():
    """A compact region holding the default spec's own records (copied, not re-quantized): reading
    block 2 from there must give exactly what reading it from the default region gives (addressing)."""
    spec, d, lay, pools, _, tables, sc, sinks, (q, k, v), n = _decode_setup()
    codes, scales, stage = pools
    ccodes, cscales = codes[:3].clone().zero_(), scales[:3].clone().zero_()
    ccodes[1], cscales[1] = codes[7], scales[7]  # logical block 2 lives in block 7
    moved = tables.clone()
    moved[0, 2] = lay.num_blocks + 1
    pos, seq = torch.tensor([n]), torch.tensor([0])
    want = reference_paged_attention(q, k, v, *pools, pos, seq, tables, sinks, *sc)
    kg, vg = spec.groups(d)
    got = torch.ops.pagedkv.quantized_paged_attention_mixed_functional(
        q, k, v, *pools, ccodes, cscales, pos, seq, moved, sinks, *sc,
        spec.k_bits, spec.v_bits, kg, vg, spec.k_sym, spec.v_sym)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_mixed_op_errors():
    spec, d, lay, pools, cpools, tables, sc, sinks, (q, k, v), n = _decode_setup()
    cs = _compact_scalars(K4V3, d)
    bad = tables.clone()
    bad[0, n // 16] = lay.num_blocks + 1  # the block the new token is written into
    with pytest.raises(PagedKVError, match="compact block"):
        torch.ops.pagedkv.quantized_paged_attention_mixed_functional(
            q, k, v, *pools, *cpools, torch.tensor([n]), torch.tensor([0]), bad, sinks, *sc, *cs)
    bad = tables.clone()
    bad[0, 1] = lay.num_blocks + lay.num_compact_blocks
    with pytest.raises(PagedKVError, match="outside the pool of 8 \\+ 4 compact"):
        torch.ops.pagedkv.quantized_paged_attention_mixed_functional(
            q, k, v, *pools, *cpools, torch.tensor([n]), torch.tensor([0]), bad, sinks, *sc, *cs)


def test_compact_spec_for_the_presets():
    from toolkit.kv_spec import COMPACT_SPEC, bytes_per_token, compact_spec_for, fp16_bytes_per_token

    for name in ("default", "best", "k5v4"):
        c = compact_spec_for(PRESETS[name], 64)
        assert c.rotate == PRESETS[name].rotate
        assert bytes_per_token(c, 3, 64) <= 0.25 * fp16_bytes_per_token(3, 64)  # the target
    assert compact_spec_for(PRESETS["default"], 256).k_group == COMPACT_SPEC.k_group
    with pytest.raises(SpecError, match="not fewer"):
        compact_spec_for(PRESETS["k4v4"].replace(k_bits=3, v_bits=2), 64)


# ----------------------------------------------------------------------------------------------
# The mixed op's ONNX fallback function (export/onnx_mixed.py): stock onnxruntime, no native library


def test_onnx_mixed_fallback_function_matches_the_reference():
    """One QuantizedPagedAttentionMixed node whose only implementation is the model's fallback function
    (standard ops) on stock onnxruntime: the reference's output and pools for a mixed table."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from export.onnx_mixed import MIXED_OP_TYPE, MIXED_TENSOR_INPUTS, mixed_fallback_function, register_mixed_schema
    from toolkit.paged_attention import COMPACT_SCALAR_ARG_NAMES, SCALAR_ARG_NAMES

    spec, d, lay, pools, cpools, tables, sc, sinks, (q, k, v), n = _decode_setup()
    # a mixed table: logical blocks 1 and 3 re-quantized into compact blocks 2 and 0
    ccodes, cscales = (t.clone() for t in cpools)
    mixed = tables.clone()
    for col, dst in ((1, 2), (3, 0)):
        compact_block(pools[0], pools[1], ccodes, cscales, int(tables[0, col]), dst, spec, K4V3, d)
        mixed[0, col] = lay.num_blocks + dst
    pos, seq = torch.tensor([n]), torch.tensor([0])
    cs = _compact_scalars(K4V3, d)
    want = reference_paged_attention(q, k, v, *pools, pos, seq, mixed, sinks, *sc, compact=(ccodes, cscales, *cs))

    register_mixed_schema()
    fn, extra = mixed_fallback_function(lay, q.shape[1])
    tensors = (q, k, v, *pools, ccodes, cscales, pos, seq, mixed, sinks)
    elem = {torch.uint8: TensorProto.UINT8, torch.float16: TensorProto.FLOAT16, torch.float32: TensorProto.FLOAT,
            torch.int64: TensorProto.INT64}
    inputs = [helper.make_tensor_value_info(nm, elem[x.dtype], list(x.shape)) for nm, x in zip(MIXED_TENSOR_INPUTS, tensors)]
    outs = [helper.make_tensor_value_info(nm, elem[x.dtype], list(x.shape))
            for nm, x in zip(("out", "codes_out", "scales_out", "stage_out"), want)]
    attrs = {a: (float(x) if isinstance(x, float) else int(x))
             for a, x in zip(SCALAR_ARG_NAMES + COMPACT_SCALAR_ARG_NAMES, sc + cs)}
    node = helper.make_node(MIXED_OP_TYPE, list(MIXED_TENSOR_INPUTS), [o.name for o in outs], domain="pagedkv", **attrs)
    model = helper.make_model(helper.make_graph([node], "mixed", inputs, outs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("pagedkv", 1)]
                              + [o for o in fn.opset_import if o.domain not in ("", "pagedkv")])
    model.ir_version = 10
    model.functions.extend([fn, *extra])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = sess.run(None, {nm: x.numpy() for nm, x in zip(MIXED_TENSOR_INPUTS, tensors)})
    torch.testing.assert_close(torch.from_numpy(got[0]), want[0], rtol=2e-5, atol=2e-5)
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(torch.from_numpy(a), b)


# ----------------------------------------------------------------------------------------------
# The model and the engine: compile(compact_blocks=N), runtime_sim.compact.compact_aged


def _compact_engine(num_blocks=16, compact_blocks=4, max_seqs=2):
    from runtime_sim.backends import TorchBackend
    from runtime_sim.engine import Engine
    from toolkit.compiler import compile
    from toolkit.tiny_models import tiny_model

    paged = compile(tiny_model("llama"), "default", num_blocks=num_blocks, max_seqs=max_seqs,
                    compact_blocks=compact_blocks)
    return Engine(TorchBackend(paged), prefill_chunk=16)


def _pool_state(paged):
    return ([tuple(t.clone() for t in layer) for layer in paged.pool_tensors()],
            {i: tuple(t.clone() for t in c) for i, c in paged.compact_pool_tensors().items()})


def test_compile_without_compact_blocks_is_todays_model():
    from toolkit.compiler import compile
    from toolkit.kv_spec import compact_spec_for
    from toolkit.tiny_models import tiny_model

    plain = compile(tiny_model("llama"), "default", num_blocks=8)
    assert plain.layout.num_compact_blocks == 0 and plain.compact_pool_tensors() == {}
    with_c = compile(tiny_model("llama"), "default", num_blocks=8, compact_blocks=3)
    names = {n for n, _ in plain.named_buffers()}
    assert {n for n, _ in with_c.named_buffers()} == names | {f"compact_{w}_{i}" for w in ("codes", "scales")
                                                             for i in range(2)}
    assert with_c.layout.compact == compact_spec_for(PRESETS["default"], 64)
    cc, cs = with_c.compact_pool_tensors()[0]
    assert tuple(cc.shape) == with_c.layout.compact_codes_shape() and cc.shape[0] == 3
    assert tuple(cs.shape) == with_c.layout.compact_scales_shape()
    # a table without compact ids: the model with a region gives the plain model's logits bit for bit
    ids = torch.arange(3, 40)[None]
    pos, seq = torch.arange(37), torch.zeros(37, dtype=torch.int64)
    table = torch.full((4, 3), -1, dtype=torch.int64)
    table[0] = torch.tensor([5, 2, 7])
    with torch.no_grad():
        assert torch.equal(plain(ids, pos, seq, table), with_c(ids, pos, seq, table))


def test_compact_aged_in_the_engine():
    from runtime_sim.compact import compact_aged
    from toolkit.compiler import compile
    from toolkit.tiny_models import tiny_model

    e = _compact_engine()
    paged, lay, bs = e.backend.paged, e.backend.layout, 16
    prompt = [(7 * i + 3) % 500 + 3 for i in range(90)]  # 90 tokens: blocks 0..5, the last one partial
    c = e.new_conversation()
    e.prefill(c, prompt)
    seq = e.conversations[c].seq
    before_table = e.pool.block_table(seq)
    before = _pool_state(paged)
    with pytest.raises(PagedKVError, match="horizon"):
        compact_aged(e, c, 0)

    moved = compact_aged(e, c, horizon=40)  # blocks ending at least 40 tokens back: 1 and 2 (0 is the sink)
    assert [i for i, _, _ in moved] == [1, 2]
    table = e.pool.block_table(seq)
    assert [table[i] for i, _, _ in moved] == [16, 17] and [s for _, s, _ in moved] == before_table[1:3]
    assert table[:1] + table[3:] == before_table[:1] + before_table[3:]
    e.check_invariants()
    assert e.pool.main.num_free_compact_blocks == 2 and e.pool.num_free_blocks == 16 - 6 + 2
    assert compact_aged(e, c, horizon=40) == []  # nothing more is old enough
    # the KV bytes in use: 4 default blocks, 2 compact ones (in the compact spec), the stage rows
    assert e.stats()["kv_bytes_in_use"] == bs * (4 * lay.bytes_per_token + 2 * lay.compact_bytes_per_token) + \
        lay.stage_bytes_per_sequence

    # (b) the default region and the stages are byte-identical; the compact region holds exactly the
    # re-quantized records of the moved blocks, and nothing else
    after = _pool_state(paged)
    for old, new in zip(before[0], after[0]):
        for a, b in zip(old, new):
            assert torch.equal(a, b)
    for i, (ccodes, cscales) in after[1].items():
        codes, scales, _ = before[0][i]
        for _, src, dst in moved:
            want_c, want_s = requantize(codes[src], scales[src], lay.spec, lay.compact, 64)
            assert torch.equal(ccodes[dst - 16], want_c) and torch.equal(cscales[dst - 16], want_s)
        assert not ccodes[2:].any() and not cscales[2:].any()

    # (a) the next token's logits equal an independent model's (same weights) on a copy of the same pool
    # state, called directly with the table the pool now holds: the mixed reference op reads the compact blocks
    ref = compile(tiny_model("llama"), "default", num_blocks=16, max_seqs=2, compact_blocks=4)
    for (dc, ds, dt), (sc, ss, st) in zip(ref.pool_tensors(), after[0]):
        dc.copy_(sc), ds.copy_(ss), dt.copy_(st)
    for i, (cc, cs) in ref.compact_pool_tensors().items():
        cc.copy_(after[1][i][0]), cs.copy_(after[1][i][1])
    tab = torch.full((2, 6), -1, dtype=torch.int64)
    tab[seq] = torch.tensor(table)
    with torch.no_grad():
        want = ref(torch.tensor([[11]]), torch.tensor([90]), torch.tensor([seq]), tab)[0, -1].numpy()
    # the same step without the compact tier reads other values: the compact blocks are what is read
    plain = _compact_engine()
    pc = plain.new_conversation()
    plain.prefill(pc, prompt)
    got = e.step({c: [11]})[c]
    assert (got == want).all()
    assert not (plain.step({pc: [11]})[pc] == got).all()
    e.check_invariants()

    # (d) generation goes on (new blocks come from the default region), then everything is freed
    out = list(e.generate(c, [12, 13], 30))
    assert len(out) == 30 and all(0 <= t < 512 for t in out)
    assert len(e.pool.block_table(seq)) == -(-(90 + 1 + 2 + 30 - 1) // bs) and all(
        b < 16 for i, b in enumerate(e.pool.block_table(seq)) if i not in (1, 2))
    moved = compact_aged(e, c, horizon=40)  # blocks 3..4 now old enough; 2 compact blocks left
    assert [i for i, _, _ in moved] == [3, 4] and e.pool.main.num_free_compact_blocks == 0
    e.check_invariants()
    e.close(c)
    e.check_invariants()
    assert e.pool.num_free_blocks == 16 and e.pool.main.num_free_compact_blocks == 4


def test_compact_aged_leaves_shared_blocks():
    from runtime_sim.compact import compact_aged

    e = _compact_engine()
    c = e.new_conversation()
    e.prefill(c, list(range(3, 90)))
    f = e.fork(c)  # every block is shared: nothing moves, for either conversation
    assert compact_aged(e, c, 16) == [] and compact_aged(e, f, 16) == []
    e.step({f: [5] * 20})  # f's last block is copied on write; the older ones stay shared
    assert compact_aged(e, f, 16) == []
    e.close(c)  # now f holds them alone
    moved = compact_aged(e, f, 16)
    assert [i for i, _, _ in moved] == [1, 2, 3, 4]
    e.check_invariants()
    e.close(f)
    e.check_invariants()
    assert e.pool.num_free_blocks == 16 and e.pool.main.num_free_compact_blocks == 4


def test_compact_aged_limit_moves_the_oldest_blocks_only():
    """compact_aged(..., limit=k): the k oldest aged blocks, the same records as moving all of them would
    give those blocks; the rest stay default until asked for (the ladder's rung moves what a turn needs)."""
    from runtime_sim.compact import compact_aged

    prompt = [(7 * i + 3) % 500 + 3 for i in range(90)]  # blocks 0..5; aged at horizon 16: 1..3 (0 is the sink)
    e, full = _compact_engine(), _compact_engine()
    c, f = e.new_conversation(), full.new_conversation()
    e.prefill(c, prompt)
    full.prefill(f, prompt)
    with pytest.raises(PagedKVError, match="limit"):
        compact_aged(e, c, 16, limit=0)
    assert [i for i, _, _ in compact_aged(e, c, 16, limit=2)] == [1, 2]
    seq = e.conversations[c].seq
    n = e.pool.main.num_blocks
    assert [i for i, b in enumerate(e.pool.block_table(seq)) if b >= n] == [1, 2]
    e.check_invariants()
    assert [i for i, _, _ in compact_aged(full, f, 16)] == [1, 2, 3]  # no limit: every aged block
    cp, fp = e.backend.paged.compact_pool_tensors(), full.backend.paged.compact_pool_tensors()
    assert cp and cp.keys() == fp.keys()
    for layer, (cc, cs) in cp.items():  # compact ids 0, 1 hold blocks 1, 2 in both (the same seeded model)
        assert torch.equal(cc[:2], fp[layer][0][:2]) and torch.equal(cs[:2], fp[layer][1][:2])
    assert [i for i, _, _ in compact_aged(e, c, 16, limit=5)] == [3]  # what is left, however many asked


def test_compact_aged_errors():
    from runtime_sim.backends import TorchBackend
    from runtime_sim.compact import compact_aged
    from runtime_sim.engine import Engine
    from toolkit.compiler import compile
    from toolkit.tiny_models import tiny_model

    e = Engine(TorchBackend(compile(tiny_model("llama"), "default", num_blocks=8)), prefill_chunk=16)
    c = e.new_conversation()
    e.prefill(c, list(range(3, 60)))
    with pytest.raises(PagedKVError, match="compact_blocks"):
        compact_aged(e, c, 16)
    with pytest.raises(SpecError):
        compile(tiny_model("llama"), "fp16", num_blocks=8, compact_blocks=2)


def test_save_of_a_compacted_conversation_writes_its_compact_records(tmp_path):
    """The conversation file (format version 2) holds compact blocks as their compact records; saving
    changes nothing in the pool. Round trips and bad files: tests/test_save_restore.py."""
    from runtime_sim import conversation_file as cf
    from runtime_sim.compact import compact_aged

    e = _compact_engine()
    c = e.new_conversation()
    e.prefill(c, list(range(3, 90)))
    moved = compact_aged(e, c, 16)
    table = e.pool.block_table(e.conversations[c].seq)
    e.save(c, tmp_path / "c.pkvc")
    d = cf.read(tmp_path / "c.pkvc")
    assert d.groups[0].present == [cf.COMPACT if b >= 16 else cf.DEFAULT for b in table] and d.n_compact == len(moved)
    for i, (cc, cs) in e.backend.paged.compact_pool_tensors().items():
        assert (d.compact_codes[i] == cc[[dst - 16 for _, _, dst in moved]].numpy()).all()
        assert (d.compact_scales[i] == cs[[dst - 16 for _, _, dst in moved]].numpy().view("uint8")).all()
    assert e.pool.block_table(e.conversations[c].seq) == table
    e.check_invariants()
