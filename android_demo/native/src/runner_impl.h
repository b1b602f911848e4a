// The runner's private parts, shared by its source files (not installed, not included by users of
// runner.h): struct Runner::Impl, its data and the declarations of its members, grouped by the file that
// defines them:
//   runner.cpp          loading the artifacts, one graph call, generate / chat, stats
//   runner_save.cpp     conversation files: save, restore (and the spill rung's capture / restore)
//   runner_compact.cpp  the compact tier: aged blocks re-quantized into the compact region
//   runner_ladder.cpp   the pressure ladder's rungs (compact, spill / restore from spill, slide)
//   runner_trim.cpp     the pool's committed pages: shrink (onTrimMemory) and grow
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/core/hierarchical_allocator.h>

#include "block_manager.h"
#include "chat_template.h"
#include "conversation_file.h"
#include "json.h"
#include "mapped_pages.h"
#include "runner.h"

namespace pagedkv_rt {

namespace et = executorch::runtime;
using executorch::aten::ScalarType;
using executorch::extension::Module;

inline size_t page_size() {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<size_t>(p) : 4096;
}

// One memory-planned arena of the program, mapped by us (anonymous, private, page aligned).
struct Arena {
  uint8_t* ptr = nullptr;
  size_t size = 0;
  ~Arena() {
    if (ptr) munmap(ptr, size);
  }
};

struct Runner::Impl {
  RunnerConfig cfg;
  // manifest
  int num_layers = 0, kv_heads = 0, head_dim = 0, block_size = 0, num_blocks = 0, max_seqs = 0;
  int layers_per_arena = 1, max_tokens_per_call = 0, max_blocks_per_seq = 0, vocab_size = 0;
  int64_t bytes_per_token = 0, stage_bytes_per_seq = 0, codes_bytes_per_layer = 0;
  int64_t pool_fixed_bytes = 0;  // pool bytes that do not depend on the block count (stage rows, placeholders)
  // what a conversation file must match (toolkit/CONVERSATION_FORMAT.md): the .pte's sha256, the spec,
  // the record sizes; sha_known is false for a manifest without the .pte's sha256 (save/restore refuse)
  std::array<uint8_t, 32> model_sha{};
  bool sha_known = false;
  ConvSpec conv_spec;
  uint32_t codes_itemsize = 1, code_bytes = 0, scale_bytes = 0;
  // per layer group, its layers' record bytes: the pool's (code_bytes, scale_bytes) unless the group
  // stores its own spec (manifest "groups"[g].spec, format_version 2; toolkit.block_pool.group_layout)
  struct GroupRecord {
    uint32_t code_bytes = 0, scale_bytes = 0;
    ConvSpec spec;  // the group's own spec (all zero without one), as a conversation file stores it
  };
  std::vector<GroupRecord> group_rec;
  bool has_group_specs() const {
    for (const GroupRecord& r : group_rec)
      if (!r.spec.none()) return true;
    return false;
  }
  bool has_stage = false;
  bool has_logits_rows = false;  // the program's last input selects the rows of the logits
  int manifest_logits_rows = -1;  // the manifest's .pte inputs end with logits_rows (1), do not (0), unlisted (-1)
  bool ran_step = false;  // this runner's program has run: the kernels' pool views can be its own
  std::vector<size_t> codes_offset;  // per layer (per-layer arenas): its codes tensor's offset in its arena, as the
                                     // memory plan put it (learned from the pool views at the first step; empty before)
  // the compact region (the compact tier, issue 25): the manifest's pool.compact / num_compact_blocks /
  // compact_*_shape, and the .pte's compact_codes_L / compact_scales_L inputs of the global group's layers
  // (after the block tables, before logits_rows, in the order the manifest's input names give). The
  // program reads them in place (inputs it does not memory-plan): this runner's memory, one mapping
  // allocated and zeroed at startup, passed in every call. The block manager's compact region (ids from
  // num_blocks) names its blocks; compact_aged fills them (requantize_records), save/restore carry them.
  struct CompactInput {
    int layer = 0;
    bool scales = false;        // compact_scales_L (float16) or compact_codes_L (uint8)
    std::vector<int64_t> shape;  // [num_compact_blocks, kv_heads, block_size, width]
    size_t offset = 0, bytes = 0;  // in compact_mem
  };
  int num_compact_blocks = 0;
  int compact_code_width = 0, compact_scale_width = 0;  // uint8 codes, float16 scales per record
  std::vector<CompactInput> compact_inputs;
  std::unique_ptr<Arena> compact_mem;
  std::vector<executorch::extension::TensorPtr> compact_tensors;  // views of compact_mem, input order
  ConvSpec compact_conv_spec;         // the manifest's compact spec (a conversation file's compact_spec)
  RecordBits spec_bits, compact_bits;  // what re-quantization reads and writes
  std::vector<std::pair<int, int>> compact_of_layer;  // layer -> its (codes, scales) in compact_inputs; -1: none
  // memory
  std::vector<std::unique_ptr<Arena>> arenas;  // index i = memory id i + 1 (0: activations)
  std::vector<et::Span<uint8_t>> spans;
  std::unique_ptr<et::HierarchicalAllocator> planned;
  std::unique_ptr<Module> module;
  std::unique_ptr<MappedPages> mapped;  // the .pte's mapped pages, unmapped before each call (mapped_pages.h)
  // layer groups (the manifest's "groups" entry; without it one global group of every layer): one block
  // table per group, passed as block_tables, block_tables_1, ... (the .pte's input order)
  std::vector<LayerGroup> groups;
  std::vector<int> layer_group;  // layer -> its group
  bool grouped = false;          // the manifest has a groups entry (stats report each group)
  std::vector<int> peak_used;    // per group: the most blocks in use at once
  std::unique_ptr<GroupedBlockManager> pool;
  int budget_limit = 0;  // usable blocks the budget allows (grow never goes above)
  // conversations
  struct Conv {
    int seq;  // kSpilled while its cache lies in a spill file
    std::vector<int32_t> history, pending;
    std::vector<std::pair<std::string, std::string>> messages;  // (role, content) for the chat template
    int64_t last_used = 0;  // the clock of the last step that touched it (the ladder's least recently used)
    std::string spill;      // adaptive: its spill file ("" = resident)
  };
  static constexpr int kSpilled = -1;
  int64_t clock = 0;  // one tick per step (runtime_sim's Engine.clock)
  LadderStats ladder;  // the pressure ladder's counters
  std::map<int, Conv> convs;
  int next_conv = 0;
  // counters
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_s = 0, decode_s = 0;
  std::mutex mu;                // the runner (generate/clear/shrink)
  mutable std::mutex stats_mu;  // the snapshot
  PoolStats snapshot;
  // stop ids and the chat template (manifest, tokenizer files)
  std::vector<int32_t> eos;
  std::string pte_file;
  std::string chat_template_src;  // "" = none
  std::vector<std::string> tokenizer_files;
  std::unique_ptr<ChatTemplate> chat_template;
  std::map<std::string, TValue> template_vars;  // bos_token, eos_token, ...

