// conversation_file_tool: the C++ side of the conversation file's cross-language tests
// (tests/test_save_restore.py) and its own checks.
//   conversation_file_tool dump FILE       parse FILE, print its fields as JSON (blocks as CRC-32 per layer)
//   conversation_file_tool copy IN OUT     parse IN, write it again with the C++ writer (atomic)
//   conversation_file_tool runner-check FILE  parse FILE and check it against a pool like the Android
//                                          runner's (FILE's own model, spec and groups, no compact region):
//                                          the checks Runner::restore makes before the pool changes
//   conversation_file_tool selftest        round trip, truncation, damage, version, atomic-write checks
// Errors: one line on stderr, exit 2.
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include <unistd.h>

#include "conversation_file.h"
#include "errors.h"
#include "test_util.h"

using namespace pagedkv_rt;

static std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += {d[p[i] >> 4], d[p[i] & 15]};
  return s;
}

template <class V>
static std::string list(const V& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

static std::string crcs(const std::vector<std::vector<uint8_t>>& arrays) {
  std::vector<uint32_t> c;
  for (const auto& a : arrays) c.push_back(crc32(a.data(), a.size()));
  return list(c);
}

static void dump(const ConversationFile& f) {
  std::printf("{\"model_sha256\": \"%s\", \"dims\": [%u, %u, %u, %u], \"spec\": [%u, %u, %u, %u, %u, %u, %u, %u, %u],\n",
              hex(f.model_sha256.data(), 32).c_str(), f.num_layers, f.num_kv_heads, f.head_dim, f.block_size,
              f.spec.k_bits, f.spec.v_bits, f.spec.k_group, f.spec.v_group, f.spec.k_sym, f.spec.v_sym, f.spec.rotate,
              f.spec.fp_tail, f.spec.sink_blocks);
  std::printf(" \"records\": [%u, %u, %u, %d], \"tokens\": %s, \"pending\": %s, \"app_hex\": \"%s\",\n",
              f.codes_itemsize, f.code_bytes, f.scale_bytes, f.has_stage ? 1 : 0, list(f.tokens).c_str(),
              list(f.pending).c_str(), hex(reinterpret_cast<const uint8_t*>(f.app.data()), f.app.size()).c_str());
  std::printf(" \"groups\": [");
  for (size_t g = 0; g < f.groups.size(); ++g)
    std::printf("%s{\"window\": %u, \"layers\": %s, \"present\": %s}", g ? ", " : "", f.groups[g].window,
                list(f.groups[g].layers).c_str(), list(f.groups[g].present).c_str());
  const ConvSpec& c = f.compact_spec;
  std::printf("],\n \"compact_spec\": [%u, %u, %u, %u, %u, %u, %u, %u, %u], \"compact_records\": [%u, %u],\n",
              c.k_bits, c.v_bits, c.k_group, c.v_group, c.k_sym, c.v_sym, c.rotate, c.fp_tail, c.sink_blocks,
              f.compact_code_bytes, f.compact_scale_bytes);
  std::printf(" \"codes_crc\": %s, \"scales_crc\": %s, \"stage_crc\": %s,\n", crcs(f.codes).c_str(),
              crcs(f.scales).c_str(), crcs(f.stage).c_str());
  std::printf(" \"compact_codes_crc\": %s, \"compact_scales_crc\": %s}\n", crcs(f.compact_codes).c_str(),
              crcs(f.compact_scales).c_str());
}

// The pool description the Android runner checks a file against (Runner::Impl::describe_pool): the
// file's own identity, no tokens or blocks, and no compact region (the runner on a .pte exported without one).
static ConversationFile runner_pool(const ConversationFile& f) {
  ConversationFile want;
  want.model_sha256 = f.model_sha256;
  want.num_layers = f.num_layers, want.num_kv_heads = f.num_kv_heads, want.head_dim = f.head_dim;
  want.block_size = f.block_size, want.spec = f.spec, want.codes_itemsize = f.codes_itemsize;
  want.code_bytes = f.code_bytes, want.scale_bytes = f.scale_bytes, want.has_stage = f.has_stage;
  for (const ConvGroup& g : f.groups) want.groups.push_back(ConvGroup{g.window, g.layers, {}, g.spec});
  return want;
}

// A small synthetic conversation: 2 layers in 2 groups (one sliding with a hole), 40 tokens.
static ConversationFile sample() {
  ConversationFile f;
  for (int i = 0; i < 32; ++i) f.model_sha256[i] = static_cast<uint8_t>(i * 7);
  f.num_layers = 2, f.num_kv_heads = 2, f.head_dim = 64, f.block_size = 16;
  f.spec = ConvSpec{8, 4, 64, 32, 1, 0, 1, 1, 1};
  f.codes_itemsize = 1, f.code_bytes = 96, f.scale_bytes = 10, f.has_stage = true;
  for (int i = 0; i < 40; ++i) f.tokens.push_back(3 + i);
  f.pending = {99};
  f.app = "{\"messages\": []}";
  f.groups = {ConvGroup{0, {1}, {1, 1, 1}, {}}, ConvGroup{24, {0}, {0, 1, 1}, {}}};
  f.codes.resize(2), f.scales.resize(2), f.stage.resize(2);
  for (uint32_t l = 0; l < 2; ++l) {
    const size_t np = l == 1 ? 3 : 2;
    for (size_t i = 0; i < np * f.block_record_bytes(96); ++i) f.codes[l].push_back(static_cast<uint8_t>(i * 31 + l));
    for (size_t i = 0; i < np * f.block_record_bytes(10); ++i) f.scales[l].push_back(static_cast<uint8_t>(i * 17 + l));
    for (size_t i = 0; i < f.stage_bytes(); ++i) f.stage[l].push_back(static_cast<uint8_t>(i * 13 + l));
  }
  return f;
}

// The sample with blocks 0 and 1 of its global group (layer 1) in the compact tier (K4/V3 g64).
static ConversationFile sample_compact() {
  ConversationFile f = sample();
  f.compact_spec = ConvSpec{4, 3, 64, 64, 1, 0, 1, 1, 1};
  f.compact_code_bytes = 56, f.compact_scale_bytes = 6;
  f.groups[0].present = {kBlockCompact, kBlockCompact, kBlockDefault};
  f.codes[1].resize(f.block_record_bytes(96));
  f.scales[1].resize(f.block_record_bytes(10));
  f.compact_codes.resize(2), f.compact_scales.resize(2);
  for (size_t i = 0; i < 2 * f.block_record_bytes(56); ++i) f.compact_codes[1].push_back(static_cast<uint8_t>(i * 5 + 1));
  for (size_t i = 0; i < 2 * f.block_record_bytes(6); ++i) f.compact_scales[1].push_back(static_cast<uint8_t>(i * 3 + 2));
  return f;
}

// bytes with a valid checksum again after an edit (to reach the checks after the checksum)
static std::vector<uint8_t> reseal(std::vector<uint8_t> b) {
  b.resize(b.size() - 4);
  const uint32_t c = crc32(b.data(), b.size());
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(c >> (8 * i)));
  return b;
}

