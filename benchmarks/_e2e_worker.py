"""One measurement of benchmarks/e2e.py, in its own process (so its peak RSS is its own).

    python benchmarks/_e2e_worker.py export --kind onnx-int4 --out DIR [--pool-tokens N]
    python benchmarks/_e2e_worker.py run --system ours-onnx --art DIR --ids IDS.json --ctx N --steps S --threads T

Prints one JSON object on its last stdout line. Imports only the standard library and numpy at the
top: the llama.cpp runs use a separate venv that has llama-cpp-python and numpy but not pagedkv's
dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rss_now() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """Peak resident set of this process (VmHWM), bytes.

    Not ru_maxrss: Linux carries it over execve from the process that forked us, so a worker started
    by a parent holding 370 MiB (torch + transformers imported) would never report less than that."""
    return _status_kib("VmHWM") * 1024


def ru_maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_ids(path: str, ctx: int) -> list[int]:
    ids = json.loads(Path(path).read_text())
    if len(ids) < ctx:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than ctx {ctx}")
    return ids[:ctx]


# ----------------------------------------------------------------------------------------------
# export


def do_export(args) -> dict:
    sys.path.insert(0, str(REPO))
    from rich.console import Console

    from export.artifacts import PoolRequest, export_artifacts

    fmt, weights = args.kind.split("-", 1)
    kw = {"onnx_weights": weights} if fmt == "onnx" else {"pte_weights": weights}
    t0 = time.time()
    manifest = export_artifacts(
        "smollm2", Path(args.out), formats=(fmt,), spec=args.spec,
        pool=PoolRequest(pool_tokens=args.pool_tokens, max_seqs=1),
        max_tokens_per_call=args.max_tokens_per_call, console=Console(stderr=True), **kw,
    )
    entry = manifest["artifacts"][fmt]
    return {"kind": args.kind, "seconds": round(time.time() - t0, 1), "bytes": entry["bytes"],
            "peak_rss_bytes": peak_rss()}


# ----------------------------------------------------------------------------------------------
# runs: each returns (decode_seconds, kv_bytes, extra) after prefilling ctx tokens


def _timed_decode(first_logits, step, steps: int, warmup: int):
    """Greedy: warmup untimed steps, then `steps` timed ones. step(tok) -> logits."""
    import numpy as np

    tok = int(np.argmax(first_logits))
    for _ in range(warmup):
        tok = int(np.argmax(step(tok)))
    generated = []
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = step(tok)
        tok = int(np.argmax(logits))
        generated.append(tok)
    return time.perf_counter() - t0, generated


def run_ours(args, ids):
    sys.path.insert(0, str(REPO))
    from runtime_sim.session import open_artifacts

    backend = "onnxruntime" if args.system == "ours-onnx" else "executorch"
    if backend == "executorch":  # the onnxruntime path does not import torch at all
        import torch

        torch.set_num_threads(args.threads)
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(args.threads)
    rss_imports = rss_now()
    t0 = time.perf_counter()
    engine = open_artifacts(args.art, backend=backend, native=True if backend == "onnxruntime" else None,
                            threads=args.threads)
    load_s = time.perf_counter() - t0
    rss_loaded = rss_now()
    cid = engine.new_conversation()
    t0 = time.perf_counter()
    logits = engine.prefill(cid, ids)
    prefill_s = time.perf_counter() - t0
    kv = engine.stats()["kv_bytes_in_use"]
    decode_s, gen = _timed_decode(logits, lambda t: engine.step({cid: [t]})[cid], args.steps, args.warmup)
    st = engine.stats()
    extra = {"load_s": load_s, "prefill_s": prefill_s, "rss_after_imports": rss_imports,
             "rss_after_load": rss_loaded, "pool_bytes": st["pool_bytes"],
             "kv_bytes_end": st["kv_bytes_in_use"], "generated": gen[:8],
             "kernel_threads": engine.backend.kernel_threads}
    if backend == "onnxruntime":
        extra["native_kernel"] = bool(engine.backend.native)
    else:
        from executorch.extension.pybindings import portable_lib

        extra["et_threads"] = int(portable_lib._threadpool_get_thread_count())
    return decode_s, kv, extra


def _cache_bytes(cache) -> int:
    import torch

    total, seen = 0, set()

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56: DynamicCache.layers[i].keys / .values
        for layer in layers:
            add(getattr(layer, "keys", None))
            add(getattr(layer, "values", None))
    else:
        for k, v in zip(cache.key_cache, cache.value_cache):
            add(k)
            add(v)
    return total


def run_hf(args, ids):
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, DynamicCache

    from toolkit.model_loading import converted_gguf_dir, load_model
    from toolkit.model_registry import model_file

    rss_imports = rss_now()
    t0 = time.perf_counter()
    hf_dir = converted_gguf_dir(model_file("smollm2"))
    if not (hf_dir / "config.json").is_file():
        load_model("smollm2")  # converts the GGUF once
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    load_s = time.perf_counter() - t0
    rss_loaded = rss_now()
    cache = DynamicCache(config=model.config) if "config" in DynamicCache.__init__.__code__.co_varnames else DynamicCache()
    pos = 0

    def forward(toks):
        nonlocal pos
        x = torch.tensor([toks], dtype=torch.int64)
        p = torch.arange(pos, pos + len(toks))[None]
        with torch.no_grad():
            out = model(input_ids=x, position_ids=p, cache_position=p[0], past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
        pos += len(toks)
        return out.logits[0, -1].float().numpy()

    t0 = time.perf_counter()
    for a in range(0, len(ids), args.hf_chunk):
        logits = forward(ids[a : a + args.hf_chunk])
    prefill_s = time.perf_counter() - t0
    kv = _cache_bytes(cache)
    decode_s, gen = _timed_decode(logits, lambda t: forward([t]), args.steps, args.warmup)
    return decode_s, kv, {"load_s": load_s, "prefill_s": prefill_s, "rss_after_imports": rss_imports,
                          "rss_after_load": rss_loaded, "kv_bytes_end": _cache_bytes(cache),
                          "attn_implementation": model.config._attn_implementation, "generated": gen[:8]}


# llama.cpp KV cache types: bytes per block of 32 values (f16: 64 bytes per 32 values)
GGML_BYTES_PER_32 = {"f16": 64, "q8_0": 34, "q4_0": 18}


def llamacpp_kv_bytes(type_k: str, type_v: str, layers: int, kv_heads: int, head_dim: int, ctx: int) -> int:
    """layers x kv_heads x head_dim x ctx x (bytes per K value + bytes per V value)."""
    vals = layers * kv_heads * head_dim * ctx
    return vals * GGML_BYTES_PER_32[type_k] // 32 + vals * GGML_BYTES_PER_32[type_v] // 32


def run_llamacpp(args, ids):
    import numpy as np

    import llama_cpp

    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    type_k, type_v = args.kv.split("/")
    rss_imports = rss_now()
    n_ctx = -(-(len(ids) + args.steps + args.warmup + 1) // 256) * 256
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.gguf, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=args.threads,
        n_threads_batch=args.threads, flash_attn=True, type_k=types[type_k], type_v=types[type_v],
        logits_all=False, verbose=False, use_mmap=True,
    )
    load_s = time.perf_counter() - t0
    rss_loaded = rss_now()
    ctx = llm.ctx
    n_vocab = llm.n_vocab()

    def last_logits():
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()

    def forward(toks):
        llm.eval(toks)
        return last_logits()

    t0 = time.perf_counter()
    logits = forward(ids)  # llm.eval splits into n_batch chunks
    prefill_s = time.perf_counter() - t0
    meta = llm.metadata
    arch = meta.get("general.architecture", "llama")
    layers = int(meta[f"{arch}.block_count"])
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads))
    kv = llamacpp_kv_bytes(type_k, type_v, layers, kv_heads, head_dim, len(ids))
    decode_s, gen = _timed_decode(logits, lambda t: forward([t]), args.steps, args.warmup)
    return decode_s, kv, {
        "load_s": load_s, "prefill_s": prefill_s, "rss_after_imports": rss_imports, "rss_after_load": rss_loaded,
        "n_ctx": n_ctx, "kv_bytes_allocated": llamacpp_kv_bytes(type_k, type_v, layers, kv_heads, head_dim, n_ctx),
        "kv_formula": f"{layers} layers x {kv_heads} kv_heads x {head_dim} head_dim x ctx x "
        f"(K {GGML_BYTES_PER_32[type_k]}/32 + V {GGML_BYTES_PER_32[type_v]}/32) bytes",
        "llama_cpp_version": getattr(llama_cpp, "__version__", "?"), "generated": gen[:8],
    }


def do_run(args) -> dict:
    ids = load_ids(args.ids, args.ctx)
    load0 = os.getloadavg()[0]
    fn = {"ours-onnx": run_ours, "ours-pte": run_ours, "hf-eager": run_hf, "llamacpp": run_llamacpp}[args.system]
    decode_s, kv, extra = fn(args, ids)
    return {"decode_tok_s": args.steps / decode_s, "decode_s": decode_s, "kv_bytes": int(kv),
            "peak_rss_bytes": peak_rss(), "ru_maxrss_bytes": ru_maxrss(), "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "threads": args.threads, **extra}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export")
    ex.add_argument("--kind", required=True, choices=["onnx-fp32", "onnx-int4", "pte-fp32", "pte-8da4w"])
    ex.add_argument("--out", required=True)
    ex.add_argument("--spec", default="default")
    ex.add_argument("--pool-tokens", type=int, default=8192 + 64)
    ex.add_argument("--max-tokens-per-call", type=int, default=64)
    rn = sub.add_parser("run")
    rn.add_argument("--system", required=True, choices=["ours-onnx", "ours-pte", "hf-eager", "llamacpp"])
    rn.add_argument("--art")
    rn.add_argument("--gguf")
    rn.add_argument("--kv", default="f16/f16", help="llama.cpp type_k/type_v")
    rn.add_argument("--ids", required=True)
    rn.add_argument("--ctx", type=int, required=True)
    rn.add_argument("--steps", type=int, default=32)
    rn.add_argument("--warmup", type=int, default=2)
    rn.add_argument("--threads", type=int, default=2)
    rn.add_argument("--hf-chunk", type=int, default=512)
    args = ap.parse_args(argv)
    out = do_export(args) if args.cmd == "export" else do_run(args)
    sys.stdout.flush()
    print("\n" + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
