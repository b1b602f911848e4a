// Block tables, reference counts, the free list and sequence slots of the paged KV pool: the C++
// twin of toolkit/block_pool.py's BlockPool, and GroupedBlockManager, the twin of its
// GroupedBlockPool (one BlockManager per layer group: global layers, and sliding-window layers that
// hand their blocks back as they leave the window). tests/test_twins.py replays recorded traces of
// pool operations through both sides and compares every result. The intended differences, all of them:
//   1. allocation order: here the lowest free id first (used blocks stay at the bottom of the pool,
//      so shrinking its free top part usually succeeds); in Python the block freed longest ago (an LRU
//      for its prefix cache). Block ids therefore differ; counts, slots, holes and outcomes do not.
//   2. no prefix cache and no fork / copy-on-write here: the app runs one chat per conversation, so
//      every refcount is 0 or 1, and commit takes a token count (Python takes the token ids, for the
//      prefix cache's hashes).
//   3. the usable limit (C++ only): only blocks < limit() are handed out. shrink lowers it (blocks at
//      or above the new limit must be free; the runner then returns their pages to the OS when Android
//      asks the app to trim, after moving used blocks below the new limit with move_block), grow raises
//      it again up to the exported number of blocks. In a
//      GroupedBlockManager only group 0 (the global group, when the model has global layers) has a
//      limit below its block count; every other group always has all its blocks usable.
// The compact region (the compact tier, issue 25; BlockPool(num_compact_blocks=N)): ids num_blocks ..
// num_blocks + N - 1 name blocks of the pool's compact region; they are never handed out for growth,
// compact(seq, i) moves a full block there (lowest free compact id first, by difference 1), and the
// usable limit does not apply to them. num_used / num_free count the default region only, as in Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

namespace pagedkv_rt {

class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size, int max_seqs, int limit, int num_compact_blocks = 0);

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int max_seqs() const { return max_seqs_; }
  int limit() const { return limit_; }
  int num_used() const { return used_; }
  int num_free() const { return static_cast<int>(free_.size()); }  // allocatable (below the limit)
  int highest_used() const;                                          // -1 if none
  int num_compact_blocks() const { return num_compact_; }
  int num_free_compact() const { return static_cast<int>(compact_free_.size()); }
  bool is_compact(int block) const { return block >= num_blocks_; }  // a table id of the compact region

  int new_sequence();                  // throws RunnerError(kState) if all slots are in use
  void release(int seq);               // drops the sequence's blocks and frees its slot
  int blocks_needed(int seq, int n_new_tokens) const;
  void reserve(int seq, int n_new_tokens);  // atomic: throws RunnerError(kPoolExhausted), nothing changed
  void commit(int seq, int n_tokens);       // advance the length by tokens written
  // Punch holes (-1) at these logical blocks (a sliding group's blocks that left the window); positions
  // stay put. Only full, committed, not yet dropped blocks; atomic: throws RunnerError(kState), nothing changed.
  void drop_blocks(int seq, const std::vector<int>& logical);
  // Move logical block `index` of seq to a free compact block (BlockPool.compact): the table names the
  // compact id, the default block is freed (its records stay until it is reused: the runtime
  // re-quantizes them into the compact block before the next call). Returns {default id, compact id}.
  // Only a full committed block of the default region; atomic: throws RunnerError(kState) for another
  // block, RunnerError(kPoolExhausted) when the compact region is full, nothing changed.
  std::pair<int, int> compact(int seq, int index);
  int held(int seq) const;  // blocks of seq that are not holes
  int length(int seq) const;
  const std::vector<int32_t>& blocks(int seq) const;
  std::vector<int> live_sequences() const;

  // Lowers the limit towards target (never below highest_used()+1); returns the new limit.
  int shrink(int target);
  // Renames used default block `from` to free block `to` (below the limit) in every table that holds it,
  // its refcount with it; `from` becomes free. The caller copies the records (Runner::shrink packs used
  // blocks below a lower limit with it; difference 3). Atomic: throws RunnerError(kState), nothing changed.
  void move_block(int from, int to);
  // Raises the limit towards target (at most num_blocks); returns the new limit.
  int grow(int target);
  // Throws RunnerError(kState) naming the first broken invariant.
  void check_invariants() const;

 private:
  struct Seq {
    bool live = false;
    std::vector<int32_t> blocks;
    int length = 0, reserved = 0;
  };
  int num_blocks_, block_size_, max_seqs_, limit_, num_compact_;
  int used_ = 0;               // default blocks in use
  std::vector<int> refcount_;  // default ids, then compact ids
  std::set<int> free_;  // free ids below limit_
  std::set<int> compact_free_;  // free compact ids (num_blocks_ ..)
  std::vector<Seq> seqs_;
  std::vector<int> free_slots_;  // stack, slot 0 popped first

  const Seq& get(int seq, const char* action) const;
  Seq& get(int seq, const char* action) { return const_cast<Seq&>(static_cast<const BlockManager*>(this)->get(seq, action)); }
  void decref(int block);
};

// Layers that share an attention type (the manifest's "groups" entry): window 0 = global, W > 0 = each
// query sees the last W positions, itself included. Each group has its own blocks and tables.
struct LayerGroup {
  int window = 0;
  std::vector<int> layers;
  int num_blocks = 0;
};

// Leading logical blocks no future query of a sliding group can see once `length` tokens are committed
// (the next query, at position >= length, sees keys > length - window only). 0 for a global group.
int dead_blocks(int window, int block_size, int length);
// Blocks one sequence of a sliding group holds at most while a call writes new_tokens.
int window_blocks_needed(int window, int block_size, int new_tokens);

// One BlockManager per layer group, driven together: the same sequence slots and lengths in every
// group, each group with its own blocks and free list. A sliding group returns a sequence's blocks to
// its pool as soon as they leave the window (after each commit). With one global group this is exactly
// a BlockManager (same ids, same tables). `limit` is group 0's usable block count (the budget).
class GroupedBlockManager {
 public:
  // num_compact_blocks: the compact region of group 0, which must then be a global group
  GroupedBlockManager(std::vector<LayerGroup> groups, int block_size, int max_seqs, int limit,
                      int num_compact_blocks = 0);

  size_t size() const { return groups_.size(); }
  const LayerGroup& group(size_t g) const { return groups_[g]; }
  const BlockManager& pool(size_t g) const { return pools_[g]; }
  BlockManager& pool(size_t g) { return pools_[g]; }
  BlockManager& main() { return pools_[0]; }
  const BlockManager& main() const { return pools_[0]; }
  int block_size() const { return block_size_; }

  int new_sequence();
  void release(int seq);
  int length(int seq) const { return pools_[0].length(seq); }
  std::vector<int> live_sequences() const { return pools_[0].live_sequences(); }
  // Free blocks reserve(seq, n) takes in each group. With chunk > 0: the most free blocks writing the n
  // tokens in calls of at most chunk tokens takes (a sliding group trims between calls).
  std::vector<int> blocks_needed(int seq, int n_new_tokens, int chunk = 0) const;
  // reserve in every group; atomic: throws RunnerError(kPoolExhausted) naming the group, nothing changed.
  void reserve(int seq, int n_new_tokens);
  // commit in every group, then return the blocks that left each sliding group's window (trim).
  void commit(int seq, int n_tokens);
  void trim(int seq);
  void check_invariants() const;

 private:
  std::vector<LayerGroup> groups_;
  std::vector<BlockManager> pools_;
  int block_size_;
};

}  // namespace pagedkv_rt
