"""Test selection for the edit loop, and the one way tests reach data outside the repository.

`make test` runs everything (it is what CI runs). `make test-fast` runs only the tests marked `fast`
here: no cross builds, no qemu, no ExecuTorch lowering, and the compiler checked on one family
(llama) only; a few minutes on 2 cores. The choice lives in this one place instead of decorators
scattered over the files.

Exports of tiny random-weight models pass accept_fidelity=True: such a model is no test of a KV spec's
fidelity (every spec's KLD is 10-100x a real model's), so the export guard would refuse the low-bit
specs their pool mechanics are tested with; the guard itself is tested in test_calibration.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The only data tests read from outside the repository: ../shared/data (see README).
SHARED_DATA = REPO.parent / "shared" / "data"
WIKITEXT = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"

# Whole modules that are fast: pure Python or one small native build of their own.
FAST_MODULES = {
    "test_block_pool", "test_op_reference", "test_plan", "test_simulate", "test_tokenizer", "test_op_contract",
    "test_twins", "test_model_loading", "test_fidelity", "test_engine", "test_eval_speed", "test_house",
    "test_imports",
}
# In these modules, the tests whose node id contains one of the strings are fast.
FAST_TESTS = {
    "test_compiler": ("[llama]", "preflight", "rejects_bad_spec", "model_dims"),
}


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: part of `make test-fast` (the edit loop); see tests/conftest.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in FAST_MODULES or any(s in item.nodeid for s in FAST_TESTS.get(module, ())):
            item.add_marker(pytest.mark.fast)


def wikitext_path() -> Path:
    """wikitext-2's test split from ../shared/data (a clear failure if the checkout has no shared/). For
    helpers that are not fixtures (`from tests.conftest import wikitext_path`); tests take the fixture."""
    if not WIKITEXT.is_file():
        pytest.fail(f"{WIKITEXT} is missing: the tests read wikitext-2 from ../shared/data beside the checkout.")
    return WIKITEXT


@pytest.fixture(scope="session")
def wikitext() -> Path:
    """wikitext-2's test split (wikitext_path)."""
    return wikitext_path()


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(d)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def made_once(tmp_path_factory, key: str, make) -> Path:
    """make(dir) run once per test run for `key` by whichever module asks first, in whichever pytest-xdist
    worker (`make test` runs 2): the others wait on a lock and get the same dir, so identical tiny exports
    are not repeated module after module. The dir is shared read-only: each hand-out checks that its files
    still have the digest they had when made (a test that changed one fails the next that asks; see also
    check_unchanged); after a failed make the next asker makes it afresh."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's dir, above each worker's own basetemp
    root = base / "made-once"
    root.mkdir(exist_ok=True)
    out, stamp = root / key, root / f"{key}.sha256"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            if out.exists():
                import shutil

                shutil.rmtree(out)
            out.mkdir()
            make(out)
            stamp.write_text(_digest(out))
        check_unchanged(out)
    return out


def check_unchanged(out: Path) -> None:
    """Fails when a made_once dir's files differ from what make() wrote (a test wrote into a shared dir)."""
    want = (out.parent / f"{out.name}.sha256").read_text()
    assert _digest(out) == want, f"{out}: a test changed this shared fixture; copy it before changing files"


@pytest.fixture(scope="session")
def tiny_llama_onnx_pte(tmp_path_factory, wikitext) -> Path:
    """A tiny llama with a BPE tokenizer trained on wikitext, exported to ONNX and .pte (default spec,
    a 256-token pool for 2 sequences, calls of up to 32 tokens): the save/restore and ladder tests
    share it (made_once: one export per test run; tests open it read-only)."""

    def make(d: Path):
        from export.artifacts import PoolRequest, export_artifacts
        from toolkit.tiny_models import tiny_bpe_tokenizer, tiny_model

        lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:2000]
        export_artifacts("tiny-llama", d / "tiny", ("onnx", "pte"), "default", PoolRequest(pool_tokens=256, max_seqs=2),
                         max_tokens_per_call=32, model_and_tokenizer=(tiny_model("llama"), tiny_bpe_tokenizer(lines)),
                         accept_fidelity=True)

    out = made_once(tmp_path_factory, "tiny-llama-onnx-pte", make)
    yield out / "tiny"
    check_unchanged(out)


@pytest.fixture(scope="session")
def tiny_pte_fp32(tmp_path_factory, wikitext) -> Path:
    """android_demo/native/tests/make_fixtures.py with its defaults (the tiny llama .pte with an fp32 pool of
    512 tokens for 2 sequences, its tokenizer, HF's greedy tokens in expected.json): the runner CLI, native
    and app tests share it (made_once; tests open it read-only). Returns make_fixtures' OUT_DIR."""
    from tests.native_build import tiny_pte_fixtures

    out = made_once(tmp_path_factory, "make-fixtures-fp32", lambda d: tiny_pte_fixtures(d, wikitext))
    yield out
    check_unchanged(out)
