"""Memory planning: how many tokens of KV cache fit in a RAM budget, per KV spec, and which
allocations the paged pool needs compared with a contiguous fp16 cache.

    result = plan("smollm2", parse_size("4GiB"), ["fp16", "default"])
    print_plan(result)            # rich table; `pagedkv plan --json` prints `result`

Everything here is exact byte arithmetic from toolkit.quant and toolkit.pool_layout:

* paged pool: per layer three allocations (codes / scales / stage, `PoolLayout.layer_tensor_bytes`),
  so the largest single allocation is one layer's codes tensor, never the whole cache;
* contiguous fp16 cache: one [layers, 2, ctx, kv_heads, head_dim] fp16 buffer per conversation,
  preallocated for the maximum context as engines do.

MODEL is a HF model dir (only config.json is read), a .gguf file (only its metadata), "smollm2"
(built-in dims, nothing is downloaded) or a tiny family name from toolkit.tiny_models.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from toolkit.errors import ArtifactError, SpecError
from toolkit.model_dims import ModelDims, layer_windows, model_dims
from toolkit.pool_layout import MIN_POOL_BLOCKS, VALID_BLOCK_SIZES, PoolLayout, budget_terms
from toolkit.pool_layout import blocks_for_budget as layout_blocks_for_budget
from toolkit.kv_spec import (
    DEFAULT_SPECS,
    KVQuantSpec,
    bytes_per_token,
    check_group_spec,
    fp16_bytes_per_token,
    fp_stage_bytes_per_sequence,
    parse_spec,
)

DEFAULT_CTX = 8192


# ----------------------------------------------------------------------------------------------
# Sizes


_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, what: str = "--ram") -> int:
    """'4GiB' | '512MiB' | '1.5GB' | '300M' | 1024 -> bytes (int). KiB/MiB/GiB and bare K/M/G are
    powers of 1024; KB/MB/GB are powers of 1000. Raises SpecError with the accepted forms."""
    if isinstance(text, bool):
        raise SpecError(f"{what} {text!r} is not a size: use e.g. 4GiB, 512MiB or 1.5GB.")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _SIZE_RE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise SpecError(
                f"{what} {text!r} is not a size: write a number with a unit, e.g. 4GiB, 512MiB, 1.5GB "
                "(KiB/MiB/GiB = 1024-based, KB/MB/GB = 1000-based, bare number = bytes)."
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise SpecError(f"{what} {text!r} is not a positive size: use e.g. 4GiB.")
    return size


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------------------------
# Model dims


# ModelDims of models we know without reading any file.
KNOWN_DIMS: dict[str, ModelDims] = {
    # SmolLM2-135M(-Instruct): llama, hidden 576 = 9 heads x 64, GQA with 3 KV heads.
    "smollm2": ModelDims(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152),
    # Gemma 3 270M: 18 layers, 4 heads, 1 KV head of 256; every 6th layer global, the others slide over 512.
    "gemma3-270m": ModelDims(num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256, vocab_size=262144),
}
# Per layer, the sliding window (0 = global attention) of the known models with sliding layers.
KNOWN_WINDOWS: dict[str, list[int]] = {"gemma3-270m": ([512] * 5 + [0]) * 3}
# Tokens one call writes at most (the engine's prefill chunk, the .pte's default max_tokens_per_call):
# a sliding layer group holds window + this many tokens of blocks per sequence at its peak.
PLAN_CHUNK = 64


def load_windows(model: str | Path | None = None) -> list[int]:
    """Per layer, the sliding window (0 = global) of a known name, tiny family, HF dir or .gguf."""
    name = "smollm2" if model is None else str(model)
    if name in KNOWN_DIMS:
        return KNOWN_WINDOWS.get(name, [0] * KNOWN_DIMS[name].num_layers)
    from toolkit.tiny_models import TINY_CONFIGS

    if name in TINY_CONFIGS:
        from toolkit.tiny_models import tiny_config

        return layer_windows(tiny_config(name))
    from transformers import AutoConfig

    path = Path(name).expanduser()
    if path.is_file():
        return layer_windows(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
    return layer_windows(AutoConfig.from_pretrained(path))


def grouped_fit(spec: KVQuantSpec, dims: ModelDims, windows: list[int], ram_bytes: int, block_size: int,
                max_seqs: int, chunk: int = PLAN_CHUNK, sliding_spec: KVQuantSpec | None = None) -> dict | None:
    """Tokens that fit when layers are grouped by attention type (toolkit.block_pool.GroupedBlockPool):
    each sliding layer's pool holds only max_seqs x window_blocks_needed(window, block_size, chunk)
    blocks, in sliding_spec if given (export --sliding-spec; None: `spec`); the global layers share the
    rest of the budget (toolkit.pool_layout.blocks_for_budget with those groups, as export sizes them).
    None for a model without sliding layers."""
    from toolkit.block_pool import LayerGroup, window_blocks_needed

    if not any(windows):
        return None
    sliding_blocks = {w: max_seqs * window_blocks_needed(w, block_size, chunk) for w in set(windows) if w}
    own = sliding_spec if sliding_spec is not None and sliding_spec != spec else None
    groups = [LayerGroup(0, tuple(i for i, w in enumerate(windows) if not w), 0)] + [
        LayerGroup(w, tuple(i for i, x in enumerate(windows) if x == w), sliding_blocks[w], own)
        for w in sorted(sliding_blocks)]
    layout = pool_layout(spec, dims, 1, block_size, max_seqs)
    fixed = budget_terms(layout, groups)[1]  # the sliding groups' blocks and the fixed bytes
    n_global = windows.count(0)
    if ram_bytes < fixed:
        tokens = 0
    elif n_global == 0:
        tokens = None  # only sliding layers: every conversation runs on for ever in a fixed pool
    else:
        tokens = layout_blocks_for_budget(layout, ram_bytes, groups) * block_size
    return {"global_layers": n_global, "sliding_layers": len(windows) - n_global,
            "sliding_blocks_per_layer": {str(w): n for w, n in sliding_blocks.items()},
            "sliding_pool_bytes": fixed - layout.fixed_bytes, "tokens_fit": tokens,
            "sliding_spec": (own or spec).describe()}


def sliding_spec_for(spec: KVQuantSpec, sliding: KVQuantSpec | None, head_dim: int) -> KVQuantSpec | None:
    """`sliding` if a pool in `spec` can store its sliding layers in it (toolkit.kv_spec.check_group_spec),
    else None (e.g. a float pool: one spec for every layer)."""
    if sliding is None:
        return None
    try:
        return check_group_spec(spec, sliding, head_dim)
    except SpecError:
        return None


def load_dims(model: str | Path | None = None) -> ModelDims:
    """Model dims from a known name, a tiny family name, a HF dir (config.json) or a .gguf (metadata)."""
    name = "smollm2" if model is None else str(model)
    if name in KNOWN_DIMS:
        return KNOWN_DIMS[name]
    from toolkit.tiny_models import TINY_CONFIGS

    if name in TINY_CONFIGS:
        from toolkit.tiny_models import tiny_config

        return model_dims(tiny_config(name))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ArtifactError(f"{path} has no config.json: pass a HF model dir, a .gguf file, 'smollm2' "
                                f"or a tiny family ({', '.join(TINY_CONFIGS)}).")
        from transformers import AutoConfig

        try:
            return model_dims(AutoConfig.from_pretrained(path))
        except (OSError, ValueError, KeyError) as e:
            raise ArtifactError(f"cannot read the config in {path}: {e}") from e
    if path.is_file() and path.suffix.lower() == ".gguf":
        from transformers import AutoConfig

        try:
            return model_dims(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
        except Exception as e:  # gguf/transformers raise many types on a bad file
            raise ArtifactError(f"cannot read the GGUF metadata of {path}: {type(e).__name__}: {e}") from e
    raise ArtifactError(
        f"model {name!r} not found: pass a HF model dir (config.json), a .gguf file, 'smollm2', "
        f"or a tiny family ({', '.join(TINY_CONFIGS)})."
    )


def as_dims(config_or_dims) -> ModelDims:
    """ModelDims from a ModelDims-like object, a HF config, or a model name/path (see load_dims)."""
    if config_or_dims is None or isinstance(config_or_dims, (str, Path)):
        return load_dims(config_or_dims)
    if isinstance(config_or_dims, ModelDims):
        return config_or_dims
    if all(hasattr(config_or_dims, f) for f in ("num_layers", "num_kv_heads", "head_dim")):
        g = lambda f, d=0: int(getattr(config_or_dims, f, d) or d)  # noqa: E731
        return ModelDims(g("num_layers"), g("num_heads", g("num_kv_heads")), g("num_kv_heads"), g("head_dim"),
                    g("vocab_size"))
    return model_dims(config_or_dims)


# ----------------------------------------------------------------------------------------------
# Pool sizing


def pool_fixed_bytes(spec: KVQuantSpec, dims: ModelDims, block_size: int, max_seqs: int) -> int:
    """PoolLayout.fixed_bytes of this model's pool: the bytes that do not depend on its block count."""
    return pool_layout(spec, dims, 1, block_size, max_seqs).fixed_bytes


