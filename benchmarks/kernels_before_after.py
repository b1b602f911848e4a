"""Our op before and after a kernel change: benchmarks/kernels.py against two native builds, alternated.

    python benchmarks/kernels_before_after.py --old BUILD_DIR --old-commit SHA --new BUILD_DIR --new-commit SHA
        [--isas avx512-vnni avx512] [--runs 4] [--add] [-- kernels.py arguments]
    python benchmarks/kernels_before_after.py --pool FILE FILE ... --old-commit SHA --new-commit SHA --out OUT

Each run is `python benchmarks/kernels.py ARGS --json TMP` with PAGEDKV_BUILD_DIR set to the old or the
new build and PAGEDKV_ISA to one code path; per ISA the runs go old, new, old, new, ... so that a change
of the shared machine's load touches both sides alike. The load average (os.getloadavg, as `uptime`) is
recorded before and after every run. Per cell (isa, dims, ctx, threads, impl) the result is the median
over the runs of each side of kernels.py's per-run ms (itself a median of its interleaved rounds), and
new / old of those medians; also new / old of each side's fastest run (a disturbance only adds time, so
on a loaded machine the fastest run is the closer estimate of the undisturbed step), and the median of the
per-round ratios (each round's new run over its old run). --runs 0 --add
recomputes the summary of --out. --add appends the runs to an existing --out (e.g. reruns of one noisy cell
with narrower kernels.py arguments) and recomputes every cell over all its runs. --pool FILE ... runs
nothing: it writes to --out the summary over all the runs of earlier --out files (of the same two builds,
e.g. several runs on different days), naming the files.

Per cell the summary also has a bootstrap 95% interval of the paired median (2,000 resamples of the
per-round ratios, seed 0). Give the same build as --old and --new (an A/A run) to see what this box's
noise alone makes of a cell.

--core times the core alone instead (pagedkv_core_bench of each build, via kernels.core_bench; PAGEDKV_ISA
is its path argument): no onnxruntime host, the two builds back to back per cell, the order flipped every
round; write it to another --out.

Writes benchmarks/results/kernels_before_after.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEFAULT_ARGS = ["--ctx", "4096", "16384", "--dims", "9/3/64", "32/8/128", "--impls", "pagedkv-ort",
                "--threads", "1", "2", "--rounds", "10"]


def one_run(build: str, isa: str, kargs: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.json"
        env = dict(os.environ, PAGEDKV_BUILD_DIR=build, PAGEDKV_ISA=isa)
        load_before = os.getloadavg()
        t0 = time.time()
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernels.py"), *kargs, "--json", str(out)],
                       env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())
    return dict(load_before=[round(x, 2) for x in load_before], load_after=[round(x, 2) for x in os.getloadavg()],
                seconds=round(time.time() - t0, 1),
                rows=[{k: r[k] for k in ("impl", "ctx", "threads", "q_heads", "kv_heads", "head_dim", "ms")}
                      for r in rows])


def core_round(builds: dict, isa: str, kargs: list[str], new_first: bool) -> list[dict]:
    """One round of the core alone (each build's pagedkv_core_bench via kernels.core_bench, the median of
    its repeats) on kernels.py's cells: per cell the two builds back to back (new first if new_first), so a
    change of load between cells touches both alike. Returns the old and the new side's run."""
    from benchmarks import kernels

    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--dims", nargs="+", default=["9/3/64", "32/8/128"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    k, _ = ap.parse_known_args(kargs)
    load_before = os.getloadavg()
    t0 = time.time()
    rows = {"old": [], "new": []}
    for dims in k.dims:
        hq, hkv, d = (int(x) for x in dims.split("/"))
        for ctx in k.ctx:
            for n in k.threads:
                for side in (("new", "old") if new_first else ("old", "new")):
                    os.environ["PAGEDKV_BUILD_DIR"] = builds[side]  # core_bench runs build_dir()/pagedkv_core_bench
                    ms, _ = kernels.core_bench(isa, hq, hkv, d, ctx, n)
                    rows[side].append(dict(impl=f"core-{isa}", ctx=ctx, threads=n, q_heads=hq, kv_heads=hkv,
                                           head_dim=d, ms=ms))
    common = dict(load_before=[round(x, 2) for x in load_before],
                  load_after=[round(x, 2) for x in os.getloadavg()], seconds=round(time.time() - t0, 1))
    return [dict(side=side, isa=isa, kernels_args=kargs, new_first=new_first, rows=rows[side], **common)
            for side in ("old", "new")]


