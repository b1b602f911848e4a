"""What each part of a .pte weight format costs, in eager PyTorch: SmolLM2-135M-Instruct on wikitext-2.

    python benchmarks/pte_weights_eager.py                 # ctx 512 x 4 windows
    python benchmarks/pte_weights_eager.py --windows 8

Each row quantizes a fresh copy of the HF model (fp32 attention, no KV pool) with export's own
quantizers (export/executorch_export.py) or one part of them, and scores teacher-forced windows from
the start of the text against the fp32 model (PPL, KLD, top-1 agreement, as benchmarks/fidelity.py).
Cheap (minutes) where an export takes half an hour: it ranks the parts. The exported programs are
scored by benchmarks/weights_fidelity.py --backend executorch. Rows:
  8da4w-e8                   the .pte format 8da4w-e8 (torchao 8da4w linears and head, int8 table)
  int4-sym-linears           only the linears' weights as 8da4w stores them (symmetric int4, blocks of
                             32), fp32 activations, head fp32
  int4-sym-head              only the tied head's weights, symmetric int4
  int8-act-per-token         only XNNPACK's dynamic activation quantization (int8, one scale per token)
                             before every linear and the head, fp32 weights
  int8-table                 only the token table as int8 (a scale per row)
  8da4w-asym-e8h8-per-token  the new format with one activation scale per token (no chunks)
  8da4w-asym-e8h8-uncapped   the format with a scale per 192 inputs on every linear (no piece cap)
  8da4w-asym-e8h8-uncalibrated  without the calibration inputs: int4 for every linear but the head
  8da4w-asym-e8h8            the .pte format 8da4w-asym-e8h8 (int8 linears chosen on the calibration
                             inputs: export/linear_inputs.py) (chunks of 192 inputs, at most
                             MAX_ACT_PIECES per linear: export.executorch_export.act_chunk)
Writes benchmarks/results/pte_weights_eager.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.e2e import cpu_model  # noqa: E402

DEFAULT_TEXT = REPO / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
ROWS = ("8da4w-e8", "int4-sym-linears", "int4-sym-head", "int8-act-per-token", "int8-table",
        "8da4w-asym-e8h8-per-token", "8da4w-asym-e8h8-uncapped", "8da4w-asym-e8h8-uncalibrated", "8da4w-asym-e8h8")


def act_int8_per_token(x):
    """Quantize-dequantize x as XNNPACK's dynamic quantization does: int8, asymmetric, one scale per row."""
    import torch

    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=1e-12)
    zp = (-128 - torch.round(lo / scale)).clamp(-128, 127)
    return (torch.clamp(torch.round(x / scale) + zp, -128, 127) - zp) * scale


