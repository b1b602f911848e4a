"""`export --max-logits-rows`: a .pte that computes at most R rows of logits per call (1 for a chat on a
phone). The memory planner then sizes the logits buffer for R rows instead of the call's tokens, the
greedy tokens stay HF's, and runtime_sim splits a call that needs more rows (teacher-forced eval) into
calls that each need at most R."""

import numpy as np
import pytest
from typer.testing import CliRunner

from export.artifacts import PoolRequest, export_artifacts
from runtime_sim.backends import TorchBackend
from runtime_sim.session import open_artifacts
from toolkit.compiler import compile
from tests.helpers import export_key_offsets, hf_greedy
from toolkit.cli import app
from toolkit.tiny_models import tiny_model

PROMPT = list(range(5, 45))
CHUNK = 32
VOCAB = 8192  # [CHUNK, VOCAB] fp32 logits (1 MiB) outweigh the tiny model's other activations, as on SmolLM2


def model():
    return tiny_model("llama", num_layers=2, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def one_row(tmp_path_factory):
    """The tiny llama (fp32 pool) exported with one logits row per call: (dir, manifest)."""
    d = tmp_path_factory.mktemp("rows-1")
    m = export_artifacts("tiny-llama", d, ("pte",), "fp32", PoolRequest(pool_tokens=256, max_seqs=2),
                         max_tokens_per_call=CHUNK, max_logits_rows=1, model_and_tokenizer=(model(), None),
                         accept_fidelity=True)
    return d, m


def test_manifest_and_arena(one_row):
    """The manifest names the bound, and the activation arena is planned for one row: [CHUNK, vocab] fp32
    logits would take more than twice what it holds (an export planned for them: 1,081,408 B here)."""
    entry = one_row[1]["artifacts"]["pte"]
    assert entry["max_logits_rows"] == 1
    assert entry["arena_bytes"][0] < CHUNK * VOCAB * 4 // 2


def test_one_row_program_greedy_equals_hf(one_row):
    d, _ = one_row
    engine = open_artifacts(d, "executorch", prefill_chunk=16)
    assert engine.backend.max_rows == 1
    got = list(engine.generate(engine.new_conversation(), PROMPT, 24))
    assert got == hf_greedy(model(), PROMPT, 24)


def test_split_call_gives_every_row(one_row):
    """A call asking every row (eval) on the one-row program is split into one-token calls: the same
    rows as the PyTorch model compiled with the same pool computes in one call, in the order asked, and
    the pool holds the same tokens afterwards (the next step's logits agree too)."""
    pte = open_artifacts(one_row[0], "executorch").backend
    lay = pte.layout
    ref = TorchBackend(compile(model(), lay.spec, block_size=lay.block_size, num_blocks=lay.num_blocks,
                               max_seqs=lay.max_seqs, key_offsets=export_key_offsets(one_row[0])))
    ids = np.asarray(PROMPT[:20], np.int64)
    pos = np.arange(len(ids), dtype=np.int64)
    seq = np.zeros(len(ids), np.int64)
    table = np.full((2, 8), -1, np.int64)
    table[0, :2] = [0, 1]
    rows = np.array([19, 3, 7, 0, 7])
    got, want = (b.forward(ids, pos, seq, table, rows=rows) for b in (pte, ref))
    assert got.shape == want.shape == (len(rows), VOCAB)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    got, want = (b.forward(np.array([PROMPT[20]]), np.array([20]), np.array([0]), table) for b in (pte, ref))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", ["0", "33"])
def test_bad_max_logits_rows_is_one_line_exit_2(tmp_path, rows):
    r = CliRunner().invoke(app, ["export", "tiny-llama", "--out", str(tmp_path / "x"), "--format", "pte",
                                 "--max-tokens-per-call", "32", "--max-logits-rows", rows])
    assert r.exit_code == 2, r.output
    assert f"--max-logits-rows {rows}: give 1 .. 32" in r.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("bad", [0, "1", 1.5, True])
def test_bad_manifest_max_logits_rows_is_refused(one_row, tmp_path, bad):
    """A manifest whose max_logits_rows is not a positive integer is refused when the program is opened,
    with one line naming the field; the artifacts dir is left as it was."""
    import shutil

    from toolkit.errors import ArtifactError
    from toolkit.manifest import MANIFEST_NAME, read_manifest, write_manifest

    art = tmp_path / "art"
    shutil.copytree(one_row[0], art)
    man = read_manifest(art)
    man["artifacts"]["pte"]["max_logits_rows"] = bad
    write_manifest(art, man)
    before = (art / MANIFEST_NAME).read_bytes()
    with pytest.raises(ArtifactError, match="max_logits_rows .* is not a positive integer"):
        open_artifacts(art, "executorch")
    assert (art / MANIFEST_NAME).read_bytes() == before
