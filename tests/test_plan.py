import pytest

from runtime_sim.plan import (
    DEFAULT_SPECS, KNOWN_DIMS, blocks_for_budget, load_dims, parse_size, plan, pool_fixed_bytes,
)
from toolkit.errors import ArtifactError, PagedKVError, SpecError
from toolkit.model_dims import ModelDims
from toolkit.pool_layout import PoolLayout
from toolkit.quant import PRESETS, bytes_per_token, fp16_bytes_per_token, fp_stage_bytes_per_sequence

SMOL = KNOWN_DIMS["smollm2"]


def test_smollm2_dims():
    assert load_dims("smollm2") == load_dims(None) == ModelDims(30, 9, 3, 64, 49152)


@pytest.mark.parametrize("ram", [4 * 2**30, 512 * 2**20, 3 * 10**8 + 17])
@pytest.mark.parametrize("block_size,max_seqs", [(16, 4), (32, 1)])
def test_plan_matches_quant_and_pool_layout(ram, block_size, max_seqs):
    r = plan(SMOL, ram, block_size=block_size, max_seqs=max_seqs)
    assert [row["name"] for row in r["specs"]] == DEFAULT_SPECS
    L, H, D = SMOL.num_layers, SMOL.num_kv_heads, SMOL.head_dim
    for row in r["specs"]:
        spec = PRESETS[row["name"]]
        bpt = bytes_per_token(spec, H, D, L)
        assert row["bytes_per_token"] == bpt
        assert row["stage_bytes_per_sequence"] == fp_stage_bytes_per_sequence(spec, block_size, H, D, L)
        assert row["vs_fp16"] == bpt / fp16_bytes_per_token(H, D, L)
        nb = row["num_blocks"]
        assert row["tokens_fit"] == nb * block_size
        layout = PoolLayout(spec, L, H, D, block_size, nb, max_seqs)
        # the most blocks that fit: nb fits, nb + 1 does not
        assert layout.total_bytes <= ram
        assert PoolLayout(spec, L, H, D, block_size, nb + 1, max_seqs).total_bytes > ram
        assert layout.total_bytes == nb * block_size * bpt + row["fixed_bytes"]
        assert row["pool_bytes"] == layout.total_bytes
        assert row["allocations_per_layer"] == layout.layer_tensor_bytes()
        assert row["allocation_count"] == 3 * L
        assert row["largest_allocation_bytes"] == layout.largest_allocation_bytes
        assert row["largest_allocation_bytes"] < layout.total_bytes / L + 1
    c = r["contiguous_fp16"]
    assert c["bytes_per_token"] == fp16_bytes_per_token(H, D, L) == 2 * 2 * D * H * L
    assert c["tokens_fit"] == ram // c["bytes_per_token"]
    assert c["buffer_shape"] == [L, 2, 8192, H, D]
    assert c["allocation_bytes"] == c["largest_allocation_bytes"] == L * 2 * 8192 * H * D * 2


def test_quantized_specs_hold_more_tokens():
    rows = {row["name"]: row for row in plan("smollm2", "1GiB")["specs"]}
    assert rows["default"]["tokens_fit"] / rows["fp16"]["tokens_fit"] == pytest.approx(1 / 0.4140625, rel=0.01)
    assert rows["k4v4"]["tokens_fit"] > rows["default"]["tokens_fit"] > rows["et-int8"]["tokens_fit"] \
        > rows["fp16"]["tokens_fit"]


def test_budget_too_small_for_one_block():
    r = plan(SMOL, 100_000, ["fp16", "default"])
    for row in r["specs"]:
        assert row["num_blocks"] == 0 and not row["fits"] and row["largest_allocation_bytes"] == 0
    assert blocks_for_budget(PRESETS["default"], SMOL, pool_fixed_bytes(PRESETS["default"], SMOL, 16, 4)) == 0


