"""Exported artifacts (.onnx and .pte) of tiny models, run through every backend, against HF and
the PyTorch reference op."""

import json

import numpy as np
import pytest

from export.artifacts import PoolRequest, export_artifacts
from runtime_sim.backends import TorchBackend
from runtime_sim.engine import Engine
from runtime_sim.session import open_artifacts
from toolkit.compiler import compile
from toolkit.tiny_models import tiny_model
from tests.helpers import export_key_offsets, hf_greedy

FAMILIES = ["llama", "qwen3", "gemma3"]
BACKENDS = [("onnxruntime", False), ("onnxruntime", True), ("executorch", None)]
BACKEND_IDS = ["ort-fallback", "ort-native", "executorch"]
PROMPT = list(range(5, 42))



def _export(tmp_path_factory, family, spec, num_layers):
    out = tmp_path_factory.mktemp(f"{family}-{spec}-{num_layers}")
    export_artifacts(
        f"tiny-{family}", out, ("onnx", "pte"), spec, PoolRequest(pool_tokens=256, max_seqs=2),
        max_tokens_per_call=32, model_and_tokenizer=(tiny_model(family, num_layers=num_layers), None),
        accept_fidelity=True,
    )
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def fp32_artifacts(request, tmp_path_factory):
    return request.param, _export(tmp_path_factory, request.param, "fp32", 2)


@pytest.fixture(scope="module", params=FAMILIES)
def quant_artifacts(request, tmp_path_factory):
    return request.param, _export(tmp_path_factory, request.param, "default", 1)


@pytest.mark.parametrize("backend,native", BACKENDS, ids=BACKEND_IDS)
def test_fp32_pool_greedy_equals_hf(fp32_artifacts, backend, native):
    family, art = fp32_artifacts
    engine = open_artifacts(art, backend, native=native, prefill_chunk=16)
    if backend == "onnxruntime":
        assert engine.backend.native is bool(native)
    conv = engine.new_conversation()
    got = list(engine.generate(conv, PROMPT, 32))
    assert got == hf_greedy(tiny_model(family), PROMPT, 32)


def _copy_pools(dst, src) -> None:
    """Overwrite backend dst's pools with backend src's (numpy views of both)."""
    for d, s in zip(dst.pool_arrays(), src.pool_arrays()):
        for x, y in zip(d, s):
            x[...] = y


@pytest.mark.parametrize("backend,native", BACKENDS, ids=BACKEND_IDS)
def test_default_spec_logits_match_reference_op(quant_artifacts, backend, native):
    family, art = quant_artifacts
    engine = open_artifacts(art, backend, native=native, prefill_chunk=16)
    lay = engine.backend.layout
    sliding = [g.num_blocks for g in engine.groups if g.window]  # the export sized its sliding pools
    ref = Engine(TorchBackend(compile(tiny_model(family, num_layers=1), lay.spec, block_size=lay.block_size,
                                      num_blocks=lay.num_blocks, max_seqs=lay.max_seqs,
                                      sliding_blocks=max(sliding, default=None),
                                      key_offsets=export_key_offsets(art))), prefill_chunk=16)
    a, b = engine.new_conversation(), ref.new_conversation()
    # prefill chunks, then decode steps: quantized blocks, the float tail and the sink all in play.
    # Before each call the reference continues from the backend's pool: the backends' matmuls round
    # K/V differently from torch's (~1e-7), which can flip a quantization code; a flip written in an
    # earlier call would then stay in one pool and not the other. Synced, each call compares the op on
    # the same cached state (the call's own new K/V still come from each side's own graph).
    calls = [PROMPT[i:i + 16] for i in range(0, len(PROMPT), 16)] + [[t] for t in range(100, 120)]
    diffs = []
    for n, toks in enumerate(calls):
        if n:
            _copy_pools(ref.backend, engine.backend)
        la = engine._run([(engine.conversations[a], toks)])[0]
        lb = ref._run([(ref.conversations[b], toks)])[0]
        diffs.append(float(np.abs(la - lb).max()))
    assert max(diffs) < 1e-4, f"{family} {backend}: per-call max |dlogit| {diffs}"


@pytest.mark.parametrize("backend,native", BACKENDS, ids=BACKEND_IDS)
def test_logits_of_chosen_rows_equal_those_rows_of_all(fp32_artifacts, backend, native):
    """backend.forward(rows=...) gives those rows of the all-rows logits (the ONNX graph computes only
    them: its logits_rows input), on a fresh pool each, for a prefill call of two sequences."""
    family, art = fp32_artifacts
    if backend == "onnxruntime":
        manifest = json.loads((art / "pagedkv.json").read_text())
        assert manifest["artifacts"]["onnx"]["inputs"][-1] == "logits_rows"
    got = []
    for rows in (None, np.array([4, 0, 11])):
        engine = open_artifacts(art, backend, native=native)
        ids = np.array(PROMPT[:12], np.int64)
        pos = np.array(list(range(7)) + list(range(5)), np.int64)
        seq = np.array([0] * 7 + [1] * 5, np.int64)
        table = np.full((engine.backend.layout.max_seqs, 2), -1, np.int64)
        table[0, 0], table[1, 0] = 0, 1
        tables = [table] * len(engine.groups) if engine.groups else table
        got.append(engine.backend.forward(ids, pos, seq, tables, rows=rows))
    assert got[0].shape[0] == 12 and got[1].shape[0] == 3
    np.testing.assert_allclose(got[1], got[0][[4, 0, 11]], rtol=0, atol=1e-4)
    assert (got[1].argmax(-1) == got[0][[4, 0, 11]].argmax(-1)).all()


