"""`pagedkv.json`: what an artifacts directory holds and how its pool is laid out — the contract
between export, the runtimes, deploy and the Android runner.

{
  "format_version": 1 (2 when a layer group has its own spec, see "groups"),
  "model": {"name", "model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
            "eos_token_ids", "weights_sha256" (optional: weights_sha256() of the weights exported)},
  "pool": PoolLayout.to_dict() (spec, shapes, dtypes, bytes_per_token, largest_allocation_bytes, ...; with a
           compact region also compact, num_compact_blocks, compact_codes_shape, compact_scales_shape: the
           runtime allocates that region, and the graphs take it as inputs compact_codes_i/compact_scales_i),
  "groups": the layer groups of a model with sliding-window layers (optional; LayerGroup.to_dict(): window,
            layers, num_blocks, and spec when the group stores its own, POOL_FORMAT.md),
  "artifacts": {"onnx": {"file", "sha256", "inputs", "outputs", ...}, "pte": {...}},
  "tokenizer_files": [...],
  "chat_template": the tokenizer's Jinja chat template (optional; the Android runner renders it),
  "stop_token_ids": ids that end a chat reply: eos ids + the template's end-of-turn token (optional),
  "calibration": {"text", "tokens", "max_kld", "fidelity": {role: {"spec", "kld", "top1"}}, "key_offsets":
                  {"file", "sha256", "shape"}} (optional; toolkit/calibration.py: what export measured, and the
                  key offsets the graphs subtract, for runtimes that compile the model themselves),
  "versions": {"pagedkv", "torch", "executorch", "onnx", "onnxruntime", "transformers"}
}

Rules checked on write and on read (a manifest is input like any other):
- every file it names is a plain file name inside the artifacts dir (no separators, no '..', not
  absolute, no leading '-', no control characters; a symlink may not lead out of the dir);
- `pagedkv.json.sha256` beside it holds the sha256 of the manifest's bytes, so an edit is caught;
- each section has the keys and types below; the pool's stored shapes agree with its spec.
The runtimes also compare the loaded graph with the manifest (`check_graph_pool`): the ONNX graph
carries its pool identity (spec, block size, heads, ...) in its metadata, and its pool inputs'
shapes and dtypes must be the ones the manifest's layout gives.

No torch here: the onnxruntime runtime, deploy and the planner read manifests without it.
"""

from __future__ import annotations

import hashlib
import json
import string
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from toolkit.errors import ArtifactError, PagedKVError
from toolkit.kv_spec import spec_from_dict
from toolkit.pool_layout import PoolLayout

MANIFEST_NAME = "pagedkv.json"
DIGEST_NAME = MANIFEST_NAME + ".sha256"
FORMAT_VERSION = 1
# a manifest whose layer groups carry their own KV spec (export --sliding-spec): a reader of version 1
# only would size those layers' pools wrong, so it refuses it
GROUP_SPEC_FORMAT_VERSION = 2
ARTIFACT_KINDS = ("onnx", "pte")
# Packages whose version must match between export and run (the kernels are ABI-tied to executorch).
PINNED_PACKAGES = ("pagedkv", "torch", "executorch", "onnxruntime")
RECORDED_PACKAGES = PINNED_PACKAGES + ("onnx", "transformers")
# The ONNX metadata key holding the graph's pool identity (pool_identity()).
ONNX_POOL_KEY = "pagedkv_pool"
# The ONNX graph's last input when it computes logits only for the rows named there (indices into the
# call's tokens); graphs exported before it compute every row.
LOGITS_ROWS = "logits_rows"
# The .pte's constant method returning the same JSON as uint8 codes.
PTE_POOL_METHOD = "pagedkv_pool"


def compact_input_names(compact_layers) -> list[str]:
    """The graph inputs of a compact region (between the pools / tables and logits_rows): compact_codes_i,
    compact_scales_i of each layer i that has one (the global layer group's)."""
    return [f"compact_{kind}_{i}" for i in compact_layers for kind in ("codes", "scales")]


def compact_input_layers(names) -> list[int]:
    """The layers whose compact region a graph with these input names reads (compact_input_names' inverse)."""
    return [int(n[len("compact_codes_"):]) for n in names if n.startswith("compact_codes_")]

_MODEL_INTS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
MAX_CHAT_TEMPLATE_BYTES = 1 << 20  # real templates are < 64 KiB; the runner holds it in memory
MAX_STOP_TOKEN_IDS = 64
_POOL_INTS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "max_seqs")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def package_versions() -> dict[str, str]:
    out = {}
    for name in RECORDED_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


