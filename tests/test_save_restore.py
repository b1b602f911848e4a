"""Save and restore a conversation (runtime_sim/conversation_file.py, toolkit/CONVERSATION_FORMAT.md).

A restored conversation must give the next token's logits bit for bit equal to the conversation that
was saved (same backend, no prefill), compact-tier blocks included (format version 2; version-1 files
still restore); every bad file is one PagedKVError and leaves the pool as it was.
"""

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from runtime_sim import conversation_file as cf
from runtime_sim import conversation_state
from runtime_sim.backends import TorchBackend
from runtime_sim.compact import compact_aged
from runtime_sim.engine import Engine
from toolkit.compiler import compile
from toolkit.errors import PagedKVError, PoolExhausted
from toolkit.tiny_models import tiny_model

REPO = Path(__file__).resolve().parent.parent
PROMPT = list(range(3, 43))  # 40 tokens: 2 full blocks and a partial one


def torch_engine(spec="default", family="llama", num_blocks=16, seed=0, **kw):
    paged = compile(tiny_model(family, seed=seed), spec, num_blocks=num_blocks, max_seqs=3, **kw)
    return Engine(TorchBackend(paged), prefill_chunk=16)


def snapshot(engine):
    """Everything a failed restore must leave as it was: pool metadata and every pool tensor (the
    compact region's too)."""
    pools = [tuple(a.copy() for a in layer) for layer in conversation_state.pool_arrays(engine)]
    pools += [tuple(a.copy() for a in conversation_state.compact_arrays(engine)[i]) for i in sorted(conversation_state.compact_arrays(engine))]
    meta = [engine.pool.free_blocks(), engine.pool.main.num_free_compact_blocks]
    tables = {s: [engine.pool.block_table(s, g) for g in range(len(engine.groups))]
              for s in engine.pool.live_sequences()}
    return pools, meta, tables, sorted(engine.conversations)


def assert_unchanged(engine, snap):
    pools, meta, tables, convs = snap
    now = snapshot(engine)
    assert now[1:] == (meta, tables, convs)
    for a, b in zip(pools, now[0]):
        for x, y in zip(a, b):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    engine.pool.check_invariants()


def continue_both(a, ca, b, cb, steps=6):
    """Feed both conversations the same tokens (a's greedy choices) and require equal logits bit for bit."""
    tok = a.conversations[ca].pending or [5]
    for _ in range(steps):
        la, lb = a.step({ca: tok})[ca], b.step({cb: tok})[cb]
        assert np.array_equal(la, lb)
        tok = [int(np.argmax(la))]


@pytest.mark.parametrize("spec", ["default", "fp32", "k4v2"])
def test_round_trip_torch_logits_bit_for_bit(tmp_path, spec):
    if spec == "k4v2":
        spec = {"k_bits": 4, "v_bits": 2, "k_group": 32, "v_group": 16}
    a = torch_engine(spec)
    ca = a.new_conversation()
    list(a.generate(ca, PROMPT, 5))
    size = a.save(ca, tmp_path / "c.pkvc")
    assert size == (tmp_path / "c.pkvc").stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name != "c.pkvc"]  # no temp file left
    b = torch_engine(spec)
    other = b.new_conversation()  # the restored one gets another slot and other block ids
    list(b.generate(other, [9, 8, 7], 1))
    cb = b.restore(tmp_path / "c.pkvc")
    assert b.conversations[cb].history == a.conversations[ca].history
    assert b.conversations[cb].pending == a.conversations[ca].pending
    assert b.conversations[cb].seq != a.conversations[ca].seq
    b.pool.check_invariants()
    continue_both(a, ca, b, cb)


def test_round_trip_with_sliding_layer_groups(tmp_path):
    """Gemma 3 (sliding window 24 + global layers): the sliding group's holes are saved and restored."""
    a = torch_engine("default", "gemma3", num_blocks=12, sliding_blocks=6)
    ca = a.new_conversation()
    list(a.generate(ca, list(range(3, 90)), 4))
    assert -1 in a.pool.block_table(a.conversations[ca].seq, 1) or -1 in a.pool.block_table(a.conversations[ca].seq, 0)
    a.save(ca, tmp_path / "g.pkvc")
    d = cf.read(tmp_path / "g.pkvc")
    assert len(d.groups) == 2 and any(not all(g.present) for g in d.groups)
    b = torch_engine("default", "gemma3", num_blocks=12, sliding_blocks=6)
    cb = b.restore(tmp_path / "g.pkvc")
    for g in range(2):
        assert [x >= 0 for x in b.pool.block_table(b.conversations[cb].seq, g)] == \
            [x >= 0 for x in a.pool.block_table(a.conversations[ca].seq, g)]
    b.pool.check_invariants()
    continue_both(a, ca, b, cb, steps=40)  # past the next window boundary