def blocks_for_budget(spec: KVQuantSpec, dims: ModelDims, budget_bytes: int, block_size: int = 16,
                      max_seqs: int = 4) -> int:
    """The most blocks whose whole pool fits in budget_bytes; 0 if none (toolkit.pool_layout.blocks_for_budget,
    the one formula, which export, run/chat and the Android runner use too)."""
    return layout_blocks_for_budget(pool_layout(spec, dims, 1, block_size, max_seqs), budget_bytes)


def pool_layout(spec: KVQuantSpec, dims: ModelDims, num_blocks: int, block_size: int = 16, max_seqs: int = 4) -> PoolLayout:
    return PoolLayout(spec, dims.num_layers, dims.num_kv_heads, dims.head_dim, block_size, num_blocks, max_seqs)


def contiguous_buffer_shape(dims: ModelDims, ctx: int) -> tuple[int, ...]:
    return (dims.num_layers, 2, ctx, dims.num_kv_heads, dims.head_dim)


def contiguous_buffer_bytes(dims: ModelDims, ctx: int) -> int:
    """One fp16 [layers, 2, ctx, kv_heads, head_dim] buffer: what an engine preallocates per conversation."""
    return ctx * fp16_bytes_per_token(dims.num_kv_heads, dims.head_dim, dims.num_layers)