def test_spec_overrides_and_bad_specs():
    row = plan(SMOL, "64MiB", ["default:v_bits=8"])["specs"][0]
    assert row["bytes_per_token"] == bytes_per_token(PRESETS["default"].replace(v_bits=8), 3, 64, 30)
    with pytest.raises(SpecError, match="unknown KV spec 'nope'"):
        plan(SMOL, "64MiB", ["nope"])
    with pytest.raises(SpecError, match="block size 8 is invalid"):
        plan(SMOL, "64MiB", block_size=8)


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("300M", 300 * 2**20),
    ("2g", 2 * 2**30), ("64 KiB", 65536), ("1000", 1000), (" 0.5 gib ", 2**29), ("10kb", 10_000), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4XB", "", "GiB", "-1GiB", "four gigs", "0", "0MiB", "1.2.3GB"])
def test_parse_size_errors_are_clear(text):
    with pytest.raises(SpecError, match=r"--ram .*(not a size|not a positive size).*e\.g\. 4GiB"):
        parse_size(text)


def test_unknown_model_is_clear(tmp_path):
    with pytest.raises(ArtifactError, match="not found: pass a HF model dir"):
        load_dims(str(tmp_path / "missing"))
    with pytest.raises(ArtifactError, match="has no config.json"):
        load_dims(str(tmp_path))
    assert issubclass(ArtifactError, PagedKVError)


def test_hf_dir_config(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"num_hidden_layers": 3, "intermediate_size": 64, "vocab_size": 100}'
    )
    assert load_dims(str(tmp_path)) == ModelDims(3, 4, 2, 32, 100)
    r = plan(str(tmp_path), "1MiB", ["fp16"])
    assert r["specs"][0]["bytes_per_token"] == 2 * 2 * 32 * 2 * 3


def test_tiny_family():
    d = load_dims("qwen3")
    assert (d.num_layers, d.num_kv_heads, d.head_dim) == (2, 2, 64)


@pytest.mark.parametrize("spec_name", ["default", "fp16"])
def test_layer_pools_start_on_a_cache_line(spec_name):
    # the native kernel loads 64-byte rows of each record: a pool 16 bytes past a line (numpy's own large
    # arrays) would split every one of them
    import numpy as np

    from toolkit.pool_layout import POOL_ALIGN, zeros_aligned

    layout = PoolLayout(PRESETS[spec_name], 2, SMOL.num_kv_heads, SMOL.head_dim, 16, 1000, 2)
    arrays = layout.allocate_layer_numpy()
    for a, shape in zip(arrays, (layout.codes_shape(), layout.scales_shape(), layout.stage_shape())):
        assert a.ctypes.data % POOL_ALIGN == 0
        assert a.shape == tuple(shape) and a.flags["C_CONTIGUOUS"] and a.flags["WRITEABLE"]
        assert not a.any()
    assert arrays[0].dtype == np.dtype(layout.codes_dtype_name)
    b = zeros_aligned((3, 5), np.float16, align=256)
    assert b.ctypes.data % 256 == 0 and b.shape == (3, 5) and b.dtype == np.float16


