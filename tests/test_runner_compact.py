"""The Android runner on a .pte with a compact region (issue 25: `pagedkv export --compact-blocks N`).

The program's global layers call pagedkv::quantized_paged_attention_mixed and take the compact region
as inputs (compact_codes_L, compact_scales_L after the block tables, before logits_rows) that ExecuTorch
does not memory-plan: the runner allocates them once from the manifest and passes them in every call.
With policy error (the default) nothing compacts, so on the tiny llama (default spec, 4 compact blocks)
its greedy tokens equal runtime_sim's ExecuTorch backend on the same artifact, which passes its own
compact arrays; the region is counted in the pool's bytes (the budget formula is toolkit.pool_layout's);
a manifest whose compact region is bad, or that disagrees with the program, is one line and exit 2.
The runner's compact tier at work (the adaptive ladder, compacted save/restore) is tests/test_runner_ladder.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.native_build import build, need, tiny_pte_fixtures

COMPACT_BLOCKS = 4
CTX, DECODE = 50, 12  # 50 prompt tokens: three full blocks of 16 and a partly filled one (sink + tail + quantized)


@pytest.fixture(scope="module")
def art(tmp_path_factory, wikitext):
    out = tmp_path_factory.mktemp("runner-compact")
    # 8,192 tokens (512 blocks): more than a 1 MiB budget holds, so the budget check below bites
    return tiny_pte_fixtures(out, wikitext, "--spec", "default", "--pool-tokens", "8192", "--compact-blocks",
                             str(COMPACT_BLOCKS)) / "artifacts"


@pytest.fixture(scope="module")
def host_cli():
    need("g++", "javac")
    return build("host") / "pagedkv-runner"


def run_cli(binary, art, wikitext, *extra):
    cmd = [binary, art, "--prompt-file", wikitext, "--ctx", str(CTX), "--decode", str(DECODE), "--threads", "1",
           "--json", *extra]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)


def test_runner_runs_a_compact_pte_like_runtime_sim(host_cli, art, wikitext, tmp_path):
    from runtime_sim import conversation_file as cf
    from runtime_sim.session import open_artifacts
    from toolkit.manifest import layout_from_manifest
    from toolkit.pool_layout import blocks_for_budget

    man = json.loads((art / "pagedkv.json").read_text())
    layout = layout_from_manifest(man)
    assert layout.num_compact_blocks == COMPACT_BLOCKS
    assert any(n.startswith("compact_codes_") for n in man["artifacts"]["pte"]["inputs"])
    saved = tmp_path / "c.pkvc"
    p = run_cli(host_cli, art, wikitext, "--save", saved)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["ladder"]["policy"] == "adaptive"  # --policy auto (the default) on a .pte with a compact region
    # the prompt's ids as the runner encoded them: the saved file's first CTX tokens (no compact block in it)
    f = cf.read(saved)
    ids = list(f.tokens[:CTX])
    engine = open_artifacts(art, "executorch")
    assert set(engine.backend.compact_arrays()) == set(range(layout.num_layers))  # the mixed op's inputs
    sim = list(engine.generate(engine.new_conversation(), ids, max_new_tokens=DECODE))
    assert r["generated"] == sim and len(sim) == DECODE
    # the compact region is pool memory: its blocks and bytes, in the fixed bytes the budget formula uses
    per_layer = layout.layer_tensor_bytes()
    assert r["compact_blocks"] == COMPACT_BLOCKS
    assert r["compact_bytes"] == (per_layer["compact_codes"] + per_layer["compact_scales"]) * layout.num_layers
    assert r["pool_fixed_bytes"] == layout.fixed_bytes
    # mapped and resident (prefaulted at startup; mincore counts whole pages, the reserved bytes do not)
    assert r["kv_pool_reserved_bytes"] > r["compact_bytes"] and r["kv_pool_resident_bytes"] > r["compact_bytes"]
    # a budget below the exported pool: the same usable blocks as the Python formula (compact region counted)
    want = blocks_for_budget(layout, 1 << 20)
    assert 4 < want < layout.num_blocks
    p = run_cli(host_cli, art, wikitext, "--budget-mb", 1)
    assert p.returncode == 0, p.stderr[-3000:]
    r2 = json.loads(p.stdout.strip().splitlines()[-1])
    assert r2["usable_blocks"] == want and r2["generated"] == sim


def _drop_compact(m):
    for k in ("compact", "num_compact_blocks", "compact_codes_shape", "compact_scales_shape"):
        del m["pool"][k]


def _bigger_region(m):  # consistent in the manifest, not what the program takes
    pool = m["pool"]
    pool["num_compact_blocks"] += 1
    pool["compact_codes_shape"][0] += 1
    pool["compact_scales_shape"][0] += 1


BAD = {
    "half-region": (lambda m: m["pool"].pop("num_compact_blocks"), "half a compact region"),
    "zero-blocks": (lambda m: m["pool"].update(num_compact_blocks=0), "num_compact_blocks 0, outside 1.."),
    "codes-shape": (lambda m: m["pool"]["compact_codes_shape"].__setitem__(3, 99), "compact_codes_shape other than"),
    "rotation": (lambda m: m["pool"]["compact"].update(rotate=not m["pool"]["compact"]["rotate"]), "rotation differs"),
    "bigger-spec": (lambda m: m["pool"]["compact"].update(k_bits=8, v_bits=8), "not smaller than the pool's spec"),
    "no-inputs": (lambda m: m["artifacts"]["pte"].update(
        inputs=[n for n in m["artifacts"]["pte"]["inputs"] if not n.startswith("compact_")]), "lists no compact_codes_L"),
    "bad-layer": (lambda m: m["artifacts"]["pte"].update(
        inputs=[n.replace("compact_codes_0", "compact_codes_7") for n in m["artifacts"]["pte"]["inputs"]]),
        "lists the input 'compact_codes_7'"),
    "no-region": (_drop_compact, "describes no compact region"),
    "program-disagrees": (_bigger_region, "is not compact_codes_0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_compact_manifest_one_line_exit_2(host_cli, art, wikitext, tmp_path, case):
    edit, needle = BAD[case]
    bad = tmp_path / "artifacts"
    shutil.copytree(art, bad)
    m = json.loads((bad / "pagedkv.json").read_text())
    edit(m)
    (bad / "pagedkv.json").write_text(json.dumps(m))
    p = run_cli(host_cli, bad, wikitext)
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("pagedkv-runner:")]
    assert p.returncode == 2 and len(err) == 1 and needle in err[0] and "pagedkv export" in err[0], p.stderr
    assert p.stdout == ""


# ---------------------------------------------------------------------------------------------------
# The block manager's compact region (block_manager.cpp BlockManager::compact) against its Python twin
# (toolkit/block_pool.py BlockPool.compact): one trace of new / reserve / commit / release / compact,
# the same outcome and the same used / free / free-compact counts after every operation (block ids are
# not compared: the two hand out blocks in another order by design, block_manager.h).

NB, BS, MS, NC = 12, 16, 3, 4


def record_compact_trace(seed: int, n_ops: int = 700) -> list[str]:
    import random

    from toolkit.block_pool import BlockPool
    from toolkit.errors import PagedKVError

    rnd = random.Random(seed)
    pool = BlockPool(NB, BS, MS, num_compact_blocks=NC)
    reserved: dict[int, int] = {}
    ops = []
    for _ in range(n_ops):
        live = pool.live_sequences()
        seq = rnd.choice(live) if live and rnd.random() < 0.9 else rnd.randrange(MS + 1)
        r = rnd.random()
        if r < 0.1 or not live:
            op = "new"
        elif r < 0.4:
            op = f"reserve {seq} {rnd.choice([1, 5, 16, 17, 40, 90])}"
        elif r < 0.7:
            room = reserved.get(seq, 0) - (pool.length(seq) if seq in live else 0)
            op = f"commit {seq} {min(room, rnd.choice([1, 3, 16, 20])) if room > 0 else 1}"
        elif r < 0.93:  # mostly full blocks, sometimes the partial one or one past the end
            full = pool.length(seq) // BS if seq in live else 0
            op = f"compact {seq} {rnd.randrange(full + 2) - (1 if rnd.random() < 0.05 else 0)}"
        else:
            op = f"release {seq}"
        ops.append(op)
        name, *args = op.split()
        try:
            if name == "new":
                reserved[pool.new_sequence()] = 0
            elif name == "reserve":
                pool.reserve(seq, int(args[1]))
                reserved[seq] = max(reserved[seq], pool.length(seq) + int(args[1]))
            elif name == "commit":
                pool.commit(seq, [rnd.randrange(1000) for _ in range(int(args[1]))])
            elif name == "compact":
                pool.compact(seq, int(args[1]))
            else:
                pool.release(seq)
                del reserved[seq]
        except PagedKVError:
            pass
    return ops


def replay_compact_python(ops: list[str]) -> list[str]:
    from tests.test_twins import replay_python
    from toolkit.block_pool import BlockPool

    return replay_python(ops, BlockPool(NB, BS, MS, num_compact_blocks=NC))


@pytest.mark.parametrize("seed", [1, 2])
def test_block_manager_compact_region_twin(tmp_path, seed):
    from tests.native_build import NATIVE

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.fail("g++ not installed: apt-get install -y g++")
    exe = tmp_path / "block_manager_test"
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(NATIVE / "src"), str(NATIVE / "tests" / "block_manager_test.cpp"),
                    str(NATIVE / "src" / "block_manager.cpp"), "-o", str(exe)], check=True, capture_output=True)
    assert subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).returncode == 0  # its unit tests
    ops = record_compact_trace(seed)
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(ops) + "\n")
    proc = subprocess.run([str(exe), "--trace", str(trace), str(NB), str(BS), str(MS), str(NC)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cpp, py = proc.stdout.splitlines(), replay_compact_python(ops)
    assert len(cpp) == len(py) == len(ops)
    for i, (op, a, b) in enumerate(zip(ops, py, cpp)):
        assert a == b, f"operation {i} '{op}': Python says '{a}', C++ says '{b}'"
    kinds = {line.split(" used")[0] for op, line in zip(ops, py) if op.startswith("compact")}
    assert kinds == {"compacted", "exhausted", "state error"}  # every outcome of compact happens
    assert any(" cfree 0" in line for line in py) and any(f" cfree {NC}" in line for line in py)


# ---------------------------------------------------------------------------------------------------
# Re-quantization in C++ (runner_compact.cpp requantize_records: the core's dequantize_record / quantize_record)
# against toolkit.quant.requantize, bit for bit, on one block of records (kv_heads * block_size) whose
# codes are arbitrary bytes (every bit pattern is a valid code) and whose scales and zero points are
# arbitrary float16 values of either sign, with one all-zero record (quantize's scale-0 path).

def _bits(spec) -> str:
    return ",".join(str(int(x)) for x in (spec.k_bits, spec.v_bits, spec.k_group, spec.v_group, spec.k_sym, spec.v_sym))


@pytest.mark.parametrize("pair", ["default->compact", "k8v8-asym->k4v2"])
def test_cpp_requantize_equals_toolkit_bit_for_bit(tmp_path, pair):
    import numpy as np
    import torch

    from toolkit.kv_spec import KVQuantSpec, compact_spec_for, record_layout
    from toolkit.quant import requantize
    from tests.native_build import build

    d, n = 64, 2 * 16  # head_dim 64, one block of 2 kv heads x 16 tokens
    if pair == "default->compact":
        src = KVQuantSpec()
        dst = compact_spec_for(src, d)
    else:
        src = KVQuantSpec(k_bits=8, v_bits=8, k_group=32, v_group=16, k_sym=False, v_sym=False)
        dst = KVQuantSpec(k_bits=4, v_bits=2, k_group=64, v_group=32, k_sym=True, v_sym=False)
    a = record_layout(src, d)
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 256, (n, a.code_width), dtype=np.uint8)
    mags = rng.uniform(1e-3, 0.2, (n, a.scale_width)).astype(np.float16)
    signs = np.where(rng.random((n, a.scale_width)) < 0.5, -1, 1).astype(np.float16)
    scales = mags * signs  # a zero point may be negative; a negative scale only flips values
    scales[3, :] = 0  # an all-zero record: quantize takes its scale-0 path
    want_c, want_s = requantize(torch.from_numpy(codes), torch.from_numpy(scales), src, dst, d)
    (tmp_path / "in.bin").write_bytes(codes.tobytes() + scales.tobytes())
    exe = build("host") / "runner_test"
    p = subprocess.run([str(exe), "--requantize", _bits(src), _bits(dst), str(d), str(n), str(tmp_path / "in.bin"),
                        str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = (tmp_path / "out.bin").read_bytes()
    want = want_c.numpy().tobytes() + want_s.numpy().tobytes()
    assert len(got) == len(want)
    assert got == want
