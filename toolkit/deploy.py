"""`pagedkv deploy ARTIFACTS [--serial S]`: push an exported artifacts dir to the Android demo app.

Pushes exactly the files the manifest names (pagedkv.json and its .sha256, the .pte, the tokenizer
files) with the real `adb`, in this order:

1. checks every name (a plain file name: letters, digits, '.', '_', '+', '-'; nothing else reaches
   a device shell) and the .pte's sha256 against the manifest, before touching adb;
2. `am force-stop` the app, so no running runner has the old model.pte mapped while it is replaced;
3. finds where the app reads its model: a debuggable install (Android Studio's Run) gets
   `files/model/` in its private dir through `run-as`; a release install reads its external files
   dir, `/sdcard/Android/data/<package>/files/model/`, which adb can write directly;
4. pushes each file to a temporary name (`<name>.partial`; debuggable: via /data/local/tmp first),
   checks its sha256 on the device (`sha256sum`) against the local file, and only then renames all
   of them into place, so an interrupted deploy never leaves a half-written model.pte under its
   real name.

Device shell commands are fixed scripts; the file names reach them as positional arguments ("$@"),
each quoted for the device shell, never spliced into the script text.

    deploy("artifacts/smollm2-pte")                  # the only connected device
    deploy("artifacts/smollm2-pte", serial="emulator-5554")
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

from toolkit.errors import ArtifactError, PagedKVError
from toolkit.manifest import DIGEST_NAME, MANIFEST_NAME, artifact_path, read_manifest, sha256_file

DEFAULT_PACKAGE = "org.pagedkv.demo"
REMOTE_STAGING = "/data/local/tmp/pagedkv"  # debuggable installs: adb pushes here, run-as copies on
EXTERNAL_ROOT = "/sdcard/Android/data"      # release installs: <root>/<package>/files/model
APP_MODEL_DIR = "files/model"  # relative to the app's data dir (Context.getFilesDir()/model)
PARTIAL = ".partial"
ADB_TIMEOUT_S = 60
PUSH_TIMEOUT_S = 1800  # a 500 MB .pte over USB 2
# What a file name may look like on its way to a device shell (stricter than the manifest's own rule).
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")

# Run as the app (cwd = its data dir): copy the staged files ($1 = staging dir) to <name>.partial.
_COPY_IN = 'src="$1"; shift; mkdir -p files/model && for f in "$@"; do cp "$src/$f" "files/model/$f.partial" || exit 1; done'
# Rename every <dir>/<name>.partial ($1 = dir) to <dir>/<name>.
_RENAME = 'dir="$1"; shift; for f in "$@"; do mv -f "$dir/$f.partial" "$dir/$f" || exit 1; done'


class AdbNotFound(PagedKVError):
    """The adb executable is not installed or not on PATH."""


class NoDeviceError(PagedKVError):
    """adb lists no usable device (or not the one asked for)."""


class DeployError(PagedKVError):
    """An adb step failed."""


def _safe_name(name: str, art: Path) -> str:
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
        raise ArtifactError(
            f"the manifest of {art} names the file {name!r}: deploy pushes only plain names of letters, digits and "
            "'._+-' (the device shell sees them); re-run `pagedkv export`."
        )
    return name


def deploy_files(artifacts_dir: str | Path) -> list[Path]:
    """The files to push, in order: pagedkv.json, its .sha256, the .pte, the tokenizer files. Only files the
    manifest names, each a plain name inside the dir. Raises ArtifactError if any is missing or odd."""
    return _checked_files(artifacts_dir)[1]


def _checked_files(artifacts_dir: str | Path) -> tuple[dict, list[Path]]:
    """(the manifest, deploy_files' list), the manifest read once."""
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
    tok = list(manifest.get("tokenizer_files") or [])
    if "tokenizer.json" not in tok:
        raise ArtifactError(
            f"{art} has no tokenizer.json in its manifest: the phone's runner needs the HF tokenizer.json; re-export."
        )
    names = [MANIFEST_NAME, DIGEST_NAME, entry["file"]] + [n for n in tok if n != entry["file"]]
    names = list(dict.fromkeys(names))  # once each, in order
    files = [artifact_path(art, _safe_name(n, art)) for n in names]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise ArtifactError(f"missing from {art}: {', '.join(missing)}. Re-run `pagedkv export --format pte`.")
    want = entry.get("sha256")
    if want and sha256_file(art / entry["file"]) != want:
        raise ArtifactError(f"{art / entry['file']} does not match the sha256 in its manifest (changed after "
                            "export?): re-run `pagedkv export --format pte`.")
    return manifest, files


def logits_rows_hint(manifest: dict) -> str | None:
    """The phone's runner reads one logits row per call (the last token's). A .pte exported for more
    rows plans a [rows, vocab] logits buffer in its activation arena: say how to drop it, or None."""
    entry = manifest.get("artifacts", {}).get("pte", {})
    rows = entry.get("max_logits_rows", entry.get("max_tokens_per_call"))
    if rows == 1:
        return None
    vocab = manifest.get("model", {}).get("vocab_size")
    size = (f" ({(rows - 1) * vocab * 4 / 2**20:.1f} MiB more activation memory than one row)"
            if type(rows) is int and type(vocab) is int else "")
    return (f"this .pte computes up to {rows if type(rows) is int else 'all'} logits rows per call{size}, the "
            "phone's runner reads one: `pagedkv export --format pte --max-logits-rows 1` makes the phone's artifact")


def find_adb(adb: str = "adb") -> str:
    path = shutil.which(adb)
    if path is None:
        raise AdbNotFound(
            f"adb not found ('{adb}'): install Debian's adb package (apt-get install adb) or Android "
            "platform-tools, and make sure it is on PATH."
        )
    return path


def _run(cmd: list[str], what: str, timeout: int = ADB_TIMEOUT_S) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DeployError(f"`{' '.join(cmd)}` did not finish in {timeout}s while {what}: check the USB connection.") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DeployError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}) while {what}: {' | '.join(tail)}")
    return proc.stdout


