"""The Android runner's pressure ladder with the compact tier (issue 25), against runtime_sim's engine.

A tiny llama exported to .pte with the default KV spec, a pool of 10 default blocks of 16 tokens and a
compact region of 8 (`--compact-blocks 8`), runs in the runner (pagedkv-runner, or runner_test --ladder
for several conversations) and in runtime_sim's ExecuTorch engine on the same program, both with policy
adaptive and a compact horizon of 32 tokens. The pool is small enough that every rung is taken: aged
blocks of the active and of idle conversations re-quantized into the compact region, idle
conversations spilled and mapped back, the last rung sliding. Checked:
  - the same greedy tokens, the same rungs counted (Engine.stats()["ladder"] names), the same kinds of
    block in each conversation's table (hole / default / compact), and the pool's invariants after every
    step on both sides;
  - the conversation file the runner saves after that run is byte for byte the Python engine's file
    (tokens, default records, compact records re-quantized by C++ requantize_records, stage rows), and
    the Python engine that restores it gives the next token's logits bit for bit;
  - a compacted file the Python engine saved is restored by the runner, which continues with its own
    greedy tokens;
  - bad files (truncated, another compact spec, more compact blocks than the region has free): one error,
    the pool and every conversation as they were;
  - a tiny Gemma 3 (two layer groups) runs the same ladder like the engine; the cross-built runner under
    qemu-aarch64 restores a compacted file and compacts on its own with the host runner's tokens.
"""

from __future__ import annotations

import json
import struct
import subprocess
import zlib

import numpy as np
import pytest

from tests.native_build import build, need, qemu_env, tiny_pte_fixtures

POOL_TOKENS, COMPACT_BLOCKS, HORIZON = 160, 8, 32  # 10 default blocks, 8 compact ones
CTX, DECODE = 200, 100  # 300 tokens in 10 + 8 blocks: two compactions, then the compact region is full: a slide
SPLIT = 192  # Python prefills 192 tokens (six calls of 32, one compaction), the runner restores and goes on
CHAT_APP = b'{"system_prompt": null, "messages": []}'  # what the runner stores for a conversation without chat
LADDER_KEYS = ("slides", "spills", "spill_bytes", "spill_failures", "restores_from_spill", "spill_reprefills",
               "spilled_now", "compactions", "compacted_blocks", "compact_blocks_in_use")


@pytest.fixture(scope="module")
def art(tmp_path_factory, wikitext):
    out = tmp_path_factory.mktemp("runner-ladder")
    return tiny_pte_fixtures(out, wikitext, "--spec", "default", "--pool-tokens", str(POOL_TOKENS),
                             "--compact-blocks", str(COMPACT_BLOCKS)) / "artifacts"


@pytest.fixture(scope="module")
def host():
    need("g++", "javac")
    return build("host")


def engine(art, spill_dir=None):
    """runtime_sim's ExecuTorch engine on the artifacts, with the runner's ladder settings."""
    from runtime_sim.session import open_artifacts

    e = open_artifacts(art, "executorch", threads=1, policy="adaptive")
    e.compact_horizon = HORIZON
    if spill_dir is not None:
        e.spill_dir = spill_dir
    return e


def kinds(e, cid) -> list[int]:
    """A conversation's global block table as kinds: 0 hole, 1 default, 2 compact ([] if spilled)."""
    conv = e.conversations[cid]
    if conv.spill is not None:
        return []
    n = e.pool.main.num_blocks
    return [0 if b < 0 else 1 if b < n else 2 for b in e.pool.block_table(conv.seq)]


def runner_cli(host, art, wikitext, *extra):
    cmd = [host / "pagedkv-runner", art, "--prompt-file", wikitext, "--ctx", str(CTX), "--decode", str(DECODE),
           "--threads", "1", "--json", "--policy", "adaptive", "--compact-horizon", str(HORIZON), *extra]
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runner_run(host, art, wikitext, tmp_path_factory):
    """One runner run under the ladder, saved: its JSON result, the file, and its prompt's ids."""
    from runtime_sim import conversation_file as cf

    saved = tmp_path_factory.mktemp("runner-ladder-saved") / "runner.pkvc"
    r = runner_cli(host, art, wikitext, "--save", saved)
    return r, saved, cf.read(saved).tokens[:CTX]


