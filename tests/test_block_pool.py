import copy

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from toolkit.block_pool import HOLE, BlockPool
from toolkit.errors import PagedKVError, PoolExhausted, PoolStateError, SpecError

BS = 16


def snapshot(pool: BlockPool) -> dict:
    return copy.deepcopy(vars(pool))


def grow(pool: BlockPool, seq: int, tokens: list[int]) -> list[tuple[int, int]]:
    copies = pool.reserve(seq, len(tokens))
    pool.commit(seq, tokens)
    return copies


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize("bs", [0, 8, 64, -16])
def test_bad_block_size(bs):
    with pytest.raises(SpecError, match=f"block size {bs} is invalid: use 16 or 32"):
        BlockPool(4, bs, 2)


@pytest.mark.parametrize("kw", [dict(num_blocks=0), dict(max_seqs=0)])
def test_bad_counts(kw):
    args = dict(num_blocks=4, block_size=16, max_seqs=2) | kw
    with pytest.raises(PagedKVError, match=str(list(kw.values())[0])):
        BlockPool(**args)


def test_fresh_pool():
    pool = BlockPool(8, 32, 3)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    assert pool.live_sequences() == []
    assert pool.stats() == dict(total_blocks=8, used_blocks=0, free_blocks=8, utilization=0.0,
                                internal_fragmentation=0.0, sequences=0, shared_blocks=0)
    pool.check_invariants()


# ---------------------------------------------------------------- sequences, reserve, commit, slots


def test_new_sequence_slots_run_out():
    pool = BlockPool(4, BS, 2)
    assert [pool.new_sequence(), pool.new_sequence()] == [0, 1]
    with pytest.raises(PoolStateError, match="all 2 sequence slots in use; clear a conversation"):
        pool.new_sequence()
    pool.release(0)
    assert pool.new_sequence() == 0


def test_reserve_commit_slots():
    pool = BlockPool(8, BS, 2)
    s = pool.new_sequence()
    assert pool.reserve(s, 20) == []
    assert len(pool.block_table(s)) == 2 and pool.num_used_blocks == 2
    assert pool.length(s) == 0
    b0, b1 = pool.block_table(s)
    assert pool.slots(s, 14, 4) == [b0 * BS + 14, b0 * BS + 15, b1 * BS, b1 * BS + 1]
    pool.commit(s, list(range(20)))
    assert pool.length(s) == 20 and pool.tokens(s) == list(range(20))
    # growing inside the last block needs no new block
    assert pool.reserve(s, 12) == [] and pool.num_used_blocks == 2
    pool.commit(s, [0] * 12)
    assert pool.reserve(s, 1) == [] and pool.num_used_blocks == 3
    assert pool.reserve(s, 0) == []
    pool.check_invariants()


def test_commit_without_reserve():
    pool = BlockPool(4, BS, 1)
    s = pool.new_sequence()
    before = snapshot(pool)
    with pytest.raises(PoolStateError, match="exceeds its reservation.*Call reserve"):
        pool.commit(s, [1, 2, 3])
    assert snapshot(pool) == before
    pool.reserve(s, 2)
    with pytest.raises(PoolStateError, match="reserved 2"):
        pool.commit(s, [1, 2, 3])


def test_slots_outside_reservation():
    pool = BlockPool(4, BS, 1)
    s = pool.new_sequence()
    pool.reserve(s, 3)
    with pytest.raises(PoolStateError, match="outside its reserved capacity of 3"):
        pool.slots(s, 0, 4)
    with pytest.raises(PoolStateError):
        pool.slots(s, -1, 1)


def test_bad_reserve_count():
    pool = BlockPool(4, BS, 1)
    s = pool.new_sequence()
    with pytest.raises(PagedKVError, match="n_new_tokens -1"):
        pool.reserve(s, -1)


def test_exhaustion_is_atomic():
    pool = BlockPool(4, BS, 2)
    a, b = pool.new_sequence(), pool.new_sequence()
    grow(pool, a, list(range(40)))  # 3 blocks
    before = snapshot(pool)
    with pytest.raises(PoolExhausted) as err:
        pool.reserve(b, 2 * BS + 1)
    assert (err.value.requested_blocks, err.value.free_blocks) == (3, 1)
    assert f"sequence {b}" in str(err.value) and "Clear a conversation" in str(err.value)
    assert snapshot(pool) == before
    pool.check_invariants()


