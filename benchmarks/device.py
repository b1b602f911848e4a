"""The on-device path side by side with llama.cpp: speed, time to first token and whole-process memory.

    python benchmarks/device.py                       # ctx 2048 8192, 1 thread, 3 interleaved repeats
    python benchmarks/device.py --ctx 2048 --repeats 1 --systems runner-pte-8da4w llamacpp-f16
    python benchmarks/device.py --json out.json --skip-llamacpp
    python benchmarks/device.py --model qwen2.5-coder-1.5b --ctx 8192 --repeats 1 \
        --systems runner-pte-8da4w-asym-e8h8 llamacpp-f16 --json benchmarks/results/device_qwen.json

Model: --model, a registered name (`pagedkv models`; default smollm2, SmolLM2-135M-Instruct's Q4_1 GGUF).
Our artifacts are exported from the GGUF's fp32 dequantization, llama.cpp runs the GGUF itself. Prompt: the first ctx tokens of
wikitext-2 (test), then --decode greedy tokens (no stop). Every (system, ctx, repeat) runs in its own
process, systems interleaved (order rotated per ctx and repeat); the table keeps medians of the
repeats (peak RSS: the largest). All systems use the same --threads.

Systems:
  runner-pte-8da4w      android_demo/native's pagedkv-runner (the app's Runner class, C++): .pte with
  runner-pte-8da4w-e8   8da4w linears (XNNPACK), e8 = token embedding int8 too (embedding_byte);
  runner-pte-8da4w-asym-e8h8  asymmetric int4 linears (exact on the GGUF's Q4_1 grid), int8 activations
                        per 192 inputs, int8 head and embedding (export/executorch_export.py: the
                        .pte weights without 8da4w's +65% PPL); the pool budget covers ctx + decode
                        tokens (the app sizes it from its budget)
  sim-onnx-int4         runtime_sim on onnxruntime (int4 MatMulNBits, native kernel), Python;
  sim-onnx-int4-e4      e4 = token embedding int4 too (GatherBlockQuantized)
  llamacpp-f16          llama-cpp-python==0.3.36, flash_attn, KV f16 / q8_0 K + q4_0 V; built from
  llamacpp-q8q4         source with AVX-512 (+VNNI, AMX off) on AVX-512 CPUs, else AVX2 (DESIGN.md, Peers)
Our kernel takes its best code path on the CPU (avx512-vnni on AVX-512 VNNI machines, avx2 else).

Columns: ttft_s = prefill of ctx tokens + the first token; prefill_tok_s = ctx / ttft; decode_tok_s =
greedy steps after the first token per second; peak_rss_bytes = VmHWM of the process; kv_bytes = KV
the context holds (ours: blocks in use + the fp16 stage; llama.cpp: layers x kv_heads x head_dim x ctx
x bytes per value); weights_resident_bytes = resident pages of the mapped weight file at the end (the
runner maps the .pte; llama.cpp mmaps the GGUF; onnxruntime reads the .onnx into its heap: 0).
Rows also carry each system's own breakdown; `pagedkv plan`'s whole-process estimate is checked
against the runner's measured peak (plan_estimate_bytes, plan_error).

Writes --json (default benchmarks/results/device.json) and prints a markdown table and the targets.
This file imports only the standard library at the top: its --worker modes run in llama.cpp's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from e2e import cpu_model, last_json, median, tail  # the shared helpers of the e2e benchmark (benchmarks/ is on sys.path)
from llamacpp_peer import build_flags, cache_root, default_venv, ensure_llamacpp

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()
DEFAULT_TEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
RUNNER_CLI = REPO / "build" / "android-host" / "pagedkv-runner"  # --runner overrides
# the longest context SmolLM2 allows (max_position_embeddings): where the 0.6x-of-llama.cpp-f16 target applies
LONGEST_CTX = 8192
# bumped when an exporter changes what a format stores (onnx v2: int4 blocks repacked on their GGUF grid;
# pte-8da4w-asym-e8h8 v2: block sums by reshape + a [1, 32] linear instead of [K/32, K] 0/1 matrices;
# pte v2 / asym v3: one logits row per call, the runner's need, so the arena holds no [64, vocab] logits)
EXPORT_VERSIONS = {"onnx": "v2", "pte": "v2", "pte-8da4w-asym-e8h8": "v3"}

SYSTEMS: dict[str, dict] = {
    "runner-pte-8da4w": {"kind": "runner", "art": "pte-8da4w", "weights": "8da4w (int4 linears, fp32 embedding)"},
    "runner-pte-8da4w-e8": {"kind": "runner", "art": "pte-8da4w-e8", "weights": "8da4w + int8 embedding"},
    "runner-pte-8da4w-asym-e8h8": {"kind": "runner", "art": "pte-8da4w-asym-e8h8",
                                   "weights": "asymmetric int4 linears (exact on the Q4_1 grid), int8 head + embedding"},
    "sim-onnx-int4": {"kind": "ort", "art": "onnx-int4", "weights": "int4 MatMulNBits"},
    "sim-onnx-int4-e4": {"kind": "ort", "art": "onnx-int4-e4", "weights": "int4 + int4 embedding (GatherBlockQuantized)"},
    "llamacpp-f16": {"kind": "llamacpp", "kv_types": "f16/f16", "weights": "Q4_1 (GGUF)", "kv": "f16"},
    "llamacpp-q8q4": {"kind": "llamacpp", "kv_types": "q8_0/q4_0", "weights": "Q4_1 (GGUF)",
                      "kv": "q8_0 K / q4_0 V"},
}
ROW_KEYS = ("system", "weights", "kv", "ctx", "threads", "ttft_s", "prefill_tok_s", "decode_tok_s",
            "peak_rss_bytes", "kv_bytes", "weights_resident_bytes")


def log(msg: str) -> None:
    print(f"[device {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# worker side (own process; standard library + what the system itself needs)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def mapped_resident(paths) -> int:
    """Resident bytes of this process's mappings of the given files (/proc/self/smaps)."""
    want = {str(Path(p).resolve()) for p in paths}
    total, current = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Pss")) and ":" not in head[0]:
            current = head[5].strip() if len(head) == 6 else None
        elif line.startswith("Rss:") and current in want:
            total += int(line.split()[1]) * 1024
    return total


