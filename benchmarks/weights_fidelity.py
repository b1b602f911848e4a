"""Fidelity of the exported weight formats beside the KV spec: SmolLM2-135M-Instruct on wikitext-2.

    python benchmarks/weights_fidelity.py                          # onnx fp32, int4, int4-e4; ctx 512 x 8
    python benchmarks/weights_fidelity.py --weights fp32 --artifacts DIR [DIR ...]   # reuse exports
    python benchmarks/weights_fidelity.py --weights fp32 int4 --variants int4-hqq int8  # candidate quantizers

Each weight format is exported to ONNX with the KV spec (--spec, default "default") into a cache dir
(reused while its manifest validates and names the same model, spec and weights), then scored by
toolkit.fidelity.evaluate_ids like `pagedkv eval MODEL --artifacts DIR`: teacher-forced windows
through the artifact on onnxruntime (the chat's Engine, prefill chunks of 64), against the fp32 model
with an unquantized fp32 pool, beside the same KV spec on the fp32 PyTorch model. Writes
benchmarks/results/weights_fidelity.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.e2e import cpu_model  # noqa: E402
from runtime_sim.eval_artifacts import open_artifact  # noqa: E402
from toolkit.fidelity import evaluate_ids, markdown_table, tokenize, tokenizer_bos  # noqa: E402

DEFAULT_TEXT = REPO / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
CACHE = Path(os.environ.get("PAGEDKV_CACHE", Path.home() / ".cache" / "pagedkv")) / "bench-artifacts"


def cached_export(model_name: str, model, tokenizer, weights: str, spec: str, pool_tokens: int, force: bool) -> Path:
    """The ONNX export of `weights` under the cache, made when missing or not matching."""
    from export.artifacts import PoolRequest, export_artifacts
    from toolkit.errors import PagedKVError
    from runtime_sim.eval_artifacts import model_identity
    from toolkit.kv_spec import resolve_spec
    from toolkit.manifest import check_same_model, layout_from_manifest, read_manifest

    out = CACHE / f"weights-fidelity-{Path(model_name).name}-{spec.replace(':', '_')}" / f"onnx-{weights}"
    if out.is_dir() and not force:
        try:
            m = read_manifest(out, require=("model", "pool"))
            check_same_model(str(out), m, model_name, model_identity(model))
            ok = (m["artifacts"].get("onnx", {}).get("weights") == weights
                  and layout_from_manifest(m).spec == resolve_spec(spec)
                  and layout_from_manifest(m).num_blocks * layout_from_manifest(m).block_size >= pool_tokens)
            if ok:
                print(f"reusing {out}", file=sys.stderr)
                return out
        except PagedKVError as e:
            print(f"re-exporting {out}: {e}", file=sys.stderr)
    t0 = time.perf_counter()
    export_artifacts(model_name, out, ("onnx",), spec, PoolRequest(pool_tokens=pool_tokens, max_seqs=1),
                     onnx_weights=weights, model_and_tokenizer=(model, tokenizer), force=True)
    print(f"exported {out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


# Candidate int4/int8 weight quantizers that `pagedkv export` does not offer (yet), made from the fp32
# export's model.onnx with onnxruntime's MatMulNBitsQuantizer, MatMul weights only (like "int4"):
# name -> (bits, algorithm). "int4" itself is symmetric RTN, blocks of 32, accuracy_level 4.
VARIANTS = {"int4-hqq": (4, "hqq"), "int8": (8, "rtn")}


def variant_export(fp32_dir: Path, name: str) -> Path:
    """A copy of the fp32 export with its MatMul weights requantized as VARIANTS[name] (cached; the
    manifest is rewritten with the new file's sha256 and the variant's name as its weights)."""
    import shutil

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from toolkit.manifest import read_manifest, sha256_file, write_manifest

    out = fp32_dir.parent / f"onnx-{name}"
    try:
        if read_manifest(out)["artifacts"]["onnx"]["weights"] == name and \
                read_manifest(fp32_dir)["model"] == read_manifest(out)["model"]:
            print(f"reusing {out}", file=sys.stderr)
            return out
    except Exception:  # noqa: BLE001  missing or stale: make it again
        pass
    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(fp32_dir, out)
    bits, algo = VARIANTS[name]
    kw = dict(op_types_to_quantize=("MatMul",), quant_axes=(("MatMul", 0),))
    model = onnx.load(str(out / "model.onnx"))
    if algo == "hqq":
        quant = MatMulNBitsQuantizer(model, block_size=32, algo_config=HQQWeightOnlyQuantConfig(block_size=32, bits=bits,
                                                                                               **kw), **kw)
    else:
        quant = MatMulNBitsQuantizer(model, bits=bits, block_size=32, is_symmetric=True, accuracy_level=4, **kw)
    quant.process()
    onnx.save_model(quant.model.model, str(out / "model.onnx"))
    m = read_manifest(out)
    m["artifacts"]["onnx"].update(sha256=sha256_file(out / "model.onnx"), bytes=(out / "model.onnx").stat().st_size,
                                  weights=name)
    write_manifest(out, m)
    print(f"made {out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def weights_table(res: dict) -> str:
    head = ["row", "weights", "model file", "KV bytes vs fp16", "PPL", "PPL +%", "KLD", "top-1"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["results"]:
        size = f"{r['weights_file_bytes'] / 2**20:.1f} MiB" if r.get("weights_file_bytes") else "-"
        weights = f"{r['format']} {r['weights']}" if "weights" in r else "PyTorch fp32"
        lines.append(f"| {r['spec']} | {weights} | {size} | {r['bytes_per_token_vs_fp16']:.3f}x | {r['ppl']:.3f} | "
                     f"{r['ppl_increase_pct']:+.3f}% | {r['kld_mean']:.5f} | {100 * r['top1_agreement']:.2f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="HF dir, .gguf or 'smollm2' (default)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="text file (default: wikitext-2 wiki.test.raw)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--spec", default="default", help="KV spec of the exports (and of the PyTorch row beside them)")
    ap.add_argument("--weights", nargs="*", default=["fp32", "int4", "int4-e4"],
                    help="ONNX weight formats to export (cached) and score (default: fp32 int4 int4-e4)")
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                    help="candidate quantizers export does not offer, made from the fp32 export (needs fp32 in "
                    "--weights): int4-hqq (HQQ 4-bit, blocks of 32), int8 (symmetric RTN, blocks of 32)")
    ap.add_argument("--artifacts", nargs="*", type=Path, default=[],
                    help="existing artifacts dirs of the same model to score as well")
    ap.add_argument("--pool-tokens", type=int, default=1024, help="pool of the exports (>= --ctx)")
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime threads (0 = its default)")
    ap.add_argument("--backend", choices=["onnxruntime", "executorch"], default="onnxruntime",
                    help="runtime of the artifact rows: executorch scores .pte artifacts (pass them with "
                    "--artifacts and --weights with no format, e.g. --weights --backend executorch --artifacts DIR)")
    ap.add_argument("--force-export", action="store_true", help="re-export even when a cached export validates")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "weights_fidelity.json")
    args = ap.parse_args(argv)
    if not args.text.is_file():
        ap.error(f"text file {args.text} not found: pass --text FILE")
    if args.pool_tokens < args.ctx:
        ap.error(f"--pool-tokens {args.pool_tokens} is below --ctx {args.ctx}")

    import torch

    from toolkit.model_loading import load_model

    model, tokenizer = load_model(args.model)
    arts = [cached_export(args.model, model, tokenizer, w, args.spec, args.pool_tokens, args.force_export)
            for w in args.weights]
    if args.variants and "fp32" not in args.weights:
        ap.error("--variants are made from the fp32 export: include fp32 in --weights")
    arts += [variant_export(arts[args.weights.index("fp32")], v) for v in args.variants] + list(args.artifacts)
    model, tokenizer = load_model(args.model)  # a fresh copy: nothing an export did to the model stays
    ids = tokenize(tokenizer, args.text.read_text(encoding="utf-8"))
    bos_id = tokenizer_bos(tokenizer)
    t0 = time.perf_counter()
    rows = [open_artifact(a, model, args.model, args.ctx, args.backend, args.threads) for a in arts]
    res = evaluate_ids(model, ids, args.ctx, [args.spec], args.windows, model_name=args.model, bos_id=bos_id,
                       extra_rows=rows)
    seconds = time.perf_counter() - t0
    cpu = cpu_model()
    res.update(
        text=args.text.name, windows=args.windows, predictions=args.windows * (args.ctx - 1), seconds=round(seconds, 1),
        cpu=cpu, torch_threads=torch.get_num_threads(), ort_threads=args.threads,
        method="teacher-forced windows from the start of the text; reference = fp32 weights (PyTorch) with an fp32 "
        f"pool; artifact rows run through runtime_sim's Engine on {args.backend} (prefill chunks of 64); metrics over "
        "the ctx-1 next-token positions of each window",
        command="python benchmarks/weights_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\n### {res['model']}, ctx {args.ctx}, {args.windows} windows, KV spec {args.spec}, {seconds:.0f} s\n")
    print(weights_table(res))
    print("\n" + markdown_table(res))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
