"""`pagedkv export`: model -> artifacts dir (model.onnx / model.pte, tokenizer files, pagedkv.json).

An export never damages what was there: everything that can be checked without the model (options,
spec, sizes, the model's config.json, the output path) is checked first; the files are written into
a temporary sibling dir, which replaces the target only when the whole export succeeded (an existing
non-empty target is refused unless force=True, and is then replaced whole, never merged). On any
failure the temporary dir is removed and the target is left as it was.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from export.formats import ASYM_WEIGHTS, FORMATS, ONNX_WEIGHTS, PTE_WEIGHTS  # noqa: F401  (re-exported)
from export.stages import StageClock, format_bytes, peak_rss_bytes
from toolkit.calibration import (DEFAULT_MAX_KLD, KEY_OFFSETS_FILE, calibrate, calibration_ids, check_max_kld,
                                 failing_roles, passing_spec, write_key_offsets)
from toolkit.errors import ArtifactError, PagedKVError, SpecError
from toolkit.manifest import sha256_file, write_manifest
from toolkit.pool_layout import PoolLayout, budget_blocks, check_block_size
from toolkit.kv_spec import DEFAULT_CANDIDATES, PRESETS, KVQuantSpec, resolve_spec

MAX_TOKENS_PER_CALL = 4096  # the .pte's largest prefill chunk (a graph bound, not a pool size)
MAX_POOL_TOKENS = 1 << 24
MAX_SEQS = 4096


@dataclass
class PoolRequest:
    """How big the pool should be: tokens or MiB (exactly one), and how many sequences share it.
    compact_blocks > 0 adds a compact region of that many blocks (the compact tier, issue 25: aged blocks
    re-quantized to compact_spec_for(spec, compact_spec): COMPACT_SPEC's record fields unless compact_spec
    names others); 0, the default, is the pool without one."""

    pool_tokens: int | None = None
    pool_mb: float | None = None
    max_seqs: int = 4
    block_size: int = 16
    compact_blocks: int = 0
    compact_spec: str | None = None  # the compact region's spec (a preset or PRESET:field=value text)

    def check(self) -> "PoolRequest":
        """Range checks that need no model (before the slow load)."""
        if self.pool_tokens is not None and self.pool_mb is not None:
            raise SpecError("give either --pool-tokens or --pool-mb, not both.")
        if self.pool_mb is not None and not (isinstance(self.pool_mb, (int, float)) and math.isfinite(self.pool_mb)
                                             and 0 < self.pool_mb <= 2**20):
            raise SpecError(f"--pool-mb {self.pool_mb}: give a pool size in MiB between 0 and 1048576.")
        if self.pool_tokens is not None and not 1 <= self.pool_tokens <= MAX_POOL_TOKENS:
            raise SpecError(f"--pool-tokens {self.pool_tokens}: give 1 .. {MAX_POOL_TOKENS} tokens.")
        if not 1 <= self.max_seqs <= MAX_SEQS:
            raise SpecError(f"--max-seqs {self.max_seqs}: give 1 .. {MAX_SEQS} conversations.")
        if not (isinstance(self.compact_blocks, int) and 0 <= self.compact_blocks <= MAX_POOL_TOKENS):
            raise SpecError(f"--compact-blocks {self.compact_blocks}: give 0 (no compact region) .. {MAX_POOL_TOKENS} "
                            "blocks.")
        check_block_size(self.block_size)
        return self

    def region_spec(self, spec: KVQuantSpec, head_dim: int) -> KVQuantSpec | None:
        """The compact region's spec (None without one)."""
        from toolkit.kv_spec import compact_spec_for

        if self.compact_spec is not None and not self.compact_blocks:
            raise SpecError("--compact-spec needs --compact-blocks N > 0 (a compact region).")
        return compact_spec_for(spec, head_dim, resolve_spec(self.compact_spec) if self.compact_spec else None) \
            if self.compact_blocks else None

    def num_blocks(self, spec: KVQuantSpec, num_layers: int, kv_heads: int, head_dim: int, groups=None) -> int:
        """The pool's block count (of the first layer group: with a model's groups, budget_groups, the
        other groups' window blocks are part of a --pool-mb budget)."""
        self.check()
        if self.pool_mb is not None:  # the most blocks whose whole pool fits (toolkit.pool_layout.budget_blocks)
            shape = PoolLayout(spec, num_layers, kv_heads, head_dim, self.block_size, 1, self.max_seqs,
                               compact=self.region_spec(spec, head_dim), num_compact_blocks=self.compact_blocks)
            return budget_blocks(shape, self.pool_mb * 2**20,
                                 f"--pool-mb {self.pool_mb} (with {self.max_seqs} sequences)", groups)
        tokens = self.pool_tokens if self.pool_tokens is not None else 2048
        if tokens < 1:
            raise SpecError(f"--pool-tokens {tokens}: the pool needs at least one token.")
        return -(-tokens // self.block_size)


def budget_groups(config, req: PoolRequest, spec: KVQuantSpec, sliding_spec: KVQuantSpec | None = None) -> list:
    """The model's layer groups as a --pool-mb budget counts them: each sliding group with the window
    blocks export gives it (compiler.sliding_pool_blocks) and its spec, the first group's count left to
    the budget."""
    from toolkit.compiler import layer_groups, model_dims, sliding_pool_blocks, with_sliding_spec

    groups = layer_groups(config, MAX_POOL_TOKENS, sliding_pool_blocks(config, req.block_size, req.max_seqs))
    if sliding_spec is None:
        return groups
    return with_sliding_spec(groups, spec, sliding_spec, model_dims(config).head_dim)


def make_layout(config, spec: KVQuantSpec, req: PoolRequest, sliding_spec: KVQuantSpec | None = None) -> PoolLayout:
    from toolkit.model_dims import model_dims

    d = model_dims(config)
    if sliding_spec is not None:  # checked before the weights load (and counted by a --pool-mb budget)
        budget_groups(config, req, spec, sliding_spec)
    nb = req.num_blocks(spec, d.num_layers, d.num_kv_heads, d.head_dim,
                        budget_groups(config, req, spec, sliding_spec) if req.pool_mb is not None else None)
    return PoolLayout(spec, d.num_layers, d.num_kv_heads, d.head_dim, req.block_size, nb, req.max_seqs,
                      compact=req.region_spec(spec, d.head_dim), num_compact_blocks=req.compact_blocks)


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


def _chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template (one Jinja string; a dict of named templates is not supported by
    the runtimes, so none is written)."""
    t = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return t if isinstance(t, str) and t else None


_PROBE = "pagedkv0reply0probe"


def _end_of_turn_ids(tokenizer) -> list[int]:
    """The special token the chat template writes right after an assistant's reply (ChatML's <|im_end|>,
    Gemma's <end_of_turn>, Llama 3's <|eot_id|>): a chat reply ends there even when it is not an eos id.
    Found by rendering a two-turn chat whose reply is a probe word and reading the token after it."""
    if _chat_template(tokenizer) is None:
        return []
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # noqa: BLE001  a template that refuses this chat (or any error in it) names no end of turn
        return []
    at = text.rfind(_PROBE) if isinstance(text, str) else -1
    if at < 0:
        return []
    after = list(tokenizer(text[at + len(_PROBE):], add_special_tokens=False)["input_ids"])
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    return after[:1] if after and after[0] in special else []


def chat_fields(tokenizer, eos_ids: list[int], vocab_size: int) -> dict:
    """pagedkv.json's chat_template and stop_token_ids (eos ids + the template's end of turn, below
    vocab_size), for runners that do not read the tokenizer files (the Android runner)."""
    if tokenizer is None:
        return {}
    out = {}
    template = _chat_template(tokenizer)
    if template is not None:
        out["chat_template"] = template
    out["stop_token_ids"] = sorted(i for i in set(eos_ids) | set(_end_of_turn_ids(tokenizer)) if 0 <= i < vocab_size)
    return out


def check_options(formats, onnx_weights: str, pte_weights: str, max_tokens_per_call: int,
                  max_logits_rows: int | None = None) -> None:
    for f in formats:
        if f not in FORMATS:
            raise PagedKVError(f"unknown format '{f}': use onnx, pte or all.")
    if onnx_weights not in ONNX_WEIGHTS:
        raise PagedKVError(f"--onnx-weights {onnx_weights}: use one of {', '.join(ONNX_WEIGHTS)}.")
    if pte_weights not in PTE_WEIGHTS:
        raise PagedKVError(f"--pte-weights {pte_weights}: use one of {', '.join(PTE_WEIGHTS)}.")
    if not 1 <= max_tokens_per_call <= MAX_TOKENS_PER_CALL:
        raise PagedKVError(f"--max-tokens-per-call {max_tokens_per_call}: give 1 .. {MAX_TOKENS_PER_CALL}.")
    if max_logits_rows is not None and not 1 <= max_logits_rows <= max_tokens_per_call:
        raise PagedKVError(f"--max-logits-rows {max_logits_rows}: give 1 .. {max_tokens_per_call} (the most tokens "
                           "of a call), or leave it out for all of them.")


def check_out_dir(out_dir: Path, force: bool) -> None:
    """The target may not exist, be an empty dir, or (with force) a dir to replace whole."""
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir() or out_dir.is_symlink():
            raise ArtifactError(f"--out {out_dir} exists and is not a directory: choose another --out.")
        if any(out_dir.iterdir()) and not force:
            raise ArtifactError(f"--out {out_dir} exists and is not empty: pass --force to replace it whole, or "
                                "choose another --out.")
    parent = out_dir.parent
    probe = parent
    while not probe.exists():  # the nearest existing ancestor must be a writable dir
        probe = probe.parent
    if not probe.is_dir():
        raise ArtifactError(f"--out {out_dir}: {probe} is a file, not a directory: choose another --out.")
    try:  # access() says yes to root even on read-only or virtual file systems: try it
        os.rmdir(tempfile.mkdtemp(prefix=".pagedkv-probe-", dir=probe))
    except OSError as e:
        raise ArtifactError(f"--out {out_dir}: cannot create a directory in {probe} ({e.strerror}): choose another "
                            "--out.") from None


def preflight_model(model_path) -> None:
    """Reject an unsupported architecture from a HF dir's config.json, before loading the weights."""
    path = Path(str(model_path)).expanduser()
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        return  # a .gguf or 'smollm2': checked when loaded
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{cfg_path} is not valid JSON ({e}): fix or re-save the model's config.") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ArtifactError(f"{cfg_path} has no model_type: it is not a HF model config.")
    from transformers import AutoConfig

    from toolkit.compiler import preflight
    from toolkit.model_loading import _check_hf_dir, check_tokenizer_files

    _check_hf_dir(path)
    check_tokenizer_files(path)

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"cannot read {cfg_path}: {e}") from None
    preflight(config)
    return config


