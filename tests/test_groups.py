"""Per-layer-group block tables: sliding-window layers keep only the blocks of their window.

Tiny random models whose layers mix global and sliding attention (Gemma 3 with a small window,
Gemma 2 alternating, Mistral all-sliding, Qwen2 with sliding layers): greedy tokens with an
unquantized pool must equal HF's over prompts and generations several windows long, while the
sliding groups hand their blocks back to their pools as the window moves on.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime_sim.backends import TorchBackend
from runtime_sim.engine import Engine
from toolkit.block_pool import HOLE, GroupedBlockPool, LayerGroup, dead_blocks, window_blocks_needed
from toolkit.compiler import compile, layer_groups
from toolkit.kv_spec import resolve_spec
from toolkit.pool_layout import PoolLayout
from toolkit.tiny_models import tiny_config, tiny_model
from tests.helpers import export_key_offsets, hf_greedy

BS = 16
W = 24  # the tiny configs' sliding window


def _scaled(cfg):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model.eval()


def gemma2_config():
    """Gemma 2 with 4 alternating layers: sliding, global, sliding, global."""
    cfg = tiny_config("gemma2")
    cfg.num_hidden_layers = 4
    cfg.layer_types = ["sliding_attention", "full_attention"] * 2
    return cfg


def qwen2_sliding():
    """Qwen2 with sliding attention from layer 1 on (max_window_layers=1): layer 0 global."""
    cfg = tiny_config("qwen2")
    cfg.num_hidden_layers = 3
    cfg.use_sliding_window, cfg.sliding_window, cfg.max_window_layers = True, W, 1
    cfg.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    return _scaled(cfg)


MODELS = {
    "gemma3": lambda: tiny_model("gemma3"),
    "gemma2": lambda: _scaled(gemma2_config()),
    "mistral": lambda: tiny_model("mistral"),
    "qwen2": qwen2_sliding,
}


# ---------------------------------------------------------------------------------------------- pool


def test_groups_of_the_families():
    g = layer_groups(gemma2_config(), 40, 6)
    assert [(x.window, x.layers, x.num_blocks) for x in g] == [(0, (1, 3), 40), (W, (0, 2), 6)]
    assert [(x.window, x.layers) for x in layer_groups(tiny_config("mistral"), 40)] == [(W, (0, 1))]
    assert [(x.window, x.layers) for x in layer_groups(tiny_config("llama"), 40)] == [(0, (0, 1))]


def test_dead_blocks_and_window_size():
    # the next query at position L sees keys L-W+1 .. L: block i is dead once (i+1)*bs <= L-W+1
    assert dead_blocks(W, BS, 40) == 1 and dead_blocks(W, BS, 39) == 1 and dead_blocks(W, BS, 38) == 0
    assert dead_blocks(0, BS, 1000) == 0
    assert window_blocks_needed(W, BS, 1) == 3  # 23 older keys + 1 new, at any alignment


def grouped(num_sliding=4):
    return GroupedBlockPool([LayerGroup(0, (1,), 20), LayerGroup(W, (0,), num_sliding)], BS, 2)


def run(pool, seq, tokens, chunk=1):
    for a in range(0, len(tokens), chunk):
        part = tokens[a:a + chunk]
        pool.reserve(seq, len(part))
        pool.commit(seq, part)
        pool.check_invariants()


def test_sliding_group_returns_blocks_as_they_leave_the_window():
    pool = grouped()
    seq = pool.new_sequence()
    run(pool, seq, list(range(200)))
    table = pool.block_table(seq, 1)
    live = [i for i, b in enumerate(table) if b != HOLE]
    assert live == [11, 12]  # the next query (200) sees 177..200: blocks 11 (176..191) and 12
    assert live[0] == dead_blocks(W, BS, 200)
    assert pool.free_blocks() == [20 - 13, 4 - 2]
    assert pool.stats()["groups"][1]["used_blocks"] == 2
    pool.release(seq)
    assert pool.free_blocks() == [20, 4]


def test_prefix_reuse_and_fork_per_group():
    pool = grouped(num_sliding=6)
    a = pool.new_sequence()
    prompt = list(range(100, 180))  # 5 blocks
    run(pool, a, prompt, chunk=16)
    pool.release(a)
    b, n = pool.new_sequence_with_prefix(prompt + [7])
    assert n == 80
    # global group: every block again; sliding group: only the blocks the next position can see
    assert HOLE not in pool.block_table(b, 0)
    assert [x == HOLE for x in pool.block_table(b, 1)] == [True, True, True, False, False]
    pool.check_invariants()
    c = pool.fork(b)
    copies = pool.reserve(c, 1)
    assert copies == []  # the fork's next token starts a fresh block in both groups
    pool.commit(c, [7])
    pool.check_invariants()
    assert pool.length(b) == 80 and pool.length(c) == 81


def test_prefix_reuse_stops_where_a_sliding_block_was_recycled():
    pool = GroupedBlockPool([LayerGroup(0, (1,), 20), LayerGroup(W, (0,), 3)], BS, 2)
    a = pool.new_sequence()
    prompt = list(range(100, 180))
    run(pool, a, prompt, chunk=16)
    pool.release(a)
    other = pool.new_sequence()
    run(pool, other, list(range(500, 548)), chunk=16)  # reuses the sliding group's 3 blocks
    b, n = pool.new_sequence_with_prefix(prompt + [7])
    assert n == 0  # the global blocks are cached, the sliding window's are gone
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------- engine


@pytest.mark.parametrize("family", list(MODELS))
def test_greedy_equals_hf_over_several_windows_with_blocks_returned(family):
    prompt = [(7 * i) % 500 + 3 for i in range(70)]
    steps = 40  # 110 tokens: more than 4 windows of 24
    ref = hf_greedy(MODELS[family](), prompt, steps)
    sliding_blocks = window_blocks_needed(W, BS, 16)
    paged = compile(MODELS[family](), "fp32", num_blocks=12, max_seqs=2, sliding_blocks=sliding_blocks)
    e = Engine(TorchBackend(paged), prefill_chunk=16)
    c = e.new_conversation()
    assert list(e.generate(c, prompt, steps)) == ref
    e.pool.check_invariants()
    seq = e.conversations[c].seq
    length = e.pool.length(seq)
    for g, grp in enumerate(e.groups):
        table = e.pool.block_table(seq, g)
        if grp.window:
            holes = dead_blocks(W, BS, length)
            assert holes >= 4 and table[:holes] == [HOLE] * holes  # returned as they left the window
            assert e.stats()["groups"][g]["used_blocks"] == len(table) - holes <= sliding_blocks
        else:
            assert HOLE not in table
    e.clear(c)
    assert e.pool.free_blocks() == [g.num_blocks for g in e.groups]


def test_one_global_group_is_exactly_the_single_pool():
    paged = compile(tiny_model("llama"), "default", num_blocks=8, max_seqs=2)
    assert [(g.window, g.num_blocks) for g in paged.groups] == [(0, 8)]
    e = Engine(TorchBackend(paged), prefill_chunk=16)
    tables = e.block_tables(3)
    assert not isinstance(tables, list) and tables.shape == (2, 3)


# ---------------------------------------------------------------------------------------------- plan


def test_plan_tokens_with_and_without_groups():
    from runtime_sim.plan import grouped_fit, load_dims, plan
    from toolkit.kv_spec import bytes_per_token, resolve_spec

    r = plan("gemma3-270m", "2GiB", ["default"])
    row = r["specs"][0]
    g = row["grouped"]
    assert (g["global_layers"], g["sliding_layers"]) == (3, 15)
    # each sliding layer: 4 sequences x (512 - 1 + 64 tokens of blocks, + 1 block) = 4 x 37 blocks
    assert g["sliding_blocks_per_layer"] == {"512": 4 * 37}
    per_layer = bytes_per_token(resolve_spec("default"), 1, 256, 1)
    assert g["sliding_pool_bytes"] == 15 * 4 * 37 * 16 * per_layer
    assert 5.5 < g["tokens_fit"] / row["tokens_fit"] < 6  # 18 layers hold the context -> 3 do
    assert plan("smollm2", "1GiB", ["default"])["specs"][0]["grouped"] is None
    mistral = grouped_fit(resolve_spec("default"), load_dims("mistral"), [W, W], 2**30, 16, 4)
    assert mistral["tokens_fit"] is None  # only sliding layers: a fixed pool, conversations unbounded


def test_plan_with_a_sliding_spec_counts_as_export_sizes_the_pool():
    """`plan --sliding-spec`: the grouped column counts the sliding layers in their own spec, the tokens
    export's --pool-mb gives the same model (tiny Gemma 3, groups from the compiler); specs the sliding
    spec cannot go with (a float pool) keep their own; a model without sliding layers refuses it."""
    from export.artifacts import PoolRequest, make_layout
    from runtime_sim.plan import plan
    from toolkit.kv_spec import resolve_spec
    from toolkit.tiny_models import tiny_config

    cfg = tiny_config("gemma3")
    sliding = resolve_spec(SLIDING_SPEC)
    for mb in (0.5, 3.0):
        r = plan("gemma3", int(mb * 2**20), ["default", "fp16"], max_seqs=4, sliding_spec=SLIDING_SPEC)
        quant, flt = r["specs"]
        assert quant["grouped"]["sliding_spec"] == sliding.describe() == r["sliding_spec"]
        assert flt["grouped"]["sliding_spec"] == resolve_spec("fp16").describe()
        without = plan("gemma3", int(mb * 2**20), ["default"], max_seqs=4)["specs"][0]["grouped"]
        assert quant["grouped"]["tokens_fit"] > without["tokens_fit"]  # K5/V3 windows leave more for global
        layout = make_layout(cfg, resolve_spec("default"), PoolRequest(pool_mb=mb, max_seqs=4), sliding)
        assert quant["grouped"]["tokens_fit"] == layout.num_blocks * layout.block_size
    from toolkit.errors import SpecError

    with pytest.raises(SpecError, match="only global ones"):
        plan("smollm2", "1GiB", ["default"], sliding_spec=SLIDING_SPEC)


# ---------------------------------------------------------------------------------------------- ONNX


@pytest.mark.parametrize("native", [False, True], ids=["ort-fallback", "ort-native"])
def test_onnx_greedy_equals_hf_with_group_tables(tmp_path, native):
    from export.onnx_export import export_onnx
    from runtime_sim.backends import OrtBackend

    if native:
        from toolkit import native as native_lib

        native_lib.ort_library_path()  # the kernel library must be built (make native)
    prompt = [(5 * i) % 500 + 3 for i in range(50)]
    steps = 30  # 80 tokens: more than 3 windows of 24
    ref = hf_greedy(tiny_model("gemma3"), prompt, steps)
    paged = compile(tiny_model("gemma3"), "fp32", num_blocks=8, max_seqs=2, sliding_blocks=8)
    entry = export_onnx(paged, tmp_path / "model.onnx")
    assert entry["inputs"][:5] == ["input_ids", "positions", "seq_ids", "block_tables", "block_tables_1"]
    backend = OrtBackend(tmp_path / "model.onnx", paged.layout, entry["inputs"], entry["outputs"], native=native)
    backend.set_groups([LayerGroup(0, (1,), 8), LayerGroup(W, (0,), window_blocks_needed(W, BS, 16))])
    assert backend.pool_arrays()[0][0].shape[0] == 4 and backend.pool_arrays()[1][0].shape[0] == 8
    e = Engine(backend, prefill_chunk=16)
    c = e.new_conversation()
    assert list(e.generate(c, prompt, steps)) == ref
    seq = e.conversations[c].seq
    assert e.pool.block_table(seq, 1)[:3] == [HOLE] * 3  # the sliding group gave its old blocks back
    e.pool.check_invariants()


# ---------------------------------------------------------------------------------------------- ExecuTorch


def test_pte_greedy_equals_hf_with_group_tables(tmp_path):
    from export.executorch_export import export_pte
    from runtime_sim.backends import ExecuTorchBackend

    prompt = [(3 * i) % 500 + 3 for i in range(50)]
    steps = 30
    ref = hf_greedy(tiny_model("gemma3"), prompt, steps)
    sliding = window_blocks_needed(W, BS, 16)
    paged = compile(tiny_model("gemma3"), "fp32", num_blocks=8, max_seqs=1, sliding_blocks=sliding)
    entry = export_pte(paged, tmp_path / "model.pte", max_tokens=16)
    assert entry["inputs"] == ["input_ids", "positions", "seq_ids", "block_tables", "block_tables_1", "logits_rows"]
    backend = ExecuTorchBackend(tmp_path / "model.pte", paged.layout, entry, groups=paged.groups)
    e = Engine(backend, prefill_chunk=16)
    c = e.new_conversation()
    assert list(e.generate(c, prompt, steps)) == ref
    assert backend.pool_arrays()[0][0].shape[0] == sliding  # the sliding layer's buffer: its group's blocks
    seq = e.conversations[c].seq
    assert e.pool.block_table(seq, 1)[:3] == [HOLE] * 3
    e.pool.check_invariants()


# ---------------------------------------------------------------------------------------------- pool budget


def test_pool_budget_sizes_the_global_group_and_counts_the_window(tmp_path, wikitext):
    """A byte budget on a model with sliding layers (export --pool-mb, run --pool-mb): it sizes the
    global group's blocks, and the sliding group's window blocks count as a fixed part, as the Android
    runner's budget_blocks does. The pool allocated fits the budget and one more block would not; at run
    time the global group gets the sized count (not the manifest's) in the backend and the engine."""
    import json

    from export.artifacts import PoolRequest, export_artifacts
    from runtime_sim.session import open_artifacts
    from toolkit.block_pool import layer_layouts
    from toolkit.manifest import layout_from_manifest
    from toolkit.pool_layout import budget_terms
    from toolkit.tiny_models import tiny_bpe_tokenizer

    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:500]
    tok = tiny_bpe_tokenizer(lines)

    def pool_bytes(layout, groups):
        return sum(b for lay in layer_layouts(layout, groups) for b in lay.layer_tensor_bytes().values())

    # export: a budget of the fixed part (stage rows, the window's blocks) plus 40.5 global blocks
    probe = PoolLayout(resolve_spec("default"), 2, 2, 64, BS, 1, 1)
    window_blocks = window_blocks_needed(W, BS, 64)  # compiler.sliding_pool_blocks: one sequence, calls of 64
    per_block, fixed = budget_terms(probe, [LayerGroup(0, (1,), 1), LayerGroup(W, (0,), window_blocks)])
    assert per_block == probe.bytes_per_token // 2 * BS  # one layer's block: the global group has one layer
    budget = fixed + 40.5 * per_block
    art = tmp_path / "art"
    export_artifacts("tiny-gemma3", art, formats=("onnx",), spec="default",
                     pool=PoolRequest(pool_mb=budget / 2**20, max_seqs=1, block_size=BS),
                     model_and_tokenizer=(tiny_model("gemma3"), tok), accept_fidelity=True)
    manifest = json.loads((art / "pagedkv.json").read_text())
    groups = [LayerGroup.from_dict(g) for g in manifest["groups"]]
    exported = layout_from_manifest(manifest)
    assert [(g.window, g.num_blocks) for g in groups] == [(0, 40), (W, window_blocks)]
    assert exported.num_blocks == 40
    assert pool_bytes(exported, groups) <= budget < pool_bytes(replace(exported, num_blocks=41),
                                                               [replace(groups[0], num_blocks=41), groups[1]])

    # run time: a smaller budget, 12.5 global blocks
    small = fixed + 12.5 * per_block
    e = open_artifacts(art, pool_mb=small / 2**20)
    be = e.backend
    assert be.layout.num_blocks == 12
    assert [g.num_blocks for g in be.groups] == [12, window_blocks]
    assert [p.num_blocks for p in e.pool.pools] == [12, window_blocks]
    allocated = sum(a.nbytes for layer in be.pool_arrays() for a in layer)
    assert allocated == pool_bytes(be.layout, be.groups) == e.stats()["pool_bytes"] <= small < allocated + per_block
    # and it chats within that pool: 100 tokens need 7 global blocks
    c = e.new_conversation()
    list(e.generate(c, [(7 * i) % 400 + 3 for i in range(90)], 10))
    e.pool.check_invariants()


