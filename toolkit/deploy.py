"""`pagedkv deploy ARTIFACTS [--serial S]`: push an exported artifacts dir to the Android demo app.

Copies model.pte, pagedkv.json and the tokenizer files to the app's files directory
(`/data/data/org.pagedkv.demo/files/model/`) with the real `adb`: the files go to
/data/local/tmp/pagedkv/ first, then `adb shell run-as <package>` copies them into the app's private
directory (run-as works for debuggable builds, which is what Android Studio installs).

    deploy("artifacts/smollm2-pte")                  # the only connected device
    deploy("artifacts/smollm2-pte", serial="emulator-5554")
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from toolkit.manifest import MANIFEST_NAME, read_manifest
from toolkit.errors import ArtifactError, PagedKVError

DEFAULT_PACKAGE = "org.pagedkv.demo"
REMOTE_STAGING = "/data/local/tmp/pagedkv"
APP_MODEL_DIR = "files/model"  # relative to the app's data dir (Context.getFilesDir()/model)
ADB_TIMEOUT_S = 60


class AdbNotFound(PagedKVError):
    """The adb executable is not installed or not on PATH."""


class NoDeviceError(PagedKVError):
    """adb lists no usable device (or not the one asked for)."""


class DeployError(PagedKVError):
    """An adb step failed."""


def deploy_files(artifacts_dir: str | Path) -> list[Path]:
    """The files to push: pagedkv.json, the .pte, the tokenizer files. Raises ArtifactError if any is missing."""
    art = Path(artifacts_dir)
    if not art.is_dir():
        raise ArtifactError(f"{art} is not a directory: pass the artifacts dir made by `pagedkv export --format pte`.")
    manifest = read_manifest(art)
    entry = manifest.get("artifacts", {}).get("pte")
    if entry is None:
        have = ", ".join(manifest.get("artifacts", {})) or "none"
        raise ArtifactError(
            f"{art} has no .pte (it has: {have}): the phone runs ExecuTorch; export with `pagedkv export --format pte`."
        )
    files = [art / MANIFEST_NAME, art / entry["file"]]
    tok = list(manifest.get("tokenizer_files") or [])
    if "tokenizer.json" not in tok:
        raise ArtifactError(
            f"{art} has no tokenizer.json in its manifest: the phone's runner needs the HF tokenizer.json; re-export."
        )
    files += [art / name for name in tok]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise ArtifactError(f"missing from {art}: {', '.join(missing)}. Re-run `pagedkv export --format pte`.")
    return files


def find_adb(adb: str = "adb") -> str:
    path = shutil.which(adb)
    if path is None:
        raise AdbNotFound(
            f"adb not found ('{adb}'): install Debian's adb package (apt-get install adb) or Android "
            "platform-tools, and make sure it is on PATH."
        )
    return path


def _run(cmd: list[str], what: str) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ADB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DeployError(f"`{' '.join(cmd)}` did not finish in {ADB_TIMEOUT_S}s while {what}: check the USB connection.") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DeployError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}) while {what}: {' | '.join(tail)}")
    return proc.stdout


def list_devices(adb_path: str) -> dict[str, str]:
    """serial -> state ('device', 'unauthorized', 'offline', ...) from `adb devices`."""
    out = _run([adb_path, "devices"], "listing devices")
    devices = {}
    for line in out.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2:
            devices[parts[0]] = parts[1]
    return devices


def pick_device(devices: dict[str, str], serial: str | None) -> str:
    ready = [s for s, state in devices.items() if state == "device"]
    if serial is not None:
        if serial not in devices:
            listed = ", ".join(f"{s} ({st})" for s, st in devices.items()) or "none"
            raise NoDeviceError(f"device '{serial}' is not connected; `adb devices` lists: {listed}.")
        if devices[serial] != "device":
            raise NoDeviceError(
                f"device '{serial}' is {devices[serial]}: unlock the phone and accept the USB debugging prompt."
            )
        return serial
    if not ready:
        if devices:
            states = ", ".join(f"{s} ({st})" for s, st in devices.items())
            raise NoDeviceError(
                f"no ready device ({states}): unlock the phone and accept the USB debugging prompt, then retry."
            )
        raise NoDeviceError(
            "no Android device: connect a phone with USB debugging on, or start an emulator; `adb devices` lists none."
        )
    if len(ready) > 1:
        raise NoDeviceError(f"several devices are connected ({', '.join(ready)}): choose one with --serial.")
    return ready[0]


def deploy(artifacts_dir: str | Path, serial: str | None = None, adb: str = "adb",
           package: str = DEFAULT_PACKAGE, progress=None) -> dict:
    """Push the artifacts to the app. Returns {"serial", "remote_dir", "files", "bytes"}."""
    if serial is not None and (not serial or not re.fullmatch(r"[\w.:\-]+", serial)):
        raise PagedKVError(f"--serial {serial!r} is not a device serial: copy one from `adb devices`.")
    if not re.fullmatch(r"[A-Za-z][\w]*(\.[A-Za-z][\w]*)+", package):
        raise PagedKVError(f"package {package!r} is not an Android package name (like org.pagedkv.demo).")
    files = deploy_files(artifacts_dir)  # check the artifacts before touching adb
    adb_path = find_adb(adb)
    target = pick_device(list_devices(adb_path), serial)
    base = [adb_path, "-s", target]
    say = progress or (lambda msg: None)

    _run(base + ["shell", "mkdir", "-p", REMOTE_STAGING], "creating the staging dir")
    total = 0
    for f in files:
        say(f"pushing {f.name} ({f.stat().st_size / 2**20:.1f} MiB)")
        _run(base + ["push", str(f), f"{REMOTE_STAGING}/{f.name}"], f"pushing {f.name}")
        total += f.stat().st_size
    names = " ".join(f.name for f in files)
    copy = (f"mkdir -p {APP_MODEL_DIR} && for f in {names}; do cp {REMOTE_STAGING}/$f {APP_MODEL_DIR}/$f || exit 1; done")
    try:
        _run(base + ["shell", "run-as", package, "sh", "-c", f"'{copy}'"], "copying into the app's files dir")
    except DeployError as e:
        raise DeployError(
            f"{e}. Is {package} installed as a debuggable build (Android Studio's Run installs one)? "
            f"The files are in {REMOTE_STAGING} on the device."
        ) from None
    _run(base + ["shell", "rm", "-rf", REMOTE_STAGING], "removing the staging dir")
    return {"serial": target, "remote_dir": f"/data/data/{package}/{APP_MODEL_DIR}",
            "files": [f.name for f in files], "bytes": total}
