"""A FAKE adb (a test double for the phone we do not have): an executable put first on PATH that records its
arguments and emulates a device's file system in a temp dir. tests/test_android_deploy.py deploys to it;
tests/test_core_device.py runs the core's aarch64 benchmark on it (the fake phone runs aarch64 ELF files
under qemu-aarch64-static, as a phone runs them natively)."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

FAKE_ADB = r'''#!PYTHON
# FAKE adb for tests (a test double for a phone): records its arguments in $FAKE_ADB_ROOT/adb.log and
# emulates a device whose file system is $FAKE_ADB_ROOT/device. `shell` runs the command line the way
# adbd does (one string, parsed by sh) with the device's absolute paths mapped into that dir, and with
# fake `pm`, `am`, `run-as` and `getprop` first on PATH. FAKE_ADB_CORRUPT=<name>: `push` of that file
# flips a byte. An aarch64 ELF file is pushed as itself (NAME.elf) and a NAME that runs it under qemu.
import json, os, shutil, subprocess, sys
root = os.environ["FAKE_ADB_ROOT"]
dev = os.path.join(root, "device")
args = sys.argv[1:]
with open(os.path.join(root, "adb.log"), "a") as f:
    f.write(json.dumps(args) + "\n")
if args == ["devices"]:
    print("List of devices attached\nFAKE0001\tdevice\n")
    sys.exit(0)
if args[:2] != ["-s", "FAKE0001"]:
    print("adb: device not found", file=sys.stderr)
    sys.exit(1)
args = args[2:]
def mapped(text):
    for p in ("/data/local/tmp", "/sdcard"):
        text = text.replace(p, dev + p)
    return text
if args[0] == "push":
    dst = mapped(args[2])
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    data = open(args[1], "rb").read()
    if os.path.basename(args[1]) == os.environ.get("FAKE_ADB_CORRUPT"):
        data = bytes([data[0] ^ 1]) + data[1:]
    if data[:4] == b"\x7fELF" and data[18:20] == b"\xb7\x00":  # e_machine EM_AARCH64
        open(dst + ".elf", "wb").write(data)
        os.chmod(dst + ".elf", 0o755)  # qemu runs only executable files; the phone's x bit is the NAME's
        data = f'#!/bin/sh\nexec qemu-aarch64-static -cpu max "{dst}.elf" "$@"\n'.encode()
    open(dst, "wb").write(data)
    print(f"{args[1]}: 1 file pushed")
    sys.exit(0)
if args[0] == "shell":
    env = dict(os.environ, PATH=os.path.join(root, "bin") + os.pathsep + os.environ["PATH"])
    sys.exit(subprocess.run(["sh", "-c", mapped(" ".join(args[1:]))], cwd=dev, env=env).returncode)
sys.exit(f"fake adb: unsupported {args}")
'''

FAKE_TOOLS = {
    "pm": '[ "$1" = path ] && [ -f "$FAKE_ADB_ROOT/installed" ] && echo "package:/data/app/$2/base.apk"; exit 0',
    "am": 'echo "$@" >> "$FAKE_ADB_ROOT/am.log"',
    "getprop": 'echo "fake-$1"',
    "run-as": 'pkg="$1"; shift\n'
              'if [ ! -f "$FAKE_ADB_ROOT/debuggable" ]; then echo "run-as: package not debuggable: $pkg" >&2; exit 1; fi\n'
              'mkdir -p "$FAKE_ADB_ROOT/device/data/data/$pkg" && cd "$FAKE_ADB_ROOT/device/data/data/$pkg" && exec "$@"',
}


@pytest.fixture()
def fake_adb(tmp_path, monkeypatch):
    """A phone with the app installed; returns its root (device/ is its file system)."""
    root = tmp_path / "phone"
    (root / "bin").mkdir(parents=True)
    (root / "device").mkdir()
    (root / "installed").touch()
    adb = root / "bin" / "adb"
    adb.write_text(FAKE_ADB.replace("PYTHON", sys.executable))
    for name, body in FAKE_TOOLS.items():
        (root / "bin" / name).write_text("#!/bin/sh\n" + body + "\n")
    for f in (root / "bin").iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_ADB_ROOT", str(root))
    monkeypatch.setenv("PATH", str(root / "bin") + os.pathsep + os.environ["PATH"])
    return root


def adb_log(root):
    return [json.loads(ln) for ln in (root / "adb.log").read_text().splitlines()] if (root / "adb.log").exists() else []
