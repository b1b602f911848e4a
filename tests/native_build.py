"""Building the Android demo's native runner for the tests (tests/test_android_native.py,
tests/test_runner_cli.py, tests/test_android_app.py): prerequisites, the builds, the tiny .pte fixture.

Prerequisites fail with the apt line instead of skipping. The builds go through
android_demo/native/ci_build.sh (host into build/android-host, cross into build/android-aarch64).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NATIVE = REPO / "android_demo" / "native"
CI = NATIVE / "ci_build.sh"
HOST = REPO / "build" / "android-host"
AARCH64 = REPO / "build" / "android-aarch64"
APT = "apt-get install -y cmake g++ nlohmann-json3-dev openjdk-17-jdk-headless clang lld g++-aarch64-linux-gnu qemu-user-static adb"

sys.path.insert(0, str(NATIVE / "tests"))  # make_fixtures.py


def need(*tools):
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: {APT}")


def run(cmd, timeout=900, **kw) -> str:
    """Run cmd, assert it succeeded, return its stdout + stderr."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{out[-4000:]}"
    return out


def build(kind: str) -> Path:
    """ci_build.sh host | cross; returns the build dir."""
    run(["bash", CI, kind], timeout=1800)
    return HOST if kind == "host" else AARCH64


def qemu_env(cross_build: Path) -> dict:
    """The environment that runs an aarch64 binary of `cross_build` under qemu-aarch64-static: the
    cross toolchain's sysroot and the ExecuTorch libraries of the aarch64 wheel."""
    et_lib = REPO / "build" / "aarch64-wheel" / "unpacked" / "executorch" / "lib"
    return dict(os.environ, QEMU_LD_PREFIX="/usr/aarch64-linux-gnu", LD_LIBRARY_PATH=f"{et_lib}:{cross_build}")


def tiny_pte_fixtures(out: Path, wikitext: Path, *args: str) -> Path:
    """make_fixtures.py into out (the tiny llama .pte, its tokenizer trained on wikitext, HF's greedy tokens).
    With the default args take conftest's tiny_pte_fp32 instead: one export per test run, shared."""
    import make_fixtures as mf

    assert mf.main([str(out), "--text", str(wikitext), *args]) == 0
    return out
