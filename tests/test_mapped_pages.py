"""The runner's mapped-page release (android_demo/native/src/mapped_pages.h, issue 23) on a real file:
mapped_pages_test.cpp maps a 4 MiB file read-only and a writable private copy of it, and checks that
release() unmaps exactly the read-only mapping's pages (smaps Rss 0), the data reads back the same, the
written private page is left alone, and PAGEDKV_KEEP_MAPPED_PAGES=1 turns it off; that later calls reuse
the ranges prepare() found without reading /proc/self/maps again, and read it again when a range changed: an
anonymous mapping holding data in a released range's place is never advised (its data intact), the file
mapped again elsewhere is found. Linux only (madvise, /proc/self/smaps, /proc/self/map_files), like the
runner."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[1] / "android_demo" / "native"


def test_release_unmaps_only_read_only_pages_of_the_file(tmp_path):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.fail("g++ not installed: apt-get install -y g++")
    exe = tmp_path / "mapped_pages_test"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", str(NATIVE / "src"),
                    str(NATIVE / "tests" / "mapped_pages_test.cpp"), str(NATIVE / "src" / "mapped_pages.cpp"),
                    "-o", str(exe)], check=True, capture_output=True)
    p = subprocess.run([str(exe), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "mapped_pages_test: ok" in p.stdout