def shell_command(*words: str) -> str:
    """One `adb shell` command line: adb joins its arguments with spaces and the device's shell parses
    the result, so every word is quoted for that shell here."""
    return " ".join(shlex.quote(w) for w in words)


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


def _device_sha256(base: list[str], paths: list[str], run_as: str | None, what: str) -> list[str | None]:
    """The sha256 of each path on the device (as the app when run_as is given), in order (sha256sum
    prints one line per argument, in argument order); None where it printed none."""
    prefix = ("run-as", run_as) if run_as else ()
    proc = subprocess.run(base + ["shell", shell_command(*prefix, "sha256sum", "--", *paths)], capture_output=True,
                          text=True, timeout=PUSH_TIMEOUT_S)
    sums = [ln.split(None, 1)[0] for ln in proc.stdout.splitlines() if re.match(r"[0-9a-f]{64}\s", ln)]
    if len(sums) != len(paths):  # a file missing on the device: which one is not known, so none counts
        return [None] * len(paths)
    return sums


def deploy(artifacts_dir: str | Path, serial: str | None = None, adb: str = "adb",
           package: str = DEFAULT_PACKAGE, progress=None) -> dict:
    """Push the artifacts to the app. Returns {"serial", "mode", "remote_dir", "files", "bytes", "hint"}
    (hint: logits_rows_hint's advice, or None)."""
    if serial is not None and (not serial or not re.fullmatch(r"[\w.:\-]+", serial)):
        raise PagedKVError(f"--serial {serial!r} is not a device serial: copy one from `adb devices`.")
    if not re.fullmatch(r"[A-Za-z][\w]*(\.[A-Za-z][\w]*)+", package):
        raise PagedKVError(f"package {package!r} is not an Android package name (like org.pagedkv.demo).")
    manifest, files = _checked_files(artifacts_dir)  # check the artifacts before touching adb
    local_sha = {f.name: sha256_file(f) for f in files}
    names = [f.name for f in files]
    adb_path = find_adb(adb)
    target = pick_device(list_devices(adb_path), serial)
    base = [adb_path, "-s", target]
    say = progress or (lambda msg: None)

    installed = _run(base + ["shell", shell_command("pm", "path", package)], "looking for the app")
    if "package:" not in installed:
        raise DeployError(f"{package} is not installed on {target}: install the app first (Android Studio's Run, or "
                          "`./gradlew installDebug` in android_demo/), then deploy.")
    _run(base + ["shell", shell_command("am", "force-stop", package)], "stopping the app")
    probe = subprocess.run(base + ["shell", shell_command("run-as", package, "true")], capture_output=True,
                           text=True, timeout=ADB_TIMEOUT_S)
    debuggable = probe.returncode == 0
    total = sum(f.stat().st_size for f in files)

    if debuggable:  # private files dir through run-as (paths relative to the app's data dir)
        mode, remote_dir = "run-as", APP_MODEL_DIR
        _run(base + ["shell", shell_command("mkdir", "-p", REMOTE_STAGING)], "creating the staging dir")
        for f in files:
            say(f"pushing {f.name} ({f.stat().st_size / 2**20:.1f} MiB)")
            _run(base + ["push", str(f), f"{REMOTE_STAGING}/{f.name}"], f"pushing {f.name}", PUSH_TIMEOUT_S)
        try:
            _run(base + ["shell", shell_command("run-as", package, "sh", "-c", _COPY_IN, "pagedkv-deploy",
                                                REMOTE_STAGING, *names)],
                 "copying into the app's files dir", PUSH_TIMEOUT_S)
        except DeployError as e:
            raise DeployError(f"{e}. The files are in {REMOTE_STAGING} on the device.") from None
        run_as = package
    else:  # a release install reads its external files dir, which adb writes directly
        mode, remote_dir = "external", f"{EXTERNAL_ROOT}/{package}/{APP_MODEL_DIR}"
        _run(base + ["shell", shell_command("mkdir", "-p", remote_dir)], "creating the app's external model dir")
        for f in files:
            say(f"pushing {f.name} ({f.stat().st_size / 2**20:.1f} MiB)")
            _run(base + ["push", str(f), f"{remote_dir}/{f.name}{PARTIAL}"], f"pushing {f.name}", PUSH_TIMEOUT_S)
        run_as = None

    say("checking sha256 on the device")
    partials = [f"{remote_dir}/{n}{PARTIAL}" for n in names]
    sums = _device_sha256(base, partials, run_as, "checking sha256 on the device")
    bad = [n for n, got in zip(names, sums) if got != local_sha[n]]
    if bad:
        raise DeployError(f"sha256 on the device differs for {', '.join(bad)} (a transfer error or a full disk?): "
                          f"nothing was renamed; the model in {remote_dir} is unchanged. Run deploy again.")
    prefix = ("run-as", package) if run_as else ()
    _run(base + ["shell", shell_command(*prefix, "sh", "-c", _RENAME, "pagedkv-deploy", remote_dir, *names)],
         "renaming the files into place")
    if debuggable:
        _run(base + ["shell", shell_command("rm", "-rf", REMOTE_STAGING)], "removing the staging dir")
    app_dir = f"/data/data/{package}/{APP_MODEL_DIR}" if debuggable else remote_dir
    return {"serial": target, "mode": mode, "remote_dir": app_dir, "files": names, "bytes": total,
            "hint": logits_rows_hint(manifest)}
