"""The compact tier in exported models (issue 25): artifacts exported with a compact region
(PoolRequest(compact_blocks=N), `pagedkv export --compact-blocks N`) on onnxruntime (the native
QuantizedPagedAttentionMixed kernel and its standard-op fallback function) and ExecuTorch
(quantized_paged_attention_mixed.out), against the torch PagedModel with the same pool state; the
backends' compact_block against toolkit.quant's; the adaptive ladder's compact rung on onnxruntime; and
an export without a compact region is the graph and manifest it was before.
"""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from export.artifacts import PoolRequest, export_artifacts
from runtime_sim.backends import TorchBackend
from runtime_sim.compact import compact_aged
from runtime_sim.engine import Engine
from runtime_sim.session import open_artifacts
from tests.helpers import export_key_offsets
from toolkit.compiler import compile
from toolkit.manifest import layout_from_manifest, pool_identity
from toolkit.tiny_models import tiny_model

# every family of tests/test_export.py (each has global layers; gemma3's first layer is a sliding one)
FAMILIES = {"llama": 1, "qwen3": 1, "gemma3": 2}  # family -> layers (gemma3: sliding + global)
BACKENDS = [("onnxruntime", False), ("onnxruntime", True), ("executorch", None)]
BACKEND_IDS = ["ort-fallback", "ort-native", "executorch"]
COMPACT_BLOCKS = 4
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(90)]  # blocks 0..5 of 16 tokens, the last one partial


def _export(tmp_path_factory, family, compact_blocks, formats=("onnx", "pte")):
    out = tmp_path_factory.mktemp(f"{family}-compact{compact_blocks}")
    export_artifacts(
        f"tiny-{family}", out, formats, "default",
        PoolRequest(pool_tokens=256, max_seqs=2, compact_blocks=compact_blocks), max_tokens_per_call=32,
        model_and_tokenizer=(tiny_model(family, num_layers=FAMILIES[family]), None),
        accept_fidelity=True,  # a random tiny model is no test of the compact spec's fidelity
    )
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def compact_artifacts(request, tmp_path_factory):
    return request.param, _export(tmp_path_factory, request.param, COMPACT_BLOCKS)


def _reference(engine, family, art) -> Engine:
    """The torch PagedModel (compile(compact_blocks=N)) of the same tiny model, pool and groups."""
    lay = engine.backend.layout
    sliding = [g.num_blocks for g in engine.groups if g.window]
    paged = compile(tiny_model(family, num_layers=FAMILIES[family]), lay.spec, block_size=lay.block_size,
                    num_blocks=lay.num_blocks, max_seqs=lay.max_seqs, sliding_blocks=max(sliding, default=None),
                    compact_blocks=lay.num_compact_blocks, key_offsets=export_key_offsets(art))
    return Engine(TorchBackend(paged), prefill_chunk=16)


def _copy_pools(dst, src) -> None:
    """Overwrite backend dst's default pools with backend src's (numpy views of both)."""
    for d, s in zip(dst.pool_arrays(), src.pool_arrays()):
        for x, y in zip(d, s):
            x[...] = y


def test_manifest_records_the_compact_region(compact_artifacts):
    family, art = compact_artifacts
    m = json.loads((art / "pagedkv.json").read_text())
    lay = layout_from_manifest(m)
    assert lay.num_compact_blocks == COMPACT_BLOCKS and lay.compact is not None
    assert m["pool"]["num_compact_blocks"] == COMPACT_BLOCKS
    assert m["pool"]["compact_codes_shape"] == list(lay.compact_codes_shape())
    # the global group's layers take their compact region as inputs, between the pools and logits_rows
    groups = m.get("groups") or [{"window": 0, "layers": list(range(lay.num_layers))}]
    global_layers = [i for g in groups if g["window"] == 0 for i in g["layers"]]
    assert global_layers and len(global_layers) < lay.num_layers or family != "gemma3"
    names = [f"compact_{k}_{i}" for i in global_layers for k in ("codes", "scales")]
    for kind in ("onnx", "pte"):
        assert m["artifacts"][kind]["inputs"][-1 - len(names):-1] == names
    model = onnx.load(str(art / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node if n.domain == "pagedkv"]
    assert ops.count("QuantizedPagedAttentionMixed") == len(global_layers)
    assert ops.count("QuantizedPagedAttention") == lay.num_layers - len(global_layers)
    # each op's fallback function is there when the graph has its nodes (stock onnxruntime runs them)
    assert {f.name for f in model.functions if f.domain == "pagedkv"} == {
        op for op in ("QuantizedPagedAttention", "QuantizedPagedAttentionMixed") if op in ops}
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["pagedkv_pool"]) == pool_identity(lay) and "compact" in pool_identity(lay)