def test_exhaustion_with_cow_is_atomic():
    pool = BlockPool(3, BS, 3)
    a = pool.new_sequence()
    grow(pool, a, list(range(20)))  # 2 blocks, last one partial
    f = pool.fork(a)
    grow(pool, pool.new_sequence(), [1])  # takes the last free block
    before = snapshot(pool)
    with pytest.raises(PoolExhausted) as err:
        pool.reserve(f, 1)  # must copy the shared partial block: needs 1, 0 free
    assert (err.value.requested_blocks, err.value.free_blocks) == (1, 0)
    assert snapshot(pool) == before
    pool.check_invariants()


def test_release_unknown_and_double():
    pool = BlockPool(4, BS, 2)
    s = pool.new_sequence()
    grow(pool, s, [1] * 5)
    pool.release(s)
    before = snapshot(pool)
    with pytest.raises(PoolStateError, match="double free"):
        pool.release(s)
    with pytest.raises(PoolStateError, match="unknown sequence 7"):
        pool.release(7)
    with pytest.raises(PoolStateError, match="unknown sequence"):
        pool.length(-1)
    assert snapshot(pool) == before
    assert pool.num_free_blocks == 4


def test_clear():
    pool = BlockPool(8, BS, 3)
    for _ in range(3):
        grow(pool, pool.new_sequence(), [1] * 20)
    pool.clear()
    assert pool.live_sequences() == [] and pool.num_free_blocks == 8
    pool.check_invariants()


# ---------------------------------------------------------------- fork / copy-on-write


def test_fork_partial_last_block_copies_on_write():
    pool = BlockPool(8, BS, 2)
    a = pool.new_sequence()
    grow(pool, a, list(range(20)))
    f = pool.fork(a)
    assert pool.block_table(f) == pool.block_table(a)
    assert pool.length(f) == 20 and pool.tokens(f) == list(range(20))
    assert pool.stats()["shared_blocks"] == 2 and pool.num_used_blocks == 2
    shared_last = pool.block_table(a)[1]
    copies = pool.reserve(f, 1)
    new_last = pool.block_table(f)[1]
    assert copies == [(shared_last, new_last)] and new_last != shared_last
    assert pool.block_table(f)[0] == pool.block_table(a)[0]
    pool.commit(f, [99])
    # the original may now append in place: its last block is private again
    assert pool.reserve(a, 1) == []
    pool.commit(a, [7])
    assert pool.tokens(a)[-1] == 7 and pool.tokens(f)[-1] == 99
    pool.check_invariants()


def test_fork_of_full_blocks_needs_no_copy():
    pool = BlockPool(8, BS, 2)
    a = pool.new_sequence()
    grow(pool, a, list(range(2 * BS)))
    f = pool.fork(a)
    assert pool.reserve(f, 5) == [] and pool.reserve(a, 5) == []
    assert pool.block_table(f)[:2] == pool.block_table(a)[:2]
    assert pool.block_table(f)[2] != pool.block_table(a)[2]
    pool.check_invariants()


def test_fork_after_reserve_requires_new_reserve():
    pool = BlockPool(8, BS, 2)
    a = pool.new_sequence()
    grow(pool, a, [1] * 5)
    pool.reserve(a, 3)
    f = pool.fork(a)  # shares the block a was about to write
    with pytest.raises(PoolStateError, match="shared"):
        pool.slots(a, 5, 3)
    with pytest.raises(PoolStateError, match="reserve"):
        pool.commit(a, [2, 2, 2])
    assert len(pool.reserve(a, 3)) == 1
    pool.slots(a, 5, 3)
    pool.commit(a, [2, 2, 2])
    assert pool.length(f) == 5
    pool.check_invariants()


def test_release_of_fork_keeps_shared_blocks():
    pool = BlockPool(4, BS, 2)
    a = pool.new_sequence()
    grow(pool, a, [3] * 20)
    f = pool.fork(a)
    pool.release(a)
    assert pool.num_used_blocks == 2 and pool.stats()["shared_blocks"] == 0
    pool.release(f)
    assert pool.num_free_blocks == 4
    pool.check_invariants()


# ---------------------------------------------------------------- prefix cache


def test_prefix_hit_after_release():
    pool = BlockPool(8, BS, 2)
    prompt = list(range(40))
    a = pool.new_sequence()
    grow(pool, a, prompt)
    table = pool.block_table(a)
    pool.release(a)
    assert pool.num_free_blocks == 8
    s, n = pool.new_sequence_with_prefix(prompt + [1, 2])
    assert n == 2 * BS
    assert pool.block_table(s) == table[:2] and pool.length(s) == 32
    assert pool.num_used_blocks == 2
    pool.check_invariants()
    grow(pool, s, (prompt + [1, 2])[32:])
    assert pool.length(s) == 42