  int64_t block_bytes_layer() const { return codes_bytes_per_layer / num_blocks; }
  bool per_layer_arenas() const { return layers_per_arena == 1; }
  // codes bytes of one layer: its group's block count (a sliding group's pool is smaller)
  // and record width (a group with its own spec, format_version 2)
  int64_t codes_bytes_of_layer(int layer) const {
    const size_t g = static_cast<size_t>(layer_group[static_cast<size_t>(layer)]);
    return static_cast<int64_t>(kv_heads) * block_size * group_rec[g].code_bytes * groups[g].num_blocks;
  }
  // pool bytes of one block of group g's layers (its records' codes and scales in every KV head)
  int64_t group_block_bytes(size_t g) const {
    return static_cast<int64_t>(kv_heads) * (group_rec[g].code_bytes + group_rec[g].scale_bytes) *
           static_cast<int64_t>(groups[g].layers.size()) * block_size;
  }
  // the pool bytes a budget must hold whatever group 0's block count: the fixed part and the other
  // groups' blocks (they are always all usable)
  int64_t budget_fixed_bytes() const {
    int64_t b = pool_fixed_bytes;
    for (size_t g = 1; g < groups.size(); ++g) b += group_block_bytes(g) * groups[g].num_blocks;
    return b;
  }
  // The usable blocks a byte budget allows: the most blocks whose whole pool fits, at most the exported
  // num_blocks, at least kMinPoolBlocks. The twin of toolkit.pool_layout.blocks_for_budget / budget_blocks
  // (same formula from the manifest's pool fields, same minimum; tests/test_runner_cli.py compares them).
  static constexpr int kMinPoolBlocks = 2;  // toolkit.pool_layout.MIN_POOL_BLOCKS
  static constexpr int64_t kMaxCompactBlocks = 1 << 24;  // export.artifacts.MAX_POOL_TOKENS (PoolRequest.check)
  // Where each layer's pool tensors are: codes, scales, stage (the kernel library's record of its last
  // call, checked to lie inside this runner's own arenas with the sizes the manifest implies).
  struct LayerPool {
    uint8_t* codes = nullptr;
    uint8_t* scales = nullptr;
    uint8_t* stage = nullptr;
  };
  // Layer l's compact codes (or scales) tensor in the compact region.
  uint8_t* compact_region(int l, bool scales) const {
    const auto& io = compact_of_layer[static_cast<size_t>(l)];
    return compact_mem->ptr + compact_inputs[static_cast<size_t>(scales ? io.second : io.first)].offset;
  }
  bool listed(const std::string& name) const {
    return std::find(tokenizer_files.begin(), tokenizer_files.end(), name) != tokenizer_files.end();
  }
  bool adaptive() const { return cfg.policy == "adaptive"; }
  bool can_spill() const { return adaptive() && !cfg.spill_dir.empty(); }
  int slide_sink() const { return cfg.sink_blocks > 0 ? cfg.sink_blocks : std::max(1, static_cast<int>(conv_spec.sink_blocks)); }

