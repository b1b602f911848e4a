"""The compiler step on tiny random models of all supported families, against unmodified HF."""

import math

import pytest
import torch

from transformers import AttentionInterface

from toolkit.compiler import compile, model_dims, preflight
from toolkit.errors import UnsupportedModelError
from toolkit.quant import PRESETS, fake_quantize, hadamard
from toolkit.tiny_models import TINY_CONFIGS, tiny_config, tiny_model
from tests.helpers import hf_greedy

FAMILIES = list(TINY_CONFIGS)
BS = 16



def paged_greedy_batch(paged, prompts: list[list[int]], steps: int, first_chunk: int) -> list[list[int]]:
    """Greedy decode two prompts together: prompt 0 prefilled in two chunks (the first chunk alone,
    the second together with the whole of prompt 1), then one decode token per sequence per step."""
    per_seq = paged.layout.num_blocks // 2
    tables = torch.arange(2 * per_seq).reshape(2, per_seq)
    outs = [[], []]
    lengths = [0, 0]

    def call(items):  # items: list of (seq, tokens)
        ids, pos, seq = [], [], []
        for s, toks in items:
            ids += toks
            pos += list(range(lengths[s], lengths[s] + len(toks)))
            seq += [s] * len(toks)
            lengths[s] += len(toks)
        with torch.no_grad():
            logits = paged(torch.tensor([ids]), torch.tensor(pos), torch.tensor(seq), tables)
        last, i = {}, 0
        for s, toks in items:
            i += len(toks)
            last[s] = int(logits[0, i - 1].argmax())
        return last

    call([(0, prompts[0][:first_chunk])])
    nxt = call([(0, prompts[0][first_chunk:]), (1, prompts[1])])
    for _ in range(steps):
        for s in (0, 1):
            outs[s].append(nxt[s])
        nxt = call([(0, [outs[0][-1]]), (1, [outs[1][-1]])])
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_pool_greedy_equals_hf(family):
    ref = tiny_model(family)
    paged = compile(tiny_model(family), "fp32", block_size=BS, num_blocks=16, max_seqs=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (37,), generator=g).tolist(), torch.randint(3, 512, (19,), generator=g).tolist()]
    steps = 34
    got = paged_greedy_batch(paged, prompts, steps, first_chunk=21)
    for s in (0, 1):
        assert got[s] == hf_greedy(ref, prompts[s], steps), f"{family}: sequence {s} diverged from HF"


# ----------------------------------------------------------------------------------------------
# Quantized pool vs HF eager attention on the same quantize-dequantized K/V


def effective_kv(x, is_k, p, spec, bs):
    """What the op lets a query at position p see for history x [Hkv, p+1, D] (unrotated space)."""
    kg, vg = spec.groups(x.shape[-1])
    bits, group, sym = (spec.k_bits, kg, spec.k_sym) if is_k else (spec.v_bits, vg, spec.v_sym)
    rot = hadamard if spec.rotate else (lambda y: y)
    xr = rot(x.float())
    fq = fake_quantize(xr, bits, group, sym)
    j = torch.arange(x.shape[1])
    fp = torch.zeros_like(j, dtype=torch.bool)
    if spec.fp_tail:
        fp |= j // bs == p // bs
    if spec.sink_blocks:
        fp |= j < bs
    eff = torch.where(fp[None, :, None], xr.half().float(), fq)
    return rot(eff)


def register_fakequant_eager(family, spec, bs):
    """An attention function that runs the family's own eager attention per query on effective K/V."""
    import importlib

    mod_name = {"gemma3": "gemma3"}.get(family, family)
    eager = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}").eager_attention_forward

    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kw):
        t = query.shape[2]
        outs = []
        for p in range(t):
            lo = max(0, p - sliding_window + 1) if sliding_window else 0
            k_eff = effective_kv(key[0, :, : p + 1], True, p, spec, bs)[None, :, lo:]
            v_eff = effective_kv(value[0, :, : p + 1], False, p, spec, bs)[None, :, lo:]
            kwargs = {k: v for k, v in kw.items() if k in ("softcap",)}
            o, _ = eager(module, query[:, :, p : p + 1], k_eff, v_eff, None, scaling=scaling, dropout=0.0, **kwargs)
            outs.append(o)
        return torch.cat(outs, dim=1), None

    name = f"fq_{family}"
    AttentionInterface.register(name, fn)
    return name


@pytest.mark.parametrize("family", FAMILIES)
def test_default_spec_equals_eager_on_fake_quantized_kv(family):
    # One layer, so both sides quantize bit-identical K/V (with two, 1e-7 differences in layer 1's
    # output can flip a rounding decision in layer 2's quantizer and the comparison would be noise).
    spec = PRESETS["default"]
    ref = tiny_model(family, num_layers=1)
    ref.set_attn_implementation(register_fakequant_eager(family, spec, BS))
    paged = compile(tiny_model(family, num_layers=1), spec, block_size=BS, num_blocks=8, max_seqs=1)
    ids = torch.randint(3, 512, (1, 45), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits
        # 30 tokens of prefill, then 15 single-token steps: tail, sink and quantized blocks all exercised
        table = torch.arange(8)[None]
        got = [paged(ids[:, :30], torch.arange(30), torch.zeros(30, dtype=torch.long), table)]
        for p in range(30, 45):
            got.append(paged(ids[:, p : p + 1], torch.tensor([p]), torch.zeros(1, dtype=torch.long), table))
    got = torch.cat(got, dim=1)
    assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())


# ----------------------------------------------------------------------------------------------
# Preflight


@pytest.mark.parametrize(
    "model_type, extra, needle",
    [
        ("llama4_text", dict(attention_chunk_size=8), "chunked attention"),
        ("bloom", {}, "ALiBi"),
        ("deepseek_v3", dict(kv_lora_rank=16), "MLA"),
        ("gemma3n_text", dict(num_kv_shared_layers=2), "KV-sharing"),
        ("t5", {}, "encoder-decoder"),
        ("falcon_mamba", {}, "not been validated"),
    ],
)
def test_preflight_rejects_unsupported(model_type, extra, needle):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **extra)
    with pytest.raises(UnsupportedModelError, match=needle):
        preflight(cfg)


def test_compile_rejects_bad_spec_before_touching_model():
    from toolkit.errors import SpecError

    model = tiny_model("llama")
    with pytest.raises(SpecError, match="k_group=48 does not divide head_dim=64"):
        compile(model, PRESETS["default"].replace(k_group=48))
    with pytest.raises(SpecError, match="block size 0 is invalid"):
        compile(model, "default", block_size=0)
    assert model.config._attn_implementation == "eager"


def test_model_dims():
    d = model_dims(tiny_config("gpt2"))
    assert (d.num_layers, d.num_heads, d.num_kv_heads, d.head_dim) == (2, 4, 4, 64)
    assert math.isclose(64**-0.5, 0.125)
