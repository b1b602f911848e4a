"""The compact tier's format, chosen by measurement: blocks older than a recency horizon re-quantized from
the conversation's spec (default K8/V4) to a compact spec, on SmolLM2-135M over a long wikitext-2 stream.

    python benchmarks/compact_tier.py                                  # 8K stream, horizon 1024, all candidates
    python benchmarks/compact_tier.py --ctx 2048 --horizon 512 --out benchmarks/results/compact_tier_2k.json
    python benchmarks/compact_tier.py --candidates k4v3 k3v4 --threads 2
    python benchmarks/compact_tier.py --model gemma3-270m --candidates k4v3 --out benchmarks/results/compact_tier_gemma3.json

Method. One teacher-forced window of --ctx tokens from the start of wikitext-2 (the text, tokenizer and
model of benchmarks/fidelity.py; --model gemma3-270m: Gemma 3 270M, BOS first, its sliding layers attend
within their window in the default spec and never compact, as in the engine). Rows:
- fp32: unquantized attention (the reference of benchmarks/fidelity.py);
- default: every block in the conversation's spec (float16 sink block and own block, as the op reads them);
- one row per candidate: the query at position p reads block b in the compact spec when the engine
  converted it before the step that writes p: between steps, every block b >= sink_blocks whose last
  token is at least --horizon positions behind the newest token held, (b + 1) * bs <= held - horizon,
  with held = p in a decode of one token per step (--step 1, the default; held = the step's first
  position for --step N). Compact blocks are toolkit.quant.requantize of the default spec's records
  (dequantize-then-quantize: the fp values are gone); every other block reads as in `default`.
  One forward pass so measures a whole decode of ctx tokens.
- with --sliding-spec S1 S2 ... (models with sliding layers): each candidate once per S, the sliding
  layers' blocks in spec S instead of the conversation's (S = the conversation's own spec gives the plain
  row): a spec per layer group, which the pool does not have yet; this measures whether one would pay.
The attention is an emulation in this script (toolkit.quant's quantize/dequantize/requantize and
Hadamard rotation; torch's fused CPU attention per key region, merged by log-sum-exp), checked at start
on a short window against the paged ops: all-default against pagedkv::quantized_paged_attention, and the
first candidate against pagedkv::quantized_paged_attention_mixed run the engine's way (calls of --step
64 tokens, aged blocks moved to the compact region with toolkit.quant.compact_block between calls). Bytes per token come from kv_spec.bytes_per_token, except the
per-channel-K candidate (KIVI-like, K scales per channel within a block: no pool format for it exists),
whose bytes are computed here.

Metrics over the ctx-1 next-token predictions: PPL, its change vs all-default (the target: at most
+1% at <= 0.25x fp16 bytes) and vs fp32, KLD(default || row) and top-1 agreement with default, and
KLD vs fp32. Writes benchmarks/results/compact_tier.json (after every row) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.e2e import cpu_model  # noqa: E402
from toolkit.kv_spec import KVQuantSpec, bytes_per_token, fp16_bytes_per_token, resolve_spec  # noqa: E402
from toolkit.kv_spec import record_layout  # noqa: E402
from toolkit.quant import dequantize, fake_quantize, hadamard, quantize, requantize  # noqa: E402

DEFAULT_TEXT = REPO / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
ATTN_NAME = "pagedkv_compact_tier_bench"

# Compact candidates over the default spec (rotation must match the conversation's: Q is rotated once
# per call). Bytes per head-token at head_dim 64: fp16 = 256, the target 0.25x = 64.
CANDIDATES: dict[str, str] = {
    "k4v2": "default:k_bits=4,k_group=64,k_sym=true,v_bits=2,v_group=32,v_sym=false",
    "k4v2-g64": "default:k_bits=4,k_group=64,k_sym=true,v_bits=2,v_group=64,v_sym=false",
    "k4v2-g128": "default:k_bits=4,k_group=128,k_sym=true,v_bits=2,v_group=128,v_sym=false",  # head_dim >= 128
    "k4v2-g256": "default:k_bits=4,k_group=256,k_sym=true,v_bits=2,v_group=256,v_sym=false",  # head_dim 256 (Gemma)
    "k3v3": "default:k_bits=3,k_group=64,k_sym=true,v_bits=3,v_group=32,v_sym=false",
    "k3v3-g64": "default:k_bits=3,k_group=64,k_sym=true,v_bits=3,v_group=64,v_sym=false",
    "k4v3": "default:k_bits=4,k_group=64,k_sym=true,v_bits=3,v_group=64,v_sym=false",
    "k4v3-vsym": "default:k_bits=4,k_group=64,k_sym=true,v_bits=3,v_group=64,v_sym=true",
    "k3v4": "default:k_bits=3,k_group=64,k_sym=true,v_bits=4,v_group=64,v_sym=false",
    "k5v2": "default:k_bits=5,k_group=64,k_sym=true,v_bits=2,v_group=64,v_sym=false",
    "k4v3-kg32": "default:k_bits=4,k_group=32,k_sym=true,v_bits=3,v_group=64,v_sym=true",
    "k5v3": "default:k_bits=5,k_group=64,k_sym=true,v_bits=3,v_group=64,v_sym=true",
    "k4v4": "k4v4",
    "k3v2": "default:k_bits=3,k_group=64,k_sym=true,v_bits=2,v_group=64,v_sym=false",  # sub-4-bit for Gemma 32K 0.5x
    # KIVI-like: K asymmetric per channel within each block (scale + zero per channel per block), V per token
    "kivi-k3v3": "kivi:k_bits=3,v_bits=3,v_group=64,v_sym=false",
    "kivi-k4v2": "kivi:k_bits=4,v_bits=2,v_group=64,v_sym=false",
}


@dataclass
class Row:
    name: str
    spec: KVQuantSpec | None  # the compact spec (None: fp32 / default rows, or a KIVI row's V spec below)
    kivi_k_bits: int = 0  # > 0: K per channel within a block (no pool format), V from spec
    sliding: KVQuantSpec | None = None  # --sliding-spec: the sliding layers' spec in this row (None: default)
    sliding_name: str = ""

    @property
    def compact(self) -> bool:
        return self.spec is not None or self.kivi_k_bits > 0


def parse_candidate(name: str) -> Row:
    text = CANDIDATES.get(name, name)
    if text.startswith("kivi:"):
        fields = dict(item.split("=") for item in text[5:].split(","))
        kb = int(fields.pop("k_bits"))
        return Row(name, resolve_spec("default:" + ",".join(f"{k}={v}" for k, v in fields.items())), kb)
    return Row(name, resolve_spec(text))


def row_bytes_vs_fp16(row: Row, default: KVQuantSpec, hkv: int, d: int, layers: int, bs: int) -> float:
    fp16 = fp16_bytes_per_token(hkv, d, layers)
    if not row.compact:
        spec = KVQuantSpec(32, 32, 0, 0, True, True, False, False, 0) if row.name == "fp32" else default
        return bytes_per_token(spec, hkv, d, layers) / fp16
    if row.kivi_k_bits:
        v = row.spec
        v_bytes = d * v.v_bits // 8 + 2 * (d // (v.v_group or d)) * (1 if v.v_sym else 2)
        k_bytes = d * row.kivi_k_bits // 8 + 2 * 2 * d / bs  # fp16 scale + zero per channel per block
        return (k_bytes + v_bytes) * hkv * layers / fp16
    return bytes_per_token(row.spec, hkv, d, layers) / fp16


def kivi_fake_quantize(x: torch.Tensor, bits: int, bs: int) -> torch.Tensor:
    """x [H, T, D] -> per channel within each block of bs tokens, asymmetric (quant.py's rule on groups
    that run along the tokens of a block instead of along head_dim). A last partial block is its own group."""
    h, t, d = x.shape
    pad = (-t) % bs
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad))
    g = xp.reshape(h, -1, bs, d).transpose(-1, -2)  # [H, blocks, D, bs]: groups of one channel in a block
    if pad:  # the padded rows must not widen the last block's range: repeat its last real token there
        g = g.clone()
        last = x[:, -1, :]
        g[:, -1, :, bs - pad:] = last[:, :, None]
    out = fake_quantize(g.contiguous(), bits, bs, False)
    return out.transpose(-1, -2).reshape(h, -1, d)[:, :t]


# ----------------------------------------------------------------------------------------------
# The emulated attention (registered with transformers' AttentionInterface, selected per run)


class Mode:
    kind = "fp32"  # "fp32" | "default" | "compact"
    default: KVQuantSpec = resolve_spec("default")
    row: Row | None = None
    horizon = 1024
    step = 1  # tokens per engine step (1: a decode)
    block_size = 16
    chunk = 512
    key_offsets: list | None = None  # per layer [Hkv, D]: subtracted from the quantized rows' keys, as export does


def stored(x: torch.Tensor, spec: KVQuantSpec, d: int):
    """K or V [H, T, D] (rotated) -> the records the op writes for it (K and V halves of a record)."""
    kg, vg = spec.groups(d)
    kc, km = quantize(x[0], spec.k_bits, kg, spec.k_sym)
    vc, vm = quantize(x[1], spec.v_bits, vg, spec.v_sym)
    return torch.cat((kc, vc), -1), torch.cat((km, vm), -1)


def read_back(codes: torch.Tensor, scales: torch.Tensor, spec: KVQuantSpec, d: int):
    """Records -> the dequantized (K, V) attention reads."""
    rec = record_layout(spec, d)
    kg, vg = spec.groups(d)
    k = dequantize(codes[..., :rec.k_code_bytes], scales[..., :rec.k_scale_count], spec.k_bits, kg, spec.k_sym, d)
    v = dequantize(codes[..., rec.k_code_bytes:], scales[..., rec.k_scale_count:], spec.v_bits, vg, spec.v_sym, d)
    return k, v


def column_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The [lo, hi) runs of columns of a [n, L] mask that hold any True."""
    used = mask.any(0).tolist()
    runs, lo = [], None
    for i, u in enumerate(used + [False]):
        if u and lo is None:
            lo = i
        elif not u and lo is not None:
            runs.append((lo, i))
            lo = None
    return runs