def test_runner_ladder_compacts_like_runtime_sim(runner_run, art, tmp_path):
    from runtime_sim import conversation_file as cf

    r, saved, ids = runner_run
    # every rung the pool forces: two compactions of the active conversation fill the compact region, then a slide
    lad = r["ladder"]
    assert lad["policy"] == "adaptive" and lad["compactions"] >= 2 and lad["slides"] >= 1
    assert lad["compact_blocks_in_use"] == COMPACT_BLOCKS and lad["compacted_blocks"] == COMPACT_BLOCKS
    assert set(r["block_kinds"]) == {0, 1, 2}  # a mixed table: the sink, compact blocks, a dropped one, recent ones

    ref = engine(art)
    c = ref.new_conversation()
    assert list(ref.generate(c, ids, DECODE)) == r["generated"]
    ref.check_invariants()
    assert {k: ref.stats()["ladder"][k] for k in LADDER_KEYS} == {k: lad[k] for k in LADDER_KEYS}
    assert kinds(ref, c) == r["block_kinds"]
    # the KV bytes held count the compact blocks in their spec, on both sides
    assert r["kv_bytes"] == ref.stats()["kv_bytes_in_use"]
    # the whole file: tokens, default records, the compact records C++ re-quantized, stage rows
    ours = tmp_path / "python.pkvc"
    ref.save(c, ours, app=CHAT_APP)
    d = cf.read(saved)
    assert d.n_compact == COMPACT_BLOCKS and d.compact is not None
    assert saved.read_bytes() == ours.read_bytes()

    # Python restores the runner's compacted file: the next token's logits are the uninterrupted engine's
    eng = engine(art)
    cr = eng.restore(saved)
    assert eng.counters.prefill_tokens == 0 and kinds(eng, cr) == kinds(ref, c)
    got = eng.step({cr: []})[cr]
    want = ref.step({c: []})[c]
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_python_compacted_file_restored_by_runner(host, runner_run, art, wikitext, tmp_path):
    plain, _, ids = runner_run
    eng = engine(art)
    c = eng.new_conversation()
    eng.prefill(c, ids[:SPLIT])
    assert eng.stats()["ladder"]["compactions"] == 1 and 2 in kinds(eng, c)  # compacted before it is saved
    saved = tmp_path / "python.pkvc"
    eng.save(c, saved)
    r = runner_cli(host, art, wikitext, "--restore", saved)
    assert r["restored_tokens"] == SPLIT
    assert r["generated"] == plain["generated"]
    assert r["block_kinds"] == plain["block_kinds"]
    assert r["ladder"]["compactions"] == plain["ladder"]["compactions"] - 1  # the first one came with the file


def test_aarch64_runner_restores_a_compacted_file_and_compacts(runner_run, art, wikitext, tmp_path):
    """The cross-built runner under qemu-aarch64 (-cpu max: NEON kernels) restores the Python engine's
    compacted file and goes on under the ladder (its own compaction and slide: requantize_records on
    aarch64) with the host runner's greedy tokens and block kinds."""
    need("aarch64-linux-gnu-g++", "qemu-aarch64-static", "javac")
    b = build("cross")
    plain, _, ids = runner_run
    eng = engine(art)
    c = eng.new_conversation()
    eng.prefill(c, ids[:SPLIT])
    saved = tmp_path / "python.pkvc"
    eng.save(c, saved)
    env = qemu_env(b)
    cmd = ["qemu-aarch64-static", "-cpu", "max", b / "pagedkv-runner", art, "--prompt-file", wikitext, "--ctx", CTX,
           "--decode", DECODE, "--threads", "1", "--json", "--policy", "adaptive", "--compact-horizon", HORIZON,
           "--restore", saved]
    p = subprocess.run([str(x) for x in cmd], capture_output=True, text=True, timeout=1800, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["isa"] == "neon-dotprod" and r["restored_tokens"] == SPLIT
    assert r["ladder"]["compactions"] >= 1 and r["ladder"]["slides"] >= 1
    assert r["generated"] == plain["generated"] and r["block_kinds"] == plain["block_kinds"]


def test_runner_sliding_policy_like_runtime_sim(host, art, wikitext, runner_run):
    """policy sliding (no compaction): the oldest default blocks after the sink are dropped as the engine
    drops them: the same tokens, slides and holes."""
    from runtime_sim.session import open_artifacts

    ids = runner_run[2]
    cmd = [host / "pagedkv-runner", art, "--prompt-file", wikitext, "--ctx", CTX, "--decode", DECODE, "--threads", 1,
           "--json", "--policy", "sliding"]
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    e = open_artifacts(art, "executorch", threads=1, policy="sliding")
    c = e.new_conversation()
    assert list(e.generate(c, ids, DECODE)) == r["generated"]
    assert r["ladder"]["slides"] == e.stats()["ladder"]["slides"] > 0 and r["ladder"]["compactions"] == 0
    assert kinds(e, c) == r["block_kinds"] and 2 not in r["block_kinds"]


@pytest.mark.parametrize("args, needle", [
    (["--policy", "evict"], "unknown pool policy 'evict'"),
    (["--compact-horizon", "0"], "--compact-horizon 0 is not an integer >= 1"),
    (["--policy", "error"], "do not fit the pool"),  # policy error: the prompt must fit, as before
])
def test_cli_ladder_options_bad_input_one_line(host, art, wikitext, args, needle):
    cmd = [host / "pagedkv-runner", art, "--prompt-file", wikitext, "--ctx", CTX, "--decode", DECODE, *args]
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("pagedkv-runner:")]
    assert p.returncode == 2 and len(err) == 1 and needle in err[0], p.stderr[-2000:]
    assert p.stdout == ""


