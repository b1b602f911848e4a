"""`make demo`: export SmolLM2-135M-Instruct (once), chat a few turns through onnxruntime on the paged
K8/V4 pool, and print the pool's memory next to what an fp16 contiguous cache would need."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from export.artifacts import PoolRequest, export_artifacts
from toolkit.manifest import read_manifest
from runtime_sim.chat import ChatSession
from runtime_sim.session import open_artifacts
from toolkit.errors import PagedKVError
from toolkit.quant import fp16_bytes_per_token

ART_DIR = Path("artifacts/smollm2")
POOL_TOKENS = 4096
MAX_CONTEXT = 8192  # what a contiguous engine preallocates per conversation
TURNS = [
    "Hi! In one sentence, what is a KV cache?",
    "Why does it grow during a long chat?",
    "Give me one tip to save memory on a phone.",
]


def _artifacts_ready() -> bool:
    try:
        m = read_manifest(ART_DIR)
    except PagedKVError:
        return False
    return "onnx" in m.get("artifacts", {}) and m["pool"]["spec"]["k_bits"] == 8


def main() -> int:
    out = Console()
    err = Console(stderr=True)
    if not _artifacts_ready():
        err.print(f"[bold]exporting SmolLM2-135M-Instruct to {ART_DIR} (first run only)[/]")
        export_artifacts("smollm2", ART_DIR, ("onnx",), "default", PoolRequest(pool_tokens=POOL_TOKENS, max_seqs=4),
                         force=True)
    engine = open_artifacts(ART_DIR, "onnxruntime")
    be = engine.backend
    out.print(f"[bold]backend[/]: onnxruntime ({'native kernel' if be.native else 'standard-op fallback'}), "
              f"KV spec {be.layout.spec.describe()}, pool preallocated: {be.layout.total_bytes / 2**20:.1f} MiB "
              f"in {3 * be.layout.num_layers} allocations of at most {be.layout.largest_allocation_bytes / 2**20:.2f} MiB")
    chat = ChatSession(engine, system_prompt="You are a concise assistant.")
    for turn in TURNS:
        out.print(f"\n[bold cyan]user[/]: {turn}")
        out.print("[bold green]assistant[/]: ", end="")
        for piece in chat.send(turn, max_new_tokens=60):
            out.print(piece, end="", soft_wrap=True)
        out.print()

    s = engine.stats()
    lay = be.layout
    held = engine.pool.length(engine.conversations[chat.cid].seq)
    fp16_same = held * fp16_bytes_per_token(lay.num_kv_heads, lay.head_dim, lay.num_layers)
    fp16_contig = MAX_CONTEXT * fp16_bytes_per_token(lay.num_kv_heads, lay.head_dim, lay.num_layers)
    t = Table(title=f"KV memory after {len(TURNS)} turns ({held} tokens cached)")
    t.add_column("what")
    t.add_column("bytes", justify="right")
    t.add_row("paged K8/V4 pool: in use (blocks + fp16 tail/sink)", f"{s['kv_bytes_in_use']:,}")
    t.add_row("fp16 cache for the same tokens", f"{fp16_same:,}")
    t.add_row(f"fp16 contiguous cache preallocated at {MAX_CONTEXT} tokens", f"{fp16_contig:,}")
    t.add_row("blocks used / total", f"{s['used_blocks']} / {s['total_blocks']}")
    t.add_row("utilization / internal fragmentation", f"{s['utilization']:.2f} / {s['internal_fragmentation']:.2f}")
    t.add_row("prefill / decode tokens per second", f"{s['prefill_tok_s']:.1f} / {s['decode_tok_s']:.1f}")
    out.print(t)
    chat.clear()
    out.print(f"after /clear: {engine.stats()['used_blocks']} blocks used, {engine.pool.num_free_blocks} free")
    return 0


if __name__ == "__main__":
    sys.exit(main())
