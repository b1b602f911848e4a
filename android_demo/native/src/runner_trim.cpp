// The pool's committed pages: group 0's blocks below the usable limit are committed (prefaulted at startup
// when RunnerConfig::prefault), the rest released. shrink lowers the limit and returns the released blocks'
// pages to the OS (onTrimMemory); grow raises it again and re-commits them.

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

// Touch (commit) or release the pages of blocks [lo, hi) in the codes region of every layer of group 0
// (the group the budget and shrink/grow limit; the other groups' arenas stay committed whole).
int64_t Runner::Impl::touch_blocks(int lo, int hi, bool commit) {
  if (!per_layer_arenas() || hi <= lo) return 0;
  const size_t ps = page_size();
  const size_t bbl = static_cast<size_t>(block_bytes_layer());
  int64_t done = 0;
  for (size_t i = 1; i < arenas.size(); ++i) {
    if (layer_group[i - 1] != 0) continue;
    size_t a = static_cast<size_t>(lo) * bbl, b = static_cast<size_t>(hi) * bbl;
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

ShrinkResult Runner::shrink(int target) {
  std::lock_guard<std::mutex> g(impl_->mu);
  Impl& m = *impl_;
  ShrinkResult r;
  r.requested_blocks = target;
  BlockManager& main = m.pool->main();  // group 0: the one with a limit
  r.usable_before = main.limit();
  int hu = main.highest_used();
  if (hu >= target) {  // count used blocks at or above the target
    for (int s : main.live_sequences())
      for (int b : main.blocks(s))
        if (b >= target && b < main.num_blocks()) ++r.blocked_by_used;  // compact blocks do not block it
  }
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
