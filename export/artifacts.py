"""`pagedkv export`: model -> artifacts dir (model.onnx / model.pte, tokenizer files, pagedkv.json)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from export.manifest import sha256_file, update_manifest
from toolkit.compiler import compile, model_dims
from toolkit.errors import PagedKVError, SpecError
from toolkit.pool_layout import PoolLayout, check_block_size
from toolkit.quant import KVQuantSpec, bytes_per_token, fp_stage_bytes_per_sequence, resolve_spec

FORMATS = ("onnx", "pte")
ONNX_WEIGHTS = ("fp32", "int4")
PTE_WEIGHTS = ("fp32", "8da4w")


@dataclass
class PoolRequest:
    """How big the pool should be: tokens or MiB (exactly one), and how many sequences share it."""

    pool_tokens: int | None = None
    pool_mb: float | None = None
    max_seqs: int = 4
    block_size: int = 16

    def num_blocks(self, spec: KVQuantSpec, num_layers: int, kv_heads: int, head_dim: int) -> int:
        if self.pool_tokens is not None and self.pool_mb is not None:
            raise SpecError("give either --pool-tokens or --pool-mb, not both.")
        if self.pool_mb is not None:
            per_token = bytes_per_token(spec, kv_heads, head_dim, num_layers)
            stage = fp_stage_bytes_per_sequence(spec, self.block_size, kv_heads, head_dim, num_layers) * self.max_seqs
            budget = self.pool_mb * 2**20 - stage
            blocks = int(budget // (per_token * self.block_size))
            if blocks < 1:
                raise SpecError(
                    f"--pool-mb {self.pool_mb} is too small for one block of {self.block_size} tokens "
                    f"({per_token * self.block_size + stage} bytes with {self.max_seqs} sequences): raise it."
                )
            return blocks
        tokens = self.pool_tokens if self.pool_tokens is not None else 2048
        if tokens < 1:
            raise SpecError(f"--pool-tokens {tokens}: the pool needs at least one token.")
        return -(-tokens // self.block_size)


def make_layout(config, spec: KVQuantSpec, req: PoolRequest) -> PoolLayout:
    d = model_dims(config)
    nb = req.num_blocks(spec, d.num_layers, d.num_kv_heads, d.head_dim)
    return PoolLayout(spec, d.num_layers, d.num_kv_heads, d.head_dim, req.block_size, nb, req.max_seqs)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def export_artifacts(
    model_path: str,
    out_dir: Path,
    formats: tuple[str, ...] = ("onnx",),
    spec: str | KVQuantSpec = "default",
    pool: PoolRequest | None = None,
    onnx_weights: str = "fp32",
    pte_weights: str = "fp32",
    max_tokens_per_call: int = 64,
    console: Console | None = None,
    model_and_tokenizer=None,
) -> dict:
    """Export `model_path` to `out_dir`; returns the manifest. `model_and_tokenizer` skips loading."""
    from toolkit.model_loading import load_model

    console = console or Console(stderr=True)
    for f in formats:
        if f not in FORMATS:
            raise PagedKVError(f"unknown format '{f}': use onnx, pte or all.")
    if onnx_weights not in ONNX_WEIGHTS:
        raise PagedKVError(f"--onnx-weights {onnx_weights}: use one of {', '.join(ONNX_WEIGHTS)}.")
    if pte_weights not in PTE_WEIGHTS:
        raise PagedKVError(f"--pte-weights {pte_weights}: use one of {', '.join(PTE_WEIGHTS)}.")
    spec = resolve_spec(spec).validate()
    pool = pool or PoolRequest()
    check_block_size(pool.block_size)  # cheap checks before the (slow) model load
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    model, tokenizer = model_and_tokenizer or load_model(model_path)
    layout = make_layout(model.config, spec, pool)  # validates spec/pool before any slow work
    dims = model_dims(model.config)
    say = lambda msg: console.print(f"[dim]  {msg}[/]")  # noqa: E731

    tok_files = []
    if tokenizer is not None:
        tok_files = [Path(p).name for p in tokenizer.save_pretrained(out_dir) if Path(p).exists()]
    update_manifest(
        out_dir,
        model={
            "name": str(model_path),
            "model_type": model.config.model_type,
            "num_layers": dims.num_layers,
            "num_heads": dims.num_heads,
            "num_kv_heads": dims.num_kv_heads,
            "head_dim": dims.head_dim,
            "vocab_size": dims.vocab_size,
            "eos_token_ids": _eos_ids(model, tokenizer),
        },
        pool=layout.to_dict(),
        tokenizer_files=tok_files,
    )
    artifacts = {}
    for fmt in formats:  # onnx before pte: 8da4w quantizes the weights in place
        t0 = time.time()
        paged = compile(model, spec, block_size=layout.block_size, num_blocks=layout.num_blocks,
                        max_seqs=layout.max_seqs)
        with console.status(f"exporting {fmt} ({dims.num_layers} layers, {spec.describe()})..."):
            if fmt == "onnx":
                from export.onnx_export import export_onnx

                entry = export_onnx(paged, out_dir / "model.onnx", progress=say)
                if onnx_weights == "int4":
                    from export.onnx_export import quantize_weights_int4

                    say("quantizing MatMul weights to int4 (MatMulNBits)")
                    quantize_weights_int4(out_dir / "model.onnx")
                entry["weights"] = onnx_weights
            else:
                from export.executorch_export import export_pte

                entry = export_pte(paged, out_dir / "model.pte", weights=pte_weights,
                                   max_tokens=max_tokens_per_call, progress=say)
        entry["sha256"] = sha256_file(out_dir / entry["file"])
        entry["export_seconds"] = round(time.time() - t0, 1)
        entry["bytes"] = (out_dir / entry["file"]).stat().st_size
        artifacts[fmt] = entry
        console.print(f"  wrote {out_dir / entry['file']} ({entry['bytes'] / 2**20:.1f} MiB, {entry['export_seconds']}s)")
    return update_manifest(out_dir, artifacts=artifacts)
