"""The `pagedkv` command line end to end (real subprocesses) and its bad-input errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from export.artifacts import PoolRequest, export_artifacts
from toolkit.manifest import DIGEST_NAME, MANIFEST_NAME, sha256_bytes
from toolkit.tiny_models import tiny_bpe_tokenizer, tiny_model

REPO = Path(__file__).resolve().parent.parent
PAGEDKV = [sys.executable, "-m", "toolkit.cli"]


def pagedkv(*args, stdin=None, env=None, check=True):
    proc = subprocess.run(
        PAGEDKV + [str(a) for a in args], input=stdin, capture_output=True, text=True, timeout=300,
        cwd=REPO, env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def art(tmp_path_factory, wikitext):
    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:2000]
    out = tmp_path_factory.mktemp("cli") / "tiny"
    export_artifacts("tiny-llama", out, ("onnx", "pte"), "default", PoolRequest(pool_tokens=512, max_seqs=3),
                     max_tokens_per_call=32, model_and_tokenizer=(tiny_model("llama"), tiny_bpe_tokenizer(lines)),
                     accept_fidelity=True)
    return out


def reseal(art: Path, data: bytes) -> None:
    """Write pagedkv.json and a matching pagedkv.json.sha256 (an edit made on purpose, hash and all)."""
    (art / MANIFEST_NAME).write_bytes(data)
    (art / DIGEST_NAME).write_text(sha256_bytes(data) + "  pagedkv.json\n")


def copy_of(art, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(art, dst)
    return dst


@pytest.mark.parametrize("backend", ["onnxruntime", "executorch"])
def test_run_json(art, backend):
    out = json.loads(pagedkv("run", art, "--prompt", "The tower is", "-n", "8", "--json", "--backend", backend).stdout)
    assert out["stats"]["used_blocks"] >= 1 and out["stats"]["decode_tok_s"] > 0
    assert isinstance(out["text"], str) and out["text"]
    one = json.loads(pagedkv("run", art, "--prompt", "The tower is", "-n", "8", "--json", "--backend", backend,
                             "--threads", "1").stdout)
    assert one["text"] == out["text"]  # greedy: the thread count does not change the tokens


def test_negative_threads_is_a_clear_error(art):
    proc = pagedkv("run", art, "--prompt", "hi", "--threads", "-2", check=False)
    assert proc.returncode == 2 and "--threads -2 is out of range" in proc.stderr


def test_chat_commands_in_a_subprocess(art):
    typed = "hello there\n/stats\n/new\nsecond chat\n/stats\n/clear\n/stats\n/quit\n"
    proc = pagedkv("chat", art, "-n", "6", stdin=typed)
    text = proc.stdout + proc.stderr
    assert "[conversation 2]" in text and "[cleared]" in text
    used = [int(x.split("/")[0]) for x in text.split("blocks used ")[1:]]
    assert len(used) == 3 and used[0] >= 1 and used[1] > used[0] and used[2] < used[1]


def test_tampered_artifact_is_rejected(art, tmp_path):
    bad = copy_of(art, tmp_path)
    data = bytearray((bad / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "model.onnx").write_bytes(bytes(data))
    proc = pagedkv("run", bad, "--prompt", "hi", check=False)
    assert proc.returncode == 2 and "corrupted or was modified" in proc.stderr


def test_truncated_pte_is_rejected(art, tmp_path):
    bad = copy_of(art, tmp_path)
    pte = bad / "model.pte"
    pte.write_bytes(pte.read_bytes()[:1000])
    proc = pagedkv("run", bad, "--prompt", "hi", "--backend", "executorch", check=False)
    assert proc.returncode == 2 and "corrupted or was modified" in proc.stderr


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: m["versions"].update(executorch="0.9.0"), "exported with executorch 0.9.0 but 1.5.1 is installed"),
        (lambda m: m.update(format_version=99), "format_version 99"),
        (lambda m: m["artifacts"]["onnx"].update(sha256="0" * 64), "does not match the manifest"),
        (lambda m: m.pop("pool"), "has no 'pool' section"),
    ],
    ids=["versions", "format", "hash", "pool"],
)
def test_wrong_manifest_is_rejected(art, tmp_path, edit, needle):
    bad = copy_of(art, tmp_path)
    m = json.loads((bad / "pagedkv.json").read_text())
    edit(m)
    reseal(bad, json.dumps(m).encode())  # past the manifest's own sha256: the deeper checks must hold
    proc = pagedkv("run", bad, "--prompt", "hi", check=False)
    assert proc.returncode == 2 and needle in " ".join(proc.stderr.split()), proc.stderr


def test_missing_kernel_library_says_how_to_build_it(art, tmp_path):
    env = {"PAGEDKV_BUILD_DIR": str(tmp_path / "no-build")}
    proc = pagedkv("run", art, "--prompt", "hi", "--backend", "executorch", env=env, check=False)
    assert proc.returncode == 2 and "run `make native`" in " ".join(proc.stderr.split())
    proc = pagedkv("run", art, "--prompt", "hi", "--native", env=env, check=False)
    assert proc.returncode == 2 and "libpagedkv_ort.so is missing" in " ".join(proc.stderr.split())


def test_export_of_model_dir_without_weights(tmp_path):
    d = tmp_path / "noweights"
    tiny_model("llama").config.save_pretrained(d)
    proc = pagedkv("export", d, "--out", tmp_path / "out", check=False)
    assert proc.returncode == 2 and "no *.safetensors" in " ".join(proc.stderr.split())
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_export_rejects_bad_spec_and_block_size(tmp_path, wikitext):
    d = tmp_path / "m"
    tiny_model("llama").save_pretrained(d)
    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:200]
    tiny_bpe_tokenizer(lines).save_pretrained(d)
    proc = pagedkv("export", d, "--out", tmp_path / "o", "--spec", "default:k_group=48,v_group=48", check=False)
    assert proc.returncode == 2 and "does not divide head_dim=64" in " ".join(proc.stderr.split())
    proc = pagedkv("export", d, "--out", tmp_path / "o", "--block-size", "0", check=False)
    assert proc.returncode == 2 and "block size 0 is invalid" in " ".join(proc.stderr.split())


def test_export_rejects_bad_sliding_and_compact_specs(tmp_path, wikitext):
    """--sliding-spec and --compact-spec: one line, exit 2, before the weights load, no --out left behind."""
    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:200]
    dirs = {}
    for family in ("llama", "gemma3"):
        dirs[family] = tmp_path / family
        tiny_model(family).save_pretrained(dirs[family])
        tiny_bpe_tokenizer(lines).save_pretrained(dirs[family])
    out = tmp_path / "o"
    for family, extra, needle in [
        ("llama", ["--sliding-spec", "default"], "only global ones"),
        ("llama", ["--compact-spec", "default:k_bits=4,v_bits=2"], "--compact-spec needs --compact-blocks"),
        ("gemma3", ["--sliding-spec", "default:rotate=false"], "differs from the pool's spec in rotate"),
        ("gemma3", ["--sliding-spec", "fp16"], "quantized specs on both sides"),
    ]:
        proc = pagedkv("export", dirs[family], "--out", out, "--spec", "default", *extra, check=False)
        assert proc.returncode == 2 and needle in " ".join(proc.stderr.split()), (extra, proc.stderr)
        assert not out.exists()


def test_runtime_pool_budget_and_policies(art):
    # the ONNX pool's block count is dynamic: a smaller pool is allocated at startup from --pool-mb
    out = json.loads(pagedkv("run", art, "--prompt", "The tower is", "-n", "4", "--json", "--pool-mb", "0.2").stdout)
    assert out["stats"]["total_blocks"] == 16 and out["stats"]["pool_bytes"] < 0.2 * 2**20
    long_prompt = " ".join(["the tower is tall"] * 80)
    proc = pagedkv("run", art, "--prompt", long_prompt, "-n", "4", "--pool-mb", "0.12", check=False)
    assert proc.returncode == 2 and "KV block pool exhausted" in " ".join(proc.stderr.split())
    out = json.loads(pagedkv("run", art, "--prompt", long_prompt, "-n", "40", "--json", "--pool-mb", "0.12",
                             "--policy", "sliding").stdout)
    assert out["stats"]["used_blocks"] <= out["stats"]["total_blocks"]
    proc = pagedkv("run", art, "--prompt", "x", "--backend", "executorch", "--pool-mb", "1", check=False)
    assert proc.returncode == 2 and "fixed when the model is exported" in " ".join(proc.stderr.split())


def test_list_options_take_several_values_after_one_flag():
    from toolkit.cli import expand_list_options

    assert expand_list_options(["eval", "m", "--spec", "fp16", "default", "--ctx", "8"]) == \
        ["eval", "m", "--spec", "fp16", "--spec", "default", "--ctx", "8"]
    assert expand_list_options(["eval", "m", "--spec", "fp16", "--spec", "k4v4", "best"]) == \
        ["eval", "m", "--spec", "fp16", "--spec", "k4v4", "--spec", "best"]
    # a non-list option's value and a list option's first value stay as they are, whatever they look like
    assert expand_list_options(["plan", "m", "--ram", "1GiB", "--spec", "-x"]) == ["plan", "m", "--ram", "1GiB",
                                                                                   "--spec", "-x"]
    assert expand_list_options(["export", "m", "--spec", "default", "x"]) == ["export", "m", "--spec", "default", "x"]


def test_plan_with_two_specs_after_one_flag(tmp_path):
    d = tmp_path / "m"
    tiny_model("llama").config.save_pretrained(d)
    proc = pagedkv("plan", d, "--ram", "64MiB", "--spec", "fp16", "default", "--json")
    rows = json.loads(proc.stdout)
    assert [r["name"] for r in rows["specs"]] == ["fp16", "default"], rows