static bool throws_with(const std::function<void()>& fn, const char* needle) {
  try {
    fn();
  } catch (const RunnerError& e) {
    if (std::strstr(e.what(), needle) && !std::strchr(e.what(), '\n')) return true;
    std::printf("    error was: %s\n", e.what());
    return false;
  }
  return false;
}

static int selftest() {
  t::Summary s;
  const ConversationFile f = sample();
  const std::vector<uint8_t> bytes = encode_conversation(f);
  s.run("round trip", [&] {
    ConversationFile g = parse_conversation(bytes.data(), bytes.size(), "mem");
    CHECK(encode_conversation(g) == bytes);
    CHECK(g.tokens == f.tokens && g.pending == f.pending && g.app == f.app && g.codes == f.codes);
    CHECK(g.groups[1].present == f.groups[1].present && g.stage == f.stage && g.spec == f.spec);
  });
  s.run("crc32 is zlib's", [] {
    const char* x = "123456789";
    CHECK_EQ(crc32(reinterpret_cast<const uint8_t*>(x), 9), 0xCBF43926u);
  });
  s.run("every truncation is an error", [&] {
    for (size_t n = 0; n < bytes.size(); n += 97)
      CHECK(throws_with([&] { parse_conversation(bytes.data(), n, "mem"); }, "conversation file mem"));
  });
  s.run("every flipped byte is an error", [&] {
    for (size_t i = 0; i < bytes.size(); i += 53) {
      std::vector<uint8_t> b = bytes;
      b[i] ^= 0x10;
      CHECK(throws_with([&] { parse_conversation(b.data(), b.size(), "mem"); }, "conversation file mem"));
    }
  });
  s.run("another version", [&] {
    std::vector<uint8_t> b = bytes;
    b[8] = 4;
    CHECK(throws_with([&] { parse_conversation(b.data(), b.size(), "mem"); }, "format version 4"));
  });
  // version 1: the same layout without the 11 compact fields after has_stage (byte 112), holes and
  // default blocks only; it reads as the version-2 file without compact blocks
  const size_t compact_at = 8 + 4 + 32 + 16 + 36 + 16, compact_len = 44;
  s.run("a version-1 file reads as version 2 without compact blocks", [&] {
    CHECK(std::vector<uint8_t>(bytes.begin() + compact_at, bytes.begin() + compact_at + compact_len) ==
          std::vector<uint8_t>(compact_len, 0));
    std::vector<uint8_t> v1(bytes.begin(), bytes.begin() + compact_at);
    v1.insert(v1.end(), bytes.begin() + compact_at + compact_len, bytes.end());
    v1[8] = 1;
    v1 = reseal(v1);
    ConversationFile g = parse_conversation(v1.data(), v1.size(), "mem");
    CHECK(encode_conversation(g) == bytes);
    CHECK(g.compact_spec.none() && g.n_compact() == 0);
  });
  const ConversationFile fc = sample_compact();
  const std::vector<uint8_t> cbytes = encode_conversation(fc);
  s.run("compact blocks round trip", [&] {
    ConversationFile g = parse_conversation(cbytes.data(), cbytes.size(), "mem");
    CHECK(encode_conversation(g) == cbytes);
    CHECK(g.compact_spec == fc.compact_spec && g.compact_codes == fc.compact_codes);
    CHECK(g.compact_scales == fc.compact_scales && g.codes == fc.codes && g.groups[0].present == fc.groups[0].present);
    CHECK_EQ(g.n_compact(), 2u);
    for (size_t n = 0; n < cbytes.size(); n += 89)
      CHECK(throws_with([&] { parse_conversation(cbytes.data(), n, "mem"); }, "conversation file mem"));
  });
  s.run("compact blocks where none can be", [&] {
    std::vector<uint8_t> b = cbytes;  // version 1 has no compact blocks
    b[8] = 1;
    CHECK(throws_with([&] { parse_conversation(b.data(), b.size(), "mem"); }, "checksum"));
    ConversationFile g = fc;
    g.groups[1].present = {kBlockHole, kBlockCompact, kBlockDefault};  // in a sliding group
    g.codes[0].resize(g.block_record_bytes(96)), g.scales[0].resize(g.block_record_bytes(10));
    g.compact_codes[0].resize(g.block_record_bytes(56)), g.compact_scales[0].resize(g.block_record_bytes(6));
    std::vector<uint8_t> e = encode_conversation(g);
    CHECK(throws_with([&] { parse_conversation(e.data(), e.size(), "mem"); }, "compact block where none"));
    g = fc;
    g.groups[0].present = {kBlockCompact, kBlockDefault, kBlockCompact};  // the partly filled last block
    e = encode_conversation(g);
    CHECK(throws_with([&] { parse_conversation(e.data(), e.size(), "mem"); }, "compact block where none"));
    e = cbytes;  // a compact spec in another rotation than the conversation's (same record sizes)
    e[compact_at + 24] = 0;
    e = reseal(e);
    CHECK(throws_with([&] { parse_conversation(e.data(), e.size(), "mem"); }, "invalid compact spec"));
    e = cbytes;  // compact record sizes the compact spec does not give
    e[compact_at + 36] = 57;
    e = reseal(e);
    CHECK(throws_with([&] { parse_conversation(e.data(), e.size(), "mem"); }, "compact record sizes"));
    e = bytes;  // a compact spec in a file without compact blocks
    e[compact_at] = 4, e[compact_at + 4] = 3;
    e = reseal(e);
    CHECK(throws_with([&] { parse_conversation(e.data(), e.size(), "mem"); }, "compact"));
  });
  s.run("the runner (no compact region) refuses compact blocks, reads the rest", [&] {
    check_conversation_compatible(f, runner_pool(f), "mem");
    CHECK(throws_with([&] { check_conversation_compatible(fc, runner_pool(fc), "mem"); },
                      "holds 2 block(s) in the compact tier"));
    ConversationFile want = runner_pool(fc);
    want.compact_spec = fc.compact_spec, want.compact_code_bytes = 56, want.compact_scale_bytes = 6;
    check_conversation_compatible(fc, want, "mem");
    want.compact_spec.v_bits = 2, want.compact_code_bytes = 48;
    CHECK(throws_with([&] { check_conversation_compatible(fc, want, "mem"); }, "compact blocks in spec"));
  });
  s.run("compatibility", [&] {
    ConversationFile want = f;
    check_conversation_compatible(f, want, "mem");
    want.model_sha256[0] ^= 1;
    CHECK(throws_with([&] { check_conversation_compatible(f, want, "mem"); }, "another model"));
    want = f;
    want.spec.v_bits = 5;
    CHECK(throws_with([&] { check_conversation_compatible(f, want, "mem"); }, "KV spec"));
    want = f;
    want.groups[1].window = 32;
    CHECK(throws_with([&] { check_conversation_compatible(f, want, "mem"); }, "layer groups"));
  });
  s.run("atomic write keeps the old file when it fails", [&] {
    const std::string path = "/tmp/pagedkv_conv_selftest_" + std::to_string(getpid()) + ".pkvc";
    CHECK_EQ(write_conversation_file(path, f), bytes.size());
    CHECK(read_conversation_file(path).tokens == f.tokens);
    ConversationFile broken = f;
    broken.codes[0].pop_back();  // inconsistent: refused before anything is written
    CHECK(throws_with([&] { write_conversation_file(path, broken); }, "cannot encode"));
    CHECK(read_conversation_file(path).codes == f.codes);
    CHECK(throws_with([&] { write_conversation_file("/nonexistent-dir/x.pkvc", f); }, "cannot write"));
    std::remove(path.c_str());
  });
  return s.finish();
}

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "dump" && argc == 3) {
      dump(read_conversation_file(argv[2]));
      return 0;
    }
    if (cmd == "copy" && argc == 4) {
      std::printf("%zu\n", write_conversation_file(argv[3], read_conversation_file(argv[2])));
      return 0;
    }
    if (cmd == "runner-check" && argc == 3) {
      const ConversationFile f = read_conversation_file(argv[2]);
      check_conversation_compatible(f, runner_pool(f), argv[2]);
      std::printf("ok\n");
      return 0;
    }
    if (cmd == "selftest") return selftest();
  } catch (const RunnerError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  std::fprintf(stderr, "usage: conversation_file_tool dump FILE | copy IN OUT | runner-check FILE | selftest\n");
  return 2;
}
