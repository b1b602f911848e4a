"""Fixtures for the native runner's tests: a byte-level BPE tokenizer trained with HF `tokenizers`
on wikitext, a tiny llama exported to .pte (fp32 pool) with it, and HF's greedy tokens.

    python android_demo/native/tests/make_fixtures.py OUT_DIR --text WIKI_TEST_RAW [--spec fp32] [--pool-tokens N]

WIKI_TEST_RAW is wikitext-2's wiki.test.raw (the tests pass tests/conftest.py's wikitext fixture).

Writes OUT_DIR/artifacts (model.pte, pagedkv.json, tokenizer files) and OUT_DIR/expected.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = [
    "The tower is 324 metres tall, about the same height as an 81-storey building.",
    " Valkyria Chronicles III is a tactical role @-@ playing video game",
    "Hello, world! \u00e9t\u00e9 \u4e2d\u6587 \U0001F600 tabs\tand  spaces",
]


def text_lines(text: Path, limit: int | None = None) -> list[str]:
    lines = [ln for ln in Path(text).read_text(encoding="utf-8").splitlines() if ln.strip()]
    return lines[:limit] if limit else lines


def tiny_bpe_tokenizer(text: Path, vocab_size: int = 512):
    """The tiny models' byte-level BPE, trained on the first 3000 non-empty lines of text (wikitext)."""
    from toolkit.tiny_models import tiny_bpe_tokenizer as train

    return train(text_lines(text, 3000), vocab_size)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain HF greedy loop (full recompute each step, no cache tricks)."""
    import torch

    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            t = int(torch.argmax(logits))
            out.append(t)
            ids.append(t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--text", type=Path, required=True, help="wikitext-2's wiki.test.raw (trains the tokenizer)")
    ap.add_argument("--spec", default="fp32")
    ap.add_argument("--pool-tokens", type=int, default=512)
    ap.add_argument("--max-seqs", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--compact-blocks", type=int, default=0, help="a compact region of N blocks (issue 25)")
    a = ap.parse_args(argv)

    from export.artifacts import PoolRequest, export_artifacts
    from toolkit.tiny_models import tiny_model

    a.out.mkdir(parents=True, exist_ok=True)
    tok = tiny_bpe_tokenizer(a.text)
    model = tiny_model("llama")
    art = a.out / "artifacts"
    export_artifacts(
        "tiny-llama", art, formats=("pte",), spec=a.spec,
        pool=PoolRequest(pool_tokens=a.pool_tokens, max_seqs=a.max_seqs, block_size=16, compact_blocks=a.compact_blocks),
        max_tokens_per_call=32, model_and_tokenizer=(model, tok), accept_fidelity=True,
    )
    reference = tiny_model("llama")  # export rewrites `model`'s attention; HF runs on a fresh copy
    cases = []
    for p in PROMPTS[:2]:
        ids = tok(p)["input_ids"]
        cases.append({"prompt": p, "prompt_ids": ids, "hf_greedy": hf_greedy(reference, ids, a.new_tokens)})
    (a.out / "expected.json").write_text(json.dumps({"spec": a.spec, "cases": cases}, indent=1))
    print(f"wrote {art} and {a.out / 'expected.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
