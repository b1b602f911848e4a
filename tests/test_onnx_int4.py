"""ONNX int4 weights (export.onnx_export.int4_matmul_nodes): MatMulNBits with 4-bit zero points plus
a small fp32 MatMul for their fractions (a float zero point would stay exact but falls off onnxruntime's
fast kernels).

Weights that already lie on a 4-bit affine grid per 32 values along the input dim (what a GGUF Q4_0 /
Q4_1 / Q4_K model dequantizes to) are stored without loss; other blocks get asymmetric round-to-nearest.
Checked on onnxruntime itself: one-MatMul graphs, and a tiny llama exported end to end."""

import shutil

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from export.artifacts import PoolRequest, export_artifacts
from export.onnx_export import int4_matmul_nodes, pack_int4_affine, quantize_weights_int4
from runtime_sim.session import open_artifacts
from tests.helpers import hf_greedy
from toolkit.manifest import read_manifest, sha256_file, write_manifest
from toolkit.tiny_models import tiny_model

BS = 32


def _dequant(packed, scales, zps, k):
    """MatMulNBits' packing read back independently: W [K, N] = scale * (q - zp), low nibble = even k."""
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], packed.shape[1], -1)
    w = (q.astype(np.float64) - zps.reshape(q.shape[:2])[..., None]) * scales.reshape(q.shape[:2])[..., None]
    return w.reshape(q.shape[0], -1)[:, :k].T