def worker(args) -> dict:
    sys.path.insert(0, str(HERE.parent))
    import _e2e_worker as w  # noqa: E402  (standard library + numpy at the top)

    ctx = args.ctx[0]  # --ctx takes a list; a worker measures one
    ids = w.load_ids(args.ids, ctx)
    ns = argparse.Namespace(steps=args.decode - 1, warmup=0, threads=args.threads, kv=args.kv, gguf=args.gguf,
                            art=args.art, system="ours-onnx")
    if args.worker == "llamacpp":
        decode_s, kv, extra = w.run_llamacpp(ns, ids)
        weights = mapped_resident([args.gguf])
    else:
        decode_s, kv, extra = w.run_ours(ns, ids)
        art = Path(args.art)
        weights = mapped_resident([p for p in art.iterdir() if p.name.startswith("model.")])
    ttft = extra["prefill_s"]
    return {"ttft_s": ttft, "prefill_tok_s": ctx / ttft, "decode_tok_s": (args.decode - 1) / decode_s,
            "peak_rss_bytes": _status_bytes("VmHWM"), "rss_bytes": _status_bytes("VmRSS"), "kv_bytes": int(kv),
            "weights_resident_bytes": weights, "load_s": extra.get("load_s"),
            "rss_after_imports": extra.get("rss_after_imports"), "rss_after_load": extra.get("rss_after_load"),
            "generated": extra.get("generated")}


# ----------------------------------------------------------------------------------------------
# preparation (repo venv)


def export_key(kind: str) -> str:
    """The artifact's cache dir name. Not a hash of the exporter's sources (they change under unrelated
    edits and a re-export takes 10-30 min): pass --reexport after changing what the graph is."""
    return f"{kind}-{EXPORT_VERSIONS.get(kind) or EXPORT_VERSIONS[kind.split('-')[0]]}"


