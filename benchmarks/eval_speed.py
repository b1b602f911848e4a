"""`pagedkv eval` at native speed vs its reference op, side by side in one run (issue 26, item 7).

    python benchmarks/eval_speed.py            # SmolLM2-135M, wikitext-2, ctx 512 x 8 windows, the default specs

Runs the same teacher-forced evaluation twice in one process on the same model and windows: the op of
every spec row on the C++ core (kernel "native", what `pagedkv eval` runs) and on its plain-PyTorch
definition (kernel "reference", what it ran before). Prints both times, their ratio and the largest
difference of any row's PPL (relative), KLD and top-1 agreement; writes results/eval_speed.json.

The scale those differences must be read against: the run "reference-1ulp" is the reference again with
the token embeddings (tied to the LM head) moved by one float32 ulp. A quantized pool turns any float
difference into some flipped codes, and flips in early layers move every later layer's K/V, so two
correct implementations (or one, with inputs one ulp apart) differ by about the quantization noise
itself; only the fp32 and fp16 rows can agree to float rounding.

The floor: "hf_forward_seconds" is the plain HuggingFace model (its own attention, no pool, no
quantization) over the same windows, timed once and multiplied by the table's rows: every row is one
teacher-forced pass over every window, so no kernel of the op can take the table below it.
"compute_floor_seconds" bounds any engine that keeps the weights' float32 numerics: the table's matmul
FLOPs (every Linear, the LM head included, and causal attention's QK^T and PV) at this machine's best
float32 matmul rate (torch.mm 2048^3, best of 5). "reference_over_5" is the reference run's time over 5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.e2e import cpu_model  # noqa: E402
from toolkit.fidelity import DEFAULT_SPECS, evaluate_ids, tokenize, tokenizer_bos  # noqa: E402

DEFAULT_TEXT = REPO / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def table_flops(model, ctx: int, windows: int, rows: int) -> float:
    """Matmul FLOPs of `rows` teacher-forced passes over `windows` windows of `ctx` tokens."""
    import torch

    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = c.num_hidden_layers * c.num_attention_heads * head_dim * ctx * (ctx + 1)  # QK^T + PV, causal
    return rows * windows * (2.0 * linear * ctx + 2.0 * attention)


def matmul_flops_per_second(n: int = 2048, reps: int = 5) -> float:
    """The best float32 torch.mm rate of n x n x n over reps runs (torch's threads)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="HF dir, .gguf, 'smollm2' (default) or 'gemma3-270m'")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="text file (default: wikitext-2 wiki.test.raw)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, help=f"specs (default {' '.join(DEFAULT_SPECS)})")
    ap.add_argument("--kernels", nargs="+", default=["native", "reference", "reference-1ulp"],
                    choices=["native", "reference", "reference-1ulp"])
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "eval_speed.json")
    a = ap.parse_args(argv)

    import torch

    from toolkit.model_loading import load_model

    model, tokenizer = load_model(a.model)[:2]
    ids = tokenize(tokenizer, a.text.read_text(encoding="utf-8"))
    bos = tokenizer_bos(tokenizer)
    # before evaluate_ids, which compiles the model in place
    rows_n = len(a.specs) + ("fp32" not in a.specs)  # the fp32 reference row is always there
    t0 = time.perf_counter()
    with torch.no_grad():
        for w in range(a.windows):
            model(torch.tensor([ids[w * a.ctx:(w + 1) * a.ctx]]))
    floor = round((time.perf_counter() - t0) * rows_n, 1)
    print(f"the plain HF model over the same windows x {rows_n} rows: {floor:.0f} s", flush=True)
    flops, rate = table_flops(model, a.ctx, a.windows, rows_n), matmul_flops_per_second()
    compute_floor = round(flops / rate, 1)
    print(f"their matmuls: {flops / 1e12:.2f} TFLOP; at the best float32 torch.mm rate here ({rate / 1e9:.0f} GFLOP/s) "
          f"{compute_floor:.0f} s", flush=True)
    runs = {}
    emb = model.get_input_embeddings().weight
    for kernel in a.kernels:
        original = emb.detach().clone()
        if kernel == "reference-1ulp":
            with torch.no_grad():
                emb.copy_(torch.nextafter(original, torch.full_like(original, float("inf"))))
        t0 = time.perf_counter()
        try:
            res = evaluate_ids(model, ids, a.ctx, a.specs, a.windows, model_name=a.model, progress=False, bos_id=bos,
                               kernel=kernel.split("-")[0])
        finally:
            with torch.no_grad():
                emb.copy_(original)
        runs[kernel] = {"seconds": round(time.perf_counter() - t0, 1), "results": res["results"]}
        print(f"{kernel}: {runs[kernel]['seconds']:.0f} s", flush=True)
    out = {"cpu": cpu_model(), "model": a.model, "ctx": a.ctx, "windows": a.windows, "specs": a.specs,
           "torch_threads": torch.get_num_threads(), "load_avg": os.getloadavg(), "runs": runs,
           "hf_forward_seconds": floor, "table_tflop": round(flops / 1e12, 2),
           "matmul_gflops": round(rate / 1e9, 1), "compute_floor_seconds": compute_floor}
    if "reference" in runs:
        out["reference_over_5"] = round(runs["reference"]["seconds"] / 5, 1)
    rows = {k: {r["spec"]: r for r in v["results"]} for k, v in runs.items()}

    def diffs(x: str, y: str) -> dict:
        nx, ny = rows[x], rows[y]
        return {"max_ppl_rel_diff": max(abs(nx[s]["ppl"] / ny[s]["ppl"] - 1) for s in ny),
                "max_kld_diff": max(abs(nx[s]["kld_mean"] - ny[s]["kld_mean"]) for s in ny),
                "max_top1_diff": max(abs(nx[s]["top1_agreement"] - ny[s]["top1_agreement"]) for s in ny)}

    if {"native", "reference"} <= runs.keys():
        out["speedup"] = round(runs["reference"]["seconds"] / runs["native"]["seconds"], 2)
        out["native_vs_reference"] = diffs("native", "reference")
        if "reference-1ulp" in runs:
            out["reference_vs_1ulp"] = diffs("reference-1ulp", "reference")
        print(f"\n{a.model}, ctx {a.ctx} x {a.windows} windows, {len(rows['reference'])} rows, {cpu_model()}, "
              f"{out['torch_threads']} torch threads, load {out['load_avg'][0]:.1f}")
        cols = [k for k in ("native", "reference", "reference-1ulp") if k in runs]
        print("| row | " + " | ".join(f"PPL {k}" for k in cols) + " | " + " | ".join(f"KLD {k}" for k in cols) + " |")
        print("|---|" + "---:|" * (2 * len(cols)))
        for s in rows["reference"]:
            print(f"| {s} | " + " | ".join(str(rows[k][s]["ppl"]) for k in cols) + " | "
                  + " | ".join(f"{rows[k][s]['kld_mean']:.3g}" for k in cols) + " |")
        print(f"\nnative {runs['native']['seconds']:.0f} s, reference {runs['reference']['seconds']:.0f} s: "
              f"{out['speedup']}x; the plain HF model over the same windows and rows {floor:.0f} s; its float32 "
              f"matmuls at this machine's best rate {compute_floor:.0f} s; the reference's time / 5: "
              f"{out['reference_over_5']:.0f} s")
        for key in ("native_vs_reference", "reference_vs_1ulp"):
            if key in out:
                d = out[key]
                print(f"{key}: largest PPL difference {d['max_ppl_rel_diff']:.2e} (relative), KLD "
                      f"{d['max_kld_diff']:.2e}, top-1 {d['max_top1_diff']:.2e}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
