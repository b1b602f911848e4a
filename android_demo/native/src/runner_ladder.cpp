// The pressure ladder (RunnerConfig::policy "sliding" / "adaptive"; runtime_sim Engine._make_room, same
// rungs in the same order): when a call needs blocks that are not free, compact aged blocks of idle
// conversations then of the active one (runner_compact.cpp), spill idle conversations to spill_dir
// (restored without prefill on their next use; runner_save.cpp writes and reads the files), slide.
// Pool invariants are checked after every rung; stats().ladder counts the rungs taken.

#include <unistd.h>

#include <cstdio>

#include "runner_impl.h"

namespace pagedkv_rt {

// The compact rung (Engine._compact_one): the oldest aged blocks (at most limit, what the step is short
// of) of one conversation, the least recently used idle resident one that has any, else the active one.
// False if none moved; make_room asks again while it is still short.
bool Runner::Impl::compact_one(Conv* active, int limit) {
  if (!pool->main().num_free_compact()) return false;
  std::vector<Conv*> order;
  for (auto& kv : convs)
    if (kv.second.spill.empty() && &kv.second != active) order.push_back(&kv.second);
  std::stable_sort(order.begin(), order.end(), [](const Conv* a, const Conv* b) { return a->last_used < b->last_used; });
  if (active) order.push_back(active);
  for (Conv* c : order) {
    const auto moved = compact_aged(*c, cfg.compact_horizon, limit);
    if (!moved.empty()) {
      ++ladder.compactions;
      ladder.compacted_blocks += static_cast<int64_t>(moved.size());
      return true;
    }
  }
  return false;
}

// The sliding rung (Engine._slide): drop the active conversation's oldest full default block after the
// sink, in every group that still holds it. Compact blocks are not dropped (that frees no default block).
bool Runner::Impl::slide_one(Conv& a) {
  BlockManager& main = pool->main();
  const auto& table = main.blocks(a.seq);
  const int full = main.length(a.seq) / block_size;
  for (int i = slide_sink(); i < full; ++i) {
    const int b = table[static_cast<size_t>(i)];
    if (b < 0 || b >= main.num_blocks()) continue;
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& t = pool->pool(g).blocks(a.seq);
      if (i < static_cast<int>(t.size()) && t[static_cast<size_t>(i)] >= 0) pool->pool(g).drop_blocks(a.seq, {i});
    }
    ++ladder.slides;
    return true;
  }
  return false;
}

std::string Runner::Impl::spill_path(int id) const {
  char tag[64];
  std::snprintf(tag, sizeof tag, "%d-%llx", static_cast<int>(getpid()),
                static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(this)));
  return cfg.spill_dir + "/spill-" + tag + "-" + std::to_string(id) + ".pkvc";
}

// The spill rung (Engine._spill_one): write the least recently used resident conversation other than
// protect to its spill file and free its slot and blocks. With short_groups / compact_short: only one
// that frees a block of a short group (or a compact block). False if none, or if its file could not be
// written (then nothing changed).
bool Runner::Impl::spill_one(const Conv* protect, const std::vector<int>* short_groups, bool compact_short) {
  const bool filter = (short_groups && !short_groups->empty()) || compact_short;
  Conv* best = nullptr;
  int best_id = -1;
  for (auto& kv : convs) {
    Conv& c = kv.second;
    if (!c.spill.empty() || &c == protect) continue;
    if (filter) {
      bool frees = false;
      for (size_t k = 0; short_groups && k < short_groups->size() && !frees; ++k) {
        const BlockManager& p = pool->pool(static_cast<size_t>((*short_groups)[k]));
        for (int32_t b : p.blocks(c.seq)) frees = frees || (b >= 0 && b < p.num_blocks());
      }
      if (compact_short)
        for (int32_t b : pool->main().blocks(c.seq)) frees = frees || b >= pool->main().num_blocks();
      if (!frees) continue;
    }
    if (!best || c.last_used < best->last_used) {
      best = &c;
      best_id = kv.first;
    }
  }
  if (!best) return false;
  const std::string path = spill_path(best_id);
  int64_t size = 0;
  try {
    ConversationFile f = capture(*best);
    f.app.clear();  // the runner keeps the chat's messages; the file holds the cache (as Engine's spill)
    size = static_cast<int64_t>(write_conversation_file(path, f));
  } catch (const RunnerError&) {
    ++ladder.spill_failures;  // the next rung is taken; the conversation stays resident
    return false;
  }
  pool->release(best->seq);
  best->seq = kSpilled;
  best->spill = path;
  ++ladder.spills;
  ladder.spill_bytes += size;
  return true;
}

// adaptive: a free sequence slot, spilling the least recently used idle conversation if all are held.
void Runner::Impl::make_slot(const Conv* protect) {
  while (can_spill() && static_cast<int>(pool->live_sequences().size()) >= max_seqs && spill_one(protect, nullptr, false)) {
  }
}

