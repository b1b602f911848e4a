"""How many tokens a fixed pool holds before the first loss, per pool policy (issue #25, item 3).

Two measurements, both written to results/pressure_ladder.json:

1. engine: the real runtime_sim Engine on the torch backend with a tiny random Llama (2 layers, the
   default K8/V4 spec; the model only makes the calls real, the counts do not depend on it). A pool
   of --blocks blocks of 16 tokens; --chats conversations take turns round-robin (--user prompt
   tokens, then --decode greedy tokens each), each growing past the whole pool, until the first loss:
   an eviction (evict: a cache dropped, prefilled again later), a slide (sliding, adaptive: old K/V
   dropped) or a spill that had to be prefilled again. "held" is the tokens of every conversation
   whose K/V is kept (in the pool, or in a spill file for adaptive) after the last turn without a loss
   (a lower bound: one turn of granularity).
2. simulate: `pagedkv simulate`'s phone model (SmolLM2-135M dims, the default trace and pool, with
   --sim-chats conversations alive at most) for seeds 0..N-1: the most tokens held at once before the
   first loss by paged-quant-evict and paged-quant-ladder (unlimited flash: where the ladder loses
   nothing in the trace, its number is the trace's peak demand, a lower bound of what it could hold).

    python benchmarks/pressure_ladder.py [--blocks 32] [--chats 4] [--seeds 3] [--sim-chats 8,16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.e2e import cpu_model  # noqa: E402

POLICIES = ("evict", "sliding", "adaptive")


def run_engine(policy: str, blocks: int, chats: int, user: int, decode: int, max_turns: int) -> dict:
    import numpy as np

    from runtime_sim.backends import TorchBackend
    from runtime_sim.engine import Engine
    from toolkit.compiler import compile
    from toolkit.tiny_models import tiny_model

    paged = compile(tiny_model("llama"), "default", num_blocks=blocks, max_seqs=chats)
    with tempfile.TemporaryDirectory(prefix="pressure-ladder-") as spill_dir:
        e = Engine(TorchBackend(paged), prefill_chunk=16, policy=policy, spill_dir=spill_dir)
        cids = [e.new_conversation() for _ in range(chats)]
        lost = lambda: e.counters.evictions + e.counters.slides + e.counters.spill_reprefills  # noqa: E731
        held, turns, rng = 0, 0, np.random.default_rng(0)
        t0 = time.perf_counter()
        while turns < max_turns:
            cid = cids[turns % chats]
            logits = e.prefill(cid, rng.integers(3, 500, user).tolist())
            for _ in range(decode):
                logits = e.step({cid: [int(np.argmax(logits))]})[cid]
            turns += 1
            if lost():
                break
            held = sum(len(c.history) + len(c.pending) for c in e.conversations.values())
        e.check_invariants()
        s = e.stats()["ladder"]
        return {"policy": policy, "tokens_held_before_first_loss": held, "turns": turns,
                "first_loss": next((k for k in ("evictions", "slides", "spill_reprefills") if s[k]), None),
                "lost_within_max_turns": bool(lost()), "seconds": round(time.perf_counter() - t0, 2), **s}


def run_simulate(seeds: int, chats: list[int]) -> list[dict]:
    from runtime_sim.simulate import LADDER_STRATEGIES, SimConfig, simulate, to_json

    out = []
    for n, seed in ((n, seed) for n in chats for seed in range(seeds)):
        res = to_json(simulate(SimConfig(seed=seed, chats=n), LADDER_STRATEGIES), with_series=False)
        row = {"chats": n, "seed": seed}
        for r in res["strategies"]:
            row[r["name"]] = {k: r[k] for k in ("peak_tokens_before_loss", "tokens_before_loss", "first_loss_event",
                                                 "losses", "turns_served", "pressure", "peak_flash_bytes")}
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=32, help="pool blocks (16 tokens each)")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--user", type=int, default=24, help="prompt tokens per turn")
    ap.add_argument("--decode", type=int, default=8, help="generated tokens per turn")
    ap.add_argument("--max-turns", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=3, help="simulate seeds (0 = skip the simulation)")
    ap.add_argument("--sim-chats", default="8,16", help="simulate: conversations alive at most (comma list)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = ap.parse_args(argv)
    engine = [run_engine(p, a.blocks, a.chats, a.user, a.decode, a.max_turns) for p in POLICIES]
    evict = max(1, engine[0]["tokens_held_before_first_loss"])
    print(f"engine: {a.blocks} blocks x 16 = {a.blocks * 16} tokens, {a.chats} chats, turns of {a.user}+{a.decode} "
          f"tokens, torch backend, tiny llama, {cpu_model()}")
    print("| policy | tokens held before first loss | x evict | first loss | turns | spills | restores | slides |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in engine:
        print(f"| {r['policy']} | {r['tokens_held_before_first_loss']} | "
              f"{r['tokens_held_before_first_loss'] / evict:.2f} | {r['first_loss'] or 'none'} | {r['turns']} | "
              f"{r['spills']} | {r['restores_from_spill']} | {r['slides']} |")
    sim = run_simulate(a.seeds, [int(x) for x in a.sim_chats.split(",")]) if a.seeds else []
    if sim:
        print("\nsimulate (SmolLM2-135M dims, default trace and pool, unlimited flash): peak tokens before first loss")
        print("| chats | seed | evict | ladder | ladder / evict | ladder spills | ladder losses | ladder peak flash |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for row in sim:
            ev, la = row["paged-quant-evict"], row["paged-quant-ladder"]
            print(f"| {row['chats']} | {row['seed']} | {ev['peak_tokens_before_loss']} | {la['peak_tokens_before_loss']} | "
                  f"{la['peak_tokens_before_loss'] / max(1, ev['peak_tokens_before_loss']):.2f} | "
                  f"{la['pressure']['spills']} | {la['losses']} | {la['peak_flash_bytes'] / 2**20:.0f} MiB |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "pressure_ladder.json").write_text(json.dumps({
        "cpu": cpu_model(), "params": vars(a) | {"out": str(a.out)}, "engine": engine, "simulate": sim}, indent=1) + "\n")
    print(f"\nwrote {a.out / 'pressure_ladder.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
