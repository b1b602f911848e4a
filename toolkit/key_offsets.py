"""Per-layer key offsets: the mean key of each channel, measured on a calibration text and subtracted
from every key before it reaches the pool.

Why: some families' keys carry a large per-channel offset (Qwen2's k_proj bias and the "massive" low-
frequency RoPE channels), common to every token. Group-wise quantization spends its whole range on it,
and the Hadamard rotation spreads it over every group, so 4- to 6-bit keys lose everything else.

Why it is exact: attention scores q . (k - mu) = q . k - q . mu, and q . mu is the same for every key a
query sees, so the softmax (shift-invariant) gives the same weights. That holds for plain softmax
attention; with a logit softcap (tanh) or attention sinks (an extra logit) it does not, so such layers get
a zero offset. The offsets are float32 constants of the compiled model (buffers `k_offset_<layer>`), so
the exported .pte / .onnx carry them and their sha256 in pagedkv.json covers them; no kernel changes.

    offsets = measure_key_offsets(model, calib_ids)   # list over layers of [num_kv_heads, head_dim]
    paged = compile(model, spec, key_offsets=offsets)
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface

from toolkit.errors import PagedKVError

OBSERVE_NAME = "pagedkv_observe"


class _KeyMeans:
    """Running per-layer sums of the post-RoPE keys HF hands the attention function."""

    def __init__(self, num_layers: int):
        self.sums: list[torch.Tensor | None] = [None] * num_layers
        self.count = [0] * num_layers
        self.exact = [True] * num_layers  # False where a shift would change the softmax

    def add(self, layer: int, key: torch.Tensor, softcap, sinks) -> None:
        k = key[0].double()  # [Hkv, T, D]
        s = k.sum(dim=1)
        self.sums[layer] = s if self.sums[layer] is None else self.sums[layer] + s
        self.count[layer] += k.shape[1]
        if softcap or sinks is not None:
            self.exact[layer] = False

    def offsets(self) -> list[torch.Tensor]:
        out = []
        for layer, (s, n) in enumerate(zip(self.sums, self.count)):
            if s is None or n == 0:
                raise PagedKVError(f"layer {layer} saw no keys during calibration: the model skipped it.")
            mean = (s / n).float()
            out.append(mean if self.exact[layer] else torch.zeros_like(mean))
        return out


_observer: _KeyMeans | None = None


def _observe_forward(module, query, key, value, attention_mask, **kwargs):
    from toolkit.compiler import paged_attention_forward

    if _observer is not None:
        sinks = kwargs.get("s_aux")
        if sinks is None:
            sinks = getattr(module, "sinks", None)
        _observer.add(module.layer_idx, key, kwargs.get("softcap"), sinks)
    return paged_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(OBSERVE_NAME, _observe_forward)


@contextlib.contextmanager
def observing_keys(model):
    """While inside, every forward of a model compiled from `model` adds its keys to the yielded sums
    (`.offsets()` gives the means); the op runs as before. Compile before entering: compile() selects the
    op's own attention."""
    global _observer
    from toolkit.compiler import ATTN_NAME, model_dims

    _observer = _KeyMeans(model_dims(model.config).num_layers)
    model.set_attn_implementation(OBSERVE_NAME)
    try:
        yield _observer
    finally:
        _observer = None
        model.set_attn_implementation(ATTN_NAME)


def measure_key_offsets(model, ids, chunk: int = 512) -> list[torch.Tensor]:
    """The mean post-RoPE key per layer, KV head and channel over the token ids `ids` (one sequence, run in
    chunks of `chunk` tokens through an unquantized pool, so every chunk's keys follow the real context).
    Returns float32 [num_kv_heads, head_dim] per layer (zeros for softcap / sink layers)."""
    from toolkit.compiler import compile

    ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
    if ids.numel() < 2:
        raise PagedKVError("the calibration text has fewer than 2 tokens: give a longer --calib-text.")
    bs = 16
    paged = compile(model, "fp32", block_size=bs, num_blocks=-(-ids.numel() // bs), max_seqs=1)
    tables = (torch.arange(paged.layout.num_blocks, dtype=torch.int64)[None, :],) * len(paged.groups)
    with observing_keys(model) as keys, torch.no_grad():
        for start in range(0, ids.numel(), chunk):
            part = ids[start:start + chunk]
            pos = torch.arange(start, start + part.numel(), dtype=torch.int64)
            paged(part[None], pos, torch.zeros_like(pos), *tables, logits_rows=torch.tensor([part.numel() - 1]))
        return keys.offsets()