def summarize(runs: list[dict]) -> list[dict]:
    """Per (isa, dims, ctx, threads, impl): each side's ms over its runs, their medians and new / old."""
    cells: dict = {}
    for run in runs:
        for r in run["rows"]:
            key = (run["isa"], r["q_heads"], r["kv_heads"], r["head_dim"], r["ctx"], r["threads"], r["impl"])
            cells.setdefault(key, {"old": [], "new": []})[run["side"]].append(r["ms"])
    out = []
    for (isa, hq, hkv, d, ctx, thr, impl), ms in sorted(cells.items()):
        if not ms["old"] or not ms["new"]:
            continue
        old, new = statistics.median(ms["old"]), statistics.median(ms["new"])
        paired = [n / o for o, n in zip(ms["old"], ms["new"])]
        out.append(dict(isa=isa, dims=f"{hq}/{hkv}/{d}", ctx=ctx, threads=thr, impl=impl, runs_old=len(ms["old"]),
                        runs_new=len(ms["new"]), old_ms=round(old, 4), new_ms=round(new, 4),
                        new_over_old=round(new / old, 3), old_min_ms=min(ms["old"]), new_min_ms=min(ms["new"]),
                        min_new_over_min_old=round(min(ms["new"]) / min(ms["old"]), 3),
                        # the i-th new run against the i-th old run (the same round): a load change between
                        # rounds cancels
                        paired_new_over_old=round(statistics.median(paired), 3),
                        paired_ci95=bootstrap_ci(paired),
                        old_all=ms["old"], new_all=ms["new"]))
    return out