@pytest.fixture(scope="module")
def gemma_art(tmp_path_factory, wikitext):
    """A tiny Gemma 3 (a sliding layer with a window of 16 beside a global one: two layer groups), the same
    pool and compact region as `art`: the compact region belongs to the global group."""
    import make_fixtures

    from export.artifacts import PoolRequest, export_artifacts
    from tests.test_runner_groups import tiny

    out = tmp_path_factory.mktemp("runner-ladder-gemma3") / "artifacts"
    export_artifacts("tiny-gemma3", out, formats=("pte",), spec="default",
                     pool=PoolRequest(pool_tokens=POOL_TOKENS, max_seqs=2, block_size=16, compact_blocks=COMPACT_BLOCKS),
                     max_tokens_per_call=32, model_and_tokenizer=(tiny("gemma3", 16), make_fixtures.tiny_bpe_tokenizer(wikitext)),
                     accept_fidelity=True)
    return out


def test_grouped_model_ladder_like_runtime_sim(host, gemma_art, wikitext, tmp_path):
    """Two layer groups: the global one compacts and slides, the sliding one hands back its blocks as they
    leave the window; the runner and the engine agree (tokens, rungs, kinds, per-group counts) and the
    runner's file holds the engine's records (rows past the last token of the partly filled block excepted:
    stale rows of a reused block, never read, differ because the two hand out other block ids), and the
    engine restoring it continues with the same logits bit for bit."""
    from runtime_sim import conversation_file as cf

    saved = tmp_path / "runner.pkvc"
    r = runner_cli(host, gemma_art, wikitext, "--save", saved)
    assert r["ladder"]["compactions"] >= 2 and r["ladder"]["slides"] >= 1 and len(r["groups"]) == 2
    d = cf.read(saved)
    ref = engine(gemma_art)
    c = ref.new_conversation()
    assert list(ref.generate(c, d.tokens[:CTX], DECODE)) == r["generated"]
    ref.check_invariants()
    assert {k: ref.stats()["ladder"][k] for k in LADDER_KEYS} == {k: r["ladder"][k] for k in LADDER_KEYS}
    assert kinds(ref, c) == r["block_kinds"]
    assert [g["used_blocks"] for g in r["groups"]] == [g["used_blocks"] for g in ref.stats()["groups"]]
    ours = tmp_path / "python.pkvc"
    ref.save(c, ours, app=CHAT_APP)
    p = cf.read(ours)
    rows = len(d.tokens) % d.block_size or d.block_size  # rows of the last block that hold tokens
    assert (d.tokens, d.pending, d.app, d.compact) == (p.tokens, p.pending, p.app, p.compact)
    assert [list(g.present) for g in d.groups] == [list(g.present) for g in p.groups]
    for name in ("codes", "scales"):
        for x, y in zip(getattr(d, name), getattr(p, name)):
            assert np.array_equal(x[:-1], y[:-1]) and np.array_equal(x[-1][:, :rows], y[-1][:, :rows])
    for name in ("compact_codes", "compact_scales", "stage"):
        for x, y in zip(getattr(d, name), getattr(p, name)):
            assert (x is None and y is None) or np.array_equal(x, y)
    eng = engine(gemma_art)
    cr = eng.restore(saved)
    got, want = eng.step({cr: []})[cr], ref.step({c: []})[c]
    assert np.array_equal(got, want)


