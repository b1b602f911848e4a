"""`export --max-logits-rows`: a .pte that computes at most R rows of logits per call (1 for a chat on a
phone). The memory planner then sizes the logits buffer for R rows instead of the call's tokens, the
greedy tokens stay HF's, and runtime_sim splits a call that needs more rows (teacher-forced eval) into
calls that each need at most R."""

import numpy as np
import pytest
from typer.testing import CliRunner

from export.artifacts import PoolRequest, export_artifacts
from runtime_sim.session import open_artifacts
from tests.helpers import hf_greedy
from toolkit.cli import app
from toolkit.tiny_models import tiny_model

PROMPT = list(range(5, 45))
CHUNK = 32
VOCAB = 8192  # [CHUNK, VOCAB] fp32 logits (1 MiB) outweigh the tiny model's other activations, as on SmolLM2


def model():
    return tiny_model("llama", num_layers=2, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The tiny llama (fp32 pool) exported twice: every row per call (the default) and one row per call."""
    out = {}
    for rows in (None, 1):
        d = tmp_path_factory.mktemp(f"rows-{rows}")
        m = export_artifacts("tiny-llama", d, ("pte",), "fp32", PoolRequest(pool_tokens=256, max_seqs=2),
                             max_tokens_per_call=CHUNK, max_logits_rows=rows, model_and_tokenizer=(model(), None))
        out[rows] = (d, m["artifacts"]["pte"])
    return out


def test_manifest_and_arena(exports):
    """The manifest names the bound; the all-rows arena holds [CHUNK, vocab] fp32 logits, the one-row arena
    does not (at this vocabulary they would be more than half of it)."""
    (_, full), (_, one) = exports[None], exports[1]
    assert full["max_logits_rows"] == CHUNK and one["max_logits_rows"] == 1
    logits = CHUNK * VOCAB * 4
    assert full["arena_bytes"][0] >= logits and one["arena_bytes"][0] < logits // 2
    assert full["arena_bytes"][1:] == one["arena_bytes"][1:]  # the pools' arenas are the same


def test_one_row_program_greedy_equals_hf(exports):
    d, _ = exports[1]
    engine = open_artifacts(d, "executorch", prefill_chunk=16)
    assert engine.backend.max_rows == 1
    got = list(engine.generate(engine.new_conversation(), PROMPT, 24))
    assert got == hf_greedy(model(), PROMPT, 24)


def test_split_call_gives_every_row(exports):
    """A call asking every row (eval) on the one-row program is split into one-token calls: the same
    rows as the all-rows program computes in one call, in the order asked, and the pool holds the same
    tokens afterwards (the next step's logits agree too)."""
    engines = {r: open_artifacts(exports[r][0], "executorch") for r in (None, 1)}
    ids = np.asarray(PROMPT[:20], np.int64)
    pos = np.arange(len(ids), dtype=np.int64)
    seq = np.zeros(len(ids), np.int64)
    table = np.full((2, 8), -1, np.int64)
    table[0, :2] = [0, 1]
    rows = np.array([19, 3, 7, 0, 7])
    out = {r: e.backend.forward(ids, pos, seq, table, rows=rows) for r, e in engines.items()}
    assert out[1].shape == out[None].shape == (len(rows), out[None].shape[1])
    np.testing.assert_allclose(out[1], out[None], rtol=1e-4, atol=1e-4)
    assert (out[1].argmax(-1) == out[None].argmax(-1)).all()
    nxt = {r: e.backend.forward(np.array([PROMPT[20]]), np.array([20]), np.array([0]), table)
           for r, e in engines.items()}
    np.testing.assert_allclose(nxt[1], nxt[None], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", ["0", "33"])
def test_bad_max_logits_rows_is_one_line_exit_2(tmp_path, rows):
    r = CliRunner().invoke(app, ["export", "tiny-llama", "--out", str(tmp_path / "x"), "--format", "pte",
                                 "--max-tokens-per-call", "32", "--max-logits-rows", rows])
    assert r.exit_code == 2, r.output
    assert f"--max-logits-rows {rows}: give 1 .. 32" in r.output
    assert not (tmp_path / "x").exists()
