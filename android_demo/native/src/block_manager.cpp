#include "block_manager.h"

#include <algorithm>
#include <string>

#include "errors.h"

namespace pagedkv_rt {

static int cdiv(int a, int b) { return (a + b - 1) / b; }

BlockManager::BlockManager(int num_blocks, int block_size, int max_seqs, int limit, int num_compact_blocks)
    : num_blocks_(num_blocks), block_size_(block_size), max_seqs_(max_seqs), limit_(limit),
      num_compact_(num_compact_blocks) {
  if (block_size != 16 && block_size != 32)
    throw RunnerError(ErrorCode::kArgument, "block size " + std::to_string(block_size) + " is invalid: use 16 or 32");
  if (num_blocks < 1 || max_seqs < 1)
    throw RunnerError(ErrorCode::kArgument, "the pool needs at least 1 block and 1 sequence slot");
  if (limit < 1 || limit > num_blocks)
    throw RunnerError(ErrorCode::kArgument, "usable block count " + std::to_string(limit) + " must be in 1.." +
                                                std::to_string(num_blocks));
  if (num_compact_blocks < 0 || num_compact_blocks > (1 << 24))
    throw RunnerError(ErrorCode::kArgument, "compact block count " + std::to_string(num_compact_blocks) +
                                                " must be in 0.." + std::to_string(1 << 24));
  refcount_.assign(static_cast<size_t>(num_blocks) + static_cast<size_t>(num_compact_blocks), 0);
  for (int b = 0; b < limit; ++b) free_.insert(b);
  for (int b = num_blocks; b < num_blocks + num_compact_blocks; ++b) compact_free_.insert(b);
  seqs_.resize(static_cast<size_t>(max_seqs));
  for (int s = max_seqs - 1; s >= 0; --s) free_slots_.push_back(s);
}

int BlockManager::highest_used() const {
  for (int b = num_blocks_ - 1; b >= 0; --b)
    if (refcount_[static_cast<size_t>(b)] > 0) return b;
  return -1;
}

const BlockManager::Seq& BlockManager::get(int seq, const char* action) const {
  if (seq < 0 || seq >= max_seqs_)
    throw RunnerError(ErrorCode::kState, "unknown sequence " + std::to_string(seq) + ": valid ids are 0.." +
                                             std::to_string(max_seqs_ - 1));
  const Seq& s = seqs_[static_cast<size_t>(seq)];
  if (!s.live)
    throw RunnerError(ErrorCode::kState, std::string("cannot ") + action + " sequence " + std::to_string(seq) +
                                             ": it was released or never created");
  return s;
}

int BlockManager::new_sequence() {
  if (free_slots_.empty())
    throw RunnerError(ErrorCode::kState, "all " + std::to_string(max_seqs_) +
                                             " sequence slots are in use: clear a conversation, or export with a "
                                             "larger max_seqs");
  int seq = free_slots_.back();
  free_slots_.pop_back();
  seqs_[static_cast<size_t>(seq)] = Seq{true, {}, 0, 0};
  return seq;
}

void BlockManager::decref(int block) {
  int& r = refcount_[static_cast<size_t>(block)];
  if (--r == 0 && block >= num_blocks_) {
    compact_free_.insert(block);
  } else if (r == 0) {
    --used_;
    if (block < limit_) free_.insert(block);
  }
}

void BlockManager::release(int seq) {
  Seq& s = get(seq, "release");
  for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it)
    if (*it >= 0) decref(*it);
  s = Seq{};
  free_slots_.push_back(seq);
}

int BlockManager::blocks_needed(int seq, int n_new_tokens) const {
  const Seq& s = get(seq, "use");
  return std::max(0, cdiv(s.length + n_new_tokens, block_size_) - static_cast<int>(s.blocks.size()));
}

void BlockManager::reserve(int seq, int n_new_tokens) {
  Seq& s = get(seq, "use");
  if (n_new_tokens < 0) throw RunnerError(ErrorCode::kArgument, "n_new_tokens must be >= 0");
  int grow_by = blocks_needed(seq, n_new_tokens);
  if (grow_by > num_free())
    throw RunnerError(ErrorCode::kPoolExhausted,
                      "KV block pool exhausted for sequence " + std::to_string(seq) + " growing from " +
                          std::to_string(s.length) + " to " + std::to_string(s.length + n_new_tokens) +
                          " tokens: needs " + std::to_string(grow_by) + " block(s), only " +
                          std::to_string(num_free()) + " free. Clear a conversation or give the pool a larger budget.");
  for (int i = 0; i < grow_by; ++i) {
    int b = *free_.begin();
    free_.erase(free_.begin());
    refcount_[static_cast<size_t>(b)] = 1;
    ++used_;
    s.blocks.push_back(b);
  }
  s.reserved = std::max(s.reserved, s.length + n_new_tokens);
}

