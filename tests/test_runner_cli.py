"""pagedkv-runner (android_demo/native/src/runner_cli.cpp): the app's Runner from the command line.

On a tiny llama exported to .pte (make_fixtures.py, fp32 pool): the greedy tokens equal HF's, the
memory breakdown adds up, bad input is one line and exit 2; then the aarch64 build once under qemu
(correctness only: qemu says nothing about speed). Prerequisites as tests/test_android_native.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.native_build import build, need, qemu_env


@pytest.fixture(scope="module")
def fixtures(tiny_pte_fp32, tmp_path_factory):
    """(make_fixtures' dir, its first case, a prompt file holding the case's prompt); the dir is shared
    with other modules (conftest.tiny_pte_fp32): read-only."""
    case = json.loads((tiny_pte_fp32 / "expected.json").read_text())["cases"][0]
    prompt = tmp_path_factory.mktemp("runner-cli") / "prompt.txt"
    prompt.write_text(case["prompt"], encoding="utf-8")
    return tiny_pte_fp32, case, prompt


@pytest.fixture(scope="module")
def host_cli():
    need("g++", "javac")
    return build("host") / "pagedkv-runner"


def cli(binary, fix, *extra, prefix=(), env=None):
    out, case, prompt = fix
    cmd = [*prefix, str(binary), str(out / "artifacts"), "--prompt-file", str(prompt),
           "--ctx", str(len(case["prompt_ids"])), "--decode", str(len(case["hf_greedy"])), "--threads", "1", *extra]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800, env=env)


def test_cli_greedy_tokens_and_memory_breakdown(host_cli, fixtures):
    p = cli(host_cli, fixtures, "--json", "--budget-mb", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    _, case, _ = fixtures
    assert r["generated"] == case["hf_greedy"]
    assert r["ctx"] == len(case["prompt_ids"]) and r["threads"] == 1
    assert r["ttft_s"] > 0 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    # the breakdown: every part resident, the parts within the resident set, the peak above it
    for k in ("weights_file_resident_bytes", "kv_pool_resident_bytes", "activations_resident_bytes",
              "libraries_resident_bytes"):
        assert r[k] > 0, k
    assert r["peak_rss_bytes"] >= r["rss_bytes"] > 0
    parts = (r["weights_file_resident_bytes"] + r["kv_pool_resident_bytes"] + r["activations_resident_bytes"]
             + r["libraries_resident_bytes"])
    assert parts + r["rest_bytes"] == r["rss_bytes"] and r["rest_bytes"] > 0
    # the budget of 1 MiB commits at most 1 MiB of blocks (+ the non-block tensors of the arenas)
    assert r["usable_blocks"] < r["pool_blocks"] or r["kv_pool_reserved_bytes"] <= 2 << 20
    assert r["kv_pool_resident_bytes"] <= r["kv_pool_reserved_bytes"] + 4096 * 64
    assert r["kv_bytes"] <= r["kv_pool_resident_bytes"]


def test_cli_budget_blocks_equal_the_python_formula(host_cli, fixtures):
    """runner.cpp's budget_blocks is the twin of toolkit.pool_layout.blocks_for_budget: for the same
    manifest and budget the runner reports the same usable blocks (capped at the exported pool)."""
    from toolkit.pool_layout import MIN_POOL_BLOCKS, PoolLayout, blocks_for_budget

    out, _, _ = fixtures
    layout = PoolLayout.from_dict(json.loads((out / "artifacts" / "pagedkv.json").read_text())["pool"])
    # the fixture's pool: 32 blocks of 32 KiB + 32 KiB of non-block bytes, so 1 MiB holds 30 blocks (a budget
    # that ignored the non-block bytes would say 32) and 2 MiB holds them all
    seen = set()
    for mb in (1, 2):
        p = cli(host_cli, fixtures, "--json", "--budget-mb", str(mb))
        assert p.returncode == 0, p.stderr[-3000:]
        r = json.loads(p.stdout.strip().splitlines()[-1])
        want = min(layout.num_blocks, blocks_for_budget(layout, mb << 20))
        assert want >= MIN_POOL_BLOCKS
        assert r["usable_blocks"] == want and r["pool_blocks"] == layout.num_blocks, (mb, r["usable_blocks"], want)
        assert r["pool_fixed_bytes"] == layout.fixed_bytes
        seen.add(r["usable_blocks"] < layout.num_blocks)
    assert seen == {True, False}  # one budget below the exported pool, one above it


def test_cli_manifest_pool_sizes_that_do_not_add_up(host_cli, fixtures, tmp_path):
    out, _, prompt = fixtures
    art = tmp_path / "artifacts"
    shutil.copytree(out / "artifacts", art)
    man = json.loads((art / "pagedkv.json").read_text())
    man["pool"]["total_bytes"] = man["pool"]["num_blocks"] * man["pool"]["block_size"] * man["pool"]["bytes_per_token"] - 1
    (art / "pagedkv.json").write_text(json.dumps(man))
    p = subprocess.run([str(host_cli), str(art), "--prompt-file", str(prompt), "--ctx", "4", "--decode", "2",
                        "--budget-mb", "1"], capture_output=True, text=True, timeout=600)
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("pagedkv-runner:")]
    assert p.returncode == 2 and len(err) == 1 and "pool sizes do not add up" in err[0] and "pagedkv export" in err[0], \
        p.stderr


def test_cli_text_report(host_cli, fixtures):
    p = cli(host_cli, fixtures)
    assert p.returncode == 0, p.stderr[-3000:]
    for word in ("time to first", "prefill", "decode", "peak RSS (VmHWM)", "weights (mapped .pte", "KV pool",
                 "activations arena", "rest"):
        assert word in p.stdout, word


@pytest.mark.parametrize("args,needle", [
    (["--ctx", "100000"], "fewer than --ctx 100000"),
    (["--ctx", "ten"], "--ctx ten is not an integer"),
    (["--budget-mb", "0", "--bogus"], "unknown option --bogus"),
    (["--prefill-chunk", "0"], "--prefill-chunk 0 is not an integer >= 1"),
])
def test_cli_bad_input_one_line_exit_2(host_cli, fixtures, args, needle):
    p = cli(host_cli, fixtures, *args)
    assert p.returncode == 2, p.stdout + p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("pagedkv-runner:")]
    assert len(err) == 1 and needle in err[0], p.stderr


def test_cli_prefill_chunk_same_tokens_fewer_activation_pages(host_cli, fixtures):
    """--prefill-chunk 3: the same greedy tokens, and fewer pages of the activations arena resident (it is
    planned for max_tokens_per_call tokens and not prefaulted: a smaller call writes part of each slot);
    the .pte's mapped pages at the end are one call's (mapped_pages.h), at most those without the release."""
    runs = {}
    for name, extra, env in (("default", [], None), ("chunk3", ["--prefill-chunk", "3"], None),
                             ("keep", [], dict(os.environ, PAGEDKV_KEEP_MAPPED_PAGES="1"))):
        p = cli(host_cli, fixtures, "--json", "--budget-mb", "1", *extra, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = json.loads(p.stdout.strip().splitlines()[-1])
    _, case, _ = fixtures
    assert all(r["generated"] == case["hf_greedy"] for r in runs.values())
    assert 0 < runs["chunk3"]["activations_resident_bytes"] < runs["default"]["activations_resident_bytes"]
    assert runs["default"]["activations_resident_bytes"] <= runs["default"]["activations_reserved_bytes"] + 4096
    assert 0 < runs["default"]["weights_file_resident_bytes"] <= runs["keep"]["weights_file_resident_bytes"]


def test_cli_missing_artifacts_and_pool_too_small(host_cli, fixtures, tmp_path, wikitext):
    out, case, prompt = fixtures
    p = subprocess.run([str(host_cli), str(tmp_path), "--prompt-file", str(prompt), "--ctx", "4",
                        "--decode", "2"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and "pagedkv export" in p.stderr, p.stderr
    # the fixture's pool holds 512 tokens: 500 + 24 do not fit, said before anything is generated
    man = json.loads((out / "artifacts" / "pagedkv.json").read_text())["pool"]
    assert man["num_blocks"] * man["block_size"] == 512
    p = subprocess.run([str(host_cli), str(out / "artifacts"), "--prompt-file", str(wikitext), "--ctx", "500",
                        "--decode", "24", "--json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and "do not fit the pool: 32 usable blocks of 16 tokens (512 tokens)" in p.stderr, p.stderr
    assert p.stdout == ""


def test_cli_aarch64_under_qemu(fixtures):
    """The cross-built CLI under qemu-aarch64 (-cpu max): the same greedy tokens, a full report."""
    need("aarch64-linux-gnu-g++", "qemu-aarch64-static", "javac")
    b = build("cross")
    env = qemu_env(b)
    p = cli(b / "pagedkv-runner", fixtures, "--json", prefix=("qemu-aarch64-static", "-cpu", "max"), env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["generated"] == fixtures[1]["hf_greedy"]
    assert r["isa"] == "neon-dotprod"
    assert r["weights_file_resident_bytes"] > 0 and r["peak_rss_bytes"] > 0


def assert_runner_equals_runtime_sim(host_cli, fixtures, art):
    """The host runner's 12 greedy tokens on the fixture prompt equal runtime_sim's on the same .pte."""
    from runtime_sim.session import open_artifacts

    _, case, prompt = fixtures
    p = subprocess.run([str(host_cli), str(art), "--prompt-file", str(prompt), "--ctx",
                        str(len(case["prompt_ids"])), "--decode", "12", "--threads", "1", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])["generated"]
    engine = open_artifacts(art, "executorch")
    sim = list(engine.generate(engine.new_conversation(), case["prompt_ids"], max_new_tokens=12))
    assert got == sim


def test_cli_runs_8da4w_e8_with_embedding_byte(host_cli, fixtures, tmp_path, wikitext):
    """.pte weights 8da4w-e8: the token embedding is int8 (quantized_decomposed::embedding_byte, linked
    into the runner); the runner's greedy tokens equal runtime_sim's on the same program."""
    import make_fixtures
    from executorch.exir._serialize._program import deserialize_pte_binary

    from export.artifacts import PoolRequest, export_artifacts
    from toolkit.tiny_models import tiny_model

    art = tmp_path / "e8"
    tok = make_fixtures.tiny_bpe_tokenizer(wikitext)
    export_artifacts("tiny-llama", art, formats=("pte",), spec="fp32",
                     pool=PoolRequest(pool_tokens=512, max_seqs=2, block_size=16), max_tokens_per_call=32,
                     model_and_tokenizer=(tiny_model("llama"), tok), pte_weights="8da4w-e8", accept_fidelity=True)
    res = deserialize_pte_binary((art / "model.pte").read_bytes())
    ops = {op.name for op in getattr(res, "program", res).execution_plan[0].operators}
    assert "quantized_decomposed::embedding_byte" in ops and "aten::embedding" not in ops, ops
    assert_runner_equals_runtime_sim(host_cli, fixtures, art)


def test_cli_runs_8da4w_asym_e8h8(host_cli, fixtures, tmp_path, wikitext):
    """.pte weights 8da4w-asym-e8h8 on a tiny llama whose linears lie on a Q4_1 grid (d*q + m per block
    of 32, as a GGUF's dequantization): every int4 block is stored exactly, every linear and block sum
    runs on XNNPACK (the activation chunks' slices stay outside), the head and the embedding are int8, and
    the runner's greedy tokens equal runtime_sim's on the same program."""
    import make_fixtures
    import torch
    from executorch.exir._serialize._program import deserialize_pte_binary

    from export.artifacts import PoolRequest, export_artifacts
    from toolkit.tiny_models import tiny_model

    model = tiny_model("llama")
    head = model.get_output_embeddings()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and mod is not head:
                n, k = mod.weight.shape
                w = mod.weight.reshape(n, k // 32, 32)
                lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
                d = ((hi - lo) / 15).to(torch.bfloat16).float()  # a bf16 step: XNNPACK keeps bf16 scales
                mod.weight.copy_((torch.clamp(torch.round((w - lo) / d), 0, 15) * d + lo).reshape(n, k))
    art = tmp_path / "asym"
    tok = make_fixtures.tiny_bpe_tokenizer(wikitext)
    m = export_artifacts("tiny-llama", art, formats=("pte",), spec="fp32",
                         pool=PoolRequest(pool_tokens=512, max_seqs=2, block_size=16), max_tokens_per_call=32,
                         model_and_tokenizer=(model, tok), pte_weights="8da4w-asym-e8h8", accept_fidelity=True)
    entry = m["artifacts"]["pte"]
    assert entry["weights"] == "8da4w-asym-e8h8"
    assert entry["int4_blocks"] > 0 and entry["int4_exact_blocks"] == entry["int4_blocks"], entry
    res = deserialize_pte_binary((art / "model.pte").read_bytes())
    plan = getattr(res, "program", res).execution_plan[0]
    ops = {op.name for op in plan.operators}
    assert "quantized_decomposed::embedding_byte" in ops and "aten::embedding" not in ops, ops
    # no linear, matmul or weight dequantization left to the portable kernels: all of them are XNNPACK's
    assert not ops & {"aten::linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::permute_copy"}, ops
    assert not any("dequantize" in op or "choose_qparams" in op for op in ops), ops
    assert plan.delegates and all(d.id == "XnnpackBackend" for d in plan.delegates)
    assert_runner_equals_runtime_sim(host_cli, fixtures, art)
