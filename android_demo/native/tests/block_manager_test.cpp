// Unit tests of the C++ block manager (mirrors tests/test_block_pool.py's core cases).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "block_manager.h"
#include "errors.h"
#include "test_util.h"

using pagedkv_rt::BlockManager;
using pagedkv_rt::GroupedBlockManager;
using pagedkv_rt::LayerGroup;
using pagedkv_rt::ErrorCode;
using pagedkv_rt::RunnerError;

static ErrorCode code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const RunnerError& e) {
    return e.code();
  }
  return static_cast<ErrorCode>(0);
}

// block_manager_test --trace FILE NUM_BLOCKS BLOCK_SIZE MAX_SEQS: replays a trace of pool operations
// (one per line: "new", "reserve S N", "commit S N", "release S") and prints what the manager did,
// one line per operation, in the words tests/test_twins.py's Python twin uses. Block ids are left
// out: the two managers hand out blocks in a different order by design (see block_manager.h).
// With NUM_COMPACT (a 6th argument) the pool has a compact region: "compact S I" moves logical block I
// of S there ("compacted"), and each line ends with the free compact blocks (" cfree N").
static int replay(const char* path, int num_blocks, int block_size, int max_seqs, int num_compact = 0) {
  BlockManager p(num_blocks, block_size, max_seqs, num_blocks, num_compact);
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ops(line);
    std::string op;
    int seq = -1, n = 0;
    ops >> op >> seq >> n;
    std::string out;
    try {
      if (op == "new") {
        out = "seq " + std::to_string(p.new_sequence());
      } else if (op == "reserve") {
        p.reserve(seq, n);
        out = "ok blocks " + std::to_string(p.blocks(seq).size());
      } else if (op == "commit") {
        p.commit(seq, n);
        out = "len " + std::to_string(p.length(seq));
      } else if (op == "release") {
        p.release(seq);
        out = "released";
      } else if (op == "compact" && num_compact) {
        p.compact(seq, n);
        out = "compacted";
      } else {
        std::cerr << "bad trace line: " << line << "\n";
        return 2;
      }
    } catch (const RunnerError& e) {
      out = e.code() == ErrorCode::kPoolExhausted ? "exhausted" : "state error";
    }
    p.check_invariants();
    std::cout << out << " used " << p.num_used() << " free " << p.num_free();
    if (num_compact) std::cout << " cfree " << p.num_free_compact();
    std::cout << "\n";
  }
  return 0;
}

// block_manager_test --group-trace FILE BLOCK_SIZE MAX_SEQS WINDOW:NUM_BLOCKS...: the same trace through a
// GroupedBlockManager (one group per WINDOW:NUM_BLOCKS, window 0 = global); each line reports, per
// group, the blocks of the sequence's table, the holes in it, and the group's used and free counts.
static int replay_groups(const char* path, int block_size, int max_seqs, const std::vector<LayerGroup>& groups) {
  GroupedBlockManager p(groups, block_size, max_seqs, groups[0].num_blocks);
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ops(line);
    std::string op;
    int seq = -1, n = 0;
    ops >> op >> seq >> n;
    std::string out;
    try {
      if (op == "new") {
        out = "seq " + std::to_string(p.new_sequence());
      } else if (op == "reserve") {
        p.reserve(seq, n);
        out = "ok";
        for (size_t g = 0; g < p.size(); ++g)
          out += " blocks " + std::to_string(p.pool(g).blocks(seq).size()) + " holes " +
                 std::to_string(p.pool(g).blocks(seq).size() - static_cast<size_t>(p.pool(g).held(seq)));
      } else if (op == "commit") {
        p.commit(seq, n);
        out = "len " + std::to_string(p.length(seq));
        for (size_t g = 0; g < p.size(); ++g) out += " held " + std::to_string(p.pool(g).held(seq));
      } else if (op == "release") {
        p.release(seq);
        out = "released";
      } else {
        std::cerr << "bad trace line: " << line << "\n";
        return 2;
      }
    } catch (const RunnerError& e) {
      out = e.code() == ErrorCode::kPoolExhausted ? "exhausted" : "state error";
    }
    p.check_invariants();
    std::cout << out;
    for (size_t g = 0; g < p.size(); ++g)
      std::cout << " | used " << p.pool(g).num_used() << " free " << p.pool(g).num_free();
    std::cout << "\n";
  }
  return 0;
}

