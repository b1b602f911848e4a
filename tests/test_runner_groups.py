"""The Android runner (android_demo/native/src/runner.cpp, driven through pagedkv-runner) on models with
layer groups: one block table per group (block_tables, block_tables_1, ... in the .pte's input order),
each sliding group handing its blocks back to its own pool as they leave the window, exactly like
runtime_sim's engine (toolkit.block_pool.GroupedBlockPool).

Tiny random configs exported to .pte with an fp32 pool: Gemma 3 (a sliding layer with a window of 16
and a global layer), Gemma 2 (4 layers alternating sliding / global, window 24: each group's layers
are not contiguous) and Mistral (every layer sliding, window 32). For a prompt plus a generation several
windows long the runner's greedy tokens equal HF's, and its per-group statistics show the sliding
group holding at most the window's blocks. A manifest whose groups entry disagrees with the .pte is
one line and exit 2. Prerequisites as tests/test_runner_cli.py (the host build of ci_build.sh).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_greedy
from tests.native_build import build, need, qemu_env
from toolkit.block_pool import LayerGroup, dead_blocks, window_blocks_needed
from toolkit.pool_layout import PoolLayout, budget_terms

BS = 16
CALL = 16  # max_tokens_per_call of the exports: the runner prefills in calls of 16 tokens
PROMPT, DECODE = 70, 60  # 130 tokens: 8 windows of 16, 4 of 32
FAMILIES = {"gemma3": 16, "gemma2": 24, "mistral": 32}  # family -> its sliding window here


def tiny(family: str, window: int):
    """toolkit.tiny_models.tiny_model with another sliding window (set before the layers are built)."""
    from transformers import AutoModelForCausalLM

    from toolkit.tiny_models import tiny_config

    cfg = tiny_config(family)
    cfg.sliding_window = window
    if family == "gemma2":  # sliding, global, sliding, global
        cfg.num_hidden_layers, cfg.layer_types = 4, ["sliding_attention", "full_attention"] * 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="module")
def host_cli():
    need("g++", "javac", "cmake")
    return build("host") / "pagedkv-runner"


@pytest.fixture(scope="module")
def tokenizer(wikitext):
    from toolkit.tiny_models import tiny_bpe_tokenizer

    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:2000]
    return tiny_bpe_tokenizer(lines)


@pytest.fixture(scope="module")
def prompt(tokenizer, wikitext, tmp_path_factory):
    """A text that the tokenizer encodes as exactly PROMPT tokens (the CLI encodes the whole file)."""
    text = wikitext.read_text(encoding="utf-8")[5000:12000]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:PROMPT]
    prompt_text = tokenizer.decode(ids)
    assert tokenizer(prompt_text, add_special_tokens=False)["input_ids"] == ids
    path = tmp_path_factory.mktemp("groups-prompt") / "prompt.txt"
    path.write_text(prompt_text, encoding="utf-8")
    return path, ids


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, tokenizer, prompt, tmp_path_factory):
    """(family, window, artifacts dir, HF's greedy tokens) for one tiny family with sliding layers."""
    from export.artifacts import PoolRequest, export_artifacts

    family, window = request.param, FAMILIES[request.param]
    art = tmp_path_factory.mktemp(f"groups-{family}") / "artifacts"
    export_artifacts(f"tiny-{family}", art, formats=("pte",), spec="fp32",
                     pool=PoolRequest(pool_tokens=512, max_seqs=1, block_size=BS), max_tokens_per_call=CALL,
                     model_and_tokenizer=(tiny(family, window), tokenizer), accept_fidelity=True)
    ref = hf_greedy(tiny(family, window), prompt[1], DECODE)
    return family, window, art, ref


def run_cli(binary, art, prompt_file, *extra):
    cmd = [binary, art, "--prompt-file", prompt_file, "--ctx", PROMPT, "--decode", DECODE, "--threads", "1", *extra]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)


