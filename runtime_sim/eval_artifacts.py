"""Exported artifacts as rows of `pagedkv eval`'s fidelity table (toolkit.fidelity.evaluate_ids's
extra_rows): each artifacts dir is opened as the chat opens it and its windows run through the
artifact's own runtime, scored against the same fp32-pool reference rows as the KV specs.

    rows = [open_artifact(d, model, "smollm2", ctx=512) for d in dirs]
    evaluate_ids(model, ids, 512, specs, windows, extra_rows=rows)
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime_sim.session import open_artifacts
from toolkit.errors import ArtifactError
from toolkit.fidelity import spec_name


def read_artifact_manifest(art_dir, backend: str | None = None) -> dict:
    """The artifacts dir's validated manifest (toolkit.manifest.read_manifest: digest, sections, file
    names), with an artifact for `backend` when given; read before any model loads so that a wrong
    dir fails at once."""
    from toolkit.manifest import read_manifest

    art_dir = Path(art_dir)
    if not art_dir.is_dir():
        raise ArtifactError(f"--artifacts {art_dir} is not a directory: give a directory made by `pagedkv export`.")
    manifest = read_manifest(art_dir, require=("model", "pool"))
    kind = "pte" if backend == "executorch" else "onnx"
    if backend is not None and kind not in manifest["artifacts"]:
        have = ", ".join(manifest["artifacts"]) or "none"
        fix = "pass --backend executorch" if "pte" in manifest["artifacts"] else "export it with --format " + kind
        raise ArtifactError(f"{art_dir} has no {kind} artifact for the {backend} backend (it has: {have}): {fix}.")
    return manifest


class _KeepLogits:
    """The engine's backend, keeping every call's logits [T, vocab]: the engine asks for each
    conversation's last row only (what a chat needs), teacher forcing needs them all."""

    def __init__(self, backend):
        self.inner = backend
        self.calls = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, ids, positions, seq_ids, tables, rows=None):
        out = self.inner.forward(ids, positions, seq_ids, tables)
        self.calls.append(out)
        return out if rows is None else out[rows]


class ArtifactRow:
    """One exported artifact as a row: opened as the chat opens it (runtime_sim.session.open_artifacts:
    artifact sha256, package versions, graph against manifest), after checking that it was exported from
    the reference model and that its pool holds a window."""

    def __init__(self, art_dir, manifest: dict, engine, ctx: int):
        kind = "pte" if engine.backend.name == "executorch" else "onnx"
        entry = manifest["artifacts"][kind]
        self.engine = engine
        self.spec = engine.backend.layout.spec
        weights = entry.get("weights", "fp32")
        kv = spec_name(self.spec)
        self.name = f"{kind} {weights} / {kv}"
        self.info = {"artifact": str(art_dir), "format": kind, "weights": weights, "kv_spec": kv,
                     "weights_file_bytes": entry.get("bytes"), "backend": engine.backend.name}
        self._keep = _KeepLogits(engine.backend)
        engine.backend = self._keep

    def window_logits(self, window: torch.Tensor) -> torch.Tensor:
        import numpy as np

        eng = self.engine
        cid = eng.new_conversation()
        self._keep.calls = []
        try:
            eng.prefill(cid, [int(t) for t in window])
        finally:
            eng.close(cid)
        return torch.from_numpy(np.concatenate(self._keep.calls, axis=0))


def model_identity(model) -> dict:
    """What a manifest records of its model (toolkit.manifest.MODEL_IDENTITY), from a loaded model."""
    from toolkit.compiler import model_dims

    d = model_dims(model.config)
    return {"model_type": model.config.model_type, "num_layers": d.num_layers, "num_heads": d.num_heads,
            "num_kv_heads": d.num_kv_heads, "head_dim": d.head_dim, "vocab_size": d.vocab_size}


def open_artifact(art_dir, model, model_name: str, ctx: int, backend: str = "onnxruntime",
                  threads: int = 0) -> ArtifactRow:
    """An artifacts dir as a row of the table, or ArtifactError (one line): not an export, exported from
    another model than the reference, a pool too small for a window, or a damaged/mismatched file."""
    from toolkit.manifest import check_same_model, weights_sha256

    manifest = read_artifact_manifest(art_dir, backend)
    kind = "pte" if backend == "executorch" else "onnx"
    check_same_model(str(art_dir), manifest, model_name, model_identity(model), lambda: weights_sha256(model))
    pool = manifest["pool"]
    bs = pool["block_size"]
    max_blocks = manifest["artifacts"][kind].get("max_blocks_per_seq")
    if max_blocks is not None and -(-ctx // bs) > max_blocks:
        raise ArtifactError(f"{art_dir}: a window of ctx {ctx} needs {-(-ctx // bs)} blocks of {bs} tokens, its "
                            f"{kind} takes at most {max_blocks} per sequence: lower --ctx or re-export it.")
    engine = open_artifacts(art_dir, backend, threads=threads)
    seq = engine.pool.new_sequence()
    try:
        need = engine.pool.blocks_needed(seq, ctx, engine.prefill_chunk)
        free = engine.pool.free_blocks()
    finally:
        engine.pool.release(seq)
    short = [g for g, (n, f) in enumerate(zip(need, free)) if n > f]
    if short:
        g = short[0]
        raise ArtifactError(f"{art_dir}: its pool holds {free[g]} blocks of {bs} tokens ({free[g] * bs} tokens"
                            f"{f' in layer group {g}' if len(free) > 1 else ''}), a window of ctx {ctx} needs "
                            f"{need[g]}: lower --ctx or re-export with --pool-tokens {ctx} or more.")
    return ArtifactRow(art_dir, manifest, engine, ctx)
