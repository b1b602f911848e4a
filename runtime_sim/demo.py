"""`make demo`: export SmolLM2-135M-Instruct (once), chat a few turns through onnxruntime on the paged
K8/V4 pool, and print the pool's memory next to what an fp16 contiguous cache would need, with the
whole process's peak resident memory.

The export is the mobile configuration: int4 linears (MatMulNBits) and an int4 token embedding
(GatherBlockQuantized), ~100 MiB instead of 518 MiB of fp32. It runs in a child process (`--export`)
whose third-party output (torch.onnx / onnxscript / transformers warnings) goes to
ART_DIR.parent / "export.log"; our progress lines stay on the terminal. The chat process never
imports torch, so its peak RSS is the runtime's, not the exporter's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

from toolkit.errors import PagedKVError
from toolkit.kv_spec import fp16_bytes_per_token  # no torch: the chat process stays the runtime alone
from toolkit.manifest import read_manifest

# The top of the stack, like the CLI: the chat runs on runtime_sim, the export (in the child process)
# on export/; nothing below imports this module.

ART_DIR = Path("artifacts/smollm2")
WEIGHTS = "int4-e4"  # export.formats.ONNX_WEIGHTS: int4 linears + int4 embedding
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
    onnx = m.get("artifacts", {}).get("onnx", {})
    return onnx.get("weights") == WEIGHTS and m["pool"]["spec"]["k_bits"] == 8


def peak_rss_bytes() -> int:
    """VmHWM: the most this process has had resident (what a phone's low-memory killer weighs)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def export_quietly() -> int:
    """The export, with fds 1/2 sent to export.log; progress goes to the terminal's stderr."""
    log = ART_DIR.parent / "export.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    progress = Console(file=terminal, stderr=True)
    progress.print(f"[bold]exporting SmolLM2-135M-Instruct to {ART_DIR} ({WEIGHTS} weights; first run only, "
                   f"a few minutes; third-party output in {log})[/]")
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    warnings.simplefilter("ignore")
    try:
        from export.artifacts import PoolRequest, export_artifacts

        export_artifacts("smollm2", ART_DIR, ("onnx",), "default", PoolRequest(pool_tokens=POOL_TOKENS, max_seqs=4),
                         onnx_weights=WEIGHTS, console=progress, force=True)
    except PagedKVError as e:
        progress.print(f"[red]export failed: {e}[/] (details: {log})")
        return 2
    return 0


def main() -> int:
    if "--export" in sys.argv[1:]:
        return export_quietly()
    out = Console()
    if not _artifacts_ready():
        rc = subprocess.run([sys.executable, "-m", "runtime_sim.demo", "--export"]).returncode
        if rc != 0:
            return rc
    from runtime_sim.chat import ChatSession
    from runtime_sim.session import open_artifacts

    engine = open_artifacts(ART_DIR, "onnxruntime")
    be = engine.backend
    out.print(f"[bold]backend[/]: onnxruntime ({'native kernel' if be.native else 'standard-op fallback'}), "
              f"KV spec {be.layout.spec.describe()}, pool preallocated: {engine.stats()['pool_bytes'] / 2**20:.1f} MiB "
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
    weights = sum(p.stat().st_size for p in ART_DIR.glob("model.onnx*"))
    t.add_row(f"whole process: peak resident (VmHWM; weights {WEIGHTS}, {weights / 2**20:.0f} MiB on disk)",
              f"{peak_rss_bytes():,}")
    out.print(t)
    chat.clear()
    out.print(f"after /clear: {engine.stats()['used_blocks']} blocks used, {engine.pool.num_free_blocks} free")
    return 0


if __name__ == "__main__":
    sys.exit(main())
