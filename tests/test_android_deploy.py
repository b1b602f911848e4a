"""`pagedkv deploy`: argument checks, and the no-device error with the real adb (Debian's adb package)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from toolkit.manifest import write_manifest
from toolkit.deploy import AdbNotFound, NoDeviceError, deploy, deploy_files, pick_device
from toolkit.errors import ArtifactError, PagedKVError


def make_artifacts(path, pte=True, tokenizer=True, write_pte_file=True):
    path.mkdir(parents=True, exist_ok=True)
    arts = {"pte": {"file": "model.pte", "sha256": "0" * 64}} if pte else {"onnx": {"file": "model.onnx"}}
    tok = ["tokenizer_config.json", "tokenizer.json"] if tokenizer else []
    write_manifest(path, {"artifacts": arts, "tokenizer_files": tok})
    if write_pte_file:
        (path / "model.pte").write_bytes(b"\0" * 16)
    for name in tok:
        (path / name).write_text("{}")
    return path


@pytest.fixture(scope="module")
def real_adb():
    adb = shutil.which("adb")
    if adb is None:
        pytest.fail("adb is not installed: CI must install Debian's adb package (apt-get install adb)")
    yield adb
    subprocess.run([adb, "kill-server"], capture_output=True, timeout=30)  # the server `adb devices` started


def test_files_to_push(tmp_path):
    art = make_artifacts(tmp_path / "a")
    assert [p.name for p in deploy_files(art)] == ["pagedkv.json", "model.pte", "tokenizer_config.json", "tokenizer.json"]


@pytest.mark.parametrize(
    "kwargs, expect",
    [
        (dict(pte=False), "export --format pte"),
        (dict(tokenizer=False), "tokenizer.json"),
        (dict(write_pte_file=False), "missing from"),
    ],
)
def test_bad_artifacts(tmp_path, kwargs, expect):
    art = make_artifacts(tmp_path / "a", **kwargs)
    with pytest.raises(ArtifactError, match=expect):
        deploy(art, adb="pagedkv-no-such-adb")  # artifacts are checked before adb


def test_not_an_artifacts_dir(tmp_path):
    with pytest.raises(ArtifactError, match="not a directory"):
        deploy(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="pagedkv.json"):
        deploy(tmp_path / "empty")


@pytest.mark.parametrize("serial", ["", "bad serial", "x;rm -rf /"])
def test_bad_serial(tmp_path, serial):
    with pytest.raises(PagedKVError, match="serial"):
        deploy(make_artifacts(tmp_path / "a"), serial=serial)


def test_bad_package(tmp_path):
    with pytest.raises(PagedKVError, match="package"):
        deploy(make_artifacts(tmp_path / "a"), package="not a package")


def test_adb_missing(tmp_path):
    with pytest.raises(AdbNotFound, match=r"apt-get install adb\) or Android platform-tools"):
        deploy(make_artifacts(tmp_path / "a"), adb="pagedkv-no-such-adb")


def test_no_device_with_real_adb(tmp_path, real_adb):
    art = make_artifacts(tmp_path / "a")
    with pytest.raises(NoDeviceError, match="connect a phone with USB debugging on, or start an emulator; `adb devices` lists none"):
        deploy(art, adb=real_adb)
    with pytest.raises(NoDeviceError, match="'emulator-5554' is not connected"):
        deploy(art, serial="emulator-5554", adb=real_adb)


def test_pick_device_rules():
    assert pick_device({"A": "device"}, None) == "A"
    assert pick_device({"A": "device", "B": "device"}, "B") == "B"
    with pytest.raises(NoDeviceError, match="--serial"):
        pick_device({"A": "device", "B": "device"}, None)
    with pytest.raises(NoDeviceError, match="accept the USB debugging prompt"):
        pick_device({"A": "unauthorized"}, None)
    with pytest.raises(NoDeviceError, match="unauthorized"):
        pick_device({"A": "unauthorized"}, "A")


def test_cli_exit_code(tmp_path):
    """The CLI prints the error on one line and exits 2 (needs the `deploy` command in toolkit/cli.py)."""
    from typer.testing import CliRunner

    from toolkit.cli import app

    if "deploy" not in [c.name or c.callback.__name__ for c in app.registered_commands]:
        pytest.fail("toolkit/cli.py has no `deploy` command yet: add it (see toolkit/deploy.py's docstring)")
    res = CliRunner().invoke(app, ["deploy", str(tmp_path / "nope")])
    assert res.exit_code == 2
    assert "not a directory" in " ".join(res.output.split())
