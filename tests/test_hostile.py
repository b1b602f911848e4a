"""Hostile input and half-finished work (issue 21): every bad input gives one clear line and exit 2, and
leaves the artifact dir and the pool as they were.

Tiny artifacts are built once per module: an ONNX export (fast) with a tokenizer, and one .pte export
for the ExecuTorch cases. Each case edits a copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from export.artifacts import PoolRequest, export_artifacts
from toolkit.errors import ArtifactError, PagedKVError, PoolExhausted
from toolkit.manifest import (
    DIGEST_NAME, MANIFEST_NAME, parse_manifest, read_manifest, sha256_bytes, sha256_file, validate_manifest,
)
from toolkit.pool_layout import PoolLayout
from toolkit.kv_spec import KVQuantSpec
from tests.conftest import wikitext_path
from toolkit.tiny_models import tiny_bpe_tokenizer, tiny_model

REPO = Path(__file__).resolve().parent.parent
PAGEDKV = [sys.executable, "-m", "toolkit.cli"]
# a template that insists on alternating user/assistant roles (as Mistral's and Gemma's do)
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli(*args, stdin=None) -> Result:
    """The CLI in this process (typer's runner): the same code path as the console script, without paying
    a Python start and the onnxruntime import for each of the many cases."""
    from typer.testing import CliRunner

    from toolkit.cli import app

    r = CliRunner().invoke(app, [str(a) for a in args], input=stdin)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return Result(r.exit_code, r.stdout, r.stderr)


def pagedkv(*args, stdin=None, env=None):
    """The CLI as a real subprocess (argv bytes, stdin, exit status)."""
    return subprocess.run(
        PAGEDKV + [a if isinstance(a, bytes) else str(a) for a in args], input=stdin, capture_output=True,
        timeout=300, cwd=REPO, env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def one_line_error(proc, needle: str) -> str:
    """Exit 2, one line on stderr starting with 'error:' and containing needle, no traceback."""
    err = proc.stderr.decode("utf-8", "replace") if isinstance(proc.stderr, bytes) else proc.stderr
    # ExecuTorch's runtime logs its CPU probing ("[cpuinfo_utils.cpp:71] ...") the first time its threadpool
    # starts in a process: native log lines, not our message
    lines = [ln for ln in err.splitlines() if ln.strip() and not re.match(r"\[\w+\.cpp:\d+\]", ln)]
    assert proc.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert needle in lines[0], err
    return lines[0]


def snapshot(d: Path) -> dict:
    return {p.name: (sha256_file(p) if p.is_file() else "dir") for p in sorted(Path(d).iterdir())}


def reseal(art: Path, manifest) -> None:
    """Write a manifest and its matching sha256 (an edit made on purpose, hash and all)."""
    data = json.dumps(manifest).encode() if not isinstance(manifest, bytes) else manifest
    (art / MANIFEST_NAME).write_bytes(data)
    (art / DIGEST_NAME).write_text(sha256_bytes(data) + "  pagedkv.json\n")


def load(art: Path) -> dict:
    return json.loads((art / MANIFEST_NAME).read_text())


def tokenizer():
    lines = [ln for ln in wikitext_path().read_text(encoding="utf-8").splitlines() if ln.strip()][:500]
    return tiny_bpe_tokenizer(lines)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile") / "onnx"
    export_artifacts("tiny-llama", out, ("onnx",), "default", PoolRequest(pool_tokens=256, max_seqs=3),
                     model_and_tokenizer=(tiny_model("llama", num_layers=1), tokenizer()), accept_fidelity=True)
    return out


@pytest.fixture(scope="module")
def pte_art(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile") / "pte"
    export_artifacts("tiny-llama", out, ("pte",), "default", PoolRequest(pool_tokens=256, max_seqs=2),
                     max_tokens_per_call=32, model_and_tokenizer=(tiny_model("llama", num_layers=1), tokenizer()),
                     accept_fidelity=True)
    return out


@pytest.fixture
def copy(art, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(art, dst)
    return dst


# ----------------------------------------------------------------------------------------------
# Manifests: names that leave the dir, edits, damaged JSON, damaged files


def _pool_with(m, **changes):
    """The manifest's pool section re-derived for a changed spec/size: a consistent, deliberate edit."""
    p = m["pool"]
    spec = KVQuantSpec(**{**p["spec"], **{k: v for k, v in changes.items() if k in p["spec"]}})
    sizes = {k: changes.get(k, p[k]) for k in ("num_layers", "num_kv_heads", "head_dim", "block_size",
                                                "num_blocks", "max_seqs")}
    m["pool"] = PoolLayout(spec, **sizes).to_dict()


def _set(path, value):
    def edit(m):
        d = m
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


def _pop(path):
    def edit(m):
        d = m
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return edit


MANIFEST_EDITS = {
    # names that lead out of the artifact dir
    "onnx-file-dotdot": (_set(["artifacts", "onnx", "file"], "../../x/evil.onnx"), "not a plain file name"),
    "onnx-file-absolute": (_set(["artifacts", "onnx", "file"], "/etc/passwd"), "not a plain file name"),
    "onnx-file-option": (_set(["artifacts", "onnx", "file"], "-rf"), "starts with '-'"),
    "tokenizer-dotdot": (_set(["tokenizer_files"], ["../../../../etc/passwd"]), "not a plain file name"),
    "tokenizer-absolute": (_set(["tokenizer_files"], ["/etc/hostname"]), "not a plain file name"),
    "tokenizer-newline": (_set(["tokenizer_files"], ["a\nb"]), "control character"),
    # edits of what the graph does: caught against the graph itself
    "spec-bits": (lambda m: _pool_with(m, k_bits=4), "differs in spec.k_bits"),
    "rotation-off": (lambda m: _pool_with(m, rotate=False), "differs in spec.rotate"),
    "k7v5-same-bytes": (lambda m: _pool_with(m, k_bits=7, v_bits=5), "differs in spec.k_bits, spec.v_bits"),
    "block-size": (lambda m: _pool_with(m, block_size=32, num_blocks=8), "differs in block_size"),
    "max-seqs": (lambda m: _pool_with(m, max_seqs=2), "differs in max_seqs"),
    "inconsistent-pool": (_set(["pool", "spec", "k_bits"], 4), "pool.codes_shape"),
    "huge-pool": (lambda m: _pool_with(m, num_blocks=10**12), "not a real export"),
    # missing keys, wrong types
    "no-sha256": (_pop(["artifacts", "onnx", "sha256"]), "no artifacts.onnx.sha256"),
    "no-file": (_pop(["artifacts", "onnx", "file"]), "artifacts.onnx.file None"),
    "no-inputs": (_pop(["artifacts", "onnx", "inputs"]), "no artifacts.onnx.inputs"),
    "no-pool": (_pop(["pool"]), "no 'pool' section"),
    "no-model": (_pop(["model"]), "no 'model' section"),
    "format-as-string": (_set(["format_version"], "1"), 'format_version "1"'),
    "format-99": (_set(["format_version"], 99), "format_version 99"),
    "num-layers-string": (_set(["model", "num_layers"], "1"), "model.num_layers must be a positive integer"),
    "block-size-float": (_set(["pool", "block_size"], 16.0), "pool.block_size must be a positive integer"),
    "spec-bool-as-int": (_set(["pool", "spec", "rotate"], 1), "expected true or false"),
    "inputs-renamed": (lambda m: m["artifacts"]["onnx"]["inputs"].__setitem__(0, "ids"), "are not the manifest's"),
    "versions": (_set(["versions", "onnxruntime"], "0.1.0"), "exported with onnxruntime 0.1.0"),
    "sha-mismatch": (_set(["artifacts", "onnx", "sha256"], "0" * 64), "does not match the manifest"),
    "sha-not-hex": (_set(["artifacts", "onnx", "sha256"], "z" * 64), "64 hex digits"),
    "unknown-kind": (_set(["artifacts", "gguf"], {"file": "m.gguf"}), "unknown artifact kind"),
}


@pytest.mark.parametrize("name", list(MANIFEST_EDITS))
def test_manifest_edit_is_one_line(copy, name):
    edit, needle = MANIFEST_EDITS[name]
    m = load(copy)
    edit(m)
    reseal(copy, m)  # hash and all: the checks below the manifest's own sha256 must hold
    before = snapshot(copy)
    one_line_error(cli("run", copy, "--prompt", "hi", "-n", "2"), needle)
    assert snapshot(copy) == before


RAW_MANIFESTS = {
    "list": (b"[1, 2]", "must be a JSON object, not list"),
    "null": (b"null", "must be a JSON object, not NoneType"),
    "not-utf8": (b'{"format_version": 1, "x": "\xff\xfe"}', "not UTF-8"),
    "not-json": (b"{format_version: 1", "not valid JSON"),
    "nan": (b'{"format_version": NaN}', "NaN, which is not JSON"),
    "deep": (b"[" * 100000 + b"]" * 100000, "pagedkv.json"),
    "empty": (b"", "not valid JSON"),
}


@pytest.mark.parametrize("name", list(RAW_MANIFESTS))
def test_raw_manifest_is_one_line(copy, name):
    data, needle = RAW_MANIFESTS[name]
    reseal(copy, data)
    one_line_error(cli("run", copy, "--prompt", "hi"), needle)


def test_edited_manifest_without_its_hash_is_caught(copy):
    m = load(copy)
    m["model"]["name"] = "something else"
    (copy / MANIFEST_NAME).write_text(json.dumps(m))
    one_line_error(cli("run", copy, "--prompt", "hi"), "was modified after export")
    (copy / DIGEST_NAME).unlink()
    one_line_error(cli("run", copy, "--prompt", "hi"), "pagedkv.json.sha256 is missing")


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[:1000])