def test_prefix_never_covers_whole_prompt():
    pool = BlockPool(8, BS, 3)
    prompt = list(range(2 * BS))
    grow(pool, pool.new_sequence(), prompt)
    s, n = pool.new_sequence_with_prefix(prompt)
    assert n == BS  # the last full block is left to prefill so the runtime gets logits
    s2, n2 = pool.new_sequence_with_prefix([])
    assert n2 == 0 and pool.length(s2) == 0


def test_prefix_miss_after_reallocation():
    pool = BlockPool(2, BS, 2)
    prompt = list(range(2 * BS))
    a = pool.new_sequence()
    grow(pool, a, prompt)
    pool.release(a)
    b = pool.new_sequence()
    grow(pool, b, [7] * (2 * BS))  # reuses both blocks for other content
    pool.release(b)
    s, n = pool.new_sequence_with_prefix(prompt + [0])
    assert n == 0
    pool.release(s)
    s, n = pool.new_sequence_with_prefix([7] * (2 * BS) + [0])
    assert n == 2 * BS
    pool.check_invariants()


def test_prefix_partial_miss_is_chained():
    pool = BlockPool(8, BS, 3)
    a = pool.new_sequence()
    grow(pool, a, list(range(3 * BS)))
    other = [999] * BS + list(range(BS, 3 * BS))  # same 2nd/3rd blocks, different 1st
    s, n = pool.new_sequence_with_prefix(other + [0])
    assert n == 0
    s, n = pool.new_sequence_with_prefix(list(range(BS)) + [5] * BS + [0])
    assert n == BS


def test_shared_system_prompt_costs_blocks_once():
    pool = BlockPool(16, BS, 4)
    system = list(range(3 * BS))
    first = pool.new_sequence()
    grow(pool, first, system)
    used_one = pool.num_used_blocks
    for user in range(3):
        s, n = pool.new_sequence_with_prefix(system + [1000 + user] * 2)
        assert n == 3 * BS
        grow(pool, s, [1000 + user] * 2)
    assert pool.num_used_blocks == used_one + 3  # one private tail block each
    st_ = pool.stats()
    assert st_["shared_blocks"] == 3 and st_["sequences"] == 4
    assert st_["utilization"] == pytest.approx((3 * BS + 3 * 2) / (6 * BS))
    assert st_["utilization"] + st_["internal_fragmentation"] == pytest.approx(1.0)
    pool.check_invariants()


# ---------------------------------------------------------------- drop_blocks


def test_drop_blocks_makes_holes():
    pool = BlockPool(8, BS, 1)
    s = pool.new_sequence()
    grow(pool, s, list(range(4 * BS + 3)))
    table = pool.block_table(s)
    pool.drop_blocks(s, [1, 2])
    assert pool.block_table(s) == [table[0], HOLE, HOLE, table[3], table[4]]
    assert pool.num_used_blocks == 3 and pool.length(s) == 4 * BS + 3
    assert pool.slots(s, 4 * BS + 3, 0) == []
    with pytest.raises(PoolStateError, match="dropped block 1"):
        pool.slots(s, BS, 1)
    grow(pool, s, [0] * BS)
    pool.check_invariants()
    pool.release(s)
    assert pool.num_free_blocks == 8


def test_drop_blocks_errors_are_atomic():
    pool = BlockPool(8, BS, 1)
    s = pool.new_sequence()
    grow(pool, s, list(range(2 * BS + 3)))
    pool.drop_blocks(s, [1])
    before = snapshot(pool)
    for bad, msg in [([2], "partial last block"), ([0, 5], "cannot drop logical block 5"),
                     ([0, 1], "already dropped"), ([0, 0], "duplicate")]:
        with pytest.raises(PoolStateError, match=msg):
            pool.drop_blocks(s, bad)
        assert snapshot(pool) == before


# ---------------------------------------------------------------- invariants catch corruption


def test_check_invariants_detects_corruption():
    pool = BlockPool(4, BS, 1)
    s = pool.new_sequence()
    grow(pool, s, [1] * 20)
    pool._refcount[pool.block_table(s)[0]] += 1
    with pytest.raises(PoolStateError, match="refcount 2 but 1 table references"):
        pool.check_invariants()


