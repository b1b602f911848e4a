"""`make demo [MODEL=NAME]`: export a model (once; default SmolLM2-135M-Instruct), chat a few turns on the
paged K8/V4 pool, and print the pool's memory next to what an fp16 contiguous cache would need, with the
whole process's peak resident memory.

The export is a mobile configuration, by the size of the model's fp32 weights:
  * under ONNX's 2 GiB protobuf limit (the default model): ONNX with int4 linears (MatMulNBits) and an
    int4 token embedding (GatherBlockQuantized), ~100 MiB instead of 518 MiB of fp32 for SmolLM2, run on
    onnxruntime. The chat process never imports torch: its peak RSS is the runtime's, not the exporter's.
  * above it (Qwen2.5-Coder-1.5B: 6 GiB of fp32): the phone's .pte (8da4w-asym-e8h8 weights, one logits
    row per call) on ExecuTorch's runtime, as the Android app runs it; this export takes 40-70 minutes on
    2 cores (BENCHMARKS.md), and the chat process imports torch (ExecuTorch's Python runtime needs it).
The export runs in a child process (`--export`) whose third-party output (torch.onnx / onnxscript /
transformers warnings) goes to artifacts/export.log; our progress lines stay on the terminal.
"""

from __future__ import annotations

import argparse
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

DEFAULT_MODEL = "smollm2"
WEIGHTS = {"onnx": "int4-e4",  # export.formats.ONNX_WEIGHTS: int4 linears + int4 embedding
           "pte": "8da4w-asym-e8h8"}  # export.formats.PTE_WEIGHTS: the phone's .pte weights
ONNX_LIMIT_BYTES = 2**31  # protobuf's limit on one .onnx file: larger fp32 models export as .pte
POOL_TOKENS = 4096
MAX_CONTEXT = 8192  # what a contiguous engine preallocates per conversation
TURNS = [
    "Hi! In one sentence, what is a KV cache?",
    "Why does it grow during a long chat?",
    "Give me one tip to save memory on a phone.",
]


def art_dir(model: str) -> Path:
    return Path("artifacts") / Path(model).name.removesuffix(".gguf")


def exported_format(art: Path) -> str | None:
    """"onnx" or "pte" when art holds the demo's export (its weights and the K8 pool), else None."""
    try:
        m = read_manifest(art)
    except PagedKVError:
        return None
    if m.get("pool", {}).get("spec", {}).get("k_bits") != 8:
        return None
    for fmt, entry in m.get("artifacts", {}).items():
        if WEIGHTS.get(fmt) == entry.get("weights", "fp32"):
            return fmt
    return None


def peak_rss_bytes() -> int:
    """VmHWM: the most this process has had resident (what a phone's low-memory killer weighs)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def export_quietly(model: str) -> int:
    """The export, with fds 1/2 sent to export.log; progress goes to the terminal's stderr."""
    art = art_dir(model)
    log = art.parent / "export.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    progress = Console(file=terminal, stderr=True)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    warnings.simplefilter("ignore")
    try:
        from export.artifacts import PoolRequest, export_artifacts
        from toolkit.model_loading import load_model

        progress.print(f"[bold]loading {model}[/] (third-party output in {log})")
        hf, _ = load_model(model)
        fp32_bytes = 4 * sum(p.numel() for p in hf.parameters())
        del hf
        fmt = "onnx" if fp32_bytes < ONNX_LIMIT_BYTES else "pte"
        progress.print(f"[bold]exporting {model} to {art}[/]: {fp32_bytes / 2**30:.1f} GiB of fp32 weights -> "
                       f"{fmt} with {WEIGHTS[fmt]} weights (first run only; "
                       f"{'a few minutes' if fmt == 'onnx' else '40-70 minutes on 2 cores'})")
        export_artifacts(model, art, (fmt,), "default",
                         PoolRequest(pool_tokens=POOL_TOKENS, max_seqs=4 if fmt == "onnx" else 1),
                         onnx_weights=WEIGHTS["onnx"], pte_weights=WEIGHTS["pte"], console=progress, force=True,
                         **({"max_logits_rows": 1} if fmt == "pte" else {}))
    except PagedKVError as e:
        progress.print(f"[red]export failed: {e}[/] (details: {log})")
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime_sim.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a model name (`pagedkv models`), HF dir or .gguf "
                    f"(default {DEFAULT_MODEL})")
    ap.add_argument("--export", action="store_true", help=argparse.SUPPRESS)  # the child process
    a = ap.parse_args(argv)
    model = a.model or DEFAULT_MODEL
    if a.export:
        return export_quietly(model)
    out = Console()
    art = art_dir(model)
    if exported_format(art) is None:
        rc = subprocess.run([sys.executable, "-m", "runtime_sim.demo", "--export", "--model", model]).returncode
        if rc != 0:
            return rc
    from runtime_sim.chat import ChatSession
    from runtime_sim.session import open_artifacts

    fmt = exported_format(art)
    if fmt is None:
        out.print(f"[red]{art} holds no export the demo reads: remove it and run the demo again.[/]")
        return 2
    backend = "onnxruntime" if fmt == "onnx" else "executorch"
    engine = open_artifacts(art, backend)
    be = engine.backend
    kernel = "native kernel" if getattr(be, "native", True) else "standard-op fallback"
    out.print(f"[bold]model[/]: {model}; [bold]backend[/]: {backend} ({kernel}), "
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
    weights = sum(p.stat().st_size for p in art.glob(f"model.{fmt}*"))
    t.add_row(f"whole process: peak resident (VmHWM; weights {WEIGHTS[fmt]}, {weights / 2**20:.0f} MiB on disk)",
              f"{peak_rss_bytes():,}")
    out.print(t)
    chat.clear()
    out.print(f"after /clear: {engine.stats()['used_blocks']} blocks used, {engine.pool.num_free_blocks} free")
    return 0


if __name__ == "__main__":
    sys.exit(main())
