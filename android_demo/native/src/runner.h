// pagedkv native runner: runs an exported artifacts dir (model.pte + pagedkv.json + tokenizer.json)
// with ExecuTorch's Module and the pagedkv kernels, on a KV block pool that it preallocates itself.
//
//   Runner r(RunnerConfig{"/data/.../files/model", 64 << 20});   // 64 MiB pool budget
//   int c = r.new_conversation();
//   r.generate(c, r.tokenizer().encode("Hello"), 32, Sampling{}, [](int32_t id, const std::string& s) {
//       std::cout << s; return true; });
//   r.clear(c);                       // its blocks go back to the pool at once
//   r.shrink(r.stats().used_blocks);  // onTrimMemory: drop the free part's pages
//   r.save(c, files + "/chat.pkvc");  // onStop; on the next start: c = r.restore(files + "/chat.pkvc")
//   r.compact(c, 1024);               // onTrimMemory, on a .pte with a compact region: aged blocks re-quantized
//
// Under memory pressure RunnerConfig::policy "adaptive" runs runtime_sim's ladder (compact aged blocks of idle
// conversations, then of the active one; spill idle conversations to spill_dir; slide), counted in
// stats().ladder; tests/test_runner_ladder.py drives the runner and runtime_sim's engine side by side.
//
// Plain C++17, no Android headers. Thread safety: one thread generates at a time (generate/clear/
// shrink take the runner's lock); stats() and cancel() may be called from any thread at any time.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "block_manager.h"
#include "errors.h"
#include "tokenizer.h"