def _fake_artifacts(tmp_path, fmt="pte", weight_bytes=1000, total_pool=5000, arena0=300):
    import json

    entry = {"file": f"model.{fmt}", "weights": "8da4w", "max_tokens_per_call": 16}
    if fmt == "pte":
        entry["arena_bytes"] = [arena0, total_pool // 2, total_pool // 2]
    (tmp_path / f"model.{fmt}").write_bytes(b"\0" * weight_bytes)
    (tmp_path / "pagedkv.json").write_text(json.dumps({"model": {"vocab_size": 100}, "pool": {"total_bytes": total_pool},
                                                       "artifacts": {fmt: entry}}))
    return tmp_path


def test_whole_process_estimate_adds_the_parts(tmp_path):
    from runtime_sim.plan import RUNTIME_BASE_BYTES, whole_process_estimate

    art = _fake_artifacts(tmp_path)
    est = whole_process_estimate(art, pool_bytes=2000)
    assert est["weights_bytes"] == 1000 and est["pool_bytes"] == 2000 and est["activations_bytes"] == 300
    assert est["total_bytes"] == 1000 + 2000 + 300 + RUNTIME_BASE_BYTES["runner"]
    # the budget commits at most the exported pool
    assert whole_process_estimate(art, pool_bytes=10**9)["pool_bytes"] == 5000
    assert whole_process_estimate(art)["pool_bytes"] == 5000


def test_whole_process_estimate_onnx_and_errors(tmp_path):
    from runtime_sim.plan import RUNTIME_BASE_BYTES, whole_process_estimate

    art = _fake_artifacts(tmp_path, fmt="onnx")
    (tmp_path / "model.onnx.data").write_bytes(b"\0" * 500)  # external data counts as weights
    est = whole_process_estimate(art, runtime="onnxruntime")
    assert est["weights_bytes"] == 1500
    assert est["activations_bytes"] == 3 * 16 * 100 * 4
    assert est["total_bytes"] == 1500 + 5000 + 3 * 16 * 100 * 4 + RUNTIME_BASE_BYTES["onnxruntime"]
    with pytest.raises(ArtifactError, match="no pte artifact"):
        whole_process_estimate(art, runtime="runner")
    with pytest.raises(ArtifactError, match="pagedkv.json"):
        whole_process_estimate(tmp_path / "nowhere")


@pytest.mark.parametrize("module", ["runtime_sim.plan", "runtime_sim.simulate", "toolkit.kv_spec", "toolkit.manifest",
                                    "toolkit.model_dims", "toolkit.pool_layout", "toolkit.block_pool", "toolkit.cli"])
def test_light_modules_do_not_import_torch(module):
    """Planning, simulation, the pool manager, the manifest and the CLI's start-up run without torch
    (a fresh interpreter, so this test's own imports do not count)."""
    import subprocess
    import sys

    code = f"import sys, {module}; heavy = [m for m in ('torch', 'transformers', 'onnx') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing {module} imports {out}"


# ----------------------------------------------------------------------------------------------
# Pool size from a budget: one formula (toolkit.pool_layout), used by plan, export and run/chat


@pytest.mark.parametrize("spec_name", sorted(PRESETS))
def test_fixed_bytes_is_what_the_block_count_does_not_change(spec_name):
    spec = PRESETS[spec_name]
    for bs, seqs in ((16, 4), (32, 1)):
        one = PoolLayout(spec, SMOL.num_layers, SMOL.num_kv_heads, SMOL.head_dim, bs, 1, seqs)
        for nb in (1, 2, 7, 300):
            lay = PoolLayout(spec, SMOL.num_layers, SMOL.num_kv_heads, SMOL.head_dim, bs, nb, seqs)
            assert lay.fixed_bytes == one.fixed_bytes >= 0
            assert lay.total_bytes == nb * bs * lay.bytes_per_token + lay.fixed_bytes


@pytest.mark.parametrize("spec_name", ["fp32", "fp16", "default", "k4v4"])
@pytest.mark.parametrize("budget", [3 * 2**20 + 5, 10**7, 0.3 * 2**20])
def test_blocks_for_budget_is_the_most_whole_pool_that_fits(spec_name, budget):
    from toolkit.pool_layout import blocks_for_budget

    shape = PoolLayout(PRESETS[spec_name], 4, 2, 64, 16, 1, 2)
    nb = blocks_for_budget(shape, budget)
    if nb:
        assert PoolLayout(PRESETS[spec_name], 4, 2, 64, 16, nb, 2).total_bytes <= budget
    assert PoolLayout(PRESETS[spec_name], 4, 2, 64, 16, nb + 1, 2).total_bytes > budget
    assert blocks_for_budget(PoolLayout(PRESETS[spec_name], 4, 2, 64, 16, 999, 2), budget) == nb  # shape only


def test_export_and_runtime_budgets_use_the_one_formula():
    from dataclasses import replace

    from export.artifacts import PoolRequest
    from runtime_sim.session import sized_layout
    from toolkit.pool_layout import MIN_POOL_BLOCKS, blocks_for_budget

    spec = PRESETS["default"]
    shape = PoolLayout(spec, 4, 2, 64, 16, 1, 3)
    for mb in (0.25, 1.0, 7.5):
        nb = blocks_for_budget(shape, mb * 2**20)
        assert PoolRequest(pool_mb=mb, max_seqs=3).num_blocks(spec, 4, 2, 64) == nb
        exported = replace(shape, num_blocks=10**4)
        assert sized_layout(exported, mb, None).num_blocks == nb  # capped at the export below
        assert sized_layout(replace(shape, num_blocks=5), mb, None).num_blocks == min(5, nb)
    # one minimum, one message naming the budget and the fix
    tiny = (shape.fixed_bytes + MIN_POOL_BLOCKS * 16 * shape.bytes_per_token - 1) / 2**20
    assert blocks_for_budget(shape, tiny * 2**20) == MIN_POOL_BLOCKS - 1
    why = "is too small: it holds fewer than 2 blocks of 16 tokens.*raise it"
    with pytest.raises(SpecError, match=rf"--pool-mb {tiny} \(with 3 sequences\) {why}"):
        PoolRequest(pool_mb=tiny, max_seqs=3).num_blocks(spec, 4, 2, 64)
    with pytest.raises(PagedKVError, match=rf"--pool-mb {tiny} {why}"):
        sized_layout(replace(shape, num_blocks=100), tiny, None)
    assert PoolRequest(pool_mb=tiny + 1 / 2**20, max_seqs=3).num_blocks(spec, 4, 2, 64) == MIN_POOL_BLOCKS


def test_plan_says_a_budget_under_the_minimum_does_not_fit():
    from toolkit.pool_layout import MIN_POOL_BLOCKS

    spec = PRESETS["default"]
    one_block = pool_fixed_bytes(spec, SMOL, 16, 4) + 16 * bytes_per_token(spec, 3, 64, 30)
    row = plan(SMOL, one_block, ["default"])["specs"][0]
    assert blocks_for_budget(spec, SMOL, one_block) == 1 < MIN_POOL_BLOCKS
    assert row["num_blocks"] == 0 and not row["fits"]
    row = plan(SMOL, one_block + 16 * bytes_per_token(spec, 3, 64, 30), ["default"])["specs"][0]
    assert row["num_blocks"] == MIN_POOL_BLOCKS and row["fits"]


def test_toolkit_imports_nothing_above_it():
    """toolkit/ is the bottom layer: no module in it imports export/ or runtime_sim/ (at import time or
    lazily), except the CLI, the one entry point that sits on top of everything."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "toolkit"
    upward = []
    for path in sorted(root.glob("*.py")):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            upward += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("export", "runtime_sim")]
    assert upward == [], f"toolkit imports upward: {upward}"


@pytest.mark.parametrize("columns", [80, 200])
def test_plan_table_fits_the_terminal(columns):
    """`pagedkv plan` in an 80-column terminal keeps the token columns whole and leaves out the allocation
    detail and bytes per token (saying so); a wide one shows every column. No cell is cut to an ellipsis in either."""
    import os
    import subprocess
    import sys

    from runtime_sim.plan import DETAIL_COLUMNS, parse_size, plan

    out = subprocess.run([sys.executable, "-m", "toolkit.cli", "plan", "gemma3-270m", "--ram", "2GiB"],
                         capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": str(columns)}).stdout
    rows = [ln for ln in out.splitlines() if ln.startswith("│ paged") or ln.startswith("│ contiguous")]
    assert len(rows) >= 7 and all("…" not in ln for ln in rows), out
    default = next(r for r in plan("gemma3-270m", parse_size("2GiB"))["specs"] if r["name"] == "default")
    row = next(ln for ln in rows if "│ default " in ln)  # tokens that fit without and with layer groups
    assert f"{default['tokens_fit']:,}" in row and f"{default['grouped']['tokens_fit']:,}" in row, row
    if columns == 80:
        assert "allocation columns hidden" in out and "largest alloc" not in out
    else:
        assert all(col in out for col in DETAIL_COLUMNS if col != "per layer: codes / scales / stage")
        assert "hidden" not in out
