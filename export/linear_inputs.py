"""A sample of each linear's inputs on the calibration text, to choose the .pte's precision per linear.

8da4w-asym-e8h8 stores an asymmetric int4 block as XNNPACK's symmetric int4 product plus an fp32 offset
term, y = Q(x) s(q-8) + x s(8-zp) (export.executorch_export.AsymInt4Linear). A block of near-zero weights
with a few large ones sits at one end of its grid (zero point near 0): its near-zero weights get codes
near -8 and the offset term +8 steps, the two terms cancel, and the int8 activation error Q(x) - x of the
first is multiplied by 8 steps where the weight is ~0. On Qwen2.5-1.5B's down_proj of layer 2, whose
weights are exact on the 4-bit grid, both terms are 3.4x |y| and the output's relative error is 0.084,
where int8 activations times the exact weights give 0.0033. So export measures each linear's error both
ways on these inputs and stores as int8 the linears that int4 makes much worse (_quantize_asym4).
"""

from __future__ import annotations

import torch

SAMPLE_ROWS = 64  # tokens kept per linear: the first FIRST_ROWS (where massive activations sit), then spread
FIRST_ROWS = 8


def sample_rows(n: int, rows: int = SAMPLE_ROWS, first: int = FIRST_ROWS) -> torch.Tensor:
    """Token indices 0..n-1 to keep: the first `first`, then evenly spread, `rows` in all (all when n <= rows)."""
    if n <= rows:
        return torch.arange(n)
    rest = torch.linspace(first, n - 1, rows - first).round().long()
    return torch.cat([torch.arange(first), rest])


def sample_linear_inputs(model: torch.nn.Module, ids) -> dict:
    """{linear's qualified name: its inputs at sample_rows of the tokens [rows, K]} over one pass of `ids`
    through `model` with an unquantized pool (toolkit.calibration.unquantized_pass)."""
    from toolkit.calibration import unquantized_pass

    run = unquantized_pass(model, ids)
    keep = sample_rows(len(ids))
    inputs: dict = {}

    def hook(name):
        def record(mod, args):
            inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1])[keep].float().clone()
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return inputs


def relative_error(linear: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor) -> float:
    """||linear(x) - x W^T|| / ||x W^T|| (no bias: it is exact in both)."""
    with torch.no_grad():
        ref = x @ weight.detach().float().T
        y = linear(x)
        if getattr(linear, "bias", None) is not None:
            y = y - linear.bias
        return float((y - ref).norm() / ref.norm().clamp(min=1e-30))
