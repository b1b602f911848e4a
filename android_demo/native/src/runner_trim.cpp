// The pool's committed pages: group 0's blocks below the usable limit are committed (prefaulted at startup
// when RunnerConfig::prefault), the rest released. shrink first moves the used blocks that lie at or above
// its target into free blocks below it (pack_below), then lowers the limit and returns the released blocks'
// pages to the OS (onTrimMemory); grow raises the limit again and re-commits the pages.

#include <sys/mman.h>

#include <cstring>

#include "runner_impl.h"

namespace pagedkv_rt {

int64_t Runner::Impl::committed_bytes() const {
  int64_t c = static_cast<int64_t>(arenas.empty() ? 0 : arenas[0]->size);
  for (size_t i = 1; i < arenas.size(); ++i) {
    if (per_layer_arenas() && layer_group[i - 1] == 0)  // group 0's blocks are committed up to the limit
      c += static_cast<int64_t>(arenas[i]->size) - codes_bytes_of_layer(static_cast<int>(i - 1)) +
           pool->main().limit() * block_bytes_layer();
    else
      c += static_cast<int64_t>(arenas[i]->size);
  }
  if (compact_mem) c += static_cast<int64_t>(compact_mem->size);
  return c;
}

// Touch (commit) or release the pages of blocks [lo, hi) in the codes tensor of every layer of group 0
// (the group the budget and shrink/grow limit; the other groups' arenas stay committed whole). The codes
// lie where the program's memory plan put them in the layer's arena (codes_offset, learned at the first
// step; the planner may put the stage rows first); before the first step nothing has been written, and the
// codes are assumed at the arena's start.
int64_t Runner::Impl::touch_blocks(int lo, int hi, bool commit) {
  if (!per_layer_arenas() || hi <= lo) return 0;
  const size_t ps = page_size();
  const size_t bbl = static_cast<size_t>(block_bytes_layer());
  int64_t done = 0;
  for (size_t i = 1; i < arenas.size(); ++i) {
    if (layer_group[i - 1] != 0) continue;
    const size_t base = codes_offset.empty() ? 0 : codes_offset[i - 1];
    size_t a = base + static_cast<size_t>(lo) * bbl, b = base + static_cast<size_t>(hi) * bbl;
    if (commit) {
      std::memset(arenas[i]->ptr + a, 0, b - a);
      done += static_cast<int64_t>(b - a);
    } else {
      a = (a + ps - 1) / ps * ps;  // only whole pages inside the free range
      b = b / ps * ps;
      if (b > a && madvise(arenas[i]->ptr + a, b - a, MADV_DONTNEED) == 0) done += static_cast<int64_t>(b - a);
    }
  }
  return done;
}

// Group 0's used default blocks at or above max(target, blocks in use) moved into its free blocks below
// that, in order (the k-th lowest into the k-th lowest free): each block's records (codes and scales)
// copied in every layer of group 0, then the block manager's move_block renames it in every table that
// holds it (and moves its refcount). Compact blocks, the other groups' blocks, stage rows (per sequence
// slot) and spilled conversations (not in the pool) do not move. The tokens a conversation generates next
// are unchanged: the kernel finds the same records through the tables. Returns the blocks moved (0 when
// the kernels' buffers cannot be reached: then shrink stops at the highest used block, as it did before).
int Runner::Impl::pack_below(int target) {
  BlockManager& main = pool->main();
  const int floor = std::max(target, main.num_used());
  if (main.highest_used() < floor) return 0;
  std::vector<uint8_t> used(static_cast<size_t>(main.num_blocks()), 0);
  for (int s : main.live_sequences())
    for (int32_t b : main.blocks(s))
      if (b >= 0 && b < main.num_blocks()) used[static_cast<size_t>(b)] = 1;
  std::vector<int> from, to;  // used at or above floor and free below it, both lowest first (a table that
                              // was ascending stays ascending)
  for (int b = floor; b < main.num_blocks(); ++b)
    if (used[static_cast<size_t>(b)]) from.push_back(b);
  for (int b = 0; b < floor && to.size() < from.size(); ++b)
    if (!used[static_cast<size_t>(b)]) to.push_back(b);
  std::vector<LayerPool> views;
  try {
    views = ensure_pool_views();
  } catch (const RunnerError&) {
    return 0;
  }
  const size_t rec = static_cast<size_t>(kv_heads) * block_size;
  const size_t cb = rec * code_bytes, sb = rec * scale_bytes;
  for (size_t k = 0; k < from.size() && k < to.size(); ++k) {
    const size_t f = static_cast<size_t>(from[k]), t = static_cast<size_t>(to[k]);
    for (int l : groups[0].layers) {
      const LayerPool& v = views[static_cast<size_t>(l)];
      std::memcpy(v.codes + t * cb, v.codes + f * cb, cb);
      if (scale_bytes) std::memcpy(v.scales + t * sb, v.scales + f * sb, sb);
    }
    main.move_block(from[k], to[k]);
  }
  pool->check_invariants();
  return static_cast<int>(std::min(from.size(), to.size()));
}

ShrinkResult Runner::shrink(int target) {
  std::lock_guard<std::mutex> g(impl_->mu);
  Impl& m = *impl_;
  ShrinkResult r;
  r.requested_blocks = target;
  BlockManager& main = m.pool->main();  // group 0: the one with a limit
  r.usable_before = main.limit();
  r.moved_blocks = m.pack_below(target);
  for (int s : main.live_sequences())  // used blocks still at or above the target (more are used than it)
    for (int b : main.blocks(s))
      if (b >= target && b < main.num_blocks()) ++r.blocked_by_used;  // compact blocks do not block it
  r.usable_after = main.shrink(target);
  r.released_bytes = m.touch_blocks(r.usable_after, r.usable_before, false);
  m.refresh_stats();
  return r;
}

int Runner::grow(int target) {
  std::lock_guard<std::mutex> g(impl_->mu);
  Impl& m = *impl_;
  int before = m.pool->main().limit();
  int after = m.pool->main().grow(std::min(target, m.pool->main().num_blocks()));
  if (m.cfg.prefault) m.touch_blocks(before, after, true);
  m.refresh_stats();
  return after;
}

}  // namespace pagedkv_rt
