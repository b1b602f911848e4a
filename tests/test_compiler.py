"""The compiler step on tiny random models of all supported families, against unmodified HF."""

import math

import pytest
import torch

from transformers import AttentionInterface

from toolkit.compiler import compile, model_dims, preflight
from toolkit.errors import UnsupportedModelError
from toolkit.quant import PRESETS, hadamard
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
    # one block table for all layers (tests/test_groups.py covers per-group tables)
    paged = compile(tiny_model(family), "fp32", block_size=BS, num_blocks=16, max_seqs=2, groups=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (37,), generator=g).tolist(), torch.randint(3, 512, (19,), generator=g).tolist()]
    steps = 34
    got = paged_greedy_batch(paged, prompts, steps, first_chunk=21)
    for s in (0, 1):
        assert got[s] == hf_greedy(ref, prompts[s], steps), f"{family}: sequence {s} diverged from HF"


# ----------------------------------------------------------------------------------------------
# Quantized pool vs HF eager attention on the K/V the op stored
#
# The eager side attends over exactly what the op wrote: the quantized records read back from the
# pool and dequantized, and the float16 sink/tail copies read back from the stage. Quantizing K/V
# independently on the eager side would not do: a 1-ulp difference in a projection or a rotation
# (CPU kernels round differently for different shapes and instruction sets) flips a quantization code.


def stored_kv(layout, pools, table, p):
    """The K and V [Hkv, p+1, D] (unrotated) that the op lets a query at position p of sequence 0 see,
    read back from the pool as it stands after the call that wrote position p."""
    from toolkit.quant import dequantize

    spec, bs, d = layout.spec, layout.block_size, layout.head_dim
    codes, scales, stage = pools
    kg, vg = spec.groups(d)
    kcb = d * spec.k_bits // 8
    ksc = (d // kg) * (1 if spec.k_sym else 2)
    j = torch.arange(p + 1)
    rec = codes[table[j // bs], :, j % bs].transpose(0, 1)  # [Hkv, p+1, code_width]
    meta = scales[table[j // bs], :, j % bs].transpose(0, 1)
    k = dequantize(rec[..., :kcb], meta[..., :ksc], spec.k_bits, kg, spec.k_sym, d)
    v = dequantize(rec[..., kcb:], meta[..., ksc:], spec.v_bits, vg, spec.v_sym, d)
    tail = (j // bs == p // bs) if spec.fp_tail else torch.zeros_like(j, dtype=torch.bool)
    sink = (j < bs * spec.sink_blocks)
    for x, kv in ((k, 0), (v, 1)):
        x[:, tail] = stage[0, 1, kv][:, j[tail] % bs].float()
        x[:, sink] = stage[0, 0, kv][:, j[sink] % bs].float()  # the sink wins over the tail
    rot = hadamard if spec.rotate else (lambda y: y)
    return rot(k), rot(v)


def register_stored_kv_eager(family, snapshots):
    """An attention function that runs the family's own eager attention per query, on stored_kv.
    snapshots[layer][p] = (layout, pools, table) of that layer as they were after the call that wrote
    position p."""
    import importlib

    mod_name = {"gemma3": "gemma3"}.get(family, family)
    eager = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}").eager_attention_forward

    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kw):
        t = query.shape[2]
        outs = []
        for p in range(t):
            lo = max(0, p - sliding_window + 1) if sliding_window else 0
            k_eff, v_eff = stored_kv(*snapshots[module.layer_idx][p], p)
            kwargs = {k: v for k, v in kw.items() if k in ("softcap",)}
            o, _ = eager(module, query[:, :, p : p + 1], k_eff[None, :, lo:], v_eff[None, :, lo:], None,
                         scaling=scaling, dropout=0.0, **kwargs)
            outs.append(o)
        return torch.cat(outs, dim=1), None

    name = f"stored_kv_{family}"
    AttentionInterface.register(name, fn)
    return name


@pytest.mark.parametrize("family", FAMILIES)
def test_default_spec_equals_eager_on_stored_kv(family):
    # One layer: the eager side then sees the same hidden states up to float noise, and the only
    # quantized data it uses is what the op stored.
    spec = PRESETS["default"]
    assert spec.fp_tail and spec.sink_blocks == 1 and BS < 30  # the calls below exercise sink, tail and codes
    paged = compile(tiny_model(family, num_layers=1), spec, block_size=BS, num_blocks=8, max_seqs=1, groups=False)
    ids = torch.randint(3, 512, (1, 45), generator=torch.Generator().manual_seed(2))
    table = torch.arange(8)[None]
    snapshots = {0: {}}
    got = []
    with torch.no_grad():
        # 30 tokens of prefill, then 15 single-token steps: tail, sink and quantized blocks all exercised
        for lo, hi in [(0, 30)] + [(p, p + 1) for p in range(30, 45)]:
            got.append(paged(ids[:, lo:hi], torch.arange(lo, hi), torch.zeros(hi - lo, dtype=torch.long), table))
            pools = tuple(x.clone() for x in paged.pool_tensors()[0])
            for p in range(lo, hi):
                snapshots[0][p] = (paged.layout, pools, table[0])
        ref = tiny_model(family, num_layers=1)
        ref.set_attn_implementation(register_stored_kv_eager(family, snapshots))
        want = ref(ids, use_cache=False).logits
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
