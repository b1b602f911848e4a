"""Gemma 3 270M at long context: KV bytes and decode speed of pagedkv (ONNX on onnxruntime, layer
groups: the 15 sliding layers keep only their 512-token window) next to llama.cpp on the same GGUF
(its default iSWA cache: sliding layers hold their window too), f16 and q8_0/q4_0 KV.

    python benchmarks/gemma_long.py --ctx 2048 8192 32768 --steps 32 --threads 1
    python benchmarks/gemma_long.py --ctx 2048 --skip-llamacpp
    python benchmarks/gemma_long.py --ctx 32768 2048 8192 --llamacpp-kv-max-ctx q8_0/q4_0=8192

    python benchmarks/gemma_long.py --ctx 32768 --runner <.pte artifacts> --out benchmarks/results/gemma_long_runner.json

`--compact-horizon H` gives our export a compact region (the compact tier, issue 25) holding every
global-layer block older than the last H tokens, re-quantized to `--compact-spec` (a compact spec, e.g.
k4v2-g256; default compact_spec_for(best)); the default region is sized for H + 512 tokens, the engine
runs the adaptive policy (its compact rung moves aged blocks as the default region fills) and every
aged block is moved after the prefill and again before the bytes are read (runtime_sim.compact.compact_aged:
what a runtime does between turns), so the row's KV bytes hold H tokens in the conversation's spec.
`--sliding-spec SPEC` exports the sliding layers in their own spec (`pagedkv export --sliding-spec`).
Rows of such an export go to their own --out (the default names it).

`--runner ARTIFACTS` measures only the Android runner (android_demo/native's pagedkv-runner, host build
from `make native` / ci_build.sh host) on a .pte export of the model: it tokenizes the first ctx tokens of
wikitext-2 with Gemma's own tokenizer (no BOS: the runner's CLI adds no special tokens), prefills them and
decodes `steps` greedy tokens; the row gets its peak RSS, KV bytes, TTFT and tok/s ("runner").
`--llamacpp-kv-max-ctx KV=CTX` runs llama.cpp with that KV type pair only up to CTX tokens (its
q8_0/q4_0 flash-attention path prefills slowly on CPU: 1,259 s at 8K on the shared Xeon); a ctx above it
gets a "not run" entry that still carries the KV bytes of llama.cpp's allocation formula (an
allocation: it needs no prefill). Rows are written sorted by ctx, each with the load averages
(os.getloadavg) taken before and after every side, since the machine is shared; a row already in --out
keeps the sides this run does not measure.

For each ctx: the first ctx tokens of wikitext-2 (BOS first) are prefilled, then `steps` greedy
tokens are decoded and timed (after 4 untimed ones). Our KV bytes are the engine's own count of the
blocks in use (every group) plus the fp16 sink/tail rows, and next to it what one block table for
all layers would hold (every layer holding ctx tokens). llama.cpp's are its cache's allocation:
global layers n_ctx cells, sliding layers min(n_ctx, window + n_ubatch) cells rounded up to 256
(llama.cpp's iSWA cache), times the bytes per cell of its KV types (f16: 2 per value; q8_0: 34 per
32; q4_0: 18 per 32). Our export: the KV spec export picks for Gemma 3 (best), ONNX int4-e4 weights
(MatMulNBits linears, int4 token table and tied head), native kernel, cached in
~/.cache/pagedkv/bench-artifacts. Writes benchmarks/results/gemma_long.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
WARMUP = 4
# Gemma 3 270M: 18 layers (every 6th global), 1 KV head x 256, sliding window 512
LAYERS, GLOBAL_LAYERS, KV_DIM, WINDOW = 18, 3, 256, 512
LLAMACPP_BYTES = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}  # bytes per values
LLAMACPP_KVS = ("f16/f16", "q8_0/q4_0")  # K/V type pairs run against ours


def llamacpp_kv_bytes(type_k: str, type_v: str, n_ctx: int, n_ubatch: int = 512) -> int:
    def cells_bytes(cells: int, t: str) -> int:
        num, den = LLAMACPP_BYTES[t]
        return cells * KV_DIM * num // den

    swa_cells = min(n_ctx, -(-(WINDOW + n_ubatch) // 256) * 256)
    per = lambda cells: cells_bytes(cells, type_k) + cells_bytes(cells, type_v)  # noqa: E731
    return GLOBAL_LAYERS * per(n_ctx) + (LAYERS - GLOBAL_LAYERS) * per(swa_cells)


def parse_kv_max_ctx(items: list[str]) -> dict[str, int]:
    """['q8_0/q4_0=8192'] -> {'q8_0/q4_0': 8192}; bad input is one line and exit 2."""
    out = {}
    for it in items:
        kv, _, n = it.partition("=")
        if kv not in LLAMACPP_KVS or not n.isdigit():
            print(f"gemma_long: bad --llamacpp-kv-max-ctx {it!r}: give KV=CTX with KV one of "
                  f"{', '.join(LLAMACPP_KVS)} and CTX a token count (e.g. q8_0/q4_0=8192)", file=sys.stderr)
            sys.exit(2)
        out[kv] = int(n)
    return out


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def worker(args) -> int:
    """In the llama.cpp venv: prefill the ids, time `steps` greedy decode steps."""
    import numpy as np

    import llama_cpp

    ids = json.loads(Path(args.ids).read_text())
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    tk, tv = args.kv.split("/")
    n_ctx = -(-(len(ids) + args.steps + WARMUP + 1) // 256) * 256
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, flash_attn=True, type_k=types[tk], type_v=types[tv],
                          logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()

    def forward(toks):
        llm.eval(toks)
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    t0 = time.perf_counter()
    tok = int(np.argmax(forward(ids)))
    prefill_s = time.perf_counter() - t0
    for _ in range(WARMUP):
        tok = int(np.argmax(forward([tok])))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tok = int(np.argmax(forward([tok])))
    decode_s = time.perf_counter() - t0
    print(json.dumps({"prefill_s": prefill_s, "decode_tok_s": args.steps / decode_s, "n_ctx": n_ctx,
                      "kv_bytes": llamacpp_kv_bytes(tk, tv, n_ctx)}))
    return 0


def export_ours(max_ctx: int, horizon: int | None = None, sliding_spec: str | None = None,
                compact_spec: str | None = None) -> Path:
    """Our ONNX export (cached): pool for max_ctx tokens; with a compact horizon, a default region of
    horizon + 512 tokens and a compact region for the rest; the sliding layers in sliding_spec if given."""
    from export.artifacts import PoolRequest, export_artifacts

    from toolkit.manifest import LOGITS_ROWS

    # the KV spec best, int4 linears + int4 token table and tied head (int4-e4:
    # with the head in fp32, its 262144 x 640 MatMul reads 671 MB per token and dominates decode)
    spec = "best"
    pool_tokens = -(-(max_ctx + 256) // 1024) * 1024
    safe = lambda text: "".join(c if c.isalnum() else "_" for c in text)  # noqa: E731
    name = f"gemma3-270m-onnx-int4-e4-{spec}-{pool_tokens}"
    req = PoolRequest(pool_tokens=pool_tokens, max_seqs=1)
    if horizon:
        req = PoolRequest(pool_tokens=horizon + 512, max_seqs=1, compact_blocks=pool_tokens // 16,
                          compact_spec=compact_spec)
        name += f"-compact{pool_tokens // 16}-h{horizon}" + (f"-{safe(compact_spec)}" if compact_spec else "")
    if sliding_spec:
        name += f"-sliding-{safe(sliding_spec)}"
    out = Path.home() / ".cache" / "pagedkv" / "bench-artifacts" / name
    man = out / "pagedkv.json"
    # re-exported when missing or made before the graph's logits_rows input (its prefill ran the head on
    # every row of a chunk)
    if not man.is_file() or json.loads(man.read_text())["artifacts"]["onnx"]["inputs"][-1] != LOGITS_ROWS:
        export_artifacts("gemma3-270m", out, ("onnx",), spec, req, onnx_weights="int4-e4", force=True,
                         sliding_spec=sliding_spec)
    return out


def run_runner(art: Path, ctx: int, steps: int, threads: int, horizon: int | None = None) -> dict:
    """pagedkv-runner on a .pte export: the first ctx tokens of wikitext-2, then `steps` greedy tokens.
    horizon: the runner's adaptive policy with that compact horizon (an export with a compact region)."""
    runner = REPO / "build" / "android-host" / "pagedkv-runner"
    if not runner.is_file():
        sys.exit(f"gemma_long: {runner} is missing: build it with `make native` (android_demo/native/ci_build.sh host)")
    load0 = loadavg()
    p = subprocess.run([str(runner), str(art), "--prompt-file", str(TEXT), "--ctx", str(ctx), "--decode",
                        str(steps + WARMUP), "--threads", str(threads), "--json"] +
                       (["--policy", "adaptive", "--compact-horizon", str(horizon)] if horizon else []),
                       capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": p.stderr.strip()[-400:], "loadavg_before_after": [load0, loadavg()]}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    keep = ("ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_bytes", "kv_bytes", "weights_file_resident_bytes",
            "kv_pool_resident_bytes", "activations_resident_bytes", "rest_bytes", "isa", "groups", "ladder")
    out = {k: r[k] for k in keep if k in r}
    out["prefill_s"] = ctx / r["prefill_tok_s"] if r.get("prefill_tok_s") else None
    out["decoded_tokens"] = len(r["generated"])
    out["loadavg_before_after"] = [load0, loadavg()]
    return out