def attend_parts(qa: torch.Tensor, parts: list, scale: float) -> torch.Tensor:
    """qa [Hkv, grp, n, D]; parts: [(mask [n, L], K [Hkv, L, D], V [Hkv, L, D])] over disjoint key sets.
    One softmax over their union: torch's fused CPU attention per column run of each part (output and
    log-sum-exp), merged by log-sum-exp. Queries of a KV head's group are stacked as rows (GQA)."""
    hkv, grp, n, d = qa.shape
    q = qa.reshape(1, hkv, grp * n, d)
    outs, lses = [], []
    for m, kk, vv in parts:
        for lo, hi in column_runs(m):
            mm = m[:, lo:hi]
            add = torch.zeros(mm.shape).masked_fill(~mm, float("-inf")).repeat(grp, 1)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, kk[None, :, lo:hi], vv[None, :, lo:hi], 0.0, False, attn_mask=add, scale=scale)[:2]
            none = ~mm.any(1).repeat(grp)  # rows with no key in this run (reported as lse 0, output 0)
            lses.append(lse.masked_fill(none, float("-inf")))
            outs.append(o)
    lse = torch.logsumexp(torch.stack(lses), 0)
    out = sum(torch.exp(lv - lse)[..., None] * o for lv, o in zip(lses, outs))
    return out.reshape(hkv, grp, n, d)


