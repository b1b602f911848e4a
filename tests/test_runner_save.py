"""The Android runner saves and restores conversations in the format runtime_sim's engine reads and
writes (toolkit/CONVERSATION_FORMAT.md): pagedkv-runner --save / --restore (Runner::save / restore).

On the tiny llama and a tiny Gemma 3 (two layer groups) exported to .pte with the default KV spec (8/4-bit codes with scales, rotation, the
fp16 sink and tail stage rows: every part of the file), the runner and runtime_sim's ExecuTorch backend
run the same program through the same pagedkv kernels:
  (a) the runner's file is byte for byte the file the Python engine writes after the same calls, and
      the Python engine that restores it gives the next token's logits bit for bit;
  (b) a file the Python engine saved is restored by the runner, which continues with the greedy
      tokens it produces without save/restore;
  (c) a truncated file, one of another model, one of another spec: exit 2, one line, nothing written;
  and the aarch64 build under qemu restores the Python engine's file and continues the same way.
"""

from __future__ import annotations

import json
import struct
import subprocess
import zlib

import numpy as np
import pytest

from tests.native_build import build, need, qemu_env, tiny_pte_fixtures

CTX, DECODE = 50, 4  # 50 prompt tokens: three full blocks of 16 and a partly filled one
SPLIT = 32  # (b): Python prefills the first 32 tokens (one .pte call), the runner the rest
CHAT_APP = b'{"system_prompt": null, "messages": []}'  # what the runner stores for a conversation without chat


@pytest.fixture(scope="module", params=["llama", "gemma3", "gemma3-sliding-spec"])
def fixtures(request, tmp_path_factory, wikitext):
    """The artifacts dir: the tiny llama (make_fixtures.py), or a tiny Gemma 3 (a sliding layer with a
    window of 16 beside a global one: two layer groups, the sliding one with holes in the file), also
    with the sliding layer in its own spec (export --sliding-spec: manifest format 2, file version 3)."""
    out = tmp_path_factory.mktemp(f"runner-save-{request.param}")
    if request.param == "llama":
        return tiny_pte_fixtures(out, wikitext, "--spec", "default") / "artifacts"
    import make_fixtures

    from export.artifacts import PoolRequest, export_artifacts
    from tests.test_runner_groups import tiny

    from tests.test_runner_groups import SLIDING_SPEC

    export_artifacts("tiny-gemma3", out / "artifacts", formats=("pte",), spec="default",
                     pool=PoolRequest(pool_tokens=512, max_seqs=2, block_size=16), max_tokens_per_call=32,
                     model_and_tokenizer=(tiny("gemma3", 16), make_fixtures.tiny_bpe_tokenizer(wikitext)),
                     sliding_spec=SLIDING_SPEC if request.param == "gemma3-sliding-spec" else None, accept_fidelity=True)
    return out / "artifacts"


@pytest.fixture(scope="module")
def host_cli():
    need("g++", "javac")
    return build("host") / "pagedkv-runner"


def runner(binary, art, wikitext, *extra):
    cmd = [binary, art, "--prompt-file", wikitext, "--ctx", str(CTX), "--decode", str(DECODE), "--threads", "1",
           "--json", *extra]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)


def result(p) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runner_saved(host_cli, fixtures, wikitext, tmp_path_factory):
    """One runner run with --save: its JSON result, the file, and its prompt's ids (the first CTX tokens of
    the text as the runner's tokenizer encodes them: the file's first tokens)."""
    from runtime_sim import conversation_file as cf

    saved = tmp_path_factory.mktemp("runner-saved") / "runner.pkvc"
    r = result(runner(host_cli, fixtures, wikitext, "--save", saved))
    return r, saved, cf.read(saved).tokens[:CTX]


