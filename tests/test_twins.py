"""The Python block manager (toolkit/block_pool.py) and its C++ twin in the Android runner
(android_demo/native/src/block_manager.cpp) replay one trace of pool operations and must agree on
every observable result: sequence slots, reservations that fit or exhaust the pool, lengths, blocks
per sequence, used and free counts, and which operations are refused. The same for the layer-group
twins (GroupedBlockPool / GroupedBlockManager: a global group and a sliding one), which must also agree
on the holes each sliding table has and the blocks each group holds after every commit. The intended
differences (allocation order, no prefix cache or fork in C++, the C++ usable limit) are listed in
block_manager.h; block ids are therefore not compared."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from toolkit.block_pool import HOLE, BlockPool, GroupedBlockPool, LayerGroup
from toolkit.errors import PagedKVError, PoolExhausted

NATIVE = Path(__file__).resolve().parents[1] / "android_demo" / "native"
NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS = 12, 16, 3


# the grouped twins: a global group and a sliding one whose pool holds less than the sequences' windows
GROUPS = [LayerGroup(0, (1,), NUM_BLOCKS), LayerGroup(24, (0,), 7)]


def record_trace(seed: int, n_ops: int = 600, pool=None) -> list[str]:
    """Operations a chat runtime issues, recorded while driving the Python pool (so most are valid and
    the pool fills, empties and runs out), plus refused ones: dead sequences, commits past the
    reservation, more sequences than slots."""
    rnd = random.Random(seed)
    pool = pool or BlockPool(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS)
    reserved: dict[int, int] = {}
    ops = []
    for _ in range(n_ops):
        live = pool.live_sequences()
        seq = rnd.choice(live) if live and rnd.random() < 0.9 else rnd.randrange(MAX_SEQS + 1)
        r = rnd.random()
        if r < 0.12 or not live:
            op = "new"
        elif r < 0.5:
            op = f"reserve {seq} {rnd.choice([1, 1, 1, 5, 16, 17, 40, 90])}"
        elif r < 0.92:
            room = reserved.get(seq, 0) - (pool.length(seq) if seq in live else 0)
            n = min(room, rnd.choice([1, 3, 16, 20])) if room > 0 and rnd.random() < 0.9 else rnd.choice([1, 20])
            op = f"commit {seq} {n}"
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
                pool.commit(seq, [0] * int(args[1]))
            else:
                pool.release(seq)
                del reserved[seq]
        except PagedKVError:
            pass
    return ops


def replay_python(ops: list[str], pool: BlockPool | None = None) -> list[str]:
    """The Python side of a trace, in the words of block_manager_test --trace. A pool with a compact
    region also takes "compact SEQ I" and reports its free compact blocks (tests/test_runner_compact.py)."""
    pool = pool or BlockPool(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS)
    rnd = random.Random(0)
    out = []
    for line in ops:
        op, *args = line.split()
        seq, n = (int(a) for a in (args + ["0", "0"])[:2])
        try:
            if op == "new":
                res = f"seq {pool.new_sequence()}"
            elif op == "reserve":
                pool.reserve(seq, n)
                res = f"ok blocks {len(pool.block_table(seq))}"
            elif op == "commit":
                pool.commit(seq, [rnd.randrange(1000) for _ in range(n)])
                res = f"len {pool.length(seq)}"
            elif op == "compact":
                pool.compact(seq, n)
                res = "compacted"
            else:
                pool.release(seq)
                res = "released"
        except PoolExhausted:
            res = "exhausted"
        except PagedKVError:
            res = "state error"
        pool.check_invariants()
        line = f"{res} used {pool.num_used_blocks} free {pool.num_free_blocks}"
        out.append(line + (f" cfree {pool.num_free_compact_blocks}" if pool.num_compact_blocks else ""))
    return out


def replay_python_groups(ops: list[str]) -> list[str]:
    """replay_python for GroupedBlockPool, in the words of block_manager_test --group-trace."""
    pool = GroupedBlockPool(GROUPS, BLOCK_SIZE, MAX_SEQS)
    out = []
    for line in ops:
        op, *args = line.split()
        seq, n = (int(a) for a in (args + ["0", "0"])[:2])
        try:
            if op == "new":
                res = f"seq {pool.new_sequence()}"
            elif op == "reserve":
                pool.reserve(seq, n)
                res = "ok" + "".join(f" blocks {len(t)} holes {t.count(HOLE)}"
                                     for t in (pool.block_table(seq, g) for g in range(len(GROUPS))))
            elif op == "commit":
                pool.commit(seq, [7] * n)
                res = f"len {pool.length(seq)}" + "".join(
                    f" held {sum(b != HOLE for b in pool.block_table(seq, g))}" for g in range(len(GROUPS)))
            else:
                pool.release(seq)
                res = "released"
        except PoolExhausted:
            res = "exhausted"
        except PagedKVError:
            res = "state error"
        pool.check_invariants()
        out.append(res + "".join(f" | used {p.num_used_blocks} free {p.num_free_blocks}" for p in pool.pools))
    return out


@pytest.fixture(scope="module")
def cpp_replayer(tmp_path_factory) -> Path:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.fail("g++ not installed: apt-get install -y g++")
    exe = tmp_path_factory.mktemp("twins") / "block_manager_test"
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(NATIVE / "src"), str(NATIVE / "tests" / "block_manager_test.cpp"),
                    str(NATIVE / "src" / "block_manager.cpp"), "-o", str(exe)], check=True, capture_output=True)
    return exe


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_python_and_cpp_block_managers_agree_on_a_trace(cpp_replayer, tmp_path, seed):
    ops = record_trace(seed)
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(ops) + "\n")
    proc = subprocess.run([str(cpp_replayer), "--trace", str(trace), str(NUM_BLOCKS), str(BLOCK_SIZE), str(MAX_SEQS)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cpp = proc.stdout.splitlines()
    py = replay_python(ops)
    assert len(cpp) == len(ops)
    for i, (op, a, b) in enumerate(zip(ops, py, cpp)):
        assert a == b, f"operation {i} '{op}': Python says '{a}', C++ says '{b}'"
    # the trace exercises every outcome
    kinds = {line.split(" used")[0].split()[0] for line in py}
    assert {"seq", "ok", "exhausted", "state", "len", "released"} <= kinds


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_python_and_cpp_grouped_block_managers_agree_on_a_trace(cpp_replayer, tmp_path, seed):
    ops = record_trace(seed, pool=GroupedBlockPool(GROUPS, BLOCK_SIZE, MAX_SEQS))
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join(ops) + "\n")
    proc = subprocess.run([str(cpp_replayer), "--group-trace", str(trace), str(BLOCK_SIZE), str(MAX_SEQS),
                           *(f"{g.window}:{g.num_blocks}" for g in GROUPS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cpp = proc.stdout.splitlines()
    py = replay_python_groups(ops)
    assert len(cpp) == len(ops)
    for i, (op, a, b) in enumerate(zip(ops, py, cpp)):
        assert a == b, f"operation {i} '{op}': Python says '{a}', C++ says '{b}'"
    kinds = {line.split()[0] for line in py}
    assert {"seq", "ok", "exhausted", "state", "len", "released"} <= kinds
    # the sliding group really slid: its tables had holes (blocks handed back as they left the window)
    assert any(int(ln.split(" holes ")[2].split()[0]) > 0 for ln in py if ln.startswith("ok"))
