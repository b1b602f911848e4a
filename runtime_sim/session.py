"""Open an artifacts directory (made by `pagedkv export`) as a ready Engine.

    engine = open_artifacts("artifacts/smollm2", backend="onnxruntime")

Verifies the manifest (sha256 of the artifact, package versions), builds the backend with a pool
laid out exactly as the manifest says, and loads the tokenizer saved next to the model.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

from toolkit.manifest import layout_from_manifest, read_manifest, verify_artifact
from runtime_sim.engine import POLICIES, Engine
from toolkit.errors import ArtifactError, PagedKVError
from toolkit.pool_layout import PoolLayout, budget_blocks

BACKENDS = ("onnxruntime", "executorch", "torch")


def load_tokenizer(art_dir: Path, manifest: dict):
    names = manifest.get("tokenizer_files") or []
    if not names:
        return None
    from runtime_sim.tokenizer import ArtifactTokenizer
    from toolkit.manifest import artifact_path

    missing = [n for n in names if not artifact_path(art_dir, n, "tokenizer file").is_file()]
    if missing:
        raise ArtifactError(f"{art_dir} lacks the tokenizer file(s) {', '.join(missing)} its manifest lists: "
                            "re-run `pagedkv export`.")
    return ArtifactTokenizer(art_dir, names)


def available_ram_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise PagedKVError("cannot read MemAvailable from /proc/meminfo: give --pool-mb instead of --pool-fraction.")


def sized_layout(layout: PoolLayout, pool_mb: float | None, pool_fraction: float | None,
                 groups=None) -> PoolLayout:
    """The pool to allocate at startup: a byte budget (MiB or a fraction of available RAM), never more
    blocks than the export was made for (so no allocation exceeds the manifest's maximum). With layer
    groups (the manifest's) the budget sizes group 0 and the others keep their blocks (sized_groups), as
    the Android runner's budget_blocks does."""
    if pool_mb is None and pool_fraction is None:
        return layout
    if pool_mb is not None and pool_fraction is not None:
        raise PagedKVError("give either --pool-mb or --pool-fraction, not both.")
    if pool_mb is not None and not (math.isfinite(pool_mb) and pool_mb > 0):
        raise PagedKVError(f"--pool-mb {pool_mb}: give a positive, finite size in MiB.")
    if pool_fraction is not None and not (math.isfinite(pool_fraction) and 0 < pool_fraction <= 1):
        raise PagedKVError(f"--pool-fraction {pool_fraction} must be in (0, 1].")
    budget = pool_mb * 2**20 if pool_mb is not None else pool_fraction * available_ram_bytes()
    what = f"--pool-mb {pool_mb}" if pool_mb is not None else \
        f"--pool-fraction {pool_fraction} ({budget / 2**20:.2f} MiB of available RAM)"
    cap = groups[0].num_blocks if groups else layout.num_blocks
    blocks = min(cap, budget_blocks(layout, budget, what, groups))  # toolkit.pool_layout: the one formula
    return replace(layout, num_blocks=blocks)


def sized_groups(groups, exported: PoolLayout, sized: PoolLayout):
    """The manifest's layer groups for a pool that sized_layout resized: group 0 gets its block count."""
    if not groups or sized.num_blocks == exported.num_blocks:
        return groups
    return [replace(groups[0], num_blocks=sized.num_blocks), *groups[1:]]


def check_threads(threads: int) -> int:
    """0 (the runtime's default) or 1..cores; more than the cores is capped with a note (a huge count
    makes the runtimes create that many threads and run out of memory)."""
    if threads < 0:
        raise PagedKVError(f"threads={threads}: use a positive thread count, or 0 for the runtime's default.")
    cores = os.cpu_count() or 1
    if threads > cores:
        import sys

        print(f"note: --threads {threads} is more than the {cores} cores here; using {cores}.", file=sys.stderr)
        return cores
    return threads


def manifest_groups(manifest: dict):
    """The manifest's layer groups (toolkit.block_pool.LayerGroup), or None for one global group."""
    from toolkit.block_pool import LayerGroup
    from toolkit.kv_spec import check_stored_group_spec

    groups = manifest.get("groups")
    if not groups:
        return None
    try:
        out = [LayerGroup.from_dict(g) for g in groups]
        pool = layout_from_manifest(manifest)
        for i, g in enumerate(out):
            if g.spec is not None:
                check_stored_group_spec(pool.spec, g.spec, pool.head_dim, i, g.window, "the manifest")
        return out
    except (KeyError, TypeError, ValueError) as e:  # SpecError is a ValueError
        raise PagedKVError(f"the manifest's groups entry is malformed ({e}): re-run `pagedkv export`.") from None


def make_backend(art_dir: Path, manifest: dict, backend: str, native: bool | None = None, threads: int = 0,
                 pool_mb: float | None = None, pool_fraction: float | None = None):
    threads = check_threads(threads)
    exported = layout_from_manifest(manifest)
    if backend == "executorch" and (pool_mb is not None or pool_fraction is not None):
        raise PagedKVError(
            "the executorch backend's pool size is fixed when the model is exported (--pool-tokens / --pool-mb of "
            "`pagedkv export`); --pool-mb / --pool-fraction at run time need the onnxruntime or torch backend."
        )
    groups = manifest_groups(manifest)
    layout = sized_layout(exported, pool_mb, pool_fraction, groups)
    groups = sized_groups(groups, exported, layout)
    if backend == "onnxruntime":
        from runtime_sim.backends import OrtBackend

        path = verify_artifact(art_dir, manifest, "onnx")
        entry = manifest["artifacts"]["onnx"]
        return OrtBackend(path, layout, entry["inputs"], entry["outputs"], native=native, threads=threads,
                          manifest_layout=exported, groups=groups)
    if backend == "executorch":
        from runtime_sim.backends import ExecuTorchBackend

        path = verify_artifact(art_dir, manifest, "pte")
        return ExecuTorchBackend(path, layout, manifest["artifacts"]["pte"], threads=threads, groups=groups)
    if backend == "torch":
        from runtime_sim.backends import TorchBackend
        from toolkit.calibration import read_key_offsets
        from toolkit.compiler import compile
        from toolkit.model_loading import load_model

        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        model, _ = load_model(manifest["model"]["name"])
        sliding = [g.num_blocks for g in groups or [] if g.window]
        own = [g.spec for g in groups or [] if g.spec is not None]
        paged = compile(model, layout.spec, block_size=layout.block_size, num_blocks=layout.num_blocks,
                        max_seqs=layout.max_seqs, sliding_blocks=max(sliding) if sliding else None,
                        compact_blocks=layout.num_compact_blocks, sliding_spec=own[0] if own else None,
                        compact_spec=layout.compact, key_offsets=read_key_offsets(art_dir, manifest))
        return TorchBackend(paged)
    raise PagedKVError(f"unknown backend '{backend}': use one of {', '.join(BACKENDS)}.")


def open_artifacts(art_dir, backend: str = "onnxruntime", native: bool | None = None, threads: int = 0,
                   prefill_chunk: int | None = None, pool_mb: float | None = None,
                   pool_fraction: float | None = None, policy: str = "error") -> Engine:
    """An engine on an artifacts dir. policy: one of runtime_sim.engine.POLICIES, or "auto": adaptive for an
    export with a compact region (its compact tier is the adaptive policy's first rung), else error."""
    art_dir = Path(art_dir)
    if policy not in POLICIES + ("auto",):
        raise PagedKVError(f"unknown pool policy '{policy}': use one of auto, {', '.join(POLICIES)}.")
    if backend not in BACKENDS:
        raise PagedKVError(f"unknown backend '{backend}': use one of {', '.join(BACKENDS)}.")
    manifest = read_manifest(art_dir, require=("model", "pool"))
    be = make_backend(art_dir, manifest, backend, native=native, threads=threads, pool_mb=pool_mb,
                      pool_fraction=pool_fraction)
    if policy == "auto":
        policy = "adaptive" if be.layout.num_compact_blocks else "error"
    chunk = prefill_chunk or manifest.get("artifacts", {}).get("pte", {}).get("max_tokens_per_call", 64)
    engine = Engine(be, load_tokenizer(art_dir, manifest), prefill_chunk=min(chunk, 64), policy=policy,
                    sink_blocks=max(1, be.layout.spec.sink_blocks))
    engine.manifest = manifest
    # the model's eos ids and the chat's end-of-turn ids (export writes both; the manifest checks them)
    engine.stop_ids = tuple(dict.fromkeys([*manifest["model"].get("eos_token_ids", []),
                                           *manifest.get("stop_token_ids", [])]))
    return engine