# ---------------------------------------------------------------------------------------------- a spec per group

# other bits and V groups than the pool's default (K8/V4, groups 64/32), the same rotation, tail and sink
SLIDING_SPEC = "default:k_bits=5,v_bits=3,v_group=16"


def test_sliding_spec_equals_eager_on_stored_kv():
    """compile(sliding_spec=): the sliding layer's pool has the sliding spec's record widths, and both
    layers' attention equals HF's eager attention on the K/V the op stored there (read back in each
    layer's own spec: tests/test_compiler.py stored_kv), over a prefill and decode steps past the window."""
    from tests.test_compiler import register_stored_kv_eager
    from toolkit.kv_spec import record_layout

    pool_spec, sliding = resolve_spec("default"), resolve_spec(SLIDING_SPEC)
    paged = compile(tiny_model("gemma3"), pool_spec, block_size=BS, num_blocks=8, max_seqs=1, sliding_spec=sliding)
    assert [(g.window, g.layers, g.spec) for g in paged.groups] == [(0, (1,), None), (W, (0,), sliding)]
    assert paged.layer_layout(0).spec == sliding and paged.layer_layout(1).spec == pool_spec
    widths = [paged.pool_tensors()[i][0].shape[-1] for i in (0, 1)]
    assert widths == [record_layout(sliding, 64).code_width, record_layout(pool_spec, 64).code_width]
    assert widths[0] < widths[1]
    ids = torch.randint(3, 512, (1, 45), generator=torch.Generator().manual_seed(3))
    table = torch.arange(8)[None]
    snapshots = {0: {}, 1: {}}
    got = []
    with torch.no_grad():
        for lo, hi in [(0, 30)] + [(p, p + 1) for p in range(30, 45)]:  # past the window of 24
            got.append(paged(ids[:, lo:hi], torch.arange(lo, hi), torch.zeros(hi - lo, dtype=torch.long), table, table))
            for layer in (0, 1):
                pools = tuple(x.clone() for x in paged.pool_tensors()[layer])
                for p in range(lo, hi):
                    snapshots[layer][p] = (paged.layer_layout(layer), pools, table[0])
        ref = tiny_model("gemma3")
        ref.set_attn_implementation(register_stored_kv_eager("gemma3", snapshots))
        want = ref(ids, use_cache=False).logits
    got = torch.cat(got, dim=1)
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_sliding_spec_rules():
    from toolkit.errors import SpecError, UnsupportedModelError
    from toolkit.kv_spec import check_group_spec
    from toolkit.manifest import validate_manifest

    pool = resolve_spec("default")
    assert check_group_spec(pool, resolve_spec("k4v4"), 64) == resolve_spec("k4v4")
    with pytest.raises(SpecError, match="rotate"):
        check_group_spec(pool, pool.replace(k_bits=4, rotate=False), 64)
    with pytest.raises(SpecError, match="quantized"):
        check_group_spec(pool, resolve_spec("fp16"), 64)
    with pytest.raises(SpecError, match="does not divide"):
        check_group_spec(pool, pool.replace(v_group=48), 64)
    with pytest.raises(UnsupportedModelError, match="only global"):
        compile(tiny_model("llama"), sliding_spec=SLIDING_SPEC)
    with pytest.raises(UnsupportedModelError, match="every layer"):
        compile(tiny_model("mistral"), sliding_spec=SLIDING_SPEC)
    # the manifest's format says whether a group has its own spec (a version-1 reader must refuse it)
    groups = [LayerGroup(0, (1,), 8).to_dict(), LayerGroup(W, (0,), 3, resolve_spec(SLIDING_SPEC)).to_dict()]
    base = {"artifacts": {}, "groups": groups}
    assert validate_manifest(dict(base, format_version=2))
    with pytest.raises(Exception, match="format_version 1 does not match"):
        validate_manifest(dict(base, format_version=1))
    with pytest.raises(Exception, match="format_version 2 does not match"):
        validate_manifest({"artifacts": {}, "groups": groups[:1] + [LayerGroup(W, (0,), 3).to_dict()],
                           "format_version": 2})


