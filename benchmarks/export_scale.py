"""How long an export takes and how much memory it needs: `pagedkv export` as a user runs it, timed whole.

    python benchmarks/export_scale.py --model qwen2.5-coder-1.5b --format pte --weights 8da4w-asym-e8h8
    python benchmarks/export_scale.py --model smollm2 --format pte --weights 8da4w-asym-e8h8

Runs the CLI in a child process (`pagedkv export MODEL --format F ...` into a fresh dir under --work) and
reads the child's wall time and peak RSS (getrusage of the waited child), then the manifest's per-stage
rows (export/stages.py: each stage's seconds and the process's peak RSS when it ended). The model's
fp32 conversion (GGUF dequantization, cached once per GGUF) is made before the timed run, as a user's
second export finds it. Writes benchmarks/results/export_<model>_<format>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.e2e import cpu_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name (`pagedkv models`), HF dir or .gguf")
    ap.add_argument("--format", choices=["pte", "onnx"], default="pte")
    ap.add_argument("--weights", default="8da4w-asym-e8h8", help="--pte-weights or --onnx-weights of the export")
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens-per-call", type=int, default=64)
    ap.add_argument("--max-logits-rows", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "pagedkv-export-scale",
                    help="where the export is written (replaced)")
    ap.add_argument("--keep", action="store_true", help="keep the export (default: removed after the run)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from toolkit.model_loading import load_model

    load_model(args.model)  # the cached fp32 conversion, outside the timed run
    out_dir = args.work / f"{Path(args.model).name}-{args.format}"
    cmd = [str(Path(sys.executable).with_name("pagedkv")), "export", args.model, "--out", str(out_dir), "--force",
           "--format", args.format, f"--{args.format}-weights", args.weights, "--pool-tokens", str(args.pool_tokens),
           "--max-seqs", "1", "--max-tokens-per-call", str(args.max_tokens_per_call)]
    if args.format == "pte":
        cmd += ["--max-logits-rows", str(args.max_logits_rows)]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if proc.returncode != 0:
        print(f"export failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode
    manifest = json.loads((out_dir / "pagedkv.json").read_text())
    entry = manifest["artifacts"][args.format]
    res = {"model": args.model, "format": args.format, "weights": args.weights, "cpu": cpu_model(),
           "cores": os.cpu_count(), "wall_seconds": round(wall, 1), "peak_rss_bytes": peak,
           "file_bytes": entry["bytes"], "stages": manifest.get("export_stages", []) + entry.get("stages", []),
           "fp32_outlier_channels": entry.get("fp32_outlier_channels"),
           "command": "python benchmarks/export_scale.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "export_command": " ".join(cmd[1:])}
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    out = args.out or REPO / "benchmarks" / "results" / f"export_{Path(args.model).name}_{args.format}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\n{args.model} {args.format} {args.weights}: {wall / 60:.1f} min wall, peak RSS {peak / 2**30:.2f} GiB, "
          f"{entry['bytes'] / 2**20:.0f} MiB file ({res['cpu']})\n")
    print("| stage | seconds | peak RSS at its end |\n|---|---:|---:|")
    for row in res["stages"]:
        print(f"| {row['stage']} | {row['seconds']:.0f} | {row['peak_rss_bytes'] / 2**30:.2f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
