"""`pagedkv.json`: what an artifacts directory holds and how its pool is laid out.

{
  "format_version": 1,
  "model": {"name", "model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
            "eos_token_ids", "weights": "fp32" | "8da4w" | "int4"},
  "pool": PoolLayout.to_dict() (spec, shapes, dtypes, bytes_per_token, largest_allocation_bytes, ...),
  "artifacts": {"onnx": {"file", "sha256", "inputs", "outputs"}, "pte": {...}},
  "tokenizer_files": [...],
  "versions": {"pagedkv", "torch", "executorch", "onnx", "onnxruntime", "transformers"}
}
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from toolkit.errors import ArtifactError
from toolkit.model_loading import sha256_file  # noqa: F401  (re-exported for the exporters)
from toolkit.pool_layout import PoolLayout

MANIFEST_NAME = "pagedkv.json"
FORMAT_VERSION = 1
# Packages whose version must match between export and run (the kernels are ABI-tied to executorch).
PINNED_PACKAGES = ("pagedkv", "torch", "executorch", "onnxruntime")
RECORDED_PACKAGES = PINNED_PACKAGES + ("onnx", "transformers")


def package_versions() -> dict[str, str]:
    out = {}
    for name in RECORDED_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


def read_manifest(art_dir: Path) -> dict:
    path = Path(art_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{path} not found: is {art_dir} an artifacts directory made by `pagedkv export`?")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}): re-run `pagedkv export`.") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format_version {manifest.get('format_version')}, this pagedkv reads {FORMAT_VERSION}: "
            "re-export with this version."
        )
    return manifest


def write_manifest(art_dir: Path, manifest: dict) -> Path:
    manifest = dict(manifest, format_version=FORMAT_VERSION, versions=package_versions())
    path = Path(art_dir) / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def update_manifest(art_dir: Path, **sections) -> dict:
    """Merge sections (e.g. artifacts={"onnx": {...}}) into the directory's manifest, creating it."""
    path = Path(art_dir) / MANIFEST_NAME
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(manifest.get(key), dict):
            manifest[key] = {**manifest[key], **value}
        else:
            manifest[key] = value
    write_manifest(art_dir, manifest)
    return read_manifest(art_dir)


def verify_artifact(art_dir: Path, manifest: dict, kind: str) -> Path:
    """Check that the artifact exists, its sha256 matches, and the versions it was made with match."""
    entry = manifest.get("artifacts", {}).get(kind)
    if entry is None:
        have = ", ".join(manifest.get("artifacts", {})) or "none"
        raise ArtifactError(
            f"{art_dir} has no {kind} artifact (it has: {have}): export it with `pagedkv export --format {kind}`."
        )
    path = Path(art_dir) / entry["file"]
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: re-run `pagedkv export`.")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise ArtifactError(
            f"{path} is corrupted or was modified: sha256 {digest[:12]}... does not match the manifest's "
            f"{entry['sha256'][:12]}.... Re-run `pagedkv export`."
        )
    have = package_versions()
    for name in PINNED_PACKAGES:
        want = manifest.get("versions", {}).get(name)
        if want is not None and want != have.get(name):
            raise ArtifactError(
                f"{art_dir} was exported with {name} {want} but {have.get(name)} is installed: re-export with "
                f"this installation, or install {name}=={want}."
            )
    return path


def layout_from_manifest(manifest: dict) -> PoolLayout:
    try:
        return PoolLayout.from_dict(manifest["pool"])
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"the manifest's pool section is incomplete ({e}): re-run `pagedkv export`.") from None
