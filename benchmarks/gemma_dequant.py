"""Is Gemma 3 270M's Q4_K_M GGUF dequantized right? Our fp32 copy (transformers' GGUF dequantization,
toolkit.model_loading) against llama.cpp running the same GGUF file.

    python benchmarks/gemma_dequant.py [--ctx 512] [--llamacpp-venv DIR]

Two checks, both with the tokenizer's BOS first (Gemma expects it):
- greedy: 32 tokens after a fixed prompt, from HF eager on our fp32 weights and from llama.cpp;
- teacher-forced top-1: over the first ctx tokens of wikitext-2 (test), the share of positions whose
  argmax next token is the same in both.
Q4_K/Q6_K dequantization errors (a wrong scale, a swapped nibble) change both at once; the small
differences of float arithmetic (llama.cpp computes in its own order, f16 KV) change neither much.
llama.cpp runs in its own venv (benchmarks/llamacpp_peer.py builds it for this CPU); this script
re-runs itself there with --worker. Writes benchmarks/results/gemma_dequant.json and prints a table.
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
PROMPT = "The capital of France is Paris. The capital of Germany is"
STEPS = 32


def worker(args) -> int:
    """In the llama.cpp venv: greedy tokens and per-position argmax for the ids in args.ids."""
    import numpy as np

    import llama_cpp

    job = json.loads(Path(args.ids).read_text())
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=len(job["text_ids"]) + 64, n_batch=512, n_ubatch=512,
                          n_threads=args.threads, n_threads_batch=args.threads, logits_all=True, verbose=False)
    llm.eval(job["text_ids"])
    top1 = np.argmax(llm.scores[: len(job["text_ids"])], axis=1).tolist()
    llm.reset()
    llm.eval(job["prompt_ids"])
    greedy = []
    for _ in range(STEPS):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(tok)
        llm.eval([tok])
    print(json.dumps({"top1": top1, "greedy": greedy, "llama_cpp": getattr(llama_cpp, "__version__", "?")}))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llamacpp-venv", type=Path, default=None,
                    help="default ~/.cache/pagedkv/llamacpp-<isa>-venv (benchmarks/llamacpp_peer.py)")
    ap.add_argument("--ctx", type=int, default=512, help="wikitext-2 tokens for the top-1 check (BOS included)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gemma_dequant.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    sys.path.insert(0, str(REPO))
    import torch

    from tests.helpers import hf_greedy
    from toolkit.model_loading import load_model
    from toolkit.model_registry import model_file

    from benchmarks.llamacpp_peer import build_flags, ensure_llamacpp, llamacpp_python

    ok, llama_version = ensure_llamacpp(args.llamacpp_venv)
    if not ok:
        sys.exit(f"llama.cpp is unavailable: {llama_version}")
    py = llamacpp_python(args.llamacpp_venv)
    gguf = model_file("gemma3-270m")
    model, tok = load_model("gemma3-270m")
    bos = tok.bos_token_id
    prompt_ids = [bos] + tok(PROMPT, add_special_tokens=False)["input_ids"]
    text_ids = [bos] + tok(TEXT.read_text(encoding="utf-8")[:20000], add_special_tokens=False)["input_ids"][: args.ctx - 1]

    t0 = time.perf_counter()
    ours_greedy = hf_greedy(model, prompt_ids, STEPS)
    with torch.no_grad():
        ours_top1 = model(torch.tensor([text_ids])).logits[0].argmax(-1).tolist()
    ours_s = time.perf_counter() - t0

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompt_ids": prompt_ids, "text_ids": text_ids}, f)
    t0 = time.perf_counter()
    proc = subprocess.run([str(py), __file__, "--worker", "--gguf", str(gguf), "--ids", f.name,
                           "--threads", str(args.threads)], capture_output=True, text=True)
    os.unlink(f.name)
    if proc.returncode != 0:
        sys.exit(f"llama.cpp worker failed: {proc.stderr.strip()[-800:]}")
    peer = json.loads(proc.stdout.strip().splitlines()[-1])
    peer_s = time.perf_counter() - t0

    same_prefix = next((i for i, (a, b) in enumerate(zip(ours_greedy, peer["greedy"])) if a != b), STEPS)
    agree = sum(a == b for a, b in zip(ours_top1, peer["top1"])) / len(text_ids)
    res = {
        "model": "Gemma 3 270M, gemma-3-270m-q4_k_m.gguf (Q4_K/Q6_K tensors)",
        "ours": "transformers GGUF dequantization -> fp32, HF eager", "peer": f"llama.cpp {peer['llama_cpp']}",
        "llamacpp_build": build_flags(),
        "prompt": PROMPT, "greedy_steps": STEPS, "greedy_ours": ours_greedy, "greedy_llamacpp": peer["greedy"],
        "greedy_identical_prefix": same_prefix, "greedy_text_ours": tok.decode(ours_greedy),
        "greedy_text_llamacpp": tok.decode(peer["greedy"]),
        "top1_positions": len(text_ids), "top1_agreement": round(agree, 5),
        "seconds": {"ours": round(ours_s, 1), "llamacpp": round(peer_s, 1)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print("| check | ours (fp32 from the GGUF) vs llama.cpp (same GGUF) |\n|---|---|")
    print(f"| greedy, {STEPS} tokens after the prompt | identical for the first {same_prefix} |")
    print(f"| top-1 next token, {len(text_ids)} wikitext-2 positions | {agree:.2%} agree |")
    print(f"\nours:      {res['greedy_text_ours']!r}\nllama.cpp: {res['greedy_text_llamacpp']!r}")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