# ---------------------------------------------------------------------------------------------------
# Several conversations: runner_test --ladder runs a script of calls on the runner, the same calls run on
# the engine; after every step the same result and the same pool.

def run_script(host, art, script, tmp_path) -> list[dict]:
    path, out = tmp_path / "script.json", tmp_path / "out.json"
    path.write_text(json.dumps(script))
    p = subprocess.run([str(host / "runner_test"), "--ladder", str(art), str(path), str(out)], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())["steps"]


def python_steps(e, steps) -> list[dict]:
    """The script's steps on the engine, in the runner_test --ladder output's form (errors: None)."""
    from toolkit.errors import PagedKVError

    out, convs = [], []
    for st in steps:
        res = {"op": st["op"]}
        try:
            if st["op"] == "new":
                convs.append(e.new_conversation())
                res["conv"] = convs[-1]
            elif st["op"] == "generate":
                res["tokens"] = list(e.generate(st["conv"], st["ids"], st["decode"]))
            elif st["op"] == "save":
                res["bytes"] = e.save(st["conv"], st["path"])
            elif st["op"] == "restore":
                convs.append(e.restore(st["path"]))
                res["conv"] = convs[-1]
            elif st["op"] == "compact":
                from runtime_sim.compact import compact_aged

                res["moved"] = [i for i, _, _ in compact_aged(e, st["conv"], st["horizon"])]
        except PagedKVError as err:
            res["error"] = str(err)
        e.check_invariants()
        s = e.stats()
        res["ladder"] = {k: s["ladder"][k] for k in LADDER_KEYS}
        res["used"], res["free"] = s["used_blocks"], s["free_blocks"]
        res["free_compact"] = e.pool.main.num_free_compact_blocks
        res["sequences"] = len(e.pool.live_sequences())
        res["kinds"] = {str(c): kinds(e, c) for c in convs}
        out.append(res)
    return out


def comparable(step: dict) -> dict:
    """A step without what differs by design: error texts (each side words its own) and save's file size
    (the runner's file carries the chat's messages as app bytes)."""
    return {k: (v is not None) if k == "error" else v for k, v in step.items() if k not in ("code", "bytes")}


@pytest.fixture(scope="module")
def prompts(runner_run):
    """200 token ids of wikitext (the runner's prompt above, as its tokenizer encoded it)."""
    return list(runner_run[2])


def test_two_conversations_ladder_twin(host, art, prompts, tmp_path):
    """Idle compaction, active compaction, spills and mapping back, save/restore under pressure: the runner
    and the engine agree after every step."""
    a, b = prompts[:100], prompts[100:160]
    runner_dir, py_dir = tmp_path / "runner-spill", tmp_path / "py-spill"
    runner_dir.mkdir()
    py_dir.mkdir()
    steps = [{"op": "new"}, {"op": "new"},
             {"op": "generate", "conv": 0, "ids": a, "decode": 20},
             {"op": "generate", "conv": 1, "ids": b, "decode": 20},  # compacts idle conversation 0 first
             {"op": "generate", "conv": 0, "ids": prompts[160:200], "decode": 10},
             {"op": "generate", "conv": 1, "ids": prompts[:30], "decode": 30},
             {"op": "generate", "conv": 0, "ids": prompts[30:60], "decode": 30},
             {"op": "generate", "conv": 1, "ids": prompts[60:70], "decode": 10},
             {"op": "compact", "conv": 1, "horizon": 16}]  # Runner::compact: every aged block, not a shortfall
    script = {"policy": "adaptive", "horizon": HORIZON, "threads": 1, "spill_dir": str(runner_dir), "steps": steps}
    got = run_script(host, art, script, tmp_path)
    want = python_steps(engine(art, spill_dir=py_dir), steps)
    assert len(got) == len(want) == len(steps)
    for i, (g, w) in enumerate(zip(got, want)):
        assert comparable(g) == comparable(w), f"step {i} {steps[i]['op']}"
    last = got[-1]["ladder"]
    # the script is sized so that every rung of the ladder but the last is taken
    assert last["compactions"] >= 2 and last["spills"] >= 1 and last["restores_from_spill"] >= 1, last
    assert len(got[-1]["moved"]) >= 2
    assert got[-1]["kinds"]["0"] == [] and not list(runner_dir.iterdir())  # spilled at the end; the runner removed its file