def write_rows(out: Path, report: dict, rows: list[dict]) -> None:
    """Rows into `out`, sorted by ctx; a ctx already there keeps the sides these rows do not have."""
    old = json.loads(out.read_text()) if out.is_file() else {}
    if "ours" in report and old.get("ours") != report["ours"]:  # rows of another export of ours: not kept
        old = {k: v for k, v in old.items() if k == "runner"} | {"runs": [
            {k: v for k, v in r.items() if k in ("ctx", "runner")} for r in old.get("runs", []) if "runner" in r]}
    merged = {r["ctx"]: r for r in old.get("runs", [])}
    for r in rows:
        merged[r["ctx"]] = {**merged.get(r["ctx"], {}), **r}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**old, **report, "runs": [merged[c] for c in sorted(merged)]}, indent=2) + "\n")


def run_ours(art: Path, ids: list[int], steps: int, threads: int, horizon: int | None = None) -> dict:
    import numpy as np

    from runtime_sim.compact import compact_aged
    from runtime_sim.session import open_artifacts

    engine = open_artifacts(art, "onnxruntime", threads=threads, policy="adaptive" if horizon else "error")
    if horizon:
        engine.compact_horizon = horizon
    cid = engine.new_conversation()
    t0 = time.perf_counter()
    tok = int(np.argmax(engine.prefill(cid, ids)))
    prefill_s = time.perf_counter() - t0
    if horizon:  # between turns: every block older than the horizon into the compact region
        compact_aged(engine, cid, horizon)
    for _ in range(WARMUP):
        tok = int(np.argmax(engine.step({cid: [tok]})[cid]))
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(np.argmax(engine.step({cid: [tok]})[cid]))
    decode_s = time.perf_counter() - t0
    if horizon:
        compact_aged(engine, cid, horizon)
    st = engine.stats()
    lay = engine.backend.layout
    n = engine.pool.length(engine.conversations[cid].seq)
    one_table = -(-n // lay.block_size) * lay.block_size * lay.bytes_per_token + lay.stage_bytes_per_sequence
    return {"prefill_s": prefill_s, "decode_tok_s": steps / decode_s, "kv_bytes": st["kv_bytes_in_use"],
            "kv_bytes_one_table": one_table, "groups": st.get("groups"), "tokens": n, "pool_bytes": st["pool_bytes"],
            "compact_blocks_in_use": st["ladder"]["compact_blocks_in_use"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--pool-ctx", type=int, default=None,
                    help="size our pool for this ctx (default the largest --ctx; 32768 reuses the 32K run's export)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--skip-ours", action="store_true",
                    help="llama.cpp only (its rows are merged into --out beside ours from another run)")
    ap.add_argument("--runner", type=Path, default=None, metavar="ARTIFACTS",
                    help="measure only the Android runner (pagedkv-runner) on this .pte export")
    ap.add_argument("--llamacpp-kv-max-ctx", nargs="*", default=[], metavar="KV=CTX",
                    help="run llama.cpp with KV types KV only up to CTX tokens, e.g. q8_0/q4_0=8192 (larger ctx: "
                         "'not run', KV bytes from llama.cpp's allocation formula)")
    ap.add_argument("--llamacpp-venv", type=Path, default=None,
                    help="default ~/.cache/pagedkv/llamacpp-<isa>-venv (benchmarks/llamacpp_peer.py)")
    ap.add_argument("--compact-horizon", type=int, default=None, metavar="H",
                    help="our export with a compact region: global-layer blocks older than the last H tokens are "
                         "compacted (the compact tier)")
    ap.add_argument("--compact-spec", default=None,
                    help="the compact region's spec: a name of benchmarks/compact_tier.py's CANDIDATES (k4v2-g256) or "
                         "spec text (export --compact-spec); default compact_spec_for(best)")
    ap.add_argument("--sliding-spec", default=None, help="the sliding layers' own KV spec (export --sliding-spec)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default benchmarks/results/gemma_long.json (gemma_long_compact.json with --compact-horizon "
                         "or --sliding-spec)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--kv", default="f16/f16", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is None:
        name = "gemma_long_compact.json" if args.compact_horizon or args.sliding_spec else "gemma_long.json"
        args.out = REPO / "benchmarks" / "results" / name
    if args.worker:
        return worker(args)
    kv_max_ctx = parse_kv_max_ctx(args.llamacpp_kv_max_ctx)
    if args.runner is not None:
        return runner_main(args)

    sys.path.insert(0, str(REPO))
    from benchmarks.compact_tier import CANDIDATES
    from benchmarks.e2e import cpu_model
    from toolkit.model_loading import load_model
    from toolkit.model_registry import model_file

    gguf = model_file("gemma3-270m")
    _, tok = load_model("gemma3-270m")
    text = TEXT.read_text(encoding="utf-8")
    all_ids = tok(text[: 8 * max(args.ctx)], add_special_tokens=False)["input_ids"]
    compact_spec = CANDIDATES.get(args.compact_spec, args.compact_spec)
    art = None if args.skip_ours else export_ours(args.pool_ctx or max(args.ctx), args.compact_horizon,
                                                  args.sliding_spec, compact_spec)
    llama_py, llama_build = None, None
    if not args.skip_llamacpp:
        from benchmarks.llamacpp_peer import build_flags, ensure_llamacpp, llamacpp_python

        ok, msg = ensure_llamacpp(args.llamacpp_venv)
        if not ok:
            sys.exit(f"llama.cpp is unavailable: {msg} (--skip-llamacpp leaves it out)")
        llama_py, llama_build = llamacpp_python(args.llamacpp_venv), build_flags()
    report = {"model": "Gemma 3 270M (Q4_K_M GGUF)", "threads": args.threads, "steps": args.steps,
              "cpu": cpu_model(), "ours": "ONNX int4-e4 weights, KV spec best (export's default for Gemma 3), layer groups, onnxruntime"
              + (f", compact tier (horizon {args.compact_horizon}, {compact_spec or 'compact_spec_for(best)'})"
                 if args.compact_horizon else "") + (f", sliding layers {args.sliding_spec}" if args.sliding_spec else ""),
              "llamacpp_build": llama_build, "runs": []}
    for ctx in args.ctx:
        ids = [tok.bos_token_id] + all_ids[: ctx - 1]
        load0 = loadavg()
        row = {"ctx": ctx}
        if not args.skip_ours:
            row["ours"] = run_ours(art, ids, args.steps, args.threads, args.compact_horizon)
            row["ours"]["loadavg_before_after"] = [load0, loadavg()]
        if not args.skip_llamacpp:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(ids, f)
            for kv in LLAMACPP_KVS:
                if ctx > kv_max_ctx.get(kv, ctx):
                    n_ctx = -(-(len(ids) + args.steps + WARMUP + 1) // 256) * 256
                    row[f"llamacpp {kv}"] = {
                        "not run": f"--llamacpp-kv-max-ctx {kv}={kv_max_ctx[kv]} (its CPU prefill is slow: "
                                   "1,259 s at 8K on this machine)",
                        "n_ctx": n_ctx, "kv_bytes": llamacpp_kv_bytes(*kv.split("/"), n_ctx),
                        "kv_bytes_from": "llama.cpp's iSWA cache allocation formula (allocated at context "
                                         "creation, so it needs no prefill)"}
                    continue
                load0 = loadavg()
                p = subprocess.run([str(llama_py), __file__, "--worker", "--gguf",
                                    str(gguf), "--ids", f.name, "--kv", kv, "--steps", str(args.steps),
                                    "--threads", str(args.threads)], capture_output=True, text=True)
                r = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else \
                    {"error": p.stderr.strip()[-400:]}
                r["loadavg_before_after"] = [load0, loadavg()]
                row[f"llamacpp {kv}"] = r
            os.unlink(f.name)
        report["runs"].append(row)
        write_rows(args.out, {k: v for k, v in report.items() if k != "runs"}, report["runs"])
        _print_row(row)
    return 0


def runner_main(args) -> int:
    sys.path.insert(0, str(REPO))
    from benchmarks.e2e import cpu_model

    man = json.loads((args.runner / "pagedkv.json").read_text()) if (args.runner / "pagedkv.json").is_file() else None
    if not man or "pte" not in man.get("artifacts", {}):
        print(f"gemma_long: {args.runner} is not a .pte export (no pagedkv.json with a pte entry): export one with "
              "`pagedkv export gemma3-270m --format pte`", file=sys.stderr)
        return 2
    pte = man["artifacts"]["pte"]
    report = {"runner": {"artifacts": str(args.runner), "weights": pte.get("weights"), "spec": man.get("spec", {}).get("name"),
                         "max_tokens_per_call": pte.get("max_tokens_per_call"), "threads": args.threads,
                         "compact_horizon": args.compact_horizon, "groups": man.get("groups"),
                         "cpu": cpu_model(), "prompt": "first ctx tokens of wikitext-2 test, runner's tokenizer, no BOS",
                         "timed": f"{args.steps + WARMUP} decode steps (the runner times all of them)"}}
    for ctx in args.ctx:
        row = {"ctx": ctx, "runner": run_runner(args.runner, ctx, args.steps, args.threads, args.compact_horizon)}
        write_rows(args.out, report, [row])
        r = row["runner"]
        print(f"ctx {ctx}: runner " + (f"failed: {r['error']}" if "error" in r else
              f"KV {r['kv_bytes'] / 2**20:.1f} MiB, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, TTFT {r['ttft_s']:.1f} s, "
              f"decode {r['decode_tok_s']:.2f} tok/s"))
    return 0


def _print_row(row: dict) -> None:
    o = row.get("ours")
    print(f"\nctx {row['ctx']}:")
    if o:
        print(f"  ours: KV {o['kv_bytes'] / 2**20:.1f} MiB (one table for all layers: {o['kv_bytes_one_table'] / 2**20:.1f} "
              f"MiB), decode {o['decode_tok_s']:.1f} tok/s, prefill {o['prefill_s']:.0f} s")
    for k in ("llamacpp f16/f16", "llamacpp q8_0/q4_0"):
        r = row.get(k)
        if not r:
            continue
        if "error" in r:
            print(f"  {k}: failed: {r['error']}")
            continue
        line = f"  {k}: KV {r['kv_bytes'] / 2**20:.1f} MiB" + (f" (ours {o['kv_bytes'] / r['kv_bytes']:.2f}x)" if o else "")
        if "not run" in r:
            line += f" (allocation), not run: {r['not run']}"
        else:
            line += f", decode {r['decode_tok_s']:.1f} tok/s" + \
                (f" (ours {o['decode_tok_s'] / r['decode_tok_s']:.2f}x)" if o else "") + f", prefill {r['prefill_s']:.0f} s"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
