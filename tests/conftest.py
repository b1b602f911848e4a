"""Test selection for the edit loop, and the one way tests reach data outside the repository.

`make test` runs everything (it is what CI runs). `make test-fast` runs only the tests marked `fast`
here: no cross builds, no qemu, no ExecuTorch lowering, and the compiler checked on one family
(llama) only; a few minutes on 2 cores. The choice lives in this one place instead of decorators
scattered over the files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The only data tests read from outside the repository: ../shared/data (see README).
SHARED_DATA = REPO.parent / "shared" / "data"
WIKITEXT = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"

# Whole modules that are fast: pure Python or one small native build of their own.
FAST_MODULES = {
    "test_block_pool", "test_op_reference", "test_plan", "test_simulate", "test_tokenizer", "test_op_contract",
    "test_twins", "test_model_loading", "test_fidelity", "test_engine",
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


@pytest.fixture(scope="session")
def tiny_llama_onnx_pte(tmp_path_factory, wikitext) -> Path:
    """A tiny llama with a BPE tokenizer trained on wikitext, exported to ONNX and .pte (default spec,
    a 256-token pool for 2 sequences, calls of up to 32 tokens): the save/restore and ladder tests
    share it (tests open it read-only)."""
    from export.artifacts import PoolRequest, export_artifacts
    from toolkit.tiny_models import tiny_bpe_tokenizer, tiny_model

    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:2000]
    out = tmp_path_factory.mktemp("exported") / "tiny"
    export_artifacts("tiny-llama", out, ("onnx", "pte"), "default", PoolRequest(pool_tokens=256, max_seqs=2),
                     max_tokens_per_call=32, model_and_tokenizer=(tiny_model("llama"), tiny_bpe_tokenizer(lines)))
    return out