def _flip(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


FILE_DAMAGE = {
    "truncated-onnx": (lambda a: _truncate(a / "model.onnx"), "corrupted or was modified"),
    "bitflip-onnx": (lambda a: _flip(a / "model.onnx"), "corrupted or was modified"),
    "missing-onnx": (lambda a: (a / "model.onnx").unlink(), "model.onnx is missing"),
    "onnx-symlink-out": (lambda a: ((a / "model.onnx").unlink(), (a / "model.onnx").symlink_to("/etc/hostname")),
                         "outside"),
    "missing-tokenizer": (lambda a: (a / "tokenizer.json").unlink(), "lacks the tokenizer file(s) tokenizer.json"),
    "corrupt-tokenizer": (lambda a: (a / "tokenizer.json").write_text("{not json"), "is not a valid tokenizer"),
    "tokenizer-config-list": (lambda a: (a / "tokenizer_config.json").write_text("[]"), "not a JSON object"),
}


@pytest.mark.parametrize("name", list(FILE_DAMAGE))
def test_damaged_files_are_one_line(copy, name):
    damage, needle = FILE_DAMAGE[name]
    damage(copy)
    before = snapshot(copy)
    one_line_error(cli("run", copy, "--prompt", "hi", "-n", "2"), needle)
    assert snapshot(copy) == before


def _with_template(art: Path, template: str) -> None:
    (art / "chat_template.jinja").write_text(template)
    m = load(art)
    m["tokenizer_files"] = sorted(set(m["tokenizer_files"]) | {"chat_template.jinja"})
    reseal(art, m)


def test_bad_chat_template_is_one_line(copy):
    _with_template(copy, "{% for m in messages %}{{ m['content'] }")
    one_line_error(cli("run", copy, "--prompt", "hi"), "does not parse")


def test_no_model_dir_tokenizer(tmp_path):
    d = tmp_path / "m"
    tiny_model("llama").save_pretrained(d)
    one_line_error(cli("export", d, "--out", tmp_path / "o"), f"no tokenizer in {d}")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------
# The .pte: its pool identity is a constant method of the program


PTE_EDITS = {
    "rotation-off": (lambda m: _pool_with(m, rotate=False), "differs in spec.rotate"),
    "k7v5-same-bytes": (lambda m: _pool_with(m, k_bits=7, v_bits=5), "differs in spec.k_bits, spec.v_bits"),
    "max-seqs": (lambda m: _pool_with(m, max_seqs=1), "differs in max_seqs"),
    "pte-dotdot": (_set(["artifacts", "pte", "file"], "../model.pte"), "not a plain file name"),
}


@pytest.mark.parametrize("name", list(PTE_EDITS) + ["truncated-pte"])
def test_pte_edits_are_one_line(pte_art, tmp_path, name):
    copy = tmp_path / "pte"
    shutil.copytree(pte_art, copy)
    if name == "truncated-pte":
        _truncate(copy / "model.pte")
        needle = "corrupted or was modified"
    else:
        edit, needle = PTE_EDITS[name]
        m = load(copy)
        edit(m)
        reseal(copy, m)
    one_line_error(cli("run", copy, "--prompt", "hi", "-n", "2", "--backend", "executorch"), needle)


# ----------------------------------------------------------------------------------------------
# Options: one line, exit 2, before torch is imported


OPTION_CASES = {
    "pool-mb-nan": (["run", "ART", "--prompt", "hi", "--pool-mb", "nan"], "--pool-mb nan"),
    "pool-mb-inf": (["run", "ART", "--prompt", "hi", "--pool-mb", "inf"], "--pool-mb inf"),
    "pool-fraction-2": (["run", "ART", "--prompt", "hi", "--pool-fraction", "2"], "--pool-fraction 2.0"),
    "temperature-nan": (["run", "ART", "--prompt", "hi", "--temperature", "nan"], "--temperature nan"),
    "temperature-neg": (["run", "ART", "--prompt", "hi", "--temperature", "-1"], "--temperature -1.0"),
    "top-p-0": (["run", "ART", "--prompt", "hi", "--top-p", "0"], "--top-p 0.0"),
    "top-k-neg": (["run", "ART", "--prompt", "hi", "--top-k", "-1"], "--top-k -1"),
    "seed-neg": (["run", "ART", "--prompt", "hi", "--seed", "-1"], "--seed -1"),
    "n-neg": (["run", "ART", "--prompt", "hi", "-n", "-5"], "--max-new-tokens -5"),
    "threads-neg": (["run", "ART", "--prompt", "hi", "--threads", "-2"], "--threads -2"),
    "policy": (["run", "ART", "--prompt", "hi", "--policy", "lru"], "unknown pool policy 'lru'"),
    "backend": (["run", "ART", "--prompt", "hi", "--backend", "tvm"], "unknown backend 'tvm'"),
    "prompt-not-utf8": (["run", "ART", "--prompt", b"caf\xe9"], "--prompt is not valid UTF-8"),
    "chat-n-0": (["chat", "ART", "-n", "0"], "--max-new-tokens 0"),
    "export-pool-mb-nan": (["export", "M", "--out", "OUT", "--pool-mb", "nan"], "--pool-mb nan"),
    "export-pool-tokens-1e13": (["export", "M", "--out", "OUT", "--pool-tokens", "10000000000000"],
                                "--pool-tokens 10000000000000"),
    "export-max-tokens-0": (["export", "M", "--out", "OUT", "--max-tokens-per-call", "0"], "--max-tokens-per-call 0"),
    "export-max-seqs-0": (["export", "M", "--out", "OUT", "--max-seqs", "0"], "--max-seqs 0"),
    "export-block-size": (["export", "M", "--out", "OUT", "--block-size", "0"], "block size 0 is invalid"),
    "export-format": (["export", "M", "--out", "OUT", "--format", "gguf"], "unknown format 'gguf'"),
    "export-spec-field": (["export", "M", "--out", "OUT", "--spec", "default:kbits=4"], "bad spec override"),
    "export-spec-value": (["export", "M", "--out", "OUT", "--spec", "default:k_bits=x"], "expected an integer"),
    "export-spec-bits": (["export", "M", "--out", "OUT", "--spec", "default:k_bits=9"], "k_bits=9"),
    "export-out-proc": (["export", "M", "--out", "/proc/pagedkv-x"], "cannot create a directory in /proc"),
    "export-out-under-file": (["export", "M", "--out", "FILE/sub"], "is a file, not a directory"),
    "simulate-plot-nodir": (["simulate", "--plot", "/nodir/x.png"], "directory /nodir does not exist"),
    "simulate-plot-suffix": (["simulate", "--plot", "OUT.txt"], "must end in .png"),
    "simulate-fragmentation": (["simulate", "--fragmentation", "nan"], "--fragmentation nan"),
    "simulate-compact-share": (["simulate", "--compact-share", "1.5", "--no-plot"], "--compact-share 1.5"),
    "simulate-compact-horizon": (["simulate", "--compact-horizon", "0", "--no-plot"], "--compact-horizon 0"),
    "simulate-flash-mb": (["simulate", "--flash-mb", "-1", "--no-plot"], "--flash-mb -1"),
    "eval-kernel": (["eval", "M", "--text", "F", "--ctx", "512", "--kernel", "fast"], "unknown --kernel 'fast'"),
    "plan-max-seqs": (["plan", "llama", "--max-seqs", "0"], "--max-seqs 0"),
    "eval-ctx": (["eval", "M", "--text", "F", "--ctx", "1"], "--ctx 1"),
}


_OPTION_RUNNER = """
import json, sys
from toolkit.cli import app
cases = json.loads(sys.argv[1])
out = {}
for name, args in cases.items():
    args = [a.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape") for a in args]
    import io, contextlib
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            app(args, prog_name="pagedkv")
            code = 0
        except SystemExit as e:
            code = e.code
    out[name] = [code, err.getvalue(), "torch" in sys.modules]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def option_results(art, tmp_path_factory):
    """Every option case run in ONE fresh Python process (torch not imported at its start), in order: each
    reports its exit code, stderr and whether torch had been imported by then."""
    tmp = tmp_path_factory.mktemp("options")
    (tmp / "file").write_text("x")
    subst = {"ART": str(art), "M": "smollm2", "OUT": str(tmp / "out"), "FILE/sub": str(tmp / "file" / "s"),
             "F": str(tmp / "file"), "OUT.txt": str(tmp / "out.txt")}
    cases = {n: [subst.get(a, a) if isinstance(a, str) else a.decode("utf-8", "surrogateescape") for a in args]
             for n, (args, _) in OPTION_CASES.items()}
    before = snapshot(art)
    proc = subprocess.run([sys.executable, "-c", _OPTION_RUNNER, json.dumps(cases)], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert snapshot(art) == before and not (tmp / "out").exists()
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_bad_option_is_one_line_before_torch(option_results, name):
    code, err, torch_imported = option_results[name]
    one_line_error(Result(code, "", err), OPTION_CASES[name][1])
    assert not torch_imported, "torch was imported before the option error"


def test_invalid_utf8_prompt_bytes_in_a_real_process(art):
    one_line_error(pagedkv("run", art, "--prompt", b"caf\xe9 au lait"), "--prompt is not valid UTF-8")


@pytest.mark.parametrize("args, needle", [
    (["export", "m", "--pool-tokens", "1e13"], "Invalid value for '--pool-tokens'"),
    (["run", "x", "--prompt", "hi", "--bogus"], "No such option: --bogus"),
    (["frobnicate"], "No such command 'frobnicate'"),
], ids=["not-an-integer", "unknown-option", "unknown-command"])
def test_usage_errors_are_one_line(args, needle):
    one_line_error(pagedkv(*args), needle)


def test_list_manifest_in_a_real_process(copy):
    reseal(copy, b"[]")
    one_line_error(pagedkv("run", copy, "--prompt", "hi"), "must be a JSON object, not list")


def test_threads_above_the_core_count_are_capped_with_a_note(art):
    proc = cli("run", art, "--prompt", "hi", "-n", "2", "--threads", "100000", "--json")
    assert proc.returncode == 0, proc.stderr
    assert f"--threads 100000 is more than the {os.cpu_count()} cores" in proc.stderr


def test_top_k_beyond_the_vocabulary_keeps_every_token(art):
    a = json.loads(cli("run", art, "--prompt", "hi", "-n", "4", "--json", "--temperature", "0.7",
                           "--top-k", "100000", "--seed", "3").stdout)
    b = json.loads(cli("run", art, "--prompt", "hi", "-n", "4", "--json", "--temperature", "0.7",
                           "--seed", "3").stdout)
    assert a["text"] == b["text"]


# ----------------------------------------------------------------------------------------------
# Exports: validated before loading, atomic, never merged


def _model_dir(tmp_path, model_type=None) -> Path:
    d = tmp_path / "model"
    tiny_model("llama", num_layers=1).save_pretrained(d)
    tokenizer().save_pretrained(d)
    if model_type:
        cfg = json.loads((d / "config.json").read_text())
        cfg["model_type"] = model_type
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def _no_leftovers(parent: Path):
    assert not [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_export_refuses_a_non_empty_target_and_keeps_it(copy, tmp_path):
    d = _model_dir(tmp_path)
    before = snapshot(copy)
    one_line_error(cli("export", d, "--out", copy, "--spec", "k4v4"), "exists and is not empty: pass --force")
    assert snapshot(copy) == before


def test_export_of_unsupported_architecture_leaves_the_target(copy, tmp_path):
    d = _model_dir(tmp_path, model_type="bloom")
    before = snapshot(copy)
    one_line_error(cli("export", d, "--out", copy, "--force"), "model type 'bloom' is not supported")
    assert snapshot(copy) == before
    _no_leftovers(copy.parent)


def test_export_failing_half_way_leaves_the_target_and_no_partial_dir(copy):
    before = snapshot(copy)
    # one block: the ONNX exporter refuses it after the tokenizer files were written (into the temp dir)
    with pytest.raises(PagedKVError, match="cannot be exported"):
        export_artifacts("tiny-llama", copy, ("onnx",), "default", PoolRequest(pool_tokens=16, max_seqs=1),
                         model_and_tokenizer=(tiny_model("llama", num_layers=1), tokenizer()), force=True,
                         accept_fidelity=True)
    assert snapshot(copy) == before
    _no_leftovers(copy.parent)


def test_export_never_replaces_the_model_it_reads(tmp_path):
    d = _model_dir(tmp_path)
    before = snapshot(d)
    one_line_error(cli("export", d, "--out", d, "--force"), "holds the model")
    one_line_error(cli("export", d, "--out", tmp_path, "--force"), "holds the model")
    assert snapshot(d) == before


def test_export_of_model_dir_with_corrupt_tokenizer(tmp_path):
    d = _model_dir(tmp_path)
    (d / "tokenizer.json").write_text("{not json")
    one_line_error(cli("export", d, "--out", tmp_path / "o"), "cannot load the tokenizer in")
    assert not (tmp_path / "o").exists()
    _no_leftovers(tmp_path)


def test_cli_export_with_spec_override_and_force(copy, tmp_path):
    d = _model_dir(tmp_path)
    (copy / "stale.bin").write_bytes(b"old")
    proc = cli("export", d, "--out", copy, "--spec", "default:k_bits=6,rotate=false", "--force", "--accept-fidelity")
    assert proc.returncode == 0, proc.stderr
    m = read_manifest(copy)
    assert m["pool"]["spec"]["k_bits"] == 6 and m["pool"]["spec"]["rotate"] is False
    assert not (copy / "stale.bin").exists() and set(m["artifacts"]) == {"onnx"}
    _no_leftovers(copy.parent)
    assert cli("run", copy, "--prompt", "hi", "-n", "2").returncode == 0


# ----------------------------------------------------------------------------------------------
# The op's metadata (plain-PyTorch reference)


def _op_case(name):
    import torch

    z = torch.zeros
    cases = {
        "no-block-for-slot": (torch.arange(3), z(3, dtype=torch.long), torch.full((2, 1), -1), "no block (-1)"),
        "negative-position": (torch.tensor([-1, 0, 1]), z(3, dtype=torch.long), z(2, 1, dtype=torch.long),
                              "positions[0]=-1 is negative"),
        "sequence-out-of-range": (torch.arange(3), torch.full((3,), 5), z(2, 1, dtype=torch.long), "seq_ids[0]=5"),
        "block-out-of-range": (torch.arange(3), z(3, dtype=torch.long), torch.full((2, 1), 99), "block 99, outside"),
        "table-too-narrow": (torch.arange(20, 23), z(3, dtype=torch.long), z(2, 1, dtype=torch.long),
                             "needs block-table column 1"),
    }
    return cases[name]


@pytest.mark.parametrize("name", ["no-block-for-slot", "negative-position", "sequence-out-of-range",
                                  "block-out-of-range", "table-too-narrow"])
def test_op_metadata_errors_name_the_value(name):
    import torch

    from toolkit.compiler import compile
    from toolkit.errors import NonFiniteKVError

    paged = compile(tiny_model("llama", num_layers=1), "default", num_blocks=8, max_seqs=2)
    pos, seq, tab, needle = _op_case(name)
    before = [t.clone() for t in paged.pool_tensors()[0]]
    with pytest.raises(PagedKVError, match=re.escape(needle)) as e:
        paged(torch.tensor([[5, 6, 7]]), pos, seq, tab)
    assert not isinstance(e.value, NonFiniteKVError)
    assert all(torch.equal(a, b) for a, b in zip(before, paged.pool_tensors()[0]))


# ----------------------------------------------------------------------------------------------
# Chat: failed turns roll back, Ctrl-C stops the reply, pool exhaustion in every policy


def _chat_engine(art, policy="error", pool_mb=None):
    from runtime_sim.session import open_artifacts

    return open_artifacts(art, "onnxruntime", native=False, policy=policy, pool_mb=pool_mb, prefill_chunk=32)


LONG = " ".join(["the tower is tall and the river is wide"] * 40)


def test_failed_turn_is_rolled_back_and_later_turns_work(copy):
    from runtime_sim.chat import ChatSession

    _with_template(copy, ALTERNATING)
    engine = _chat_engine(copy, pool_mb=0.1)
    chat = ChatSession(engine)
    first = "".join(chat.send("hello there", 4))
    used = engine.stats()["used_blocks"]
    messages = list(chat.messages)
    for _ in range(3):  # repeated failures do not grow anything
        with pytest.raises(PoolExhausted):
            "".join(chat.send(LONG, 4))
        assert chat.messages == messages and engine.stats()["used_blocks"] == used
        engine.pool.check_invariants()
    second = "".join(chat.send("and then", 4))  # alternating roles still hold: no TemplateError
    assert isinstance(first, str) and isinstance(second, str) and len(chat.messages) == 4


def test_failure_mid_reply_is_rolled_back(copy):
    from runtime_sim.chat import ChatSession

    engine = _chat_engine(copy, pool_mb=0.1)
    chat = ChatSession(engine)
    total = engine.stats()["total_blocks"]
    with pytest.raises(PoolExhausted):  # the prompt fits, the reply runs out of blocks
        "".join(chat.send("hi", total * 16))
    assert chat.messages == [] and engine.stats()["used_blocks"] == 0
    assert "".join(chat.send("hi", 3)) is not None and len(chat.messages) == 2
    engine.pool.check_invariants()


def test_ctrl_c_stops_the_reply_not_the_session(copy):
    from runtime_sim.chat import ChatSession

    engine = _chat_engine(copy)
    chat = ChatSession(engine)
    gen = chat.send("hello there", 50)
    next(gen)
    with pytest.raises(KeyboardInterrupt):
        gen.throw(KeyboardInterrupt)  # what Python does when SIGINT arrives while the reply streams
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert "".join(chat.send("go on", 3)) is not None
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2
    engine.pool.check_invariants()


def test_chat_unknown_command_gets_help_and_bad_turn_keeps_the_session(art):
    typed = f"/frobnicate\n{LONG}\nhello\n/stats\n/quit\n"
    proc = pagedkv("chat", art, "-n", "3", "--pool-mb", "0.1", stdin=typed.encode())
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "unknown command /frobnicate" in err and "/clear" in err
    assert "KV block pool exhausted" in err and "blocks used" in err


@pytest.mark.parametrize("policy", ["error", "evict", "sliding"])
def test_pool_exhaustion_in_every_policy(art, policy):
    engine = _chat_engine(art, policy=policy, pool_mb=0.1)
    total = engine.stats()["total_blocks"]
    a, b = engine.new_conversation(), engine.new_conversation()
    list(engine.generate(a, list(range(3, 3 + 16 * (total - 2))), 2))
    used = engine.stats()["used_blocks"]
    more = list(range(3, 3 + 16 * 4))
    if policy == "error":  # refused, nothing changed
        with pytest.raises(PoolExhausted):
            list(engine.generate(b, more, 2))
        assert engine.stats()["used_blocks"] == used
    elif policy == "evict":  # the idle chat a loses its blocks
        assert len(list(engine.generate(b, more, 2))) == 2
        assert engine.conversations[a].evictions == 1
    else:  # sliding: a drops its own oldest blocks and goes on
        assert len(list(engine.generate(a, more, 2))) == 2
    assert engine.stats()["used_blocks"] <= total
    engine.pool.check_invariants()
    engine.clear(a)
    engine.clear(b)
    assert engine.stats()["used_blocks"] == 0


# ----------------------------------------------------------------------------------------------
# The Python API


def test_toolkit_compile_takes_the_cli_spec_strings_and_dicts():
    import pydoc

    import toolkit

    p = toolkit.compile(tiny_model("llama", num_layers=1), "default:v_group=16,rotate=false", num_blocks=4)
    assert p.layout.spec.v_group == 16 and p.layout.spec.rotate is False
    p = toolkit.compile(tiny_model("llama", num_layers=1), {"k_bits": 6}, num_blocks=4)
    assert p.layout.spec.k_bits == 6
    with pytest.raises(PagedKVError, match="expected an integer"):
        toolkit.compile(tiny_model("llama", num_layers=1), {"k_bits": "six"})
    with pytest.raises(PagedKVError, match="not list"):
        toolkit.resolve_spec([8, 4])
    text = pydoc.render_doc(toolkit, renderer=pydoc.plaintext)
    for name in ("compile", "load_model", "resolve_spec", "read_manifest"):
        assert name in text


def test_deploy_pushes_only_plain_names(copy):
    from toolkit.deploy import deploy_files

    m = load(copy)
    m["artifacts"]["pte"] = {"file": "model.onnx", "sha256": m["artifacts"]["onnx"]["sha256"]}
    m["tokenizer_files"] = ["tokenizer.json", "../../../../etc/passwd"]
    reseal(copy, m)
    with pytest.raises(ArtifactError, match="not a plain file name"):
        deploy_files(copy)


# ----------------------------------------------------------------------------------------------
# Fuzz: any JSON value is a clean error or a valid manifest


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_fuzz_any_json_value_is_a_clean_error(value):
    try:
        m = parse_manifest(json.dumps(value).encode(), "fuzz.json", require=("model", "pool"))
    except ArtifactError as e:
        assert "\n" not in str(e)
    else:
        assert isinstance(m, dict)


def _paths(d, prefix=()):
    """Every key path of a nested manifest."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_one_field_of_a_real_manifest(art, data):
    m = load(art)
    paths = list(_paths(m))
    path = data.draw(st.sampled_from(paths))
    value = data.draw(json_values)
    d = m
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    try:
        out = validate_manifest(json.loads(json.dumps(m)), "fuzz.json", require=("model", "pool"))
    except ArtifactError as e:
        assert "\n" not in str(e)
    else:
        PoolLayout.from_dict(out["pool"])  # a manifest that passes is usable