# ----------------------------------------------------------------------------------------------
# The plan


def plan(config_or_dims=None, ram_bytes: int = 4 * 2**30, specs=None, block_size: int = 16,
         max_seqs: int = 4, ctx: int = DEFAULT_CTX, model_name: str | None = None,
         windows: list[int] | None = None, sliding_spec: str | KVQuantSpec | None = None) -> dict:
    """Per KV spec: exact bytes/token, fixed per-sequence fp16 stage bytes, tokens that fit in
    ram_bytes, the pool's per-layer allocations and its largest single allocation; next to a
    contiguous fp16 cache (one [layers,2,ctx,kv_heads,head_dim] buffer per conversation).

    sliding_spec: the sliding layers' own spec (export --sliding-spec) in the grouped estimate of each
    spec that allows it (sliding_spec_for); a model without sliding layers refuses it."""
    if isinstance(ram_bytes, str):
        ram_bytes = parse_size(ram_bytes)
    if not isinstance(ram_bytes, int) or ram_bytes <= 0:
        raise SpecError(f"RAM budget {ram_bytes!r} is invalid: pass a positive byte count (e.g. 4GiB).")
    if block_size not in VALID_BLOCK_SIZES:
        raise SpecError(f"block size {block_size} is invalid: use 16 or 32 tokens per block.")
    if max_seqs < 1:
        raise SpecError(f"max_seqs={max_seqs}: allow at least one sequence.")
    if ctx < 1:
        raise SpecError(f"--ctx {ctx}: the maximum context must be at least 1 token.")
    dims = as_dims(config_or_dims)
    if model_name is None:
        model_name = str(config_or_dims) if isinstance(config_or_dims, (str, Path)) else \
            ("smollm2" if config_or_dims is None else type(config_or_dims).__name__)
    L, H, D = dims.num_layers, dims.num_kv_heads, dims.head_dim
    if windows is None and (config_or_dims is None or isinstance(config_or_dims, (str, Path))):
        windows = load_windows(config_or_dims)
    sliding = parse_spec(sliding_spec)[1].validate(D) if isinstance(sliding_spec, str) else sliding_spec
    if sliding is not None and not any(windows or []):
        raise SpecError("--sliding-spec needs a model with sliding-window layers; this one has only global ones "
                        "(drop --sliding-spec).")
    fp16_bpt = fp16_bytes_per_token(H, D, L)
    contig_alloc = contiguous_buffer_bytes(dims, ctx)
    contiguous = {
        "name": "contiguous-fp16",
        "bytes_per_token": fp16_bpt,
        "tokens_fit": ram_bytes // fp16_bpt,
        "buffer_shape": list(contiguous_buffer_shape(dims, ctx)),
        "allocation_bytes": contig_alloc,
        "largest_allocation_bytes": contig_alloc,
        "conversations_fit": ram_bytes // contig_alloc,
    }
    rows = []
    for item in specs or DEFAULT_SPECS:
        name, spec = parse_spec(item)
        spec.validate(D)
        bpt = bytes_per_token(spec, H, D, L)
        nb = blocks_for_budget(spec, dims, ram_bytes, block_size, max_seqs)
        if nb < MIN_POOL_BLOCKS:  # export and the runtimes refuse a budget this small: it does not fit
            nb = 0
        row = {
            "name": name,
            "layout": spec.describe(),
            "bytes_per_token": bpt,
            "vs_fp16": bpt / fp16_bpt,
            "stage_bytes_per_sequence": fp_stage_bytes_per_sequence(spec, block_size, H, D, L),
            "fixed_bytes": pool_fixed_bytes(spec, dims, block_size, max_seqs),
            "num_blocks": nb,
            "tokens_fit": nb * block_size,
            "tokens_vs_contiguous": (nb * block_size) / contiguous["tokens_fit"] if contiguous["tokens_fit"] else 0.0,
            "conversations_fit": (nb * block_size) // ctx,
            "fits": nb > 0,
            "grouped": grouped_fit(spec, dims, windows or [0] * L, ram_bytes, block_size, max_seqs,
                                   sliding_spec=sliding_spec_for(spec, sliding, D)),
        }
        if nb > 0:
            layout = pool_layout(spec, dims, nb, block_size, max_seqs)
            assert layout.total_bytes <= ram_bytes
            per_layer = layout.layer_tensor_bytes()
            row.update(
                pool_bytes=layout.total_bytes,
                allocations_per_layer=per_layer,
                allocation_count=len(per_layer) * L,
                largest_allocation_bytes=layout.largest_allocation_bytes,
            )
        else:
            row.update(pool_bytes=0, allocations_per_layer={}, allocation_count=0, largest_allocation_bytes=0)
        rows.append(row)
    return {
        "model": model_name,
        "dims": asdict(dims),
        "ram_bytes": ram_bytes,
        "block_size": block_size,
        "max_seqs": max_seqs,
        "ctx": ctx,
        "contiguous_fp16": contiguous,
        "sliding_spec": sliding.describe() if sliding is not None else None,
        "specs": rows,
    }


