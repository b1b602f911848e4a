"""Where the native runner's memory goes per .pte weight format: SmolLM2-135M-Instruct cut to its first
L layers (the real weights: SmolLM2's hidden sizes and its Q4_1 blocks, its 49152-token table and tied
head), exported with each --weights format and run by android_demo/native's pagedkv-runner. The
difference between L and L+1 layers is one layer's cost; what stays at L = 0 is the table, the head and
the runtime. A full SmolLM2 export of 8da4w-asym-e8h8 takes ~40 min; these take 1-3 min each.

    python benchmarks/pte_weights_memory.py                     # 8da4w-e8 and 8da4w-asym-e8h8, 1 and 2 layers
    python benchmarks/pte_weights_memory.py --weights 8da4w-asym-e8h8 --layers 1 2 4

    python benchmarks/pte_weights_memory.py --artifacts DIR ... --heaptrack   # existing exports, heap by site

Runner: --ctx 256 tokens of wikitext-2, --decode 8, 1 thread, a pool of 512 tokens. Columns: peak RSS
(VmHWM), and the runner's breakdown of the resident set at the end (mapped .pte pages, KV pool, activation
arena, libraries, rest = heap: XNNPACK's packed weights, its workspaces, the runtime's allocations).
--heaptrack (needs `apt-get install heaptrack`) runs the runner once more under heaptrack and splits the
heap at its peak by who allocated it (HEAP_SITES: XNNPACK's packed int4 / int8 / fp32 linear weights,
its workspace of intermediate tensors, the tokenizer, the rest).
Writes --json (default benchmarks/results/pte_weights_memory.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNNER_CLI = REPO / "build" / "android-host" / "pagedkv-runner"
DEFAULT_TEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
MiB = 2**20


def export_cut(weights: str, layers: int, out: Path) -> dict:
    """SmolLM2 with its first `layers` decoder layers, exported to .pte with `weights`."""
    sys.path.insert(0, str(REPO))
    from export.artifacts import PoolRequest, export_artifacts
    from toolkit.model_loading import load_model

    model, tok = load_model("smollm2")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    t0 = time.time()
    m = export_artifacts("smollm2", out, formats=("pte",), spec="default",
                         pool=PoolRequest(pool_tokens=512, max_seqs=1), max_tokens_per_call=64,
                         model_and_tokenizer=(model, tok), pte_weights=weights, force=True)
    return {"export_s": round(time.time() - t0, 1), "pte_bytes": m["artifacts"]["pte"]["bytes"]}


def run_runner(art: Path, prompt: Path, ctx: int, decode: int) -> dict:
    p = subprocess.run([str(RUNNER_CLI), str(art), "--prompt-file", str(prompt), "--ctx", str(ctx), "--decode",
                        str(decode), "--threads", "1", "--json"], capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"pagedkv-runner failed on {art}: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# heap sites: the first frame of an allocation's stack that names one (heaptrack's flame graph, peak cost)
HEAP_SITES = (
    ("int4 linears (XNNPACK qb4w)", "xnn_create_fully_connected_nc_qdu8_f32_qb4w"),
    ("int8 linears (XNNPACK qc8w)", "xnn_create_fully_connected_nc_qdu8_f32_qc8w"),
    ("fp32 linears (XNNPACK f32)", "xnn_create_fully_connected_nc_f32"),
    ("XNNPACK workspace", "xnn_plan_memory"),
    ("tokenizer", "pagedkv_rt::Tokenizer"),
)


def heap_by_site(art: Path, prompt: Path, ctx: int, decode: int, work: Path) -> dict:
    """The runner's heap at its peak, by allocation site (bytes), from one run under heaptrack."""
    import shutil

    if not shutil.which("heaptrack") or not shutil.which("heaptrack_print"):
        raise SystemExit("--heaptrack needs heaptrack: apt-get install heaptrack")
    data = work / "heaptrack"
    for f in work.glob("heaptrack*"):
        f.unlink()
    subprocess.run(["heaptrack", "-o", str(data), str(RUNNER_CLI), str(art), "--prompt-file", str(prompt), "--ctx",
                    str(ctx), "--decode", str(decode), "--threads", "1"], capture_output=True, text=True,
                   timeout=3600, check=True)
    stacks = work / "heaptrack-peak.txt"
    subprocess.run(["heaptrack_print", "-f", str(next(work.glob("heaptrack*.zst"))), "--print-peaks", "0",
                    "--print-allocators", "0", "--print-temporary", "0", "--print-leaks", "0", "-F", str(stacks),
                    "--flamegraph-cost-type", "peak"], capture_output=True, text=True, timeout=1800, check=True)
    sites = {name: 0 for name, _ in HEAP_SITES} | {"other": 0}
    for line in stacks.read_text().splitlines():
        stack, _, cost = line.rpartition(" ")
        name = next((n for n, frame in HEAP_SITES if frame in stack), "other")
        sites[name] += int(cost)
    return sites


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", nargs="+", default=["8da4w-e8", "8da4w-asym-e8h8"])
    ap.add_argument("--layers", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "pagedkv" / "pte-weights-memory",
                    help="where the cut models are exported (each export replaced)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "pte_weights_memory.json")
    ap.add_argument("--artifacts", nargs="+", type=Path, help="measure these artifact dirs instead of exporting")
    ap.add_argument("--heaptrack", action="store_true", help="also split the heap by allocation site (heaptrack)")
    ap.add_argument("--export-one", nargs=3, metavar=("WEIGHTS", "LAYERS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.export_one:
        w, n, out = args.export_one
        print("\n" + json.dumps(export_cut(w, int(n), Path(out))), flush=True)
        return 0
    if not RUNNER_CLI.is_file():
        raise SystemExit(f"{RUNNER_CLI} is not built: run `bash android_demo/native/ci_build.sh host` first")
    if not args.text.is_file():
        ap.error(f"text file {args.text} not found: pass --text FILE")
    prompt = args.work / "prompt.txt"
    args.work.mkdir(parents=True, exist_ok=True)
    prompt.write_text(args.text.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    rows = []
    jobs = [(None, w, n) for w in args.weights for n in args.layers] if not args.artifacts else \
        [(Path(a), *_manifest_weights_layers(Path(a))) for a in args.artifacts]
    for given, weights, layers in jobs:
        out = given or args.work / f"{weights}-L{layers}"
        if given is None:
            # each export in its own process: the runner's numbers are then the only thing in the next one
            p = subprocess.run([sys.executable, __file__, "--export-one", weights, str(layers), str(out)],
                               capture_output=True, text=True, cwd=REPO,
                               env=dict(os.environ, PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error"))
            if p.returncode != 0:
                raise SystemExit(f"export of {weights} x {layers} layers failed: {p.stderr.strip()[-2000:]}")
            ex = json.loads(p.stdout.strip().splitlines()[-1])
        else:
            ex = {"export_s": None, "pte_bytes": (out / "model.pte").stat().st_size, "artifacts": str(out)}
        r = run_runner(out, prompt, args.ctx, args.decode)
        row = {"weights": weights, "layers": layers, **ex,
               **{k: r[k] for k in ("peak_rss_bytes", "rss_bytes", "weights_file_resident_bytes",
                                    "kv_pool_resident_bytes", "activations_resident_bytes",
                                    "libraries_resident_bytes", "rest_bytes", "generated")}}
        if args.heaptrack:
            row["heap_by_site"] = heap_by_site(out, prompt, args.ctx, args.decode, args.work)
        rows.append(row)
        print(f"{weights:18s} L={layers}: peak {row['peak_rss_bytes'] / MiB:6.1f} MiB, pte "
              f"{row['pte_bytes'] / MiB:6.1f}, mapped {row['weights_file_resident_bytes'] / MiB:5.1f}, rest "
              f"{row['rest_bytes'] / MiB:6.1f} (export {row['export_s']} s)", file=sys.stderr, flush=True)
    print("| weights | layers | .pte MiB | peak RSS MiB | mapped .pte | KV | arena | libs | rest (heap) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {_label(r)} | {r['layers']} | {r['pte_bytes'] / MiB:.1f} | {r['peak_rss_bytes'] / MiB:.1f} | "
              f"{r['weights_file_resident_bytes'] / MiB:.1f} | {r['kv_pool_resident_bytes'] / MiB:.1f} | "
              f"{r['activations_resident_bytes'] / MiB:.1f} | {r['libraries_resident_bytes'] / MiB:.1f} | "
              f"{r['rest_bytes'] / MiB:.1f} |")
    if args.heaptrack:
        names = [n for n, _ in HEAP_SITES] + ["other"]
        print("\n| weights | layers | " + " | ".join(names) + " | heap at peak |")
        print("|---|---:|" + "---:|" * (len(names) + 1))
        for r in rows:
            h = r["heap_by_site"]
            print(f"| {_label(r)} | {r['layers']} | " + " | ".join(f"{h[n] / MiB:.1f}" for n in names)
                  + f" | {sum(h.values()) / MiB:.1f} |")
    per = {}
    for w in args.weights:
        by = {r["layers"]: r for r in rows if r["weights"] == w and "artifacts" not in r}  # the cut exports
        ls = sorted(by)
        if len(ls) >= 2:
            a, b = by[ls[0]], by[ls[-1]]
            n = ls[-1] - ls[0]
            per[w] = {k: (b[k] - a[k]) / n for k in ("peak_rss_bytes", "rest_bytes", "pte_bytes")}
            line = (f"{w}: per layer peak RSS {per[w]['peak_rss_bytes'] / MiB:.2f} MiB, rest "
                    f"{per[w]['rest_bytes'] / MiB:.2f} MiB, file {per[w]['pte_bytes'] / MiB:.2f} MiB")
            if "heap_by_site" in a:  # the RSS's rest can hide a layer in freed heap; the heap's sites do not
                per[w]["heap_by_site"] = {k: (b["heap_by_site"][k] - v) / n for k, v in a["heap_by_site"].items()}
                line += "; heap " + ", ".join(f"{k} {v / MiB:.2f}" for k, v in per[w]["heap_by_site"].items() if v)
            print(line)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cpu": _cpu(), "ctx": args.ctx, "decode": args.decode, "rows": rows,
                                     "per_layer": per}, indent=1))
    return 0


def _label(row: dict) -> str:
    """The weight format, and the export's directory name for --artifacts rows (which export it was)."""
    return row["weights"] + (f" ({Path(row['artifacts']).name})" if row.get("artifacts") else "")


def _manifest_weights_layers(art: Path) -> tuple[str, int]:
    m = json.loads((art / "pagedkv.json").read_text())
    return m["artifacts"]["pte"]["weights"], int(m["pool"]["num_layers"])


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