def _ort_matmul(w, a, accuracy_level):
    """A @ W through the graph the exporter makes for one MatMul (int4_matmul_nodes) on onnxruntime."""
    import onnxruntime as ort

    k, n = w.shape
    nodes, inits, _ = int4_matmul_nodes("A", "Y", w, "w", BS, accuracy_level)
    zp = next(i for i in inits if i.name == "w_zp")
    assert zp.data_type == TensorProto.UINT8  # 4-bit integer zero points: onnxruntime's fast kernels
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a.shape))],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [a.shape[0], n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": a})[0]


def _q4_grid(rng, k, n, kind):
    """A weight [K, N] built as GGUF dequantizes it: fp16 block constants, fp32 arithmetic, 32 values a block."""
    nb = -(-k // BS)
    q = rng.integers(0, 16, size=(n, nb, BS)).astype(np.float32)
    d = rng.uniform(0.002, 0.05, size=(n, nb, 1)).astype(np.float16).astype(np.float32)
    if kind == "q4_0":
        x = d * (q - np.float32(8))
    else:  # q4_1 (and a Q4_K sub-block: a*q + b, the same form)
        m = rng.uniform(-0.6, 0.1, size=(n, nb, 1)).astype(np.float16).astype(np.float32)
        x = d * q + m
    return np.ascontiguousarray(x.reshape(n, -1)[:, :k].T)


@pytest.mark.parametrize("kind,k", [("q4_1", 96), ("q4_0", 96), ("q4_1", 80)])  # 80: a partial last block
def test_grid_weights_are_stored_exactly(kind, k):
    rng = np.random.default_rng(0)
    w = _q4_grid(rng, k, 24, kind)
    w[:BS, 0] = np.float32(-0.25) + np.float32(0.01) * np.array([0, 3, 8, 11] * 8, dtype=np.float32)  # missing levels
    packed, scales, zps, exact = pack_int4_affine(w, BS)
    assert packed.shape == (24, -(-k // BS), BS // 2) and scales.shape == zps.shape == (24 * -(-k // BS),)
    assert exact == scales.size  # every block found on its grid
    assert np.abs(_dequant(packed, scales, zps, k) - w).max() <= 1e-6 * np.abs(w).max()
    a = rng.standard_normal((3, k)).astype(np.float32)
    ref = a.astype(np.float64) @ w
    scale = (np.abs(a) @ np.abs(w)).max()
    assert np.abs(_ort_matmul(w, a, 0) - ref).max() <= 1e-5 * scale  # fp32 compute: lossless
    # accuracy_level 4 (the export's) rounds the activations to int8 per block: ~1e-3, no more
    assert np.abs(_ort_matmul(w, a, 4) - ref).max() <= 5e-3 * scale


def test_other_weights_get_round_to_nearest_and_constant_blocks_are_exact():
    rng = np.random.default_rng(1)
    k, n = 64, 16
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:BS, 0] = 0.0
    w[:BS, 1] = 0.3
    w[BS:, 1] = -1.7
    packed, scales, zps, exact = pack_int4_affine(w, BS)
    assert exact == 3  # the three constant blocks, no random one
    got = _dequant(packed, scales, zps, k)
    blocks = w.T.reshape(n, -1, BS)
    half_step = np.repeat((blocks.max(-1) - blocks.min(-1)) / 30, BS, axis=-1).reshape(n, k).T
    err = np.abs(got - w)
    assert np.all(err <= half_step * (1 + 1e-5) + 1e-7)  # RTN: at most half a step
    assert err.max() > 0.1 * half_step.max()  # and it does round
    assert np.abs(got[:BS, :2] - w[:BS, :2]).max() <= 1e-7 and np.abs(got[BS:, 1] + 1.7).max() <= 1e-6
    a = rng.standard_normal((2, k)).astype(np.float32)
    for level in (0, 4):
        y = _ort_matmul(w, a, level)  # onnxruntime computes with the same dequantized weights
        assert np.abs(y - a.astype(np.float64) @ got).max() <= 1e-2 * (np.abs(a) @ np.abs(got)).max()


def _snap_q4_1(model):
    """Every linear weight [out, in] -> its Q4_1 rounding per 32 inputs (fp16 d and m, as GGUF stores them)."""
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.reshape(mod.weight.shape[0], -1, BS)
                m = w.amin(-1, keepdim=True).half().float()
                d = ((w.amax(-1, keepdim=True) - m) / 15).half().float()
                q = ((w - m) / d).round().clamp(0, 15)
                mod.weight.copy_((d * q + m).reshape(mod.weight.shape))
    return model


def _run_calls(art, calls):
    """Per-call logits of one conversation on onnxruntime (native kernel)."""
    engine = open_artifacts(art, "onnxruntime", native=True, prefill_chunk=16)
    conv = engine.new_conversation()
    return [engine._run([(engine.conversations[conv], toks)])[0] for toks in calls]


def test_exported_q4_1_llama_matches_its_fp32_export(tmp_path):
    arts = {}
    for weights in ("fp32", "int4"):
        arts[weights] = tmp_path / weights
        export_artifacts("tiny-llama", arts[weights], ("onnx",), "fp32", PoolRequest(pool_tokens=256, max_seqs=1),
                         max_tokens_per_call=32, onnx_weights=weights,
                         model_and_tokenizer=(_snap_q4_1(tiny_model("llama")), None), accept_fidelity=True)
    entry = read_manifest(arts["int4"])["artifacts"]["onnx"]
    assert entry["weights"] == "int4" and entry["int4_exact_blocks"] == entry["int4_blocks"] > 0
    assert entry["bytes"] < read_manifest(arts["fp32"])["artifacts"]["onnx"]["bytes"] / 2.5  # fp32 embedding kept
    # the same weights at accuracy_level 0 (fp32 compute): the int4 graph is the fp32 graph
    arts["int4-acc0"] = tmp_path / "int4-acc0"
    shutil.copytree(arts["fp32"], arts["int4-acc0"])
    m = read_manifest(arts["int4-acc0"])
    stats = quantize_weights_int4(arts["int4-acc0"] / "model.onnx", accuracy_level=0)
    assert stats == {k: entry[k] for k in stats}
    m["artifacts"]["onnx"].update(weights="int4", sha256=sha256_file(arts["int4-acc0"] / "model.onnx"))
    write_manifest(arts["int4-acc0"], m)
    prompt = list(range(5, 42))
    calls = [prompt[i:i + 16] for i in range(0, len(prompt), 16)] + [[t] for t in range(100, 110)]
    logits = {w: _run_calls(arts[w], calls) for w in arts}
    rel = {w: max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits[w], logits["fp32"]))
           for w in ("int4", "int4-acc0")}
    assert rel["int4-acc0"] < 1e-5, rel
    # the export's accuracy_level 4 rounds the activations to int8 per block (measured: 0.041)
    assert 1e-5 < rel["int4"] < 0.1, rel
    engine = open_artifacts(arts["int4-acc0"], "onnxruntime", native=True, prefill_chunk=16)
    got = list(engine.generate(engine.new_conversation(), prompt, 24))
    assert got == hf_greedy(_snap_q4_1(tiny_model("llama")), prompt, 24)