# rich_table(wide=False) leaves these out (bytes per token and the allocation detail), for terminals
# narrower than the full table
DETAIL_COLUMNS = ("B/token", "stage/seq", "allocations", "per layer: codes / scales / stage", "largest alloc")
WIDE_TABLE_COLUMNS = 170  # terminal columns the full table needs (Gemma 3 270M's, the widest built-in)


def rich_table(result: dict, wide: bool = True):
    """The plan as a rich Table; wide=False leaves out DETAIL_COLUMNS (--json has everything)."""
    from rich.table import Table

    d = result["dims"]
    c = result["contiguous_fp16"]
    table = Table(
        title=f"{result['model']} ({d['num_layers']} layers, {d['num_kv_heads']} KV heads x {d['head_dim']}): "
        f"KV cache in {format_bytes(result['ram_bytes'])}, block {result['block_size']}, "
        f"{result['max_seqs']} sequences, ctx {result['ctx']}"
    )
    grouped = any(r.get("grouped") for r in result["specs"])
    cols = ["cache", "spec", "B/token", "vs fp16", "stage/seq", "tokens fit", "x contiguous",
            "allocations", "per layer: codes / scales / stage", "largest alloc"]
    if grouped:  # a model with sliding layers: tokens that fit with one pool per layer group
        cols.insert(6, "tokens fit (groups)" if not result.get("sliding_spec") else "tokens fit (groups; sliding spec)")
    keep = [i for i, col in enumerate(cols) if wide or col not in DETAIL_COLUMNS]
    for i in keep:
        name = cols[i]  # the name columns never shrink below their longest word
        table.add_column(name, justify="left" if name in ("cache", "spec") else "right",
                         min_width={"cache": 10, "spec": 9}.get(name))
    shape = "x".join(str(s) for s in c["buffer_shape"])
    row = ["contiguous", "fp16", str(c["bytes_per_token"]), "1.000x", "-", f"{c['tokens_fit']:,}", "1.00x",
           "1 per chat", f"[{shape}] fp16", format_bytes(c["largest_allocation_bytes"])]
    row = row[:6] + ["-"] + row[6:] if grouped else row
    table.add_row(*(row[i] for i in keep))
    for r in result["specs"]:
        per = r["allocations_per_layer"]
        row = [
            "paged", r["name"], str(r["bytes_per_token"]), f"{r['vs_fp16']:.3f}x",
            format_bytes(r["stage_bytes_per_sequence"]) if r["stage_bytes_per_sequence"] else "0",
            f"{r['tokens_fit']:,}", f"{r['tokens_vs_contiguous']:.2f}x",
            str(r["allocation_count"]) if per else "does not fit",
            " / ".join(format_bytes(per[k]) for k in ("codes", "scales", "stage")) if per else "-",
            format_bytes(r["largest_allocation_bytes"]),
        ]
        if grouped:
            g = r.get("grouped") or {}
            fit = g.get("tokens_fit", r["tokens_fit"])
            row.insert(6, "unbounded" if fit is None else f"{fit:,}")
        table.add_row(*(row[i] for i in keep))
    return table