@pytest.mark.parametrize("backend,native", BACKENDS, ids=BACKEND_IDS)
def test_fork_copies_on_write_on_every_backend(fp32_artifacts, backend, native):
    family, art = fp32_artifacts
    engine = open_artifacts(art, backend, native=native, prefill_chunk=16)
    c = engine.new_conversation()
    list(engine.generate(c, PROMPT, 3))  # 39 tokens cached + 1 pending: the last block is partial
    f = engine.fork(c)
    used = engine.stats()["used_blocks"]
    forked = list(engine.generate(f, [7, 8], 6))
    assert engine.stats()["used_blocks"] == used + 1  # the partial block was copied, full ones shared
    assert list(engine.generate(c, [7, 8], 6)) == forked
    engine.pool.check_invariants()


@pytest.mark.parametrize("backend", ["onnxruntime", "executorch"])
def test_runtime_threads_reach_the_kernel(fp32_artifacts, backend):
    """The kernels run on the runtime's threads (the session's intra-op pool, ExecuTorch's threadpool):
    the backend's thread count is theirs, and one copy of the library is loaded.
    tests/test_native_kernels.py::test_hosts_run_the_op_on_their_threads checks the threads a call used."""
    from toolkit import native as native_lib

    family, art = fp32_artifacts
    want = hf_greedy(tiny_model(family), PROMPT, 4)
    if backend == "executorch":
        from executorch.extension.pybindings import portable_lib

        before = portable_lib._threadpool_get_thread_count()
    try:
        for n in (1, 2):
            engine = open_artifacts(art, backend, native=True if backend == "onnxruntime" else None, threads=n,
                                    prefill_chunk=16)
            assert engine.backend.kernel_threads == n
            assert list(engine.generate(engine.new_conversation(), PROMPT, 4)) == want
        lib = native_lib.ort_library_path() if backend == "onnxruntime" else native_lib.et_library_path()
        maps = [ln for ln in open("/proc/self/maps") if ln.rstrip().endswith(lib)]
        assert sum(ln.split()[2] == "00000000" for ln in maps) == 1, maps  # one copy of the library
    finally:
        if backend == "executorch":
            portable_lib._unsafe_reset_threadpool(before)


def test_manifest_describes_pool_and_artifacts(fp32_artifacts):
    _, art = fp32_artifacts
    m = json.loads((art / "pagedkv.json").read_text())
    assert set(m["artifacts"]) == {"onnx", "pte"}
    pool = m["pool"]
    assert pool["num_blocks"] == 16 and pool["block_size"] == 16 and pool["max_seqs"] == 2
    assert pool["largest_allocation_bytes"] == max(
        np.prod(pool["codes_shape"]) * 4, np.prod(pool["stage_shape"]) * 2
    )
    pte = m["artifacts"]["pte"]
    # one memory arena per layer for the pool, each no larger than one layer's tensors
    assert len(pte["arena_bytes"]) == 1 + m["model"]["num_layers"]
    assert max(pte["arena_bytes"][1:]) <= pool["total_bytes"] // m["model"]["num_layers"] + 256
    for entry in m["artifacts"].values():
        assert len(entry["sha256"]) == 64 and entry["bytes"] > 0
    assert m["versions"]["executorch"] == "1.5.1" and m["versions"]["torch"].startswith("2.13.0")


def test_export_without_spec_chooses_by_calibration_kld(tmp_path):
    """No --spec: export scores default and best (equal bytes) on the calibration text: default while its KLD is
    within DEFAULT_PREFERRED_KLD, else the lower, by measurement, not by model name; the manifest records both."""
    from toolkit.kv_spec import DEFAULT_CANDIDATES, DEFAULT_PREFERRED_KLD, PRESETS
    from toolkit.manifest import layout_from_manifest

    for family in ("llama", "gemma3"):
        m = export_artifacts(f"tiny-{family}", tmp_path / family, ("onnx",), None, PoolRequest(pool_tokens=64),
                             model_and_tokenizer=(tiny_model(family, num_layers=1), None), accept_fidelity=True)
        got = m["calibration"]["candidates"]
        assert set(got) == set(DEFAULT_CANDIDATES)
        want = "default" if got["default"] <= DEFAULT_PREFERRED_KLD else min(got, key=got.get)
        assert layout_from_manifest(m).spec == PRESETS[want]
        assert m["calibration"]["fidelity"]["pool"]["kld"] == got[want]


def test_manifest_records_the_export_stages(tiny_llama_onnx_pte):
    """Each artifact's stages and the export's own (calibration, ...) are in pagedkv.json: a name, seconds
    and the process's resident and peak bytes when the stage ended (export/stages.py)."""
    manifest = json.loads((tiny_llama_onnx_pte / "pagedkv.json").read_text())
    pte = [r["stage"] for r in manifest["artifacts"]["pte"]["stages"]]
    assert pte[:1] == ["torch.export"] and "to_edge and XNNPACK lowering" in pte and pte[-1] == "serializing"
    assert manifest["artifacts"]["onnx"]["stages"]
    assert [r["stage"] for r in manifest["export_stages"]][:1] == ["calibration"]
    rows = manifest["export_stages"] + manifest["artifacts"]["pte"]["stages"] + manifest["artifacts"]["onnx"]["stages"]
    for row in rows:
        assert set(row) == {"stage", "seconds", "rss_bytes", "peak_rss_bytes"}, row
        assert row["seconds"] >= 0 and 0 < row["rss_bytes"] <= row["peak_rss_bytes"], row