void BlockManager::commit(int seq, int n_tokens) {
  Seq& s = get(seq, "commit to");
  if (s.length + n_tokens > s.reserved)
    throw RunnerError(ErrorCode::kState, "commit of " + std::to_string(n_tokens) + " token(s) to sequence " +
                                             std::to_string(seq) + " exceeds its reservation: call reserve first");
  s.length += n_tokens;
}

void BlockManager::drop_blocks(int seq, const std::vector<int>& logical) {
  Seq& s = get(seq, "use");
  const int n_full = s.length / block_size_;
  std::vector<int> seen;
  for (int i : logical) {
    if (i < 0 || i >= n_full)
      throw RunnerError(ErrorCode::kState, "cannot drop logical block " + std::to_string(i) + " of sequence " +
                                               std::to_string(seq) + ": only full committed blocks 0.." +
                                               std::to_string(n_full - 1) + " can be dropped");
    if (s.blocks[static_cast<size_t>(i)] < 0)
      throw RunnerError(ErrorCode::kState, "logical block " + std::to_string(i) + " of sequence " +
                                               std::to_string(seq) + " was already dropped");
    if (std::find(seen.begin(), seen.end(), i) != seen.end())
      throw RunnerError(ErrorCode::kState, "drop_blocks got logical block " + std::to_string(i) + " twice");
    seen.push_back(i);
  }
  for (int i : logical) {
    int32_t& b = s.blocks[static_cast<size_t>(i)];
    decref(b);
    b = -1;
  }
}

std::pair<int, int> BlockManager::compact(int seq, int index) {
  Seq& s = get(seq, "compact a block of");
  const int n_full = s.length / block_size_;
  if (index < 0 || index >= n_full)
    throw RunnerError(ErrorCode::kState, "cannot compact logical block " + std::to_string(index) + " of sequence " +
                                             std::to_string(seq) + ": only full committed blocks 0.." +
                                             std::to_string(n_full - 1) + " can be");
  const int block = s.blocks[static_cast<size_t>(index)];
  if (block < 0 || block >= num_blocks_)
    throw RunnerError(ErrorCode::kState, "logical block " + std::to_string(index) + " of sequence " +
                                             std::to_string(seq) + " is " + (block < 0 ? "dropped" : "compact") +
                                             " already");
  if (refcount_[static_cast<size_t>(block)] > 1)  // no fork here (difference 2), kept as Python's rule
    throw RunnerError(ErrorCode::kState, "logical block " + std::to_string(index) + " of sequence " +
                                             std::to_string(seq) + " is shared: shared blocks stay in the default region");
  if (compact_free_.empty())
    throw RunnerError(ErrorCode::kPoolExhausted, "compacting block " + std::to_string(index) + " of sequence " +
                                                     std::to_string(seq) + ": the compact region's " +
                                                     std::to_string(num_compact_) + " blocks are all in use");
  const int dst = *compact_free_.begin();
  compact_free_.erase(compact_free_.begin());
  refcount_[static_cast<size_t>(dst)] = 1;
  s.blocks[static_cast<size_t>(index)] = dst;
  decref(block);
  return {block, dst};
}

int BlockManager::held(int seq) const {
  const Seq& s = get(seq, "use");
  return static_cast<int>(std::count_if(s.blocks.begin(), s.blocks.end(), [](int32_t b) { return b >= 0; }));
}

int BlockManager::length(int seq) const { return get(seq, "use").length; }
const std::vector<int32_t>& BlockManager::blocks(int seq) const { return get(seq, "use").blocks; }

std::vector<int> BlockManager::live_sequences() const {
  std::vector<int> out;
  for (int s = 0; s < max_seqs_; ++s)
    if (seqs_[static_cast<size_t>(s)].live) out.push_back(s);
  return out;
}

int BlockManager::shrink(int target) {
  int floor = highest_used() + 1;
  int to = std::max({target, floor, 1});
  if (to >= limit_) return limit_;
  free_.erase(free_.lower_bound(to), free_.end());
  limit_ = to;
  return limit_;
}

