"""The op's reference against an independent naive implementation (dense per-query loop, no paging).

The naive side keeps each sequence's full K/V history in plain lists and, for every query, builds the
key set the spec promises: float16 for the sink block and the query's own block, group-wise
fake-quantized otherwise. It never looks at block tables, slots, stages or codes.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import naive_attention_loop
from toolkit.errors import NonFiniteKVError
from toolkit.paged_attention import reference_paged_attention
from toolkit.pool_layout import PoolLayout
from toolkit.quant import PRESETS, KVQuantSpec, fake_quantize, hadamard, pack_bits, quantize, unpack_bits

SPECS = ["fp32", "fp16", "default", "best", "k4v4", "q8_0-q4_0", "et-int8"]


def naive_attention(q_tok, hist_k, hist_v, p, spec: KVQuantSpec, bs, scale, window, softcap, sinks):
    """q_tok [Hq, D]; hist_k/v [Hkv, p+1, D] (raw, unrotated); returns [Hq, D]."""
    d = q_tok.shape[1]
    quant = not spec.is_float
    rot = hadamard if (quant and spec.rotate) else (lambda x: x)
    kg, vg = spec.groups(d)

    def seen(j, kj, vj):
        if not quant:
            return (kj.to(torch.float16).float() if spec.k_bits == 16 else kj,
                    vj.to(torch.float16).float() if spec.v_bits == 16 else vj)
        if (spec.sink_blocks and j < bs) or (spec.fp_tail and j // bs == p // bs):
            return kj.half().float(), vj.half().float()
        return (fake_quantize(kj[None], spec.k_bits, kg, spec.k_sym)[0],
                fake_quantize(vj[None], spec.v_bits, vg, spec.v_sym)[0])

    return naive_attention_loop(q_tok, hist_k, hist_v, p, rot, seen, scale, window, softcap, sinks)


@st.composite
def scenarios(draw):
    spec_name = draw(st.sampled_from(SPECS))
    spec = PRESETS[spec_name]
    hkv = draw(st.sampled_from([1, 2]))
    grp = draw(st.sampled_from([1, 3, 4]))
    d = 64 if spec.k_group in (0, 64) or draw(st.booleans()) else 32
    if d == 32 and not spec.is_float:
        spec = spec.replace(k_group=min(spec.k_group or 32, 32), v_group=min(spec.v_group or 32, 32))
    bs = draw(st.sampled_from([16, 32]))
    n_seqs = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 70)) for _ in range(n_seqs)]
    window = draw(st.sampled_from([0, 0, 5, 17, 40]))
    softcap = draw(st.sampled_from([0.0, 0.0, 8.0]))
    with_sinks = draw(st.booleans())
    # schedule: each call advances every unfinished sequence by 1..25 tokens (prefill chunks / decode)
    schedule, done = [], [0] * n_seqs
    while any(done[s] < lengths[s] for s in range(n_seqs)):
        call = []
        first = min(s for s in range(n_seqs) if done[s] < lengths[s])
        for s in range(n_seqs):
            if done[s] < lengths[s] and (s == first or draw(st.booleans())):
                n = draw(st.integers(1, min(25, lengths[s] - done[s])))
                call.append((s, done[s], n))
                done[s] += n
        schedule.append(call)
    seed = draw(st.integers(0, 2**16))
    return spec, hkv, grp, d, bs, lengths, window, softcap, with_sinks, schedule, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(scenarios())
def test_reference_matches_naive(sc):
    spec, hkv, grp, d, bs, lengths, window, softcap, with_sinks, schedule, seed = sc
    g = torch.Generator().manual_seed(seed)
    hq = hkv * grp
    n_seqs = len(lengths)
    max_blocks = max(math.ceil(n / bs) for n in lengths)
    num_blocks = n_seqs * max_blocks + 2
    layout = PoolLayout(spec, 1, hkv, d, bs, num_blocks, n_seqs)
    codes, scales, stage = layout.allocate_layer()
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: n_seqs * max_blocks].reshape(n_seqs, max_blocks)
    q_all = [torch.randn(hq, n, d, generator=g) for n in lengths]
    k_all = [torch.randn(hkv, n, d, generator=g) * 2 for n in lengths]
    v_all = [torch.randn(hkv, n, d, generator=g) for n in lengths]
    sinks = torch.randn(hq, generator=g) if with_sinks else torch.full((hq,), float("-inf"))
    scale = d**-0.5
    kg, vg = spec.groups(d)
    scalars = (0, spec.k_bits, spec.v_bits, kg, vg, spec.k_sym, spec.v_sym, spec.rotate, spec.fp_tail,
               spec.sink_blocks, scale, window, softcap)
    for call in schedule:
        q = torch.cat([q_all[s][:, a : a + n] for s, a, n in call], dim=1)[None]
        k = torch.cat([k_all[s][:, a : a + n] for s, a, n in call], dim=1)[None]
        v = torch.cat([v_all[s][:, a : a + n] for s, a, n in call], dim=1)[None]
        pos = torch.cat([torch.arange(a, a + n) for s, a, n in call])
        seq = torch.cat([torch.full((n,), s) for s, a, n in call])
        out, codes, scales, stage = reference_paged_attention(
            q, k, v, codes, scales, stage, pos, seq, tables, sinks, *scalars
        )
        i = 0
        for s, a, n in call:
            for p in range(a, a + n):
                want = naive_attention(q_all[s][:, p], k_all[s][:, : p + 1], v_all[s][:, : p + 1], p, spec, bs,
                                       scale, window, softcap, sinks)
                torch.testing.assert_close(out[0, i], want, rtol=2e-5, atol=2e-5)
                i += 1


# ----------------------------------------------------------------------------------------------
# Quantizer unit checks against scalar formulas


@pytest.mark.parametrize("bits", range(2, 9))
def test_pack_unpack_roundtrip_and_nibble_order(bits):
    u = torch.randint(0, 1 << bits, (3, 64), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(u, bits)
    assert packed.shape == (3, 64 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, 64), u.to(torch.int32))
    if bits == 4:  # value 0 in the low nibble of byte 0 (ORT's int4 order)
        assert int(packed[0, 0]) == int(u[0, 0]) | (int(u[0, 1]) << 4)


def test_symmetric_int8_matches_scalar_formula():
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    packed, meta = quantize(x[None], 8, 32, True)
    for gi in range(2):
        grp = x[gi * 32 : (gi + 1) * 32]
        s16 = torch.tensor(float(grp.abs().max()) / 127).half()
        assert meta[0, gi] == s16
        for i in range(32):
            want = max(-127, min(127, round(float(grp[i]) / float(s16)))) + 128
            assert int(packed[0, gi * 32 + i]) == want


def test_zero_group_has_zero_scale_and_dequantizes_to_zero():
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-1, 1, 32)
    for bits, sym in ((8, True), (4, False), (5, True)):
        y = fake_quantize(x, bits, 32, sym)
        assert torch.isfinite(y).all()
        assert torch.equal(y[0], torch.zeros(64)) and torch.equal(y[1, :32], torch.zeros(32))


def test_nan_kv_raises_naming_layer_and_position_and_leaves_pool_intact():
    spec = PRESETS["default"]
    layout = PoolLayout(spec, 1, 1, 64, 16, 4, 1)
    codes, scales, stage = layout.allocate_layer()
    k = torch.randn(1, 1, 5, 64)
    k[0, 0, 3, 7] = float("nan")
    before = [t.clone() for t in (codes, scales, stage)]
    import toolkit.paged_attention  # noqa: F401

    with pytest.raises(NonFiniteKVError, match=r"layer 7, sequence 0, position 3"):
        torch.ops.pagedkv.quantized_paged_attention(
            torch.randn(1, 1, 5, 64), k, torch.randn(1, 1, 5, 64), codes, scales, stage,
            torch.arange(5), torch.zeros(5, dtype=torch.long), torch.arange(4)[None], torch.full((1,), float("-inf")),
            7, 8, 4, 64, 32, True, False, True, True, 1, 0.125, 0, 0.0,
        )
    for a, b in zip(before, (codes, scales, stage)):
        assert torch.equal(a, b)