__all__ = [
    "DEFAULT_CTX", "DEFAULT_SPECS", "DETAIL_COLUMNS", "WIDE_TABLE_COLUMNS", "KNOWN_DIMS", "KNOWN_WINDOWS", "as_dims", "grouped_fit", "sliding_spec_for", "load_windows", "blocks_for_budget", "contiguous_buffer_bytes",
    "format_bytes", "load_dims", "parse_size", "plan", "pool_fixed_bytes", "pool_layout", "rich_table",
]


# ----------------------------------------------------------------------------------------------
# Whole process: weights + pool + activations + the runtime itself

# The runtime's own resident bytes with no model to speak of: shared libraries + heap + stacks, measured
# with pagedkv-runner (android_demo/native) on the tiny test model (tests/test_runner_cli.py's
# fixture: 7.5 MiB of libraries + 4.3 MiB of heap, of which ~4 MiB are that model's packed weights),
# and with benchmarks/_e2e_worker.py's onnxruntime path before loading a model (python + numpy +
# onnxruntime + tokenizers imported).
RUNTIME_BASE_BYTES = {"runner": 8 * 2**20, "onnxruntime": 70 * 2**20}


def whole_process_estimate(art_dir, pool_bytes: int | None = None, runtime: str = "runner") -> dict:
    """Peak resident bytes of a process serving the artifacts in art_dir, by part:

    * weights: the model file's size. The runner maps the .pte (ExecuTorch Module, LoadMode::Mmap);
      XNNPACK packs the linears' weights into its heap and frees their pages of the file, the rest
      (e.g. the token embedding, gathered by a portable or quantized kernel) is read from the mapping,
      which the runner unmaps before each call (android_demo/native/src/mapped_pages.h: one call's rows
      resident, not the table). The file size still lands near the peak: XNNPACK's packed copies take
      more than the file's bytes (SmolLM2 8da4w-asym-e8h8 v2 at 8K: estimate 222 MiB, measured 223 MiB,
      benchmarks/results/device_8k.json). onnxruntime reads the .onnx into its heap.
    * pool: the KV pool the budget commits (pool_bytes, at most the exported pool's total_bytes).
    * activations: the .pte's planned activation arena (sized by max_tokens_per_call and max_logits_rows), or for
      onnxruntime the same estimate from the logits of one prefill chunk.
    * runtime: RUNTIME_BASE_BYTES (libraries, heap, stacks).
    """
    import json

    art = Path(art_dir)
    fix = "pass an artifacts dir made by `pagedkv export` (or export it again)"
    try:
        manifest = json.loads((art / "pagedkv.json").read_text())
        manifest["model"], manifest["pool"]  # noqa: B018
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{art} has no valid pagedkv.json ({e}): {fix}.") from None
    fmt = "pte" if runtime == "runner" else "onnx"
    entry = manifest.get("artifacts", {}).get(fmt)
    if entry is None:
        raise ArtifactError(f"{art} has no {fmt} artifact: export it with `pagedkv export --format {fmt}`.")
    try:  # hostile manifests: every number is checked to be a non-negative integer
        stem = Path(str(entry["file"])).stem
        total_pool = _count(manifest["pool"]["total_bytes"])
        if fmt == "pte":
            activations = _count(entry["arena_bytes"][0])
        else:
            chunk = _count(entry.get("max_tokens_per_call", PLAN_CHUNK))
            activations = 3 * chunk * _count(manifest["model"]["vocab_size"]) * 4  # logits + two temporaries
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ArtifactError(f"{art}/pagedkv.json lacks or garbles a field the memory estimate reads ({e!r}): {fix}.") \
            from None
    weights = sum(p.stat().st_size for p in art.iterdir() if p.name.startswith(stem + ".") and p.suffix != ".json")
    pool = total_pool if pool_bytes is None else min(int(pool_bytes), total_pool)
    base = RUNTIME_BASE_BYTES[runtime]
    return {"runtime": runtime, "weights_bytes": weights, "pool_bytes": pool, "activations_bytes": activations,
            "runtime_bytes": base, "total_bytes": weights + pool + activations + base,
            "weights": entry.get("weights", "fp32")}


