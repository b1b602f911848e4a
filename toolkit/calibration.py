"""Calibration at export: key offsets measured on a short text, the pool's specs scored against the
unquantized pool on the same text, and the guard that refuses a spec the model cannot hold.

    cal = calibrate(model, calibration_ids(tokenizer), {"pool": spec, "compact": compact_spec})
    cal.offsets          # per layer [num_kv_heads, head_dim] (toolkit/key_offsets.py)
    cal.fidelity         # {"pool": {"spec", "kld", "top1"}, ...}
    failing_roles(cal, max_kld)    # the roles over the bound (export refuses them, naming a spec that passes)

The text is the user's `--calib-text` or toolkit/data/calibration.txt (prose, a dialogue, numbers and
code, written for this), cut to CALIB_TOKENS tokens. The offsets are written beside the graphs as
KEY_OFFSETS_FILE (raw little-endian float32 [num_layers, num_kv_heads, head_dim]) with their sha256 in
pagedkv.json's "calibration" section, for runtimes that compile the model themselves (the torch
backend); the .pte and .onnx carry the same values as constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import ArtifactError, PagedKVError, SpecError
from toolkit.kv_spec import DEFAULT_PREFERRED_KLD, PRESETS, KVQuantSpec

CALIB_TEXT = Path(__file__).with_name("data") / "calibration.txt"
CALIB_TOKENS = 512
MIN_CALIB_TOKENS = 32
# The bound on a spec's KLD against the unquantized pool over the calibration text. From the fidelity
# tables (BENCHMARKS.md): specs that hold sit at 0.0001-0.01 (llama.cpp's q8_0/q4_0 at 0.007-0.009),
# collapsed ones at 0.05-6 (K6 without key offsets on Qwen2.5 0.046, k4v4 6.0); 0.02 leaves room for
# the noise of a few hundred tokens.
DEFAULT_MAX_KLD = 0.02
KEY_OFFSETS_FILE = "key_offsets.f32"
BLOCK = 16  # the block size calibration's pools use
# what `export` tries, in order, when it must name a spec that passes
FALLBACK_SPECS = ("default", "best", "q8_0-q4_0")


@dataclass
class Calibration:
    offsets: list | None  # per layer torch [Hkv, D] float32; None for a float pool
    tokens: int
    text: str  # where the text came from
    fidelity: dict = field(default_factory=dict)  # role -> {"spec": describe(), "kld", "top1"}
    spec: KVQuantSpec | None = None  # the pool's spec (the chosen one when there were candidates)
    candidates: dict = field(default_factory=dict)  # candidate pool spec name -> its KLD (when export chose)
    max_kld: float = DEFAULT_MAX_KLD  # the bound the export held the specs to
    accepted: bool = False  # a spec over the bound was exported anyway (--accept-fidelity)

    def to_manifest(self, offsets_sha256: str | None) -> dict:
        out = {"text": self.text, "tokens": self.tokens, "max_kld": self.max_kld, "fidelity": self.fidelity}
        if self.candidates:
            out["candidates"] = self.candidates
        if self.accepted:
            out["accepted_below_bound"] = True
        if self.offsets is not None:
            n, (h, d) = len(self.offsets), tuple(self.offsets[0].shape)
            out["key_offsets"] = {"file": KEY_OFFSETS_FILE, "sha256": offsets_sha256, "shape": [n, h, d]}
        return out


def calibration_ids(tokenizer, text_path: str | Path | None = None, tokens: int = CALIB_TOKENS,
                    vocab_size: int | None = None) -> tuple[list[int], str]:
    """(token ids, a name for the text): the first `tokens` tokens of `text_path` (default CALIB_TEXT), after
    the tokenizer's BOS when it puts one before a text.
    A model without a tokenizer (tests hand export a bare model) gets a fixed pseudo-random id sequence
    over its vocab instead."""
    path = Path(text_path).expanduser() if text_path is not None else CALIB_TEXT
    if tokenizer is None:
        if not vocab_size:
            raise PagedKVError("calibration needs the model's tokenizer (or its vocab size).")
        return [(i * 7919 + 13) % vocab_size for i in range(tokens)], "ids (no tokenizer)"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PagedKVError(f"--calib-text {path}: cannot read it as UTF-8 text ({e}): give a plain text file.") from None
    from toolkit.fidelity import tokenize, tokenizer_bos

    bos = tokenizer_bos(tokenizer)  # a model whose tokenizer starts every text with BOS (Gemma) sees one here too
    ids = ([bos] if bos is not None else []) + tokenize(tokenizer, text)
    ids = ids[:tokens]
    if len(ids) < MIN_CALIB_TOKENS:
        raise PagedKVError(f"--calib-text {path} has {len(ids)} tokens, fewer than {MIN_CALIB_TOKENS}: give a longer "
                           "text (a few hundred tokens).")
    return ids, ("calibration.txt" if text_path is None else path.name)


def one_sequence_tables(paged, nb: int):
    """The one sequence's block table for every layer group of `paged` (blocks 0 .. nb-1)."""
    import torch

    return (torch.arange(nb, dtype=torch.int64)[None, :],) * len(paged.groups)


