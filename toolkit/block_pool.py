"""Metadata-only block manager for the paged KV cache (pure Python, no torch).

The pool hands out fixed-size blocks of KV slots to sequences. It never touches tensors: the runtime
owns them and applies what the pool tells it (which slots to write, which blocks to copy).

Model of one sequence:

    blocks   [b0, b1, -1, b3, b4]     logical block i holds positions i*block_size .. (i+1)*block_size-1
                                       (-1 = a hole left by drop_blocks; positions do not move)
    length   committed tokens (K/V written and confirmed by commit)
    reserved capacity the runtime may write up to (length <= reserved <= len(blocks)*block_size)

Lifecycle of a step: ``copies = reserve(seq, n)`` -> apply the (src, dst) block copies ->
write K/V at ``slots(seq, length, n)`` -> ``commit(seq, token_ids)``.

Sharing:
* ``fork`` shares every block (refcount + 1). A shared block that is about to be written (the
  partially filled last block) is copied-on-write by the next ``reserve``.
* Every block that becomes full gets a content hash chained with the previous block's hash and is
  registered in a prefix cache. ``new_sequence_with_prefix`` reuses those blocks, even after their
  owner released them, until they are handed out again for other content.

Freed blocks go to the back of the free list and allocation takes from the front, so the blocks
released longest ago are recycled first (an LRU for the prefix cache). Sequences release their
blocks last-to-first, so a chain's tail is recycled before its root.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field

from toolkit.errors import PagedKVError, PoolExhausted, PoolStateError, SpecError
from toolkit.pool_layout import check_block_size

HOLE = -1  # block-table entry for a block dropped by drop_blocks
_ROOT_HASH = 0  # "previous hash" of a sequence's first block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _chain_hash(prev_hash: int, tokens: tuple[int, ...]) -> int:
    # In-process only (Python's hash); lookups also compare the stored content, so a collision can
    # never hand out a block with the wrong tokens.
    return hash((prev_hash, tokens))


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)  # block ids, HOLE for dropped blocks
    length: int = 0  # committed tokens
    reserved: int = 0  # tokens the runtime may write up to
    tokens: list[int] = field(default_factory=list)  # committed token ids
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block


class BlockPool:
    """Block tables, refcounts, free list, sequence slots and the prefix cache of a KV pool."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, num_compact_blocks: int = 0):
        check_block_size(block_size)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise SpecError(f"num_blocks {num_blocks!r} is invalid: the pool needs at least 1 block")
        if not isinstance(max_seqs, int) or max_seqs < 1:
            raise SpecError(f"max_seqs {max_seqs!r} is invalid: allow at least 1 sequence")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_seqs = max_seqs
        # the compact tier (issue 25): ids num_blocks .. num_blocks + num_compact_blocks - 1 name blocks of
        # the pool's compact region. They are never allocated for growth; compact() moves a full block there.
        self.num_compact_blocks = num_compact_blocks
        self._compact_free: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(num_blocks, num_blocks + num_compact_blocks))
        self._refcount = [0] * (num_blocks + num_compact_blocks)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # ordered set
        # prefix cache: chained hash -> block id, plus what each registered block holds
        self._cache: dict[int, int] = {}
        self._block_key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # (prev_hash, tokens)
        self._block_hash: list[int | None] = [None] * num_blocks
        self._seqs: dict[int, _Seq] = {}
        self._free_slots = list(range(max_seqs - 1, -1, -1))  # stack: pops 0 first

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def live_sequences(self) -> list[int]:
        return sorted(self._seqs)

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def block_table(self, seq: int) -> list[int]:
        return list(self._get(seq).blocks)

    def tokens(self, seq: int) -> list[int]:
        return list(self._get(seq).tokens)

    def slots(self, seq: int, start: int, n: int) -> list[int]:
        """Slot ids (block_id * block_size + offset) of positions start .. start+n-1."""
        s = self._get(seq)
        if start < 0 or n < 0 or start + n > s.reserved:
            raise PoolStateError(
                f"positions {start}..{start + n - 1} of sequence {seq} are outside its reserved capacity "
                f"of {s.reserved} token(s): call reserve(seq, n) first"
            )
        bs = self.block_size
        out = []
        for pos in range(start, start + n):
            block = s.blocks[pos // bs]
            if block == HOLE:
                raise PoolStateError(
                    f"position {pos} of sequence {seq} lies in dropped block {pos // bs}: "
                    "only positions still in the block table have slots"
                )
            if pos >= s.length and self._refcount[block] > 1:
                raise PoolStateError(
                    f"position {pos} of sequence {seq} is in block {block}, which is shared with another "
                    "sequence (forked after reserve): call reserve(seq, n) again so it is copied first"
                )
            out.append(block * bs + pos % bs)
        return out

    # ------------------------------------------------------------------ sequences

    def new_sequence(self) -> int:
        """Take a free sequence slot; the sequence starts empty."""
        if not self._free_slots:
            raise PoolStateError(
                f"all {self.max_seqs} sequence slots in use; clear a conversation or raise max_seqs"
            )
        seq = self._free_slots.pop()
        self._seqs[seq] = _Seq()
        return seq

    def new_sequence_with_prefix(self, token_ids: list[int]) -> tuple[int, int]:
        """New sequence sharing the cached full blocks that start token_ids.

        Returns (seq, n_cached_tokens). n_cached_tokens is a multiple of block_size and always less
        than len(token_ids), so the runtime prefills at least one token and gets logits.
        """
        token_ids = list(token_ids)
        found = self.cached_prefix_blocks(token_ids)
        n = found.index(None) if None in found else len(found)  # the cached run from the start
        seq = self.new_sequence_from_blocks(token_ids[: n * self.block_size], found[:n])
        return seq, n * self.block_size

    def cached_prefix_blocks(self, token_ids: list[int]) -> list[int | None]:
        """For each full block of token_ids (but never the last token's): the cached block holding it,
        or None. The hash chain runs over the tokens, so a block can be found after a missing one."""
        bs = self.block_size
        out, prev = [], _ROOT_HASH
        for i in range(max(0, (len(token_ids) - 1) // bs)):
            key = (prev, tuple(token_ids[i * bs:(i + 1) * bs]))
            h = _chain_hash(*key)
            block = self._cache.get(h)
            out.append(block if block is not None and self._block_key[block] == key else None)
            prev = h
        return out

    def new_sequence_from_blocks(self, token_ids: list[int], blocks: list[int | None]) -> int:
        """New sequence of len(blocks) full blocks holding token_ids, sharing the given cached blocks
        (None = a hole: a block a sliding group no longer needs). Returns its slot."""
        bs = self.block_size
        token_ids = list(token_ids)
        if len(token_ids) != len(blocks) * bs:
            raise PoolStateError(f"{len(token_ids)} tokens do not fill {len(blocks)} block(s) of {bs}")
        seq = self.new_sequence()
        s = self._seqs[seq]
        prev = _ROOT_HASH
        for i, block in enumerate(blocks):
            h = _chain_hash(prev, tuple(token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                s.blocks.append(HOLE)
            else:
                if self._refcount[block] == 0:
                    del self._free[block]  # revive a released block that still holds this content
                self._refcount[block] += 1
                s.blocks.append(block)
            s.hashes.append(h)
            prev = h
        s.length = s.reserved = len(blocks) * bs
        s.tokens = token_ids
        return seq

    def fork(self, seq: int) -> int:
        """New sequence sharing all blocks of seq (same length and tokens). Returns its slot.

        Only blocks that hold committed tokens are shared; seq keeps any reserved-but-unwritten
        blocks for itself. The runtime copies seq's per-sequence staging row.
        """
        src = self._get(seq)
        new = self.new_sequence()
        shared = src.blocks[:_cdiv(src.length, self.block_size)]
        for block in shared:
            if block != HOLE:
                self._refcount[block] += 1
        self._seqs[new] = _Seq(
            blocks=list(shared), length=src.length, reserved=src.length,
            tokens=list(src.tokens), hashes=list(src.hashes),
        )
        return new

    def release(self, seq: int) -> None:
        """Drop seq's block references (blocks reaching 0 are freed, hashes kept) and free its slot."""
        s = self._get(seq, action="release")
        for block in reversed(s.blocks):  # tail first: prefix roots stay cached longest
            if block != HOLE:
                self._decref(block)
        del self._seqs[seq]
        self._free_slots.append(seq)

    def clear(self) -> None:
        """Release every live sequence (the prefix cache survives until blocks are reused)."""
        for seq in self.live_sequences():
            self.release(seq)

    # ------------------------------------------------------------------ growth

    def reserve(self, seq: int, n_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for length + n_new_tokens tokens. Atomic: on PoolExhausted nothing changed.

        Returns (src_block, dst_block) copies the runtime must apply before writing: a shared block
        about to be written (after fork) is copied-on-write into a fresh block.
        """
        s = self._get(seq)
        cow, grow = self._growth(s, n_new_tokens)
        target = s.length + n_new_tokens
        if n_new_tokens == 0:
            return []
        needed = len(cow) + grow
        if needed > len(self._free):
            raise PoolExhausted(needed, len(self._free),
                                what=f"sequence {seq} growing from {s.length} to {target} tokens")
        copies = []
        for i in cow:
            src = s.blocks[i]
            dst = self._allocate()
            self._decref(src)  # stays >= 1: it was shared
            s.blocks[i] = dst
            copies.append((src, dst))
        for _ in range(grow):
            s.blocks.append(self._allocate())
        s.reserved = max(s.reserved, target)
        return copies

    def blocks_needed(self, seq: int, n_new_tokens: int) -> int:
        """Free blocks reserve(seq, n_new_tokens) would take (new blocks + copy-on-write copies)."""
        cow, grow = self._growth(self._get(seq), n_new_tokens)
        return len(cow) + grow

    def _growth(self, s: _Seq, n_new_tokens: int) -> tuple[list[int], int]:
        if not isinstance(n_new_tokens, int) or n_new_tokens < 0:
            raise PagedKVError(f"n_new_tokens {n_new_tokens!r} is invalid: pass a count >= 0")
        bs = self.block_size
        target = s.length + n_new_tokens
        if n_new_tokens == 0:
            return [], 0
        # blocks that the coming writes touch and that already exist but are shared
        cow = [i for i in range(s.length // bs, min(len(s.blocks), _cdiv(target, bs)))
               if self._refcount[s.blocks[i]] > 1]
        return cow, max(0, _cdiv(target, bs) - len(s.blocks))

    def commit(self, seq: int, token_ids: list[int]) -> None:
        """Advance seq by the tokens the runtime wrote; register every block that became full."""
        s = self._get(seq)
        token_ids = list(token_ids)
        new_length = s.length + len(token_ids)
        if new_length > s.reserved:
            raise PoolStateError(
                f"commit of {len(token_ids)} token(s) to sequence {seq} exceeds its reservation: length "
                f"{s.length}, reserved {s.reserved}. Call reserve(seq, {len(token_ids)}) before writing"
            )
        bs = self.block_size
        if not token_ids:
            return
        for i in range(s.length // bs, _cdiv(new_length, bs)):  # blocks the runtime wrote into
            if self._refcount[s.blocks[i]] > 1:
                raise PoolStateError(
                    f"commit to sequence {seq} writes into block {s.blocks[i]}, which is shared with "
                    "another sequence (forked after reserve): call reserve(seq, n) again before writing"
                )
        s.tokens.extend(token_ids)
        for i in range(s.length // bs, new_length // bs):  # blocks that are now full
            prev = s.hashes[i - 1] if i > 0 else _ROOT_HASH
            key = (prev, tuple(s.tokens[i * bs:(i + 1) * bs]))
            h = _chain_hash(*key)
            block = s.blocks[i]
            self._block_key[block] = key
            self._block_hash[block] = h
            self._cache[h] = block
            s.hashes.append(h)
        s.length = new_length

    def drop_blocks(self, seq: int, logical_indices: list[int]) -> None:
        """Punch holes at these logical block positions (for the sliding policy); positions stay put.

        Only full, committed, not-yet-dropped blocks can be dropped; the block being written never.
        Atomic: on error nothing changed.
        """
        s = self._get(seq)
        n_full = s.length // self.block_size
        indices = list(logical_indices)
        if len(set(indices)) != len(indices):
            raise PoolStateError(f"drop_blocks got duplicate indices {indices}: list each block once")
        for i in indices:
            if not isinstance(i, int) or not 0 <= i < n_full:
                raise PoolStateError(
                    f"cannot drop logical block {i!r} of sequence {seq}: only full committed blocks "
                    f"0..{n_full - 1} can be dropped (the partial last block is still being written)"
                )
            if s.blocks[i] == HOLE:
                raise PoolStateError(f"logical block {i} of sequence {seq} was already dropped")
        for i in indices:
            block, s.blocks[i] = s.blocks[i], HOLE
            self._decref(block)

    def compact(self, seq: int, index: int) -> tuple[int, int]:
        """Move logical block `index` of seq to a free compact block: the table names the compact id,
        the default block loses seq's reference (freed; its prefix-cache entry is kept, the records in it
        are intact until it is reused). Returns (default id, compact id); the runtime re-quantizes the
        records from the first into the second before the next call. Only a full committed block held by
        seq alone: a block shared with another sequence (fork, prefix cache) is left as it is. Atomic."""
        s = self._get(seq)
        if not isinstance(index, int) or not 0 <= index < s.length // self.block_size:
            raise PoolStateError(f"cannot compact logical block {index!r} of sequence {seq}: only full committed "
                                 f"blocks 0..{s.length // self.block_size - 1} can be")
        block = s.blocks[index]
        if block == HOLE or block >= self.num_blocks:
            raise PoolStateError(f"logical block {index} of sequence {seq} is "
                                 f"{'dropped' if block == HOLE else 'compact'} already")
        if self._refcount[block] > 1:
            raise PoolStateError(f"logical block {index} of sequence {seq} (block {block}) is shared with another "
                                 "sequence: shared blocks stay in the default region")
        if not self._compact_free:
            raise PoolExhausted(1, 0, what=f"compacting block {index} of sequence {seq} (compact region full)")
        dst, _ = self._compact_free.popitem(last=False)
        self._refcount[dst] = 1
        s.blocks[index] = dst
        self._decref(block)
        return block, dst

    def forget_cached(self, block: int) -> None:
        """Drop a free default block's prefix-cache entry: for a block committed but never written (a
        restore commits every logical block, then drops the file's holes and compacts its compact blocks
        without writing their default records), so no new sequence can share its stale records."""
        if not 0 <= block < self.num_blocks or self._refcount[block]:
            raise PoolStateError(f"forget_cached({block!r}): only a free block of the default region can be forgotten")
        h = self._block_hash[block]
        if h is not None and self._cache.get(h) == block:
            del self._cache[h]
        self._block_hash[block] = self._block_key[block] = None

    @property
    def num_free_compact_blocks(self) -> int:
        return len(self._compact_free)

    def refcount(self, block: int) -> int:
        """Sequences holding block (default or compact id)."""
        return self._refcount[block]

    # ------------------------------------------------------------------ accounting

    def stats(self) -> dict:
        bs = self.block_size
        filled: dict[int, int] = {}  # used block -> tokens it holds (a shared block counted once)
        for s in self._seqs.values():
            for i, block in enumerate(s.blocks):
                if block != HOLE:
                    n = min(bs, max(0, s.length - i * bs))
                    filled[block] = max(filled.get(block, 0), n)
        used = self.num_used_blocks
        capacity = used * bs
        stored = sum(filled.values())
        return {
            "total_blocks": self.num_blocks,
            "used_blocks": used,
            "free_blocks": self.num_free_blocks,
            "utilization": stored / capacity if capacity else 0.0,
            "internal_fragmentation": (capacity - stored) / capacity if capacity else 0.0,
            "sequences": len(self._seqs),
            "shared_blocks": sum(1 for r in self._refcount if r > 1),
        }

    def check_invariants(self) -> None:
        """Raise PoolStateError naming the first broken invariant; return None if all hold."""
        def fail(msg: str) -> None:
            raise PoolStateError(f"block pool invariant broken: {msg}")

        total = self.num_blocks + self.num_compact_blocks
        refs = [0] * total
        bs = self.block_size
        for seq, s in self._seqs.items():
            if not 0 <= s.length <= s.reserved:
                fail(f"sequence {seq} has length {s.length} and reserved {s.reserved}")
            if len(s.blocks) != _cdiv(s.reserved, bs):
                fail(f"sequence {seq} reserves {s.reserved} tokens but has {len(s.blocks)} blocks")
            if len(s.tokens) != s.length or len(s.hashes) != s.length // bs:
                fail(f"sequence {seq}: {len(s.tokens)} tokens / {len(s.hashes)} hashes for length {s.length}")
            for i, block in enumerate(s.blocks):
                if block == HOLE:
                    if i >= s.length // bs:
                        fail(f"sequence {seq} has a hole at logical block {i}, which is not full")
                elif not 0 <= block < total:
                    fail(f"sequence {seq} references block {block} outside 0..{total - 1}")
                else:
                    refs[block] += 1
        for block in range(self.num_blocks):
            if refs[block] != self._refcount[block]:
                fail(f"block {block} has refcount {self._refcount[block]} but {refs[block]} table references")
            if (self._refcount[block] == 0) != (block in self._free):
                fail(f"block {block} has refcount {self._refcount[block]}, free-list membership "
                     f"{block in self._free}")
        if any(not 0 <= b < self.num_blocks for b in self._free):
            fail("free list holds an id outside the pool")
        for block in range(self.num_blocks, total):  # the compact region
            if refs[block] != self._refcount[block]:
                fail(f"compact block {block} has refcount {self._refcount[block]} but {refs[block]} table references")
            if (self._refcount[block] == 0) != (block in self._compact_free):
                fail(f"compact block {block} has refcount {self._refcount[block]}, free-list membership "
                     f"{block in self._compact_free}")
        used = sum(1 for r in self._refcount[:self.num_blocks] if r > 0)
        if used + len(self._free) != self.num_blocks:
            fail(f"{used} used + {len(self._free)} free != {self.num_blocks} total blocks")
        for h, block in self._cache.items():
            if self._block_hash[block] != h:
                fail(f"prefix cache maps hash {h} to block {block}, which holds other content")
        slots = set(self._free_slots)
        if len(slots) != len(self._free_slots) or slots & set(self._seqs) \
                or slots | set(self._seqs) != set(range(self.max_seqs)):
            fail(f"sequence slots inconsistent: free {sorted(slots)}, live {sorted(self._seqs)}")

    # ------------------------------------------------------------------ internals

    def _get(self, seq: int, action: str = "use") -> _Seq:
        s = self._seqs.get(seq)
        if s is not None:
            return s
        if isinstance(seq, int) and 0 <= seq < self.max_seqs:
            hint = "double free: it was already released" if action == "release" else \
                "it was released or never created"
            raise PoolStateError(f"cannot {action} sequence {seq}: {hint}. Create one with new_sequence()")
        raise PoolStateError(f"unknown sequence {seq!r}: valid ids are 0..{self.max_seqs - 1}")

    def _allocate(self) -> int:
        block, _ = self._free.popitem(last=False)  # released longest ago
        h = self._block_hash[block]
        if h is not None:  # reused for other content: forget what it held
            if self._cache.get(h) == block:
                del self._cache[h]
            self._block_hash[block] = None
            self._block_key[block] = None
        self._refcount[block] = 1
        return block

    def _decref(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if block >= self.num_blocks:
                self._compact_free[block] = None
            else:
                self._free[block] = None


# ----------------------------------------------------------------------------------------------
# Layer groups: one pool and one block table per sequence for each attention type


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share an attention type: window 0 = global, W > 0 = each query sees the last W
    positions (itself included; HF's sliding_window). Each group has its own blocks and tables."""

    window: int
    layers: tuple[int, ...]
    num_blocks: int
    # the group's own KV spec (toolkit.kv_spec.check_group_spec: it changes only the record's bits,
    # groups and symmetry); None: the pool's spec. The first (global) group always has the pool's.
    spec: object = None

    def to_dict(self) -> dict:
        d = {"window": self.window, "layers": list(self.layers), "num_blocks": self.num_blocks}
        if self.spec is not None:  # written only when set: a manifest without group specs is as before
            d["spec"] = dataclasses.asdict(self.spec)
        return d

    @staticmethod
    def from_dict(d: dict) -> "LayerGroup":
        from toolkit.kv_spec import spec_from_dict

        spec = spec_from_dict(d["spec"], None, "a layer group's spec") if d.get("spec") is not None else None
        return LayerGroup(int(d["window"]), tuple(int(i) for i in d["layers"]), int(d["num_blocks"]), spec)


def has_group_specs(groups: list[LayerGroup] | None) -> bool:
    """Whether any layer group has its own KV spec (manifest format 2)."""
    return any(g.spec is not None for g in groups or [])


def layer_layouts(layout, groups: list[LayerGroup] | None) -> list:
    """Per layer, its pool's layout (toolkit.pool_layout.PoolLayout) with its group's block count and spec
    (group_layout); groups=None: every layer has `layout`."""
    if not groups:
        return [layout] * layout.num_layers
    out = [layout] * layout.num_layers
    for g in groups:
        lay = group_layout(layout, g)
        for i in g.layers:
            out[i] = lay
    return out


def group_layout(layout, g: LayerGroup):
    """The layout of one layer group's pools: the pool's, with the group's block count and spec; a
    sliding group (window > 0) has no compact region (the compact tier holds the global layers' aged blocks)."""
    changes = {}
    if g.num_blocks != layout.num_blocks:
        changes["num_blocks"] = g.num_blocks
    if g.spec is not None and g.spec != layout.spec:
        changes["spec"] = g.spec
    if g.window and layout.num_compact_blocks:
        changes.update(compact=None, num_compact_blocks=0)
    return dataclasses.replace(layout, **changes) if changes else layout


def grouped_pool_bytes(layout, groups: list[LayerGroup] | None) -> int:
    """Bytes of every layer's pool tensors, each layer with its group's block count (layer_layouts); the
    compact region, if any, belongs to the first group's (global) layers. groups=None: layout.total_bytes."""
    if not groups:
        return layout.total_bytes
    return sum(sum(lay.layer_tensor_bytes().values()) for lay in layer_layouts(layout, groups))


def window_blocks_needed(window: int, block_size: int, new_tokens: int) -> int:
    """Blocks one sequence of a sliding group holds at most while a call writes new_tokens: the
    blocks that intersect the window before the first new token, plus those the new tokens fill."""
    return _cdiv(window - 1 + new_tokens, block_size) + 1


def dead_blocks(window: int, block_size: int, length: int) -> int:
    """Leading logical blocks no future query of a sliding group can see once `length` tokens are
    committed: the next query (position >= length) sees keys > length - window only."""
    if window <= 0:
        return 0
    return max(0, (length - window + 1) // block_size)


class GroupedBlockPool:
    """One BlockPool per layer group, driven together: the same sequence slots, lengths and tokens in
    every group; each group has its own blocks, free list, refcounts and prefix cache. A sliding group
    returns a sequence's blocks to its pool as soon as they leave the window (after each commit).

    With one global group this is exactly a BlockPool (same block ids, same tables).
    """

    def __init__(self, groups: list[LayerGroup], block_size: int, max_seqs: int, num_compact_blocks: int = 0):
        """num_compact_blocks: the compact region of the global group (the first, window 0), if any."""
        if not groups:
            raise SpecError("a pool needs at least one layer group")
        if num_compact_blocks and groups[0].window:
            raise SpecError("a compact region belongs to the global layer group: this model has none")
        self.groups = list(groups)
        self.pools = [BlockPool(g.num_blocks, block_size, max_seqs, num_compact_blocks if i == 0 else 0)
                      for i, g in enumerate(self.groups)]
        self.block_size = block_size
        self.max_seqs = max_seqs

    # ------------------------------------------------------------------ queries (all groups agree)

    @property
    def main(self) -> BlockPool:
        return self.pools[0]

    def live_sequences(self) -> list[int]:
        return self.main.live_sequences()

    def length(self, seq: int) -> int:
        return self.main.length(seq)

    def tokens(self, seq: int) -> list[int]:
        return self.main.tokens(seq)

    def block_table(self, seq: int, group: int = 0) -> list[int]:
        return self.pools[group].block_table(seq)

    def free_blocks(self) -> list[int]:
        return [p.num_free_blocks for p in self.pools]

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the first group (the only one for a model without sliding layers)."""
        return self.main.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.main.num_used_blocks

    def slots(self, seq: int, start: int, n: int, group: int = 0) -> list[int]:
        return self.pools[group].slots(seq, start, n)

    # ------------------------------------------------------------------ sequences

    def _same(self, results: list):
        if any(r != results[0] for r in results[1:]):
            raise PoolStateError(f"layer groups out of step: {results}")
        return results[0]

    def new_sequence(self) -> int:
        return self._same([p.new_sequence() for p in self.pools])

    def fork(self, seq: int) -> int:
        return self._same([p.fork(seq) for p in self.pools])

    def release(self, seq: int) -> None:
        for p in self.pools:
            p.release(seq)

    def clear(self) -> None:
        for p in self.pools:
            p.clear()

    def new_sequence_with_prefix(self, token_ids: list[int]) -> tuple[int, int]:
        """Like BlockPool.new_sequence_with_prefix, for every group: the longest prefix (whole blocks,
        less than len(token_ids)) whose blocks are still cached in each group — all of them in a global
        group, only those that intersect the window before the next position in a sliding group."""
        token_ids = list(token_ids)
        bs = self.block_size
        found = [p.cached_prefix_blocks(token_ids) for p in self.pools]
        best = 0
        for k in range(max(0, (len(token_ids) - 1) // bs), 0, -1):
            if all(all(f[i] is not None for i in range(dead_blocks(g.window, bs, k * bs), k))
                   for g, f in zip(self.groups, found)):
                best = k
                break
        seqs = []
        for g, p, f in zip(self.groups, self.pools, found):
            lo = dead_blocks(g.window, bs, best * bs)
            seqs.append(p.new_sequence_from_blocks(
                token_ids[:best * bs], [None] * lo + [f[i] for i in range(lo, best)]))
        return self._same(seqs), best * bs

    # ------------------------------------------------------------------ growth

    def blocks_needed(self, seq: int, n_new_tokens: int, chunk: int | None = None) -> list[int]:
        """Free blocks reserve(seq, n) would take in each group. With chunk: the most free blocks writing
        the n tokens in calls of at most chunk tokens takes (a sliding group trims between calls, so
        it never holds more than window_blocks_needed(window, block_size, chunk) blocks)."""
        out = []
        for g, p in zip(self.groups, self.pools):
            need = p.blocks_needed(seq, n_new_tokens)
            if g.window > 0 and chunk is not None:
                held = sum(1 for b in p.block_table(seq) if b != HOLE)
                peak = window_blocks_needed(g.window, self.block_size, min(chunk, n_new_tokens))
                need = min(need, max(0, peak - held))
            out.append(need)
        return out

    def reserve(self, seq: int, n_new_tokens: int) -> list[tuple[int, int, int]]:
        """reserve in every group; atomic. Returns (group, src, dst) copy-on-write copies."""
        need = self.blocks_needed(seq, n_new_tokens)
        for g, (n, p) in enumerate(zip(need, self.pools)):
            if n > p.num_free_blocks:
                raise PoolExhausted(n, p.num_free_blocks, what=f"sequence {seq} growing by {n_new_tokens} "
                                    f"token(s) in layer group {g} (window {self.groups[g].window or 'global'})")
        return [(g, src, dst) for g, p in enumerate(self.pools) for src, dst in p.reserve(seq, n_new_tokens)]

    def commit(self, seq: int, token_ids: list[int]) -> None:
        """Commit in every group, then return the blocks that left each sliding group's window."""
        for p in self.pools:
            p.commit(seq, token_ids)
        self.trim(seq)

    def trim(self, seq: int) -> None:
        bs = self.block_size
        for g, p in zip(self.groups, self.pools):
            if g.window > 0:
                table = p.block_table(seq)
                dead = [i for i in range(dead_blocks(g.window, bs, p.length(seq))) if table[i] != HOLE]
                if dead:
                    p.drop_blocks(seq, dead)

    def drop_blocks(self, seq: int, logical_indices: list[int]) -> None:
        """Holes at these logical blocks in every group that still holds them (the sliding policy)."""
        for p in self.pools:
            table = p.block_table(seq)
            keep = [i for i in logical_indices if i < len(table) and table[i] != HOLE]
            if keep:
                p.drop_blocks(seq, keep)

    # ------------------------------------------------------------------ accounting

    def stats(self) -> dict:
        """The first group's stats (a model without sliding layers: the whole pool), plus per group."""
        out = self.main.stats()
        if len(self.pools) > 1 or self.groups[0].window:
            out["groups"] = [dict(p.stats(), window=g.window, layers=len(g.layers))
                             for g, p in zip(self.groups, self.pools)]
        return out

    def check_invariants(self) -> None:
        for p in self.pools:
            p.check_invariants()
        for g, p in zip(self.groups, self.pools):
            for seq in p.live_sequences():
                if p.length(seq) != self.length(seq):
                    raise PoolStateError(f"block pool invariant broken: sequence {seq} differs between groups")
                if g.window > 0:
                    table = p.block_table(seq)
                    live = [i for i in range(dead_blocks(g.window, self.block_size, p.length(seq)))
                            if table[i] != HOLE]
                    if live:
                        raise PoolStateError(f"block pool invariant broken: sequence {seq} keeps blocks {live} "
                                             f"outside the window of {g.window} in a sliding group")
