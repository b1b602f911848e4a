"""The desktop engine: owns the block pool, runs prefill/decode on a backend, samples tokens.

    engine = Engine(TorchBackend(paged_model), tokenizer)
    conv = engine.new_conversation()
    for token_id in engine.generate(conv, prompt_ids, max_new_tokens=32): ...
    engine.clear(conv)            # its blocks go back to the pool at once

A backend runs the compiled graph on (ids, positions, seq_ids, block_tables) and keeps the pool
tensors; the engine keeps the metadata (toolkit.block_pool.BlockPool): which blocks each
conversation owns, reference counts, copy-on-write.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from runtime_sim import conversation_file, conversation_state
from toolkit.block_pool import GroupedBlockPool, LayerGroup, group_layout, grouped_pool_bytes
from toolkit.errors import PagedKVError, PoolExhausted
from toolkit.pool_layout import PoolLayout

log = logging.getLogger("pagedkv.engine")


class Backend(Protocol):
    layout: PoolLayout

    def forward(self, ids: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, tables: np.ndarray,
                rows: np.ndarray | None = None) -> np.ndarray:
        """Run one step; returns the logits of the tokens `rows` indexes ([len(rows), V] float32; None:
        all T) and updates the pool in place."""

    def copy_block(self, src: int, dst: int) -> None: ...

    def copy_stage(self, src_seq: int, dst_seq: int) -> None: ...


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    if s.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    if 0 < s.top_k < len(z):  # top_k >= the vocabulary keeps every token
        kth = np.partition(z, -s.top_k)[-s.top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < s.top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(len(p), p=p))


SPILLED = -1  # Conversation.seq of a conversation spilled to flash: it holds no slot and no block


@dataclass
class Conversation:
    seq: int  # pool sequence slot (SPILLED while its cache lies in a spill file)
    history: list[int] = field(default_factory=list)  # tokens in the cache (positions 0..len-1)
    pending: list[int] = field(default_factory=list)  # not in the cache yet: fed first on the next turn
    last_used: int = 0  # engine clock of the last step that touched this conversation
    evictions: int = 0
    spill: Path | None = None  # the adaptive policy's file holding its cache (seq is SPILLED meanwhile)


@dataclass
class Counters:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    # the pool policies' rungs, each counted when taken (stats()["ladder"])
    evictions: int = 0  # evict: a conversation lost its blocks (re-prefilled on its next turn)
    slides: int = 0  # sliding / adaptive: one old block of the active conversation dropped (its K/V lost)
    spills: int = 0  # adaptive: an idle conversation written to its spill file, its blocks freed
    spill_bytes: int = 0  # bytes written by those spills
    spill_failures: int = 0  # adaptive: a spill file could not be written (the next rung was taken)
    restores_from_spill: int = 0  # adaptive: a spilled conversation mapped back without prefill
    spill_reprefills: int = 0  # adaptive: a spill file was unreadable (or its compact blocks found no room); prefilled again
    compactions: int = 0  # adaptive: one conversation's aged blocks re-quantized into the compact region
    compacted_blocks: int = 0  # blocks those compactions moved (each freed one default block)


POLICIES = ("error", "evict", "sliding", "adaptive")


class Engine:
    """policy decides what happens when the pool is full:
    - "error": PoolExhausted, nothing changed; the conversation stays usable after a clear.
    - "evict": the least-recently-used other conversation loses its blocks (its tokens are kept and
      re-prefilled on its next turn).
    - "sliding": the conversation drops its oldest blocks after the first `sink_blocks` (positions
      stay as they are), so a chat can go on for ever in a fixed pool.
    - "adaptive": a ladder, no token lost before its last rung. On a model compiled with a compact
      region (compile(..., compact_blocks=N)) and a backend that can re-quantize (compact_block), the
      first rung compacts: blocks ending at least `compact_horizon` tokens back are moved into the
      compact region (runtime_sim/compact.py; fewer bits, the tokens stay), oldest first and only as
      many as the step is short of, idle conversations least recently used first, then the active
      ones. Then idle conversations are spilled to flash, least
      recently used first, compacted or not: written with the conversation file writer
      (runtime_sim/conversation_file.py; compact blocks as their compact records) into `spill_dir`
      (default: a temp dir the engine owns and removes), their slot and blocks (default and compact)
      freed; the conversation keeps its tokens. After a spill the ladder starts again from the top
      (the spill may have freed compact blocks). A spilled conversation's next turn maps it back from
      the file without prefill (the same logits bit for bit), spilling others to make room, its compact
      blocks into free compact blocks; if the compact region cannot hold them (the active conversations
      hold it), or the file cannot be read, its tokens are prefilled again instead (spill_reprefills).
      Last, the active conversation slides as with "sliding". A spill that cannot be written
      falls through to the next rung with the pool unchanged. Blocks shared with another
      conversation (fork, prefix cache) stay for it: a spill frees only what no one else holds.
    """

    def __init__(self, backend: Backend, tokenizer=None, prefill_chunk: int = 64, policy: str = "error",
                 sink_blocks: int = 1, spill_dir=None, compact_horizon: int = 1024):
        if policy not in POLICIES:
            raise PagedKVError(f"unknown pool policy '{policy}': use one of {', '.join(POLICIES)}.")
        if not isinstance(compact_horizon, int) or compact_horizon < 1:
            raise PagedKVError(f"compact_horizon {compact_horizon!r} is invalid: give the number of recent tokens "
                               "a conversation keeps in the default region (>= 1, e.g. 1024).")
        self.compact_horizon = compact_horizon  # adaptive: blocks at least this many tokens back may be compacted
        self.policy = policy
        self.sink_blocks = sink_blocks
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None  # None: a temp dir on first spill
        self._spill_tag = f"{os.getpid()}-{id(self):x}"  # spill file names of this engine in a shared dir
        self.clock = 0
        self.backend = backend
        self.tokenizer = tokenizer
        lay = backend.layout
        # one block pool per layer group (toolkit.block_pool.GroupedBlockPool); a backend without
        # sliding layers has one global group of the layout's blocks, exactly the single pool of before
        self.groups = list(getattr(backend, "groups", None) or [LayerGroup(0, tuple(range(lay.num_layers)),
                                                                           lay.num_blocks)])
        # the global group's compact region (the compact tier, runtime_sim/compact.py), if the model has one
        self.pool = GroupedBlockPool(self.groups, lay.block_size, lay.max_seqs, getattr(lay, "num_compact_blocks", 0))
        self.prefill_chunk = prefill_chunk
        self.conversations: dict[int, Conversation] = {}
        self.counters = Counters()
        self.stop_ids: tuple[int, ...] = ()
        self.manifest: dict | None = None
        self._next_id = 0

    # -- conversations -------------------------------------------------------------------------

    def new_conversation(self) -> int:
        self._make_slot(set())
        seq = self.pool.new_sequence()
        cid = self._next_id
        self._next_id += 1
        self.conversations[cid] = Conversation(seq, last_used=self.clock)
        return cid

    def fork(self, cid: int) -> int:
        """A new conversation sharing cid's cached blocks (copy-on-write), e.g. a shared system prompt."""
        src = self._resident(cid)
        self._make_slot({id(src)})
        seq = self.pool.fork(src.seq)
        self.backend.copy_stage(src.seq, seq)
        new = self._next_id
        self._next_id += 1
        self.conversations[new] = Conversation(seq, list(src.history), list(src.pending), last_used=self.clock)
        return new

    def clear(self, cid: int) -> None:
        """Release the conversation's blocks; it stays usable and starts empty."""
        conv = self.conversation(cid)
        if conv.spill is not None:  # no slot yet: take one first, so a failure changes nothing
            self._make_slot({id(conv)})
            seq = self.pool.new_sequence()
            self._drop_spill(conv)
            conv.seq = seq
        else:
            self.pool.release(conv.seq)
            conv.seq = self.pool.new_sequence()
        conv.history, conv.pending = [], []

    def close(self, cid: int) -> None:
        conv = self.conversation(cid)
        if conv.spill is not None:
            self._drop_spill(conv)
        else:
            self.pool.release(conv.seq)
        del self.conversations[cid]

    def conversation(self, cid: int) -> Conversation:
        if cid not in self.conversations:
            raise PagedKVError(f"unknown conversation {cid}: create one with new_conversation().")
        return self.conversations[cid]

    # -- running -------------------------------------------------------------------------------

    def block_tables(self, width: int):
        """Block tables [max_seqs, width] of the live sequences: one array, or a list of one per layer
        group when the model has several (a sliding group's rows have holes, -1, before the window)."""
        lay = self.backend.layout
        out = []
        for g in range(len(self.groups)):
            tables = np.full((lay.max_seqs, max(width, 1)), -1, dtype=np.int64)
            for seq in self.pool.live_sequences():
                row = self.pool.block_table(seq, g)[:width]
                tables[seq, : len(row)] = row
            out.append(tables)
        return out[0] if len(out) == 1 else out

    def _copy_block(self, group: int, src: int, dst: int) -> None:
        if len(self.groups) == 1:
            self.backend.copy_block(src, dst)
        else:  # only the layers of that group hold the block
            self.backend.copy_block(src, dst, self.groups[group].layers)

    def _make_room(self, items: list[tuple[Conversation, list[int]]], chunk: int | None = None,
                   slide: bool = True) -> None:
        """Apply the pool policy until every item's reserve will succeed, or raise PoolExhausted. With
        chunk: room to write the items in calls of chunk tokens (sliding layer groups trim in between).
        slide=False: the policy's rungs that keep every token only (adaptive: compact and spill, never slide)."""
        active = {id(c) for c, _ in items}
        spill = self.policy == "adaptive"
        compact = can_compact = spill and self._can_compact()
        while True:
            needs = [self.pool.blocks_needed(c.seq, len(t), chunk) for c, t in items]
            frees = self.pool.free_blocks()
            short = [g for g, f in enumerate(frees) if sum(n[g] for n in needs) > f]
            if not short:
                return
            need, free = sum(n[short[0]] for n in needs), frees[short[0]]
            if self.policy == "evict" and self._evict_one(active):
                continue
            if compact:
                # compaction frees blocks of the global group only, as many as it is short of
                if 0 in short and self._compact_one(items, sum(n[0] for n in needs) - frees[0]):
                    continue
                compact = False  # nothing more is old enough, or the compact region is full: next rung
            if spill:
                if self._spill_one(active, short):
                    compact = can_compact  # from the top: the spill may have freed compact blocks
                    continue
                spill = False  # nothing left to spill, or a spill file could not be written: next rung
            if self.policy in ("sliding", "adaptive") and slide and self._slide(items):
                continue
            what = f"{sum(len(t) for _, t in items)} new token(s)"
            if self.policy != "error":
                what += f" (policy '{self.policy}' found nothing more to free)"
            raise PoolExhausted(need, free, what)

    def _evict_one(self, active: set[int]) -> bool:
        idle = [c for c in self.conversations.values()
                if id(c) not in active and c.spill is None and self.pool.length(c.seq) > 0]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last_used)
        tokens = victim.history + victim.pending
        self.pool.release(victim.seq)
        victim.seq = self.pool.new_sequence()
        victim.history, victim.pending = [], tokens  # re-prefilled on its next turn
        victim.evictions += 1
        self.counters.evictions += 1
        log.info("pool full: evicted an idle conversation (%d tokens to prefill again)", len(tokens))
        return True

    def _slide(self, items: list[tuple[Conversation, list[int]]]) -> bool:
        """Drop the oldest droppable block of the item holding the most blocks. Compact blocks are not
        dropped (that frees no default block): the oldest default block after them goes."""
        bs = self.pool.block_size
        best = None
        n = self.groups[0].num_blocks  # ids >= n: compact blocks; dropping one frees no default block
        for conv, _ in items:
            table = self.pool.block_table(conv.seq)
            full = self.pool.length(conv.seq) // bs
            live = [i for i in range(self.sink_blocks, full) if 0 <= table[i] < n]
            if live and (best is None or len(live) > best[1]):
                best = (conv, len(live), live[0])
        if best is None:
            return False
        self.pool.drop_blocks(best[0].seq, [best[2]])
        self.counters.slides += 1
        log.info("pool full: dropped logical block %d of the active conversation (sliding)", best[2])
        return True

    # -- the adaptive policy: aged blocks compacted, idle conversations spilled to flash and mapped back --

    def _can_compact(self) -> bool:
        """The compact rung exists: the model has a compact region and the backend can re-quantize into it."""
        return (bool(self.pool.main.num_compact_blocks) and not self.groups[0].window
                and hasattr(self.backend, "compact_block"))

    def _compact_one(self, items: list[tuple[Conversation, list[int]]], limit: int | None = None) -> bool:
        """Compact the oldest aged blocks (at most `limit`: what the step is short of) of one conversation:
        the least recently used idle resident one that has any, else one of the items (the conversations
        about to be written). False if none moved; _make_room asks again while it is still short."""
        from runtime_sim.compact import compact_aged

        if not self.pool.main.num_free_compact_blocks:
            return False
        active = [c for c, _ in items]
        idle = sorted((c for c in self.conversations.values() if c.spill is None and all(c is not a for a in active)),
                      key=lambda c: c.last_used)
        by_obj = {id(c): cid for cid, c in self.conversations.items()}
        for conv in idle + active:
            moved = compact_aged(self, by_obj[id(conv)], self.compact_horizon, limit)
            if moved:
                self.counters.compactions += 1
                self.counters.compacted_blocks += len(moved)
                log.info("pool full: compacted %d aged block(s) of %s conversation %d (%d compact blocks free)",
                         len(moved), "the active" if any(conv is a for a in active) else "idle",
                         by_obj[id(conv)], self.pool.main.num_free_compact_blocks)
                return True
        return False

    def _spill_path(self, cid: int) -> Path:
        if self.spill_dir is None:  # a temp dir of our own, removed with the engine
            self.spill_dir = Path(tempfile.mkdtemp(prefix="pagedkv-spill-"))
            weakref.finalize(self, shutil.rmtree, str(self.spill_dir), True)
        return self.spill_dir / f"spill-{self._spill_tag}-{cid}.pkvc"

    def _freed_by_release(self, seq: int) -> tuple[list[int], int]:
        """Blocks that releasing seq would free: of each layer group's default region, and of the
        compact region; those no other sequence holds (a block shared by a fork or a restored prefix
        stays for the others)."""
        out, compact = [], 0
        for g in range(len(self.groups)):
            others = {b for s in self.pool.live_sequences() if s != seq for b in self.pool.block_table(s, g)}
            n = self.groups[g].num_blocks  # ids >= n: compact blocks, which free no default block
            mine = [b for b in self.pool.block_table(seq, g) if b >= 0 and b not in others]
            out.append(sum(1 for b in mine if b < n))
            compact += sum(1 for b in mine if b >= n)
        return out, compact

    def _spill_one(self, protect: set[int], short: list[int] | None, compact_short: bool = False) -> bool:
        """Spill the least recently used resident conversation not in protect (ids of Conversation
        objects) that frees a block of a short layer group, or a compact block if compact_short
        (short=None and not compact_short: one that frees a sequence slot, any will do). False if
        there is none, or if its file could not be written (then the pool and the conversation are as
        they were)."""
        best = None
        for cid, c in self.conversations.items():
            if c.spill is not None or id(c) in protect:
                continue
            if short is not None or compact_short:
                freed, freed_compact = self._freed_by_release(c.seq)
                if not (any(freed[g] for g in short or ()) or (compact_short and freed_compact)):
                    continue
            if best is None or c.last_used < best[1].last_used:
                best = (cid, c)
        if best is None:
            return False
        cid, conv = best
        path = self._spill_path(cid)
        try:
            size = conversation_file.write(path, conversation_state.capture(self, cid))
        except (PagedKVError, OSError) as e:
            self.counters.spill_failures += 1
            log.warning("pool full: could not spill conversation %d to flash (%s); taking the next rung", cid, e)
            return False
        self.pool.release(conv.seq)
        conv.seq, conv.spill = SPILLED, path
        self.counters.spills += 1
        self.counters.spill_bytes += size
        log.info("pool full: spilled conversation %d (%d tokens) to %s (%d bytes)", cid, len(conv.history), path, size)
        return True

    def _make_slot(self, protect: set[int]) -> None:
        """adaptive: a free sequence slot, spilling the least recently used idle conversation if every
        slot is held (other policies: new_sequence raises as before)."""
        while (self.policy == "adaptive" and len(self.pool.live_sequences()) >= self.pool.max_seqs
               and self._spill_one(protect, None)):
            pass

    def _room_for_file(self, d, protect: set[int]) -> None:
        """adaptive: spill idle conversations until the saved conversation d can be restored (its
        default blocks, its compact blocks and a sequence slot)."""
        need = conversation_file.blocks_to_restore(d)
        while self.policy == "adaptive":
            short = [g for g, (n, f) in enumerate(zip(need, self.pool.free_blocks())) if n > f]
            compact_short = d.n_compact > self.pool.main.num_free_compact_blocks
            if not short and not compact_short and len(self.pool.live_sequences()) < self.pool.max_seqs:
                return
            if not self._spill_one(protect, short or None, compact_short):
                return  # restore_sequence raises the shortage, nothing changed

    def _drop_spill(self, conv: Conversation) -> None:
        try:
            conv.spill.unlink(missing_ok=True)
        except OSError as e:  # the conversation is not affected; only a stray file is left
            log.warning("could not delete spill file %s: %s", conv.spill, e)
        conv.spill = None

    def _resident(self, cid: int, protect: set[int] | None = None) -> Conversation:
        """The conversation with its cache in the pool: a spilled one is mapped back from its file
        (no prefill; the same logits bit for bit), spilling others not in protect to make room."""
        conv = self.conversation(cid)
        if conv.spill is None:
            return conv
        protect = (protect or set()) | {id(conv)}
        path = conv.spill
        try:
            d = conversation_file.read(path)
            if d.tokens != conv.history or d.pending != conv.pending:
                raise conversation_file.ConversationFileError(f"spill file {path} holds other tokens")
        except PagedKVError as e:  # deleted or damaged behind our back: its tokens are still here
            return self._reprefill_spilled(cid, conv, protect, f"cannot be read back ({e})")
        self._room_for_file(d, protect)
        if d.n_compact > self.pool.main.num_free_compact_blocks:  # the conversations of this step hold them
            return self._reprefill_spilled(cid, conv, protect, f"needs {d.n_compact} compact block(s), "
                                           f"{self.pool.main.num_free_compact_blocks} can be had")
        conv.seq = conversation_state.restore_sequence(self, d, path)  # raises with nothing changed
        self._drop_spill(conv)
        self.counters.restores_from_spill += 1
        log.info("restored conversation %d (%d tokens) from its spill file", cid, len(conv.history))
        return conv

    def _reprefill_spilled(self, cid: int, conv: Conversation, protect: set[int], why: str) -> Conversation:
        """A spilled conversation that cannot be mapped back: a fresh slot, its file dropped, its tokens
        pending (prefilled again on this turn, under the ladder like any prompt)."""
        self._make_slot(protect)
        conv.seq = self.pool.new_sequence()
        self._drop_spill(conv)
        conv.history, conv.pending = [], conv.history + conv.pending
        self.counters.spill_reprefills += 1
        log.warning("spilled conversation %d %s: its %d tokens are prefilled again", cid, why, len(conv.pending))
        return conv

    def spilled(self) -> list[int]:
        """Ids of the conversations whose cache lies in a spill file (policy 'adaptive')."""
        return [cid for cid, c in self.conversations.items() if c.spill is not None]

    def _run(self, items: list[tuple[Conversation, list[int]]]) -> list[np.ndarray]:
        """Write tokens for several conversations in one call; returns each one's last logits."""
        self._make_room(items)
        self.clock += 1
        for conv, toks in items:
            conv.last_used = self.clock
            for g, src, dst in self.pool.reserve(conv.seq, len(toks)):
                self._copy_block(g, src, dst)
        ids, pos, seqs = [], [], []
        for conv, toks in items:
            start = self.pool.length(conv.seq)
            ids += toks
            pos += range(start, start + len(toks))
            seqs += [conv.seq] * len(toks)
        bs = self.backend.layout.block_size
        width = max(-(-(self.pool.length(c.seq) + len(t)) // bs) for c, t in items)
        last_rows = np.cumsum([len(t) for _, t in items]) - 1  # each conversation's last token in the call
        logits = self.backend.forward(
            np.asarray(ids, np.int64), np.asarray(pos, np.int64), np.asarray(seqs, np.int64), self.block_tables(width),
            rows=last_rows,
        )
        for conv, toks in items:
            self.pool.commit(conv.seq, toks)
            conv.history += toks
        return list(logits)

    def prefill(self, cid: int, token_ids: list[int]) -> np.ndarray:
        if not token_ids:
            raise PagedKVError("empty prompt: give at least one token.")
        conv = self._resident(cid)
        token_ids = conv.pending + list(token_ids)
        if self.policy in ("error", "evict"):  # room for the whole prompt up front: no half-prefilled turn
            self._make_room([(conv, token_ids)], self.prefill_chunk)
        elif self.policy == "adaptive":  # spill for the whole prompt; if that is not enough, the chunks slide
            try:
                self._make_room([(conv, token_ids)], self.prefill_chunk, slide=False)
            except PoolExhausted:
                pass
        conv.pending = []
        t0 = time.perf_counter()
        for a in range(0, len(token_ids), self.prefill_chunk):
            last = self._run([(conv, token_ids[a : a + self.prefill_chunk])])[0]
        self.counters.prefill_tokens += len(token_ids)
        self.counters.prefill_seconds += time.perf_counter() - t0
        return last

    def step(self, feeds: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """One batched call: append tokens to several conversations (each after its pending tokens);
        returns each conversation's last logits. Decode steps of many chats share one call."""
        protect = {id(self.conversation(cid)) for cid in feeds}
        if any(not self.conversation(cid).pending and not toks for cid, toks in feeds.items()):
            raise PagedKVError("step() needs at least one token per conversation.")
        items = []
        for cid, toks in feeds.items():
            conv = self._resident(cid, protect)
            items.append((conv, conv.pending + list(toks)))
        t0 = time.perf_counter()
        logits = self._run(items)
        for conv, _ in items:
            conv.pending = []
        n = sum(len(t) for _, t in items)
        self.counters.decode_tokens += n
        self.counters.decode_seconds += time.perf_counter() - t0
        return dict(zip(feeds, logits))

    def generate(
        self,
        cid: int,
        prompt_ids: list[int],
        max_new_tokens: int = 64,
        sampling: Sampling | None = None,
        stop_ids: tuple[int, ...] = (),
    ) -> Iterator[int]:
        """Prefill the prompt (appended to the conversation) and stream up to max_new_tokens tokens."""
        sampling = sampling or Sampling()
        rng = np.random.default_rng(sampling.seed)
        conv = self.conversation(cid)
        logits = self.prefill(cid, prompt_ids)
        for i in range(max_new_tokens):
            tok = sample(logits, sampling, rng)
            yield tok
            if tok in stop_ids or i == max_new_tokens - 1:
                conv.pending = [tok]  # fed at the start of the next turn
                return
            logits = self.step({cid: [tok]})[cid]

    # -- save / restore (runtime_sim/conversation_state.py; format: toolkit/CONVERSATION_FORMAT.md) --

    def capture(self, cid: int) -> "conversation_file.ConversationData":
        """Conversation cid as plain data: copies of its blocks' records as they lie in the pool, its stage
        rows and tokens (what save writes)."""
        self._resident(cid)
        return conversation_state.capture(self, cid)

    def save(self, cid: int, path, app: bytes = b"") -> int:
        """Write conversation cid (its blocks as they lie in the pool, stage rows, tokens, and the
        caller's own `app` bytes) to path, atomically. Returns the file's size in bytes."""
        d = self.capture(cid)
        d.app = bytes(app)
        return conversation_file.write(path, d)

    def restore(self, path) -> int:
        """A new conversation from a saved file, its blocks mapped back without re-prefill; a file of
        another model, spec or version, or a damaged one, raises PagedKVError and changes nothing."""
        return self.restore_data(conversation_file.read(path), path)

    def restore_data(self, d: "conversation_file.ConversationData", path) -> int:
        """restore() of an already read (or captured) conversation; path names it in errors. Everything is
        checked before the pool changes; adaptive: idle conversations are spilled to make room."""
        if self.policy == "adaptive":  # room by spilling idle conversations, once the file is known to fit
            conversation_file.check_compatible(d, conversation_state.describe(self), path)
            self._room_for_file(d, set())
        seq = conversation_state.restore_sequence(self, d, path)
        cid = self._next_id
        self._next_id += 1
        self.conversations[cid] = Conversation(seq, list(d.tokens), list(d.pending), last_used=self.clock)
        return cid

    # -- stats ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        lay = self.backend.layout
        s = self.pool.stats()
        c = self.counters
        # a block of a group costs its layers' token bytes in the group's spec (group_layout)
        blocks_bytes = sum(p.num_used_blocks * lay.block_size * group_layout(lay, g).bytes_per_token
                           // lay.num_layers * len(g.layers) for g, p in zip(self.groups, self.pool.pools))
        # compact blocks in use, in the compact spec, in the first group's layers (the compact tier)
        compact_used = self.pool.main.num_compact_blocks - self.pool.main.num_free_compact_blocks
        blocks_bytes += compact_used * lay.block_size * lay.compact_bytes_per_token // lay.num_layers * \
            len(self.groups[0].layers)
        s.update(
            kv_bytes_in_use=blocks_bytes + len(self.pool.live_sequences()) * lay.stage_bytes_per_sequence,
            pool_bytes=grouped_pool_bytes(lay, self.groups),
            prefill_tok_s=c.prefill_tokens / c.prefill_seconds if c.prefill_seconds else 0.0,
            decode_tok_s=c.decode_tokens / c.decode_seconds if c.decode_seconds else 0.0,
            ladder=dict(policy=self.policy, evictions=c.evictions, slides=c.slides, spills=c.spills,
                        spill_bytes=c.spill_bytes, spill_failures=c.spill_failures,
                        restores_from_spill=c.restores_from_spill, spill_reprefills=c.spill_reprefills,
                        spilled_now=len(self.spilled()), compactions=c.compactions,
                        compacted_blocks=c.compacted_blocks,
                        compact_blocks_in_use=self.pool.main.num_compact_blocks
                        - self.pool.main.num_free_compact_blocks),
        )
        return s

    def check_invariants(self) -> None:
        """The pool's invariants (toolkit.block_pool) and the engine's: every conversation is either
        resident (a live sequence of its own holding exactly its history) or spilled (no sequence, a
        spill file on disk), and every live sequence belongs to a conversation."""
        from toolkit.errors import PoolStateError

        self.pool.check_invariants()
        live, seen = set(self.pool.live_sequences()), set()
        for cid, c in self.conversations.items():
            if c.spill is not None:
                if c.seq != SPILLED or not c.spill.is_file():
                    raise PoolStateError(f"engine invariant broken: spilled conversation {cid} has slot {c.seq}, "
                                         f"file {c.spill} exists={c.spill.is_file()}")
                continue
            if c.seq not in live or c.seq in seen:
                raise PoolStateError(f"engine invariant broken: conversation {cid} has slot {c.seq}, not its own")
            seen.add(c.seq)
            if self.pool.tokens(c.seq) != c.history:
                raise PoolStateError(f"engine invariant broken: conversation {cid}'s history differs from its cache")
        if seen != live:
            raise PoolStateError(f"engine invariant broken: slots {sorted(live - seen)} belong to no conversation")
