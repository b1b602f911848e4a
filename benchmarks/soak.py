"""Soak test of the runtime: thousands of batched decode steps across dozens of conversations with random
clears and new chats, for each pool policy, on a tiny exported model through onnxruntime.

Checks after every phase that the pool invariants hold, and at the end that every block is back on
the free list and that the process RSS stayed flat (the pool is preallocated; nothing should grow).

    python benchmarks/soak.py [--steps 3000] [--convs 24] [--json benchmarks/results/soak.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from export.artifacts import PoolRequest, export_artifacts  # noqa: E402
from runtime_sim.session import open_artifacts  # noqa: E402
from toolkit.errors import PoolExhausted  # noqa: E402
from toolkit.tiny_models import tiny_model  # noqa: E402


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def soak(art: Path, policy: str, steps: int, convs: int, seed: int) -> dict:
    rng = random.Random(seed)
    engine = open_artifacts(art, "onnxruntime", prefill_chunk=32)
    engine.policy = policy
    live: dict[int, int] = {}  # cid -> next token to feed

    def start_chat():
        cid = engine.new_conversation()
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 60))]
        try:
            logits = engine.prefill(cid, prompt)
        except PoolExhausted:
            engine.close(cid)
            return False
        live[cid] = int(np.argmax(logits))
        return True

    counts = {"clears": 0, "new_chats": 0, "exhausted": 0, "evictions": 0, "steps": 0, "tokens": 0}
    rss0 = rss_after_warmup = None
    t0 = time.perf_counter()
    for step in range(steps):
        if step == steps // 10:
            rss_after_warmup = rss_bytes()
        while len(live) < convs and len(engine.pool.live_sequences()) < engine.backend.layout.max_seqs:
            counts["new_chats"] += 1
            if not start_chat():
                break
        r = rng.random()
        if live and r < 0.01:  # a user clears a chat
            cid = rng.choice(list(live))
            engine.close(cid)
            del live[cid]
            counts["clears"] += 1
            continue
        batch = rng.sample(list(live), k=min(len(live), rng.randint(1, 6)))
        try:
            out = engine.step({cid: [live[cid]] for cid in batch})
        except PoolExhausted:
            counts["exhausted"] += 1  # policy "error": the app closes its oldest chat and carries on
            oldest = min(live, key=lambda c: engine.conversations[c].last_used)
            engine.close(oldest)
            del live[oldest]
            continue
        for cid, logits in out.items():
            live[cid] = int(np.argmax(logits))
        counts["steps"] += 1
        counts["tokens"] += len(batch)
        if step % 250 == 0:
            engine.pool.check_invariants()
    seconds = time.perf_counter() - t0
    counts["evictions"] = sum(c.evictions for c in engine.conversations.values())
    for cid in list(live):
        engine.close(cid)
    engine.pool.check_invariants()
    stats = engine.stats()
    rss_end = rss_bytes()
    return {
        "policy": policy,
        **counts,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(counts["tokens"] / seconds, 1),
        "blocks_free_at_end": stats["free_blocks"],
        "blocks_total": stats["total_blocks"],
        "all_blocks_returned": stats["free_blocks"] == stats["total_blocks"] and stats["sequences"] == 0,
        "rss_after_warmup_bytes": rss_after_warmup or rss0,
        "rss_end_bytes": rss_end,
        "rss_growth_bytes": rss_end - (rss_after_warmup or rss_end),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000, help="batched decode steps per policy")
    ap.add_argument("--convs", type=int, default=24, help="conversations alive at once")
    ap.add_argument("--pool-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "soak.json")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(tmp) / "tiny"
        export_artifacts("tiny-llama", art, ("onnx",), "default", PoolRequest(pool_tokens=a.pool_tokens,
                         max_seqs=a.convs), model_and_tokenizer=(tiny_model("llama"), None))
        rows = [soak(art, policy, a.steps, a.convs, a.seed) for policy in ("error", "evict", "sliding")]
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"steps": a.steps, "convs": a.convs, "pool_tokens": a.pool_tokens,
                                  "rows": rows}, indent=2) + "\n")
    cols = ["policy", "steps", "tokens", "new_chats", "clears", "exhausted", "evictions", "tokens_per_second",
            "all_blocks_returned", "rss_growth_bytes"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    ok = all(r["all_blocks_returned"] and r["rss_growth_bytes"] < 32 * 2**20 for r in rows)
    print("soak:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
