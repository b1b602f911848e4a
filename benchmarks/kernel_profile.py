"""Where one decode step of our attention kernel spends its time: `perf record` on the C++ core alone.

    make native && python benchmarks/kernel_profile.py             # 16K, 9/3/64 and 32/8/128, 1 thread
    python benchmarks/kernel_profile.py --ctx 4096 --dims 9/3/64 --threads 2

Runs toolkit/csrc/pagedkv_core_bench (the default K8/V4 spec, random codes, shuffled blocks) under
`perf record -F 5000` on the best code path of this CPU, over the shuffled pool ("pool"), over a
block table cycling over 8 blocks ("hot": the same work without cache misses, as core-hot in
kernels.py) and over the shuffled pool with the caches flushed before each step ("cold": the bench
reads --cold-mib MiB first, as core-cold in kernels.py; those reads are not the core's and not
counted), and groups the samples of the step by function into phases:

  K scores      q . k per key and query head (scores_* / q_scores: the prepared query, the fp16 scales)
  softmax       the online softmax of each run of keys (Attend::softmax and its row helpers)
  V             p-weighted sums of the V codes (vacc_*)
  rest          the per-(token, KV head) walk over the block table, runs, set-up, merge, the write of
                the new token, the Hadamard rotations, the thread pool

The bench's own set-up (random pool, page faults) is left out: only the core's symbols and the libc /
libm routines it calls count, each with the samples of a run of ~3 s of steps minus those of a run with
one step. ms per phase = share x the bench's median step time
under perf (sampling makes the step ~10-20% slower than in kernels.py). Needs Linux `perf` (linux-perf
/ linux-tools); samples are by CPU clock, so this works in VMs without hardware counters. Writes
benchmarks/results/kernel_profile.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from kernels import core_bench_cmd, core_paths, parse_core_bench  # noqa: E402

PHASES = (
    ("K scores", re.compile(r"scores_|q_scores|q_prepare")),
    ("softmax", re.compile(r"::softmax|row_max|row_exp|rows_reduce|exp_sub|max_n|exp512")),
    ("V", re.compile(r"vacc_|v_accum")),
)
NAMES = [p for p, _ in PHASES] + ["rest"]
# symbols a step can run: the core, and the libc / libm routines it calls (memcpy/memset, exp)
STEP = re.compile(r"pagedkv|^__mem|^__exp|^exp")


def phase_of(symbol: str) -> str:
    for name, pat in PHASES:
        if pat.search(symbol):
            return name
    return "rest"


def samples(cmd: list, env: dict) -> tuple:
    """(bench stdout, {symbol: samples}) of one `perf record` of cmd."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        run = subprocess.run(["perf", "record", "-q", "-F", "5000", "-o", str(data), "--"] + cmd,
                             capture_output=True, text=True, env=env)
        if run.returncode != 0:
            raise RuntimeError(f"perf record failed ({run.returncode}): {run.stderr.strip()[-400:]}")
        report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "-n", "--sort", "symbol"],
                                capture_output=True, text=True, check=True).stdout
    counts: dict = {}
    for line in report.splitlines():
        hit = re.match(r"\s*[\d.]+%\s+(\d+)\s+\[\.\]\s+(.*?)\s*$", line)
        if hit:
            counts[hit.group(2)] = counts.get(hit.group(2), 0) + int(hit.group(1))
    return run.stdout, counts


def profile(path: str, hq: int, hkv: int, d: int, ctx: int, threads: int, seconds: float, pool: str,
            cold_mib: int = 512) -> dict:
    """Phase shares of the step: the samples of a run with ~`seconds` of steps minus those of a run with
    one step (the bench's set-up: random pool, page faults), per symbol. pool: "pool", "hot" or "cold"."""
    def cmd(reps):
        return core_bench_cmd(path, hq, hkv, d, ctx, threads, reps, hot_blocks=8 if pool == "hot" else 0,
                              cold_mib=cold_mib if pool == "cold" else 0)

    argv, env = cmd(20)
    calib = subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout
    # cold: every step also waits for the flush, so fewer steps (their samples still count alone)
    reps = max(20, int(seconds * 1e3 / parse_core_bench(calib)[0]))
    if pool == "cold":
        reps = min(reps, 300)
    out, full = samples(*cmd(reps))
    _, setup = samples(*cmd(1))
    step = {sym: max(0, n - setup.get(sym, 0)) for sym, n in full.items() if STEP.search(sym)}
    by_phase = {p: 0 for p in NAMES}
    for sym, n in step.items():
        by_phase[phase_of(sym)] += n
    total = sum(by_phase.values())
    if total <= 0:
        raise RuntimeError("perf recorded no samples of the step")
    ms = parse_core_bench(out)[0]
    return {"step_ms": ms, "reps": reps, "samples": total, "share": {p: round(by_phase[p] / total, 4) for p in NAMES},
            "ms": {p: round(ms * by_phase[p] / total, 4) for p in NAMES}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=16384, help="cached tokens (default 16384)")
    ap.add_argument("--dims", nargs="+", default=["9/3/64", "32/8/128"], help="q_heads/kv_heads/head_dim")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--path", default=None, help="core code path (default: the best of this CPU)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of steps per profile (default 3)")
    ap.add_argument("--cold-mib", type=int, default=512,
                    help="MiB read before each step of the cold profile (0: no cold profile)")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "kernel_profile.json")
    args = ap.parse_args(argv)
    if not shutil.which("perf"):
        print("perf is not installed: install linux-perf (Debian) or linux-tools-$(uname -r) (Ubuntu)",
              file=sys.stderr)
        return 2
    path = args.path or core_paths()[-1]
    rows = []
    for dims in args.dims:
        hq, hkv, d = (int(x) for x in dims.split("/"))
        for pool in ("pool", "hot") + (("cold",) if args.cold_mib else ()):
            r = profile(path, hq, hkv, d, args.ctx, args.threads, args.seconds, pool, args.cold_mib)
            rows.append(dict(path=path, dims=dims, ctx=args.ctx, threads=args.threads, pool=pool, **r))
            print(f"  {dims} ctx {args.ctx} {pool:4s}: {r['step_ms']:.3f} ms  "
                  + ", ".join(f"{p} {s:.0%}" for p, s in r["share"].items()), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print()
    print("| dims q/kv/d | ctx | threads | pool | step ms | " + " | ".join(f"{p} ms (share)" for p in NAMES) + " |")
    print("|---|---:|---:|---|---:|" + "---:|" * len(NAMES))
    for r in rows:
        print(f"| {r['dims']} | {r['ctx']} | {r['threads']} | {r['pool']} | {r['step_ms']:.3f} | "
              + " | ".join(f"{r['ms'][p]:.3f} ({r['share'][p]:.0%})" for p in NAMES) + " |")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