@pytest.mark.parametrize("backend,native", BACKENDS, ids=BACKEND_IDS)
def test_mixed_table_logits_match_the_torch_model(compact_artifacts, backend, native):
    """Prefill on the exported model, compact_aged on it and on the torch model given the same pool
    state: the same blocks move and the compact records are the same bits (the backend's compact_block
    against toolkit.quant.compact_block); then the next step reads the mixed table and gives the torch
    model's logits (to the bound tests/test_export.py holds the quantized pool to: the runtimes' matmuls
    round K/V differently from torch's, ~1e-7)."""
    family, art = compact_artifacts
    engine = open_artifacts(art, backend, native=native, prefill_chunk=16)
    if backend == "onnxruntime":
        assert engine.backend.native is bool(native)
        # `pagedkv run/chat --policy auto` (their default): the compact tier's ladder on such an export
        assert open_artifacts(art, backend, native=native, policy="auto").policy == "adaptive"
    ref = _reference(engine, family, art)
    a, b = engine.new_conversation(), ref.new_conversation()
    engine.prefill(a, PROMPT)
    ref.prefill(b, PROMPT)
    seq_a, seq_b = engine.conversations[a].seq, ref.conversations[b].seq
    assert engine.pool.block_table(seq_a) == ref.pool.block_table(seq_b)
    _copy_pools(ref.backend, engine.backend)

    moved = compact_aged(engine, a, horizon=40)  # blocks ending >= 40 tokens back: 1 and 2 (0 is the sink)
    assert [i for i, _, _ in moved] == [1, 2]
    assert compact_aged(ref, b, horizon=40) == moved
    got, want = engine.backend.compact_arrays(), ref.backend.compact_arrays()
    assert sorted(got) == sorted(want) and got
    for i in want:
        for x, y in zip(got[i], want[i]):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"layer {i}: compact records differ"
        assert got[i][0][:len(moved)].any() and not got[i][0][len(moved):].any()
    engine.check_invariants()

    # the freed default blocks no longer hold what the table reads: garbage there must not matter
    for pools in (engine.backend.pool_arrays(), ref.backend.pool_arrays()):
        for i in got:
            for _, src, _ in moved:
                pools[i][0][src] = 0xA5
                pools[i][1][src] = 7.0
    la = engine.step({a: [11]})[a]
    lb = ref.step({b: [11]})[b]
    assert float(np.abs(la - lb).max()) < 1e-4, f"{family} {backend}: max |dlogit| {np.abs(la - lb).max()}"
    # generation goes on past the compacted blocks and every block comes back on close
    assert len(list(engine.generate(a, [12, 13], 6))) == 6
    engine.check_invariants()
    engine.close(a)
    assert engine.pool.main.num_free_compact_blocks == COMPACT_BLOCKS


def test_adaptive_ladder_compacts_on_onnxruntime(compact_artifacts):
    """The adaptive policy's first rung on the onnxruntime backend: a pool too small for two chats
    compacts the idle one's aged blocks instead of spilling or sliding, and both chats go on."""
    family, art = compact_artifacts
    if family != "llama":
        pytest.skip("one family is enough for the ladder (the rung itself is tested in tests/test_ladder.py)")
    engine = open_artifacts(art, "onnxruntime", native=False, prefill_chunk=16, policy="adaptive")
    engine.compact_horizon = 32
    a, b = engine.new_conversation(), engine.new_conversation()
    engine.prefill(a, PROMPT)  # 6 blocks
    engine.prefill(b, PROMPT[:80] * 2)  # 10 blocks: the pool's 16 are all held
    out = list(engine.generate(b, [5], 20))  # needs more: the ladder runs
    c = engine.counters
    assert c.compactions >= 1 and c.compacted_blocks >= 1
    assert c.spills == c.slides == c.evictions == 0
    assert any(x >= engine.groups[0].num_blocks for x in engine.pool.block_table(engine.conversations[a].seq))
    engine.check_invariants()
    assert len(out) == 20 and len(list(engine.generate(a, [9], 4))) == 4
    engine.check_invariants()


