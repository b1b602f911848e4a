"""Soak test of the runtime, for each pool policy, on a tiny exported model through onnxruntime:

1. decode soak: thousands of batched decode steps across dozens of conversations with random clears and
   new chats;
2. chat soak (issue 21): thousands of `pagedkv chat`-like turns (ChatSession, tokenizer and a chat template
   that insists on alternating roles) on a small pool, mixing good turns with bad requests: messages too
   long for the pool, replies stopped by Ctrl-C, operations on unknown or closed conversations, empty
   steps, and forks and clears. Every bad request must fail with a PagedKVError (or stop, for Ctrl-C) and
   leave the pool consistent; a failed turn must leave its chat's history as it was.

Checks the pool invariants along the way, and at the end that every block is back on the free list and
that the process RSS stayed flat (the pool is preallocated; nothing should grow).

    python benchmarks/soak.py [--steps 3000] [--convs 24] [--turns 3000] [--json benchmarks/results/soak.json]
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
from runtime_sim.chat import ChatSession  # noqa: E402
from toolkit.errors import PagedKVError, PoolExhausted  # noqa: E402
from toolkit.tiny_models import tiny_bpe_tokenizer, tiny_model  # noqa: E402

WIKI = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
# a chat template that rejects two user messages in a row (as Mistral's and Gemma's do): a failed turn
# left in the history would break every later turn
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


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


def chat_soak(art: Path, policy: str, turns: int, chats: int, seed: int) -> dict:
    """Many chat turns, good and bad mixed, on one engine (see the module docstring)."""
    rng = random.Random(seed)
    lines = [ln for ln in WIKI.read_text(encoding="utf-8").splitlines() if 20 < len(ln) < 200][:4000]
    engine = open_artifacts(art, "onnxruntime", prefill_chunk=32, policy=policy)
    total = engine.stats()["total_blocks"]
    sessions = [ChatSession(engine) for _ in range(chats)]
    counts = {"turns": 0, "good_turns": 0, "exhausted": 0, "rolled_back": 0, "interrupted": 0,
              "bad_requests": 0, "clears": 0, "forks": 0, "reply_tokens": 0}
    rss_after_warmup = None
    t0 = time.perf_counter()
    for turn in range(turns):
        if turn == turns // 10:
            rss_after_warmup = rss_bytes()
        counts["turns"] += 1
        chat = rng.choice(sessions)
        r = rng.random()
        if r < 0.05:  # /clear
            chat.clear()
            counts["clears"] += 1
            continue
        if r < 0.10:  # fork the chat (a shared prefix), continue the fork a little, drop it
            if len(engine.pool.live_sequences()) < engine.backend.layout.max_seqs:
                f = engine.fork(chat.cid)
                try:
                    counts["reply_tokens"] += len(list(engine.generate(f, [rng.randrange(3, 500)], 3)))
                except PoolExhausted:
                    counts["exhausted"] += 1
                else:
                    counts["forks"] += 1
                engine.close(f)
            continue
        if r < 0.16:  # bad requests at the API: unknown/closed conversation, empty step, empty prompt
            for bad in (lambda: engine.step({10**6: [1]}), lambda: engine.close(10**6),
                        lambda: engine.prefill(10**6, [1]), lambda: engine.prefill(chat.cid, [])):
                try:
                    bad()
                except PagedKVError:
                    counts["bad_requests"] += 1
                else:
                    raise AssertionError("a bad request was accepted")
            continue
        if len(chat.messages) >= 24:  # a long chat: the user starts over (/clear) so turns stay short
            chat.clear()
            counts["clears"] += 1
        before = list(chat.messages)
        if r < 0.26:  # a message too long for the whole pool
            text = " ".join(rng.choice(lines) for _ in range(total * 2))
        else:
            text = rng.choice(lines)
        gen = chat.send(text, rng.randint(1, 12))
        try:
            if r > 0.95:  # Ctrl-C after the first piece of the reply
                next(gen, None)
                try:
                    gen.throw(KeyboardInterrupt)
                except (KeyboardInterrupt, StopIteration):
                    pass
                counts["interrupted"] += 1
            else:
                counts["reply_tokens"] += len("".join(gen))
                counts["good_turns"] += 1
        except PoolExhausted:
            counts["exhausted"] += 1
            if chat.messages != before:
                raise AssertionError("a failed turn stayed in the history")
            counts["rolled_back"] += 1
            if r >= 0.26 and policy == "error":  # a normal message did not fit: the user types /clear
                chat.clear()
                counts["clears"] += 1
        if turn % 200 == 0:
            engine.pool.check_invariants()
        if turn % 500 == 0:
            print(f"  chat soak, policy {policy}: turn {turn}/{turns}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    for chat in sessions:
        engine.close(chat.cid)
    engine.pool.check_invariants()
    stats = engine.stats()
    rss_end = rss_bytes()
    return {
        "policy": policy, **counts, "seconds": round(seconds, 1),
        "blocks_free_at_end": stats["free_blocks"], "blocks_total": stats["total_blocks"],
        "all_blocks_returned": stats["free_blocks"] == stats["total_blocks"] and stats["sequences"] == 0,
        "rss_after_warmup_bytes": rss_after_warmup, "rss_end_bytes": rss_end,
        "rss_growth_bytes": rss_end - (rss_after_warmup or rss_end),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000, help="batched decode steps per policy")
    ap.add_argument("--convs", type=int, default=24, help="conversations alive at once")
    ap.add_argument("--pool-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turns", type=int, default=3000, help="chat turns per policy (chat soak)")
    ap.add_argument("--chats", type=int, default=3, help="chats alive at once in the chat soak")
    ap.add_argument("--chat-pool-tokens", type=int, default=512)
    ap.add_argument("--chat-only", action="store_true", help="run only the chat soak; keep the decode rows of --json")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "soak.json")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.chat_only:
            old = json.loads(a.json.read_text())
            rows, a.steps, a.convs, a.pool_tokens = old["rows"], old["steps"], old["convs"], old["pool_tokens"]
        else:
            art = Path(tmp) / "tiny"
            export_artifacts("tiny-llama", art, ("onnx",), "default", PoolRequest(pool_tokens=a.pool_tokens,
                             max_seqs=a.convs), model_and_tokenizer=(tiny_model("llama"), None))
            rows = [soak(art, policy, a.steps, a.convs, a.seed) for policy in ("error", "evict", "sliding")]
        chat_art = Path(tmp) / "chat"
        tok = tiny_bpe_tokenizer([ln for ln in WIKI.read_text(encoding="utf-8").splitlines() if ln.strip()][:2000])
        tok.chat_template = ALTERNATING
        export_artifacts("tiny-llama", chat_art, ("onnx",), "default",
                         PoolRequest(pool_tokens=a.chat_pool_tokens, max_seqs=a.chats + 1),
                         model_and_tokenizer=(tiny_model("llama"), tok))
        chat_rows = [chat_soak(chat_art, policy, a.turns, a.chats, a.seed) for policy in ("error", "evict", "sliding")]
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"steps": a.steps, "convs": a.convs, "pool_tokens": a.pool_tokens,
                                  "rows": rows, "chat": {"turns": a.turns, "chats": a.chats,
                                                         "pool_tokens": a.chat_pool_tokens, "rows": chat_rows}},
                                 indent=2) + "\n")
    cols = ["policy", "steps", "tokens", "new_chats", "clears", "exhausted", "evictions", "tokens_per_second",
            "all_blocks_returned", "rss_growth_bytes"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    cols = ["policy", "turns", "good_turns", "exhausted", "rolled_back", "interrupted", "bad_requests", "clears",
            "forks", "all_blocks_returned", "rss_growth_bytes"]
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in chat_rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    ok = all(r["all_blocks_returned"] and r["rss_growth_bytes"] < 32 * 2**20 for r in rows + chat_rows)
    print("soak:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