def test_runner_file_read_by_python_bit_for_bit(runner_saved, fixtures, tmp_path):
    from runtime_sim import conversation_file as cf
    from runtime_sim.session import open_artifacts

    r, saved, ids = runner_saved
    assert r["saved_bytes"] == saved.stat().st_size > 0
    d = cf.read(saved)
    assert d.tokens == ids + r["generated"][:-1] and d.pending == r["generated"][-1:]
    assert d.has_stage and d.scale_bytes > 0 and d.app == CHAT_APP
    if len(d.groups) > 1:  # Gemma 3: the sliding group's blocks that left the window are holes in the file
        assert d.groups[1].window == 16 and not all(d.groups[1].present) and all(d.groups[0].present)

    # the Python engine on the same .pte, the same calls (prefill in calls of 32, then greedy steps)
    ref = open_artifacts(fixtures, "executorch", threads=1)
    c = ref.new_conversation()
    assert list(ref.generate(c, ids, DECODE)) == r["generated"]
    ours = tmp_path / "python.pkvc"
    ref.save(c, ours, app=CHAT_APP)
    # the pool records (codes, scales, stage rows), tokens and header are byte-equal: the whole file
    assert saved.read_bytes() == ours.read_bytes()

    # Python restores the runner's file: the next token's logits are the uninterrupted engine's, bit for bit
    eng = open_artifacts(fixtures, "executorch", threads=1)
    cr = eng.restore(saved)
    assert eng.counters.prefill_tokens == 0  # restored, not prefilled
    got = eng.step({cr: []})[cr]
    want = ref.step({c: []})[c]
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_python_file_restored_by_runner_continues_greedy(host_cli, runner_saved, fixtures, wikitext, tmp_path):
    from runtime_sim.session import open_artifacts

    plain, _, ids = runner_saved  # the runner's greedy tokens without save/restore
    eng = open_artifacts(fixtures, "executorch", threads=1)
    c = eng.new_conversation()
    eng.prefill(c, ids[:SPLIT])
    saved = tmp_path / "python.pkvc"
    eng.save(c, saved)
    r = result(runner(host_cli, fixtures, wikitext, "--restore", saved))
    assert r["restored_tokens"] == SPLIT
    assert r["generated"] == plain["generated"]
    # and both are what the Python engine continues with
    assert list(eng.generate(c, ids[SPLIT:], DECODE)) == plain["generated"]


def test_aarch64_runner_restores_a_python_file(runner_saved, fixtures, wikitext, tmp_path):
    """The cross-built runner under qemu-aarch64 (-cpu max: NEON kernels) restores a file the x86 Python
    engine saved and continues with the host runner's greedy tokens (correctness only under qemu; its
    own files differ from x86's in the last bits of the linears' K/V, so no byte equality here)."""
    from runtime_sim.session import open_artifacts

    need("aarch64-linux-gnu-g++", "qemu-aarch64-static", "javac")
    b = build("cross")
    plain, _, ids = runner_saved
    eng = open_artifacts(fixtures, "executorch", threads=1)
    c = eng.new_conversation()
    eng.prefill(c, ids[:SPLIT])
    saved = tmp_path / "python.pkvc"
    eng.save(c, saved)
    env = qemu_env(b)
    cmd = ["qemu-aarch64-static", "-cpu", "max", b / "pagedkv-runner", fixtures, "--prompt-file", wikitext, "--ctx",
           CTX, "--decode", DECODE, "--threads", "1", "--json", "--restore", saved]
    r = result(subprocess.run([str(x) for x in cmd], capture_output=True, text=True, timeout=1800, env=env))
    assert r["isa"] == "neon-dotprod" and r["restored_tokens"] == SPLIT
    assert r["generated"] == plain["generated"]


