"""Export SmolLM2-135M-Instruct to every artifact kind and measure each against the torch model.

For onnx (fp32 / int4 MatMulNBits weights) and pte (fp32 / 8da4w weights), all with the default
K8/V4 pool: export time and size (from the manifest written by the export), then logits agreement
with the compiled torch model (fp32 weights, same KV spec) on wikitext-2 tokens, teacher-forced:
a 96-token prefill in chunks of 32, then 32 single-token steps.

    python benchmarks/export_smollm2.py [--variants onnx-fp32,pte-fp32] [--out-root DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from export.artifacts import PoolRequest, export_artifacts  # noqa: E402
from toolkit.manifest import read_manifest  # noqa: E402
from runtime_sim.backends import TorchBackend  # noqa: E402
from runtime_sim.engine import Engine  # noqa: E402
from runtime_sim.session import open_artifacts  # noqa: E402
from toolkit.compiler import compile  # noqa: E402
from toolkit.errors import PagedKVError  # noqa: E402
from toolkit.model_loading import cache_dir, load_model  # noqa: E402

WIKI = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
VARIANTS = {  # name -> (format, weights)
    "onnx-fp32": ("onnx", "fp32"),
    "onnx-int4": ("onnx", "int4"),
    "pte-fp32": ("pte", "fp32"),
    "pte-8da4w": ("pte", "8da4w"),
}
PREFILL, STEPS, CHUNK = 96, 32, 32


def ensure_exported(name: str, root: Path) -> Path:
    fmt, weights = VARIANTS[name]
    out = root / name
    try:
        if fmt in read_manifest(out).get("artifacts", {}):
            return out
    except PagedKVError:
        pass
    model, tok = load_model("smollm2")  # fresh weights: 8da4w quantizes them in place
    export_artifacts("smollm2", out, (fmt,), "default", PoolRequest(pool_tokens=1024, max_seqs=1),
                     onnx_weights=weights if fmt == "onnx" else "fp32",
                     pte_weights=weights if fmt == "pte" else "fp32", max_tokens_per_call=CHUNK,
                     model_and_tokenizer=(model, tok), force=True)
    return out


def logits_trace(engine: Engine, ids: list[int]) -> np.ndarray:
    """Teacher-forced: logits after each chunk of the prefill and after each single-token step."""
    cid = engine.new_conversation()
    rows = []
    for a in range(0, PREFILL, CHUNK):
        rows.append(engine.step({cid: ids[a:a + CHUNK]})[cid])
    for tok in ids[PREFILL:PREFILL + STEPS]:
        rows.append(engine.step({cid: [tok]})[cid])
    return np.stack(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out-root", type=Path, default=cache_dir() / "export-bench")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "export_smollm2.json")
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v}: choose from {', '.join(VARIANTS)}")

    model, tok = load_model("smollm2")
    ids = tok(WIKI.read_text(encoding="utf-8")[:20000], add_special_tokens=False)["input_ids"][: PREFILL + STEPS]
    rows = []
    reference = None
    for name in names:
        t0 = time.time()
        art = ensure_exported(name, a.out_root)
        fmt, weights = VARIANTS[name]
        entry = read_manifest(art)["artifacts"][fmt]
        engine = open_artifacts(art, "onnxruntime" if fmt == "onnx" else "executorch", prefill_chunk=CHUNK)
        if reference is None:
            lay = engine.backend.layout
            paged = compile(model, lay.spec, block_size=lay.block_size, num_blocks=lay.num_blocks, max_seqs=1)
            reference = logits_trace(Engine(TorchBackend(paged), prefill_chunk=CHUNK), ids)
        got = logits_trace(engine, ids)
        diff = np.abs(got - reference)
        rows.append({
            "variant": name, "format": fmt, "weights": weights,
            "export_seconds": entry.get("export_seconds"), "bytes": entry.get("bytes"),
            "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
            "top1_agreement": float((got.argmax(-1) == reference.argmax(-1)).mean()),
            "native_kernel": bool(getattr(engine.backend, "native", fmt == "pte")),
            "seconds": round(time.time() - t0, 1),
        })
        print(json.dumps(rows[-1]), flush=True)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "spec": "default", "prefill": PREFILL,
                                  "steps": STEPS, "rows": rows}, indent=2) + "\n")
    cols = ["variant", "export_seconds", "bytes", "max_abs_logit_diff", "mean_abs_logit_diff", "top1_agreement"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
