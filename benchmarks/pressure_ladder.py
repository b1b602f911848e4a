"""How many tokens a fixed pool holds before the first loss, per pool policy (issue #25, item 3).

Two measurements, both written to results/pressure_ladder.json:

1. engine: the real runtime_sim Engine on the torch backend with a tiny random Llama (2 layers, the
   default K8/V4 spec; the model only makes the calls real, the counts do not depend on it). A pool
   of --blocks blocks of 16 tokens; --chats conversations take turns round-robin (--user prompt
   tokens, then --decode greedy tokens each), each growing past the whole pool, until the first loss:
   an eviction (evict: a cache dropped, prefilled again later), a slide (sliding, adaptive: old K/V
   dropped) or a spill that had to be prefilled again. "held" is the tokens of every conversation
   whose K/V is kept (in the pool, or in a spill file for adaptive) after the last turn without a loss
   (a lower bound: one turn of granularity); "resident" the most of them in the pool at once before
   the first spill or loss. `adaptive+compact` is adaptive on a model with a compact region in the same
   pool bytes, split by simulate.compact_split_layout (--compact-share, default auto: default blocks for
   every chat's --horizon and one turn, the rest compact), aged blocks --horizon tokens back.
2. simulate: `pagedkv simulate`'s phone model (SmolLM2-135M dims, the default trace, with --sim-chats
   conversations alive at most) for seeds 0..N-1, pools of --sim-pool-mb (default: the simulator's,
   two contiguous 8K caches = 360 MiB; and 120 MiB): the most tokens held at once before the first loss
   by paged-quant-evict, paged-quant-ladder (spill, slide) and paged-quant-compact (compact, spill,
   slide; its split by --compact-share as above, for --sim-chats and horizon 1,024), with unlimited flash
   and with none (RAM only). Where a ladder loses nothing in the trace,
   its number is the trace's peak demand, a lower bound of what it could hold.
The compact tier's fidelity cost is read from results/compact_tier.json (benchmarks/compact_tier.py).

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

POLICIES = ("evict", "sliding", "adaptive", "adaptive+compact")
SIM_POLICIES = ("paged-quant-evict", "paged-quant-ladder", "paged-quant-compact")


def run_engine(policy: str, blocks: int, chats: int, user: int, decode: int, max_turns: int, horizon: int,
               share: float | str = "auto") -> dict:
    import numpy as np

    from runtime_sim.backends import TorchBackend
    from runtime_sim.engine import Engine
    from runtime_sim.simulate import compact_split_layout
    from toolkit.compiler import compile
    from toolkit.tiny_models import tiny_model

    model = tiny_model("llama")
    paged = compile(model, "default", num_blocks=blocks, max_seqs=chats)
    if policy == "adaptive+compact":  # the same pool bytes, part of them a compact region
        split = compact_split_layout(paged.layout, paged.layout.total_bytes, share, chats, horizon, user + decode)
        paged = compile(model, "default", num_blocks=split.num_blocks, max_seqs=chats,
                        compact_blocks=split.num_compact_blocks)
    lay = paged.layout
    with tempfile.TemporaryDirectory(prefix="pressure-ladder-") as spill_dir:
        e = Engine(TorchBackend(paged), prefill_chunk=16, policy=policy.split("+")[0], spill_dir=spill_dir,
                   compact_horizon=horizon)
        cids = [e.new_conversation() for _ in range(chats)]
        lost = lambda: e.counters.evictions + e.counters.slides + e.counters.spill_reprefills  # noqa: E731
        held = resident = turns = 0
        rng = np.random.default_rng(0)
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
            if not e.counters.spills:
                resident = held
        e.check_invariants()
        s = e.stats()["ladder"]
        return {"policy": policy, "tokens_held_before_first_loss": held, "resident_before_first_spill": resident,
                "turns": turns, "pool_bytes": lay.total_bytes, "num_blocks": lay.num_blocks,
                "num_compact_blocks": lay.num_compact_blocks,
                "first_loss": next((k for k in ("evictions", "slides", "spill_reprefills") if s[k]), None),
                "lost_within_max_turns": bool(lost()), "seconds": round(time.perf_counter() - t0, 2),
                **{k: v for k, v in s.items() if k != "policy"}}


def run_simulate(seeds: int, chats: list[int], pools_mb: list[float | None], share: float | str = "auto") -> list[dict]:
    from runtime_sim.simulate import SimConfig, simulate, to_json

    out = []
    for n, pool, flash, seed in ((n, p, f, seed) for n in chats for p in pools_mb for f in (None, 0)
                                 for seed in range(seeds)):
        cfg = SimConfig(seed=seed, chats=n, pool_bytes=None if pool is None else int(pool * 2**20), flash_bytes=flash,
                        compact_share=share)
        res = to_json(simulate(cfg, SIM_POLICIES), with_series=False)
        row = {"chats": n, "seed": seed, "pool_bytes": res["params"]["pool_bytes"], "flash": "none" if flash == 0
               else "unlimited"}
        for r in res["strategies"]:
            row[r["name"]] = {k: r.get(k) for k in ("peak_tokens_before_loss", "tokens_before_loss", "first_loss_event",
                                                     "losses", "turns_served", "pressure", "peak_flash_bytes",
                                                     "capacity_tokens", "compact_spec", "num_compact_blocks")}
        out.append(row)
    return out


def compact_cost() -> dict | None:
    """The compact tier's measured cost over the 8K stream (results/compact_tier.json), if present."""
    path = REPO / "benchmarks" / "results" / "compact_tier.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    rows = [r for r in data.get("rows", data.get("results", [])) if isinstance(r, dict)]
    return {"source": str(path.relative_to(REPO)), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=32, help="pool blocks (16 tokens each)")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--user", type=int, default=24, help="prompt tokens per turn")
    ap.add_argument("--decode", type=int, default=8, help="generated tokens per turn")
    ap.add_argument("--max-turns", type=int, default=400)
    ap.add_argument("--horizon", type=int, default=16, help="engine, adaptive+compact: recent tokens kept default "
                    "(one block: this pool is tiny)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES, help="engine policies to run")
    ap.add_argument("--seeds", type=int, default=3, help="simulate seeds (0 = skip the simulation)")
    ap.add_argument("--sim-chats", default="8,16", help="simulate: conversations alive at most (comma list)")
    ap.add_argument("--sim-pool-mb", default="default,120", help="simulate: pool budgets in MiB (comma list; "
                    "'default' = the simulator's)")
    ap.add_argument("--compact-share", default="auto", type=lambda x: x if x == "auto" else float(x),
                    help="the compact region's share of the pool bytes, or auto (default; simulate.compact_split_layout)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = ap.parse_args(argv)
    engine = [run_engine(p, a.blocks, a.chats, a.user, a.decode, a.max_turns, a.horizon, a.compact_share)
              for p in a.policies]
    evict = max(1, next((r["tokens_held_before_first_loss"] for r in engine if r["policy"] == "evict"), 1))
    print(f"engine: {a.blocks} blocks x 16 = {a.blocks * 16} tokens ({engine[0]['pool_bytes']} pool bytes), {a.chats} "
          f"chats, turns of {a.user}+{a.decode} tokens, torch backend, tiny llama, {cpu_model()}")
    print("| policy | tokens held before first loss | x evict | resident before first spill | first loss | turns | "
          "compacted blocks | spills | restores | slides |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in engine:
        print(f"| {r['policy']} | {r['tokens_held_before_first_loss']} | "
              f"{r['tokens_held_before_first_loss'] / evict:.2f} | {r['resident_before_first_spill']} | "
              f"{r['first_loss'] or 'none'} | {r['turns']} | {r.get('compacted_blocks', 0)} | "
              f"{r['spills']} | {r['restores_from_spill']} | {r['slides']} |")
    pools = [None if x == "default" else float(x) for x in a.sim_pool_mb.split(",")]
    sim = run_simulate(a.seeds, [int(x) for x in a.sim_chats.split(",")], pools, a.compact_share) if a.seeds else []
    if sim:
        print("\nsimulate (SmolLM2-135M dims, default trace): peak tokens held before the first loss")
        print("| chats | pool | flash | seed | evict | ladder | compact ladder | ladder / evict | compact / evict | "
              "compact: compactions, spills, losses |")
        print("|---:|---:|---|---|---:|---:|---:|---:|---:|---|")
        for row in sim:
            ev, la, co = (row[k] for k in SIM_POLICIES)
            e = max(1, ev["peak_tokens_before_loss"])
            print(f"| {row['chats']} | {row['pool_bytes'] / 2**20:.0f} MiB | {row['flash']} | {row['seed']} | "
                  f"{ev['peak_tokens_before_loss']} | {la['peak_tokens_before_loss']} | {co['peak_tokens_before_loss']} | "
                  f"{la['peak_tokens_before_loss'] / e:.2f} | {co['peak_tokens_before_loss'] / e:.2f} | "
                  f"{co['pressure']['compactions']}, {co['pressure']['spills']}, {co['losses']} |")
    cost = compact_cost()
    if cost:
        default = next((r for r in cost["rows"] if r["candidate"] == "default"), None)
        print("\ncompact tier cost (" + cost["source"] + ", 8K stream, blocks older than 1K compact):")
        for r in cost["rows"]:
            if r["compact_spec"] != "-":
                print(f"  {r['compact_spec']}: {r['bytes_per_token_vs_fp16']}x fp16 bytes, PPL "
                      f"{r['ppl_vs_default_pct']:+.2f}% vs all-default ({default and default['compact_spec']}), "
                      f"KLD {r['kld_vs_default']}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "pressure_ladder.json").write_text(json.dumps({
        "cpu": cpu_model(), "params": vars(a) | {"out": str(a.out)}, "engine": engine, "simulate": sim,
        "compact_tier_cost": cost}, indent=1) + "\n")
    print(f"\nwrote {a.out / 'pressure_ladder.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
