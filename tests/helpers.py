"""Helpers shared by the tests."""

import torch


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy decoding with HF's own KV cache (no generate(): its EOS handling would interfere)."""
    out, ids, cache = [], torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(steps):
            res = model(ids, past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out
