"""Long-context retrieval through each KV spec: keys hidden in filler text at several depths, asked for at
the end, answered greedily.

    python benchmarks/retrieval.py --model qwen2.5-coder-1.5b --ctx 4096 16384

The context is wikitext-2 paragraphs (../shared/data) with one sentence "The access code of the NAME
vault is NNNNN." inserted at each depth (10%, 50%, 90% of the context by default), cut to a whole number of
blocks. It is prefilled once per spec in chunks through the paged model (the op on the native core, the
key offsets export calibrates subtracted, as the exported artifact does); then each key is asked for in a
chat turn (the model's chat template) that continues right after the context, greedy, and the turn is
rolled back (its positions rewritten) before the next one. A key counts as retrieved when its five
digits appear in the first 24 generated tokens. The fp16 pool is the reference row. Writes
benchmarks/results/retrieval.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_TEXT = REPO / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
COMPACT = "default:k_bits=4,v_bits=3,k_group=64,v_group=64,v_sym=false"  # kv_spec.COMPACT_SPEC as a whole pool
SPECS = ["fp16", "default", "best", "k5v4", "k4v4", "q8_0-q4_0", COMPACT]
NAMES = ["amber", "cobalt", "juniper", "saffron", "granite", "harbor", "willow"]
ANSWER_TOKENS = 24
BLOCK = 16


MARK = "\x00CONTEXT\x00"


def framing(tok, name: str) -> tuple[list[int], list[int]]:
    """The chat turn around the context: (ids before it, ids after it: the question and the assistant's
    header), from the model's chat template with the context as the start of the user's message."""
    chat = [{"role": "user", "content": f"{MARK}\n\nWhat is the access code of the {name} vault? Answer with the "
             "number only."}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    before, after = text.split(MARK)
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    return enc(before), enc(after)


def build_context(tok, filler: list[int], ctx: int, depths: list[float], seed: int) -> tuple[list[int], list]:
    """The chat's opening and filler ids with one key sentence at each depth: ctx tokens cut to a multiple of
    BLOCK (so each question starts a fresh block). Returns (ids, [(name, code, depth), ...])."""
    rnd = random.Random(seed)
    keys = [(NAMES[i % len(NAMES)], f"{rnd.randrange(10000, 100000)}", d) for i, d in enumerate(depths)]
    ids, pos = list(framing(tok, keys[0][0])[0]), 0
    for name, code, depth in sorted(keys, key=lambda k: k[2]):
        take = max(0, int(depth * ctx) - len(ids))
        ids += filler[pos:pos + take]
        pos += take
        ids += tok(f" The access code of the {name} vault is {code}. ", add_special_tokens=False)["input_ids"]
    ids += filler[pos:pos + max(0, ctx - len(ids))]
    return ids[:ctx - ctx % BLOCK], keys


def run_spec(model, tok, spec: str, ids: list[int], keys, offsets, chunk: int) -> tuple[list[bool], list[str], float]:
    import torch

    from toolkit.compiler import compile
    from toolkit.native_op import native_op

    n_q = max(len(framing(tok, k[0])[1]) for k in keys) + ANSWER_TOKENS
    blocks = -(-(len(ids) + n_q) // BLOCK) + 1
    paged = compile(model, spec, block_size=BLOCK, num_blocks=blocks, max_seqs=1, groups=False, key_offsets=offsets)
    table = torch.arange(blocks, dtype=torch.int64)[None, :]
    seq0 = lambda n: torch.zeros(n, dtype=torch.int64)  # noqa: E731
    t0 = time.perf_counter()
    with torch.no_grad(), native_op():
        for start in range(0, len(ids), chunk):
            part = torch.tensor(ids[start:start + chunk])
            pos = torch.arange(start, start + part.numel())
            paged(part[None], pos, seq0(part.numel()), table, logits_rows=torch.tensor([part.numel() - 1]))
        hits, answers = [], []
        for name, code, _ in keys:
            q = torch.tensor(framing(tok, name)[1])
            p = len(ids)
            logits = paged(q[None], torch.arange(p, p + q.numel()), seq0(q.numel()), table,
                           logits_rows=torch.tensor([q.numel() - 1]))
            p += q.numel()
            out = []
            for _ in range(ANSWER_TOKENS):
                nxt = int(logits[0, -1].argmax())
                out.append(nxt)
                if nxt in (tok.eos_token_id,):
                    break
                logits = paged(torch.tensor([[nxt]]), torch.tensor([p]), seq0(1), table)
                p += 1
            text = tok.decode(out, skip_special_tokens=True)
            answers.append(text.strip())
            hits.append(code in text.replace(" ", ""))
    return hits, answers, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a registered model name, a HF dir or a .gguf")
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--specs", nargs="+", default=SPECS)
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk (tokens per paged call)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "retrieval.json")
    args = ap.parse_args(argv)
    if not args.text.is_file():
        ap.error(f"text file {args.text} not found: pass --text FILE")
    if any(not 0 <= d < 1 for d in args.depths):
        ap.error("--depths are fractions of the context in [0, 1)")

    import torch

    from toolkit.calibration import calibration_ids
    from toolkit.fidelity import tokenize
    from toolkit.key_offsets import measure_key_offsets
    from toolkit.model_loading import load_model

    model, tok = load_model(args.model)
    offsets = measure_key_offsets(model, calibration_ids(tok)[0])
    filler = tokenize(tok, args.text.read_text(encoding="utf-8"))
    report = {"model": args.model, "cpu_threads": torch.get_num_threads(), "depths": args.depths,
              "answer_tokens": ANSWER_TOKENS, "runs": []}
    lines = ["| ctx | spec | retrieved | answers | seconds |", "|---:|---|---:|---|---:|"]
    for ctx in args.ctx:
        ids, keys = build_context(tok, filler, ctx, args.depths, args.seed + ctx)
        for spec in args.specs:
            hits, answers, secs = run_spec(model, tok, spec, ids, keys, offsets, args.chunk)
            row = {"ctx": len(ids), "spec": spec, "retrieved": sum(hits), "keys": len(keys), "hits": hits,
                   "answers": answers, "codes": [k[1] for k in keys], "seconds": round(secs, 1)}
            report["runs"].append(row)
            shown = "; ".join(a[:14] for a in answers)
            lines.append(f"| {len(ids)} | {spec} | {sum(hits)}/{len(keys)} | {shown} | {secs:.0f} |")
            print(lines[-1], flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
