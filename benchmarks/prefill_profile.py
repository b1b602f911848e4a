"""Where prefill time goes in an exported ONNX artifact: onnxruntime's own profiler over one prefill
through runtime_sim's Engine (chunks of 64, as the chat runs it), summed by operator type and by node.

    python benchmarks/prefill_profile.py --model gemma3-270m --tokens 1024 --threads 1 \
        --artifacts ~/.cache/pagedkv/bench-artifacts/gemma3-270m-onnx-int4-e4-best-33792

The prompt is the first `tokens` tokens of wikitext-2 (BOS first when the tokenizer has one). Writes
benchmarks/results/prefill_profile_<model>.json: total prefill seconds, then the kernel time of each
operator type and of the largest nodes, with their share of all kernel time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def kernel_times(trace: list[dict]) -> tuple[collections.Counter, collections.Counter]:
    """Microseconds per operator type and per node, from onnxruntime's profile events."""
    by_op, by_node = collections.Counter(), collections.Counter()
    for ev in trace:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            by_op[ev["args"]["op_name"]] += ev["dur"]
            by_node[ev["name"][: -len("_kernel_time")]] += ev["dur"]
    return by_op, by_node


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, required=True, help="an exported ONNX artifacts dir")
    ap.add_argument("--model", default="gemma3-270m", help="model name for the tokenizer (as pagedkv export)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=6, help="largest nodes to list")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (args.artifacts / "pagedkv.json").is_file():
        ap.error(f"{args.artifacts} has no pagedkv.json: pass an exported artifacts dir")

    sys.path.insert(0, str(REPO))
    import onnxruntime as ort

    from benchmarks.e2e import cpu_model
    from runtime_sim.session import open_artifacts
    from toolkit.model_loading import load_model

    prefix = Path(tempfile.mkdtemp(prefix="pagedkv-prof-")) / "ort"
    base = ort.SessionOptions

    class ProfiledOptions(base):  # the engine's session, with onnxruntime's profiler on
        def __init__(self):
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = str(prefix)

    _, tok = load_model(args.model)
    ids = tok(TEXT.read_text(encoding="utf-8")[: 20 * args.tokens], add_special_tokens=False)["input_ids"]
    ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids
    ids = ids[: args.tokens]
    ort.SessionOptions = ProfiledOptions
    try:
        engine = open_artifacts(args.artifacts, "onnxruntime", threads=args.threads)
    finally:
        ort.SessionOptions = base
    cid = engine.new_conversation()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    engine.prefill(cid, ids)
    seconds = time.perf_counter() - t0
    by_op, by_node = kernel_times(json.loads(Path(engine.backend.session.end_profiling()).read_text()))
    total = sum(by_op.values()) or 1
    share = lambda us: {"s": round(us / 1e6, 3), "share": round(us / total, 4)}  # noqa: E731
    report = {"model": args.model, "artifacts": str(args.artifacts), "tokens": len(ids), "threads": args.threads,
              "prefill_chunk": engine.prefill_chunk, "prefill_s": round(seconds, 2), "load_avg_at_start": load,
              "cpu": cpu_model(), "kernel_s": round(total / 1e6, 3),
              "by_op": {k: share(v) for k, v in by_op.most_common()},
              "top_nodes": {k: share(v) for k, v in by_node.most_common(args.top)},
              "command": "python benchmarks/prefill_profile.py " + " ".join(argv or sys.argv[1:])}
    out = args.out or REPO / "benchmarks" / "results" / f"prefill_profile_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"prefill of {len(ids)} tokens: {seconds:.1f} s ({len(ids) / seconds:.0f} tok/s), {args.threads} thread(s), "
          f"load {load:.1f}")
    for k, v in list(by_op.most_common())[:8]:
        print(f"  {k:28s} {v / 1e6:7.2f} s  {100 * v / total:5.1f}%")
    print("largest nodes:")
    for k, v in by_node.most_common(args.top):
        print(f"  {k[:60]:60s} {v / 1e6:7.2f} s  {100 * v / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
