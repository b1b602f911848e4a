"""Gemma 3 270M: our KV bytes at 2K/8K/32K with the compact tier (issue 25) on the 3 global layers,
next to llama.cpp's iSWA allocation (f16 and q8_0/q4_0). No model run: bytes only.

    python benchmarks/gemma_compact_bytes.py
    python benchmarks/gemma_compact_bytes.py --compact k4v3 k3v2 --horizon 1024
    python benchmarks/gemma_compact_bytes.py --compact k4v2-g256 --sliding-spec best:k_bits=6,v_bits=4

Ours without compaction is the engine's own count from the gemma_long.py run of record
(benchmarks/results/gemma_long.json, "ours" kv_bytes, both layer groups and the fp16 sink/tail rows).
With compaction, the global group's blocks that runtime_sim.compact.aged_blocks would move (block
indices max(1, sink_blocks) .. (tokens - horizon) // block_size - 1) change from the conversation's
spec (Gemma's "best", K7/V5) to the compact spec: per block, block_size x (kv_spec.bytes_per_token
(default) - bytes_per_token(compact)) over the 3 global layers. A KIVI row (K per channel, no pool
format yet) uses compact_tier.row_bytes_vs_fp16's bytes. llama.cpp: gemma_long.llamacpp_kv_bytes with
n_ctx as in that run. --sliding-spec S (a spec per layer group, which the pool does not have yet; the
fidelity: compact_tier.py --sliding-spec): each compact column again with the 15 sliding layers' held
blocks (the run's count) in spec S instead of "best". Writes benchmarks/results/gemma_compact_bytes.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from compact_tier import CANDIDATES, parse_candidate, row_bytes_vs_fp16  # noqa: E402
from gemma_long import GLOBAL_LAYERS, KV_DIM, llamacpp_kv_bytes  # noqa: E402

from toolkit.kv_spec import bytes_per_token, check_compact, fp16_bytes_per_token, resolve_spec  # noqa: E402

BLOCK_SIZE = 16  # the Gemma export's block size (gemma_long.json: 131 blocks hold 2,084 tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compact", nargs="+", default=["k4v3", "k4v2-g64", "k3v2", "kivi-k3v3"],
                    help=f"compact candidates ({', '.join(CANDIDATES)}) or spec text")
    ap.add_argument("--horizon", type=int, default=1024)
    ap.add_argument("--sliding-spec", nargs="+", default=[], metavar="SPEC",
                    help="also each compact column with the sliding layers in these specs (bytes only)")
    ap.add_argument("--runs", default=str(REPO / "benchmarks/results/gemma_long.json"))
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/gemma_compact_bytes.json"))
    args = ap.parse_args(argv)
    spec = resolve_spec("best")
    runs = [r for r in json.loads(Path(args.runs).read_text())["runs"] if "ours" in r]
    default_tok = bytes_per_token(spec, 1, KV_DIM, GLOBAL_LAYERS)
    rows = []
    for r in runs:
        n, ours = r["ours"]["tokens"], r["ours"]["kv_bytes"]
        n_ctx = r["llamacpp q8_0/q4_0"]["n_ctx"]
        aged = max(0, (n - args.horizon) // BLOCK_SIZE - max(1, spec.sink_blocks))
        row = {"ctx": r["ctx"], "tokens": n, "aged_blocks": aged, "ours_default": ours,
               "llamacpp_f16": llamacpp_kv_bytes("f16", "f16", n_ctx),
               "llamacpp_q8q4": llamacpp_kv_bytes("q8_0", "q4_0", n_ctx)}
        for name in args.compact:
            cand = parse_candidate(name)
            if cand.kivi_k_bits:
                comp_tok = round(row_bytes_vs_fp16(cand, spec, 1, KV_DIM, GLOBAL_LAYERS, BLOCK_SIZE)
                                 * fp16_bytes_per_token(1, KV_DIM, GLOBAL_LAYERS))
            else:
                comp_tok = bytes_per_token(check_compact(spec, cand.spec.replace(rotate=spec.rotate), KV_DIM),
                                           1, KV_DIM, GLOBAL_LAYERS)
            row[f"ours_{name}"] = ours - aged * BLOCK_SIZE * (default_tok - comp_tok)
            row[f"bytes_per_token_{name}"] = comp_tok
            for sname in args.sliding_spec:  # the sliding group's held blocks in another spec
                sliding = next(g for g in r["ours"]["groups"] if g["window"])
                layers = sliding["layers"]
                per_tok = (bytes_per_token(spec, 1, KV_DIM, layers)
                           - bytes_per_token(resolve_spec(sname).validate(KV_DIM), 1, KV_DIM, layers))
                row[f"ours_{name}+sliding {sname}"] = (row[f"ours_{name}"]
                                                       - sliding["used_blocks"] * BLOCK_SIZE * per_tok)
        rows.append(row)
    Path(args.out).write_text(json.dumps({"spec": spec.describe(), "horizon": args.horizon, "block_size": BLOCK_SIZE,
                                          "default_bytes_per_token_global": default_tok, "rows": rows}, indent=2) + "\n")
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print(f"global layers: {spec.describe()} {default_tok} B/token (3 layers); horizon {args.horizon}")
    cols = [c for name in args.compact for c in [name] + [f"{name}+sliding {s}" for s in args.sliding_spec]]
    print("ctx    | llama f16 | llama q8q4 | ours default (x q8q4) | "
          + " | ".join(f"ours+{c} (x q8q4, x f16)" for c in cols))
    for row in rows:
        q = row["llamacpp_q8q4"]
        cells = [f"{mib(row[f'ours_{c}'])} ({row[f'ours_{c}'] / q:.4f}x, {row[f'ours_{c}'] / row['llamacpp_f16']:.2f}x)"
                 for c in cols]
        print(f"{row['ctx']:6d} | {mib(row['llamacpp_f16'])} | {mib(q)} | {mib(row['ours_default'])} "
              f"({row['ours_default'] / q:.2f}x) | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