def _count(value) -> int:
    """A manifest's byte or token count: a non-negative integer (not a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def pool_tokens_within(art_dir, ram_bytes: int, runtime: str = "runner") -> int:
    """The most pool tokens (whole blocks) an export of this model could hold with the whole process
    (whole_process_estimate) in ram_bytes: what `pagedkv export --pool-tokens` should be for a phone
    with that much memory for the app; 0 when the weights, activations and runtime alone take it."""
    from toolkit.manifest import layout_from_manifest, read_manifest

    layout = layout_from_manifest(read_manifest(Path(art_dir), require=("pool",)))  # validated pool dims
    est = whole_process_estimate(art_dir, runtime=runtime)
    room = ram_bytes - (est["total_bytes"] - est["pool_bytes"]) - layout.fixed_bytes
    return max(room // layout.bytes_per_token // layout.block_size * layout.block_size, 0)


def print_process_estimate(est: dict, console) -> None:
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    console.print(f"whole process ({est['runtime']}, weights {est['weights']}): weights {mib(est['weights_bytes'])} + "
                  f"KV pool {mib(est['pool_bytes'])} + activations {mib(est['activations_bytes'])} + runtime "
                  f"{mib(est['runtime_bytes'])} = [bold]{mib(est['total_bytes'])}[/] peak resident (estimate)")