def test_grouped_runner_greedy_equals_hf_and_sliding_blocks_return(host_cli, exported, prompt):
    family, window, art, ref = exported
    man = json.loads((art / "pagedkv.json").read_text())
    groups = man["groups"]
    assert man["artifacts"]["pte"]["inputs"][3:] == ["block_tables"] + [f"block_tables_{g}" for g in range(1, len(groups))] + \
        ["logits_rows"]
    p = run_cli(host_cli, art, prompt[0], "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["generated"] == ref
    assert r["ladder"]["policy"] == "error"  # --policy auto (the default) without a compact region
    # the last generated token is not fed: the cache holds PROMPT + DECODE - 1 tokens
    length = PROMPT + DECODE - 1
    assert [(g["window"], g["layers"], g["total_blocks"]) for g in r["groups"]] == \
        [(g["window"], len(g["layers"]), g["num_blocks"]) for g in groups]
    for g in r["groups"]:
        assert g["used_blocks"] + g["free_blocks"] == g["usable_blocks"] == g["total_blocks"]
        if g["window"]:
            # only the blocks that intersect the window before the next position; the rest went back
            assert g["used_blocks"] == -(-length // BS) - dead_blocks(window, BS, length)
            assert dead_blocks(window, BS, length) >= 3
            # at no time more than a window plus one call's tokens, far below the whole conversation's blocks
            assert g["peak_used_blocks"] <= window_blocks_needed(window, BS, CALL) < -(-length // BS)
        else:
            assert g["used_blocks"] == g["peak_used_blocks"] == -(-length // BS)
    main = r["groups"][0]
    assert (r["pool_blocks"], r["usable_blocks"], r["used_blocks"]) == \
        (main["total_blocks"], main["usable_blocks"], main["used_blocks"])
    assert r["kv_bytes"] == sum(g["used_blocks"] * g["bytes_per_block"] for g in r["groups"])
    # a byte budget counts the same terms as toolkit.pool_layout.budget_terms (runner.cpp budget_blocks):
    # a block of the first group's layers, and the fixed part with the other groups' blocks
    layout = PoolLayout.from_dict(man["pool"])
    assert budget_terms(layout, [LayerGroup.from_dict(g) for g in groups]) == (
        r["groups"][0]["bytes_per_block"],
        r["pool_fixed_bytes"] + sum(g["bytes_per_block"] * g["total_blocks"] for g in r["groups"][1:]))
    if family != "mistral":
        assert [g["window"] for g in r["groups"]] == [0, window]  # the global group first
    else:
        assert [g["window"] for g in r["groups"]] == [window]  # Mistral: every layer sliding


def test_grouped_runner_aarch64_under_qemu(exported, prompt):
    """The cross-built runner under qemu-aarch64 -cpu max (NEON dotprod kernels): the same tokens and blocks."""
    need("clang", "aarch64-linux-gnu-g++", "qemu-aarch64-static", "javac")
    b = build("cross")
    env = qemu_env(b)
    family, window, art, ref = exported
    cmd = ["qemu-aarch64-static", "-cpu", "max", b / "pagedkv-runner", art, "--prompt-file", prompt[0], "--ctx", PROMPT,
           "--decode", DECODE, "--threads", "1", "--json"]
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["isa"] == "neon-dotprod" and r["generated"] == ref
    length = PROMPT + DECODE - 1
    assert [g["used_blocks"] for g in r["groups"]] == \
        [-(-length // BS) - dead_blocks(g["window"], BS, length) for g in r["groups"]]


def test_runtime_sim_engine_holds_the_same_blocks(exported, prompt):
    """The Python engine on the same .pte: the same tokens and the same blocks per group at the end."""
    from runtime_sim.session import open_artifacts

    family, window, art, ref = exported
    engine = open_artifacts(art, "executorch")
    engine.prefill_chunk = CALL
    c = engine.new_conversation()
    assert list(engine.generate(c, prompt[1], max_new_tokens=DECODE)) == ref
    seq = engine.conversations[c].seq
    length = PROMPT + DECODE - 1
    for g, grp in enumerate(engine.groups):
        held = sum(b >= 0 for b in engine.pool.block_table(seq, g))
        want = -(-length // BS) - dead_blocks(grp.window, BS, length)
        assert held == want == engine.stats()["groups"][g]["used_blocks"]


def test_each_layer_arena_starts_with_its_groups_codes(exported):
    """The runner commits and releases group 0's block pages assuming each layer's arena starts with its
    codes tensor, of its group's block count (a sliding layer's is smaller)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    _, _, art, _ = exported
    man = json.loads((art / "pagedkv.json").read_text())
    shape = man["pool"]["codes_shape"]
    blocks = {layer: g["num_blocks"] for g in man["groups"] for layer in g["layers"]}
    res = deserialize_pte_binary((art / "model.pte").read_bytes())
    plan = getattr(res, "program", res).execution_plan[0]
    codes = {}
    for v in plan.values:
        info = getattr(v.val, "allocation_info", None)
        if info is not None and info.memory_id >= 2 and list(v.val.sizes)[1:] == shape[1:] \
                and list(v.val.sizes)[0] == blocks[info.memory_id - 2]:
            codes[info.memory_id - 2] = (info.memory_offset_low, info.memory_offset_high)
    assert codes == {layer: (0, 0) for layer in range(man["pool"]["num_layers"])}


def edit_manifest(art: Path, tmp_path: Path, change) -> Path:
    bad = tmp_path / "artifacts"
    shutil.copytree(art, bad)
    man = json.loads((bad / "pagedkv.json").read_text())
    change(man)
    (bad / "pagedkv.json").write_text(json.dumps(man))
    return bad


def _drop_groups(man):
    del man["groups"]


def _grow_sliding_group(man):
    man["groups"][-1]["num_blocks"] = man["pool"]["num_blocks"]


def _empty_or_short_group(man):
    man["groups"][-1]["layers"] = man["groups"][-1]["layers"][:-1]


def _other_tables(man):
    """Groups (and the manifest's own input names) that imply another number of block tables than the .pte
    takes: Gemma's two groups merged into one, Mistral's one split in two."""
    groups, n = man["groups"], man["model"]["num_layers"]
    if len(groups) > 1:
        man["groups"] = [{"window": 0, "layers": list(range(n)), "num_blocks": man["pool"]["num_blocks"]}]
    else:
        man["groups"] = [dict(groups[0], layers=[i]) for i in range(n)]
    man["artifacts"]["pte"]["inputs"] = ["input_ids", "positions", "seq_ids", "block_tables"] + \
        [f"block_tables_{g}" for g in range(1, len(man["groups"]))] + ["logits_rows"]


@pytest.mark.parametrize("change,needles", [
    # Gemma: the manifest's input names list two tables; Mistral: its one sliding layer group read as
    # global has more blocks than the program's buffers
    (_drop_groups, {"gemma3": "block table", "gemma2": "block table", "mistral": "codes tensor"}),
    (_grow_sliding_group, {"gemma3": "codes tensor", "gemma2": "codes tensor", "mistral": "codes tensor"}),
    (_empty_or_short_group, {"gemma3": "without layers", "gemma2": "leaves layer 2 out", "mistral": "leaves layer 1 out"}),
    (_other_tables, {"gemma3": "takes 6 inputs (2 block table(s))", "gemma2": "takes 6 inputs (2 block table(s))",
                     "mistral": "takes 5 inputs (1 block table(s))"}),
])
def test_groups_entry_inconsistent_with_the_pte_is_one_line_exit_2(host_cli, exported, prompt, tmp_path, change,
                                                                   needles):
    family, window, art, _ = exported
    bad = edit_manifest(art, tmp_path, change)
    p = run_cli(host_cli, bad, prompt[0], "--json")
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("pagedkv-runner:")]
    assert p.returncode == 2 and len(err) == 1 and needles[family] in err[0] and "export" in err[0], p.stderr
    assert p.stdout == ""


# the sliding layers' own spec (export --sliding-spec; tests/test_groups.py SLIDING_SPEC): manifest format 2
SLIDING_SPEC = "default:k_bits=5,v_bits=3,v_group=16"


@pytest.fixture(scope="module")
def sliding_spec_export(tokenizer, tmp_path_factory):
    """Tiny Gemma 3 (window 16) exported to .pte with the default spec and SLIDING_SPEC on its sliding layer."""
    from export.artifacts import PoolRequest, export_artifacts

    art = tmp_path_factory.mktemp("groups-sliding-spec") / "artifacts"
    export_artifacts("tiny-gemma3", art, formats=("pte",), spec="default", sliding_spec=SLIDING_SPEC,
                     pool=PoolRequest(pool_tokens=512, max_seqs=1, block_size=BS), max_tokens_per_call=CALL,
                     model_and_tokenizer=(tiny("gemma3", FAMILIES["gemma3"]), tokenizer), accept_fidelity=True)
    return art


def test_runner_reads_a_sliding_spec_export_as_the_engine_does(host_cli, sliding_spec_export, prompt):
    """Format 2: the runner sizes the sliding layer's pool in its own spec, generates the tokens the Python
    engine generates on the same .pte, and counts each group's blocks in its spec (as budget_terms)."""
    from runtime_sim.session import open_artifacts
    from toolkit.block_pool import group_layout

    art = sliding_spec_export
    man = json.loads((art / "pagedkv.json").read_text())
    assert man["format_version"] == 2 and man["groups"][1]["spec"] is not None
    p = run_cli(host_cli, art, prompt[0], "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    engine = open_artifacts(art, "executorch")
    engine.prefill_chunk = CALL
    c = engine.new_conversation()
    assert r["generated"] == list(engine.generate(c, prompt[1], max_new_tokens=DECODE))
    layout = PoolLayout.from_dict(man["pool"])
    groups = [LayerGroup.from_dict(g) for g in man["groups"]]
    want = [group_layout(layout, g).bytes_per_token // layout.num_layers * len(g.layers) * BS for g in groups]
    assert [g["bytes_per_block"] for g in r["groups"]] == want
    assert want[1] < want[0]  # one layer each: K5/V3 records are smaller than K8/V4's
    assert [g["used_blocks"] for g in r["groups"]] == [g["used_blocks"] for g in engine.stats()["groups"]]
    assert budget_terms(layout, groups) == (
        want[0], r["pool_fixed_bytes"] + want[1] * r["groups"][1]["total_blocks"])


def _version_1(man):
    man["format_version"] = 1


def _rotation_differs(man):
    man["groups"][1]["spec"]["rotate"] = not man["groups"][1]["spec"]["rotate"]


def _global_group_spec(man):
    man["groups"][0]["spec"] = man["groups"][1]["spec"]


def _wider_records(man):
    """A group spec whose records are not the .pte's: the program's pool tensors disagree."""
    man["groups"][1]["spec"]["k_bits"] = 8


def _pool_rotation_differs(man):
    """The pool's spec edited (its groups' too, so that they agree): the .pte's pool identity catches it."""
    for spec in (man["pool"]["spec"], man["groups"][1]["spec"]):
        spec["rotate"] = not spec["rotate"]


@pytest.mark.parametrize("change,needle", [
    (_pool_rotation_differs, "differs in spec"),
    (_version_1, "format_version 1 disagree"),
    (_rotation_differs, "rotate/fp_tail/sink_blocks differ"),
    (_global_group_spec, "not a sliding group"),
    (_wider_records, "differs in group_specs"),
])
def test_sliding_spec_manifest_tampered_is_one_line_exit_2(host_cli, sliding_spec_export, prompt, tmp_path, change,
                                                           needle):
    bad = edit_manifest(sliding_spec_export, tmp_path, change)
    p = run_cli(host_cli, bad, prompt[0], "--json")
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("pagedkv-runner:")]
    assert p.returncode == 2 and len(err) == 1 and needle in err[0] and "export" in err[0], p.stderr
    assert p.stdout == ""