namespace pagedkv_rt {

struct RunnerConfig {
  std::string artifacts_dir;
  int64_t pool_budget_bytes = 0;  // bytes for the whole KV pool (blocks + PoolStats::pool_fixed_bytes), all
                                  // layers; 0 = every block the .pte holds
  bool prefault = true;           // touch the committed pages at startup so the memory is really there
  int num_threads = 0;            // threads of ExecuTorch's threadpool, which runs the linears (XNNPACK)
                                  // and the attention kernel (0 = its default: one per core)
  std::string isa;                // "" = best available; "scalar", "neon", "neon-dotprod", "avx2" to force
  int prefill_chunk = 0;          // tokens per prefill call (0 = the .pte's max_tokens_per_call)
  int fail_allocation_at = -1;    // tests: make the allocation of this arena fail
  // What happens when a call needs blocks that are not free (runtime_sim's Engine policies, same rungs in
  // the same order): "error" = RunnerError(kPoolExhausted), nothing changed; "sliding" = the active
  // conversation drops its oldest default block after the first sink_blocks (its K/V lost, positions kept);
  // "adaptive" = the ladder: compact aged blocks (those ending >= compact_horizon tokens back) of idle
  // conversations, least recently used first, then of the active one (needs a .pte with a compact region),
  // then spill idle conversations to spill_dir (restored without prefill on their next use), then slide;
  // "auto" = adaptive for a .pte with a compact region, else error.
  std::string policy = "error";
  int compact_horizon = 1024;     // adaptive: recent tokens a conversation keeps in the default region
  int sink_blocks = 0;            // sliding / adaptive: leading blocks never dropped (0 = max(1, the spec's sink_blocks))
  std::string spill_dir;          // adaptive: where idle conversations are spilled ("" = no spill rung); the
                                  // runner deletes its spill files when they are restored, cleared, closed, or it goes
};

// The pressure ladder's rungs, each counted when taken (runtime_sim Engine.stats()["ladder"], same names).
struct LadderStats {
  std::string policy = "error";
  int64_t slides = 0;             // one old block of the active conversation dropped (its K/V lost)
  int64_t spills = 0;             // an idle conversation written to its spill file, its blocks freed
  int64_t spill_bytes = 0;        // bytes written by those spills
  int64_t spill_failures = 0;     // a spill file could not be written (the next rung was taken)
  int64_t restores_from_spill = 0;  // a spilled conversation mapped back without prefill
  int64_t spill_reprefills = 0;   // a spill file was unreadable (or its compact blocks found no room); prefilled again
  int spilled_now = 0;            // conversations whose cache lies in a spill file now
  // compactions / compacted_blocks count the compact rung only, not a direct Runner::compact (the app's
  // trim): these are the rungs the policy took, named and counted as runtime_sim's Engine counts them
  // (its direct runtime_sim.compact.compact_aged is not counted either), and tests/test_runner_ladder.py
  // compares them one for one after scripts that mix both. Runner::compact returns the blocks it moved;
  // compact_blocks_in_use counts every compact block held, however it got there.
  int64_t compactions = 0;        // one conversation's aged blocks re-quantized into the compact region
  int64_t compacted_blocks = 0;   // blocks those compactions moved (each freed one default block)
  int compact_blocks_in_use = 0;  // compact blocks held now
};

struct Sampling {
  float temperature = 0.f;  // 0 = greedy
  int top_k = 0;
  float top_p = 1.f;
  uint64_t seed = 0;
  bool ignore_stop = false;  // benchmarks: keep generating past stop tokens (a fixed number of steps)
};

// One layer group's blocks (the manifest's "groups" entry: global layers, sliding-window layers).
struct GroupStats {
  int window = 0;            // 0 = global, W = sliding window of W positions
  int layers = 0;            // layers in the group
  int total_blocks = 0;      // blocks of the group's pool (each of its layers holds that many)
  int usable_blocks = 0;     // below the limit (only group 0 has one below total_blocks)
  int used_blocks = 0;
  int free_blocks = 0;
  int peak_used_blocks = 0;  // the most blocks in use at once since the runner started
  int64_t bytes_per_block = 0;  // the group's layers
};

struct PoolStats {
  // total/usable/used/free: group 0 (for a model without sliding layers, the one pool of every layer)
  int total_blocks = 0;      // blocks in the exported pool
  int usable_blocks = 0;     // blocks below the current limit (budget / shrink)
  int used_blocks = 0;
  int free_blocks = 0;       // usable and free
  int block_size = 0;
  int sequences = 0;         // live conversations
  int64_t kv_bytes_in_use = 0;
  int64_t bytes_per_block = 0;   // all layers (one block of every layer)
  int64_t pool_fixed_bytes = 0;  // pool bytes that do not depend on the block count (PoolLayout.fixed_bytes)
  int64_t committed_bytes = 0;   // arena bytes currently backed (after prefault / release)
  int64_t reserved_bytes = 0;    // arena bytes mapped (address space)
  int64_t largest_allocation_bytes = 0;
  int num_allocations = 0;
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_tok_s = 0, decode_tok_s = 0;
  std::string isa;
  int threads = 0;  // ExecuTorch's threadpool (linears and attention kernel)
  std::vector<GroupStats> groups;  // per layer group; empty for a model without sliding layers
  // the compact region (a .pte exported with --compact-blocks N; issue 25): blocks of it and its bytes,
  // all its layers (allocated once at startup, counted in reserved/committed bytes and in
  // pool_fixed_bytes); 0 without one. ladder.compact_blocks_in_use: the ones conversations hold.
  int compact_blocks = 0;
  int64_t compact_bytes = 0;
  LadderStats ladder;
};

// Resident bytes of the runner's own mappings now (mincore), for a whole-process breakdown.
struct MemoryUse {
  int64_t activations_resident = 0, activations_reserved = 0;  // arena 1: planned activations
  int64_t pool_resident = 0, pool_reserved = 0;                // the KV pool arenas
  std::string program_path;  // the .pte, mapped (ExecuTorch Module LoadMode::Mmap): its resident pages
                             // are the weights read straight from the file
};

struct ShrinkResult {
  int requested_blocks = 0;   // the target usable count asked for
  int usable_before = 0, usable_after = 0;
  int moved_blocks = 0;       // used blocks moved from at or above the target into free blocks below it
  int blocked_by_used = 0;    // used blocks still at or above the target after the moves (more blocks are in
                              // use than the target): they kept the limit higher
  int64_t released_bytes = 0; // pages returned to the OS (madvise)
};

// Called for each generated token with the text it completes (whole UTF-8 characters). Return
// false to stop generating. When generation ends early (cancel(), false returned) with a partial UTF-8
// character pending, one last call repeats the last token id with that tail (as U+FFFD); its return
// value is ignored. At a stop token or the token cap the tail comes with the last token.
using TokenCallback = std::function<bool(int32_t token, const std::string& text)>;

// The record fields of a KV spec (KVQuantSpec's bits, groups and sym; group 0 = head_dim): what
// re-quantization reads and writes.
struct RecordBits {
  int k_bits = 8, v_bits = 4, k_group = 0, v_group = 0;
  bool k_sym = true, v_sym = false;
};
// Re-quantizes n records (one block of one layer: kv_heads * block_size records) from spec src to spec
// dst, the compact tier's conversion: each record's K and V dequantized from the stored codes, then
// quantized with dst's rule (pagedkv_core's dequantize_record / quantize_record). Bit for bit
// toolkit.quant.requantize (tests/test_runner_compact.py). Records: codes [n, code width] uint8,
// scales [n, scale width] float16 bits, widths as toolkit/POOL_FORMAT.md ("One record").
void requantize_records(const uint8_t* codes, const uint16_t* scales, size_t n, const RecordBits& src,
                        const RecordBits& dst, int head_dim, uint8_t* out_codes, uint16_t* out_scales);
// One spec's record widths at head_dim: code bytes and float16 scales per record.
void record_widths(const RecordBits& b, int head_dim, int* code_bytes, int* scale_count);

class Runner {
 public:
  explicit Runner(const RunnerConfig& cfg);  // loads everything; throws RunnerError
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const std::vector<int32_t>& stop_tokens() const { return stop_ids_; }

