"""Load the models pagedkv works on: a HF model dir, a GGUF file, or a registered name.

    model, tokenizer = load_model("smollm2")   # or "gemma3-270m", "qwen2.5-coder-1.5b", a HF dir, any .gguf

Named models are fetched by toolkit/model_registry.py.

A GGUF is dequantized by transformers (`from_pretrained(dir, gguf_file=name)`), which is slow
(~40 s for SmolLM2-135M), so the first load writes an fp32 safetensors copy + tokenizer into the
cache dir, keyed by the GGUF's sha256; later loads read that copy.

Cache dir: ~/.cache/pagedkv, or $PAGEDKV_CACHE.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from toolkit.errors import ArtifactError
from toolkit.manifest import sha256_file
from toolkit.model_registry import MODEL_NAMES, MODELS, cache_dir, model_file  # noqa: F401  (re-exported)

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin")

_console = Console(stderr=True)


def named_model_path(name: str) -> Path | None:
    """The GGUF behind a registered model name (toolkit.model_registry), fetched once; None for other names."""
    return model_file(name) if name in MODELS else None


# ----------------------------------------------------------------------------------------------
# Loading


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ArtifactError(
            f"{path} is not a HuggingFace model dir: no config.json in it. Pass a dir with config.json + "
            "*.safetensors, a .gguf file, or a model name (pagedkv models)."
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


def load_model(path: str | Path = "smollm2"):
    """-> (float32 eval model, tokenizer) from a HF dir, a .gguf file or a registered model name."""
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
        f"{path} is a file but not a .gguf: pass a HF model dir (config.json + *.safetensors), a .gguf, or a model name (pagedkv models)."
    )