  // runner.cpp: loading the artifacts, one graph call, the stats snapshot
  int budget_blocks(int64_t budget_bytes) const;
  void load_manifest(const std::string& dir);
  void load_record_format(const Json& pool, int64_t elem);
  void load_compact(const Json& pool, const std::string& dir);
  bool parse_sha256(const std::string& hex);
  void load_groups(const Json& m, const Json& pte, const std::string& dir);
  GroupRecord group_record(const Json& spec, size_t g, const std::function<RunnerError(const std::string&)>& bad) const;
  void load_compact_inputs(const std::vector<std::string>& names, const std::string& dir);
  void allocate_compact(size_t alloc_index);
  void load_chat_template(const std::string& dir);
  void allocate_and_load(const std::string& dir);
  void check_pool_identity(const std::string& pte) const;
  Json manifest;  // pagedkv.json as read (the .pte's pool identity is compared with it)
  bool pool_views(std::vector<LayerPool>* out) const;
  std::vector<LayerPool> ensure_pool_views();
  std::string render(const std::vector<std::pair<std::string, std::string>>& messages) const;
  std::vector<float> step(Conv& c, const std::vector<int32_t>& toks);
  Conv& conv(int id);
  void refresh_stats();

  // runner_save.cpp: a conversation's blocks to and from a conversation file (save, restore, the spill rung);
  // the caller holds mu
  ConversationFile describe_pool() const;
  ConversationFile capture(Conv& c);
  std::vector<int> blocks_to_restore(const ConversationFile& f) const;
  int restore_seq(const ConversationFile& f, const std::string& path);

  // runner_compact.cpp: the compact tier (runtime_sim/compact.py)
  void requantize_block(const std::vector<LayerPool>& views, int src, int dst);
  std::vector<int> aged_blocks(int seq, int horizon) const;
  std::vector<std::tuple<int, int, int>> compact_aged(Conv& c, int horizon, int limit = 0);

  // runner_ladder.cpp: the pressure ladder's rungs (runtime_sim Engine._make_room)
  bool compact_one(Conv* active, int limit);
  bool slide_one(Conv& a);
  std::string spill_path(int id) const;
  bool spill_one(const Conv* protect, const std::vector<int>* short_groups, bool compact_short);
  void make_slot(const Conv* protect);
  void room_for_file(const ConversationFile& f, const Conv* protect);
  void drop_spill(Conv& c);
  Conv& reprefill_spilled(Conv& c);
  Conv& resident(int id);
  RunnerError exhausted(size_t g, int need, int free, size_t n_tokens, const char* what) const;
  void make_room(Conv& a, int n_new, int chunk, bool slide, const char* what);

  // runner_trim.cpp: the pool's committed pages (budget, shrink and its block moves, grow)
  int64_t committed_bytes() const;
  int64_t touch_blocks(int lo, int hi, bool commit);
  int pack_below(int target);
};

}  // namespace pagedkv_rt
