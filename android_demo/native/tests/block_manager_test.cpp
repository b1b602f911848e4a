// Unit tests of the C++ block manager (mirrors tests/test_block_pool.py's core cases).
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "block_manager.h"
#include "errors.h"
#include "test_util.h"

using pagedkv_rt::BlockManager;
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
static int replay(const char* path, int num_blocks, int block_size, int max_seqs) {
  BlockManager p(num_blocks, block_size, max_seqs, num_blocks);
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
      } else {
        std::cerr << "bad trace line: " << line << "\n";
        return 2;
      }
    } catch (const RunnerError& e) {
      out = e.code() == ErrorCode::kPoolExhausted ? "exhausted" : "state error";
    }
    p.check_invariants();
    std::cout << out << " used " << p.num_used() << " free " << p.num_free() << "\n";
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "--trace")
    return replay(argv[2], std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]));
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
  s.run("bad_arguments", [] {
    CHECK(code_of([] { BlockManager(8, 24, 1, 8); }) == ErrorCode::kArgument);
    CHECK(code_of([] { BlockManager(8, 16, 1, 9); }) == ErrorCode::kArgument);
    CHECK(code_of([] { BlockManager(0, 16, 1, 1); }) == ErrorCode::kArgument);
  });
  return s.finish();
}
