"""Several runs of benchmarks/kernels.py side by side: which run is least disturbed, and the ranges.

    python benchmarks/lab/kernels_runs.py run1.json run2.json ...   (kernels.py --json files of one build)

The host is shared, so every run of kernels.py has a few disturbed cells. Given several runs of the same
code this prints, per run, its distance from the per-cell medians of all runs (the sum over every
(impl, ctx, threads, dims) cell of |log(ms / median ms)|: the smallest is the least disturbed run, the
one BENCHMARKS.md tabulates), then over all runs the range of our kernel's bandwidth fraction at 16K
and, from 4K up, of its time against GQA int8 / fp32 and of its bandwidth fraction (onnxruntime host).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def load_rows(path: Path) -> dict:
    d = json.loads(path.read_text())
    rows = d["rows"] if isinstance(d, dict) else d
    return {(r["impl"], r["ctx"], r["threads"], r["q_heads"], r["kv_heads"], r["head_dim"]): r for r in rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="kernels.py --json files of the same code")
    args = ap.parse_args(argv)
    if len(args.runs) < 2:
        ap.error("give at least two runs")
    runs = {p.name: load_rows(p) for p in args.runs}
    cells = set.intersection(*(set(r) for r in runs.values()))
    med = {k: statistics.median(r[k]["ms"] for r in runs.values()) for k in cells}
    print("distance from the per-cell medians (sum of |log(ms / median)|):")
    for name, r in runs.items():
        print(f"  {name}: {sum(abs(math.log(r[k]['ms'] / med[k])) for k in cells):.2f}")

    def span(values):
        return f"{min(values):.2f}-{max(values):.2f}"

    dims = sorted({k[3:] for k in cells})
    print("bandwidth fraction at 16K, over all runs (min-max):")
    for impl in ("pagedkv-ort", "pagedkv-et", "pagedkv-ort-spin", "core-avx512-vnni", "core-hot", "core-cold",
                 "core-walk-cold"):
        parts = []
        for d in dims:
            for t in (1, 2):
                k = (impl, 16384, t) + d
                if k in cells:
                    parts.append(f"{d[0]}/{d[1]}/{d[2]} {t}T {span([r[k]['bandwidth_fraction'] for r in runs.values()])}")
        if parts:
            print(f"  {impl}: " + ", ".join(parts))
    big = [k for k in cells if k[0] == "pagedkv-ort" and k[1] >= 4096]
    if big:
        def ratio(peer):
            return [r[k]["ms"] / r[(peer,) + k[1:]]["ms"] for r in runs.values() for k in big if (peer,) + k[1:] in r]
        print("from 4K up, onnxruntime host, over all runs (min-max):")
        print(f"  time / gqa-int8 {span(ratio('gqa-int8'))}, time / gqa-fp32 {span(ratio('gqa-fp32'))}, "
              f"bandwidth fraction {span([r[k]['bandwidth_fraction'] for r in runs.values() for k in big])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
