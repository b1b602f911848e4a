// Block tables, reference counts, the free list and sequence slots of the paged KV pool: the C++
// twin of toolkit/block_pool.py's BlockPool. tests/test_twins.py replays one recorded trace of pool
// operations through both and compares every result. The intended differences, all of them:
//   1. allocation order: here the lowest free id first (used blocks stay at the bottom of the pool,
//      so shrinking its free top part usually succeeds); in Python the block freed longest ago (an LRU
//      for its prefix cache). Block ids therefore differ; counts, slots and outcomes do not.
//   2. no prefix cache and no fork / copy-on-write here: the app runs one chat per conversation, so
//      every refcount is 0 or 1, and commit takes a token count (Python takes the token ids, for the
//      prefix cache's hashes).
//   3. the usable limit (C++ only): only blocks < limit() are handed out. shrink lowers it (blocks at
//      or above the new limit must be free; the runner then returns their pages to the OS when Android
//      asks the app to trim), grow raises it again up to the exported number of blocks.
//   4. no per-layer-group tables yet (Python: toolkit.block_pool.GroupedBlockPool for sliding-window
//      layers); the runner keeps one table for all layers.
#pragma once

#include <cstdint>
#include <set>
#include <vector>

namespace pagedkv_rt {

class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size, int max_seqs, int limit);

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int max_seqs() const { return max_seqs_; }
  int limit() const { return limit_; }
  int num_used() const { return used_; }
  int num_free() const { return static_cast<int>(free_.size()); }  // allocatable (below the limit)
  int highest_used() const;                                          // -1 if none

  int new_sequence();                  // throws RunnerError(kState) if all slots are in use
  void release(int seq);               // drops the sequence's blocks and frees its slot
  int blocks_needed(int seq, int n_new_tokens) const;
  void reserve(int seq, int n_new_tokens);  // atomic: throws RunnerError(kPoolExhausted), nothing changed
  void commit(int seq, int n_tokens);       // advance the length by tokens written
  int length(int seq) const;
  const std::vector<int32_t>& blocks(int seq) const;
  std::vector<int> live_sequences() const;

  // Lowers the limit towards target (never below highest_used()+1); returns the new limit.
  int shrink(int target);
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
  int num_blocks_, block_size_, max_seqs_, limit_;
  int used_ = 0;
  std::vector<int> refcount_;
  std::set<int> free_;  // free ids below limit_
  std::vector<Seq> seqs_;
  std::vector<int> free_slots_;  // stack, slot 0 popped first

  const Seq& get(int seq, const char* action) const;
  Seq& get(int seq, const char* action) { return const_cast<Seq&>(static_cast<const BlockManager*>(this)->get(seq, action)); }
  void decref(int block);
};

}  // namespace pagedkv_rt
