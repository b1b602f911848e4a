"""`pagedkv deploy`: argument checks, the no-device error with the real adb (Debian's adb package), and the
whole deploy against a FAKE adb: an executable on PATH that records its arguments and emulates a phone's
file system in a temp dir (a test double for the device we do not have; tests/fake_adb.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest

from tests.fake_adb import adb_log, fake_adb  # noqa: F401 (a fixture)
from toolkit.deploy import (AdbNotFound, DeployError, NoDeviceError, deploy, deploy_files, logits_rows_hint,
                            pick_device, shell_command)
from toolkit.manifest import DIGEST_NAME, MANIFEST_NAME, write_manifest
from toolkit.errors import ArtifactError, PagedKVError


def make_artifacts(path, pte=True, tokenizer=True, write_pte_file=True):
    path.mkdir(parents=True, exist_ok=True)
    pte_bytes = bytes(range(256)) * 64
    sha = hashlib.sha256(pte_bytes).hexdigest()
    arts = {"pte": {"file": "model.pte", "sha256": sha}} if pte else {"onnx": {"file": "model.onnx"}}
    tok = ["tokenizer_config.json", "tokenizer.json"] if tokenizer else []
    write_manifest(path, {"artifacts": arts, "tokenizer_files": tok})
    if write_pte_file:
        (path / "model.pte").write_bytes(pte_bytes)
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
    assert [p.name for p in deploy_files(art)] == ["pagedkv.json", "pagedkv.json.sha256", "model.pte",
                                                   "tokenizer_config.json", "tokenizer.json"]
    (art / "extra.bin").write_bytes(b"not named by the manifest")
    assert "extra.bin" not in [p.name for p in deploy_files(art)]


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


# ---- the whole deploy against a fake adb ----------------------------------------------------------

def same_files(art, model_dir):
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(["pagedkv.json", DIGEST_NAME, "model.pte", "tokenizer_config.json", "tokenizer.json"])
    for n in names:
        assert (model_dir / n).read_bytes() == (art / n).read_bytes(), n


def test_deploy_debuggable_via_run_as(tmp_path, fake_adb):
    (fake_adb / "debuggable").touch()
    art = make_artifacts(tmp_path / "a")
    res = deploy(art, adb="adb")
    model = fake_adb / "device/data/data/org.pagedkv.demo/files/model"
    same_files(art, model)
    assert res["mode"] == "run-as" and res["remote_dir"] == "/data/data/org.pagedkv.demo/files/model"
    assert (fake_adb / "am.log").read_text().split() == ["force-stop", "org.pagedkv.demo"]
    assert not (fake_adb / "device/data/local/tmp/pagedkv").exists()  # staging removed
    log = adb_log(fake_adb)
    shells = [a[3] for a in log if a[2:3] == ["shell"]]
    # force-stop before the first push; sha256 checked on .partial names before the rename
    first_push = next(i for i, a in enumerate(log) if a[2:3] == ["push"])
    assert any("force-stop" in a[3] for a in log[:first_push] if a[2:3] == ["shell"])
    i_sha = next(i for i, s in enumerate(shells) if "sha256sum" in s)
    i_mv = next(i for i, s in enumerate(shells) if "mv -f" in s)
    assert i_sha < i_mv and ".partial" in shells[i_sha]
    # deploying again replaces the files by rename (the old model.pte's inode is left to any mapping)
    old_inode = (model / "model.pte").stat().st_ino
    deploy(art, adb="adb")
    assert (model / "model.pte").stat().st_ino != old_inode
    same_files(art, model)


def test_deploy_hints_at_one_logits_row(tmp_path, fake_adb):
    """A .pte planned for a chunk's logits rows gets the advice to export one row for the phone (with the
    memory it costs when the manifest gives the vocabulary); one exported with one row gets none."""
    art = make_artifacts(tmp_path / "a")
    hint = deploy(art, adb="adb")["hint"]
    assert "--max-logits-rows 1" in hint and "up to all logits rows" in hint
    man = json.loads((art / MANIFEST_NAME).read_text())
    man["artifacts"]["pte"]["max_logits_rows"] = 64
    assert "up to 64 logits rows per call (11.8 MiB more" in logits_rows_hint({**man, "model": {"vocab_size": 49152}})
    man["artifacts"]["pte"]["max_logits_rows"] = 1
    write_manifest(art, man)
    assert deploy(art, adb="adb")["hint"] is None


def test_deploy_release_to_external_files_dir(tmp_path, fake_adb):
    art = make_artifacts(tmp_path / "a")  # no `debuggable` marker: run-as fails like on a release build
    res = deploy(art, adb="adb")
    model = fake_adb / "device/sdcard/Android/data/org.pagedkv.demo/files/model"
    same_files(art, model)
    assert res["mode"] == "external" and res["remote_dir"] == "/sdcard/Android/data/org.pagedkv.demo/files/model"
    assert not (fake_adb / "device/data/data").exists()
    pushes = [a[4] for a in adb_log(fake_adb) if a[2:3] == ["push"]]
    assert pushes and all(p.endswith(".partial") for p in pushes)


def test_deploy_sha_mismatch_on_device_renames_nothing(tmp_path, fake_adb, monkeypatch):
    art = make_artifacts(tmp_path / "a")
    deploy(art, adb="adb")
    model = fake_adb / "device/sdcard/Android/data/org.pagedkv.demo/files/model"
    before = (model / "model.pte").read_bytes()
    (art / "tokenizer.json").write_text('{"changed": 1}')  # a new export would differ; the push corrupts it
    monkeypatch.setenv("FAKE_ADB_CORRUPT", "tokenizer.json")
    with pytest.raises(DeployError, match="sha256 on the device differs for tokenizer.json"):
        deploy(art, adb="adb")
    assert (model / "model.pte").read_bytes() == before
    assert (model / "tokenizer.json").read_text() == "{}"  # the old one, untouched


def test_deploy_app_not_installed(tmp_path, fake_adb):
    (fake_adb / "installed").unlink()
    with pytest.raises(DeployError, match="org.pagedkv.demo is not installed"):
        deploy(make_artifacts(tmp_path / "a"), adb="adb")
    assert not any(a[2:3] == ["push"] for a in adb_log(fake_adb))


def test_deploy_refuses_a_pte_that_does_not_match_its_manifest(tmp_path, fake_adb):
    art = make_artifacts(tmp_path / "a")
    (art / "model.pte").write_bytes(b"edited")
    with pytest.raises(ArtifactError, match="does not match the sha256"):
        deploy(art, adb="adb")
    assert adb_log(fake_adb) == []


HOSTILE = "x; do touch pwned; done; for f in y"


def write_raw_manifest(art, manifest):
    """A manifest written by hand with a matching digest (what a hostile or broken exporter could produce)."""
    data = (json.dumps(manifest) + "\n").encode()
    (art / MANIFEST_NAME).write_bytes(data)
    (art / DIGEST_NAME).write_text(hashlib.sha256(data).hexdigest() + "  " + MANIFEST_NAME + "\n")


@pytest.mark.parametrize("bad", [HOSTILE, "$(touch pwned)", "`touch pwned`", "-rf", "../x", "a b", "x'y"])
def test_hostile_tokenizer_file_names_are_refused(tmp_path, fake_adb, bad):
    art = make_artifacts(tmp_path / "a")
    manifest = json.loads((art / MANIFEST_NAME).read_text())
    manifest["tokenizer_files"].append(bad)
    write_raw_manifest(art, manifest)
    if "/" not in bad:
        (art / bad).write_text("x")
    with pytest.raises(ArtifactError) as e:
        deploy(art, adb="adb")
    assert repr(bad)[1:-1] in str(e.value) or bad in str(e.value)
    assert adb_log(fake_adb) == []  # refused before adb is touched
    assert not list(tmp_path.rglob("pwned")) and not list(fake_adb.rglob("pwned"))


def test_shell_words_reach_the_device_shell_literally(tmp_path):
    """Defence in depth: shell_command quotes every word, so even a hostile name is one literal argument."""
    out = subprocess.run(["sh", "-c", shell_command("printf", "%s|", HOSTILE, "$(touch pwned)", "a'b")],
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out == f"{HOSTILE}|$(touch pwned)|a'b|"
    assert not (tmp_path / "pwned").exists()


# ---- the memory the app will need (`pagedkv deploy --ram`) -------------------------------------------

def artifacts_with_pool(path, num_blocks=64, arena=50_000):
    """make_artifacts with the model, pool and .pte fields a real export writes (what the estimate reads):
    a tiny llama's pool (2 layers, 2 KV heads x 64, the default spec, blocks of 16)."""
    from toolkit.kv_spec import resolve_spec
    from toolkit.pool_layout import PoolLayout

    art = make_artifacts(path)
    man = json.loads((art / MANIFEST_NAME).read_text())
    layout = PoolLayout(spec=resolve_spec("default"), num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                        num_blocks=num_blocks, max_seqs=1)
    man["model"] = {"name": "tiny", "model_type": "llama", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                    "head_dim": 64, "vocab_size": 512}
    man["pool"] = layout.to_dict()
    man["artifacts"]["pte"].update(arena_bytes=[arena, layout.total_bytes], max_logits_rows=1)
    write_manifest(art, man)
    return art, layout


