"""Helpers shared by the tests."""

import math

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


def naive_attention_loop(q_tok, hist_k, hist_v, p, rot, seen, scale, window, softcap, sinks):
    """One query [Hq, D] over raw history [Hkv, p+1, D], one key at a time: the attention rule of
    toolkit/POOL_FORMAT.md with no tables, slots or codes. rot: the rotation (identity if none);
    seen(j, k, v) -> the (k, v) attention sees for key j, given its rotated float values (the spec's
    storage: float16, quantized, ...). Query head h reads KV head h // (Hq / Hkv); returns [Hq, D]."""
    hq, d = q_tok.shape
    hkv = hist_k.shape[0]
    out = torch.zeros(hq, d)
    for h in range(hq):
        kvh = h // (hq // hkv)
        qv = rot(q_tok[h].float())
        logits, values = [], []
        for j in range(p + 1):
            if window > 0 and p - j >= window:
                continue
            kj, vj = seen(j, rot(hist_k[kvh, j].float()), rot(hist_v[kvh, j].float()))
            s = float(qv @ kj) * scale
            if softcap > 0:
                s = math.tanh(s / softcap) * softcap
            logits.append(s)
            values.append(vj)
        w = torch.softmax(torch.tensor(logits + [float(sinks[h])]), 0)[:-1]
        out[h] = rot(sum(wi * vi for wi, vi in zip(w, values)))
    return out


def export_key_offsets(art_dir):
    """The key offsets an export calibrated (toolkit/calibration.py), for a reference compiled beside it."""
    from toolkit.calibration import read_key_offsets
    from toolkit.manifest import read_manifest

    return read_key_offsets(art_dir, read_manifest(art_dir))