# ----------------------------------------------------------------------------------------------
# File names


def check_file_name(name, what: str = "file name") -> str:
    """A plain file name inside the artifacts dir, or ArtifactError. Returns it."""
    bad = None
    if not isinstance(name, str) or not name:
        bad = "is not a non-empty string"
    elif name in (".", "..") or "/" in name or "\\" in name:
        bad = "is not a plain file name (no directories, no '..')"
    elif name.startswith("-"):
        bad = "starts with '-'"
    elif any(ord(c) < 32 or c == "\x7f" for c in name):
        bad = "contains a control character"
    elif len(name) > 255:
        bad = "is longer than 255 characters"
    if bad:
        raise ArtifactError(f"the manifest's {what} {name!r} {bad}: artifacts name only files inside their own "
                            "directory; re-run `pagedkv export`.")
    return name


def artifact_path(art_dir: Path, name, what: str = "file name") -> Path:
    """art_dir / name, after checking the name and that the file does not lead out of art_dir (symlinks)."""
    path = Path(art_dir) / check_file_name(name, what)
    if path.is_symlink() and path.resolve().parent != Path(art_dir).resolve():
        raise ArtifactError(f"{path} is a link to {path.resolve()}, outside {art_dir}: artifacts are self-contained; "
                            "re-run `pagedkv export`.")
    return path


def manifest_files(manifest: dict) -> list[str]:
    """Every file name the manifest names (artifacts and tokenizer files)."""
    names = [e["file"] for e in manifest.get("artifacts", {}).values()]
    return names + list(manifest.get("tokenizer_files", []))


# ----------------------------------------------------------------------------------------------
# Validation


def _fail(where: str, msg: str):
    raise ArtifactError(f"{where}: {msg}; re-run `pagedkv export`.")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _get(d: dict, key: str, kind, where: str, section: str):
    if key not in d:
        _fail(where, f"the {section} section has no '{key}'")
    value = d[key]
    ok = {"int": _is_int(value) and value > 0, "str": isinstance(value, str),
          "dict": isinstance(value, dict), "list": isinstance(value, list)}[kind]
    if not ok:
        desc = {"int": "a positive integer", "str": "a string", "dict": "an object", "list": "a list"}[kind]
        _fail(where, f"{section}.{key} must be {desc}, not {json.dumps(value)[:40]}")
    return value


def _check_model(m: dict, where: str) -> None:
    _get(m, "name", "str", where, "model")
    _get(m, "model_type", "str", where, "model")
    for key in _MODEL_INTS:
        _get(m, key, "int", where, "model")
    eos = m.get("eos_token_ids", [])
    if not isinstance(eos, list) or not all(_is_int(x) and x >= 0 for x in eos):
        _fail(where, f"model.eos_token_ids must be a list of token ids, not {json.dumps(eos)[:40]}")
    sha = m.get("weights_sha256")
    if sha is not None and not _is_sha256(sha):
        _fail(where, "model.weights_sha256 must be 64 hex digits")


def _is_sha256(x) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in string.hexdigits for c in x)