def random_steps(seed: int, prompts: list[int], n: int = 20) -> list[dict]:
    """A random script: up to 4 conversations (the pool has 2 slots: new ones spill idle ones), turns of
    1-60 prompt tokens and 1-30 greedy tokens, saves and restores (file names, placed by the caller)."""
    import random

    rnd = random.Random(seed)
    steps, convs, saved, held = [{"op": "new"}, {"op": "new"}], 2, [], set()  # held: conversations with tokens
    for _ in range(n):
        r = rnd.random()
        if r < 0.1 and convs < 4:
            steps.append({"op": "new"})
            convs += 1
        elif r < 0.18 and held:
            saved.append(f"s{len(saved)}.pkvc")
            steps.append({"op": "save", "conv": rnd.choice(sorted(held)), "path": saved[-1]})
        elif r < 0.24 and saved and convs < 5:
            steps.append({"op": "restore", "path": rnd.choice(saved)})
            convs += 1
        else:
            a, k = rnd.randrange(len(prompts)), rnd.randint(1, 60)
            held.add(rnd.randrange(convs))
            steps.append({"op": "generate", "conv": max(held) if r > 0.9 else sorted(held)[-1 - int(r * 10) % len(held)],
                          "ids": (prompts * 2)[a:a + k], "decode": rnd.randint(1, 30)})
    return steps


def placed(steps: list[dict], where) -> list[dict]:
    return [dict(st, path=str(where / st["path"])) if "path" in st else st for st in steps]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_ladder_traces_twin(host, art, prompts, tmp_path, seed):
    """Random scripts of turns, new conversations, saves and restores under the adaptive ladder: the runner
    and the engine agree after every step (tokens, rungs, pool counts, block kinds; invariants on both)."""
    steps = random_steps(seed, prompts)
    runner_dir, py_dir = tmp_path / "runner", tmp_path / "py"
    runner_dir.mkdir()
    py_dir.mkdir()
    script = {"policy": "adaptive", "horizon": HORIZON, "threads": 1, "spill_dir": str(runner_dir),
              "steps": placed(steps, runner_dir)}
    got = run_script(host, art, script, tmp_path)
    want = python_steps(engine(art, spill_dir=py_dir), placed(steps, py_dir))
    for i, (g, w) in enumerate(zip(got, want)):
        assert comparable(g) == comparable(w), f"step {i} {steps[i]}"
    assert len(got) == len(want) == len(steps)


def _set_u32(data: bytes, offset: int, value: int) -> bytes:
    """data with the u32 at offset replaced and the trailing CRC-32 recomputed (a consistent file)."""
    body = bytearray(data[:-4])
    body[offset:offset + 4] = struct.pack("<I", value)
    return bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))


def test_bad_files_leave_the_pool_intact(host, art, prompts, tmp_path):
    """A compacted file (Python: 120 tokens, 5 aged blocks compacted with compact_aged) restores into the
    runner; then a truncated copy, one of another compact spec (a consistent file: CRC recomputed) and the
    good file again (a free slot and free default blocks, but 5 compact blocks wanted and 3 free) are each
    one error, the pool and every conversation as they were; a new conversation then starts."""
    from runtime_sim.compact import compact_aged
    from toolkit.errors import PagedKVError

    e = engine(art)
    c = e.new_conversation()
    e.prefill(c, prompts[:120])
    assert len(compact_aged(e, c, 16)) == 5
    good = tmp_path / "good.pkvc"
    e.save(c, good)
    data = good.read_bytes()
    compact_spec_at = 112  # CONVERSATION_FORMAT.md "Compact blocks": compact_spec starts at byte 112
    sink_field = compact_spec_at + 8 * 4  # the compact spec's sink_blocks: no record size depends on it
    files = {"truncated": data[:-100], "other-compact-spec": _set_u32(data, sink_field,
                                                                       1 - struct.unpack_from("<I", data, sink_field)[0])}
    for name, blob in files.items():
        (tmp_path / f"{name}.pkvc").write_bytes(blob)
    steps = [{"op": "restore", "path": str(good)},
             {"op": "restore", "path": str(tmp_path / "truncated.pkvc")},
             {"op": "restore", "path": str(tmp_path / "other-compact-spec.pkvc")},
             {"op": "restore", "path": str(good)},
             {"op": "new"}]
    script = {"policy": "error", "horizon": HORIZON, "threads": 1, "steps": steps}
    got = run_script(host, art, script, tmp_path)
    assert "error" not in got[0] and got[0]["ladder"]["compact_blocks_in_use"] == 5
    assert got[0]["kinds"]["0"] == kinds(e, c) == [1, 2, 2, 2, 2, 2, 1, 1]
    before = {k: got[0][k] for k in ("used", "free", "free_compact", "sequences", "kinds", "ladder")}
    for i, needle in [(1, "truncated"), (2, "compact region is"), (3, "compact-tier block(s)")]:
        assert "error" in got[i] and needle in got[i]["error"] and "\n" not in got[i]["error"], got[i]
        assert {k: got[i][k] for k in before} == before, f"step {i} changed the pool"
    assert got[3]["code"] == 3 and got[3]["free"] > 0  # kPoolExhausted by the compact region alone
    assert "error" not in got[4] and got[4]["sequences"] == 2
    # Python refuses the same files
    for name in files:
        with pytest.raises(PagedKVError):
            e.restore(tmp_path / f"{name}.pkvc")
    e.check_invariants()