void BlockManager::move_block(int from, int to) {
  if (from < 0 || from >= num_blocks_ || refcount_[static_cast<size_t>(from)] == 0)
    throw RunnerError(ErrorCode::kState, "cannot move block " + std::to_string(from) + ": it is not a used block of "
                                             "the default region");
  if (!free_.count(to))
    throw RunnerError(ErrorCode::kState, "cannot move a block to block " + std::to_string(to) + ": it is not free "
                                             "below the usable limit " + std::to_string(limit_));
  for (Seq& s : seqs_)
    if (s.live)
      for (int32_t& b : s.blocks)
        if (b == from) b = to;
  refcount_[static_cast<size_t>(to)] = refcount_[static_cast<size_t>(from)];
  refcount_[static_cast<size_t>(from)] = 0;
  free_.erase(to);
  if (from < limit_) free_.insert(from);
}

int BlockManager::grow(int target) {
  int to = std::min(target, num_blocks_);
  for (int b = limit_; b < to; ++b)
    if (refcount_[static_cast<size_t>(b)] == 0) free_.insert(b);
  limit_ = std::max(limit_, to);
  return limit_;
}

void BlockManager::check_invariants() const {
  auto fail = [](const std::string& m) { throw RunnerError(ErrorCode::kState, "block pool invariant broken: " + m); };
  const int total = num_blocks_ + num_compact_;
  std::vector<int> refs(static_cast<size_t>(total), 0);
  int live = 0;
  for (int q = 0; q < max_seqs_; ++q) {
    const Seq& s = seqs_[static_cast<size_t>(q)];
    if (!s.live) continue;
    ++live;
    if (s.length > s.reserved || static_cast<int>(s.blocks.size()) != cdiv(s.reserved, block_size_))
      fail("sequence " + std::to_string(q) + " length/reserved/blocks disagree");
    for (size_t i = 0; i < s.blocks.size(); ++i) {
      const int b = s.blocks[i];
      if (b < 0) {  // a hole: only where a full committed block was dropped
        if (static_cast<int>(i) >= s.length / block_size_)
          fail("sequence " + std::to_string(q) + " has a hole at logical block " + std::to_string(i) + ", which is not full");
        continue;
      }
      if (b >= total) fail("block id out of range");
      if (b >= num_blocks_ && static_cast<int>(i) >= s.length / block_size_)
        fail("sequence " + std::to_string(q) + " has a compact block at logical block " + std::to_string(i) +
             ", which is not full");
      ++refs[static_cast<size_t>(b)];
    }
  }
  int used = 0;
  for (int b = 0; b < num_blocks_; ++b) {
    int r = refcount_[static_cast<size_t>(b)];
    if (r != refs[static_cast<size_t>(b)]) fail("block " + std::to_string(b) + " refcount mismatch");
    if (r > 0) ++used;
    bool in_free = free_.count(b) > 0;
    if (in_free != (r == 0 && b < limit_)) fail("block " + std::to_string(b) + " free-list membership wrong");
  }
  if (used != used_) fail("used count mismatch");
  for (int b = num_blocks_; b < total; ++b) {  // the compact region
    const int r = refcount_[static_cast<size_t>(b)];
    if (r != refs[static_cast<size_t>(b)]) fail("compact block " + std::to_string(b) + " refcount mismatch");
    if ((compact_free_.count(b) > 0) != (r == 0)) fail("compact block " + std::to_string(b) + " free-list membership wrong");
  }
  if (static_cast<int>(compact_free_.size()) > num_compact_ ||
      (!compact_free_.empty() && (*compact_free_.begin() < num_blocks_ || *compact_free_.rbegin() >= total)))
    fail("compact free list holds an id outside the compact region");
  if (live + static_cast<int>(free_slots_.size()) != max_seqs_) fail("sequence slots inconsistent");
}

// ------------------------------------------------------------------------------------------------
// Layer groups (toolkit/block_pool.py: dead_blocks, window_blocks_needed, GroupedBlockPool)

int dead_blocks(int window, int block_size, int length) {
  if (window <= 0) return 0;
  return std::max(0, (length - window + 1) / block_size);
}

int window_blocks_needed(int window, int block_size, int new_tokens) {
  return cdiv(window - 1 + new_tokens, block_size) + 1;
}

static std::vector<BlockManager> make_pools(const std::vector<LayerGroup>& groups, int block_size, int max_seqs,
                                            int limit, int num_compact) {
  if (groups.empty()) throw RunnerError(ErrorCode::kArgument, "a pool needs at least one layer group");
  if (num_compact && groups[0].window)
    throw RunnerError(ErrorCode::kArgument, "a compact region belongs to the global layer group: this model has none");
  std::vector<BlockManager> out;
  for (size_t g = 0; g < groups.size(); ++g)
    out.emplace_back(groups[g].num_blocks, block_size, max_seqs, g == 0 ? limit : groups[g].num_blocks,
                     g == 0 ? num_compact : 0);
  return out;
}