// adaptive: spill idle conversations until f can be restored (default blocks, compact blocks, a slot).
void Runner::Impl::room_for_file(const ConversationFile& f, const Conv* protect) {
  if (!can_spill()) return;
  const std::vector<int> need = blocks_to_restore(f);
  while (true) {
    std::vector<int> short_groups;
    for (size_t g = 0; g < need.size() && g < groups.size(); ++g)
      if (need[g] > pool->pool(g).num_free()) short_groups.push_back(static_cast<int>(g));
    const bool compact_short = static_cast<int>(f.n_compact()) > pool->main().num_free_compact();
    if (short_groups.empty() && !compact_short && static_cast<int>(pool->live_sequences().size()) < max_seqs) return;
    if (!spill_one(protect, &short_groups, compact_short)) return;  // restore_seq names the shortage
  }
}

void Runner::Impl::drop_spill(Conv& c) {
  unlink(c.spill.c_str());  // a stray file at worst; the conversation is not affected
  c.spill.clear();
}

// A spilled conversation that cannot be mapped back: a fresh slot, its file dropped, its tokens pending
// (prefilled again on this turn, under the ladder like any prompt).
Runner::Impl::Conv& Runner::Impl::reprefill_spilled(Conv& c) {
  make_slot(&c);
  c.seq = pool->new_sequence();
  drop_spill(c);
  c.pending.insert(c.pending.begin(), c.history.begin(), c.history.end());
  c.history.clear();
  ++ladder.spill_reprefills;
  return c;
}

// The conversation with its cache in the pool (Engine._resident): a spilled one is mapped back from its
// file without prefill (spilling others to make room), or prefilled again if that cannot be.
Runner::Impl::Conv& Runner::Impl::resident(int id) {
  Conv& c = conv(id);
  if (c.spill.empty()) return c;
  ConversationFile f;
  try {
    f = read_conversation_file(c.spill);
    if (f.tokens != c.history || f.pending != c.pending)
      throw RunnerError(ErrorCode::kArgument, "spill file " + c.spill + " holds other tokens");
  } catch (const RunnerError&) {  // deleted or damaged behind our back: its tokens are still here
    return reprefill_spilled(c);
  }
  room_for_file(f, &c);
  if (static_cast<int>(f.n_compact()) > pool->main().num_free_compact()) return reprefill_spilled(c);
  c.seq = restore_seq(f, c.spill);  // throws with nothing changed
  drop_spill(c);
  ++ladder.restores_from_spill;
  return c;
}

RunnerError Runner::Impl::exhausted(size_t g, int need, int free, size_t n_tokens, const char* what) const {
  return RunnerError(ErrorCode::kPoolExhausted,
                     "KV block pool exhausted for " + std::string(what) + " of " + std::to_string(n_tokens) +
                         " tokens" +
                         (grouped ? " in layer group " + std::to_string(g) + " (" +
                                        (groups[g].window ? "window " + std::to_string(groups[g].window)
                                                          : std::string("global")) + ")"
                                  : std::string()) +
                         ": needs " + std::to_string(need) + " block(s), only " + std::to_string(free) + " free" +
                         (cfg.policy != "error" ? " (policy '" + cfg.policy + "' found nothing more to free)"
                                                : std::string()) +
                         ". Clear a conversation or give the pool a larger budget.");
}

// Apply the pool policy until writing n_new tokens to a (in calls of chunk tokens; 0 = one call) will
// find its blocks, or throw kPoolExhausted (Engine._make_room). slide=false: only the rungs that keep
// every token (adaptive: compact and spill, never slide). Invariants are checked after every rung.
void Runner::Impl::make_room(Conv& a, int n_new, int chunk, bool slide, const char* what) {
  bool spill = can_spill();
  const bool can_compact = adaptive() && num_compact_blocks > 0 && groups[0].window == 0;
  bool compact = can_compact;
  while (true) {
    const std::vector<int> need = pool->blocks_needed(a.seq, n_new, chunk);
    std::vector<int> short_groups;
    for (size_t g = 0; g < need.size(); ++g)
      if (need[g] > pool->pool(g).num_free()) short_groups.push_back(static_cast<int>(g));
    if (short_groups.empty()) return;
    if (compact) {
      // compaction frees blocks of the global group only, as many as it is short of
      if (short_groups[0] == 0 && compact_one(&a, need[0] - pool->pool(0).num_free())) {
        pool->check_invariants();
        continue;
      }
      compact = false;  // nothing more is old enough, or the compact region is full: next rung
    }
    if (spill) {
      if (spill_one(&a, &short_groups, false)) {
        pool->check_invariants();
        compact = can_compact;  // from the top: the spill may have freed compact blocks
        continue;
      }
      spill = false;  // nothing left to spill, or a spill file could not be written: next rung
    }
    if ((adaptive() || cfg.policy == "sliding") && slide && slide_one(a)) {
      pool->check_invariants();
      continue;
    }
    const size_t g = static_cast<size_t>(short_groups[0]);
    throw exhausted(g, need[g], pool->pool(g).num_free(), static_cast<size_t>(n_new), what);
  }
}

}  // namespace pagedkv_rt