def test_sliding_policy_holes_round_trip(tmp_path):
    a = torch_engine("default", num_blocks=4)
    a.policy = "sliding"
    ca = a.new_conversation()
    list(a.generate(ca, list(range(3, 80)), 3))  # 80 tokens in a pool of 64: old blocks dropped
    assert -1 in a.pool.block_table(a.conversations[ca].seq)
    a.save(ca, tmp_path / "s.pkvc")
    b = torch_engine("default", num_blocks=4)
    b.policy = "sliding"
    cb = b.restore(tmp_path / "s.pkvc")
    continue_both(a, ca, b, cb, steps=3)


def test_shared_system_prompt_saved_once_and_forked_after_restart(tmp_path):
    a = torch_engine()
    sys_conv = a.new_conversation()
    a.prefill(sys_conv, list(range(3, 3 + 48)))  # 3 full blocks
    a.save(sys_conv, tmp_path / "system.pkvc")
    b = torch_engine()  # "after a restart"
    base = b.restore(tmp_path / "system.pkvc")
    used = b.stats()["used_blocks"]
    kids = [b.fork(base) for _ in range(2)]
    assert b.stats()["used_blocks"] == used  # the forks share the restored blocks
    ref = a.fork(sys_conv)
    for k in kids:
        assert np.array_equal(b.prefill(k, [50, 51, 52]), a.prefill(ref, [50, 51, 52]))
        a.clear(ref)
        a.prefill(ref, list(range(3, 3 + 48)))
    # restored full blocks are in the prefix cache too
    b.close(kids[0])
    seq, cached = b.pool.new_sequence_with_prefix(list(range(3, 3 + 48)) + [1])
    assert cached == 48
    b.pool.release(seq)


def test_app_bytes_and_evicted_conversation(tmp_path):
    a = torch_engine()
    c = a.new_conversation()
    a.conversations[c].pending = [4, 5, 6]  # nothing cached yet (like an evicted conversation)
    a.save(c, tmp_path / "e.pkvc", app=b'{"messages": []}')
    d = cf.read(tmp_path / "e.pkvc")
    assert d.tokens == [] and d.pending == [4, 5, 6] and d.app == b'{"messages": []}'
    b = torch_engine()
    cb = b.restore(tmp_path / "e.pkvc")
    assert b.stats()["used_blocks"] == 0 and b.conversations[cb].pending == [4, 5, 6]


# ------------------------------------------------------------------------------------------ bad files


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "c.pkvc"
    a = torch_engine()
    c = a.new_conversation()
    list(a.generate(c, PROMPT, 3))
    a.save(c, path)
    return path.read_bytes()


def reseal(data: bytes) -> bytes:
    """A deliberate edit with a valid checksum (to reach the checks after the checksum)."""
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))


def _version(data):
    return reseal(data[:8] + struct.pack("<I", 4) + data[12:])


def _spec_field(data):  # rotate 1 -> 0: a valid spec of the same record sizes, but not the engine's
    off = 8 + 4 + 32 + 16 + 6 * 4
    assert struct.unpack_from("<I", data, off) == (1,)
    return reseal(data[:off] + struct.pack("<I", 0) + data[off + 4:])


def _sizes(data):  # k_bits 8 -> 6 without the record sizes that go with it
    off = 8 + 4 + 32 + 16
    return reseal(data[:off] + struct.pack("<I", 6) + data[off + 4:])


def _hole(data):  # the partly filled last block marked as a hole: no pool ever drops the block being written
    d = cf.parse(data)
    assert len(d.tokens) % 16
    hdr = cf.encode_header(d)
    d.groups[0].present[-1] = False
    d.codes = [c[:-1] for c in d.codes]
    d.scales = [s[:-1] for s in d.scales]
    body = b"".join(np.ascontiguousarray(x).tobytes() if isinstance(x, np.ndarray) else x for x in cf._payload(d))
    assert len(hdr) == len(cf.encode_header(d))
    return body + struct.pack("<I", zlib.crc32(body))