int main(int argc, char** argv) {
  if ((argc == 6 || argc == 7) && std::string(argv[1]) == "--trace")
    return replay(argv[2], std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), argc == 7 ? std::atoi(argv[6]) : 0);
  if (argc >= 6 && std::string(argv[1]) == "--group-trace") {
    std::vector<LayerGroup> groups;
    for (int i = 5; i < argc; ++i) {
      LayerGroup g;
      if (std::sscanf(argv[i], "%d:%d", &g.window, &g.num_blocks) != 2) return 2;
      g.layers = {i - 5};
      groups.push_back(g);
    }
    return replay_groups(argv[2], std::atoi(argv[3]), std::atoi(argv[4]), groups);
  }
  t::Summary s;
  s.run("reserve_commit_release", [] {
    BlockManager p(8, 16, 2, 8);
    int a = p.new_sequence();
    CHECK_EQ(a, 0);
    p.reserve(a, 20);
    CHECK_EQ(p.num_used(), 2);
    CHECK_EQ(p.blocks(a)[0], 0);
    CHECK_EQ(p.blocks(a)[1], 1);
    p.commit(a, 20);
    CHECK_EQ(p.length(a), 20);
    p.reserve(a, 12);  // fits in block 1
    CHECK_EQ(p.num_used(), 2);
    p.commit(a, 12);
    p.reserve(a, 1);
    CHECK_EQ(p.num_used(), 3);
    p.check_invariants();
    p.release(a);
    CHECK_EQ(p.num_used(), 0);
    CHECK_EQ(p.num_free(), 8);
    p.check_invariants();
  });
  s.run("exhaustion_is_atomic", [] {
    BlockManager p(4, 16, 2, 4);
    int a = p.new_sequence();
    p.reserve(a, 48);
    p.commit(a, 48);
    CHECK(code_of([&] { p.reserve(a, 40); }) == ErrorCode::kPoolExhausted);
    CHECK_EQ(p.num_used(), 3);
    CHECK_EQ(p.length(a), 48);
    p.check_invariants();
  });
  s.run("slots_and_double_release", [] {
    BlockManager p(4, 16, 2, 4);
    int a = p.new_sequence(), b = p.new_sequence();
    CHECK_EQ(b, 1);
    CHECK(code_of([&] { p.new_sequence(); }) == ErrorCode::kState);
    p.release(a);
    CHECK(code_of([&] { p.release(a); }) == ErrorCode::kState);
    CHECK(code_of([&] { p.reserve(7, 1); }) == ErrorCode::kState);
    CHECK_EQ(p.new_sequence(), 0);
    p.check_invariants();
  });
  s.run("lowest_ids_first_and_reuse", [] {
    BlockManager p(8, 16, 2, 8);
    int a = p.new_sequence(), b = p.new_sequence();
    p.reserve(a, 32);
    p.reserve(b, 16);
    CHECK_EQ(p.blocks(b)[0], 2);
    p.release(a);
    int c = p.new_sequence();
    p.reserve(c, 16);
    CHECK_EQ(p.blocks(c)[0], 0);
    p.check_invariants();
  });
  s.run("shrink_and_grow", [] {
    BlockManager p(16, 16, 2, 16);
    int a = p.new_sequence();
    p.reserve(a, 16 * 5);  // blocks 0..4
    CHECK_EQ(p.shrink(2), 5);  // blocks 0..4 used: the limit stops above them
    CHECK_EQ(p.num_free(), 0);
    CHECK(code_of([&] { p.reserve(a, 16 * 6); }) == ErrorCode::kPoolExhausted);
    p.release(a);
    CHECK_EQ(p.num_free(), 5);
    CHECK_EQ(p.shrink(3), 3);
    CHECK_EQ(p.num_free(), 3);
    p.check_invariants();
    CHECK_EQ(p.grow(10), 10);
    CHECK_EQ(p.num_free(), 10);
    CHECK_EQ(p.grow(99), 16);
    p.check_invariants();
  });
  s.run("sliding_group_returns_blocks_as_they_leave_the_window", [] {
    // toolkit/block_pool.py's test_sliding_group_returns_blocks_as_they_leave_the_window, token by token
    GroupedBlockManager p({LayerGroup{0, {1}, 20}, LayerGroup{24, {0}, 4}}, 16, 2, 20);
    int a = p.new_sequence();
    for (int i = 0; i < 200; ++i) {
      p.reserve(a, 1);
      p.commit(a, 1);
      p.check_invariants();
      CHECK(p.pool(1).held(a) <= pagedkv_rt::window_blocks_needed(24, 16, 1));
    }
    const auto& t = p.pool(1).blocks(a);
    CHECK_EQ(static_cast<int>(t.size()), 13);
    for (int i = 0; i < 11; ++i) CHECK_EQ(t[static_cast<size_t>(i)], -1);  // the next query (200) sees 177..200
    CHECK(t[11] >= 0 && t[12] >= 0);
    CHECK_EQ(p.pool(0).num_free(), 20 - 13);
    CHECK_EQ(p.pool(1).num_free(), 4 - 2);
    CHECK_EQ(p.pool(0).held(a), 13);
    // a call of 16 tokens needs at most window_blocks_needed(24, 16, 16) = 4 blocks of the sliding group
    CHECK_EQ(p.blocks_needed(a, 64, 16)[1], 4 - 2);
    CHECK_EQ(p.blocks_needed(a, 64)[1], 4);
    p.release(a);
    CHECK_EQ(p.pool(0).num_free(), 20);
    CHECK_EQ(p.pool(1).num_free(), 4);
    p.check_invariants();
  });
  s.run("grouped_reserve_is_atomic_across_groups", [] {
    GroupedBlockManager p({LayerGroup{0, {1}, 20}, LayerGroup{24, {0}, 2}}, 16, 2, 20);
    int a = p.new_sequence();
    CHECK(code_of([&] { p.reserve(a, 48); }) == ErrorCode::kPoolExhausted);  // 3 blocks, the sliding group has 2
    CHECK_EQ(p.pool(0).num_used(), 0);
    CHECK_EQ(p.pool(1).num_used(), 0);
    p.check_invariants();
    CHECK(code_of([&] { p.pool(1).drop_blocks(a, {0}); }) == ErrorCode::kState);  // nothing committed yet
  });
  s.run("one_global_group_is_exactly_a_block_manager", [] {
    GroupedBlockManager g({LayerGroup{0, {0, 1}, 8}}, 16, 2, 6);
    BlockManager p(8, 16, 2, 6);
    int a = g.new_sequence(), b = p.new_sequence();
    CHECK_EQ(a, b);
    g.reserve(a, 70);
    p.reserve(b, 70);
    g.commit(a, 70);
    p.commit(b, 70);
    CHECK(g.pool(0).blocks(a) == p.blocks(b));
    CHECK_EQ(g.main().num_free(), p.num_free());
    CHECK(code_of([&] { g.reserve(a, 40); }) == ErrorCode::kPoolExhausted);
  });
  s.run("compact_region", [] {  // BlockPool.compact's rules (tests/test_compact_tier.py)
    BlockManager p(6, 16, 2, 6, 2);
    const int a = p.new_sequence();
    p.reserve(a, 40);  // 3 blocks, 2 full after the commit
    p.commit(a, 40);
    CHECK(code_of([&] { p.compact(a, 2); }) == ErrorCode::kState);   // not full
    CHECK(code_of([&] { p.compact(a, -1); }) == ErrorCode::kState);
    const auto moved = p.compact(a, 0);
    CHECK_EQ(moved.first, 0);
    CHECK_EQ(moved.second, 6);  // the lowest compact id
    CHECK_EQ(p.blocks(a)[0], 6);
    CHECK(p.is_compact(p.blocks(a)[0]));
    CHECK_EQ(p.num_used(), 2);  // the default block went back to the free list
    CHECK_EQ(p.num_free(), 4);
    CHECK_EQ(p.num_free_compact(), 1);
    CHECK(code_of([&] { p.compact(a, 0); }) == ErrorCode::kState);  // compact already
    p.check_invariants();
    p.compact(a, 1);
    CHECK_EQ(p.num_free_compact(), 0);
    const int b = p.new_sequence();
    p.reserve(b, 16);
    p.commit(b, 16);
    CHECK(code_of([&] { p.compact(b, 0); }) == ErrorCode::kPoolExhausted);  // region full, nothing changed
    CHECK_EQ(p.blocks(b)[0], 0);
    p.drop_blocks(a, {0});  // a compact block can be dropped like any other: it returns to its free list
    CHECK_EQ(p.num_free_compact(), 1);
    p.check_invariants();
    p.release(a);
    CHECK_EQ(p.num_free_compact(), 2);
    CHECK_EQ(p.num_used(), 1);
    CHECK_EQ(p.shrink(1), 1);  // the limit is the default region's only
    p.check_invariants();
    CHECK(code_of([] { GroupedBlockManager({LayerGroup{16, {0}, 4}}, 16, 1, 4, 2); }) == ErrorCode::kArgument);
    GroupedBlockManager g({LayerGroup{0, {0}, 4}, LayerGroup{16, {1}, 3}}, 16, 1, 4, 2);
    CHECK_EQ(g.pool(0).num_compact_blocks(), 2);
    CHECK_EQ(g.pool(1).num_compact_blocks(), 0);
  });
  s.run("bad_arguments", [] {
    CHECK(code_of([] { BlockManager(8, 24, 1, 8); }) == ErrorCode::kArgument);
    CHECK(code_of([] { BlockManager(8, 16, 1, 9); }) == ErrorCode::kArgument);
    CHECK(code_of([] { BlockManager(0, 16, 1, 1); }) == ErrorCode::kArgument);
  });
  return s.finish();
}