GroupedBlockManager::GroupedBlockManager(std::vector<LayerGroup> groups, int block_size, int max_seqs, int limit,
                                         int num_compact_blocks)
    : groups_(std::move(groups)),
      pools_(make_pools(groups_, block_size, max_seqs, limit, num_compact_blocks)),
      block_size_(block_size) {}

int GroupedBlockManager::new_sequence() {
  const int seq = pools_[0].new_sequence();  // throws with nothing changed when the slots are full
  for (size_t g = 1; g < pools_.size(); ++g)
    if (pools_[g].new_sequence() != seq)
      throw RunnerError(ErrorCode::kState, "layer groups out of step: group " + std::to_string(g) +
                                               " gave another sequence slot than group 0");
  return seq;
}

void GroupedBlockManager::release(int seq) {
  for (auto& p : pools_) p.release(seq);
}

std::vector<int> GroupedBlockManager::blocks_needed(int seq, int n_new_tokens, int chunk) const {
  std::vector<int> out;
  for (size_t g = 0; g < pools_.size(); ++g) {
    int need = pools_[g].blocks_needed(seq, n_new_tokens);
    if (groups_[g].window > 0 && chunk > 0) {
      const int peak = window_blocks_needed(groups_[g].window, block_size_, std::min(chunk, n_new_tokens));
      need = std::min(need, std::max(0, peak - pools_[g].held(seq)));
    }
    out.push_back(need);
  }
  return out;
}

void GroupedBlockManager::reserve(int seq, int n_new_tokens) {
  if (n_new_tokens < 0) throw RunnerError(ErrorCode::kArgument, "n_new_tokens must be >= 0");
  if (pools_.size() == 1 && groups_[0].window == 0) return pools_[0].reserve(seq, n_new_tokens);  // as before groups
  const std::vector<int> need = blocks_needed(seq, n_new_tokens);
  for (size_t g = 0; g < pools_.size(); ++g)
    if (need[g] > pools_[g].num_free())
      throw RunnerError(ErrorCode::kPoolExhausted,
                        "KV block pool exhausted for sequence " + std::to_string(seq) + " growing from " +
                            std::to_string(length(seq)) + " to " + std::to_string(length(seq) + n_new_tokens) +
                            " tokens in layer group " + std::to_string(g) + " (" +
                            (groups_[g].window ? "window " + std::to_string(groups_[g].window) : std::string("global")) +
                            "): needs " + std::to_string(need[g]) + " block(s), only " +
                            std::to_string(pools_[g].num_free()) +
                            " free. Clear a conversation or give the pool a larger budget.");
  for (auto& p : pools_) p.reserve(seq, n_new_tokens);
}

void GroupedBlockManager::commit(int seq, int n_tokens) {
  for (auto& p : pools_) p.commit(seq, n_tokens);
  trim(seq);
}

void GroupedBlockManager::trim(int seq) {
  for (size_t g = 0; g < pools_.size(); ++g) {
    if (groups_[g].window <= 0) continue;
    const auto& table = pools_[g].blocks(seq);
    std::vector<int> dead;
    const int n = dead_blocks(groups_[g].window, block_size_, pools_[g].length(seq));
    for (int i = 0; i < n; ++i)
      if (table[static_cast<size_t>(i)] >= 0) dead.push_back(i);
    if (!dead.empty()) pools_[g].drop_blocks(seq, dead);
  }
}

void GroupedBlockManager::check_invariants() const {
  for (const auto& p : pools_) p.check_invariants();
  for (size_t g = 0; g < pools_.size(); ++g) {
    if (pools_[g].live_sequences() != pools_[0].live_sequences())
      throw RunnerError(ErrorCode::kState, "block pool invariant broken: layer groups hold other sequences");
    for (int seq : pools_[g].live_sequences()) {
      if (pools_[g].length(seq) != pools_[0].length(seq))
        throw RunnerError(ErrorCode::kState, "block pool invariant broken: sequence " + std::to_string(seq) +
                                                 " differs between groups");
      const auto& table = pools_[g].blocks(seq);
      const int n = dead_blocks(groups_[g].window, block_size_, pools_[g].length(seq));
      for (int i = 0; i < n; ++i)
        if (table[static_cast<size_t>(i)] >= 0)
          throw RunnerError(ErrorCode::kState, "block pool invariant broken: sequence " + std::to_string(seq) +
                                                   " keeps block " + std::to_string(i) + " outside the window of " +
                                                   std::to_string(groups_[g].window) + " in a sliding group");
    }
  }
}

}  // namespace pagedkv_rt
