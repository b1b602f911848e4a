"""benchmarks/core_device.py: the kernel core's static benchmark, cross-built for aarch64 and run on a FAKE
phone (tests/fake_adb.py: a test double for the device we do not have, running the aarch64 binaries under
qemu-aarch64-static), and built for x86-64 and run on this machine. Checks what the script does, not how
fast NEON is (qemu cannot say)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tests.fake_adb import adb_log, fake_adb  # noqa: F401 (a fixture)
from tests.native_build import REPO, need

SCRIPT = REPO / "benchmarks" / "core_device.py"


def core_device(*args, timeout=1800):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def cross_built():
    need("aarch64-linux-gnu-g++", "qemu-aarch64-static", "cmake")
    proc = core_device("--build")
    assert proc.returncode == 0, proc.stderr
    return REPO / "build" / "aarch64-bench"


def test_on_a_phone_over_adb(cross_built, fake_adb, tmp_path):
    out = tmp_path / "core_device.json"
    proc = core_device("--adb", "--ctx", 256, "--dims", "9/3/64", "--threads", 1, 2, "--reps", 2, "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["where"] == "adb" and res["cpu"].startswith("fake-ro.product.model")
    assert res["core_test"][-1] == "all pagedkv core tests passed"  # the core's own tests ran on the "phone"
    assert res["paths"] == ["scalar", "neon", "neon-dotprod"]  # qemu -cpu max has dotprod
    rows = res["rows"]
    assert [(r["path"], r["threads"]) for r in rows] == [(p, t) for t in (1, 2) for p in res["paths"]]
    for r in rows:
        assert r["dims"] == "9/3/64" and r["ctx"] == 256 and r["bytes"] > 0
        assert r["ms"] > 0 and r["floor_ms"] > 0 and r["floor_over_step"] == pytest.approx(r["floor_ms"] / r["ms"])
    assert "| neon-dotprod | 9/3/64 | 256 | 2 |" in proc.stdout
    log = adb_log(fake_adb)
    pushed = [a[3:] for a in log if a[2:3] == ["push"]]
    assert pushed == [[str(cross_built / n), f"/data/local/tmp/pagedkv-core-bench/{n}"]
                      for n in ("pagedkv_core_bench", "pagedkv_core_test")]
    walks = [a for a in log if a[2:3] == ["shell"] and "BENCH_WALK=1" in a[3]]
    assert len(walks) == 2  # one memory floor per (dims, ctx, threads) cell


def test_on_this_machine(tmp_path):
    if platform.machine() != "x86_64":
        pytest.skip(f"the local mode is checked on x86-64 (this is {platform.machine()})")
    need("g++", "cmake")
    proc = core_device("--build", "--arch", "x86_64")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "local.json"
    proc = core_device("--ctx", 256, "--dims", "9/3/64", "--threads", 1, 2, "--reps", 2, "--paths", "avx2", "scalar",
                       "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["where"] == "local" and "avx2" in res["cpu"] and "scalar" in res["paths"]
    assert res["core_test"][-1] == "all pagedkv core tests passed"
    assert [(r["path"], r["threads"]) for r in res["rows"]] == [("avx2", 1), ("scalar", 1), ("avx2", 2), ("scalar", 2)]
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 and r["bytes"] > 0 for r in res["rows"])


def test_refusals_are_one_line(cross_built, fake_adb):
    for args, words in [(["--adb", "--serial", "NOPE"], "device 'NOPE' is not connected"),
                        (["--adb", "--dims", "9/2/64"], "Hq a multiple of Hkv"),
                        (["--adb", "--threads", "0"], "must be positive"),
                        (["--build", "--arch", "riscv64"], "use aarch64 or x86_64"),
                        (["--adb", "--ctx", 256, "--dims", "9/3/64", "--threads", 1, "--reps", 1, "--paths", "sve"],
                         "--paths sve: not on this CPU, which has scalar neon neon-dotprod")]:
        proc = core_device(*args, timeout=300)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            (args, proc.stderr)
