"""What `pagedkv export` picks when no --spec is given, and what the choice costs in the kernel.

    python benchmarks/default_spec.py --models smollm2 gemma3-270m qwen2.5-coder-1.5b

For each model: the calibration KLD of kv_spec.DEFAULT_CANDIDATES on toolkit/data/calibration.txt (as
export measures it, toolkit.calibration.calibrate, key offsets on) and the spec export keeps. Then one
decode step of the kernel core alone for each candidate (benchmarks/kernels.py's core_bench: SmolLM2's
dims 9/3/64, 16K cached tokens, 1 thread) on the avx2 path and the machine's best path: the candidates
take the same bytes but not the same time. Writes benchmarks/results/default_spec.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def bench_spec(spec) -> str:
    """pagedkv_core_bench's BENCH_SPEC: k_bits,v_bits,k_group,v_group,k_sym,v_sym."""
    return ",".join(str(int(x)) for x in (spec.k_bits, spec.v_bits, spec.k_group, spec.v_group, spec.k_sym,
                                          spec.v_sym))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["smollm2", "gemma3-270m", "qwen2.5-coder-1.5b"],
                    help="models to calibrate (none: the kernel cells only)")
    ap.add_argument("--paths", nargs="+", default=None, help="kernel code paths (default: avx2 and the best one)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "default_spec.json")
    args = ap.parse_args(argv)

    import kernels  # benchmarks/kernels.py

    from toolkit.calibration import calibrate, calibration_ids
    from toolkit.fidelity import spec_name
    from toolkit.kv_spec import DEFAULT_CANDIDATES, PRESETS
    from toolkit.model_loading import load_model
    from toolkit.native import available_isas, ort_kernels

    candidates = [PRESETS[n] for n in DEFAULT_CANDIDATES]
    report = {"candidates": list(DEFAULT_CANDIDATES), "models": [], "kernel": []}
    for name in args.models:
        model, tok = load_model(name)
        ids, _ = calibration_ids(tok)
        cal = calibrate(model, ids, {"pool": candidates})
        row = {"model": name, "tokens": len(ids), "kld": cal.candidates, "chosen": spec_name(cal.spec)}
        report["models"].append(row)
        print(f"{name}: calibration KLD {cal.candidates} -> {row['chosen']}", flush=True)
        del model
    paths = args.paths or list(dict.fromkeys(["avx2", available_isas(ort_kernels())[-1]]))
    for path in paths:
        for spec in candidates:
            os.environ["BENCH_SPEC"] = bench_spec(spec)
            ms, _ = kernels.core_bench(path, 9, 3, 64, 16384, 1)
            report["kernel"].append({"path": path, "spec": spec_name(spec), "ms": ms})
            print(f"{path} {spec_name(spec)}: {ms:.3f} ms per step (9/3/64, 16K, 1 thread)", flush=True)
    os.environ.pop("BENCH_SPEC", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