def do_export(kind: str, out: Path, pool_tokens: int, model: str = "smollm2") -> dict:
    sys.path.insert(0, str(REPO))
    from rich.console import Console

    from export.artifacts import PoolRequest, export_artifacts

    fmt, weights = kind.split("-", 1)
    # the .pte computes one logits row per call: all a chat on the runner asks for
    kw = {"onnx_weights": weights} if fmt == "onnx" else {"pte_weights": weights, "max_logits_rows": 1}
    t0 = time.time()
    m = export_artifacts(model, out, formats=(fmt,), spec="default",
                         pool=PoolRequest(pool_tokens=pool_tokens, max_seqs=1), max_tokens_per_call=64,
                         console=Console(stderr=True), force=True, **kw)
    return {"kind": kind, "seconds": round(time.time() - t0, 1), "bytes": m["artifacts"][fmt]["bytes"]}


def artifact_dir(kind: str, pool_tokens: int, model: str = "smollm2") -> Path:
    """Where the benchmark keeps (and looks for) its export of `kind`."""
    return cache_root() / "bench-artifacts" / f"device-{model}-default-p{pool_tokens}-s1" / export_key(kind)


def ensure_artifact(kind: str, pool_tokens: int, timeout: int, reexport: bool = False, model: str = "smollm2") -> dict:
    d = artifact_dir(kind, pool_tokens, model)
    base = d.parent
    if (d / "pagedkv.json").is_file() and not reexport:
        return {"ok": True, "dir": str(d), "cached": True}
    base.mkdir(parents=True, exist_ok=True)
    log(f"exporting {kind} into {d} (once; 10-30 min on 2 cores)...")
    cmd = [sys.executable, str(HERE), "--export", kind, "--export-out", str(d), "--pool-tokens", str(pool_tokens),
           "--force", "--model", model]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                           env=dict(os.environ, PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error"))
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"export timed out after {timeout} s"}
    d.with_name(d.name + ".log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    res = last_json(p.stdout)
    if p.returncode != 0 or res is None:
        return {"ok": False, "error": f"export exited {p.returncode}: {tail(p.stderr, 4)}"}
    log(f"exported {kind} in {res['seconds']} s ({res['bytes'] / 2**20:.0f} MiB)")
    return {"ok": True, "dir": str(d), "cached": False, **res}


def plan_estimate(art: str, ctx: int, decode: int, budget_mb: int) -> dict | None:
    """`pagedkv plan`'s whole-process estimate for the runner on this artifact and budget."""
    try:
        sys.path.insert(0, str(REPO))
        from runtime_sim.plan import whole_process_estimate

        return whole_process_estimate(Path(art), pool_bytes=budget_mb << 20, runtime="runner")
    except Exception as e:  # noqa: BLE001  (reported in the row, not fatal for the measurement)
        return {"error": str(e)[:200]}


# ----------------------------------------------------------------------------------------------
# runs


def runner_budget_mb(art: str, ctx: int, decode: int) -> int:
    pool = json.loads((Path(art) / "pagedkv.json").read_text())["pool"]
    bs = pool["block_size"]
    blocks = -(-(ctx + decode + 1) // bs)
    stage = pool.get("total_bytes", 0) - pool["bytes_per_token"] * bs * pool["num_blocks"]
    return -(-(blocks * pool["bytes_per_token"] * bs + max(0, stage)) // 2**20)


def run_one(name: str, ctx: int, args, ids_file: Path, arts: dict, gguf: str, llama_py: Path) -> dict:
    s = SYSTEMS[name]
    t0 = time.time()
    if s["kind"] == "runner":
        budget = runner_budget_mb(arts[s["art"]], ctx, args.decode)
        cmd = [str(args.runner), arts[s["art"]], "--prompt-file", str(args.text), "--ctx", str(ctx), "--decode",
               str(args.decode), "--threads", str(args.threads), "--budget-mb", str(budget), "--json"]
        if args.prefill_chunk:
            cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    else:
        py = str(llama_py) if s["kind"] == "llamacpp" else sys.executable
        cmd = [py, str(HERE), "--worker", s["kind"], "--ids", str(ids_file), "--ctx", str(ctx), "--decode",
               str(args.decode), "--threads", str(args.threads)]
        cmd += ["--gguf", gguf, "--kv", s["kv_types"]] if s["kind"] == "llamacpp" else ["--art", arts[s["art"]]]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.run_timeout} s"}
    res = last_json(p.stdout)
    if p.returncode != 0 or res is None:
        return {"error": f"exit {p.returncode}: {tail(p.stderr, 4)}"}
    if s["kind"] == "runner":
        res["weights_resident_bytes"] = res["weights_file_resident_bytes"]
        res["budget_mb"] = budget
    res["wall_s"] = round(time.time() - t0, 1)
    res["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return res


def make_rows(runs: dict, systems, ctxs, threads, spec_name: str, gguf_blocks: str = "Q4_1") -> list[dict]:
    rows = []
    for ctx in ctxs:
        for name in systems:
            s = SYSTEMS[name]
            base = {"system": name, "weights": s["weights"].replace("Q4_1", gguf_blocks), "kv": s.get("kv", f"pagedkv {spec_name}"), "ctx": ctx,
                    "threads": threads}
            got = runs.get((name, ctx), [])
            good = [r for r in got if not r.get("error")]
            if not good:
                rows.append({**base, **{k: None for k in ROW_KEYS if k not in base},
                             "error": got[-1]["error"] if got else "not run"})
                continue
            mid = median([r["decode_tok_s"] for r in good])
            rep = min(good, key=lambda r: abs(r["decode_tok_s"] - mid))
            row = {**base,
                   "ttft_s": round(median([r["ttft_s"] for r in good]), 4),
                   "prefill_tok_s": round(median([r["prefill_tok_s"] for r in good]), 2),
                   "decode_tok_s": round(mid, 3),
                   "peak_rss_bytes": max(r["peak_rss_bytes"] for r in good),
                   "kv_bytes": rep["kv_bytes"],
                   "weights_resident_bytes": rep["weights_resident_bytes"],
                   "repeats": len(good),
                   "all_decode_tok_s": [round(r["decode_tok_s"], 3) for r in good],
                   "all_peak_rss_bytes": [r["peak_rss_bytes"] for r in good],
                   "detail": {k: v for k, v in rep.items() if k not in ROW_KEYS}}
            rows.append(row)
    return rows


def evaluate_targets(rows: list[dict], ctx: int, model: str = "smollm2") -> list[dict]:
    ok = {r["system"]: r for r in rows if r["ctx"] == ctx and not r.get("error")}
    out = []
    f16, q = ok.get("llamacpp-f16"), ok.get("llamacpp-q8q4")
    for name in (n for n in ok if n.startswith("runner-")):
        r = ok[name]

        def add(target, value, threshold, passed, note):
            out.append({"target": target, "system": name, "ctx": ctx, "value": round(value, 3),
                        "threshold": threshold, "pass": bool(passed), "note": note})

        if q:
            x = r["peak_rss_bytes"] / q["peak_rss_bytes"]
            add("peak RSS <= 1.0x llama.cpp q8_0/q4_0 KV", x, 1.0, x <= 1.0,
                f"{r['peak_rss_bytes'] / 2**20:.0f} vs {q['peak_rss_bytes'] / 2**20:.0f} MiB")
        if f16:
            x = r["peak_rss_bytes"] / f16["peak_rss_bytes"]
            add("peak RSS <= 0.7x llama.cpp f16 KV", x, 0.7, x <= 0.7,
                f"{r['peak_rss_bytes'] / 2**20:.0f} vs {f16['peak_rss_bytes'] / 2**20:.0f} MiB")
            if ctx == LONGEST_CTX and model == "smollm2":
                add("peak RSS <= 0.6x llama.cpp f16 KV at the longest context the model allows", x, 0.6, x <= 0.6,
                    f"{r['peak_rss_bytes'] / 2**20:.0f} vs {f16['peak_rss_bytes'] / 2**20:.0f} MiB at {ctx}")
            x = r["decode_tok_s"] / f16["decode_tok_s"]
            add("decode tok/s >= 1.5x llama.cpp f16 KV", x, 1.5, x >= 1.5,
                f"{r['decode_tok_s']:.1f} vs {f16['decode_tok_s']:.1f} tok/s")
            x = r["ttft_s"] / f16["ttft_s"]
            add("TTFT <= 1.0x llama.cpp f16 KV", x, 1.0, x <= 1.0, f"{r['ttft_s']:.2f} vs {f16['ttft_s']:.2f} s")
        plan = r.get("plan_estimate_bytes")
        if plan:
            err = plan / r["peak_rss_bytes"] - 1
            add("pagedkv plan whole-process estimate within 15% of peak RSS", abs(err), 0.15, abs(err) <= 0.15,
                f"estimate {plan / 2**20:.0f} vs measured {r['peak_rss_bytes'] / 2**20:.0f} MiB ({err:+.1%})")
    return out


def mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}"


def markdown(rows: list[dict]) -> str:
    out = ["| system | weights | KV | ctx | threads | TTFT s | prefill tok/s | decode tok/s | peak RSS MiB | KV MiB | "
           "weights resident MiB |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['system']} | {r['weights']} | {r['kv']} | {r['ctx']} | {r['threads']} | "
                       f"FAILED: {r['error'][:120]} | | | | | |")
            continue
        out.append(f"| {r['system']} | {r['weights']} | {r['kv']} | {r['ctx']} | {r['threads']} | {r['ttft_s']:.2f} | "
                   f"{r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {mib(r['peak_rss_bytes'])} | "
                   f"{r['kv_bytes'] / 2**20:.1f} | {mib(r['weights_resident_bytes'])} |")
    return "\n".join(out)


def breakdown_table(rows: list[dict]) -> str:
    out = ["| runner row | ctx | peak RSS | RSS at end | mapped .pte | KV pool | activations | libraries | rest "
           "(heap) | plan estimate |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        d = r.get("detail") or {}
        if r.get("error") or "kv_pool_resident_bytes" not in d:
            continue
        out.append(f"| {r['system']} | {r['ctx']} | {mib(r['peak_rss_bytes'])} | {mib(d['rss_bytes'])} | "
                   f"{mib(d['weights_file_resident_bytes'])} | {mib(d['kv_pool_resident_bytes'])} | "
                   f"{mib(d['activations_resident_bytes'])} | {mib(d['libraries_resident_bytes'])} | "
                   f"{mib(d['rest_bytes'])} | {mib(r.get('plan_estimate_bytes'))} |")
    return "\n".join(out) + "\n\n(MiB)"


def report(out: dict, path: Path) -> None:
    """Targets from out["rows"]; writes path; prints the tables."""
    rows = out["rows"]
    ctxs = sorted({r["ctx"] for r in rows})
    target_ctx = 8192 if 8192 in ctxs else max(ctxs)
    out["targets"] = evaluate_targets(rows, target_ctx, out.get("model_name", "smollm2"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    m = out["machine"]
    print(f"\n## device: {out['model']}, prompt = first ctx tokens of wikitext-2, {out['decode']} greedy tokens, "
          f"{out['threads']} thread(s), medians of interleaved runs (column repeats in the JSON)\n")
    print(f"CPU: {m['cpu']}; pagedkv kernel path: {m['pagedkv_kernel_path']}; llama.cpp build: {m['llamacpp_build']}\n")
    print(markdown(rows))
    print("\n### Runner memory breakdown (at the end of the run)\n")
    print(breakdown_table(rows))
    print(f"\n### Targets at ctx {target_ctx}\n")
    for t in out["targets"]:
        print(f"- {'PASS' if t['pass'] else 'FAIL'}  {t['system']}: {t['target']}: {t['value']} ({t['note']})")
    for f in out["failures"]:
        print(f"- FAILED {f['system']} ({f['stage']}): {f['error']}")


def merge(args) -> int:
    parts = [json.loads(p.read_text()) for p in args.merge]
    out = dict(parts[0])
    out["rows"] = [r for part in parts for r in part["rows"] if r.get("error") != "not run"]
    out["rows"].sort(key=lambda r: (r["ctx"], list(SYSTEMS).index(r["system"]) if r["system"] in SYSTEMS else 99))
    out["failures"] = [f for part in parts for f in part["failures"]]
    out["merged_from"] = [{"file": str(p), "command": part.get("command"), "date": part.get("date"),
                           "repeats": part.get("repeats")} for p, part in zip(args.merge, parts)]
    for part in parts:
        for k, v in part["machine"].items():
            out["machine"][k] = out["machine"].get(k) or v
        for k, v in part["versions"].items():
            out["versions"][k] = out["versions"].get(k) or v
    report(out, args.json)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a registered model name (`pagedkv models`; default smollm2)")
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--decode", type=int, default=33, help="tokens generated after the prompt (default 33)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS), metavar="SYSTEM")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--llamacpp-venv", type=Path, default=None,
                    help="default ~/.cache/pagedkv/llamacpp-<isa>-venv (its own build flags)")
    ap.add_argument("--export-timeout", type=int, default=5400)
    ap.add_argument("--run-timeout", type=int, default=1800)
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "device.json")
    ap.add_argument("--resume", type=Path, metavar="PARTIAL_JSON",
                    help="keep the runs of an interrupted run's --json .partial.json and measure only the rest")
    ap.add_argument("--runner", type=Path, default=RUNNER_CLI,
                    help="the pagedkv-runner binary of the runner-* systems (default build/android-host/pagedkv-runner)")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="tokens per prefill call of the runner-* rows (default 0: the .pte's max_tokens_per_call)")
    ap.add_argument("--reexport", action="store_true", help="export the artifacts again (after exporter changes)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="measure nothing: combine the rows of earlier --json files (runs split by system) into "
                    "--json, re-evaluate the targets, print the tables")
    # worker / export modes (internal)
    ap.add_argument("--worker", choices=["llamacpp", "ort"], help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--art", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--kv", default="f16/f16", help=argparse.SUPPRESS)
    ap.add_argument("--export", help=argparse.SUPPRESS)
    ap.add_argument("--export-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--pool-tokens", type=int, default=8192 + 64, help=argparse.SUPPRESS)
    ap.add_argument("--force", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("\n" + json.dumps(worker(args)), flush=True)
        return 0
    if args.export:
        print("\n" + json.dumps(do_export(args.export, args.export_out, args.pool_tokens, args.model)), flush=True)
        return 0
    if args.merge:
        return merge(args)
    if not args.text.is_file():
        ap.error(f"text file {args.text} not found: pass --text FILE")
    if max(args.ctx) + args.decode > args.pool_tokens:
        ap.error(f"ctx {max(args.ctx)} + decode {args.decode} exceed the exported pool ({args.pool_tokens} tokens)")
    systems = [s for s in args.systems if not (args.skip_llamacpp and s.startswith("llamacpp"))]
    if any(SYSTEMS[s]["kind"] == "runner" for s in systems) and not args.runner.is_file():
        raise SystemExit(f"{args.runner} is not built: run `bash android_demo/native/ci_build.sh host` "
                         "(or `make test`) first")
    wall0 = time.time()
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE.parent))
    from e2e import prepare_ids

    from toolkit.model_registry import MODELS, model_file

    if args.model not in MODELS:
        ap.error(f"--model {args.model}: give one of {', '.join(MODELS)} (the registered models)")
    gguf = str(model_file(args.model))
    gguf_blocks = MODELS[args.model].title.split(", ")[-1].replace(" GGUF", "")
    ids_file = prepare_ids(args.text, max(args.ctx), args.model)
    failures, arts, exports = [], {}, {}
    for s in systems:
        kind = SYSTEMS[s].get("art")
        if kind and kind not in exports:
            exports[kind] = ensure_artifact(kind, args.pool_tokens, args.export_timeout, args.reexport, args.model)
            if exports[kind]["ok"]:
                arts[kind] = exports[kind]["dir"]
            else:
                failures.append({"system": s, "stage": "export", "error": exports[kind]["error"]})
                log(f"export {kind} FAILED: {exports[kind]['error']}")
    systems = [s for s in systems if "art" not in SYSTEMS[s] or SYSTEMS[s]["art"] in arts]
    venv = args.llamacpp_venv or default_venv()
    llama_version = None
    if any(s.startswith("llamacpp") for s in systems):
        ok, msg = ensure_llamacpp(venv)
        if ok:
            llama_version = msg
        else:
            failures.append({"system": "llamacpp-*", "stage": "install", "error": msg})
            systems = [s for s in systems if not s.startswith("llamacpp")]

    runs: dict = {}
    if args.resume:  # "system@ctx" -> the results measured before the interruption
        for key, results in json.loads(args.resume.read_text()).items():
            s, _, c = key.rpartition("@")
            if s in systems and int(c) in args.ctx:
                runs[(s, int(c))] = [r for r in results if not r.get("error")][: args.repeats]
    n, k = len(systems) * len(args.ctx) * args.repeats, 0
    for ci, ctx in enumerate(args.ctx):
        for rep in range(args.repeats):
            shift = (ci + rep) % max(1, len(systems))
            for s in systems[shift:] + systems[:shift]:
                k += 1
                if len(runs.get((s, ctx), [])) > rep:  # measured before (--resume)
                    continue
                log(f"[{k}/{n}] {s} ctx {ctx} (repeat {rep + 1})...")
                res = run_one(s, ctx, args, ids_file, arts, gguf, venv / "bin" / "python")
                if res.get("error"):
                    log(f"  FAILED: {res['error']}")
                else:
                    log(f"  TTFT {res['ttft_s']:.2f} s, decode {res['decode_tok_s']:.1f} tok/s, peak RSS "
                        f"{mib(res['peak_rss_bytes'])} MiB, weights resident {mib(res['weights_resident_bytes'])} MiB")
                runs.setdefault((s, ctx), []).append(res)
                partial = args.json.with_suffix(".partial.json")  # what is measured so far, if stopped
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({f"{a}@{c}": v for (a, c), v in runs.items()}, indent=1) + "\n")

    rows = make_rows(runs, systems, args.ctx, args.threads, "default", gguf_blocks)
    for r in rows:
        if r["system"].startswith("runner-") and not r.get("error"):
            est = plan_estimate(arts[SYSTEMS[r["system"]]["art"]], r["ctx"], args.decode, r["detail"]["budget_mb"])
            if est and "error" not in est:
                r["plan_estimate_bytes"] = est["total_bytes"]
                r["plan_estimate"] = est
            elif est:
                r["plan_error"] = est["error"]
    kernel_isa = next((r["detail"].get("isa") for r in rows if r.get("detail", {}).get("isa")), None)
    out = {
        "model": f"{MODELS[args.model].title} ({args.model}; ours exported from its fp32 dequantization)",
        "model_name": args.model, "text": args.text.name, "decode": args.decode, "threads": args.threads, "repeats": args.repeats,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "pagedkv_kernel_path": kernel_isa,
                    "llamacpp_build": build_flags() if llama_version else None},
        "versions": {"llama-cpp-python": llama_version},
        "runner": str(args.runner), "prefill_chunk": args.prefill_chunk,
        "command": "python benchmarks/device.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_seconds": round(time.time() - wall0, 1),
        "exports": exports, "rows": rows, "failures": failures,
    }
    report(out, args.json)
    log(f"wrote {args.json} ({(time.time() - wall0) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