def test_cli_deploy_prints_the_memory_and_refuses_a_pool_that_does_not_fit(tmp_path, fake_adb):
    from typer.testing import CliRunner

    from runtime_sim.plan import RUNTIME_BASE_BYTES, whole_process_estimate
    from toolkit.cli import app

    art, layout = artifacts_with_pool(tmp_path / "a")
    need = whole_process_estimate(art)
    pte = (art / "model.pte").stat().st_size
    assert need["total_bytes"] == pte + layout.total_bytes + 50_000 + RUNTIME_BASE_BYTES["runner"]
    block = layout.block_size * layout.bytes_per_token
    runner = CliRunner()
    # too little memory: one line naming the need and a --pool-tokens that fits, and the phone untouched
    ram = need["total_bytes"] - 20 * block - 1  # 20 blocks short, and one byte
    res = runner.invoke(app, ["deploy", str(art), "--ram", str(ram)])
    out = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "more than --ram" in out and f"--pool-tokens {(64 - 21) * 16} " in out, out
    assert adb_log(fake_adb) == [] and not (fake_adb / "am.log").exists()
    # that pool fits and one more block would not: the same artifacts exported with 43 and 44 blocks
    fits = whole_process_estimate(artifacts_with_pool(tmp_path / "b", num_blocks=43)[0])["total_bytes"]
    over = whole_process_estimate(artifacts_with_pool(tmp_path / "c", num_blocks=44)[0])["total_bytes"]
    assert fits <= ram < over
    # enough memory: the estimate is printed and the deploy goes through
    (fake_adb / "debuggable").touch()
    res = runner.invoke(app, ["deploy", str(art), "--ram", "1GiB"])
    assert res.exit_code == 0, res.output
    assert "the app will need" in res.output and "deployed 5 files" in " ".join(res.output.split())
    # the weights alone too big: no pool size helps
    res = runner.invoke(app, ["deploy", str(art), "--ram", "1000"])
    assert res.exit_code == 2 and "alone do not fit" in " ".join(res.output.split())


@pytest.mark.parametrize("field, value", [("total_bytes", "12"), ("total_bytes", 12), ("bytes_per_token", 0),
                                          ("num_blocks", 1.5), ("arena", None), ("pool", None)])
def test_cli_deploy_refuses_hostile_pool_fields(tmp_path, fake_adb, field, value):
    """A manifest edited with its digest recomputed (so only its content is wrong) gets one line, exit 2."""
    from typer.testing import CliRunner

    from toolkit.cli import app

    art, _ = artifacts_with_pool(tmp_path / "a")
    man = json.loads((art / MANIFEST_NAME).read_text())
    if field == "arena":
        del man["artifacts"]["pte"]["arena_bytes"]
    elif field == "pool":
        del man["pool"]
    else:
        man["pool"][field] = value
    write_raw_manifest(art, man)
    res = CliRunner().invoke(app, ["deploy", str(art), "--ram", "100"])
    out = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "error:" in out and "pagedkv.json" in out and "Traceback" not in out, out
    assert adb_log(fake_adb) == []