# ---------------------------------------------------------------- stateful property test


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([16, 32]),
                max_seqs=st.integers(1, 5))
    def setup(self, num_blocks, block_size, max_seqs):
        self.pool = BlockPool(num_blocks, block_size, max_seqs)
        self.model: dict[int, list[int]] = {}  # expected committed tokens per sequence
        self.prompts: list[list[int]] = []  # token lists seen, to drive prefix hits
        self.kv: dict[int, int] = {}  # slot -> token: what the runtime's tensors would hold

    def live(self):
        return sorted(self.model)

    @precondition(lambda self: len(self.model) < self.pool.max_seqs)
    @rule()
    def new_sequence(self):
        self.model[self.pool.new_sequence()] = []

    @precondition(lambda self: len(self.model) == self.pool.max_seqs)
    @rule()
    def new_sequence_when_full(self):
        with pytest.raises(PoolStateError):
            self.pool.new_sequence()

    def grow(self, seq, tokens):
        n = len(tokens)
        before = snapshot(self.pool)
        try:
            copies = self.pool.reserve(seq, n)
        except PoolExhausted as e:
            assert e.requested_blocks > e.free_blocks
            assert snapshot(self.pool) == before
            event("reserve: PoolExhausted")
            return
        if copies:
            event("reserve: copy-on-write")
        bs = self.pool.block_size
        for src, dst in copies:  # apply them as the runtime would
            assert src != dst and dst in self.pool.block_table(seq)
            for off in range(bs):
                if src * bs + off in self.kv:
                    self.kv[dst * bs + off] = self.kv[src * bs + off]
        slots = self.pool.slots(seq, self.pool.length(seq), n)
        assert len(set(slots)) == n
        self.kv.update(zip(slots, tokens))
        self.pool.commit(seq, tokens)
        self.model[seq] += tokens
        self.prompts.append(list(self.model[seq]))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 40), vocab=st.integers(1, 3))
    def reserve_commit(self, data, n, vocab):
        seq = data.draw(st.sampled_from(self.live()))
        self.grow(seq, data.draw(st.lists(st.integers(0, vocab), min_size=n, max_size=n)))

    @precondition(lambda self: self.model and len(self.model) < self.pool.max_seqs)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        new = self.pool.fork(seq)
        assert new not in self.model
        self.model[new] = list(self.model[seq])
        if data.draw(st.booleans()):  # append to one side right away: exercises copy-on-write
            self.grow(data.draw(st.sampled_from([seq, new])), data.draw(st.lists(st.integers(0, 3), max_size=20)))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        self.pool.release(seq)
        del self.model[seq]
        before = snapshot(self.pool)
        with pytest.raises(PoolStateError):
            self.pool.release(seq)
        assert snapshot(self.pool) == before

    @precondition(lambda self: len(self.model) < self.pool.max_seqs)
    @rule(data=st.data(), extra=st.integers(0, 20))
    def new_sequence_with_prefix(self, data, extra):
        base = data.draw(st.sampled_from(self.prompts)) if self.prompts else []
        prompt = base + [0] * extra
        used = self.pool.num_used_blocks
        seq, n = self.pool.new_sequence_with_prefix(prompt)
        bs = self.pool.block_size
        assert n % bs == 0 and (n < len(prompt) or n == 0)
        assert self.pool.length(seq) == n and self.pool.tokens(seq) == prompt[:n]
        assert self.pool.num_used_blocks <= used + n // bs
        self.model[seq] = prompt[:n]
        event("prefix hit" if n else "prefix miss")

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def drop_blocks(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        table = self.pool.block_table(seq)
        droppable = [i for i in range(self.pool.length(seq) // self.pool.block_size) if table[i] != HOLE]
        if not droppable:
            return
        idx = data.draw(st.lists(st.sampled_from(droppable), min_size=1, unique=True))
        self.pool.drop_blocks(seq, idx)
        assert all(self.pool.block_table(seq)[i] == HOLE for i in idx)
        event("drop_blocks")

    @rule(go=st.integers(0, 9))
    def clear(self, go):
        if go == 0:  # rarely, so sequences get a chance to grow
            self.pool.clear()
            self.model.clear()
            event("clear")

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        assert self.pool.live_sequences() == self.live()
        for seq, toks in self.model.items():
            assert self.pool.tokens(seq) == toks and self.pool.length(seq) == len(toks)
            # the cache content the block table points at is this sequence's tokens (holes aside)
            bs, table = self.pool.block_size, self.pool.block_table(seq)
            for pos, tok in enumerate(toks):
                if table[pos // bs] != HOLE:
                    assert self.kv.get(table[pos // bs] * bs + pos % bs) == tok, (seq, pos)
        s = self.pool.stats()
        assert s["used_blocks"] + s["free_blocks"] == s["total_blocks"]
        assert 0.0 <= s["utilization"] <= 1.0


PoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolMachine = PoolMachine.TestCase
