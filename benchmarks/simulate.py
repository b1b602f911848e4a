"""The phone-memory simulation with its default scenario, over several seeds.

Runs `pagedkv simulate`'s model (runtime_sim/simulate.py, driving the real BlockPool) for seeds
0..N-1, writes results/simulate.json + results/simulate.png for seed 0 and prints, per seed, the
tokens each strategy held before its first failure and the paged-quant / paged-fp16 ratio.

    python benchmarks/simulate.py [--seeds 10]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime_sim.simulate import SimConfig, plot, simulate, to_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    print("| seed | contiguous-fp16 | paged-fp16 | paged-quant | quant / fp16 |")
    print("|---|---:|---:|---:|---:|")
    for seed in range(a.seeds):
        result = simulate(SimConfig(seed=seed))
        held = {s["name"]: s["tokens_before_failure"] for s in to_json(result, with_series=False)["strategies"]}
        ratio = held["paged-quant"] / max(1, held["paged-fp16"])
        print(f"| {seed} | {held['contiguous-fp16']} | {held['paged-fp16']} | {held['paged-quant']} | {ratio:.2f} |")
        if seed == 0:
            (a.out / "simulate.json").write_text(json.dumps(to_json(result)) + "\n")
            plot(result, a.out / "simulate.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