def _check_chat(m: dict, where: str) -> None:
    """The optional chat_template (a string of bounded size, valid UTF-8) and stop_token_ids (a short
    list of ids below the model's vocab_size) the Android runner reads."""
    if "chat_template" in m:
        t = m["chat_template"]
        if not isinstance(t, str) or not t:
            _fail(where, f"chat_template must be a non-empty string, not {json.dumps(t)[:40]}")
        try:
            size = len(t.encode("utf-8"))
        except UnicodeEncodeError:
            _fail(where, "chat_template is not valid Unicode (it holds a lone surrogate)")
        if size > MAX_CHAT_TEMPLATE_BYTES:
            _fail(where, f"chat_template is {size} bytes, more than the {MAX_CHAT_TEMPLATE_BYTES} a template may have")
    if "stop_token_ids" in m:
        ids = m["stop_token_ids"]
        if not isinstance(ids, list) or not all(_is_int(x) and x >= 0 for x in ids):
            _fail(where, f"stop_token_ids must be a list of token ids, not {json.dumps(ids)[:40]}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            _fail(where, f"stop_token_ids lists {len(ids)} ids, more than {MAX_STOP_TOKEN_IDS}")
        vocab = m.get("model", {}).get("vocab_size") if isinstance(m.get("model"), dict) else None
        if _is_int(vocab) and any(x >= vocab for x in ids):
            _fail(where, f"stop_token_ids has id {max(ids)}, not below model.vocab_size={vocab}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def _check_calibration(c, model, where: str) -> None:
    """The calibration section (toolkit/calibration.py): the text's token count, the KLD bound, each role's
    measured fidelity, and the key offsets file (name, sha256, a shape equal to the model's layers, KV heads
    and head_dim)."""
    if not isinstance(c, dict):
        _fail(where, "calibration must be an object")
    _get(c, "tokens", "int", where, "calibration")
    _get(c, "text", "str", where, "calibration")
    if not (_is_number(c.get("max_kld")) and c["max_kld"] > 0):
        _fail(where, f"calibration.max_kld must be a positive number, not {json.dumps(c.get('max_kld'))[:40]}")
    fid = _get(c, "fidelity", "dict", where, "calibration")
    for role, f in fid.items():
        if not (isinstance(f, dict) and isinstance(f.get("spec"), str) and _is_number(f.get("kld")) and f["kld"] >= 0
                and _is_number(f.get("top1")) and 0 <= f["top1"] <= 1):
            _fail(where, f"calibration.fidelity.{role} must hold spec, kld >= 0 and top1 in [0, 1]")
    if "key_offsets" in c:
        k = c["key_offsets"]
        if not isinstance(k, dict):
            _fail(where, "calibration.key_offsets must be an object")
        check_file_name(k.get("file"), "calibration.key_offsets.file")
        if not _is_sha256(k.get("sha256")):
            _fail(where, "calibration.key_offsets.sha256 must be 64 hex digits")
        shape = k.get("shape")
        if not (isinstance(shape, list) and len(shape) == 3 and all(_is_int(x) and x > 0 for x in shape)):
            _fail(where, f"calibration.key_offsets.shape must be [layers, kv heads, head_dim], not {json.dumps(shape)[:40]}")
        if isinstance(model, dict):
            want = [model.get("num_layers"), model.get("num_kv_heads"), model.get("head_dim")]
            if shape != want:
                _fail(where, f"calibration.key_offsets.shape {shape} does not match the model's {want}")


def _check_pool(p: dict, where: str) -> PoolLayout:
    for key in _POOL_INTS:
        _get(p, key, "int", where, "pool")
    compact, num_compact = None, 0
    if "compact" in p or "num_compact_blocks" in p:  # the compact region (issue 25): both or neither
        num_compact = _get(p, "num_compact_blocks", "int", where, "pool")
        compact_dict = _get(p, "compact", "dict", where, "pool")
    try:
        spec = spec_from_dict(_get(p, "spec", "dict", where, "pool"), None, "pool.spec")
        if num_compact:
            compact = spec_from_dict(compact_dict, None, "pool.compact")
        layout = PoolLayout(spec=spec, compact=compact, num_compact_blocks=num_compact,
                            **{k: p[k] for k in _POOL_INTS})
    except PagedKVError as e:
        _fail(where, f"its pool does not describe a valid pool ({e})")
    if layout.total_bytes > 2**40:  # an edited size would otherwise fail deep inside numpy
        _fail(where, f"its pool is {layout.total_bytes / 2**30:.0f} GiB, not a real export")
    # the derived values the other readers (Android runner, deploy) take as written must agree
    want = layout.to_dict()
    for key in ("codes_shape", "scales_shape", "stage_shape", "codes_dtype", "bytes_per_token", "total_bytes",
                "compact_codes_shape", "compact_scales_shape"):
        if key in p and p[key] != want.get(key):
            _fail(where, f"pool.{key} is {json.dumps(p[key])[:60]} but the pool's spec and sizes give "
                         f"{json.dumps(want[key])}")
    return layout


def _check_artifact(kind: str, e, where: str) -> None:
    if not isinstance(e, dict):
        _fail(where, f"artifacts.{kind} must be an object")
    check_file_name(e.get("file"), f"artifacts.{kind}.file")
    sha = e.get("sha256")
    if sha is not None and not _is_sha256(sha):
        _fail(where, f"artifacts.{kind}.sha256 must be 64 hex digits")
    for key in ("inputs", "outputs"):
        names = e.get(key)
        if names is not None and not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            _fail(where, f"artifacts.{kind}.{key} must be a non-empty list of names")
    for key in ("max_tokens_per_call", "max_blocks_per_seq"):
        if key in e and not (_is_int(e[key]) and e[key] > 0):
            _fail(where, f"artifacts.{kind}.{key} must be a positive integer")


def validate_manifest(m, where: str = MANIFEST_NAME, require: tuple[str, ...] = ()) -> dict:
    """Check a parsed manifest's structure; raises ArtifactError (one line) or returns it.

    `format_version` and `artifacts` are always required; the `model`/`pool` sections are checked
    when present and required when named in `require`."""
    if not isinstance(m, dict):
        _fail(where, f"the manifest must be a JSON object, not {type(m).__name__}")
    fv = m.get("format_version")
    if not _is_int(fv) or fv not in (FORMAT_VERSION, GROUP_SPEC_FORMAT_VERSION):
        raise ArtifactError(
            f"{where} has format_version {json.dumps(fv)}, this pagedkv reads {FORMAT_VERSION} and "
            f"{GROUP_SPEC_FORMAT_VERSION}: re-export with this version."
        )
    if fv != format_version(m):
        _fail(where, f"format_version {fv} does not match its layer groups (version {GROUP_SPEC_FORMAT_VERSION} "
                     "exactly when a group has its own spec)")
    for key in ("artifacts",) + tuple(require):
        if key not in m:
            _fail(where, f"it has no '{key}' section")
    arts = m["artifacts"]
    if not isinstance(arts, dict):
        _fail(where, "artifacts must be an object")
    for kind, entry in arts.items():
        if kind not in ARTIFACT_KINDS:
            _fail(where, f"unknown artifact kind {kind!r} (known: {', '.join(ARTIFACT_KINDS)})")
        _check_artifact(kind, entry, where)
    tok = m.get("tokenizer_files", [])
    if not isinstance(tok, list):
        _fail(where, "tokenizer_files must be a list of file names")
    for name in tok:
        check_file_name(name, "tokenizer file")
    if "model" in m:
        if not isinstance(m["model"], dict):
            _fail(where, "model must be an object")
        _check_model(m["model"], where)
    if "pool" in m:
        if not isinstance(m["pool"], dict):
            _fail(where, "pool must be an object")
        layout = _check_pool(m["pool"], where)
        model = m.get("model")
        if isinstance(model, dict):
            for key in ("num_layers", "num_kv_heads", "head_dim"):
                if model[key] != getattr(layout, key):
                    _fail(where, f"model.{key}={model[key]} but pool.{key}={getattr(layout, key)}")
    _check_chat(m, where)
    if "calibration" in m:
        _check_calibration(m["calibration"], m.get("model"), where)
    versions = m.get("versions", {})
    if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
        _fail(where, "versions must be an object of version strings")
    return m


def parse_manifest(data: bytes, where: str = MANIFEST_NAME, require: tuple[str, ...] = ()) -> dict:
    """Bytes of a pagedkv.json -> validated manifest dict, or ArtifactError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{where} is not UTF-8 text (byte {e.start}): re-run `pagedkv export`.") from None
    try:
        m = json.loads(text, parse_constant=lambda c: _fail(where, f"it contains {c}, which is not JSON"))
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{where} is not valid JSON ({e}): re-run `pagedkv export`.") from None
    except RecursionError:
        raise ArtifactError(f"{where} nests too deeply to be a manifest: re-run `pagedkv export`.") from None
    return validate_manifest(m, where, require)


def read_manifest(art_dir: Path, require: tuple[str, ...] = ()) -> dict:
    """The validated manifest of an artifacts dir; its bytes must match pagedkv.json.sha256."""
    art_dir = Path(art_dir)
    path = art_dir / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{path} not found: is {art_dir} an artifacts directory made by `pagedkv export`?")
    try:
        data = path.read_bytes()
        digest_file = art_dir / DIGEST_NAME
        stored = digest_file.read_text(encoding="ascii", errors="replace").split()[:1] if digest_file.is_file() else None
    except OSError as e:
        raise ArtifactError(f"cannot read {path}: {e}") from None
    if stored is None:
        raise ArtifactError(f"{art_dir / DIGEST_NAME} is missing: the manifest cannot be checked; re-run "
                            "`pagedkv export`.")
    if stored != [sha256_bytes(data)]:
        raise ArtifactError(f"{path} was modified after export (its sha256 does not match {DIGEST_NAME}): re-run "
                            "`pagedkv export` rather than editing the manifest.")
    return parse_manifest(data, str(path), require)


def format_version(manifest: dict) -> int:
    """The format a manifest is written in: GROUP_SPEC_FORMAT_VERSION when a layer group has its own spec."""
    groups = manifest.get("groups")
    own = isinstance(groups, list) and any(isinstance(g, dict) and g.get("spec") is not None for g in groups)
    return GROUP_SPEC_FORMAT_VERSION if own else FORMAT_VERSION


def write_manifest(art_dir: Path, manifest: dict) -> Path:
    """Write pagedkv.json (with format_version and this installation's versions) and its sha256 beside it.
    The manifest is validated first: a bad one is never written."""
    manifest = dict(manifest, format_version=format_version(manifest), versions=package_versions())
    validate_manifest(manifest, "the manifest to write")
    data = (json.dumps(manifest, indent=2) + "\n").encode("utf-8")
    path = Path(art_dir) / MANIFEST_NAME
    path.write_bytes(data)
    (Path(art_dir) / DIGEST_NAME).write_text(f"{sha256_bytes(data)}  {MANIFEST_NAME}\n")
    return path


# ----------------------------------------------------------------------------------------------
# Artifacts


def verify_artifact(art_dir: Path, manifest: dict, kind: str) -> Path:
    """Check that the artifact exists, its sha256 matches, and the versions it was made with match."""
    entry = manifest.get("artifacts", {}).get(kind)
    if entry is None:
        have = ", ".join(manifest.get("artifacts", {})) or "none"
        raise ArtifactError(
            f"{art_dir} has no {kind} artifact (it has: {have}): export it with `pagedkv export --format {kind}`."
        )
    for key in ("sha256", "inputs", "outputs"):
        if key not in entry:
            raise ArtifactError(f"{art_dir}'s manifest has no artifacts.{kind}.{key}: re-run `pagedkv export`.")
    path = artifact_path(art_dir, entry["file"], f"artifacts.{kind}.file")
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


# ----------------------------------------------------------------------------------------------
# The model an export was made from


def weights_sha256(model) -> str:
    """sha256 of a torch model's weights as loaded: each state_dict entry's name, dtype, shape and
    bytes, in name order. Export records it as model.weights_sha256 (before any weight quantization);
    `pagedkv eval --artifacts` compares it with the reference model's. torch only inside (a torch
    model is passed in anyway); SmolLM2's 540 MB take ~2 s."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


MODEL_IDENTITY = ("model_type",) + _MODEL_INTS


def check_same_model(where: str, manifest: dict, name: str, identity: dict, weights_sha=None) -> None:
    """The manifest's model must be the one named `name`: the same model_type, sizes and vocab
    (`identity`, keys MODEL_IDENTITY), and the same weights: model.weights_sha256 against
    `weights_sha()` (a callable, run only when the manifest records one); a manifest without it
    (exported before it was recorded) must name the same model. ArtifactError (one line) otherwise."""
    m = manifest.get("model")
    if not isinstance(m, dict):
        raise ArtifactError(f"{where}'s manifest has no model section: re-run `pagedkv export`.")
    diff = [f"{k} {m.get(k)} vs {identity.get(k)}" for k in MODEL_IDENTITY if m.get(k) != identity.get(k)]
    if diff:
        raise ArtifactError(f"{where} was exported from another model than {name} ({', '.join(diff)}; it names "
                            f"{m.get('name')!r}): give the model it was exported from as the reference.")
    sha = m.get("weights_sha256")
    if sha is not None and weights_sha is not None:
        have = weights_sha()
        if have != sha:
            raise ArtifactError(f"{where} was exported from other weights than {name} (weights sha256 {sha[:12]}... vs "
                                f"{have[:12]}...): give the model it was exported from as the reference.")
    elif sha is None and str(m.get("name")) != str(name):
        same_path = Path(str(m.get("name"))).expanduser().exists() and \
            Path(str(m.get("name"))).expanduser().resolve() == Path(str(name)).expanduser().resolve()
        if not same_path:
            raise ArtifactError(f"{where} was exported from {m.get('name')!r}, not {name!r}, and records no weights "
                                f"sha256 to tell whether they are the same: give {m.get('name')!r} as the reference, "
                                "or re-export it with this pagedkv.")


def layout_from_manifest(manifest: dict) -> PoolLayout:
    if "pool" not in manifest:
        raise ArtifactError("the manifest's pool section is incomplete (no 'pool'): re-run `pagedkv export`.")
    return _check_pool(manifest["pool"], "the manifest")


# ----------------------------------------------------------------------------------------------
# The graph against the manifest


def pool_identity(layout: PoolLayout, groups=None) -> dict:
    """What a graph bakes in about its pool (everything but the block count, which runtimes size):
    stored in the ONNX graph's metadata at export, compared with the manifest at load. groups (LayerGroup
    list): the specs of the groups that have their own ("group_specs", group index -> spec; only then)."""
    d = layout.to_dict()
    out = {"spec": d["spec"], **{k: d[k] for k in ("num_layers", "num_kv_heads", "head_dim", "block_size",
                                                     "max_seqs", "codes_dtype")}}
    if layout.num_compact_blocks:  # the compact spec the mixed nodes bake in (not the region's block count)
        out["compact"] = d["compact"]
    own = {str(i): g.to_dict()["spec"] for i, g in enumerate(groups or []) if g.spec is not None}
    if own:
        out["group_specs"] = own
    return out


_ORT_DTYPES = {"tensor(uint8)": "uint8", "tensor(float16)": "float16", "tensor(float)": "float32",
               "tensor(int64)": "int64"}


def check_identity(where: str, want: dict, graph_identity: str | None) -> None:
    """The pool identity a graph carries (JSON) must be the manifest's pool_identity()."""
    if graph_identity is None:
        raise ArtifactError(f"{where} carries no pool description ({ONNX_POOL_KEY}): it was not made by this "
                            "`pagedkv export`; re-run it.")
    try:
        got = json.loads(graph_identity)
    except ValueError:
        got = None
    if got == want:
        return
    got = got if isinstance(got, dict) else {}
    diff = [k for k in want if got.get(k) != want[k]]
    if "spec" in diff and isinstance(got.get("spec"), dict):
        diff = [f"spec.{k}" for k in want["spec"] if got["spec"].get(k) != want["spec"][k]] + \
               [k for k in diff if k != "spec"]
    raise ArtifactError(f"{where} was exported for another pool than the manifest describes (differs in "
                        f"{', '.join(diff) or 'its description'}): the manifest was edited or mixed up; re-run "
                        "`pagedkv export`.")


def check_graph_pool(where: str, layout: PoolLayout, names: list[str], graph_inputs: list[tuple[str, list, str]],
                     graph_identity: str | None, groups=None) -> None:
    """Compare a loaded graph with the manifest. graph_inputs: (name, shape with ints or symbols,
    onnx type string) per input; graph_identity: the JSON in the graph's metadata (None if absent).
    Generic over the manifest's input list: every name it lists must be an input of the graph with
    the same position; pool inputs (codes_i / scales_i / stage_i) must have the layout's fixed dims
    and dtypes."""
    have = [g[0] for g in graph_inputs]
    if have != list(names):
        raise ArtifactError(f"{where}: the graph's inputs {have[:6]}... are not the manifest's {list(names)[:6]}...: "
                            "the manifest does not belong to this model; re-run `pagedkv export`.")
    from toolkit.block_pool import layer_layouts

    check_identity(where, pool_identity(layout, groups), graph_identity)
    layouts = layer_layouts(layout, groups)  # each layer's widths: its group's spec

    def shapes(lay: PoolLayout) -> dict:
        out = {"codes": lay.codes_shape(), "scales": lay.scales_shape(), "stage": lay.stage_shape()}
        if layout.num_compact_blocks:  # compact_codes_i / compact_scales_i (the compact region, read-only inputs)
            out.update(compact_codes=layout.compact_codes_shape(), compact_scales=layout.compact_scales_shape())
        return out

    dtypes = {"codes": layout.codes_dtype_name, "scales": "float16", "stage": "float16", "compact_codes": "uint8",
              "compact_scales": "float16"}
    for name, shape, kind in graph_inputs:
        prefix, _, idx = name.rpartition("_")
        if prefix not in dtypes or not idx.isdigit() or int(idx) >= len(layouts) or \
                prefix.startswith("compact") and not layout.num_compact_blocks:
            if name == "block_tables" and shape and isinstance(shape[0], int) and shape[0] != layout.max_seqs:
                raise ArtifactError(f"{where}: block_tables has {shape[0]} rows but the manifest's pool has "
                                    f"max_seqs={layout.max_seqs}; re-run `pagedkv export`.")
            continue
        want = shapes(layouts[int(idx)])[prefix]
        fixed_ok = len(shape) == len(want) and all(not isinstance(g, int) or g == w for g, w in zip(shape, want))
        if not fixed_ok or _ORT_DTYPES.get(kind) != dtypes[prefix]:
            raise ArtifactError(f"{where}: input {name} is {kind} {list(shape)} but the manifest's pool gives "
                                f"{dtypes[prefix]} {list(want)}; re-run `pagedkv export`.")