def test_onnxruntime_compaction_needs_no_torch(compact_artifacts):
    """The onnxruntime backend re-quantizes in numpy (runtime_sim.requant): a process that opens the
    artifacts, prefills and compacts never imports torch."""
    family, art = compact_artifacts
    if family != "llama":
        pytest.skip("one family is enough")
    code = (
        "import sys\n"
        "from runtime_sim.session import open_artifacts\n"
        "from runtime_sim.compact import compact_aged\n"
        f"e = open_artifacts({str(art)!r}, 'onnxruntime', native=False, prefill_chunk=16)\n"
        "c = e.new_conversation()\n"
        f"e.prefill(c, {PROMPT!r})\n"
        "print(len(compact_aged(e, c, 40)), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "False"]


def test_export_without_compact_region_is_unchanged(compact_artifacts, tmp_path_factory):
    """compact_blocks=0 (the default): no compact input, node, function or manifest key anywhere, and
    the graph is the compact export's with each mixed node read as the default op (same inputs but the
    compact ones, same attributes but the compact spec's)."""
    family, art = compact_artifacts
    if family != "llama":
        pytest.skip("one family is enough")
    plain = _export(tmp_path_factory, family, 0)
    m, mc = (json.loads((d / "pagedkv.json").read_text()) for d in (plain, art))
    lay = layout_from_manifest(m)
    assert lay.num_compact_blocks == 0 and not any(k.startswith(("compact", "num_compact")) for k in m["pool"])
    assert m["pool"] == dataclasses.replace(layout_from_manifest(mc), compact=None, num_compact_blocks=0).to_dict()
    assert "compact" not in pool_identity(lay)
    for kind in ("onnx", "pte"):
        assert m["artifacts"][kind]["inputs"] == [n for n in mc["artifacts"][kind]["inputs"]
                                                  if not n.startswith("compact_")]
    g0 = onnx.load(str(plain / "model.onnx")).graph
    g1 = onnx.load(str(art / "model.onnx")).graph
    assert [i.name for i in g0.input] == m["artifacts"]["onnx"]["inputs"]
    assert [o.name for o in g0.output] == [o.name for o in g1.output]

    def node_key(n):
        inputs = [x for x in n.input if not x.startswith("compact_")]
        attrs = sorted((a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute
                       if a.name not in ("ck_bits", "cv_bits", "ck_group", "cv_group", "ck_sym", "cv_sym"))
        return n.op_type.replace("QuantizedPagedAttentionMixed", "QuantizedPagedAttention"), inputs, list(n.output), attrs

    assert [node_key(n) for n in g0.node] == [node_key(n) for n in g1.node]
    assert {i.name: i.raw_data for i in g0.initializer} == {i.name: i.raw_data for i in g1.initializer}
    assert not any(n.op_type == "QuantizedPagedAttentionMixed" for n in g0.node)


# ----------------------------------------------------------------------------------------------
# Bad input: one clear line, nothing written


def test_bad_compact_options_are_one_line(tmp_path):
    from toolkit.errors import SpecError

    proc = subprocess.run([sys.executable, "-m", "toolkit.cli", "export", "tiny-llama", "--out", str(tmp_path / "a"),
                           "--compact-blocks", "-1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--compact-blocks -1" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    with pytest.raises(SpecError, match="quantized specs"):  # a float pool has no codes to re-quantize
        export_artifacts("tiny-llama", tmp_path / "b", ("onnx",), "fp16", PoolRequest(pool_tokens=64, compact_blocks=2),
                         model_and_tokenizer=(tiny_model("llama", num_layers=1), None), accept_fidelity=True)
    assert not (tmp_path / "b").exists()


def test_manifest_compact_region_is_checked():
    """A pool section naming half a compact region, or compact shapes that disagree with its spec, is a
    one-line ArtifactError."""
    from toolkit.errors import ArtifactError
    from toolkit.kv_spec import compact_spec_for
    from toolkit.manifest import validate_manifest
    from toolkit.pool_layout import PoolLayout
    from toolkit.quant import PRESETS

    spec = PRESETS["default"]
    lay = PoolLayout(spec, 2, 2, 64, 16, 8, 2, compact=compact_spec_for(spec, 64), num_compact_blocks=3)
    good = {"format_version": 1, "artifacts": {}, "pool": lay.to_dict()}
    assert layout_from_manifest(validate_manifest(good)) == lay
    for edit, needle in ((lambda p: p.pop("num_compact_blocks"), "num_compact_blocks"),
                         (lambda p: p.pop("compact"), "'compact'"),
                         (lambda p: p.update(compact_codes_shape=[3, 2, 16, 99]), "compact_codes_shape"),
                         (lambda p: p["compact"].update(rotate=False), "rotate")):
        bad = json.loads(json.dumps(good))
        edit(bad["pool"])
        with pytest.raises(ArtifactError, match=needle) as e:
            validate_manifest(bad)
        assert "\n" not in str(e.value)
