"""Save and restore a conversation (Engine.save / Engine.restore) against re-prefilling it, and the file
against llama.cpp's state file for the same conversation.

    python benchmarks/save_restore.py                       # ctx 2048 and 8192, 2 threads, 3 repeats
    python benchmarks/save_restore.py --ctx 2048 --repeats 1 --skip-llamacpp

Model: SmolLM2-135M-Instruct; ours = the `default` KV spec (K8/V4, rotation, fp16 sink and tail) .onnx with
int4 MatMulNBits weights on onnxruntime with the native kernel (the e2e benchmark's `ours-onnx-int4`
artifact, exported once into ~/.cache/pagedkv/bench-artifacts and shared with benchmarks/e2e.py). For each
context the first `ctx` tokens of wikitext-2 (test) are prefilled in chunks of 64, then, per repeat:

  save       Engine.save to a file (gather the blocks' records, write, fsync, rename)
  restore    Engine.restore of that file into the pool (read, CRC-32, checks, scatter into fresh blocks);
             the file was just written, so it is read from the OS page cache, not from flash
  prefill    the same tokens prefilled again into an empty conversation (what a restart costs without a file)

and the next token's logits after the restore must equal those after the re-prefill bit for bit.
With --compact-artifacts (an export with a compact region) a second row does the same with the
conversation compacted before the save (runtime_sim.compact.compact_aged, blocks older than
--compact-horizon re-quantized to the compact spec): the file holds those blocks as compact records;
its re-prefill is compacted the same way (compact_s, not in prefill_s) before the logits are compared.

llama.cpp (llama-cpp-python==0.3.36, built for this CPU's instruction set by benchmarks/llamacpp_peer.py,
on the GGUF the same model comes from): the same tokens evaluated with an f16 (and a q8_0/q4_0) KV
cache, then `llama_state_seq_save_file` (the sequence's KV cells and its tokens, the file a chat app keeps)
and `llama_state_seq_load_file` into a fresh context, timed, and the file's size; also the size of
`llama_state_seq_get_size` (the sequence state in memory).

Writes --json (default benchmarks/results/save_restore.json) and prints a markdown table and the targets:
restore at 8K at least 20x faster than re-prefill; our file at most 0.45x llama.cpp's f16 state file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.e2e import DEFAULT_TEXT, cpu_model, ensure_artifact, last_json, prepare_ids, worker_env  # noqa: E402
from benchmarks.llamacpp_peer import build_flags, cache_root, ensure_llamacpp, llamacpp_python  # noqa: E402

LLAMACPP_SCRIPT = r"""
import ctypes, json, os, sys, time
import llama_cpp
a = json.loads(sys.argv[1])
ids = json.load(open(a["ids"]))[:a["ctx"]]
types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
def make():
    return llama_cpp.Llama(model_path=a["gguf"], n_ctx=-(-(a["ctx"] + 64) // 256) * 256, n_batch=512, n_ubatch=512,
                           n_threads=a["threads"], n_threads_batch=a["threads"], flash_attn=True,
                           type_k=types[a["k"]], type_v=types[a["v"]], verbose=False, use_mmap=True)
llm = make()
t0 = time.perf_counter(); llm.eval(ids); prefill_s = time.perf_counter() - t0
seq_bytes = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
path = a["path"].encode()
toks = (llama_cpp.llama_token * len(ids))(*ids)
saves, loads = [], []
for _ in range(a["repeats"]):
    fresh = make()  # an empty context to load into (a restarted app)
    t0 = time.perf_counter()
    n = llama_cpp.llama_state_seq_save_file(llm.ctx, path, 0, toks, len(ids))
    fd = os.open(a["path"], os.O_RDONLY); os.fsync(fd); os.close(fd)  # as durable as ours (we fsync)
    saves.append(time.perf_counter() - t0)
    out = (llama_cpp.llama_token * (len(ids) + 8))()
    count = ctypes.c_size_t(0)
    t0 = time.perf_counter()
    got = llama_cpp.llama_state_seq_load_file(fresh.ctx, path, 0, out, len(ids) + 8, ctypes.byref(count))
    loads.append(time.perf_counter() - t0)
    assert got > 0 and count.value == len(ids), (got, count.value)
    del fresh
print(json.dumps({"prefill_s": prefill_s, "seq_state_bytes": int(seq_bytes), "file_bytes": os.path.getsize(a["path"]),
                  "save_s": saves, "restore_s": loads, "version": llama_cpp.__version__}))
"""


def log(msg: str) -> None:
    print(f"[save_restore {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_ours(art: Path, ids: list[int], ctx: int, threads: int, repeats: int, tmp: Path,
             horizon: int | None = None) -> dict:
    """horizon: compact the conversation before saving it (runtime_sim.compact.compact_aged: every block
    ending at least `horizon` tokens back, into the export's compact region), as the adaptive policy would
    have; the re-prefilled conversation is compacted the same way (timed apart) before its logits are compared."""
    import numpy as np

    from runtime_sim.compact import compact_aged
    from runtime_sim.session import open_artifacts

    engine = open_artifacts(art, "onnxruntime", native=True, threads=threads, prefill_chunk=64)
    prompt, nxt = ids[:ctx], [ids[ctx]]
    conv = engine.new_conversation()
    engine.prefill(conv, prompt)  # warm-up prefill (first-call allocations), not timed
    compacted, compact_s = [], []

    def compact(c):
        if horizon is not None:
            t0 = time.perf_counter()
            compacted.append(len(compact_aged(engine, c, horizon)))
            compact_s.append(time.perf_counter() - t0)

    compact(conv)
    path = tmp / f"ours-{ctx}.pkvc"
    saves, restores, prefills, equal = [], [], [], []
    for rep in range(repeats):
        t0 = time.perf_counter()
        size = engine.save(conv, path)
        saves.append(time.perf_counter() - t0)
        engine.close(conv)
        t0 = time.perf_counter()
        conv = engine.restore(path)
        restores.append(time.perf_counter() - t0)
        restored = engine.step({conv: nxt})[conv]
        engine.close(conv)
        conv = engine.new_conversation()
        t0 = time.perf_counter()
        engine.prefill(conv, prompt)
        prefills.append(time.perf_counter() - t0)
        compact(conv)
        reprefilled = engine.step({conv: nxt})[conv]
        equal.append(bool(np.array_equal(restored, reprefilled)))
        if rep < repeats - 1:
            engine.clear(conv)
            engine.prefill(conv, prompt)  # the conversation to save next time: exactly `ctx` tokens
            compact(conv)
    lay = engine.backend.layout
    out = {"file_bytes": size, "save_s": saves, "restore_s": restores, "prefill_s": prefills,
           "logits_equal": equal, "kv_bytes_in_use": engine.stats()["kv_bytes_in_use"],
           "bytes_per_token": lay.bytes_per_token, "stage_bytes": lay.stage_bytes_per_sequence,
           "kernel_isa": os.environ.get("PAGEDKV_ISA", "auto"), "artifacts": str(art),
           "onnx_weights": engine.manifest.get("artifacts", {}).get("onnx", {}).get("weights", "fp32")}
    if horizon is not None:
        out.update({"compact_horizon": horizon, "compacted_blocks": compacted, "compact_s": compact_s,
                    "compact_spec": lay.compact.describe(), "compact_bytes_per_token": lay.compact_bytes_per_token})
    return out


def run_llamacpp(venv: Path, gguf: str, ids_file: Path, ctx: int, threads: int, repeats: int, kv: str,
                 tmp: Path) -> dict:
    k, v = kv.split("/")
    arg = json.dumps({"ids": str(ids_file), "ctx": ctx, "gguf": gguf, "threads": threads, "repeats": repeats,
                      "k": k, "v": v, "path": str(tmp / f"llama-{ctx}-{k}.bin")})
    p = subprocess.run([str(llamacpp_python(venv)), "-c", LLAMACPP_SCRIPT, arg], capture_output=True, text=True,
                       timeout=3600, env=worker_env(threads))
    res = last_json(p.stdout)
    if p.returncode != 0 or res is None:
        return {"ok": False, "error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-3:]}"}
    return {"ok": True, **res}


def med(xs):
    return statistics.median(xs) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--llamacpp-venv", type=Path, default=None,
                    help="default ~/.cache/pagedkv/llamacpp-<isa>-venv (benchmarks/llamacpp_peer.py)")
    ap.add_argument("--artifacts", type=Path, default=None,
                    help="a SmolLM2 onnx-int4 artifacts dir to use (default: the e2e benchmark's, exported once)")
    ap.add_argument("--llamacpp-kv", nargs="+", default=["f16/f16", "q8_0/q4_0"], choices=["f16/f16", "q8_0/q4_0"],
                    help="llama.cpp KV cache types to run (default both; q8_0/q4_0 prefills ~5x slower here)")
    ap.add_argument("--compact-artifacts", type=Path, default=None,
                    help="a SmolLM2 onnx export with a compact region (pagedkv export --compact-blocks N): adds a "
                         "row whose conversation is compacted (blocks older than --compact-horizon) before the save")
    ap.add_argument("--compact-horizon", type=int, default=1024)
    ap.add_argument("--dir", type=Path, default=None, help="where the files are written (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "save_restore.json")
    args = ap.parse_args(argv)

    from toolkit.model_registry import model_file

    ids_file = prepare_ids(DEFAULT_TEXT, max(args.ctx))
    ids = json.loads(ids_file.read_text())
    pool_tokens = max(8192, max(args.ctx)) + 64
    art = {"ok": True, "dir": str(args.artifacts)} if args.artifacts else ensure_artifact(cache_root() / "bench-artifacts" / f"smollm2-default-p{pool_tokens}-s1", "onnx-int4",
                          "default", pool_tokens, args.threads, 7200)
    if not art["ok"]:
        raise SystemExit(f"export failed: {art['error']}")
    llama_ok, llama_version = (False, "skipped")
    if not args.skip_llamacpp:
        llama_ok, llama_version = ensure_llamacpp(args.llamacpp_venv)
        if not llama_ok:
            log(f"llama.cpp unavailable: {llama_version}")
    gguf = str(model_file("smollm2"))
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        for ctx in args.ctx:
            log(f"ctx {ctx}: ours")
            row = {"ctx": ctx, "ours": run_ours(Path(art["dir"]), ids, ctx, args.threads, args.repeats, tmp)}
            (tmp / f"ours-{ctx}.pkvc").unlink(missing_ok=True)
            if args.compact_artifacts:
                log(f"ctx {ctx}: ours, compacted (horizon {args.compact_horizon})")
                row["ours_compacted"] = run_ours(args.compact_artifacts, ids, ctx, args.threads, args.repeats, tmp,
                                                 horizon=args.compact_horizon)
            for kv in (args.llamacpp_kv if llama_ok else []):
                log(f"ctx {ctx}: llama.cpp {kv}")
                row[f"llamacpp_{kv.replace('/', '_')}"] = run_llamacpp(args.llamacpp_venv, gguf, ids_file, ctx,
                                                                       args.threads, args.repeats, kv, tmp)
            rows.append(row)
            (tmp / f"ours-{ctx}.pkvc").unlink(missing_ok=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)  # what is measured so far (a long run)
            args.json.with_suffix(".partial.json").write_text(json.dumps(rows, indent=1))

    lines = ["| ctx | ours | our file | save | restore | re-prefill | restore speed-up | logits equal | llama.cpp f16 "
             "state file | ours / f16 | llama.cpp f16 save / load | llama.cpp q8_0/q4_0 file |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    targets = []
    mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    for r in rows:
        f16, q = r.get("llamacpp_f16_f16", {}), r.get("llamacpp_q8_0_q4_0", {})
        for key in ("ours", "ours_compacted"):
            if key not in r:
                continue
            o = r[key]
            label = "default" if key == "ours" else f"compacted (older than {o['compact_horizon']})"
            speed = med(o["prefill_s"]) / med(o["restore_s"])
            ratio = o["file_bytes"] / f16["file_bytes"] if f16.get("ok") else None
            r["summary" if key == "ours" else "summary_compacted"] = {
                "save_s": med(o["save_s"]), "restore_s": med(o["restore_s"]), "prefill_s": med(o["prefill_s"]),
                "restore_speedup": speed, "file_vs_llamacpp_f16": ratio}
            lines.append(
                f"| {r['ctx']} | {label} | {mb(o['file_bytes'])} | {med(o['save_s']) * 1e3:.0f} ms | "
                f"{med(o['restore_s']) * 1e3:.0f} ms | {med(o['prefill_s']):.2f} s | {speed:.0f}x | {all(o['logits_equal'])} | "
                + (f"{mb(f16['file_bytes'])} | {ratio:.3f}x | {med(f16['save_s']) * 1e3:.0f} / "
                   f"{med(f16['restore_s']) * 1e3:.0f} ms | " if f16.get("ok") else "- | - | - | ")
                + (f"{mb(q['file_bytes'])} |" if q.get("ok") else "- |"))
            if r["ctx"] == 8192:
                targets.append(f"{label}: restore at 8K {speed:.0f}x faster than re-prefill (target >= 20x): "
                               f"{'met' if speed >= 20 else 'NOT met'}")
            if ratio is not None:
                targets.append(f"{label}: file at {r['ctx']} = {ratio:.3f}x llama.cpp's f16 state file (target <= "
                               f"0.45x): {'met' if ratio <= 0.45 else 'NOT met'}")
    print("\n".join(lines + [""] + targets))
    out = {"benchmark": "save_restore", "model": "SmolLM2-135M-Instruct", "spec": "default",
           "ours": "onnxruntime, native pagedkv kernel (each row's onnx_weights: int4 MatMulNBits or fp32)", "threads": args.threads,
           "repeats": args.repeats, "cpu": platform.processor() or platform.machine(),
           "cpu_model": cpu_model(),
           "llama_cpp": llama_version, "llamacpp_build": build_flags() if llama_ok else None, "rows": rows, "targets": targets,
           "command": "python benchmarks/save_restore.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
