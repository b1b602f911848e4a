"""The engine's 'adaptive' pool policy (issue #25's pressure ladder): on a model with a compact region,
aged blocks compacted first (idle conversations LRU first, then the active one); then idle
conversations spilled to flash (conversation files, compact blocks as their compact records) and
mapped back without prefill, then sliding.

A conversation that was spilled and restored must give the same logits bit for bit as the same
conversation in an engine that never spilled (same backend, same calls for that conversation).
"""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime_sim.backends import TorchBackend
from runtime_sim.engine import SPILLED, Engine
from toolkit.compiler import compile
from toolkit.errors import PagedKVError
from toolkit.tiny_models import tiny_model

PROMPT = list(range(3, 43))  # 40 tokens: 2 full blocks and a partial one


def torch_engine(num_blocks, policy="adaptive", max_seqs=3, spec="default", **kw):
    paged = compile(tiny_model("llama"), spec, num_blocks=num_blocks, max_seqs=max_seqs)
    return Engine(TorchBackend(paged), prefill_chunk=16, policy=policy, **kw)


def step_both(a, ca, r, cr, tokens):
    """The same tokens into a's conversation and the reference's; their logits must be equal bit for bit."""
    for t in tokens:
        la, lr = a.step({ca: [t]})[ca], r.step({cr: [t]})[cr]
        assert np.array_equal(la, lr)


def table(e, cid):
    return e.pool.block_table(e.conversations[cid].seq)