def reseal(raw: bytes) -> bytes:
    """A file whose checksum matches its (changed) bytes: what another writer's valid file looks like."""
    body = raw[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


SHA_AT = 12  # magic (8) + version (4)
SPEC_AT = SHA_AT + 32 + 4 * 4  # after the sha256 and the four dims
ROTATE_AT = SPEC_AT + 6 * 4  # k_bits, v_bits, k_group, v_group, k_sym, v_sym, rotate


@pytest.mark.parametrize("case, needle", [
    ("truncated", "checksum mismatch"),
    ("other-model", "was saved with another model"),
    ("other-spec", "was saved with KV spec"),
    ("not-the-prompt", "are not the start of the"),
    ("first-group-spec", "layer group 0 is not a sliding group after the first"),
])
def test_runner_rejects_bad_files_in_one_line(host_cli, runner_saved, fixtures, wikitext, tmp_path, case, needle):
    from runtime_sim import conversation_file as cf
    from runtime_sim.session import open_artifacts

    if case == "first-group-spec" and json.loads((fixtures / "pagedkv.json").read_text())["format_version"] != 2:
        pytest.skip("only an export whose sliding group stores its own spec writes group specs")
    eng = open_artifacts(fixtures, "executorch", threads=1)
    c = eng.new_conversation()
    ids = runner_saved[2]
    eng.prefill(c, ids[:SPLIT] if case != "not-the-prompt" else ids[1:SPLIT])
    good = tmp_path / "good.pkvc"
    eng.save(c, good)
    raw = good.read_bytes()

    def first_group_spec(_):  # the sliding group's own spec given to the first group too (a valid writer's bytes)
        d = cf.read(good)
        d.groups[0].spec = d.groups[1].spec
        cf.write(tmp_path / "first.pkvc", d)
        return (tmp_path / "first.pkvc").read_bytes()

    bad = {
        "truncated": lambda b: b[: len(b) // 2],
        "other-model": lambda b: reseal(b[:SHA_AT] + bytes(32) + b[SHA_AT + 32:]),
        "other-spec": lambda b: reseal(b[:ROTATE_AT] + struct.pack("<I", 1 - struct.unpack_from("<I", b, ROTATE_AT)[0])
                                       + b[ROTATE_AT + 4:]),
        "not-the-prompt": lambda b: b,
        "first-group-spec": first_group_spec,
    }[case](raw)
    path = tmp_path / "bad.pkvc"
    path.write_bytes(bad)
    out = tmp_path / "never.pkvc"
    p = runner(host_cli, fixtures, wikitext, "--restore", path, "--save", out)
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    # one line of the runner's (ExecuTorch's own "I ..." log lines aside, as in test_runner_cli.py)
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("pagedkv-runner:")]
    if case == "other-spec" and json.loads((fixtures / "pagedkv.json").read_text())["format_version"] == 2:
        needle = "holds an invalid layer-group spec"  # the sliding group's own spec no longer fits the pool's
    assert len(err) == 1 and needle in err[0], p.stderr
    assert not out.exists() and path.read_bytes() == bad  # nothing saved, the bad file left as it was


# ---------------------------------------------------------------------------------------------------
# A trim (save, then shrink to the blocks in use) with a closed conversation's blocks below a live one's:
# Runner::shrink moves the live conversation's blocks down before it lowers the limit (runner_trim.cpp).

def test_shrink_moves_used_blocks_down_and_keeps_the_tokens(fixtures, tmp_path):
    """Two conversations, the first (lowest block ids) closed: shrink(0) moves the second's blocks of layer
    group 0 into the freed ones, so the limit falls to the blocks in use; after growing back the second
    conversation goes on with the greedy tokens it gives without the shrink."""
    need("g++", "javac")
    exe = build("host") / "runner_test"
    ids = [5 + (i * 37) % 200 for i in range(60)]
    start = [{"op": "new"}, {"op": "new"},
             {"op": "generate", "conv": 0, "ids": ids[:CTX], "decode": DECODE},
             {"op": "generate", "conv": 1, "ids": ids[:CTX], "decode": DECODE},
             {"op": "close", "conv": 0}]
    trim = [{"op": "shrink", "target": 0}, {"op": "grow", "target": 1 << 20}]
    goon = [{"op": "generate", "conv": 1, "ids": ids[CTX:], "decode": 8}]
    runs = []
    for name, steps in (("plain", start + goon), ("trim", start + trim + goon)):
        d = tmp_path / name
        d.mkdir()
        (d / "script.json").write_text(json.dumps({"policy": "error", "horizon": 1024, "threads": 1, "steps": steps}))
        p = subprocess.run([str(exe), "--ladder", str(fixtures), str(d / "script.json"), str(d / "out.json")],
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads((d / "out.json").read_text())["steps"])
    plain, got = runs
    closed, shrunk = got[4], got[5]
    assert closed["used"] >= 2  # the second conversation's blocks of group 0, all above the first's
    assert shrunk["moved_blocks"] == closed["used"] and shrunk["usable_after"] == closed["used"]
    assert shrunk["usable_before"] > shrunk["usable_after"] and shrunk["released_bytes"] > 0
    assert shrunk["kinds"] == closed["kinds"] and shrunk["free"] == 0
    assert got[-1]["tokens"] == plain[-1]["tokens"] and got[-1]["used"] == plain[-1]["used"]
