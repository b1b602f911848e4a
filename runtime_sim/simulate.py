"""A phone-memory model: why a contiguous fp16 KV cache hits a cliff and a quantized block pool does not.

    result = simulate(SimConfig())          # `pagedkv simulate`; seeded and deterministic
    result["strategies"]                    # one dict per strategy, same trace, same RAM

The phone:
* RAM is an address space (default 4 GiB) mostly held by other apps. `free` bytes are left in free
  holes; `fragmentation` (0..1) sets how many: 0 = one big hole, 1 = many small ones (the total free
  is the same at every level). Hole sizes are heavy-tailed (lognormal), holes are in random order.
* The allocator is first-fit over the holes, page granular (4 KiB): a request larger than every
  hole fails even when the total free memory would be enough.
* During the trace other apps allocate and free (seeded), chopping the holes up over time.

The user: a seeded multi-conversation chat trace. Up to `chats` conversations are alive at once;
each turn adds a user message (lognormal, median 40 tokens) and an assistant answer (lognormal,
median 150 tokens); chats are occasionally cleared, new chats are opened, and a chat that would
pass the maximum context ends (the user starts a new one).

The strategies, each on a fresh copy of the same RAM and the same trace:
* contiguous-fp16: every new conversation allocates one [layers, 2, ctx, kv_heads, head_dim] fp16
  buffer up front (as engines preallocate for max context); it fails when no hole is large enough.
* paged-fp16 / paged-quant: a block pool of the same byte budget (`pool_bytes`) is allocated at
  startup as PoolLayout's per-layer codes / scales / stage tensors (each must fit a hole, or the
  strategy fails at startup); tokens are admitted through the real toolkit.block_pool.BlockPool
  (reserve -> commit, one block at a time while decoding) and PoolExhausted is a failure. The
  quantized pool holds ~2.4x the tokens in the same bytes.

A failure drops the conversation it happened in (its memory is released, its later turns are
skipped) and the trace goes on, so later failures are counted too.

Pool-pressure strategies (`--ladder`; LADDER_STRATEGIES), the quantized pool of paged-quant under the
engine's pool policies (runtime_sim/engine.py) instead of failing when it is full:
* paged-quant-evict: policy `evict`: the least recently used idle chat loses its blocks; its next turn
  prefills its tokens again. Each eviction is a loss (the cache is gone).
* paged-quant-ladder: policy `adaptive` without the compact tier: first the least recently used idle
  chat is spilled to flash (its present blocks and stage rows, as a conversation file; up to
  `flash_bytes`, default unlimited) and restored without prefill on its next turn, making room by
  spilling others; last, the active chat slides (its oldest block after the sink is dropped: a loss).
* paged-quant-compact: policy `adaptive` with the compact tier, the engine's whole ladder. The same pool
  bytes are split into default blocks and a compact region (blocks in kv_spec.compact_spec_for the
  spec: K4/V3 by default, ~0.58x a default block's bytes): by default (`compact_share` "auto",
  compact_split_layout) the default region is what the expected chats need there (every chat's sink
  block and its last `compact_horizon` tokens, and the largest turn the trace makes), the rest compact;
  a number is the fraction of the pool bytes in the compact region. First the aged
  blocks (ending at least `compact_horizon` tokens back; never the sink block or the last token's block)
  of idle chats, least recently used first, then of the active chat move to the compact region, oldest
  first and only as many as the turn is short of; then
  idle chats are spilled; last, the active chat slides. Compaction loses no token; its cost is
  fidelity, measured by benchmarks/compact_tier.py (BENCHMARKS.md "The compact tier").
A chat that is spilled still holds its tokens (tokens_held counts them); an evicted one does not.
`tokens_before_loss` is the tokens held at the first loss or failure. Only memory is modelled: the
time to write and read spill files is not.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass

import numpy as np

from runtime_sim.plan import (
    DEFAULT_CTX, as_dims, blocks_for_budget, contiguous_buffer_bytes, format_bytes, parse_size, pool_layout,
)
from toolkit.block_pool import BlockPool
from toolkit.errors import PoolExhausted, SpecError
from toolkit.model_dims import ModelDims
from toolkit.pool_layout import PoolLayout, check_block_size
from toolkit.kv_spec import bytes_per_token, compact_spec_for, fp16_bytes_per_token, parse_spec

PAGE = 4096
STRATEGIES = ("contiguous-fp16", "paged-fp16", "paged-quant")
LADDER_STRATEGIES = ("paged-quant-evict", "paged-quant-ladder", "paged-quant-compact")  # pressure handled, not failed
MAX_HOLES = 128  # holes at fragmentation 1.0


def _pages(nbytes: int) -> int:
    return -(-int(nbytes) // PAGE)


# ----------------------------------------------------------------------------------------------
# RAM: an address space with free holes and a first-fit allocator


class AddressSpace:
    """Free holes of a RAM address space (page granular) with first-fit allocation.

    Allocations are identified by an int id; `free(id)` returns the range and merges it with its
    neighbouring holes."""

    def __init__(self, size_bytes: int):
        self.size = _pages(size_bytes) * PAGE
        self._starts: list[int] = [0]  # sorted hole starts
        self._sizes: dict[int, int] = {0: self.size}  # hole start -> size
        self._allocs: dict[int, tuple[int, int]] = {}  # id -> (start, size)
        self._next_id = 0

    # queries
    @property
    def free_bytes(self) -> int:
        return sum(self._sizes.values())

    @property
    def largest_hole(self) -> int:
        return max(self._sizes.values(), default=0)

    @property
    def num_holes(self) -> int:
        return len(self._starts)

    def holes(self) -> list[tuple[int, int]]:
        return [(s, self._sizes[s]) for s in self._starts]

    def check(self) -> None:
        """Raise AssertionError unless holes and allocations tile the space exactly, holes merged."""
        ranges = sorted([(s, z, "hole") for s, z in self.holes()] + [(s, z, "alloc") for s, z in self._allocs.values()])
        pos, prev_kind = 0, None
        for start, size, kind in ranges:
            assert start == pos and size > 0, f"gap or overlap at {start} (expected {pos})"
            assert not (kind == prev_kind == "hole"), f"two adjacent holes at {start}"
            pos, prev_kind = start + size, kind
        assert pos == self.size, f"ranges end at {pos}, not {self.size}"
        assert self._starts == sorted(self._sizes), "hole index out of sync"

    # allocation
    def alloc(self, nbytes: int) -> int | None:
        """First-fit: the lowest hole that can hold nbytes (rounded up to pages); None if none can."""
        size = max(1, _pages(nbytes)) * PAGE
        for i, start in enumerate(self._starts):
            hole = self._sizes[start]
            if hole >= size:
                del self._sizes[start]
                if hole == size:
                    del self._starts[i]
                else:
                    self._starts[i] = start + size
                    self._sizes[start + size] = hole - size
                return self._record(start, size)
        return None

    def alloc_at(self, start: int, nbytes: int) -> int:
        """Take [start, start + nbytes) out of the hole containing it (to build an initial layout)."""
        size = max(1, _pages(nbytes)) * PAGE
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or start + size > self._starts[i] + self._sizes[self._starts[i]]:
            raise ValueError(f"[{start}, {start + size}) is not free")
        h_start = self._starts[i]
        h_size = self._sizes.pop(h_start)
        del self._starts[i]
        if start > h_start:
            self._insert_hole(h_start, start - h_start)
        if start + size < h_start + h_size:
            self._insert_hole(start + size, h_start + h_size - start - size)
        return self._record(start, size)

    def free(self, alloc_id: int) -> None:
        start, size = self._allocs.pop(alloc_id)
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start + size:  # merge with the next hole
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == start:  # merge with the previous hole
                self._sizes[prev] += size
                return
        self._insert_hole(start, size)

    def _insert_hole(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._sizes[start] = size

    def _record(self, start: int, size: int) -> int:
        self._next_id += 1
        self._allocs[self._next_id] = (start, size)
        return self._next_id


def make_ram(ram_bytes: int, free_bytes: int, fragmentation: float, seed: int,
             max_holes: int = MAX_HOLES) -> tuple[AddressSpace, list[int]]:
    """A RAM address space where other apps hold everything but `free_bytes`, left in
    1 + round(fragmentation * (max_holes - 1)) heavy-tailed holes in random order.

    Returns (ram, ids of the other apps' allocations)."""
    if not 0.0 <= fragmentation <= 1.0:
        raise SpecError(f"--fragmentation {fragmentation}: use a value from 0 (one free hole) to 1 (many small holes).")
    total_pages = _pages(ram_bytes)
    free_pages = min(int(free_bytes) // PAGE, total_pages)
    if free_pages < 1 or free_pages >= total_pages:
        raise SpecError(
            f"free memory {format_bytes(free_bytes)} of {format_bytes(ram_bytes)} RAM: leave other apps some "
            "memory and keep at least one page free (e.g. --free 0.25 or --free 1GiB)."
        )
    rng = np.random.default_rng([seed, 1])
    n_holes = min(1 + round(fragmentation * (max_holes - 1)), free_pages)
    hole_pages = _split(rng, free_pages, n_holes, sigma=1.5)
    used_pages = total_pages - free_pages
    n_apps = min(max(n_holes + 1, 48), used_pages)
    app_pages = _split(rng, used_pages, n_apps, sigma=1.0)
    # holes go into distinct gaps between app allocations (so no two holes touch), in random order
    gaps = sorted(rng.choice(n_apps + 1, size=min(n_holes, n_apps + 1), replace=False).tolist())
    hole_at = dict(zip(gaps, hole_pages))
    ram = AddressSpace(total_pages * PAGE)
    apps, pos = [], 0
    for i in range(n_apps + 1):
        pos += hole_at.get(i, 0) * PAGE
        if i < n_apps:
            apps.append(ram.alloc_at(pos, app_pages[i] * PAGE))
            pos += app_pages[i] * PAGE
    return ram, apps


def _split(rng: np.random.Generator, total: int, n: int, sigma: float) -> list[int]:
    """total split into n positive integer parts with lognormal weights (exact sum)."""
    if n <= 1:
        return [total]
    w = rng.lognormal(0.0, sigma, n)
    parts = np.maximum(1, np.floor(w / w.sum() * (total - n)).astype(np.int64) + 1)
    parts[int(np.argmax(parts))] += total - int(parts.sum())
    return [int(p) for p in parts]


# ----------------------------------------------------------------------------------------------
# The chat trace


@dataclass(frozen=True)
class Event:
    kind: str  # "new" | "turn" | "clear" | "end" | "app_alloc" | "app_free"
    conv: int = -1
    user: int = 0
    assistant: int = 0
    size: int = 0  # app_alloc bytes
    pick: float = 0.0  # app_free: which live app allocation (fraction of the list)


@dataclass
class SimConfig:
    """Everything that defines a run. Sizes in bytes."""

    ram_bytes: int = 4 * 2**30
    free: float = 0.25  # fraction of RAM (<= 1) or bytes (> 1) left free by other apps
    fragmentation: float = 0.3
    seed: int = 0
    turns: int = 700
    chats: int = 8  # conversations alive at once (and the block pool's max_seqs)
    ctx: int = DEFAULT_CTX  # max context of a conversation (the contiguous buffer size)
    pool_bytes: int | None = None  # paged budget; default: contiguous buffers for 2 conversations
    quant_spec: str = "default"
    block_size: int = 16
    app_churn: float = 0.3  # other-app alloc/free events per turn
    user_median: float = 40.0
    assistant_median: float = 150.0
    p_new: float = 0.12  # chance a step opens a new chat (when fewer than `chats` are alive)
    p_clear: float = 0.01  # chance a step clears a chat
    model: str | None = None  # model for the dims (default SmolLM2-135M)
    flash_bytes: int | None = None  # paged-quant-ladder/-compact: flash for spill files (None = unlimited)
    compact_share: float | str = "auto"  # paged-quant-compact: fraction of the pool bytes in the compact region,
    # or "auto": the default region sized for `chats` horizons and one turn (compact_split_layout)
    compact_horizon: int = 1024  # paged-quant-compact: recent tokens a chat keeps in default blocks

    def free_bytes(self) -> int:
        f = float(self.free)
        if f <= 0:
            raise SpecError(f"--free {self.free}: give a fraction of RAM (e.g. 0.25) or a size (e.g. 1GiB).")
        return int(f * self.ram_bytes) if f <= 1.0 else int(f)

    def validate(self) -> "SimConfig":
        if self.turns < 1:
            raise SpecError(f"--turns {self.turns}: simulate at least one turn.")
        if self.chats < 1:
            raise SpecError(f"--chats {self.chats}: allow at least one conversation.")
        if self.ctx < 64:
            raise SpecError(f"--ctx {self.ctx}: the maximum context must be at least 64 tokens.")
        check_block_size(self.block_size)
        if self.app_churn < 0:
            raise SpecError(f"--app-churn {self.app_churn}: use a rate >= 0 (events per turn).")
        if self.compact_share != "auto" and (isinstance(self.compact_share, str)
                                             or not 0 < self.compact_share < 1):
            raise SpecError(f"--compact-share {self.compact_share}: give the fraction of the pool bytes for the "
                            "compact region, between 0 and 1 (e.g. 0.5), or 'auto'.")
        if self.compact_horizon < 1:
            raise SpecError(f"--compact-horizon {self.compact_horizon}: give the recent tokens kept in default "
                            "blocks (>= 1, e.g. 1024).")
        self.free_bytes()
        return self


def make_trace(cfg: SimConfig) -> list[Event]:
    """The seeded event list every strategy replays: chats, turns, clears, other apps' churn."""
    rng = np.random.default_rng([cfg.seed, 2])
    cap_user, cap_asst = max_turn_tokens(cfg), min(1024, cfg.ctx // 4)
    events: list[Event] = []
    live: dict[int, int] = {}  # conv -> tokens so far
    next_conv = 0
    turns = 0
    while turns < cfg.turns:
        r = rng.random()
        if not live or (len(live) < cfg.chats and r < cfg.p_new):
            live[next_conv] = 0
            events.append(Event("new", next_conv))
            next_conv += 1
        elif live and r > 1.0 - cfg.p_clear:
            conv = int(rng.choice(sorted(live)))
            del live[conv]
            events.append(Event("clear", conv))
        else:
            conv = int(rng.choice(sorted(live)))
            user = int(min(cap_user, max(1, round(rng.lognormal(math.log(cfg.user_median), 1.0)))))
            asst = int(min(cap_asst, max(1, round(rng.lognormal(math.log(cfg.assistant_median), 0.8)))))
            if live[conv] + user + asst > cfg.ctx:  # the chat is full: the user starts over
                del live[conv]
                events.append(Event("end", conv))
                continue
            live[conv] += user + asst
            events.append(Event("turn", conv, user, asst))
            turns += 1
            n_churn = rng.poisson(cfg.app_churn)
            for _ in range(n_churn):
                if rng.random() < 0.5:
                    size = int(min(256 * 2**20, rng.lognormal(math.log(6 * 2**20), 1.0)))
                    events.append(Event("app_alloc", size=size))
                else:
                    events.append(Event("app_free", pick=float(rng.random())))
    return events


def max_turn_tokens(cfg: SimConfig) -> int:
    """The most tokens one turn of make_trace's trace admits at once (a user prompt, capped)."""
    return min(2048, cfg.ctx // 4)


# ----------------------------------------------------------------------------------------------
# Strategies


class _Strategy:
    name = ""

    def __init__(self, ram: AddressSpace, dims: ModelDims, cfg: SimConfig):
        self.ram, self.dims, self.cfg = ram, dims, cfg
        self.lengths: dict[int, int] = {}  # live conversation -> tokens held
        self.losses: list[dict] = []  # {"kind", "tokens_held"}: cache lost without a failure (run_strategy adds "event")

    def startup(self) -> str | None:
        """Allocate what must exist before the first chat; a message if that failed."""
        return None

    def open(self, conv: int) -> bool:
        raise NotImplementedError

    def grow(self, conv: int, user: int, assistant: int) -> bool:
        raise NotImplementedError

    def close(self, conv: int) -> None:
        raise NotImplementedError

    def tokens_held(self) -> int:
        return sum(self.lengths.values())

    def resident_tokens(self) -> int:
        """Tokens whose K/V is in RAM (tokens_held less what a strategy keeps on flash)."""
        return self.tokens_held()

    def bytes_in_use(self) -> int:
        raise NotImplementedError

    def bytes_allocated(self) -> int:
        raise NotImplementedError

    def capacity_assigned(self) -> int:
        """Token slots of KV memory assigned to live conversations."""
        raise NotImplementedError

    def info(self) -> dict:
        return {}


class Contiguous(_Strategy):
    name = "contiguous-fp16"

    def __init__(self, ram, dims, cfg):
        super().__init__(ram, dims, cfg)
        self.buffer_bytes = contiguous_buffer_bytes(dims, cfg.ctx)
        self.buffers: dict[int, int] = {}  # conv -> allocation id

    def open(self, conv):
        alloc = self.ram.alloc(self.buffer_bytes)
        if alloc is None:
            return False
        self.buffers[conv] = alloc
        self.lengths[conv] = 0
        return True

    def grow(self, conv, user, assistant):
        self.lengths[conv] += user + assistant  # the trace never passes ctx
        return True

    def close(self, conv):
        self.ram.free(self.buffers.pop(conv))
        del self.lengths[conv]

    def bytes_in_use(self):
        return len(self.buffers) * self.buffer_bytes

    bytes_allocated = bytes_in_use

    def capacity_assigned(self):
        return len(self.buffers) * self.cfg.ctx

    def info(self):
        return {
            "buffer_shape": [self.dims.num_layers, 2, self.cfg.ctx, self.dims.num_kv_heads, self.dims.head_dim],
            "buffer_bytes": self.buffer_bytes,
            "largest_allocation_bytes": self.buffer_bytes,
            "bytes_per_token": fp16_bytes_per_token(self.dims.num_kv_heads, self.dims.head_dim, self.dims.num_layers),
        }


class Paged(_Strategy):
    """A pool allocated at startup; admission through the real BlockPool."""

    def __init__(self, ram, dims, cfg, name: str, spec_name: str):
        super().__init__(ram, dims, cfg)
        self.name = name
        self.spec_name, self.spec = parse_spec(spec_name)
        budget = cfg.pool_bytes if cfg.pool_bytes is not None else 2 * contiguous_buffer_bytes(dims, cfg.ctx)
        nb = blocks_for_budget(self.spec, dims, budget, cfg.block_size, cfg.chats)
        if nb < 1:
            raise SpecError(
                f"pool budget {format_bytes(budget)} is too small for one {cfg.block_size}-token block of "
                f"'{self.spec_name}' with {cfg.chats} sequences: raise --pool-mb."
            )
        self.layout = pool_layout(self.spec, dims, nb, cfg.block_size, cfg.chats)
        self.pool = BlockPool(nb, cfg.block_size, cfg.chats)
        self.seqs: dict[int, int] = {}  # conv -> pool sequence
        self.allocations: list[int] = []
        self.block_bytes = self.layout.bytes_per_token * cfg.block_size
        self._next_token = 0

    def startup(self):
        per_layer = self.layout.layer_tensor_bytes()
        for layer in range(self.dims.num_layers):
            for tensor, nbytes in per_layer.items():
                alloc = self.ram.alloc(nbytes)
                if alloc is None:
                    for a in self.allocations:
                        self.ram.free(a)
                    self.allocations.clear()
                    return (f"layer {layer} {tensor} tensor ({format_bytes(nbytes)}) does not fit: largest free "
                            f"hole {format_bytes(self.ram.largest_hole)}")
                self.allocations.append(alloc)
        return None

    def open(self, conv):
        self.seqs[conv] = self.pool.new_sequence()
        self.lengths[conv] = 0
        return True

    def _admit(self, seq: int, n: int) -> None:
        self.pool.reserve(seq, n)  # raises PoolExhausted atomically
        self.pool.commit(seq, list(range(self._next_token, self._next_token + n)))
        self._next_token += n

    def grow(self, conv, user, assistant):
        seq, bs = self.seqs[conv], self.cfg.block_size
        try:
            self._admit(seq, user)  # prefill: the whole user message at once
            self.lengths[conv] = self.pool.length(seq)
            left = assistant
            while left:  # decode: one token per step, so a new block is needed at each block boundary
                n = min(left, bs - self.pool.length(seq) % bs)
                self._admit(seq, n)
                left -= n
                self.lengths[conv] = self.pool.length(seq)
        except PoolExhausted:
            return False
        return True

    def close(self, conv):
        self.pool.release(self.seqs.pop(conv))
        del self.lengths[conv]

    def tokens_held(self):
        return sum(self.pool.length(s) for s in self.pool.live_sequences())

    def bytes_in_use(self):
        stage = self.layout.stage_bytes_per_sequence * len(self.seqs)
        return self.pool.num_used_blocks * self.block_bytes + stage

    def bytes_allocated(self):
        return self.layout.total_bytes if self.allocations else 0

    def capacity_assigned(self):
        return self.pool.num_used_blocks * self.cfg.block_size

    def info(self):
        per_layer = self.layout.layer_tensor_bytes()
        return {
            "spec": self.spec_name,
            "layout": self.spec.describe(),
            "bytes_per_token": self.layout.bytes_per_token,
            "num_blocks": self.layout.num_blocks,
            "capacity_tokens": self.layout.capacity_tokens,
            "pool_bytes": self.layout.total_bytes,
            "allocation_count": len(per_layer) * self.dims.num_layers,
            "allocations_per_layer": per_layer,
            "largest_allocation_bytes": self.layout.largest_allocation_bytes,
        }


def default_region_blocks(chats: int, horizon: int, turn_tokens: int, block_size: int, sink_blocks: int = 1) -> int:
    """Default blocks the compact ladder needs so that no chat's recent tokens must leave the default
    region (else the active chat slides while compact room is left): per chat its sink block(s), the
    blocks of its last `horizon` tokens and the block straddling that horizon (runtime_sim.compact.
    aged_blocks moves only blocks ending >= horizon back), plus the active turn's tokens, admitted at once."""
    per_chat = max(1, sink_blocks) + -(-horizon // block_size) + 1
    return chats * per_chat + -(-turn_tokens // block_size)


def compact_split_layout(layout: PoolLayout, budget: int, share: float | str = "auto", chats: int | None = None,
                         horizon: int = 1024, turn_tokens: int = 0) -> PoolLayout:
    """`layout` (all default blocks, within budget) with part of its block bytes moved to a compact region
    (kv_spec.compact_spec_for its spec), the whole still within budget. share: the fraction moved, or
    "auto": keep default_region_blocks(chats (default layout.max_seqs), horizon, turn_tokens) default
    blocks and make the rest compact; if those fill the pool, `layout` as it is (no compact region). The
    one rule for sizing the region (simulate, pressure_ladder)."""
    compact = compact_spec_for(layout.spec, layout.head_dim)
    if share == "auto":
        need = default_region_blocks(chats or layout.max_seqs, horizon, turn_tokens, layout.block_size,
                                     layout.spec.sink_blocks)
        if need >= layout.num_blocks:  # the chats' recent tokens fill the pool: a compact region would only
            return layout  # make the active chat slide sooner (no region: the ladder is spill, then slide)
        num_blocks = need
    else:
        num_blocks = max(1, round(layout.num_blocks * (1 - share)))
    default_block = layout.bytes_per_token * layout.block_size
    compact_block = bytes_per_token(compact, layout.num_kv_heads, layout.head_dim, layout.num_layers) * layout.block_size
    n = (layout.num_blocks - num_blocks) * default_block // compact_block
    while n > 0:
        split = PoolLayout(layout.spec, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size,
                           num_blocks, layout.max_seqs, compact=compact, num_compact_blocks=n)
        if split.total_bytes <= budget:
            return split
        n -= 1
    raise SpecError(f"a compact share of {share} leaves no compact block in this pool: raise --pool-mb or the share.")


def simulate_compact_layout(layout: PoolLayout, budget: int, cfg: SimConfig) -> PoolLayout:
    """paged-quant-compact's pool: compact_split_layout for the trace's chats, horizon and largest turn."""
    return compact_split_layout(layout, budget, cfg.compact_share, cfg.chats, cfg.compact_horizon,
                                max_turn_tokens(cfg))


class PagedPressure(Paged):
    """paged-quant's pool under a pool policy (module docstring): 'evict', 'ladder' (spill, then slide) or
    'compact' (compact aged blocks, then spill, then slide)."""

    def __init__(self, ram, dims, cfg, name: str, mode: str):
        super().__init__(ram, dims, cfg, name, cfg.quant_spec)
        self.mode = mode
        self.compact_block_bytes = 0
        if mode == "compact":
            budget = cfg.pool_bytes if cfg.pool_bytes is not None else 2 * contiguous_buffer_bytes(dims, cfg.ctx)
            self.layout = simulate_compact_layout(self.layout, budget, cfg)
            self.pool = BlockPool(self.layout.num_blocks, cfg.block_size, cfg.chats, self.layout.num_compact_blocks)
            self.compact_block_bytes = self.layout.compact_bytes_per_token * cfg.block_size
        self.clock = 0
        self.last_used: dict[int, int] = {}
        # conv -> (tokens, dropped blocks, compact blocks, file bytes)
        self.spilled: dict[int, tuple[int, set[int], set[int], int]] = {}
        self.evicted: dict[int, int] = {}  # conv -> tokens to prefill again on its next turn
        self.flash_used = self.peak_flash = 0
        self.counts = {"evictions": 0, "reprefilled_tokens": 0, "spills": 0, "spill_failures": 0,
                       "restores": 0, "slides": 0, "compactions": 0, "compacted_blocks": 0}

    def _is_compact(self, block: int) -> bool:
        return block >= self.pool.num_blocks

    def _spill_bytes(self, seq: int) -> int:
        table = self.pool.block_table(seq)
        default = sum(1 for b in table if 0 <= b < self.pool.num_blocks)
        compact = sum(1 for b in table if self._is_compact(b))
        return default * self.block_bytes + compact * self.compact_block_bytes + self.layout.stage_bytes_per_sequence

    def _compact_aged(self, conv: int, limit: int | None = None) -> int:
        """The engine's choice of blocks (runtime_sim.compact.aged_blocks), oldest first, moved while compact
        blocks are free, at most `limit` (None: all)."""
        from runtime_sim.compact import aged_blocks

        seq = self.seqs[conv]
        moved = 0
        for i in aged_blocks(self.pool, seq, self.cfg.compact_horizon):
            if not self.pool.num_free_compact_blocks or (limit is not None and moved >= limit):
                break
            self.pool.compact(seq, i)
            moved += 1
        return moved

    def _compact_one(self, active: int, short: int) -> bool:
        """The compact rung: the oldest aged blocks, as many as the turn is `short` of, of the least recently
        used idle chat that has any, else the active chat's (the engine's Engine._compact_one)."""
        order = sorted((c for c in self.seqs if c != active), key=lambda c: self.last_used.get(c, 0)) + [active]
        for conv in order:
            moved = self._compact_aged(conv, short)
            if moved:
                self.counts["compactions"] += 1
                self.counts["compacted_blocks"] += moved
                return True
        return False

    def _relieve(self, active: int, short: int = 1) -> bool:
        """One rung of the policy (short: the default blocks the turn lacks); False when nothing more can be freed."""
        if self.mode == "compact" and self.pool.num_free_compact_blocks and self._compact_one(active, short):
            return True
        idle = [c for c, seq in self.seqs.items() if c != active and self.pool.length(seq) > 0]
        victim = min(idle, key=lambda c: self.last_used.get(c, 0)) if idle else None
        if self.mode == "evict":
            if victim is None:
                return False
            self.losses.append({"kind": "evict", "tokens_held": self.tokens_held()})
            self.evicted[victim] = self.pool.length(self.seqs[victim])
            self.pool.release(self.seqs[victim])
            self.seqs[victim] = self.pool.new_sequence()
            self.counts["evictions"] += 1
            return True
        if victim is not None:
            seq = self.seqs[victim]
            size = self._spill_bytes(seq)
            if self.cfg.flash_bytes is None or self.flash_used + size <= self.cfg.flash_bytes:
                table = self.pool.block_table(seq)
                self.spilled[victim] = (self.pool.length(seq), {i for i, b in enumerate(table) if b < 0},
                                        {i for i, b in enumerate(table) if self._is_compact(b)}, size)
                self.flash_used += size
                self.peak_flash = max(self.peak_flash, self.flash_used)
                self.pool.release(seq)
                del self.seqs[victim]
                self.counts["spills"] += 1
                return True
            self.counts["spill_failures"] += 1  # flash full: the next rung
        seq, bs = self.seqs[active], self.cfg.block_size
        table = self.pool.block_table(seq)
        # block 0 is the sink; a compact block is not dropped (that frees no default block)
        live = [i for i in range(1, self.pool.length(seq) // bs) if 0 <= table[i] < self.pool.num_blocks]
        if not live:
            return False
        self.losses.append({"kind": "slide", "tokens_held": self.tokens_held()})
        self.pool.drop_blocks(seq, [live[0]])
        self.counts["slides"] += 1
        return True

    def _admit_room(self, conv: int, n: int) -> None:
        while True:
            try:
                return self._admit(self.seqs[conv], n)
            except PoolExhausted as e:
                if not self._relieve(conv, max(1, e.requested_blocks - e.free_blocks)):
                    raise

    def _restore(self, conv: int) -> None:
        """Map a spilled chat back block by block (its holes dropped as they pass, its compact blocks
        back in the compact region while it has room), spilling others."""
        n, holes, compact, size = self.spilled.pop(conv)
        self.flash_used -= size  # read back and deleted (if the restore fails, the chat is dropped)
        self.seqs[conv] = seq = self.pool.new_sequence()
        bs = self.cfg.block_size
        for i in range(-(-n // bs)):
            self._admit_room(conv, min(bs, n - i * bs))
            if i in holes:
                self.pool.drop_blocks(seq, [i])
            elif i in compact and self.pool.num_free_compact_blocks:
                self.pool.compact(seq, i)
        self.counts["restores"] += 1

    def grow(self, conv, user, assistant):
        self.clock += 1
        self.last_used[conv] = self.clock
        bs = self.cfg.block_size
        try:
            if conv in self.spilled:
                self._restore(conv)
            if self.evicted.get(conv):
                n = self.evicted.pop(conv)
                self._admit_room(conv, n)
                self.counts["reprefilled_tokens"] += n
            self._admit_room(conv, user)
            left = assistant
            while left:
                k = min(left, bs - self.pool.length(self.seqs[conv]) % bs)
                self._admit_room(conv, k)
                left -= k
        except PoolExhausted:
            return False
        self.lengths[conv] = self.pool.length(self.seqs[conv])
        return True

    def close(self, conv):
        if conv in self.spilled:
            self.flash_used -= self.spilled.pop(conv)[3]
        else:
            self.pool.release(self.seqs.pop(conv))
        self.evicted.pop(conv, None)
        self.lengths.pop(conv, None)

    def tokens_held(self):
        return super().tokens_held() + sum(s[0] for s in self.spilled.values())

    def bytes_in_use(self):
        compact = self.pool.num_compact_blocks - self.pool.num_free_compact_blocks
        return super().bytes_in_use() + compact * self.compact_block_bytes

    def capacity_assigned(self):
        compact = self.pool.num_compact_blocks - self.pool.num_free_compact_blocks
        return super().capacity_assigned() + compact * self.cfg.block_size

    def resident_tokens(self):
        return super().tokens_held()

    def info(self):
        out = {**super().info(), "policy": "evict" if self.mode == "evict" else "adaptive",
               "pressure": dict(self.counts), "peak_flash_bytes": self.peak_flash, "flash_bytes": self.cfg.flash_bytes}
        if self.mode == "compact":
            out.update(compact_spec=self.layout.compact.describe() if self.layout.compact else None, num_compact_blocks=self.layout.num_compact_blocks,
                       compact_bytes_per_token=self.layout.compact_bytes_per_token,
                       compact_horizon=self.cfg.compact_horizon, capacity_tokens=(
                           self.layout.num_blocks + self.layout.num_compact_blocks) * self.cfg.block_size)
        return out


# ----------------------------------------------------------------------------------------------
# Running


def _make_strategy(name: str, ram: AddressSpace, dims: ModelDims, cfg: SimConfig) -> _Strategy:
    if name == "contiguous-fp16":
        return Contiguous(ram, dims, cfg)
    if name == "paged-fp16":
        return Paged(ram, dims, cfg, name, "fp16")
    if name == "paged-quant":
        return Paged(ram, dims, cfg, name, cfg.quant_spec)
    if name == "paged-quant-evict":
        return PagedPressure(ram, dims, cfg, name, "evict")
    if name == "paged-quant-ladder":
        return PagedPressure(ram, dims, cfg, name, "ladder")
    if name == "paged-quant-compact":
        return PagedPressure(ram, dims, cfg, name, "compact")
    raise SpecError(f"unknown strategy '{name}': choose from {', '.join(STRATEGIES + LADDER_STRATEGIES)}.")


def run_strategy(name: str, events: list[Event], dims: ModelDims, cfg: SimConfig) -> dict:
    ram, app_ids = make_ram(cfg.ram_bytes, cfg.free_bytes(), cfg.fragmentation, cfg.seed)
    s = _make_strategy(name, ram, dims, cfg)
    failures: list[dict] = []
    series = {"event": [], "tokens": [], "bytes_in_use": [], "bytes_allocated": [], "largest_hole": []}
    util_sum = util_n = 0
    alloc_util_sum = alloc_util_n = 0
    processed = turns_served = turns_dropped = app_alloc_failed = 0
    dead: set[int] = set()
    dynamic_apps: list[int] = []

    def record(i: int) -> None:
        nonlocal util_sum, util_n, alloc_util_sum, alloc_util_n
        tokens = s.resident_tokens()
        series["event"].append(i)
        series["tokens"].append(s.tokens_held())
        series["bytes_in_use"].append(s.bytes_in_use())
        series["bytes_allocated"].append(s.bytes_allocated())
        series["largest_hole"].append(ram.largest_hole)
        cap = s.capacity_assigned()
        if cap:
            util_sum += tokens / cap
            util_n += 1
        alloc = s.bytes_allocated()
        if alloc:
            alloc_util_sum += tokens * bpt / alloc
            alloc_util_n += 1

    def fail(i: int, kind: str, conv: int, detail: str = "") -> None:
        failures.append({"event": i, "kind": kind, "conversation": conv, "tokens_held": s.tokens_held(),
                         "bytes_in_use": s.bytes_in_use(), "detail": detail})

    bpt = s.info()["bytes_per_token"]
    startup_error = s.startup()
    if startup_error:
        fail(0, "startup", -1, startup_error)
        record(0)
    else:
        for i, ev in enumerate(events):
            seen = len(s.losses)
            if ev.kind == "new":
                if not s.open(ev.conv):
                    fail(i, "alloc", ev.conv, f"no free hole of {format_bytes(s.buffer_bytes)} "
                                              f"(largest {format_bytes(ram.largest_hole)})")
                    dead.add(ev.conv)
            elif ev.kind == "turn":
                if ev.conv in dead:
                    turns_dropped += 1
                elif s.grow(ev.conv, ev.user, ev.assistant):
                    turns_served += 1
                    processed += ev.user + ev.assistant
                else:
                    fail(i, "pool_exhausted", ev.conv)
                    turns_dropped += 1
                    s.close(ev.conv)
                    dead.add(ev.conv)
            elif ev.kind in ("clear", "end"):
                if ev.conv not in dead:
                    s.close(ev.conv)
                dead.discard(ev.conv)
            elif ev.kind == "app_alloc":
                a = ram.alloc(ev.size)
                if a is None:
                    app_alloc_failed += 1
                else:
                    dynamic_apps.append(a)
            elif ev.kind == "app_free" and dynamic_apps:
                ram.free(dynamic_apps.pop(int(ev.pick * len(dynamic_apps))))
            for loss in s.losses[seen:]:
                loss["event"] = i
            record(i)
    peak_alloc = max(series["bytes_allocated"])
    # the first event where anything was lost: a loss (eviction, slide) or a failure; a loss comes first
    # within its event (it happens before the failure it could not prevent)
    lost = sorted([(x["event"], 0, x["tokens_held"]) for x in s.losses] +
                  [(f["event"], 1, f["tokens_held"]) for f in failures])
    out = {
        "name": name,
        "tokens_before_failure": failures[0]["tokens_held"] if failures else processed,
        "peak_bytes": peak_alloc,
        "utilization": util_sum / util_n if util_n else 0.0,
        "failures": len(failures),
        "first_failure_event": failures[0]["event"] if failures else None,
        "tokens_before_loss": lost[0][2] if lost else processed,
        # the most tokens held at once (in RAM, or spilled to flash) before the first loss
        "peak_tokens_before_loss": max([t for e, t in zip(series["event"], series["tokens"])
                                        if not lost or e < lost[0][0]] + [lost[0][2] if lost else 0]),
        "first_loss_event": lost[0][0] if lost else None,
        "losses": len(s.losses),
        "startup_failed": bool(startup_error),
        "allocated_utilization": alloc_util_sum / alloc_util_n if alloc_util_n else 0.0,
        "peak_bytes_in_use": max(series["bytes_in_use"]),
        "peak_tokens": max(series["tokens"] + [f["tokens_held"] for f in failures]),
        "tokens_processed": processed,
        "turns_served": turns_served,
        "turns_dropped": turns_dropped,
        "other_app_alloc_failures": app_alloc_failed,
        "failure_events": failures,
        **s.info(),
    }
    if isinstance(s, Paged):
        s.pool.check_invariants()
        out["pool_stats"] = s.pool.stats()
        out["_pool"] = s.pool  # for tests / callers; dropped from the JSON
    out["series"] = series
    return out


def simulate(cfg: SimConfig | None = None, strategies=STRATEGIES) -> dict:
    """strategies: names from STRATEGIES and LADDER_STRATEGIES (`pagedkv simulate --ladder`: all)."""
    cfg = (cfg or SimConfig()).validate()
    dims = as_dims(cfg.model)
    events = make_trace(cfg)
    ram, _ = make_ram(cfg.ram_bytes, cfg.free_bytes(), cfg.fragmentation, cfg.seed)
    results = [run_strategy(name, events, dims, cfg) for name in strategies]
    params = asdict(cfg)
    params.update(
        model=cfg.model or "smollm2",
        dims=asdict(dims),
        free_bytes=cfg.free_bytes(),
        pool_bytes=cfg.pool_bytes if cfg.pool_bytes is not None else 2 * contiguous_buffer_bytes(dims, cfg.ctx),
        initial_holes=ram.num_holes,
        initial_largest_hole=ram.largest_hole,
        events=len(events),
        trace_tokens=sum(e.user + e.assistant for e in events if e.kind == "turn"),
        conversations=sum(1 for e in events if e.kind == "new"),
        quant_bytes_per_token=bytes_per_token(parse_spec(cfg.quant_spec)[1], dims.num_kv_heads, dims.head_dim,
                                              dims.num_layers),
    )
    return {"params": params, "strategies": results}


def to_json(result: dict, with_series: bool = True) -> dict:
    """The JSON-safe form: {"params", "strategies": [{"name", "tokens_before_failure", "peak_bytes",
    "utilization", ...}]}."""
    strategies = []
    for r in result["strategies"]:
        r = {k: v for k, v in r.items() if not k.startswith("_")}
        if not with_series:
            r.pop("series", None)
        strategies.append(r)
    return {"params": result["params"], "strategies": strategies}


# ----------------------------------------------------------------------------------------------
# Output


COLORS = {"contiguous-fp16": "tab:red", "paged-fp16": "tab:orange", "paged-quant": "tab:green",
          "paged-quant-evict": "tab:purple", "paged-quant-ladder": "tab:blue",
          "paged-quant-compact": "tab:cyan"}


def plot(result: dict, path) -> None:
    """PNG: KV memory in use and tokens held over the trace, failures marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["params"]
    fig, (ax_mem, ax_tok) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for r in result["strategies"]:
        color = COLORS.get(r["name"], None)
        ser = r["series"]
        x = ser["event"]
        mib = [b / 2**20 for b in ser["bytes_in_use"]]
        ax_mem.plot(x, mib, color=color, lw=1.2, label=f"{r['name']} (in use)")
        if r["name"] != "contiguous-fp16" and r.get("pool_bytes") and not r["startup_failed"]:
            ax_mem.axhline(r["pool_bytes"] / 2**20, color=color, ls="--", lw=0.8,
                           label=f"{r['name']} pool ({format_bytes(r['pool_bytes'])})")
        ax_tok.plot(x, ser["tokens"], color=color, lw=1.2,
                    label=f"{r['name']}: {r['tokens_before_failure']:,} tokens at 1st failure")
        fx = [f["event"] for f in r["failure_events"]]
        fy_mem = [f["bytes_in_use"] / 2**20 for f in r["failure_events"]]
        fy_tok = [f["tokens_held"] for f in r["failure_events"]]
        ax_mem.scatter(fx, fy_mem, marker="x", color=color, s=40, zorder=3)
        ax_tok.scatter(fx, fy_tok, marker="x", color=color, s=40, zorder=3)
        if r["failure_events"]:
            ax_tok.axvline(fx[0], color=color, ls=":", lw=1)
    ax_mem.set_ylabel("KV memory (MiB)")
    ax_mem.set_title(
        f"{p['model']} KV cache on a {format_bytes(p['ram_bytes'])} phone, {format_bytes(p['free_bytes'])} free in "
        f"{p['initial_holes']} holes (fragmentation {p['fragmentation']}), seed {p['seed']}  (x = failure)",
        fontsize=9,
    )
    ax_mem.legend(fontsize=7, loc="lower right")
    ax_tok.set_ylabel("tokens held (live chats)")
    ax_tok.set_xlabel("trace event")
    ax_tok.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rich_table(result: dict):
    from rich.table import Table

    p = result["params"]
    table = Table(
        title=f"{p['model']}: {format_bytes(p['ram_bytes'])} RAM, {format_bytes(p['free_bytes'])} free in "
        f"{p['initial_holes']} holes (largest {format_bytes(p['initial_largest_hole'])}), paged budget "
        f"{format_bytes(p['pool_bytes'])}, {p['turns']} turns / {p['conversations']} chats, seed {p['seed']}"
    )
    for col in ("strategy", "tokens before failure", "peak tokens before loss", "peak KV bytes", "largest alloc",
                "utilization", "failures", "first failure", "pool pressure", "turns served", "tokens processed"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in result["strategies"]:
        first = "startup" if r["startup_failed"] else (
            "-" if r["first_failure_event"] is None else f"event {r['first_failure_event']}")
        pressure = ", ".join(f"{k} {v}" for k, v in r["pressure"].items() if v) or "-" if "pressure" in r else "-"
        table.add_row(
            r["name"], f"{r['tokens_before_failure']:,}", f"{r['peak_tokens_before_loss']:,}", format_bytes(r["peak_bytes"]),
            format_bytes(r["largest_allocation_bytes"]), f"{r['utilization']:.3f}", str(r["failures"]), first,
            pressure, f"{r['turns_served']}", f"{r['tokens_processed']:,}",
        )
    return table


def parse_free(text: str | float) -> float:
    """'0.25' (fraction of RAM) or '1GiB' (a size) -> SimConfig.free."""
    try:
        f = float(text)
    except (TypeError, ValueError):
        return float(parse_size(text, what="--free"))
    if not 0.0 < f < 1.0:
        raise SpecError(f"--free {text}: give a fraction of RAM between 0 and 1 (e.g. 0.25) or a size (e.g. 1GiB).")
    return f


__all__ = [
    "AddressSpace", "Event", "LADDER_STRATEGIES", "SimConfig", "STRATEGIES", "make_ram", "make_trace", "parse_free", "plot",
    "rich_table", "run_strategy", "simulate", "to_json",
]
