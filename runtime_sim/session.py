"""Open an artifacts directory (made by `pagedkv export`) as a ready Engine.

    engine = open_artifacts("artifacts/smollm2", backend="onnxruntime")

Verifies the manifest (sha256 of the artifact, package versions), builds the backend with a pool
laid out exactly as the manifest says, and loads the tokenizer saved next to the model.
"""

from __future__ import annotations

from pathlib import Path

from export.manifest import layout_from_manifest, read_manifest, verify_artifact
from runtime_sim.engine import Engine
from toolkit.errors import PagedKVError

BACKENDS = ("onnxruntime", "executorch", "torch")


def load_tokenizer(art_dir: Path, manifest: dict):
    if not manifest.get("tokenizer_files"):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(art_dir))


def make_backend(art_dir: Path, manifest: dict, backend: str, native: bool | None = None, threads: int = 0):
    layout = layout_from_manifest(manifest)
    if backend == "onnxruntime":
        from runtime_sim.backends import OrtBackend

        path = verify_artifact(art_dir, manifest, "onnx")
        entry = manifest["artifacts"]["onnx"]
        return OrtBackend(path, layout, entry["inputs"], entry["outputs"], native=native, threads=threads)
    if backend == "executorch":
        from runtime_sim.backends import ExecuTorchBackend

        path = verify_artifact(art_dir, manifest, "pte")
        return ExecuTorchBackend(path, layout, manifest["artifacts"]["pte"])
    if backend == "torch":
        from runtime_sim.backends import TorchBackend
        from toolkit.compiler import compile
        from toolkit.model_loading import load_model

        model, _ = load_model(manifest["model"]["name"])
        paged = compile(model, layout.spec, block_size=layout.block_size, num_blocks=layout.num_blocks,
                        max_seqs=layout.max_seqs)
        return TorchBackend(paged)
    raise PagedKVError(f"unknown backend '{backend}': use one of {', '.join(BACKENDS)}.")


def open_artifacts(art_dir, backend: str = "onnxruntime", native: bool | None = None, threads: int = 0,
                   prefill_chunk: int | None = None) -> Engine:
    art_dir = Path(art_dir)
    manifest = read_manifest(art_dir)
    be = make_backend(art_dir, manifest, backend, native=native, threads=threads)
    chunk = prefill_chunk or manifest.get("artifacts", {}).get("pte", {}).get("max_tokens_per_call", 64)
    engine = Engine(be, load_tokenizer(art_dir, manifest), prefill_chunk=min(chunk, 64))
    engine.manifest = manifest
    engine.stop_ids = tuple(manifest["model"].get("eos_token_ids", []))
    return engine
