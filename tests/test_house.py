"""The house rules a check can hold: the commit-msg hook `make hooks` installs (CONTRIBUTING.md)."""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HOOK = REPO / ".githooks" / "commit-msg"


@pytest.mark.parametrize("message,ok", [
    ("Add the model registry\n\nOne table, one fetch function.\n", True),
    ("x" * 72 + "\n", True),
    ("x" * 73 + "\n\nbody\n", False),
    ("Subject\nbody right after it\n", False),
    ("# a comment git strips\nShort subject\n\nbody\n", True),
])
def test_commit_msg_hook(tmp_path, message, ok):
    msg = tmp_path / "COMMIT_EDITMSG"
    msg.write_text(message)
    proc = subprocess.run(["sh", str(HOOK), str(msg)], capture_output=True, text=True)
    assert (proc.returncode == 0) is ok, proc.stderr
    if not ok:
        assert len(proc.stderr.strip().splitlines()) == 1


def test_make_hooks_installs_it(tmp_path):
    """`make hooks` points git at .githooks (in a scratch clone, so the developer's config is untouched)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    subprocess.run(["cp", str(REPO / "Makefile"), str(clone / "Makefile")], check=True)
    subprocess.run(["make", "-s", "-C", str(clone), "hooks"], check=True, capture_output=True)
    got = subprocess.run(["git", "-C", str(clone), "config", "core.hooksPath"], capture_output=True, text=True)
    assert got.stdout.strip() == ".githooks"