def records(e, cid):
    """What a conversation's next logits depend on besides its tokens: per layer, the records of its
    blocks in logical order (a compact block's from the compact region, tagged) and its stage rows."""
    conv, n = e.conversations[cid], e.groups[0].num_blocks
    ids = table(e, cid)[:-(-len(conv.history) // e.pool.block_size)]
    compact = e.backend.paged.compact_pool_tensors()
    out = []
    for i, (codes, scales, stage) in enumerate(e.backend.pool_arrays()):
        for b in ids:
            out.append(("default", codes[b].tobytes(), scales[b].tobytes()) if b < n else
                       ("compact", compact[i][0][b - n].numpy().tobytes(), compact[i][1][b - n].numpy().tobytes()))
        out.append(stage[conv.seq].tobytes())
    return out


# ------------------------------------------------------------------------ spill and restore, torch


@pytest.mark.parametrize("spec", ["default", "fp32"])
def test_spilled_conversation_resumes_bit_for_bit_without_prefill(tmp_path, spec):
    a = torch_engine(6, spec=spec, spill_dir=tmp_path)  # 96 tokens: two chats of 40+ do not fit
    r = torch_engine(32, "error", spec=spec)  # the reference never runs short
    ca, cb = a.new_conversation(), a.new_conversation()
    ra, rb = r.new_conversation(), r.new_conversation()
    assert np.array_equal(a.prefill(ca, PROMPT), r.prefill(ra, PROMPT))
    second = PROMPT[::-1] + [60, 61, 62, 63, 64, 65, 66, 67, 68]  # 49 tokens: in a, cb spills ca
    assert np.array_equal(a.prefill(cb, second), r.prefill(rb, second))
    assert a.spilled() == [ca] and a.conversations[ca].seq == SPILLED
    assert len(list(tmp_path.iterdir())) == 1
    a.check_invariants()
    prefilled = a.counters.prefill_tokens
    step_both(a, ca, r, ra, [5, 6, 7, 8])  # ca is mapped back (cb spilled for it), then continues
    assert a.spilled() == [cb]
    step_both(a, cb, r, rb, [9, 10])  # and cb comes back in turn
    s = a.stats()["ladder"]
    assert (s["spills"], s["restores_from_spill"], s["slides"], s["spill_reprefills"]) == (3, 2, 0, 0)
    assert s["spill_bytes"] > 0 and a.counters.prefill_tokens == prefilled  # no re-prefill
    assert [p.name for p in tmp_path.iterdir()] == [a.conversations[ca].spill.name]  # restored files deleted
    a.check_invariants()
    a.close(ca)  # a spilled conversation's file goes with it
    assert list(tmp_path.iterdir()) == []
    a.check_invariants()


def test_shared_blocks_stay_for_the_fork_when_its_parent_spills(tmp_path):
    a, r = torch_engine(9, spill_dir=tmp_path), torch_engine(32, "error")
    ids = {}
    for e in (a, r):
        base = e.new_conversation()
        e.prefill(base, list(range(3, 52)))  # 49 tokens: 3 full blocks + 1
        kid = e.fork(base)
        e.prefill(kid, [70, 71])  # copy-on-write of the partial block: 3 shared + 1 each
        ids[e] = (base, kid)
    (ab, ak), (rb, rk) = ids[a], ids[r]
    assert a.stats()["used_blocks"] == 5 and a.stats()["shared_blocks"] == 3
    shared = table(a, ak)[:3]
    step_both(a, ak, r, rk, [4])  # kid used last: base is the least recently used
    other = a.new_conversation()
    a.prefill(other, list(range(100, 164)))  # 4 full blocks, 4 free; the step below needs a 5th
    a.step({other: [5]})
    c = r.new_conversation()
    r.prefill(c, list(range(100, 164)))
    r.step({c: [5]})
    assert a.spilled() == [ab], "base spilled first (LRU), freeing only its own partial block"
    assert table(a, ak)[:3] == shared, "the blocks it shared with the fork stay"
    a.check_invariants()
    step_both(a, ak, r, rk, [6, 7])
    step_both(a, ab, r, rb, [8, 9])  # base mapped back (others spilled to make room)
    step_both(a, ak, r, rk, [10])
    a.check_invariants()
    s = a.stats()["ladder"]
    assert s["restores_from_spill"] >= 1 and s["slides"] == 0 and s["spill_reprefills"] == 0


def test_spill_write_failure_falls_through_to_slide_with_nothing_lost(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spill directory should be")
    a = torch_engine(4, max_seqs=2, spill_dir=blocker / "spill")  # mkdir fails: NotADirectoryError
    r = torch_engine(16, "error", max_seqs=2)
    ca, ra = a.new_conversation(), r.new_conversation()
    a.prefill(ca, PROMPT[:30])
    r.prefill(ra, PROMPT[:30])
    before = table(a, ca)
    cb = a.new_conversation()
    a.prefill(cb, list(range(100, 148)))  # 3 blocks, 2 free: spill fails, cb slides its own blocks
    s = a.stats()["ladder"]
    assert s["spill_failures"] >= 1 and s["spills"] == 0 and s["slides"] >= 1
    assert table(a, ca) == before and a.spilled() == []
    a.check_invariants()
    step_both(a, ca, r, ra, [5, 6])  # ca lost nothing


def test_sequence_slots_spill_lru_and_clear_and_lost_file(tmp_path):
    a = torch_engine(16, max_seqs=2, spill_dir=tmp_path)
    c0, c1 = a.new_conversation(), a.new_conversation()
    a.prefill(c0, PROMPT)
    a.prefill(c1, [4, 5, 6])
    c2 = a.new_conversation()  # both slots held: c0 (least recently used) is spilled for a slot
    assert a.spilled() == [c0] and a.stats()["ladder"]["spills"] == 1
    a.prefill(c2, [7, 8])
    a.clear(c0)  # a spilled conversation cleared: its file is deleted, it starts empty in a slot
    assert a.conversations[c0].history == [] and a.conversations[c0].spill is None
    assert a.spilled() == [c1] and len(list(tmp_path.iterdir())) == 1
    a.check_invariants()
    a.conversations[c1].spill.unlink()  # the file vanished behind the engine's back
    a.prefill(c1, [9])  # its tokens are still known: prefilled again
    assert a.conversations[c1].history == [4, 5, 6, 9] and a.stats()["ladder"]["spill_reprefills"] == 1
    a.check_invariants()


def test_restore_into_a_full_pool_spills_idle_conversations(tmp_path):
    """Engine.restore (and /load, through restore_data) under adaptive: idle chats make room; a file
    that cannot be restored here spills nobody."""
    src = torch_engine(16)
    c = src.new_conversation()
    src.prefill(c, PROMPT)
    src.save(c, tmp_path / "c.pkvc")
    a = torch_engine(6, max_seqs=2, spill_dir=tmp_path / "spill")
    x, y = a.new_conversation(), a.new_conversation()
    a.prefill(x, PROMPT[:30])
    a.prefill(y, PROMPT[:20])  # 4 of 6 blocks and both slots held
    bad = tmp_path / "bad.pkvc"
    data = (tmp_path / "c.pkvc").read_bytes()
    bad.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(PagedKVError, match="checksum"):
        a.restore(bad)
    assert a.spilled() == []
    r = a.restore(tmp_path / "c.pkvc")  # needs 3 blocks and a slot: x (least recently used) is spilled
    assert a.spilled() == [x] and a.conversations[r].history == PROMPT
    a.check_invariants()
    assert np.array_equal(a.step({r: [5]})[r], src.step({c: [5]})[c])


def test_policy_is_known_to_the_cli_and_session():
    from runtime_sim.engine import POLICIES
    from toolkit.cli import check_runtime_options

    assert "adaptive" in POLICIES
    check_runtime_options(None, None, 0, "adaptive", "torch")  # no exit


# ------------------------------------------------------------------- exported model: ORT and ET


@pytest.fixture(scope="module")
def exported(tiny_llama_onnx_pte):
    return tiny_llama_onnx_pte


@pytest.mark.parametrize("backend,native", [("onnxruntime", True), ("onnxruntime", False), ("executorch", None)],
                         ids=["ort-native", "ort-fallback", "executorch"])
def test_exported_spill_resumes_bit_for_bit(exported, tmp_path, backend, native):
    """A 256-token pool: a 200-token chat spills the 100-token one; it comes back with the logits of the
    same engine run without the other chat."""
    from runtime_sim.session import open_artifacts

    a = open_artifacts(exported, backend, native=native, prefill_chunk=16, policy="adaptive")
    a.spill_dir = tmp_path
    r = open_artifacts(exported, backend, native=native, prefill_chunk=16)
    ca, ra = a.new_conversation(), r.new_conversation()
    first = list(range(3, 103))
    assert np.array_equal(a.prefill(ca, first), r.prefill(ra, first))
    cb = a.new_conversation()
    a.prefill(cb, list(range(200, 400)))
    assert a.spilled() == [ca]
    step_both(a, ca, r, ra, [5, 6, 7])
    assert a.spilled() == [cb] and a.stats()["ladder"]["restores_from_spill"] == 1
    assert a.counters.prefill_tokens == 300
    a.check_invariants()


# -------------------------------------------------------------- stateful: the ladder's invariants


_BACKEND = {}


def _shared_backend():
    """One compiled tiny model for every example (a fresh Engine each time; its pool is all free)."""
    if "be" not in _BACKEND:
        _BACKEND["be"] = TorchBackend(compile(tiny_model("llama"), "default", num_blocks=6, max_seqs=3))
    return _BACKEND["be"]


class LadderMachine(RuleBasedStateMachine):
    """Many conversations with random turns, forks, clears and closes in a 6-block pool (96 tokens)
    with 3 slots under 'adaptive'. After every step: the pool's invariants, every conversation
    resident or spilled (its file on disk), its token history intact, and a block held by two
    conversations only where they share the same tokens at the same place (a fork or prefix)."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory(prefix="ladder-test-")
        self.e = Engine(_shared_backend(), prefill_chunk=16, policy="adaptive", spill_dir=self.dir.name)
        self.want: dict[int, list[int]] = {}  # conversation -> every token it was given, in order

    taken: dict[str, int] = {}  # the rungs taken over all examples

    def teardown(self):
        for k in ("spills", "restores_from_spill", "slides"):
            self.taken[k] = self.taken.get(k, 0) + self.e.stats()["ladder"][k]
        self.dir.cleanup()

    @precondition(lambda self: len(self.want) < 5)
    @rule()
    def new(self):
        self.want[self.e.new_conversation()] = []

    @precondition(lambda self: self.want)
    @rule(data=st.data(), n=st.integers(1, 40), decode=st.integers(0, 3))
    def turn(self, data, n, decode):
        cid = data.draw(st.sampled_from(sorted(self.want)))
        prompt = data.draw(st.lists(st.integers(3, 120), min_size=n, max_size=n))
        logits = self.e.prefill(cid, prompt)
        self.want[cid] += prompt
        for _ in range(decode):
            tok = int(np.argmax(logits))
            logits = self.e.step({cid: [tok]})[cid]
            self.want[cid].append(tok)

    @precondition(lambda self: self.want and len(self.want) < 5)
    @rule(data=st.data())
    def fork(self, data):
        cid = data.draw(st.sampled_from(sorted(self.want)))
        self.want[self.e.fork(cid)] = list(self.want[cid])

    @precondition(lambda self: self.want)
    @rule(data=st.data(), close=st.booleans())
    def clear_or_close(self, data, close):
        cid = data.draw(st.sampled_from(sorted(self.want)))
        if close:
            self.e.close(cid)
            del self.want[cid]
        else:
            self.e.clear(cid)
            self.want[cid] = []

    @invariant()
    def pool_and_conversations(self):
        e = self.e
        e.check_invariants()  # free + used == total, refcounts == tables, resident xor spilled
        assert sorted(e.conversations) == sorted(self.want)
        for cid, c in e.conversations.items():
            assert c.history + c.pending == self.want[cid], "a conversation's tokens were lost"
        files = {p.name for p in Path(self.dir.name).iterdir()}
        assert files == {e.conversations[cid].spill.name for cid in e.spilled()}
        bs, holders = e.pool.block_size, {}
        for cid, c in e.conversations.items():
            if c.spill is None:
                for i, b in enumerate(e.pool.block_table(c.seq)):
                    if b >= 0:
                        holders.setdefault(b, []).append((i, c.history[i * bs:(i + 1) * bs]))
        for b, held in holders.items():
            assert all(h == held[0] for h in held), f"block {b} is in two conversations with other content"


def test_ladder_state_machine():
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(LadderMachine, settings=settings(
        max_examples=8, stateful_step_count=20, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    # the machine must reach the spill rungs; the slide rung is driven deterministically by
    # test_spill_write_failure_falls_through_to_slide_with_nothing_lost (random turns rarely outgrow the pool)
    assert all(LadderMachine.taken.get(k) for k in ("spills", "restores_from_spill")), LadderMachine.taken


class CompactLadderMachine(LadderMachine):
    """The same machine on a model with a compact region (8 default + 6 compact blocks) and a 16-token
    horizon: the compact rung comes first; conversations holding compact blocks are spilled like any
    other (their files hold the compact records) and mapped back into the compact region."""

    def __init__(self):
        super().__init__()
        if "compact" not in _BACKEND:
            _BACKEND["compact"] = TorchBackend(compile(tiny_model("llama"), "default", num_blocks=8, max_seqs=3,
                                                       compact_blocks=6))
        self.e = Engine(_BACKEND["compact"], prefill_chunk=16, policy="adaptive", spill_dir=self.dir.name,
                        compact_horizon=16)

    taken: dict[str, int] = {}

    def teardown(self):
        self.taken["compactions"] = self.taken.get("compactions", 0) + self.e.counters.compactions
        self.taken["compacted_spills"] = self.taken.get("compacted_spills", 0) + len(self.compacted_files)
        super().teardown()

    @property
    def compacted_files(self) -> set:
        if not hasattr(self, "_compacted_files"):
            self._compacted_files = set()  # spill files seen holding compact blocks
        return self._compacted_files

    @invariant()
    def compact_blocks_only_where_allowed(self):
        from runtime_sim import conversation_file as cf

        n = self.e.pool.main.num_blocks
        for c in self.e.conversations.values():
            if c.spill is not None:
                d = cf.read(c.spill)  # a spilled conversation's file: its tokens, compact blocks included
                assert d.tokens == c.history and d.pending == c.pending
                if d.n_compact:
                    self.compacted_files.add((c.spill.name, tuple(d.tokens)))
                continue
            assert all(b < n for b in self.e.pool.block_table(c.seq)[:self.e.sink_blocks])  # sinks never move
            full = self.e.pool.length(c.seq) // self.e.pool.block_size
            tail = self.e.pool.block_table(c.seq)[full:]
            assert all(b < n for b in tail), "the block being written is in the compact region"


def test_ladder_state_machine_with_the_compact_rung():
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(CompactLadderMachine, settings=settings(
        max_examples=4, stateful_step_count=20, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert all(CompactLadderMachine.taken.get(k) for k in ("compactions", "compacted_spills", "restores_from_spill")), \
        CompactLadderMachine.taken


# ------------------------------------------------------------------ the compact rung, deterministic


def test_compact_rung_comes_before_spill_and_slide(tmp_path):
    """10 default + 6 compact blocks, horizon 16: a new chat that needs blocks first compacts idle chats'
    aged blocks, oldest first and only as many as it is short of (LRU chat first; nothing spilled or slid
    while that suffices), a chat never compacted
    gives the logits of a run without pressure bit for bit, and every chat keeps generating. Once the
    compact region is full, the least recently used idle chat (compacted) is spilled with its compact
    records, freeing blocks of both regions; nothing is evicted or slid, and its next turn maps it back
    from the file with the same records and no prefill."""
    paged = compile(tiny_model("llama"), "default", num_blocks=10, max_seqs=3, compact_blocks=6)
    e = Engine(TorchBackend(paged), prefill_chunk=16, policy="adaptive", spill_dir=tmp_path, compact_horizon=16)
    r = torch_engine(32, "error")  # the reference never runs short (no compact region: same bits without one)
    pa = [(7 * i + 3) % 500 + 3 for i in range(80)]  # 80 tokens: blocks 0..4; aged (ending >= 16 back): 1..3
    pb = [(11 * i + 5) % 500 + 3 for i in range(80)]
    pc = PROMPT  # 40 tokens, 3 blocks
    a, b, c = e.new_conversation(), e.new_conversation(), e.new_conversation()
    ra, rb, rc = r.new_conversation(), r.new_conversation(), r.new_conversation()
    assert np.array_equal(e.prefill(a, pa), r.prefill(ra, pa))
    assert np.array_equal(e.prefill(b, pb), r.prefill(rb, pb))
    assert e.pool.num_free_blocks == 0
    e.check_invariants()

    # (a) c needs 3 blocks: a (least recently used) gives its 3 aged blocks, b is left alone
    assert np.array_equal(e.prefill(c, pc), r.prefill(rc, pc))
    s = e.stats()["ladder"]
    assert (s["compactions"], s["compacted_blocks"], s["compact_blocks_in_use"]) == (1, 3, 3)
    assert (s["spills"], s["slides"], s["spill_failures"]) == (0, 0, 0) and e.spilled() == []
    n = e.pool.main.num_blocks
    assert [i for i, x in enumerate(table(e, a)) if x >= n] == [1, 2, 3]
    assert all(x < n for x in table(e, b) + table(e, c))
    e.check_invariants()

    # (b) c decodes into a 4th block: a has nothing more old enough, so b (next LRU idle) gives the one
    # block c is short of, its oldest aged one (1 of its 3 aged blocks: no block loses bits before it must)
    for t in range(9):  # c: 40 -> 49 tokens, its 4th block from token 48 on
        step_both(e, c, r, rc, [60 + t])
        e.check_invariants()
    s = e.stats()["ladder"]
    assert (s["compactions"], s["compacted_blocks"], s["spills"], s["slides"]) == (2, 4, 0, 0)
    assert [i for i, x in enumerate(table(e, b)) if x >= n] == [1]
    assert np.array_equal(e.step({c: [70]})[c], r.step({rc: [70]})[rc])  # c, never compacted: same bits

    # compacted chats go on generating (their own greedy tokens; the compact blocks are read); each needs
    # one more block, which the least recently used idle chat gives: b its block 2, then c its block 1
    for cid, (victim, blocks) in ((a, (b, [1, 2])), (b, (c, [1]))):
        out = list(e.generate(cid, [12], 5))
        assert len(out) == 5 and all(0 <= t < 512 for t in out)
        assert [i for i, x in enumerate(table(e, victim)) if x >= n] == blocks
        e.check_invariants()

    # compact region full (6/6): the next shortage cannot compact, so a (the least recently used idle
    # chat, compacted) is spilled with its compact records; no token is lost, nothing is evicted or slid
    before = e.stats()["ladder"]
    assert before["compact_blocks_in_use"] == 6
    want_a = records(e, a)
    kinds_a = [x >= n for x in table(e, a)]
    toks_a = (list(e.conversations[a].history), list(e.conversations[a].pending))
    for t in range(20):
        e.step({c: [80 + t]})
        e.check_invariants()
    s = e.stats()["ladder"]
    assert e.spilled() == [a] and s["spills"] == 1 and s["spill_bytes"] > 0, (s, e.spilled())
    assert (s["evictions"], s["slides"], s["spill_failures"]) == (0, 0, 0)
    assert (e.conversations[a].history, e.conversations[a].pending) == toks_a
    assert s["compact_blocks_in_use"] == 3 + s["compacted_blocks"] - before["compacted_blocks"]
    # a's next turn maps it back (save() makes it resident first; b, now the least recently used, is
    # spilled for room): its compact blocks into the compact region, every record as it was, no prefill
    prefilled = e.counters.prefill_tokens
    e.save(a, tmp_path / "a.pkvc")
    s = e.stats()["ladder"]
    assert e.spilled() == [b] and (s["spills"], s["restores_from_spill"], s["evictions"]) == (2, 1, 0)
    assert [x >= n for x in table(e, a)] == kinds_a and records(e, a) == want_a
    e.check_invariants()
    e.prefill(a, [13])
    assert e.counters.prefill_tokens - prefilled == len(toks_a[1]) + 1
    assert e.conversations[a].history == toks_a[0] + toks_a[1] + [13]
    e.check_invariants()
    for cid in (a, b, c):
        e.close(cid)
    e.check_invariants()
    assert e.pool.num_free_blocks == 10 and e.pool.main.num_free_compact_blocks == 6


def test_spilled_compacted_conversation_without_compact_room_is_prefilled_again(tmp_path):
    """A spilled compacted conversation whose compact blocks cannot be mapped back (the other
    conversation of the same step holds the whole compact region, so nothing can be spilled for room)
    comes back by prefill of its tokens: nothing lost, the file dropped, counted as a spill reprefill."""
    from runtime_sim.compact import compact_aged

    paged = compile(tiny_model("llama"), "default", num_blocks=20, max_seqs=3, compact_blocks=3)
    e = Engine(TorchBackend(paged), prefill_chunk=16, policy="adaptive", spill_dir=tmp_path, compact_horizon=16)
    a, b, c = e.new_conversation(), e.new_conversation(), e.new_conversation()
    pa = [(7 * i + 3) % 500 + 3 for i in range(80)]
    e.prefill(a, pa)
    assert len(compact_aged(e, a, 16)) == 3  # the compact region is full; a holds 2 default blocks
    e.prefill(c, [(11 * i + 5) % 500 + 3 for i in range(300)])  # 19 blocks: a (idle, compacted) is spilled
    assert e.spilled() == [a] and e.pool.main.num_free_compact_blocks == 3
    e.close(c)
    e.prefill(b, list(range(3, 103)))
    assert len(compact_aged(e, b, 16)) == 3  # b takes the whole compact region
    s0 = e.stats()["ladder"]
    out = e.step({a: [5], b: [6]})  # both in one step: b cannot be spilled to make room for a's compact blocks
    s = e.stats()["ladder"]
    assert (s["spill_reprefills"], s["restores_from_spill"]) == (1, s0["restores_from_spill"]) and e.spilled() == []
    assert e.conversations[a].history == pa + [5] and len(out[a]) == 512
    assert all(x < 20 for x in table(e, a)) and sum(x >= 20 for x in table(e, b)) == 3
    assert (s["slides"], s["evictions"]) == (0, 0) and not list(tmp_path.iterdir())  # a's spill file is gone
    e.check_invariants()


def test_no_compact_rung_without_a_compact_region(tmp_path):
    """A model without a compact region: the adaptive ladder is spill then slide, no compaction counted."""
    e = torch_engine(6, spill_dir=tmp_path, compact_horizon=16)
    ca, cb = e.new_conversation(), e.new_conversation()
    e.prefill(ca, PROMPT)
    e.prefill(cb, PROMPT[::-1] + list(range(60, 69)))
    s = e.stats()["ladder"]
    assert s["spills"] == 1 and s["compactions"] == 0 and s["compact_blocks_in_use"] == 0
    with pytest.raises(PagedKVError, match="compact_horizon"):
        torch_engine(6, compact_horizon=0)


# ------------------------------------------------------------------ the ladder in `pagedkv simulate`


def test_simulate_ladder_holds_more_than_evict_before_a_loss():
    from runtime_sim.simulate import SimConfig, simulate, to_json

    cfg = SimConfig(turns=250, chats=12, seed=3)
    res = simulate(cfg, ("paged-quant", "paged-quant-evict", "paged-quant-ladder"))
    for r in res["strategies"]:
        r["_pool"].check_invariants()
    quant, evict, ladder = to_json(res, with_series=False)["strategies"]
    # the same pool and trace: evict loses its first cache exactly where paged-quant first fails
    assert evict["pressure"]["evictions"] > 0 and evict["failures"] == 0
    assert (evict["first_loss_event"], evict["tokens_before_loss"]) == \
        (quant["first_failure_event"], quant["tokens_before_failure"])
    # the ladder spilled instead: nothing lost, every turn served, more tokens held at once
    p = ladder["pressure"]
    assert p["spills"] > 0 and p["restores"] > 0 and p["slides"] == 0 and ladder["losses"] == 0
    assert ladder["turns_served"] == cfg.turns and ladder["peak_flash_bytes"] > 0
    assert ladder["peak_tokens_before_loss"] > evict["peak_tokens_before_loss"]


def test_simulate_ladder_slides_when_flash_is_full():
    from runtime_sim.simulate import SimConfig, simulate, to_json

    cfg = SimConfig(turns=250, chats=12, seed=3, flash_bytes=20 * 2**20)
    (ladder,) = to_json(simulate(cfg, ("paged-quant-ladder",)), with_series=False)["strategies"]
    p = ladder["pressure"]
    assert p["spill_failures"] > 0 and p["slides"] > 0 and ladder["losses"] == p["slides"]
    assert ladder["peak_flash_bytes"] <= cfg.flash_bytes
    assert ladder["first_loss_event"] is not None