  int new_conversation();
  void clear(int conv);  // releases its blocks; the conversation stays usable, empty
  void close(int conv);  // releases its blocks and forgets it
  // Appends prompt_ids to the conversation, prefills, then samples up to max_new_tokens, streaming
  // each through cb. Returns the generated ids. Stops at a stop token (it is returned, not fed).
  std::vector<int32_t> generate(int conv, const std::vector<int32_t>& prompt_ids, int max_new_tokens,
                                const Sampling& sampling, const TokenCallback& cb);
  // One chat turn: the user's message joins the conversation's messages, the whole conversation is
  // rendered with the model's chat template (ChatTemplate: pagedkv.json's chat_template, else the
  // exported tokenizer files' template; without one "role: text" lines) and only the tokens the cache
  // does not hold yet are prefilled (a re-render that differs from the cache starts the cache over),
  // then generate(); the reply joins the messages. A turn that throws is rolled back (message removed,
  // the cache cleared if it changed). Returns the generated ids.
  std::vector<int32_t> chat(int conv, const std::string& user_text, int max_new_tokens, const Sampling& sampling,
                            const TokenCallback& cb);
  // The conversation's text as chat() would render it with the generation prompt (tests, CLI).
  std::string render_chat(int conv, const std::string& user_text) const;
  void cancel() { cancel_.store(true); }  // stops the running generate after its current step

  // Lower the limit of group 0 (the global layers) towards target_usable_blocks and release the pages of
  // the blocks above it. Used blocks at or above the target are moved first into free blocks below it
  // (their records copied, every block table naming the new id), so the limit reaches the target, or the
  // number of blocks in use when more are in use; conversations go on with the same tokens.
  ShrinkResult shrink(int target_usable_blocks);
  int grow(int target_usable_blocks);             // raise it again (re-commits pages); returns the limit
  PoolStats stats() const;
  MemoryUse memory_use() const;  // any thread; the arenas do not move after construction
  void check_invariants() const;
  int conversation_length(int conv) const;  // tokens in the cache
  // The compact tier (issue 25; runtime_sim.compact.compact_aged): move conv's aged blocks, from past the
  // sink to the last block ending at least `horizon` tokens back, default blocks of the global group, into
  // free blocks of the compact region while it has any, oldest first: each block's records re-quantized
  // from the pool's spec to the compact spec in every global layer, the block table naming the compact
  // block, the default block freed. Returns (logical block, default id, compact id) of each block moved
  // (ids as in the block table: compact ids from num_blocks). RunnerError(kArgument) for a .pte without a
  // compact region or a horizon < 1; kState for a conversation in a spill file.
  std::vector<std::tuple<int, int, int>> compact(int conv, int horizon);
  // Logical blocks of conv's global group: 0 = hole, 1 = default region, 2 = compact region (tests, CLI).
  std::vector<uint8_t> block_kinds(int conv) const;

  // Save / restore a conversation (toolkit/CONVERSATION_FORMAT.md, the format runtime_sim's Engine.save
  // and Engine.restore read and write). save writes conv's blocks as they lie in the pool (every layer
  // group), its stage rows, tokens and chat messages, the spec and the .pte's sha256 from the manifest,
  // atomically (temp file + rename); returns the file's size. restore checks the whole file first
  // (format, checksum, model, spec, dims, groups, vocabulary, room) and maps its blocks into free blocks
  // without prefill; returns the new conversation. Any failure: RunnerError(kArgument / kPoolExhausted /
  // kState), one line, the pool and every conversation as they were.
  int64_t save(int conv, const std::string& path);
  int restore(const std::string& path);
  std::vector<int32_t> conversation_tokens(int conv) const;  // the cache's tokens, then the pending ones

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<int32_t> stop_ids_;
  std::atomic<bool> cancel_{false};
};

}  // namespace pagedkv_rt
