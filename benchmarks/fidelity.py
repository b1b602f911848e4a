"""Fidelity of the KV specs on a real model (a registered name, e.g. smollm2, gemma3-270m,
qwen2.5-coder-1.5b, or a path) on wikitext-2.

    python benchmarks/fidelity.py                       # ctx 512 x 8 windows, ctx 2048 x 2 windows
    python benchmarks/fidelity.py --model gemma3-270m --out benchmarks/results/fidelity_gemma3.json
    python benchmarks/fidelity.py --ctx 512 --windows 8 --specs default "default:v_group=16"
    python benchmarks/fidelity.py --model qwen2.5-coder-1.5b --ctx 512 --windows 2 --key-offsets both

The quantized rows subtract the key offsets export calibrates (toolkit/key_offsets.py, measured on
toolkit/data/calibration.txt); --key-offsets off measures the plain pool, both puts the two side by side
(the plain rows named "SPEC (plain)").

Teacher-forced, one call per window through the paged model (the op on the C++ core, as `pagedkv eval`
runs it; --kernel reference for its plain-PyTorch definition), the unquantized fp32 pool as reference; see toolkit/fidelity.py for the metrics. Writes
benchmarks/results/fidelity.json and prints one markdown table per ctx.
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

from toolkit.fidelity import DEFAULT_SPECS, evaluate_ids, markdown_table, tokenize, tokenizer_bos  # noqa: E402
from toolkit.kv_spec import resolve_spec  # noqa: E402

DEFAULT_TEXT = REPO / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="HF dir, .gguf, 'smollm2' (default) or 'gemma3-270m'")
    ap.add_argument("--bos", choices=["auto", "on", "off"], default="auto",
                    help="BOS first in every window: auto = when the tokenizer adds one (Gemma), as llama.cpp does")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="text file (default: wikitext-2 wiki.test.raw)")
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 2048], help="window lengths (default 512 2048)")
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 2],
                    help="windows per ctx, one value or one per --ctx (default 8 2)")
    ap.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, help=f"specs (default {' '.join(DEFAULT_SPECS)})")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kernel", choices=["native", "reference"], default="native",
                    help="the op of the spec rows: the C++ core (default) or the plain-PyTorch reference")
    ap.add_argument("--key-offsets", choices=["on", "off", "both"], default="on",
                    help="subtract the calibrated key offsets in the quantized rows (default on, as export does)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fidelity.json")
    args = ap.parse_args(argv)

    windows = args.windows if len(args.windows) == len(args.ctx) else [args.windows[0]] * len(args.ctx)
    if len(args.windows) not in (1, len(args.ctx)):
        ap.error("--windows takes one value or one per --ctx")
    if not args.text.is_file():
        ap.error(f"text file {args.text} not found: pass --text FILE")

    from toolkit.model_loading import load_model

    from toolkit.calibration import calibration_ids
    from toolkit.key_offsets import measure_key_offsets
    from toolkit.model_registry import MODELS

    model, tokenizer = load_model(args.model)
    name = f"{MODELS[args.model].title} -> fp32" if args.model in MODELS else str(args.model)
    offsets = None if args.key_offsets == "off" else measure_key_offsets(model, calibration_ids(tokenizer)[0])
    bos_id = tokenizer_bos(tokenizer) if args.bos == "auto" else (tokenizer.bos_token_id if args.bos == "on" else None)
    t0 = time.perf_counter()
    ids = tokenize(tokenizer, args.text.read_text(encoding="utf-8"))
    print(f"tokenized {args.text.name}: {len(ids)} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    report = {
        "model": name,
        "text": args.text.name,
        "bos": bos_id is not None,
        "method": f"teacher-forced, one paged call per window, {'BOS first' if bos_id is not None else 'no BOS'}, "
        "consecutive windows from the start; "
        "reference = fp32 pool; metrics over the ctx-1 next-token positions of each window",
        "block_size": args.block_size,
        "kernel": args.kernel,
        "key_offsets": args.key_offsets,
        "torch_threads": __import__("torch").get_num_threads(),
        "runs": [],
    }
    for ctx, w in zip(args.ctx, windows):
        t0 = time.perf_counter()
        res = evaluate_ids(model, ids, ctx, args.specs, w, args.block_size, model_name=name, bos_id=bos_id,
                           kernel=args.kernel, key_offsets=offsets)
        if args.key_offsets == "both":
            plain = evaluate_ids(model, ids, ctx, [(f"{s} (plain)", resolve_spec(s)) for s in args.specs
                                                   if not resolve_spec(s).is_float],
                                 w, args.block_size, model_name=name, bos_id=bos_id, kernel=args.kernel)
            res["results"] += plain["results"][1:]
        seconds = time.perf_counter() - t0
        res.update(windows=w, tokens_per_window=ctx, predictions=w * (ctx - 1), seconds=round(seconds, 1))
        report["runs"].append(res)
        print(f"\n### {name}, ctx {ctx}, {w} windows ({w * (ctx - 1)} predictions), {seconds:.0f} s\n")
        print(markdown_table(res), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")  # after every ctx: partial results survive
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