BAD = {
    "empty": (lambda d: b"", "bad magic"),
    "magic": (lambda d: b"GGUF" + d[4:], "bad magic"),
    "truncated": (lambda d: d[:len(d) // 2], "checksum"),
    "truncated-resealed": (lambda d: reseal(d[:len(d) // 2]), "truncated"),
    "tampered-block": (lambda d: d[:-100] + bytes([d[-100] ^ 1]) + d[-99:], "checksum"),
    "tampered-token": (lambda d: d[:200] + bytes([d[200] ^ 0x40]) + d[201:], "checksum"),
    "version": (_version, "format version 4"),
    "other-spec": (_spec_field, "KV spec"),
    "record-sizes": (_sizes, "record sizes"),
    "extra-bytes": (lambda d: reseal(d[:-4] + b"\0" * 8 + d[-4:]), "unexpected byte"),
    "hole": (_hole, "would not keep"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_is_one_error_and_pool_unchanged(saved, tmp_path, case):
    make, expect = BAD[case]
    path = tmp_path / "bad.pkvc"
    path.write_bytes(make(saved))
    e = torch_engine()
    c = e.new_conversation()
    list(e.generate(c, [1, 2, 3, 4, 5], 2))
    snap = snapshot(e)
    with pytest.raises(PagedKVError, match=expect) as info:
        e.restore(path)
    assert "\n" not in str(info.value)
    assert_unchanged(e, snap)
    list(e.generate(c, [6], 2))  # still usable


def test_other_model_spec_dims_and_missing_file(saved, tmp_path):
    path = tmp_path / "c.pkvc"
    path.write_bytes(saved)
    for engine, expect in ((torch_engine(seed=1), "another model"), (torch_engine("fp32"), "pool has|KV spec"),
                           (torch_engine(family="qwen3"), "another model")):
        snap = snapshot(engine)
        with pytest.raises(PagedKVError, match=expect):
            engine.restore(path)
        assert_unchanged(engine, snap)
    with pytest.raises(PagedKVError, match="does not exist"):
        torch_engine().restore(tmp_path / "nope.pkvc")


def test_restore_into_a_full_pool_changes_nothing(saved, tmp_path):
    path = tmp_path / "c.pkvc"
    path.write_bytes(saved)
    e = torch_engine(num_blocks=4)
    c = e.new_conversation()
    e.prefill(c, list(range(3, 3 + 40)))  # 3 of 4 blocks
    snap = snapshot(e)
    with pytest.raises(PoolExhausted, match="restoring"):
        e.restore(path)
    assert_unchanged(e, snap)


def test_write_is_atomic(tmp_path, monkeypatch):
    a = torch_engine()
    c = a.new_conversation()
    a.prefill(c, PROMPT)
    path = tmp_path / "c.pkvc"
    a.save(c, path)
    before = path.read_bytes()
    a.prefill(c, [7, 8, 9])

    def broken(chunks):  # the disk fills up half-way through the new file
        yield next(iter(chunks))
        raise OSError(28, "No space left on device")

    real = cf._payload
    monkeypatch.setattr(cf, "_payload", lambda d: broken(real(d)))
    with pytest.raises(PagedKVError, match="No space left"):
        a.save(c, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["c.pkvc"]
    a.save(c, path)
    assert cf.read(path).tokens == PROMPT + [7, 8, 9]


# ------------------------------------------------------------------------ exported model: ORT and ET


@pytest.fixture(scope="module")
def exported(tiny_llama_onnx_pte):
    return tiny_llama_onnx_pte


@pytest.mark.parametrize("backend,native", [("onnxruntime", True), ("onnxruntime", False), ("executorch", None)],
                         ids=["ort-native", "ort-fallback", "executorch"])
def test_round_trip_exported_logits_bit_for_bit(exported, tmp_path, backend, native):
    from runtime_sim.session import open_artifacts

    a = open_artifacts(exported, backend, native=native, prefill_chunk=16)
    ca = a.new_conversation()
    list(a.generate(ca, PROMPT, 4))
    a.save(ca, tmp_path / "c.pkvc")
    # a fresh engine that has never run a step (ExecuTorch finds its pool buffers on a scratch step)
    b = open_artifacts(exported, backend, native=native, prefill_chunk=16)
    cb = b.restore(tmp_path / "c.pkvc")
    assert b.counters.prefill_tokens == 0
    continue_both(a, ca, b, cb)
    other = "executorch" if backend == "onnxruntime" else "onnxruntime"
    c = open_artifacts(exported, other)
    with pytest.raises(PagedKVError, match="another model"):
        c.restore(tmp_path / "c.pkvc")  # the other artifact of the export is another model file


def test_chat_save_and_load_continue_the_same_chat(exported, tmp_path):
    """ChatSession.save/load: the loaded chat answers the next message exactly as the saved one does,
    prefilling only the new message; a load that cannot fit beside the current chat swaps it out."""
    from runtime_sim.chat import ChatSession
    from runtime_sim.session import open_artifacts

    a = open_artifacts(exported, "onnxruntime", prefill_chunk=16)
    sa = ChatSession(a, "Be brief.")
    "".join(sa.send("The tower is", 12))
    sa.save(tmp_path / "chat.pkvc")
    b = open_artifacts(exported, "onnxruntime", prefill_chunk=16)
    sb = ChatSession(b)
    sb2 = ChatSession(b)  # both sequence slots (max_seqs=2) in use: load swaps sb's empty chat out
    sb.load(tmp_path / "chat.pkvc")
    assert sb.messages == sa.messages and sb.system_prompt == "Be brief."
    before_a, before_b = a.counters.prefill_tokens, b.counters.prefill_tokens
    assert "".join(sb.send("and then", 12)) == "".join(sa.send("and then", 12))
    # the loaded chat prefilled what the saved one did for this turn, nothing of the restored cache
    assert b.counters.prefill_tokens - before_b == a.counters.prefill_tokens - before_a
    with pytest.raises(PagedKVError, match="no chat messages"):
        a.save(sa.cid, tmp_path / "raw.pkvc")
        sb2.load(tmp_path / "raw.pkvc")
    assert sb2.messages == [] and len(b.conversations) == 2


def test_chat_cli_save_then_load_in_a_new_process(exported, tmp_path):
    def chat(stdin):
        proc = subprocess.run([sys.executable, "-m", "toolkit.cli", "chat", str(exported), "-n", "8"], input=stdin,
                              capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "COLUMNS": "200"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    whole = chat("The tower is\nand then\n")
    first = chat("The tower is\n/save mychat\n")
    assert "[saved mychat.pkvc" in first and (tmp_path / "mychat.pkvc").is_file()
    second = chat("/load mychat\nand then\n")
    assert "[loaded mychat.pkvc: 2 messages" in second
    reply = lambda out: [ln for ln in out.splitlines() if ln.startswith("> ")][-1]  # noqa: E731
    assert reply(second).split("> ")[-1] == reply(whole).split("> ")[-1]
    bad = chat("/load nothing-here\n/save\n")
    assert "does not exist" in bad and "give a name" in bad


# ------------------------------------------------------------- the Android runner's reader and writer


@pytest.fixture(scope="module")
def cpp_tool(tmp_path_factory):
    """android_demo/native's conversation_file.cpp with its test tool, compiled with the host's g++."""
    import shutil

    if shutil.which("g++") is None:
        pytest.fail("g++ not installed: apt-get install -y g++")
    native = REPO / "android_demo" / "native"
    exe = tmp_path_factory.mktemp("cpp") / "conversation_file_tool"
    subprocess.run(["g++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
                    f"-I{native / 'src'}", f"-I{native / 'tests'}", str(native / "tests" / "conversation_file_tool.cpp"),
                    str(native / "src" / "conversation_file.cpp"), "-o", str(exe)], check=True, timeout=300)
    return exe


def test_cpp_selftest(cpp_tool):
    out = subprocess.run([cpp_tool, "selftest"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "11 passed, 0 failed" in out.stdout, out.stdout


def test_python_file_read_by_cpp_and_cpp_file_read_by_python(cpp_tool, tmp_path):
    import json

    a = torch_engine("default", "gemma3", num_blocks=12, sliding_blocks=6)
    ca = a.new_conversation()
    list(a.generate(ca, list(range(3, 90)), 4))
    py = tmp_path / "py.pkvc"
    a.save(ca, py, app=b'{"messages": [{"role": "user", "content": "hi"}]}')
    d = cf.read(py)
    got = json.loads(subprocess.run([cpp_tool, "dump", py], capture_output=True, text=True, check=True).stdout)
    crc = lambda arrays: [zlib.crc32(np.ascontiguousarray(x).tobytes()) for x in arrays]  # noqa: E731
    assert got == {
        "model_sha256": d.model_sha256.hex(), "dims": [d.num_layers, d.num_kv_heads, d.head_dim, d.block_size],
        "spec": [int(getattr(d.spec, k)) for k in cf.SPEC_FIELDS],
        "records": [d.codes_itemsize, d.code_bytes, d.scale_bytes, int(d.has_stage)],
        "tokens": d.tokens, "pending": d.pending, "app_hex": d.app.hex(),
        "groups": [{"window": g.window, "layers": list(g.layers), "present": [int(p) for p in g.present]}
                   for g in d.groups],
        "compact_spec": [0] * 9, "compact_records": [0, 0],
        "codes_crc": crc(d.codes), "scales_crc": crc(d.scales), "stage_crc": crc(d.stage),
        "compact_codes_crc": [0] * d.num_layers, "compact_scales_crc": [0] * d.num_layers}
    assert any(0 in g["present"] for g in got["groups"])  # the sliding group's holes crossed over
    # C++ writes it again: the same bytes, and Python restores the C++ file bit for bit
    cpp = tmp_path / "cpp.pkvc"
    subprocess.run([cpp_tool, "copy", py, cpp], check=True, capture_output=True)
    assert cpp.read_bytes() == py.read_bytes()
    b = torch_engine("default", "gemma3", num_blocks=12, sliding_blocks=6)
    cb = b.restore(cpp)
    continue_both(a, ca, b, cb, steps=3)


@pytest.mark.parametrize("case", ["empty", "magic", "truncated", "truncated-resealed", "tampered-block",
                                  "tampered-token", "version", "extra-bytes", "record-sizes"])
def test_cpp_rejects_bad_files_in_one_line(cpp_tool, saved, tmp_path, case):
    make, expect = BAD[case]
    path = tmp_path / "bad.pkvc"
    path.write_bytes(make(saved))
    out = subprocess.run([cpp_tool, "dump", path], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and expect in out.stderr, out.stderr


# ------------------------------------------------------------------ the compact tier (format version 2)

COMPACT_AT = 8 + 4 + 32 + 16 + 36 + 16  # the 11 compact-tier fields of version 2 follow has_stage
LONG = list(range(3, 90))  # 87 tokens; after 2 more, compact_aged(horizon=16) moves blocks 1..3


def compacted_engine(compact_blocks=4, seed=0):
    """An engine whose conversation holds 3 compact blocks (of 6; 16 default blocks, 4 compact)."""
    e = torch_engine(compact_blocks=compact_blocks, seed=seed)
    c = e.new_conversation()
    list(e.generate(c, LONG, 3))
    assert [i for i, _, _ in compact_aged(e, c, 16)] == [1, 2, 3]
    return e, c


def kinds(e, cid):
    n = e.groups[0].num_blocks
    return [0 if b < 0 else 1 if b < n else 2 for b in e.pool.block_table(e.conversations[cid].seq)]


def test_compacted_conversation_round_trip_bit_for_bit(tmp_path):
    a, ca = compacted_engine()
    path = tmp_path / "c.pkvc"
    a.save(ca, path)
    d = cf.read(path)
    assert d.groups[0].present == kinds(a, ca) == [1, 2, 2, 2, 1, 1] and d.n_compact == 3
    assert d.compact == a.backend.layout.compact and (d.compact_code_bytes, d.compact_scale_bytes) == (56, 6)
    # the file holds the compact records exactly as they lie in the compact region
    n = a.groups[0].num_blocks
    cids = [b - n for b in a.pool.block_table(a.conversations[ca].seq) if b >= n]
    for i, (cc, cs) in conversation_state.compact_arrays(a).items():
        assert np.array_equal(d.compact_codes[i], cc[cids]) and np.array_equal(d.compact_scales[i], cs[cids].view(np.uint8))
    # restored beside a conversation that holds a compact block itself: other slot, other ids of both regions
    b = torch_engine(compact_blocks=4)
    other = b.new_conversation()
    b.prefill(other, list(range(200, 250)))
    assert len(compact_aged(b, other, 16)) == 1
    prefilled = b.counters.prefill_tokens
    cb = b.restore(path)
    assert b.counters.prefill_tokens == prefilled  # no prefill
    assert kinds(b, cb) == kinds(a, ca) and b.pool.block_table(b.conversations[cb].seq) != \
        a.pool.block_table(a.conversations[ca].seq)
    assert b.pool.main.num_free_compact_blocks == 0
    b.check_invariants()
    # the compacted blocks' default blocks were never written here: the prefix cache offers block 0 only
    seq, cached = b.pool.new_sequence_with_prefix(d.tokens + [1])
    assert cached == 16
    b.pool.release(seq)
    continue_both(a, ca, b, cb)
    b.close(cb)
    b.close(other)
    b.check_invariants()
    assert b.pool.num_free_blocks == 16 and b.pool.main.num_free_compact_blocks == 4


def to_version_1(data: bytes) -> bytes:
    """A version-2 file without compact blocks as the version-1 writer wrote it (CONVERSATION_FORMAT.md)."""
    assert struct.unpack_from("<I", data, 8) == (2,) and data[COMPACT_AT:COMPACT_AT + 44] == bytes(44)
    return reseal(data[:8] + struct.pack("<I", 1) + data[12:COMPACT_AT] + data[COMPACT_AT + 44:])


def test_version_1_file_restores_bit_for_bit_and_a_region_changes_no_byte(tmp_path):
    a = torch_engine()
    ca = a.new_conversation()
    list(a.generate(ca, PROMPT, 5))
    a.save(ca, tmp_path / "c.pkvc")
    v2 = (tmp_path / "c.pkvc").read_bytes()
    # an engine with a compact region writes the same bytes for a conversation without compact blocks
    r = torch_engine(compact_blocks=4)
    cr = r.new_conversation()
    list(r.generate(cr, PROMPT, 5))
    r.save(cr, tmp_path / "r.pkvc")
    assert (tmp_path / "r.pkvc").read_bytes() == v2
    (tmp_path / "v1.pkvc").write_bytes(to_version_1(v2))
    d1, d2 = cf.read(tmp_path / "v1.pkvc"), cf.read(tmp_path / "c.pkvc")
    assert d1.tokens == d2.tokens and [g.present for g in d1.groups] == [g.present for g in d2.groups]
    assert d1.compact is None and all(np.array_equal(x, y) for x, y in zip(d1.codes + d1.stage, d2.codes + d2.stage))
    b = torch_engine(compact_blocks=4)  # a pool with a compact region reads it too
    cb = b.restore(tmp_path / "v1.pkvc")
    continue_both(a, ca, b, cb)


def _present_at(d) -> int:
    """Offset of the first layer group's `present` bytes in a version-2 file."""
    return COMPACT_AT + 44 + 12 + 8 + 4 * len(d.groups[0].layers) + 4


def _edit(data, off, fmt, value):
    return reseal(data[:off] + struct.pack(fmt, value) + data[off + struct.calcsize(fmt):])


def _cut_compact(data):  # resealed, ending inside the last layer's compact codes
    d = cf.parse(data)
    pos = 0
    for chunk in cf._payload(d):
        size = len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
        if isinstance(chunk, np.ndarray) and chunk is d.compact_codes[d.groups[0].layers[-1]]:
            return reseal(data[:pos + size // 2] + data[-4:])
        pos += size
    raise AssertionError("no compact codes")


def _compact_in_v1(data):
    """The compacted file in the version-1 layout: version 1 has no compact blocks."""
    return reseal(data[:8] + struct.pack("<I", 1) + data[12:COMPACT_AT] + data[COMPACT_AT + 44:])


def _swap_compact_bits(data):  # K4/V3 -> K3/V4: a valid compact spec of the same record sizes, not the engine's
    k, v = struct.unpack_from("<2I", data, COMPACT_AT)
    return reseal(data[:COMPACT_AT] + struct.pack("<2I", v, k) + data[COMPACT_AT + 8:])


BAD_COMPACT = {
    "compact-truncated": (_cut_compact, "ends inside the compact codes of layer"),
    "compact-spec-mismatch": (_swap_compact_bits, "compact blocks in spec K3s/g64 V4a/g64 .*, this engine.s compact region is K4s/g64 V3a/g64"),
    "compact-in-version-1": (_compact_in_v1, "impossible layer group"),
    "compact-partial-block": (lambda b: _edit(b, _present_at(cf.parse(b)) + 5, "<B", 2), "compact block where none"),
    "compact-without-spec": (lambda b: reseal(b[:COMPACT_AT] + bytes(44) + b[COMPACT_AT + 44:]), "where none can be"),
    "compact-record-sizes": (lambda b: _edit(b, COMPACT_AT + 36, "<I", 57), "compact record sizes"),
    "compact-rotation": (lambda b: _edit(b, COMPACT_AT + 24, "<I", 0), "invalid compact spec"),
    "compact-not-smaller": (lambda b: reseal(b[:COMPACT_AT] + struct.pack("<2I", 8, 5) + b[COMPACT_AT + 8:]),
                            "invalid compact spec"),  # K8/V5: 110 record bytes, not fewer than K8/V4's 106
}


@pytest.fixture(scope="module")
def compacted_saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("compacted") / "c.pkvc"
    e, c = compacted_engine()
    e.save(c, path)
    return path.read_bytes()


def _busy_compact_engine():
    """A compact engine with a conversation of its own holding 1 compact block (3 of 4 left free)."""
    e = torch_engine(compact_blocks=4)
    c = e.new_conversation()
    e.prefill(c, list(range(200, 250)))
    assert len(compact_aged(e, c, 16)) == 1
    return e


@pytest.mark.parametrize("case", list(BAD_COMPACT) + ["no-compact-region", "compact-region-full"])
def test_bad_compact_file_is_one_error_and_pool_unchanged(compacted_saved, tmp_path, case):
    path = tmp_path / "bad.pkvc"
    if case == "no-compact-region":  # a valid file, for a model compiled without compact_blocks
        path.write_bytes(compacted_saved)
        e, expect = torch_engine(), "3 block.s. in the compact tier .* no compact region: restore it with a model"
        c = e.new_conversation()
        e.prefill(c, PROMPT)
    elif case == "compact-region-full":  # a valid file needing 3 compact blocks where 2 are free
        path.write_bytes(compacted_saved)
        e, expect = torch_engine(compact_blocks=4), "compact region: needs 3 block"
        c = e.new_conversation()
        e.prefill(c, list(range(200, 250)))
        e.prefill(c, list(range(250, 270)))  # 70 tokens: blocks 1 and 2 are aged
        assert len(compact_aged(e, c, 16)) == 2
    else:
        make, expect = BAD_COMPACT[case]
        path.write_bytes(make(compacted_saved))
        e = _busy_compact_engine()
    snap = snapshot(e)
    with pytest.raises(PagedKVError, match=expect) as info:
        e.restore(path)
    assert "\n" not in str(info.value)
    assert_unchanged(e, snap)
    e.check_invariants()


def test_adaptive_restore_spills_a_compacted_conversation_for_compact_room(compacted_saved, tmp_path):
    """Policy adaptive: restoring a file whose compact blocks do not fit spills an idle conversation that
    holds compact blocks (its file has them too), then maps the file's in; both give their logits back."""
    path = tmp_path / "c.pkvc"
    path.write_bytes(compacted_saved)
    e = torch_engine(compact_blocks=4)
    e.policy, e.spill_dir = "adaptive", tmp_path / "spill"
    c = e.new_conversation()
    e.prefill(c, list(range(200, 290)))
    assert len(compact_aged(e, c, 16)) == 3  # 1 compact block left: the file needs 3
    r = torch_engine(compact_blocks=4)  # the same conversation, never spilled
    rc = r.new_conversation()
    r.prefill(rc, list(range(200, 290)))
    compact_aged(r, rc, 16)
    cb = e.restore(path)
    assert e.spilled() == [c] and e.stats()["ladder"]["spills"] == 1 and kinds(e, cb) == [1, 2, 2, 2, 1, 1]
    e.check_invariants()
    la, lr = e.step({c: [7]})[c], r.step({rc: [7]})[rc]  # c comes back; cb is idle, so it spills in turn
    assert np.array_equal(la, lr) and e.stats()["ladder"]["restores_from_spill"] == 1 and e.spilled() == [cb]
    assert kinds(e, c) == kinds(r, rc)
    e.check_invariants()


def test_python_compacted_file_read_by_cpp_and_refused_by_the_runner(cpp_tool, tmp_path):
    import json

    a, ca = compacted_engine()
    py = tmp_path / "py.pkvc"
    a.save(ca, py)
    d = cf.read(py)
    got = json.loads(subprocess.run([cpp_tool, "dump", py], capture_output=True, text=True, check=True).stdout)
    crc = lambda arrays: [zlib.crc32(np.ascontiguousarray(x).tobytes()) if x is not None else 0  # noqa: E731
                          for x in arrays]
    assert got["groups"] == [{"window": 0, "layers": list(d.groups[0].layers), "present": [1, 2, 2, 2, 1, 1]}]
    assert got["compact_spec"] == [int(getattr(d.compact, k)) for k in cf.SPEC_FIELDS] == [4, 3, 64, 64, 1, 0, 1, 1, 1]
    assert got["compact_records"] == [56, 6]
    assert (got["codes_crc"], got["scales_crc"]) == (crc(d.codes), crc(d.scales))
    assert (got["compact_codes_crc"], got["compact_scales_crc"]) == (crc(d.compact_codes), crc(d.compact_scales))
    cpp = tmp_path / "cpp.pkvc"
    subprocess.run([cpp_tool, "copy", py, cpp], check=True, capture_output=True)
    assert cpp.read_bytes() == py.read_bytes()
    b = torch_engine(compact_blocks=4)
    cb = b.restore(cpp)
    continue_both(a, ca, b, cb, steps=3)
    # the Android runner has no compact region: one line naming it, exit 2; a file without compact blocks passes
    out = subprocess.run([cpp_tool, "runner-check", py], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "holds 3 block(s) in the compact tier" in out.stderr and "no compact region" in out.stderr, out.stderr
    c = a.new_conversation()
    a.prefill(c, PROMPT)
    a.save(c, tmp_path / "plain.pkvc")
    out = subprocess.run([cpp_tool, "runner-check", tmp_path / "plain.pkvc"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr
    # a version-1 file: C++ reads it as the version-2 file without compact blocks, and writes version 2
    (tmp_path / "v1.pkvc").write_bytes(to_version_1((tmp_path / "plain.pkvc").read_bytes()))
    subprocess.run([cpp_tool, "copy", tmp_path / "v1.pkvc", tmp_path / "v1-copy.pkvc"], check=True, capture_output=True)
    assert (tmp_path / "v1-copy.pkvc").read_bytes() == (tmp_path / "plain.pkvc").read_bytes()


@pytest.mark.parametrize("case", list(BAD_COMPACT))
def test_cpp_rejects_bad_compact_files_in_one_line(cpp_tool, compacted_saved, tmp_path, case):
    make, expect = BAD_COMPACT[case]
    path = tmp_path / "bad.pkvc"
    path.write_bytes(make(compacted_saved))
    out = subprocess.run([cpp_tool, "runner-check" if case == "compact-spec-mismatch" else "dump", path],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out
    want = {"compact-spec-mismatch": "compact tier", "compact-in-version-1": "impossible layer group"}.get(case, expect)
    assert want in out.stderr, out.stderr


@pytest.fixture(scope="module")
def exported_compact(tmp_path_factory):
    """The tiny llama exported to ONNX and .pte with a compact region of 4 blocks (a 256-token pool)."""
    from export.artifacts import PoolRequest, export_artifacts

    out = tmp_path_factory.mktemp("exported-compact") / "tiny"
    export_artifacts("tiny-llama", out, ("onnx", "pte"), "default", PoolRequest(pool_tokens=256, max_seqs=2,
                                                                                compact_blocks=4),
                     max_tokens_per_call=32, model_and_tokenizer=(tiny_model("llama"), None), accept_fidelity=True)
    return out


@pytest.mark.parametrize("backend,native", [("onnxruntime", True), ("onnxruntime", False), ("executorch", None)],
                         ids=["ort-native", "ort-fallback", "executorch"])
def test_compacted_round_trip_exported_logits_bit_for_bit(exported_compact, tmp_path, backend, native):
    from runtime_sim.session import open_artifacts

    a = open_artifacts(exported_compact, backend, native=native, prefill_chunk=16)
    ca = a.new_conversation()
    list(a.generate(ca, LONG, 3))
    assert [i for i, _, _ in compact_aged(a, ca, 16)] == [1, 2, 3]
    a.save(ca, tmp_path / "c.pkvc")
    assert cf.read(tmp_path / "c.pkvc").n_compact == 3
    b = open_artifacts(exported_compact, backend, native=native, prefill_chunk=16)  # never ran a step
    cb = b.restore(tmp_path / "c.pkvc")
    assert b.counters.prefill_tokens == 0 and kinds(b, cb) == kinds(a, ca) == [1, 2, 2, 2, 1, 1]
    b.check_invariants()
    continue_both(a, ca, b, cb)
