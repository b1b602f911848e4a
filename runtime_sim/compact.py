"""The compact tier in the engine (issue 25): a conversation's aged blocks re-quantized in place.

    moved = compact_aged(engine, cid, horizon=1024)            # every aged block (while the region has room)
    moved = compact_aged(engine, cid, horizon=1024, limit=3)   # the 3 oldest only (the ladder: what a turn needs)

Blocks of the global layer group that lie wholly before the last `horizon` tokens are moved, oldest
first, into free blocks of the pool's compact region (compile(..., compact_blocks=N)): the records are
re-quantized from the conversation's spec to the compact spec (toolkit.quant.compact_block, every layer
of the group), the block table names the compact id (num_blocks + index) and the default block is
freed. Never moved: the sink block(s) (block 0 at least), the block holding the last token (the fp16
tail) and any block another conversation also holds (a fork or a cached prefix: it stays in the
default region for both). It runs between steps; sliding groups are left as they are.
"""

from __future__ import annotations

from toolkit.block_pool import HOLE
from toolkit.errors import PagedKVError


def aged_blocks(pool, seq: int, horizon: int, first: int = 1) -> list[int]:
    """Logical blocks of seq that may move to the compact region, oldest first: from `first` (past the
    sink blocks) to the last block ending at least `horizon` tokens back, each a default block held by
    seq alone (not dropped, not compact already, not shared)."""
    table = pool.block_table(seq)
    last = (pool.length(seq) - horizon) // pool.block_size  # blocks i < last end at least horizon tokens back
    return [i for i in range(first, last)
            if table[i] != HOLE and table[i] < pool.num_blocks and pool.refcount(table[i]) == 1]


def compact_aged(engine, cid: int, horizon: int, limit: int | None = None) -> list[tuple[int, int, int]]:
    """Move conversation cid's aged blocks, oldest first, to the compact region while it has free blocks:
    all of them, or at most `limit` (the adaptive policy's compact rung asks for the blocks its turn is
    short of, so no block loses bits before it must). Returns (logical block, default id, compact id) of
    each block moved (ids as in the block table)."""
    if not isinstance(horizon, int) or horizon < 1:
        raise PagedKVError(f"horizon {horizon!r} is invalid: give the number of recent tokens kept in the "
                           "default region (>= 1).")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise PagedKVError(f"limit {limit!r} is invalid: give the most blocks to move (>= 1), or None for all.")
    lay = engine.backend.layout
    pool = engine.pool.main
    if not pool.num_compact_blocks or engine.groups[0].window:
        raise PagedKVError("this model has no compact region: compile it with compact_blocks=N to use the "
                           "compact tier.")
    if not hasattr(engine.backend, "compact_block"):
        raise PagedKVError(f"the {getattr(engine.backend, 'name', '?')} backend cannot re-quantize blocks yet: "
                           "open the model through runtime_sim.session (its torch, onnxruntime and ExecuTorch "
                           "backends can).")
    conv = engine.conversation(cid)
    if conv.spill is not None:
        raise PagedKVError(f"conversation {cid} lies in a spill file: restore it (its next turn) before compacting.")
    n = pool.num_blocks
    moved = []
    for i in aged_blocks(pool, conv.seq, horizon, first=max(1, lay.spec.sink_blocks)):
        if not pool.num_free_compact_blocks or (limit is not None and len(moved) >= limit):
            break
        src, dst = pool.compact(conv.seq, i)
        engine.backend.compact_block(src, dst - n)
        moved.append((i, src, dst))
    return moved
