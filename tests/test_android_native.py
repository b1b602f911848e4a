"""The Android demo's native runner (android_demo/native), built and tested on the host, cross-built
for aarch64 and run under qemu (-cpu max: NEON dotprod; -cpu cortex-a53: the no-dotprod fallback),
and its JNI bridge on the host JVM.

Prerequisites (no silent skips: a missing one fails with the apt line): cmake, g++, a JDK,
g++-aarch64-linux-gnu, qemu-user-static; the aarch64 executorch wheel is fetched with pip once.
"""

from __future__ import annotations

import glob
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NATIVE = REPO / "android_demo" / "native"
CI = NATIVE / "ci_build.sh"
HOST = REPO / "build" / "android-host"
APT = "apt-get install -y cmake g++ openjdk-17-jdk-headless g++-aarch64-linux-gnu qemu-user-static adb"
WIKI = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"

sys.path.insert(0, str(NATIVE / "tests"))


def need(*tools):
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: {APT}")


def run(cmd, timeout=900, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{out[-4000:]}"
    return out


def summary(out: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"^(\d+) passed, (\d+) failed$", out, re.M)]


@pytest.fixture(scope="module")
def host_build():
    need("g++", "javac", "java")
    run(["bash", CI, "host"])
    return HOST


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """A tiny llama exported to .pte with an fp32 pool + HF's greedy tokens (make_fixtures.py)."""
    import make_fixtures

    out = tmp_path_factory.mktemp("android-fixtures")
    assert make_fixtures.main([str(out)]) == 0
    return out


def expected(fixtures):
    return json.loads((fixtures / "expected.json").read_text())["cases"]


def test_pool_arenas_hold_codes_at_offset_zero(fixtures):
    """The runner releases free blocks' pages assuming each layer arena starts with its codes tensor."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    manifest = json.loads((fixtures / "artifacts" / "pagedkv.json").read_text())
    res = deserialize_pte_binary((fixtures / "artifacts" / "model.pte").read_bytes())
    plan = getattr(res, "program", res).execution_plan[0]
    codes = [v.val for v in plan.values
             if getattr(getattr(v.val, "allocation_info", None), "memory_id", 0) >= 2
             and list(v.val.sizes) == manifest["pool"]["codes_shape"]]
    assert len(codes) == manifest["pool"]["num_layers"]
    assert sorted(t.allocation_info.memory_id for t in codes) == list(range(2, 2 + len(codes)))
    assert all(t.allocation_info.memory_offset_low == 0 and t.allocation_info.memory_offset_high == 0 for t in codes)


def _tokenizer_lines(tmp_path) -> tuple[Path, list[str]]:
    lines = [ln for ln in WIKI.read_text(encoding="utf-8").split("\n") if ln.strip()][:1500]
    lines += ["Hello, world! \u00e9t\u00e9 \u4e2d\u6587 \U0001F600 tabs\tand  spaces", "don't I'll we've 'x' a''b",
              "  lead   many\n\n newlines  ", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
              "1234567 3.14 \u0661\u0662 \u00bd"]
    esc = lambda s: s.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")  # noqa: E731
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(esc(s) for s in lines) + "\n", encoding="utf-8")
    return path, lines


def _smollm2_tokenizer_json() -> Path:
    found = sorted(glob.glob(str(Path.home() / ".cache" / "pagedkv" / "gguf-fp32" / "*" / "tokenizer.json")))
    if found:
        return Path(found[0])
    from toolkit.model_loading import cache_dir, load_model

    load_model("smollm2")  # converts once and caches the tokenizer next to the fp32 copy
    return Path(sorted(glob.glob(str(cache_dir() / "gguf-fp32" / "*" / "tokenizer.json")))[0])


@pytest.mark.parametrize("which", ["tiny-bpe", "smollm2"])
def test_cpp_tokenizer_equals_hf(host_build, fixtures, tmp_path, which):
    from tokenizers import Tokenizer

    tj = fixtures / "artifacts" / "tokenizer.json" if which == "tiny-bpe" else _smollm2_tokenizer_json()
    path, lines = _tokenizer_lines(tmp_path)
    out = run([host_build / "tokenize_cli", tj, path]).split("\n")
    hf = Tokenizer.from_file(str(tj))
    bad = [s for i, s in enumerate(lines) if [int(x) for x in out[i].split()] != hf.encode(s).ids]
    assert not bad, f"{len(bad)} of {len(lines)} lines differ from HF, first: {bad[0]!r}"
    rt = run([host_build / "tokenize_cli", tj, path, "--decode"]).split()
    assert rt.count("OK") == len(lines)


def test_runner_on_host(host_build, fixtures, tmp_path):
    out = run(["bash", CI, "test-host", fixtures, "--tokens-out", tmp_path / "tokens.txt"])
    assert summary(out) and all(f == 0 for _, f in summary(out)), out
    assert "all pagedkv core tests passed" in out, out[-4000:]
    got = [[int(x) for x in ln.split()] for ln in (tmp_path / "tokens.txt").read_text().splitlines()]
    assert got == [c["hf_greedy"] for c in expected(fixtures)]


def test_runner_equals_runtime_sim(host_build, fixtures, tmp_path):
    """Same .pte through runtime_sim's engine (ExecuTorch pybindings + the pagedkv kernel library)."""
    from toolkit.manifest import layout_from_manifest, read_manifest
    from runtime_sim.backends import ExecuTorchBackend
    from runtime_sim.engine import Engine

    art = fixtures / "artifacts"
    manifest = read_manifest(art)
    entry = manifest["artifacts"]["pte"]
    engine = Engine(ExecuTorchBackend(art / "model.pte", layout_from_manifest(manifest), entry),
                    prefill_chunk=entry["max_tokens_per_call"])
    run(["bash", CI, "test-host", fixtures, "--tokens-out", tmp_path / "tokens.txt"])
    runner = [[int(x) for x in ln.split()] for ln in (tmp_path / "tokens.txt").read_text().splitlines()]
    for case, mine in zip(expected(fixtures), runner):
        conv = engine.new_conversation()
        sim = list(engine.generate(conv, case["prompt_ids"], max_new_tokens=len(case["hf_greedy"])))
        assert sim == mine == case["hf_greedy"]


def test_jni_bridge_on_host_jvm(host_build, fixtures, tmp_path):
    classes = tmp_path / "classes"
    sources = sorted((NATIVE / "java").rglob("*.java")) + [NATIVE / "tests" / "java" / "JniBridgeTest.java"]
    run(["javac", "-d", classes, *sources])
    out = run(["java", f"-Djava.library.path={host_build}", "-cp", classes, "JniBridgeTest", fixtures])
    assert summary(out) and summary(out)[-1][1] == 0 and summary(out)[-1][0] >= 16, out


def test_aarch64_under_qemu(fixtures):
    """Cross-built with Debian's aarch64 g++ against the aarch64 executorch wheel; run twice under qemu."""
    need("aarch64-linux-gnu-g++", "qemu-aarch64-static", "javac")
    run(["bash", CI, "cross"], timeout=1800)
    out = run(["bash", CI, "test-cross", fixtures], timeout=1800)
    results = summary(out)
    assert len(results) == 4 and all(f == 0 for _, f in results), out[-4000:]
    assert "isa neon-dotprod" in out and "isa neon\n" in out.replace("isa neon-dotprod", "")
    # the kernel core's tests (every path vs scalar): the sdot path under -cpu max, plain NEON on the A53
    assert out.count("all pagedkv core tests passed") == 2, out[-4000:]
    assert re.search(r"^active path: neon-dotprod,", out, re.M) and re.search(r"^active path: neon,", out, re.M)