def unquantized_pass(model, ids):
    """`model` compiled with an unquantized pool for one sequence of `ids` (the fp32 model's activations;
    the HF model is compiled in place), and a call that runs ids through it: logits [n, vocab]. Compiled
    here, run later: observers such as key_offsets.observing_keys are entered after compile()."""
    import torch

    from toolkit.compiler import compile

    ids = torch.as_tensor(ids, dtype=torch.int64)
    nb = -(-ids.numel() // BLOCK)
    ref = compile(model, "fp32", block_size=BLOCK, num_blocks=nb, max_seqs=1)
    pos = torch.arange(ids.numel())

    def run():
        with torch.no_grad():
            return ref(ids[None], pos, torch.zeros_like(pos), *one_sequence_tables(ref, nb))[0]

    return run


def _reference(model, ids):
    """(log-probs [n, vocab] of the unquantized pool over ids, the key offsets measured in the same pass)."""
    import torch

    from toolkit.key_offsets import observing_keys

    run = unquantized_pass(model, ids)
    with observing_keys(model) as keys:
        logits = run().float()
    return torch.log_softmax(logits, -1), keys.offsets()


def _versus(ref_logp, logits) -> tuple[float, float]:
    """KLD(reference || row) and top-1 agreement, averaged over the rows' positions."""
    import torch

    logp = torch.log_softmax(logits.float(), -1)
    kld = float((ref_logp.exp() * (ref_logp - logp)).sum(-1, dtype=torch.float64).mean())
    return kld, float((logp.argmax(-1) == ref_logp.argmax(-1)).double().mean())


def _score(model, ids, spec: KVQuantSpec, offsets, ref_logp, sliding_spec=None) -> tuple[float, float]:
    """KLD and top-1 agreement of `spec` vs the unquantized pool (ref_logp, _reference) over one window of ids."""
    import torch

    from toolkit.compiler import compile

    ids = torch.as_tensor(ids, dtype=torch.int64)
    nb = -(-ids.numel() // BLOCK)
    row = compile(model, spec, block_size=BLOCK, num_blocks=nb, max_seqs=1, sliding_spec=sliding_spec,
                  key_offsets=offsets)
    pos = torch.arange(ids.numel())
    with torch.no_grad():
        logits = row(ids[None], pos, torch.zeros_like(pos), *one_sequence_tables(row, nb))[0]
    return _versus(ref_logp[:-1], logits[:-1])


def _score_compact(model, ids, spec: KVQuantSpec, compact: KVQuantSpec, offsets, ref_logp) -> tuple[float, float]:
    """KLD and top-1 of a pool whose older half is in the compact tier, as the engine's adaptive policy leaves
    it: the first half of ids prefilled in `spec`, the global layers' blocks after the sink re-quantized into
    the compact region (toolkit.quant.compact_block, the table pointed there), then the second half; scored
    over the second half's predictions against the unquantized pool (ref_logp, _reference)."""
    import torch

    from toolkit.compiler import compile
    from toolkit.quant import compact_block

    n = len(ids)
    nb = -(-n // BLOCK)
    aged = (n // 2) // BLOCK  # blocks 0 .. aged-1 hold the first half
    half = aged * BLOCK
    ids = torch.as_tensor(ids, dtype=torch.int64)
    seq = lambda t: torch.zeros(t, dtype=torch.int64)  # noqa: E731
    paged = compile(model, spec, block_size=BLOCK, num_blocks=nb, max_seqs=1, compact_blocks=nb,
                    compact_spec=compact, key_offsets=offsets)
    tables = one_sequence_tables(paged, nb)
    with torch.no_grad():
        paged(ids[None, :half], torch.arange(half), seq(half), *tables, logits_rows=torch.tensor([half - 1]))
        pools, cpools = paged.pool_tensors(), paged.compact_pool_tensors()
        moved = tables[0].clone()  # the global group's table (the compact region is its own)
        for b in range(spec.sink_blocks, aged):
            for layer, (ccodes, cscales) in cpools.items():
                codes, scales, _ = pools[layer]
                compact_block(codes, scales, ccodes, cscales, b, b, spec, paged.layout.compact, paged.dims.head_dim)
            moved[0, b] = nb + b
        logits = paged(ids[None, half:], torch.arange(half, n), seq(n - half), moved, *tables[1:])[0]
    return _versus(ref_logp[half:-1], logits[:-1])


def calibrate(model, ids: list[int], roles: dict, text: str = "calibration.txt", kernel: str = "native",
              prefer_below: float = DEFAULT_PREFERRED_KLD) -> Calibration:
    """Key offsets from `ids` (for a quantized pool) and the fidelity of each role's spec. roles: name ->
    KVQuantSpec; "sliding" is the sliding layers' own spec, scored with the pool's spec in the other
    layers; "compact" the compact region's, scored with the older half of the text compacted; "pool" may
    be a list of candidate specs, of which the first becomes the pool's while its KLD is at most
    prefer_below, else the one of lower KLD (Calibration.spec; every candidate's KLD in
    Calibration.candidates). One unquantized pass gives both the offsets and the reference."""
    from toolkit.fidelity import _op_kernel, spec_name

    pool = roles["pool"]
    candidates = list(pool) if isinstance(pool, (list, tuple)) else [pool]
    ref_logp, offsets = _reference(model, ids)
    if candidates[0].is_float:
        offsets = None
    cal = Calibration(offsets, len(ids), text, spec=candidates[0])
    with _op_kernel(kernel):
        if len(candidates) > 1:
            scored = [(_score(model, ids, c, offsets, ref_logp), c) for c in candidates]
            cal.candidates = {spec_name(c): float(f"{kld:.6g}") for (kld, _), c in scored}
            first = scored[0]
            (kld, top1), cal.spec = first if first[0][0] <= prefer_below else min(scored, key=lambda x: x[0][0])
            cal.fidelity["pool"] = {"spec": cal.spec.describe(), "kld": float(f"{kld:.6g}"), "top1": round(top1, 5)}
            roles = {k: v for k, v in roles.items() if k != "pool"}
        for role, spec in roles.items():
            base, sliding = (cal.spec, spec) if role == "sliding" else (spec, None)
            if base.is_float:
                continue
            if role == "compact":
                kld, top1 = _score_compact(model, ids, cal.spec, spec, offsets, ref_logp)
            else:
                kld, top1 = _score(model, ids, base, offsets, ref_logp, sliding)
            shown = (sliding or base).describe()
            cal.fidelity[role] = {"spec": shown, "kld": float(f"{kld:.6g}"), "top1": round(top1, 5)}
    return cal


def passing_spec(model, ids, offsets, max_kld: float, kernel: str = "native", skip=()) -> tuple[str, float] | None:
    """The first of FALLBACK_SPECS (not in skip) whose KLD on ids is within max_kld: (name, kld), or None.
    Only on a refusal, so it takes its own reference pass."""
    from toolkit.fidelity import _op_kernel

    ref_logp, _ = _reference(model, ids)
    with _op_kernel(kernel):
        for name in FALLBACK_SPECS:
            spec = PRESETS[name]
            if spec in skip:
                continue
            kld, _ = _score(model, ids, spec, offsets, ref_logp)
            if kld <= max_kld:
                return name, kld
    return None


def check_max_kld(max_kld) -> float:
    if not (isinstance(max_kld, (int, float)) and math.isfinite(max_kld) and max_kld > 0):
        raise SpecError(f"--max-kld {max_kld}: give a positive KLD bound (default {DEFAULT_MAX_KLD}).")
    return float(max_kld)


def failing_roles(cal: Calibration, max_kld: float) -> list[str]:
    return [role for role, f in cal.fidelity.items() if not f["kld"] <= max_kld]


# ----------------------------------------------------------------------------------------------
# The offsets file


def write_key_offsets(path: Path, offsets) -> None:
    import torch

    torch.stack([o.float() for o in offsets]).contiguous().numpy().astype("<f4").tofile(path)


def read_key_offsets(art_dir: Path, manifest: dict) -> list | None:
    """The key offsets an export wrote (checked against pagedkv.json: file name, sha256, shape, finite), or
    None when it has none. ArtifactError (one line) otherwise."""
    import numpy as np
    import torch

    from toolkit.manifest import artifact_path, sha256_file

    entry = (manifest.get("calibration") or {}).get("key_offsets")
    if entry is None:
        return None
    path = artifact_path(Path(art_dir), entry["file"], "calibration.key_offsets.file")
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: re-run `pagedkv export`.")
    if sha256_file(path) != entry["sha256"]:
        raise ArtifactError(f"{path} is corrupted or was modified: its sha256 does not match the manifest's. "
                            "Re-run `pagedkv export`.")
    n, h, d = entry["shape"]
    data = np.fromfile(path, dtype="<f4")
    if data.size != n * h * d:
        raise ArtifactError(f"{path} holds {data.size} floats, the manifest's shape {[n, h, d]} needs {n * h * d}: "
                            "re-run `pagedkv export`.")
    if not np.isfinite(data).all():
        raise ArtifactError(f"{path} holds NaN or Inf key offsets: re-run `pagedkv export`.")
    t = torch.from_numpy(data.reshape(n, h, d).copy())
    return [t[i] for i in range(n)]
