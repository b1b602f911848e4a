"""The runtime engine on the torch backend: greedy parity, conversations, pool policies."""

import pytest

from runtime_sim.backends import TorchBackend
from runtime_sim.engine import Engine
from toolkit.compiler import compile
from toolkit.errors import PagedKVError, PoolExhausted
from toolkit.tiny_models import tiny_model
from tests.helpers import hf_greedy

PROMPT = list(range(3, 40))



def engine(num_blocks=16, max_seqs=3, spec="fp32", **kw):
    paged = compile(tiny_model("llama"), spec, num_blocks=num_blocks, max_seqs=max_seqs)
    return Engine(TorchBackend(paged), prefill_chunk=16, **kw)


def test_greedy_equals_hf_and_clear_returns_blocks():
    e = engine()
    c = e.new_conversation()
    assert list(e.generate(c, PROMPT, 20)) == hf_greedy(tiny_model("llama"), PROMPT, 20)
    assert e.stats()["used_blocks"] == 4
    e.clear(c)
    assert e.stats()["used_blocks"] == 0 and e.pool.num_free_blocks == 16
    e.pool.check_invariants()


def test_multi_turn_continues_the_same_sequence():
    e = engine()
    c = e.new_conversation()
    first = list(e.generate(c, PROMPT[:20], 5))
    second = list(e.generate(c, PROMPT[20:], 5))
    ref = tiny_model("llama")
    # the whole history as one prompt gives the same continuation
    assert second == hf_greedy(ref, PROMPT[:20] + first + PROMPT[20:], 5)


def test_fork_shares_blocks_and_copies_on_write():
    e = engine()
    c = e.new_conversation()
    list(e.generate(c, PROMPT, 3))  # 39 tokens cached + 1 pending: last block partial
    f = e.fork(c)
    used = e.stats()["used_blocks"]
    a = list(e.generate(f, [7, 8], 6))
    assert e.stats()["used_blocks"] == used + 1  # the partial block was copied, full ones shared
    b = list(e.generate(c, [7, 8], 6))
    assert a == b
    e.pool.check_invariants()


def test_error_policy_leaves_everything_intact_and_chat_usable_after_clear():
    e = engine(num_blocks=4)
    c = e.new_conversation()
    list(e.generate(c, PROMPT, 10))
    before = (e.pool.block_table(e.conversations[c].seq), e.pool.length(e.conversations[c].seq), e.stats())
    with pytest.raises(PoolExhausted, match=r"41 new token\(s\): needs 3 block\(s\), only 1 free"):
        list(e.generate(c, list(range(40)), 5))
    after = (e.pool.block_table(e.conversations[c].seq), e.pool.length(e.conversations[c].seq), e.stats())
    assert before == after
    e.pool.check_invariants()
    e.clear(c)
    assert list(e.generate(c, PROMPT, 3)) == hf_greedy(tiny_model("llama"), PROMPT, 3)


def test_evict_policy_frees_lru_conversation_and_reprefills_it():
    e = engine(num_blocks=5, max_seqs=2, policy="evict")
    a, b = e.new_conversation(), e.new_conversation()
    out_a = list(e.generate(a, PROMPT, 4))  # 3 blocks
    out_b = list(e.generate(b, PROMPT[:30], 20))  # needs 4 blocks: a is evicted
    assert e.conversations[a].evictions == 1 and e.pool.length(e.conversations[a].seq) == 0
    e.pool.check_invariants()
    e.clear(b)
    more_a = list(e.generate(a, [5, 6], 4))  # re-prefills a's history first
    ref = tiny_model("llama")
    assert out_b == hf_greedy(ref, PROMPT[:30], 20)
    assert more_a == hf_greedy(ref, PROMPT + out_a + [5, 6], 4)


def test_sliding_policy_runs_past_the_pool_with_fixed_memory():
    e = engine(num_blocks=4, max_seqs=1, policy="sliding", spec="default")
    c = e.new_conversation()
    out = list(e.generate(c, PROMPT, 120))  # 157 tokens through a 64-token pool
    seq = e.conversations[c].seq
    assert len(out) == 120 and e.pool.length(seq) == len(PROMPT) + 119
    table = e.pool.block_table(seq)
    assert table[0] >= 0, "the sink block is kept"
    assert sum(b >= 0 for b in table) <= 4 and table.count(-1) >= 5
    e.pool.check_invariants()
    # before the first drop, sliding is exactly the unlimited pool
    ref = engine(num_blocks=16, max_seqs=1, spec="default")
    rc = ref.new_conversation()
    assert list(ref.generate(rc, PROMPT, 20))[:20] == out[:20]


def test_bad_policy_and_unknown_conversation():
    with pytest.raises(PagedKVError, match="unknown pool policy 'lru'"):
        engine(policy="lru")
    e = engine()
    with pytest.raises(PagedKVError, match="unknown conversation 7"):
        e.clear(7)
