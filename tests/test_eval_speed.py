"""benchmarks/eval_speed.py's compute floor counts the FLOPs PyTorch's own counter counts (BENCHMARKS quotes
it as the float32 bound of the fidelity table)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.eval_speed import table_flops
from toolkit.tiny_models import tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_table_flops_is_the_forward_counted_by_torch(family):
    model, ctx = tiny_model(family), 48
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, model.config.vocab_size, (1, ctx)))
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # eager attention multiplies the whole ctx x ctx square; table_flops counts only the causal half
    square = 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * ctx * ctx
    causal = 2 * c.num_hidden_layers * c.num_attention_heads * head_dim * ctx * (ctx + 1)
    assert table_flops(model, ctx, windows=1, rows=1) - causal + square == counter.get_total_flops()
    assert table_flops(model, ctx, windows=3, rows=2) == 6 * table_flops(model, ctx, windows=1, rows=1)