def test_sliding_spec_exports_and_runs_on_every_backend(tmp_path, wikitext):
    """export --sliding-spec to ONNX and .pte: the manifest (format 2) names the group's spec; the
    native ORT kernel, ORT's standard-op fallback (an overload of the op's function with the sliding
    spec baked in), ExecuTorch and the torch op give the same logits over a prompt two windows long and
    the same greedy tokens after it; each sliding layer's pool has the sliding spec's widths; the pool
    bytes in the stats are what was allocated; a conversation file carries the group's spec."""
    import json

    from export.artifacts import PoolRequest, export_artifacts
    from runtime_sim.session import open_artifacts
    from toolkit.errors import PagedKVError
    from toolkit.kv_spec import record_layout
    from toolkit.tiny_models import tiny_bpe_tokenizer

    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:500]
    sliding = resolve_spec(SLIDING_SPEC)
    art = tmp_path / "art"
    export_artifacts("tiny-gemma3", art, formats=("onnx", "pte"), spec="default", sliding_spec=SLIDING_SPEC,
                     pool=PoolRequest(pool_tokens=160, max_seqs=1, block_size=BS),
                     model_and_tokenizer=(tiny_model("gemma3"), tiny_bpe_tokenizer(lines)), accept_fidelity=True)
    manifest = json.loads((art / "pagedkv.json").read_text())
    assert manifest["format_version"] == 2
    assert [LayerGroup.from_dict(g).spec for g in manifest["groups"]] == [None, sliding]
    groups = [LayerGroup.from_dict(g) for g in manifest["groups"]]
    # only a sliding group after the first may store its own spec (the same rule as conversation files)
    from runtime_sim.session import manifest_groups

    bad = json.loads(json.dumps(manifest))
    bad["groups"][0]["spec"] = bad["groups"][1]["spec"]
    with pytest.raises(PagedKVError, match="malformed .the manifest gives layer group 0 .* its own spec"):
        manifest_groups(bad)

    torch_paged = compile(tiny_model("gemma3"), "default", block_size=BS, num_blocks=10, max_seqs=1,
                          sliding_blocks=groups[1].num_blocks, sliding_spec=sliding,
                          key_offsets=export_key_offsets(art))
    engines = {"torch": Engine(TorchBackend(torch_paged), prefill_chunk=16),
               "ort-native": open_artifacts(art, native=True, prefill_chunk=16),
               "ort-fallback": open_artifacts(art, native=False, prefill_chunk=16),
               "executorch": open_artifacts(art, "executorch", prefill_chunk=16)}
    assert engines["ort-native"].backend.native and not engines["ort-fallback"].backend.native
    prompt = [(11 * i) % 500 + 3 for i in range(50)]
    logits, tokens = {}, {}
    for name, e in engines.items():
        c = e.new_conversation()
        out = logits[name] = e.prefill(c, prompt)
        tokens[name] = []
        for _ in range(12):  # greedy
            tokens[name].append(int(out.argmax()))
            out = e.step({c: [tokens[name][-1]]})[c]
        pools = e.backend.pool_arrays()
        assert pools[0][0].shape[-1] == record_layout(sliding, 64).code_width, name  # layer 0 slides
        assert pools[1][0].shape[-1] == record_layout(resolve_spec("default"), 64).code_width, name
        assert e.pool.block_table(e.conversations[c].seq, 1)[0] == HOLE, name  # the window moved on
        e.pool.check_invariants()
        if name.startswith("ort"):
            assert e.stats()["pool_bytes"] == sum(a.nbytes for layer in pools for a in layer)
    want = logits["torch"]
    for name in engines:
        assert abs(logits[name] - want).max() < 1e-3 * max(1.0, abs(want).max()), name
        assert tokens[name] == tokens["torch"], name
    # a conversation file (version 3) carries the sliding group's spec and records: restored into a fresh
    # engine on the same export, the next step's logits are the saved conversation's, bit for bit
    from runtime_sim import conversation_file as cf

    e = engines["ort-native"]
    path = tmp_path / "chat.pkvc"
    e.save(0, path)
    d = cf.read(path)
    assert path.read_bytes()[8] == cf.GROUP_SPEC_VERSION and [g.spec for g in d.groups] == [None, sliding]
    assert d.codes[0].shape[-1] == record_layout(sliding, 64).code_width  # layer 0 slides
    fresh = open_artifacts(art, native=True, prefill_chunk=16)
    c2 = fresh.restore(path)
    assert np.array_equal(fresh.step({c2: [tokens["ort-native"][-1]]})[c2], e.step({0: [tokens["ort-native"][-1]]})[0])
    fresh.check_invariants()
    # a file whose group specs are not the engine's, or a spec where none may be: one line, nothing changed
    used = fresh.pool.stats()["used_blocks"]
    d.groups[1].spec = None
    with pytest.raises(PagedKVError, match="layer-group specs"):
        fresh.restore_data(d, path)
    d.groups[1].spec, d.groups[0].spec = sliding, sliding
    cf.write(tmp_path / "bad.pkvc", d)
    with pytest.raises(PagedKVError, match="gives layer group 0 .* its own spec"):
        fresh.restore(tmp_path / "bad.pkvc")
    assert fresh.pool.stats()["used_blocks"] == used
    fresh.check_invariants()