# ---------------------------------------------------------------------------------------------------
# A trim (the app's ChatEngine.trim: compact aged blocks, then shrink to the blocks in use) returns memory
# at once: compaction frees the conversation's oldest, lowest default ids, and the shrink moves the used
# blocks above the blocks in use into them before it lowers the limit (Runner::shrink, runner_trim.cpp).

def codes_bytes(art, lo: int, hi: int) -> tuple[int, int]:
    """The codes bytes of blocks [lo, hi) in every layer, and what page rounding may leave of them: the runner
    madvises the whole pages inside each layer's range (where the plan put the codes tensor in its arena)."""
    import os

    pool = json.loads((art / "pagedkv.json").read_text())["pool"]
    item = {"float32": 4, "float16": 2}.get(pool["codes_dtype"], 1)
    per_block = int(np.prod(pool["codes_shape"][1:])) * item
    return pool["num_layers"] * (hi - lo) * per_block, 2 * pool["num_layers"] * os.sysconf("SC_PAGE_SIZE")


def test_trim_after_compaction_releases_the_freed_blocks(host, art, prompts, tmp_path):
    """After compaction the shrink moves the used default blocks above the blocks in use into the free ones
    below, lowers the limit to the blocks in use and releases the pages above it; every block keeps its kind,
    and after growing back the conversation goes on with the greedy tokens it gives without the trim."""
    start = [{"op": "new"}, {"op": "generate", "conv": 0, "ids": prompts[:100], "decode": 20},
             {"op": "compact", "conv": 0, "horizon": HORIZON}]
    trim = [{"op": "shrink", "target": 0}, {"op": "grow", "target": POOL_TOKENS // 16}]
    goon = [{"op": "generate", "conv": 0, "ids": prompts[100:110], "decode": 30}]
    script = {"policy": "adaptive", "horizon": HORIZON, "threads": 1}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = run_script(host, art, dict(script, steps=start + goon), tmp_path / "a")
    got = run_script(host, art, dict(script, steps=start + trim + goon), tmp_path / "b")
    compacted, shrunk, grown = got[2], got[3], got[4]
    used = compacted["used"]
    assert len(compacted["moved"]) >= 2 and compacted["free_compact"] < COMPACT_BLOCKS
    assert shrunk["usable_before"] == POOL_TOKENS // 16
    assert shrunk["moved_blocks"] >= 1 and shrunk["usable_after"] == used  # not the highest used id + 1
    assert shrunk["blocked_by_used"] == used and shrunk["used"] == used and shrunk["free"] == 0
    span, slack = codes_bytes(art, used, POOL_TOKENS // 16)
    assert span >= shrunk["released_bytes"] > span - slack
    assert shrunk["kinds"] == compacted["kinds"] and shrunk["ladder"] == compacted["ladder"]
    assert grown["usable"] == POOL_TOKENS // 16
    assert got[-1]["tokens"] == plain[-1]["tokens"]
    assert got[-1]["kinds"] == plain[-1]["kinds"] and got[-1]["ladder"] == plain[-1]["ladder"]