def bootstrap_ci(xs: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """A bootstrap 95% interval of the median of xs (resampled with replacement, seeded: reproducible)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return [round(meds[int(0.025 * resamples)], 3), round(meds[int(0.975 * resamples) - 1], 3)]


def table(summary: list[dict]) -> str:
    lines = ["| path | impl | dims q/kv/d | ctx | threads | before ms | after ms | after / before "
             "| fastest runs: after / before | paired: median of after / before per round | its 95% interval | runs |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for c in summary:
        lines.append(f"| {c['isa']} | {c['impl']} | {c['dims']} | {c['ctx'] // 1024}K | {c['threads']} | "
                     f"{c['old_ms']:.3f} | "
                     f"{c['new_ms']:.3f} | {c['new_over_old']:.3f} | {c['min_new_over_min_old']:.3f} | "
                     f"{c['paired_new_over_old']:.3f} | {c['paired_ci95'][0]:.3f}-{c['paired_ci95'][1]:.3f} | "
                     f"{c['runs_old']}+{c['runs_new']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    kargs = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT_ARGS
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="build dir of the before commit (libpagedkv_ort.so)")
    ap.add_argument("--new", help="build dir of the after commit")
    ap.add_argument("--old-commit", required=True)
    ap.add_argument("--new-commit", required=True)
    ap.add_argument("--isas", nargs="+", default=["avx512-vnni", "avx512"])
    ap.add_argument("--runs", type=int, default=4, help="runs per side and ISA, alternated (default 4)")
    ap.add_argument("--core", action="store_true",
                    help="time the core alone (each build's pagedkv_core_bench, the median of its repeats) on "
                         "the same cells instead of kernels.py's onnxruntime host")
    ap.add_argument("--new-first", action="store_true",
                    help="each round runs the new build before the old one (a check of order effects)")
    ap.add_argument("--add", action="store_true", help="append to --out's runs instead of starting anew")
    ap.add_argument("--pool", nargs="+", type=Path, metavar="FILE",
                    help="run nothing: the runs of these earlier --out files (same builds), summarized together")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kernels_before_after.json")
    args = ap.parse_args(argv)
    if args.pool:
        return pool(args.pool, args.old_commit, args.new_commit, args.out)
    if not (args.old and args.new):
        ap.error("--old and --new (build dirs) are required unless --pool is given")
    for b in (args.old, args.new):
        need = "pagedkv_core_bench" if args.core else "libpagedkv_ort.so"
        if not (Path(b) / need).exists():
            print(f"error: {b}/{need} is missing: build that commit's toolkit/csrc there first",
                  file=sys.stderr)
            return 2
    doc = json.loads(args.out.read_text()) if args.add and args.out.exists() else None
    if doc and (doc["old_commit"], doc["new_commit"]) != (args.old_commit, args.new_commit):
        print(f"error: {args.out} compares {doc['old_commit']} with {doc['new_commit']}: use another --out",
              file=sys.stderr)
        return 2
    from benchmarks.e2e import cpu_model

    doc = doc or dict(cpu=cpu_model(), old_commit=args.old_commit, new_commit=args.new_commit, runs=[])
    for i in range(args.runs):
        for isa in args.isas:
            if args.core:  # cell by cell, the order flipped every round
                flip = args.new_first != (i % 2 == 1)
                runs = core_round({"old": args.old, "new": args.new}, isa, kargs, flip)
            else:  # whole kernels.py runs, one per side
                sides = (("old", args.old), ("new", args.new))
                runs = [dict(side=side, isa=isa, kernels_args=kargs, new_first=args.new_first,
                             **one_run(build, isa, kargs))
                        for side, build in (sides[::-1] if args.new_first else sides)]
            for run in runs:
                doc["runs"].append(run)
                print(f"round {i + 1} {isa} {run['side']}: "
                      f"load {run['load_before'][0]:.2f} -> {run['load_after'][0]:.2f}, "
                      + ", ".join(f"{r['impl']} {r['q_heads']}/{r['kv_heads']}/{r['head_dim']} {r['ctx'] // 1024}K "
                                  f"{r['threads']}T {r['ms']:.3f}" for r in run["rows"]), flush=True)
    if not doc["runs"]:
        print(f"error: {args.out} holds no runs: give --runs N (with --add, an existing --out)", file=sys.stderr)
        return 2
    return write(doc, args.out)


def write(doc: dict, out: Path, keep_runs: bool = True) -> int:
    """Summarize doc's runs into it, write it to out (without the runs: keep_runs=False) and print the
    table."""
    doc["summary"] = summarize(doc["runs"])
    loads = [x for r in doc["runs"] for x in (r["load_before"][0], r["load_after"][0])]
    doc["load_1min_range"] = [min(loads), max(loads)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc if keep_runs else {k: v for k, v in doc.items() if k != "runs"}, indent=1) + "\n")
    print(f"\n{doc['cpu']}, {doc['old_commit']} -> {doc['new_commit']}, load (1 min) "
          f"{min(loads):.1f}-{max(loads):.1f}\n")
    print(table(doc["summary"]))
    print(f"\nwrote {out}")
    return 0


def pool(files: list[Path], old_commit: str, new_commit: str, out: Path) -> int:
    """--pool: the summary over the runs of earlier result files (each file's rounds stay paired); the
    runs themselves stay in those files."""
    docs = []
    for f in files:
        try:
            docs.append(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            print(f"error: --pool {f} is not a result file of this script ({e}): pass its --out files",
                  file=sys.stderr)
            return 2
    cpus = {d.get("cpu") for d in docs}
    if len(cpus) != 1 or any("runs" not in d for d in docs):
        print(f"error: --pool files must be runs of this script on one CPU (got {sorted(map(str, cpus))})",
              file=sys.stderr)
        return 2
    doc = dict(cpu=cpus.pop(), old_commit=old_commit, new_commit=new_commit,
               pooled_from=[dict(file=f.name, old_commit=d["old_commit"], new_commit=d["new_commit"],
                                 runs=len(d["runs"])) for f, d in zip(files, docs)],
               runs=[r for d in docs for r in d["runs"]])
    return write(doc, out, keep_runs=False)


if __name__ == "__main__":
    raise SystemExit(main())
