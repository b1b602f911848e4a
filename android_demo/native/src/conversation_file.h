// The pagedkv conversation file (format version 2, or 3 when a layer group stores its own spec; version 1
// is read too): a conversation's KV blocks
// as they lie in the pool (default and compact region), the fp16 stage rows of its sequence slot, its
// tokens and the identity a reader checks. The
// format is documented in toolkit/CONVERSATION_FORMAT.md; runtime_sim/conversation_file.py reads and
// writes the same bytes (tests/test_save_restore.py checks each side reads the other's files).
//
//   ConversationFile f = read_conversation_file(path);   // throws RunnerError(kArgument), one line
//   check_conversation_compatible(f, want, path);        // same model sha256, dims, spec, groups,
//                                                        // compact spec if f holds compact blocks
//   write_conversation_file(path, f);                    // atomic: temp file, fsync, rename
//
// Plain C++17, no ExecuTorch and no Android headers.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pagedkv_rt {

constexpr uint32_t kConversationFormatVersion = 2;  // written; versions 1, 2 and 3 are read
// written when a layer group stores its own spec (export --sliding-spec): each group carries it
constexpr uint32_t kConversationGroupSpecVersion = 3;
// ConvGroup::present values: a hole, a block of the default region, a block of the compact region (v2)
constexpr uint8_t kBlockHole = 0, kBlockDefault = 1, kBlockCompact = 2;

struct ConvSpec {  // KVQuantSpec's fields in the file's order (booleans 0/1)
  uint32_t k_bits = 0, v_bits = 0, k_group = 0, v_group = 0, k_sym = 0, v_sym = 0, rotate = 0, fp_tail = 0,
           sink_blocks = 0;
  bool operator==(const ConvSpec& o) const;
  bool none() const { return k_bits == 0; }  // the all-zero spec: no compact blocks / the file's spec
  std::string describe() const;
};

struct ConvGroup {
  uint32_t window = 0;             // 0 = global, W = sliding window
  std::vector<uint32_t> layers;    // the group's layers in the engine's order
  std::vector<uint8_t> present;    // per logical block: kBlockHole, kBlockDefault or kBlockCompact
  ConvSpec spec;                   // the group's own spec (version 3); all zero: the file's spec
  size_t n_present() const;        // default-region blocks (their records in codes/scales)
  size_t n_compact() const;        // compact-region blocks (their records in compact_codes/compact_scales)
};

struct ConversationFile {
  std::array<uint8_t, 32> model_sha256{};
  uint32_t num_layers = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;
  ConvSpec spec;
  uint32_t codes_itemsize = 1, code_bytes = 0, scale_bytes = 0;
  bool has_stage = false;
  std::vector<int32_t> tokens, pending;
  std::vector<ConvGroup> groups;
  std::string app;  // the application's own bytes (pagedkv chat: its messages as JSON)
  // the compact tier (v2): the compact blocks' spec and record sizes, all zero when the file holds none
  // (in a pool description: the pool's compact region, zero without one)
  ConvSpec compact_spec;
  uint32_t compact_code_bytes = 0, compact_scale_bytes = 0;
  // per layer: its group's default blocks in logical order, [n_present, Hkv, bs, code_bytes] and
  // [n_present, Hkv, bs, scale_bytes]; stage: [2, 2, Hkv, bs, head_dim] float16 (raw bytes)
  std::vector<std::vector<uint8_t>> codes, scales, stage;
  // per layer (empty for layers of groups without compact blocks): its compact blocks in logical order,
  // [n_compact, Hkv, bs, compact_code_bytes] and [n_compact, Hkv, bs, compact_scale_bytes]
  std::vector<std::vector<uint8_t>> compact_codes, compact_scales;

  size_t n_compact() const {
    size_t k = 0;
    for (const ConvGroup& g : groups) k += g.n_compact();
    return k;
  }

  // bytes of one record of a group's layers (codes, scales): its own spec's, else code_bytes/scale_bytes
  void group_record_bytes(const ConvGroup& g, uint32_t* codes, uint32_t* scales) const;
  bool has_group_specs() const {
    for (const ConvGroup& g : groups)
      if (!g.spec.none()) return true;
    return false;
  }

  size_t block_record_bytes(uint32_t width) const {  // one block of one layer
    return static_cast<size_t>(num_kv_heads) * block_size * width;
  }
  size_t stage_bytes() const { return 2u * 2u * num_kv_heads * block_size * head_dim * 2u; }
};

// CRC-32 (zlib's: reflected polynomial 0xEDB88320, init/final xor 0xFFFFFFFF); crc = the previous value.
uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc = 0);

// Parse and check (magic, version, checksum, bounds, exact length). `where` names the file in errors.
ConversationFile parse_conversation(const uint8_t* data, size_t n, const std::string& where);
ConversationFile read_conversation_file(const std::string& path);
// The file's bytes (checksum included); checks the arrays' sizes against the header first.
std::vector<uint8_t> encode_conversation(const ConversationFile& f);
// Atomic write; returns the size in bytes. Throws RunnerError(kArgument) naming the path on failure.
size_t write_conversation_file(const std::string& path, const ConversationFile& f);
// Why `group` cannot be the own spec that a manifest or a version-3 file stores for layer group `index`
// (sliding window `window`, 0 for a global group) beside the pool's spec `pool` (toolkit/kv_spec.py
// check_stored_group_spec: only a sliding group after the first has one; both quantized, `group` valid
// for head_dim, the same rotate, fp_tail and sink_blocks); "" if it can. The manifest's groups (the
// runner) and version-3 files both check with it.
std::string group_spec_problem(const ConvSpec& pool, const ConvSpec& group, uint32_t head_dim, size_t index,
                               uint32_t window);
// `want` describes the runner's pool (no tokens or blocks): throws RunnerError(kArgument) on any mismatch.
void check_conversation_compatible(const ConversationFile& f, const ConversationFile& want, const std::string& where);

}  // namespace pagedkv_rt