def emulated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                       softcap=None, **kwargs):
    d = query.shape[-1]
    scale = scaling if scaling is not None else d ** -0.5
    if softcap:
        raise SystemExit("this emulation has no attention softcap: the model needs the paged op's path")
    window = sliding_window or 0  # a sliding layer (Gemma 3): keys p - j < window only, never compact
    q, k, v = query[0].float(), key[0].float(), value[0].float()  # [H, T, D]
    hq, t, _ = q.shape
    hkv = k.shape[0]
    grp = hq // hkv
    if Mode.kind == "fp32":
        tq = torch.arange(t)
        keep = (tq[None, :] <= tq[:, None]) & ((tq[:, None] - tq[None, :] < window) if window else True)
        out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=keep, scale=scale,
                                                               enable_gqa=True)[0]
        return out.transpose(0, 1)[None].to(query.dtype), None
    row = Mode.row
    if Mode.key_offsets is not None:  # exact for the attention (toolkit/key_offsets.py)
        k = k - Mode.key_offsets[module.layer_idx][:, None, :]
    spec, bs = Mode.default, Mode.block_size
    if window and Mode.kind == "compact" and row.sliding is not None:  # a per-group spec (--sliding-spec)
        spec = row.sliding
    if spec.rotate:
        q, k, v = hadamard(q), hadamard(k), hadamard(v)
    k16, v16 = k.half().float(), v.half().float()
    codes, scales = stored((k, v), spec, d)
    kd, vd = read_back(codes, scales, spec, d)
    compact = Mode.kind == "compact" and not window  # the compact tier is the global layers' only
    if compact:  # the compact tier: toolkit.quant.requantize of the stored records, read back
        ccodes, cscales = requantize(codes, scales, spec, row.spec, d)
        kc, vc = read_back(ccodes, cscales, row.spec, d)
        if row.kivi_k_bits:  # K per channel within a block instead (no pool format: emulated here)
            kc = kivi_fake_quantize(kd, row.kivi_k_bits, bs)
    out = torch.empty(hkv, grp, t, d)
    qg = q.reshape(hkv, grp, t, d)
    for a in range(0, t, Mode.chunk):
        n = min(Mode.chunk, t - a)
        keys = a + n
        p = torch.arange(a, a + n)[:, None]
        j = torch.arange(keys)[None, :]
        causal = (j <= p) & ((p - j < window) if window else True)
        bj, bp = j // bs, p // bs
        fp = torch.zeros_like(causal)
        if spec.sink_blocks:
            fp = fp | (bj < spec.sink_blocks)
        if spec.fp_tail:
            fp = fp | (bj == bp)
        fp = fp & causal
        held = (p // Mode.step) * Mode.step  # tokens in the pool when the step writing p converted blocks
        cm = (causal & ~fp & ((bj + 1) * bs <= held - Mode.horizon)) if compact else torch.zeros_like(causal)
        dm = causal & ~fp & ~cm
        qa = qg[:, :, a:a + n]  # [Hkv, grp, n, D]
        # each key version only over the column runs its mask uses (the compact run is most of a long
        # context: computing every version over every key would triple the work)
        parts = [(dm, kd, vd), (fp, k16, v16)] + ([(cm, kc, vc)] if compact else [])
        o = attend_parts(qa, parts, scale)
        out[:, :, a:a + n] = o
    out = out.reshape(hq, t, d)
    if spec.rotate:
        out = hadamard(out)
    return out.transpose(0, 1)[None].to(query.dtype), None


def hidden_states(model, ids: torch.Tensor) -> torch.Tensor:
    t = ids.numel()
    with torch.no_grad():
        out = model.model(input_ids=ids[None], position_ids=torch.arange(t)[None], use_cache=False)
    return out.last_hidden_state[0]


def logprobs(model, h: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model.lm_head(h).float(), dim=-1)


def score(model, h: torch.Tensor, refs: dict, target: torch.Tensor, rows: int = 1024) -> dict:
    """NLL sum, and KLD(ref || h) sums and top-1 agreements vs each reference's hidden states, in row
    chunks (an 8K x 49K logits matrix is 1.6 GB)."""
    n = target.numel()
    nll, kld, agree = 0.0, {r: 0.0 for r in refs}, {r: 0 for r in refs}
    for a in range(0, n, rows):
        lp = logprobs(model, h[a:a + min(rows, n - a)])
        nll += float(-lp.gather(1, target[a:a + lp.shape[0], None]).sum(dtype=torch.float64))
        top = lp.argmax(-1)
        for r, hr in refs.items():
            rp = logprobs(model, hr[a:a + lp.shape[0]])
            kld[r] += float((rp.exp() * (rp - lp)).sum(dtype=torch.float64))
            agree[r] += int((rp.argmax(-1) == top).sum())
    return {"nll": nll, "kld": kld, "agree": agree, "n": n}


def check_against_op(model, ids: torch.Tensor, bs: int, spec: KVQuantSpec, n: int = 256) -> float:
    """KLD(op || emulation) of this script's all-default emulation against the paged op (its PyTorch
    reference) on the first n tokens: the emulation must be the op's arithmetic up to float rounding (a
    rounding difference can flip a code, so it is not 0: the native kernel vs the reference measured the
    same size on this window, KLD ~1e-4, against ~8e-4 for default vs fp32)."""
    from toolkit.compiler import compile

    w = ids[:n]
    Mode.kind = "default"
    model.set_attn_implementation(ATTN_NAME)
    mine = logprobs(model, hidden_states(model, w))
    paged = compile(model, spec, block_size=bs, num_blocks=-(-n // bs), max_seqs=1, groups=False,
                    key_offsets=Mode.key_offsets)
    with torch.no_grad():
        theirs = paged(w[None], torch.arange(n), torch.zeros(n, dtype=torch.int64),
                       torch.arange(-(-n // bs))[None])[0].float()
    theirs = torch.log_softmax(theirs, -1)
    model.set_attn_implementation(ATTN_NAME)  # compile() selected the op's attention
    return float((theirs.exp() * (theirs - mine)).sum(-1).mean())


def global_layers(config) -> list[int]:
    """Layers attending to the whole context (the compact tier's); Gemma 3's sliding layers are not."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [i for i, t in enumerate(types) if t != "sliding_attention"]


def compact_label(r: Row) -> str:
    if not r.compact:
        return "-"
    if r.kivi_k_bits:
        return f"K{r.kivi_k_bits}a per-channel/block {r.spec.describe().split(' ')[1]}"
    return " ".join(x for x in r.spec.describe().split(" ") if x not in ("tail", "sink"))


class OpRun:
    """State of the engine-style run through the mixed op: per layer (codes, scales, stage, compact_codes,
    compact_scales), the block table, the call's positions."""
    pools: list = []
    table = None
    plain_table = None
    positions = None
    layout = None


def op_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                 **kwargs):
    from toolkit.compiler import op_scalar_args

    lay, d = OpRun.layout, query.shape[-1]
    window = sliding_window or 0  # a sliding layer reads its own blocks (never compact), within its window
    table = OpRun.plain_table if window else OpRun.table
    scale = scaling if scaling is not None else d ** -0.5
    codes, scales, stage, ccodes, cscales = OpRun.pools[module.layer_idx]
    c = lay.compact
    ckg, cvg = c.groups(d)
    t = OpRun.positions.numel()
    if Mode.key_offsets is not None:
        key = key - Mode.key_offsets[module.layer_idx][None, :, None, :]
    out = torch.ops.pagedkv.quantized_paged_attention_mixed(
        query, key, value, codes, scales, stage, ccodes, cscales, OpRun.positions, torch.zeros(t, dtype=torch.int64),
        table[None], torch.full((query.shape[1],), float("-inf")),
        *op_scalar_args(lay.spec, d, module.layer_idx, scale, window, 0.0), c.k_bits, c.v_bits, ckg, cvg, c.k_sym, c.v_sym)
    return out.to(query.dtype), None


def check_mixed_op(model, ids: torch.Tensor, row: Row, n: int, horizon: int, step: int, bs: int) -> float:
    """KLD(mixed op || emulation) over n tokens, both the engine's way: calls of `step` tokens through
    pagedkv::quantized_paged_attention_mixed (its PyTorch reference), and before each call every block
    past the horizon moved to the compact region by toolkit.quant.compact_block, the table pointed there."""
    from transformers import AttentionInterface

    from toolkit.compiler import model_dims
    from toolkit.pool_layout import PoolLayout
    from toolkit.quant import compact_block

    dims = model_dims(model.config)
    nb = -(-n // bs)
    lay = PoolLayout(Mode.default, dims.num_layers, dims.num_kv_heads, dims.head_dim, bs, nb, 1,
                     compact=row.spec, num_compact_blocks=nb)
    OpRun.layout = lay
    OpRun.pools = [(*lay.allocate_layer(), *lay.allocate_compact_layer()) for _ in range(dims.num_layers)]
    OpRun.table = torch.arange(nb)
    OpRun.plain_table = torch.arange(nb)  # sliding layers' table: their blocks stay where they are
    glob = global_layers(model.config)
    AttentionInterface.register(ATTN_NAME + "_op", op_attention)
    model.set_attn_implementation(ATTN_NAME + "_op")
    w, logits, used = ids[:n], [], 0
    with torch.no_grad():
        for a in range(0, n, step):
            for b in range(Mode.default.sink_blocks, nb):  # between steps: convert what passed the horizon
                if (b + 1) * bs <= a - horizon and OpRun.table[b] < nb:
                    for layer in (OpRun.pools[i] for i in glob):
                        compact_block(layer[0], layer[1], layer[3], layer[4], int(OpRun.table[b]), used,
                                      Mode.default, row.spec, dims.head_dim)
                    OpRun.table[b] = nb + used
                    used += 1
            OpRun.positions = torch.arange(a, min(a + step, n))
            h = model.model(input_ids=w[None, a:a + step], position_ids=OpRun.positions[None], use_cache=False)
            logits.append(logprobs(model, h.last_hidden_state[0]))
    theirs = torch.cat(logits)
    Mode.kind, Mode.row, old = "compact", row, (Mode.horizon, Mode.step, Mode.chunk)
    Mode.horizon, Mode.step = horizon, step
    model.set_attn_implementation(ATTN_NAME)
    mine = logprobs(model, hidden_states(model, w))
    Mode.chunk = 48  # the same emulation with other query chunks: only float summation order changes
    other = logprobs(model, hidden_states(model, w))
    Mode.horizon, Mode.step, Mode.chunk = old
    assert used > 0, "the check window converted no block: lengthen it"
    return (float((theirs.exp() * (theirs - mine)).sum(-1).mean()),
            float((mine.exp() * (mine - other)).sum(-1).mean()))


def fmt_table(rows: list[dict]) -> str:
    head = ("candidate", "compact spec", "bytes vs fp16", "PPL", "PPL vs default", "KLD vs default",
            "top-1 vs default", "PPL vs fp32", "KLD vs fp32")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        lines.append("| " + " | ".join([
            r["candidate"], r["compact_spec"], f"{r['bytes_per_token_vs_fp16']:.3f}x", f"{r['ppl']:.3f}",
            f"{r['ppl_vs_default_pct']:+.3f}%", f"{r['kld_vs_default']:.5f}", f"{100 * r['top1_vs_default']:.2f}%",
            f"{r['ppl_vs_fp32_pct']:+.3f}%", f"{r['kld_vs_fp32']:.5f}",
        ]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="'smollm2' (default), 'gemma3-270m' or an HF dir")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=8192, help="stream length in tokens (default 8192)")
    ap.add_argument("--horizon", type=int, default=1024, help="blocks older than this many tokens are compact")
    ap.add_argument("--spec", default=None, help="the conversation's spec (default: the model's default preset)")
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES),
                    help=f"compact candidates: names ({', '.join(CANDIDATES)}) or spec text")
    ap.add_argument("--sliding-spec", nargs="+", default=None, metavar="SPEC",
                    help="measure each candidate once per SPEC, the sliding layers in that spec (a per-layer-group "
                         "spec, emulated here only; default: the sliding layers keep the conversation's spec)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--step", type=int, default=1, help="tokens per engine step: blocks convert between steps (1)")
    ap.add_argument("--chunk", type=int, default=256, help="queries per attention chunk (memory)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-check", action="store_true", help="skip the emulation-vs-op check")
    ap.add_argument("--no-key-offsets", action="store_true",
                    help="keep the keys as they are (default: subtract the key offsets export calibrates)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "compact_tier.json")
    args = ap.parse_args(argv)
    if not args.text.is_file():
        ap.error(f"text file {args.text} not found: pass --text FILE")
    torch.set_num_threads(args.threads)

    from transformers import AttentionInterface

    from toolkit.compiler import model_dims
    from toolkit.fidelity import tokenize, tokenizer_bos
    from toolkit.model_loading import load_model

    model, tokenizer = load_model(args.model)
    model.eval()
    dims = model_dims(model.config)
    default = resolve_spec(args.spec or "default").validate(dims.head_dim)
    rows = [Row("fp32", None), Row("default", None)] + [parse_candidate(c) for c in args.candidates]
    if args.sliding_spec:
        if not global_layers(model.config) or len(global_layers(model.config)) == dims.num_layers:
            ap.error(f"--sliding-spec: {args.model} has no sliding layers")
        rows = rows[:2] + [dataclasses.replace(r, name=f"{r.name} + sliding {s}", sliding=resolve_spec(s),
                                               sliding_name=s) for r in rows[2:] for s in args.sliding_spec]
    for r in rows:
        for sp in (r.spec, r.sliding):
            if sp is None:
                continue
            sp.validate(dims.head_dim)
            if sp.rotate != default.rotate or sp.sink_blocks != default.sink_blocks or sp.fp_tail != default.fp_tail:
                ap.error(f"row {r.name}: rotate/sink_blocks/fp_tail of {sp.describe()} differ from the conversation "
                         f"spec's ({default.describe()})")
    ids = torch.tensor(tokenize(tokenizer, args.text.read_text(encoding="utf-8"))[:args.ctx], dtype=torch.int64)
    bos = tokenizer_bos(tokenizer)
    if bos is not None:
        ids[0] = bos
    if ids.numel() < args.ctx or (not args.no_check and args.ctx < 768):
        ap.error(f"--ctx {args.ctx}: the text has {ids.numel()} tokens, the checks need 768 (or pass --no-check)")
    target = ids[1:]

    if not args.no_key_offsets:
        from toolkit.calibration import calibration_ids
        from toolkit.key_offsets import measure_key_offsets

        Mode.key_offsets = measure_key_offsets(model, calibration_ids(tokenizer)[0])
    AttentionInterface.register(ATTN_NAME, emulated_attention)
    Mode.default, Mode.horizon, Mode.block_size, Mode.chunk = default, args.horizon, args.block_size, args.chunk
    Mode.step = args.step
    report = {
        "model": args.model, "text": args.text.name, "ctx": args.ctx, "horizon": args.horizon, "step": args.step,
        "block_size": args.block_size, "default_spec": default.describe(), "torch_threads": args.threads,
        "compact_layers": f"{len(global_layers(model.config))} of {dims.num_layers} (the global ones; sliding layers "
                          "keep their window in the default spec; bytes_per_token_vs_fp16 is a global layer's)",
        "cpu": cpu_model(),
        "method": "one teacher-forced window from the start; the query at p reads in the compact spec the blocks "
                  "(never the sink block or its own) whose last token was >= horizon behind the newest token held "
                  "when the engine step writing p converted blocks (held = p for step 1); compact records = "
                  "toolkit.quant.requantize of the default records; emulated attention, checked against the ops",
        "rows": [],
    }
    if not args.no_check:
        report["check_kld_op_vs_emulation_256"] = check_against_op(model, ids, args.block_size, default)
        print(f"check: KLD(paged op || emulated default), first 256 tokens: "
              f"{report['check_kld_op_vs_emulation_256']:.2e}", file=sys.stderr, flush=True)
        first = next((r for r in rows if r.compact and not r.kivi_k_bits), None)
        if first is not None:
            n, hz, st = 768, 256, 64
            kld, floor = check_mixed_op(model, ids, first, n, hz, st, args.block_size)
            report["check_mixed_op"] = {"candidate": first.name, "tokens": n, "horizon": hz, "step": st,
                                        "kld_op_vs_emulation": kld, "kld_emulation_rechunked": floor}
            print(f"check: KLD(mixed op, engine steps of {st} || emulation), {first.name}, {n} tokens, horizon {hz}: "
                  f"{kld:.2e}; the emulation against itself with other query chunks (float rounding only): "
                  f"{floor:.2e}", file=sys.stderr, flush=True)
    model.set_attn_implementation(ATTN_NAME)

    hs: dict[str, torch.Tensor] = {}
    out_rows = []
    for r in rows:
        t0 = time.perf_counter()
        Mode.kind = "fp32" if r.name == "fp32" else ("compact" if r.compact else "default")
        Mode.row = r
        h = hidden_states(model, ids)
        if r.name in ("fp32", "default"):
            hs[r.name] = h
        res = score(model, h, hs, target)
        ppl = float(torch.exp(torch.tensor(res["nll"] / res["n"])))
        seconds = time.perf_counter() - t0
        entry = {
            "candidate": r.name,
            "compact_spec": compact_label(r),
            **({} if r.sliding is None else {
                "sliding_spec": r.sliding_name, "sliding_spec_fields": r.sliding.__dict__,
                "sliding_bytes_per_token_vs_fp16": round(bytes_per_token(r.sliding, dims.num_kv_heads, dims.head_dim)
                                                         / fp16_bytes_per_token(dims.num_kv_heads, dims.head_dim), 4)}),
            "spec_fields": None if r.spec is None else r.spec.__dict__ | ({"kivi_k_bits": r.kivi_k_bits} if r.kivi_k_bits else {}),
            "bytes_per_token_vs_fp16": round(row_bytes_vs_fp16(r, default, dims.num_kv_heads, dims.head_dim,
                                                               dims.num_layers, args.block_size), 4),
            "ppl": round(ppl, 4),
            "nll_sum": res["nll"], "predictions": res["n"], "seconds": round(seconds, 1),
        }
        for ref in ("default", "fp32"):
            if ref in res["kld"]:
                entry[f"kld_vs_{ref}"] = float(f"{res['kld'][ref] / res['n']:.6g}")
                entry[f"top1_vs_{ref}"] = round(res["agree"][ref] / res["n"], 5)
        out_rows.append(entry)
        base = {x["candidate"]: x["ppl"] for x in out_rows}
        for e in out_rows:
            e["ppl_vs_fp32_pct"] = round((e["ppl"] / base["fp32"] - 1) * 100, 4)
            e["ppl_vs_default_pct"] = round((e["ppl"] / base.get("default", e["ppl"]) - 1) * 100, 4)
            e.setdefault("kld_vs_default", 0.0)
            e.setdefault("top1_vs_default", 1.0)
            e.setdefault("kld_vs_fp32", 0.0)
            e.setdefault("top1_vs_fp32", 1.0)
        report["rows"] = out_rows
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"{r.name}: PPL {ppl:.4f} ({seconds:.0f} s)", file=sys.stderr, flush=True)
    print(f"\n### {args.model}, ctx {args.ctx}, horizon {args.horizon}, default {default.describe()}\n")
    print(fmt_table(out_rows))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