def _new_temp_dir(out_dir: Path) -> Path:
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=parent))
    except OSError as e:
        raise ArtifactError(f"--out {out_dir}: cannot create a directory in {parent} ({e.strerror}): choose "
                            "another --out.") from None
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    return tmp


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished export over the target: a rename, with the old target removed after."""
    old = None
    if out_dir.exists():
        if any(out_dir.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "dir")
        else:
            out_dir.rmdir()
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_artifacts(
    model_path: str,
    out_dir: Path,
    formats: tuple[str, ...] = ("onnx",),
    spec: str | dict | KVQuantSpec | None = None,
    pool: PoolRequest | None = None,
    onnx_weights: str = "fp32",
    pte_weights: str = "fp32",
    max_tokens_per_call: int = 64,
    max_logits_rows: int | None = None,
    console: Console | None = None,
    model_and_tokenizer=None,
    force: bool = False,
    sliding_spec: str | dict | KVQuantSpec | None = None,
    calib_text: str | Path | None = None,
    max_kld: float = DEFAULT_MAX_KLD,
    accept_fidelity: bool = False,
) -> dict:
    """Export `model_path` to `out_dir` atomically; returns the manifest. `model_and_tokenizer` skips loading.
    An existing non-empty `out_dir` is refused unless `force` (then replaced whole). spec None: one of
    kv_spec.DEFAULT_CANDIDATES, chosen by calibration KLD. max_logits_rows bounds the logits rows one .pte call
    computes (export_pte); None: all of the call's tokens. sliding_spec: the sliding layers' own KV spec
    (compile(sliding_spec=); the manifest is then format 2); None: every layer stores `spec`.

    Calibration (toolkit/calibration.py): a quantized pool's key offsets are measured on `calib_text`
    (default toolkit/data/calibration.txt) and every spec of the pool (default region, compact region,
    sliding layers) is scored against the unquantized pool there; a spec whose KLD exceeds `max_kld` is
    refused (SpecError naming a spec that passes) unless `accept_fidelity`. The manifest records both."""
    console = console or Console(stderr=True)
    max_kld = check_max_kld(max_kld)
    formats = tuple(dict.fromkeys(formats))
    check_options(formats, onnx_weights, pte_weights, max_tokens_per_call, max_logits_rows)
    if spec is not None:
        spec = resolve_spec(spec).validate()
    if sliding_spec is not None:
        sliding_spec = resolve_spec(sliding_spec).validate()
    pool = (pool or PoolRequest()).check()
    out_dir = Path(out_dir).expanduser().absolute()
    check_out_dir(out_dir, force)
    src = Path(str(model_path)).expanduser()
    if model_and_tokenizer is None and src.exists():
        src, dst = src.resolve(), out_dir.resolve()
        if src == dst or dst in src.parents:  # --force would delete the model being exported
            raise ArtifactError(f"--out {out_dir} holds the model {model_path}: write the artifacts somewhere else.")
    if model_and_tokenizer is None:
        config = preflight_model(model_path)
        if config is not None:  # spec and pool against the model's dims, before the weights load
            make_layout(config, spec or PRESETS[DEFAULT_CANDIDATES[0]], pool, sliding_spec)

    tmp = None
    say = lambda msg: console.print(f"[dim]  {msg}[/]")  # noqa: E731
    clock = StageClock(say)
    try:
        from toolkit.model_loading import load_model

        model, tokenizer = model_and_tokenizer or load_model(model_path)
        if model_and_tokenizer is None:
            clock.done("loading the model")
        candidates = [spec] if spec is not None else [PRESETS[n] for n in DEFAULT_CANDIDATES]
        layout = make_layout(model.config, candidates[0], pool, sliding_spec)
        cal = _calibrate(model, tokenizer, candidates, layout, sliding_spec, calib_text, max_kld, accept_fidelity,
                         console)
        if cal is not None:
            clock.done("calibration")
        spec = cal.spec if cal is not None else candidates[0]
        layout = make_layout(model.config, spec, pool, sliding_spec)
        tmp = _new_temp_dir(out_dir)
        manifest = _write_all(model, tokenizer, model_path, tmp, formats, spec, layout, onnx_weights, pte_weights,
                              max_tokens_per_call, console, max_logits_rows, sliding_spec, cal, calib_text, clock)
        _replace_dir(tmp, out_dir)
        tmp = None
    except OSError as e:  # a full disk or a vanished dir: one line, nothing left behind
        raise ArtifactError(f"export to {out_dir} failed: {e}; nothing was changed there.") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    for fmt, entry in manifest["artifacts"].items():
        console.print(f"  wrote {out_dir / entry['file']} ({entry['bytes'] / 2**20:.1f} MiB, {entry['export_seconds']}s)")
    console.print(f"  export took {time.perf_counter() - clock.began:.0f} s; peak RSS {format_bytes(peak_rss_bytes())}")
    return manifest


def _calibrate(model, tokenizer, candidates, layout, sliding_spec, calib_text, max_kld: float, accept: bool,
               console):
    """Key offsets and the fidelity of each of the pool's specs on the calibration text; with several
    candidate pool specs (no --spec: kv_spec.DEFAULT_CANDIDATES, equal bytes) the first is the pool's while
    its KLD is at most kv_spec.DEFAULT_PREFERRED_KLD, else the one of lower KLD (Calibration.spec). SpecError
    (one line: the spec, its KLD, the bound and a spec that passes) when a spec exceeds max_kld and not
    accept. None for a float pool (nothing quantized, nothing to guard)."""
    from toolkit.fidelity import spec_name
    from toolkit.model_dims import model_dims

    spec = candidates[0]
    if spec.is_float:
        return None
    roles = {"pool": candidates} if len(candidates) > 1 else {"pool": spec}
    if layout.compact is not None:
        roles["compact"] = layout.compact
    if sliding_spec is not None:
        roles["sliding"] = sliding_spec
    ids, name = calibration_ids(tokenizer, calib_text, vocab_size=model_dims(model.config).vocab_size)
    t0 = time.time()
    with console.status(f"calibrating on {len(ids)} tokens of {name} (key offsets, the fidelity of "
                        f"{', '.join(roles)})..."):
        cal = calibrate(model, ids, roles, name)
    if len(candidates) > 1:
        klds = ", ".join(f"{n} {k:.5f}" for n, k in cal.candidates.items())
        console.print(f"[dim]  KV spec: {spec_name(cal.spec)} by calibration KLD ({klds}; equal bytes; "
                      "--spec overrides)[/]")
    for role, f in cal.fidelity.items():
        console.print(f"[dim]  calibration: {role} {f['spec']}: KLD {f['kld']:.5f}, top-1 {100 * f['top1']:.1f}% "
                      f"vs the unquantized pool ({time.time() - t0:.1f} s)[/]")
    bad = failing_roles(cal, max_kld)
    cal.max_kld, cal.accepted = max_kld, bool(bad)
    if not bad or accept:
        return cal
    role, f = bad[0], cal.fidelity[bad[0]]
    flag = {"pool": "--spec", "compact": "--compact-spec", "sliding": "--sliding-spec"}[role]
    if role == "pool":
        alt = passing_spec(model, ids, cal.offsets, max_kld, skip=tuple(candidates))
        fix = (f"{flag} {alt[0]} measures {alt[1]:.4f}" if alt else "no preset passes on this model either") + \
            ", or raise --max-kld"
    else:
        fix = f"give {flag} more bits, or raise --max-kld"
    raise SpecError(f"the {role} spec {f['spec']} loses too much on this model: KLD {f['kld']:.4g} vs the unquantized "
                    f"pool on {cal.tokens} calibration tokens, over the bound {max_kld:g}; {fix}, or pass "
                    "--accept-fidelity to export it anyway.")


def _write_all(model, tokenizer, model_path, out: Path, formats, spec, layout, onnx_weights, pte_weights,
               max_tokens_per_call, console, max_logits_rows=None, sliding_spec=None, cal=None,
               calib_text=None, clock: StageClock | None = None) -> dict:
    """Write every file of the export into `out` (a fresh dir); the manifest last. cal: the Calibration
    (_calibrate), or None for a float pool. calib_text: the text on which a .pte's linears are sampled
    to choose int4 or int8 for each (export/linear_inputs.py). clock: the export's stages so far (loading, calibration),
    recorded in the manifest with those of this function (export_stages; each artifact has its own)."""
    from toolkit.compiler import compile, groups_manifest, model_dims, sliding_pool_blocks
    from toolkit.manifest import check_file_name, weights_sha256

    dims = model_dims(model.config)
    clock = clock or StageClock()
    weights = weights_sha256(model)  # before any format quantizes them (8da4w does, in place)
    say = lambda msg: console.print(f"[dim]  {msg}[/]")  # noqa: E731
    tok_files = []
    if tokenizer is not None:
        tok_files = sorted({Path(p).name for p in tokenizer.save_pretrained(out) if Path(p).is_file()})
    for name in tok_files:
        check_file_name(name, "tokenizer file")
    offsets = cal.offsets if cal else None
    offsets_sha = None
    if offsets is not None:
        write_key_offsets(out / KEY_OFFSETS_FILE, offsets)
        offsets_sha = sha256_file(out / KEY_OFFSETS_FILE)
    linear_inputs = None
    if "pte" in formats and pte_weights == ASYM_WEIGHTS:
        from export.linear_inputs import sample_linear_inputs
        from toolkit.calibration import calibration_ids

        ids, name = calibration_ids(tokenizer, calib_text, vocab_size=dims.vocab_size)
        linear_inputs = sample_linear_inputs(model, ids)
        clock.done(f"the linears' inputs on {len(ids)} tokens of {name}")
    artifacts = {}
    for fmt in formats:  # onnx before pte: 8da4w quantizes the weights in place
        t0 = time.time()
        paged = compile(model, spec, block_size=layout.block_size, num_blocks=layout.num_blocks,
                        max_seqs=layout.max_seqs, compact_blocks=layout.num_compact_blocks,
                        sliding_blocks=sliding_pool_blocks(model.config, layout.block_size, layout.max_seqs),
                        sliding_spec=sliding_spec, compact_spec=layout.compact, key_offsets=offsets)
        what = spec.describe() + (f"; sliding layers {sliding_spec.describe()}" if sliding_spec else "")
        with console.status(f"exporting {fmt} ({dims.num_layers} layers, {what})..."):
            if fmt == "onnx":
                from export.onnx_export import export_onnx

                entry = export_onnx(paged, out / "model.onnx", progress=say)
                if onnx_weights in ("int4", "int4-e4"):
                    from export.onnx_export import quantize_weights_int4

                    say("quantizing MatMul weights to int4 (MatMulNBits)" +
                        (" and the embedding (GatherBlockQuantized)" if onnx_weights == "int4-e4" else ""))
                    int4 = StageClock(say)
                    entry.update(quantize_weights_int4(out / "model.onnx", embedding=onnx_weights == "int4-e4"))
                    int4.done(f"quantizing weights to {onnx_weights}", f"{entry['int4_exact_blocks']} of "
                              f"{entry['int4_blocks']} MatMul weight blocks on a 4-bit grid, stored exactly")
                    entry["stages"] = entry["stages"] + int4.rows
                entry["weights"] = onnx_weights
            else:
                from export.executorch_export import export_pte

                entry = export_pte(paged, out / "model.pte", weights=pte_weights,
                                   max_tokens=max_tokens_per_call, max_logits_rows=max_logits_rows,
                                   progress=say, linear_inputs=linear_inputs)
        entry["sha256"] = sha256_file(out / entry["file"])
        entry["export_seconds"] = round(time.time() - t0, 1)
        entry["bytes"] = (out / entry["file"]).stat().st_size
        artifacts[fmt] = entry
    manifest = {
        "model": {
            "name": str(model_path),
            "model_type": model.config.model_type,
            "num_layers": dims.num_layers,
            "num_heads": dims.num_heads,
            "num_kv_heads": dims.num_kv_heads,
            "head_dim": dims.head_dim,
            "vocab_size": dims.vocab_size,
            "eos_token_ids": _eos_ids(model, tokenizer),
            "weights_sha256": weights,
        },
        "pool": layout.to_dict(),
        **({"groups": groups_manifest(paged.groups)} if groups_manifest(paged.groups) else {}),
        "artifacts": artifacts,
        "tokenizer_files": tok_files,
        "export_stages": clock.rows,
        **chat_fields(tokenizer, _eos_ids(model, tokenizer), dims.vocab_size),
        **({"calibration": cal.to_manifest(offsets_sha)} if cal else {}),
    }
    write_manifest(out, manifest)
    from toolkit.manifest import read_manifest

    return read_manifest(out, require=("model", "pool"))