def variant(model, name: str, linear_inputs=None, max_pieces: int | None = None):
    """A quantized copy of model for row `name`."""
    import torch
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    from export import executorch_export as ee

    m = copy.deepcopy(model)
    head = m.get_output_embeddings()
    if name == "8da4w-e8":
        ee._quantize_8da4w(m)
        ee._quantize_embeddings_int8(m)
    elif name in ("int4-sym-linears", "int4-sym-head"):
        pick = (lambda mod: mod is not head) if name == "int4-sym-linears" else (lambda mod: mod is head)
        quantize_(m, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
                  filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and pick(mod))
    elif name == "int8-act-per-token":
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.register_forward_pre_hook(lambda _mod, args: (act_int8_per_token(args[0]),) + args[1:])
    elif name == "int8-table":
        ee._quantize_embeddings_int8(m)
    elif name.startswith("8da4w-asym-e8h8"):
        # the export's int8 choice by its calibration inputs; -uncalibrated: none (int4 linears)
        inputs = None if name.endswith("uncalibrated") else linear_inputs
        if name.endswith("per-token"):
            ee._quantize_asym4(m, chunk=1 << 30, inputs=inputs)
        else:  # -uncapped: a scale per ACT_CHUNK inputs however many pieces a linear gets
            pieces = 1 << 30 if name.endswith("uncapped") else max_pieces or ee.MAX_ACT_PIECES
            info = ee._quantize_asym4(m, max_pieces=pieces, inputs=inputs)
            print(f"{name}: {info}", file=sys.stderr)
        ee._quantize_embeddings_int8(m)
    else:
        raise ValueError(name)
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="HF dir, .gguf or 'smollm2' (default)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-pieces", type=int, default=None,
                    help="activation chunks per linear of the 8da4w-asym-e8h8 rows (default MAX_ACT_PIECES)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "pte_weights_eager.json")
    args = ap.parse_args(argv)
    if not args.text.is_file():
        ap.error(f"text file {args.text} not found: pass --text FILE")

    import torch

    from export.executorch_export import MAX_ACT_PIECES
    from toolkit.fidelity import tokenize
    from toolkit.model_loading import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    model.eval()
    ids = torch.tensor(tokenize(tokenizer, args.text.read_text(encoding="utf-8"))[: args.windows * args.ctx])
    if ids.numel() < args.windows * args.ctx:
        ap.error(f"the text has {ids.numel()} tokens, fewer than --windows x --ctx")
    windows = [ids[w * args.ctx:(w + 1) * args.ctx] for w in range(args.windows)]

    def logp(m, window):
        with torch.no_grad():
            return torch.log_softmax(m(window[None], use_cache=False).logits[0, :-1].float(), -1)

    ref = [logp(model, w) for w in windows]
    # the linears' inputs on the export's calibration text (export/linear_inputs.py), in a copy (the pass
    # compiles the model it runs)
    from export.linear_inputs import sample_linear_inputs
    from toolkit.calibration import calibration_ids

    linear_inputs = sample_linear_inputs(copy.deepcopy(model), calibration_ids(tokenizer)[0])
    count = args.windows * (args.ctx - 1)
    ref_nll = sum(float(-r.gather(1, w[1:, None]).sum(dtype=torch.float64)) for r, w in zip(ref, windows))
    ref_ppl = math.exp(ref_nll / count)
    results = [{"row": "fp32", "ppl": round(ref_ppl, 4), "ppl_increase_pct": 0.0, "kld_mean": 0.0, "top1_agreement": 1.0}]
    print(f"fp32 PPL {ref_ppl:.3f}", file=sys.stderr)
    for name in args.rows:
        t0 = time.perf_counter()
        m = variant(model, name, linear_inputs, args.max_pieces)
        nll = kld = agree = 0.0
        for r, w in zip(ref, windows):
            lp = logp(m, w)
            nll += float(-lp.gather(1, w[1:, None]).sum(dtype=torch.float64))
            kld += float((r.exp() * (r - lp)).sum(dtype=torch.float64))
            agree += float((lp.argmax(-1) == r.argmax(-1)).sum())
        del m
        ppl = math.exp(nll / count)
        row = {"row": name, "ppl": round(ppl, 4), "ppl_increase_pct": round(100 * (ppl / ref_ppl - 1), 4),
               "kld_mean": round(kld / count, 6), "top1_agreement": round(agree / count, 5),
               "seconds": round(time.perf_counter() - t0, 1)}
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    res = {"model": args.model, "ctx": args.ctx, "windows": args.windows, "predictions": count,
           "text": args.text.name, "cpu": cpu_model(), "threads": args.threads, "max_pieces": args.max_pieces or MAX_ACT_PIECES, "results": results,
           "method": "eager PyTorch (HF model, fp32 attention), a fresh quantized copy per row; teacher-forced "
           "windows from the start of the text; reference = the fp32 model",
           "command": "python benchmarks/pte_weights_eager.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\n### {args.model}, ctx {args.ctx} x {args.windows} windows, eager\n")
    print("| row | PPL | PPL +% | KLD | top-1 |\n|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['row']} | {r['ppl']:.3f} | {r['ppl_increase_pct']:+.2f}% | {r['kld_mean']:.4f} | "
              f"{100 * r['top1_agreement']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
