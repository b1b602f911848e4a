""".pte weights "8da4w-asym-e8h8" (export.executorch_export.AsymInt4Linear): asymmetric 4-bit blocks on
XNNPACK's symmetric int4 kernel plus a per-block offset linear. Weights already on a 4-bit affine grid
(a GGUF Q4_1 model's dequantization) are stored exactly; the rest are asymmetric round-to-nearest."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from export.executorch_export import AsymInt4Linear  # noqa: E402


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """W [n, k] = d*q + m per block of 32 (GGUF Q4_1), d a bf16 value so XNNPACK's bf16 scales hold it."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.001).to(torch.bfloat16).float()
    m = -torch.rand(n, k // 32, 1, generator=g) * 0.1
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # every block spans the grid (its step is then unambiguous)
    return (d * q + m).reshape(n, k)


def effective_weight(lin: AsymInt4Linear) -> torch.Tensor:
    """The weight the module multiplies by: dequantized int4 codes + each block's offset."""
    w = torch.cat([p.weight.dequantize() for p in lin.pieces], dim=1)
    if lin.offsets is not None:
        w = w + lin.offsets.repeat_interleave(lin.group, dim=1)
    return w


def test_grid_weights_are_stored_exactly():
    w = q4_1_weight(48, 96)
    lin = AsymInt4Linear(w)
    assert lin.exact_blocks == 48 * 3 and lin.offsets is not None
    torch.testing.assert_close(effective_weight(lin), w, rtol=0, atol=1e-6)
    # the forward pass is that weight on int8 per-token activations: within int8 rounding of x @ W^T
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    ref = x @ w.T
    err = (lin(x) - ref).abs().max() / ref.abs().max()
    assert err < 0.02, err
    # the block sums (a reshape + a [1, 32] linear, no [K/32, K] matrix) for any leading shape
    assert lin.block_ones.shape == (1, 32)
    xb = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(lin(xb), torch.stack([lin(xi) for xi in xb]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lin(xb[:1]), lin(xb[0])[None], rtol=1e-6, atol=1e-6)


def test_symmetric_grid_needs_no_offsets_and_other_weights_round_to_nearest():
    g = torch.Generator().manual_seed(2)
    d = (torch.rand(8, 2, 1, generator=g) + 0.5).to(torch.bfloat16).float()
    q = torch.randint(0, 16, (8, 2, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    w = (d * (q - 8)).reshape(8, 64)  # Q4_0: d*(q-8)
    lin = AsymInt4Linear(w)
    assert lin.offsets is None and lin.exact_blocks == 16
    torch.testing.assert_close(effective_weight(lin), w, rtol=0, atol=1e-6)
    # weights on no grid: asymmetric RTN, within half a step (span/30) per value, plus bf16 scale rounding
    w = torch.randn(8, 64, generator=g)
    lin = AsymInt4Linear(w, bias=torch.ones(8))
    assert lin.exact_blocks == 0
    blocks = w.reshape(8, 2, 32)
    step = (blocks.amax(-1) - blocks.amin(-1)) / 15
    err = (effective_weight(lin) - w).abs().reshape(8, 2, 32).amax(-1)
    assert torch.all(err <= step * (0.5 + 8 * 2**-8)), (err / step).max()
    assert torch.equal(lin.bias, torch.ones(8))


def test_activation_chunks():
    """Each int8 activation scale covers a chunk of inputs that divides K (96 -> 96, 576 -> 3 x 192,
    640 -> 4 x 160), and a wide linear gets at most MAX_ACT_PIECES chunks (8960 -> 8 x 1120, not 56 x 160);
    the pieces together hold the whole weight."""
    from export.executorch_export import MAX_ACT_PIECES, act_chunk

    assert (act_chunk(96, 32), act_chunk(576, 32), act_chunk(1536, 32), act_chunk(640, 32)) == (96, 192, 192, 160)
    assert MAX_ACT_PIECES == 8 and act_chunk(8960, 32) == 1120 and act_chunk(8960, 32, max_pieces=1 << 30) == 160
    w = q4_1_weight(16, 576, seed=3)
    lin = AsymInt4Linear(w)
    assert lin.widths == [192, 192, 192]
    torch.testing.assert_close(effective_weight(lin), w, rtol=0, atol=1e-6)


def test_sibling_projections_fused_keep_every_number():
    """q/k/v (and gate/up) of a tiny llama become one AsymInt4Linear behind LinearParts: each part's
    output equals its own AsymInt4Linear's on the same input (the same weight blocks, the same int8
    activation scale per chunk of the shared input), in any call order and for a different input."""
    from export.executorch_export import LinearPart, _quantize_asym4
    from toolkit.tiny_models import tiny_model

    model = tiny_model("llama", num_layers=1)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    alone = {n: AsymInt4Linear(getattr(attn, n).weight) for n in ("q_proj", "k_proj", "v_proj")}
    alone |= {n: AsymInt4Linear(getattr(mlp, n).weight) for n in ("gate_proj", "up_proj")}
    head = model.get_output_embeddings()
    blocks = sum(m.weight.numel() // 32 for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    assert _quantize_asym4(model)["int4_blocks"] == blocks
    assert isinstance(attn.k_proj, LinearPart) and isinstance(mlp.up_proj, LinearPart)
    g = torch.Generator().manual_seed(4)
    x, x2 = torch.randn(1, 5, 256, generator=g), torch.randn(1, 5, 256, generator=g)
    with torch.no_grad():
        for mod, names in ((attn, ("v_proj", "q_proj", "k_proj")), (mlp, ("gate_proj", "up_proj"))):
            for name in names:  # out of order, then one part on another input
                torch.testing.assert_close(getattr(mod, name)(x), alone[name](x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(getattr(mod, names[0])(x2), alone[names[0]](x2), rtol=1e-5, atol=1e-5)
        assert model(torch.arange(6)[None], use_cache=False).logits.isfinite().all()


class TwoLinears(torch.nn.Module):
    """Two projections "on" and "off" of the given weights (no LM head)."""

    def __init__(self, on: torch.Tensor, off: torch.Tensor):
        super().__init__()
        self.on = torch.nn.Linear(on.shape[1], on.shape[0], bias=False)
        self.off = torch.nn.Linear(off.shape[1], off.shape[0], bias=False)
        self.on.weight.data, self.off.weight.data = on, off


def test_a_model_off_the_grid_stays_int4():
    """int8 is chosen only in a model with linears on the 4-bit grid (a GGUF Q4 dequantization): in a model
    of fp weights every linear is rounded to int4 anyway, and int8 everywhere would double its size."""
    from export.executorch_export import AsymInt4Linear, _quantize_asym4

    g = torch.Generator().manual_seed(4)
    m = TwoLinears(torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g))
    x = torch.randn(32, 64, generator=g)
    info = _quantize_asym4(m, inputs={"on": x, "off": x})
    assert isinstance(m.on, AsymInt4Linear) and isinstance(m.off, AsymInt4Linear) and info["int8_linears"] == 0


def test_calibration_inputs_choose_int8_where_int4_cancels():
    """With calibration inputs, an on-grid linear whose int4 error on them is over INT8_GAIN x its int8 error
    is int8. Blocks of near-zero weights with one large weight sit at one end of their grid (zero point 0):
    their symmetric int4 codes are -8 and the offset term +8 steps, so the two terms cancel and the int8
    activation error of the first is multiplied by 8 steps where the weight is 0 (export/linear_inputs.py).
    Blocks spread over their grid stay int4 (exact there)."""
    from export.executorch_export import INT8_GAIN, AsymInt4Linear, ChunkedLinear, _int8_linear, _quantize_asym4
    from export.linear_inputs import relative_error

    g = torch.Generator().manual_seed(7)
    sparse = torch.zeros(16, 2, 32)
    sparse[..., 5] = 15
    sparse[..., 9] = torch.randint(0, 16, (16, 2), generator=g).float()
    spread = torch.randint(0, 16, (16, 2, 32), generator=g).float()
    spread[..., 0], spread[..., 1] = 0, 15
    x = torch.randn(32, 64, generator=g)
    for q, want8 in ((2.0**-8 * sparse, True), (2.0**-8 * (spread - 8), False)):
        w = q.reshape(16, 64)
        e4, e8 = relative_error(AsymInt4Linear(w), x, w), relative_error(_int8_linear(w), x, w)
        assert (e4 > INT8_GAIN * e8) == want8, (e4, e8)
        m = TwoLinears(w.clone(), q4_1_weight(16, 64, seed=8))
        info = _quantize_asym4(m, inputs={"on": x, "off": x})
        assert (type(m.on) is ChunkedLinear) == want8 and isinstance(m.off, AsymInt4Linear), info
        assert info["int8_linears"] == int(want8)


def test_float_tensors_get_their_own_memory():
    """After quantization the plain tensors left (norms, biases) are copied out of the memory they were
    loaded into (a safetensors memory map: its pages stay resident while any tensor of it lives); the
    values stay, quantized weights are left as they are."""
    from export.executorch_export import _own_float_tensors, _quantize_asym4

    loaded = torch.randn(4096)  # stands in for the file's map: every tensor below is a view of it
    m = TwoLinears(loaded[:16 * 64].view(16, 64), q4_1_weight(16, 64))
    m.norm = torch.nn.Parameter(loaded[2048:2112], requires_grad=False)
    m.register_buffer("table", loaded[3000:3010])
    _quantize_asym4(m)
    quantized = {id(p) for p in m.parameters() if type(p) not in (torch.Tensor, torch.nn.Parameter)}
    copied = _own_float_tensors(m)
    assert copied >= (64 + 10) * 4
    base = loaded.untyped_storage().data_ptr()
    for t in list(m.parameters()) + list(m.buffers()):
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            assert t.untyped_storage().data_ptr() != base
    assert torch.equal(m.norm, loaded[2048:2112]) and torch.equal(m.table, loaded[3000:3010])
    assert quantized <= {id(p) for p in m.parameters()}
