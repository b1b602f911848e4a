#include "runner_impl.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <tuple>

#include "pagedkv_core.h"

// ExecuTorch's threadpool: the executorch wheel ships its library (libexecutorch_threadpool.so, linked
// here) but not extension/threadpool/threadpool.h. These declarations are the part of that header
// the runner calls (ExecuTorch 1.5.1, the version the kernels are built against).
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t new_thread_count);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

// The kernel library (toolkit/csrc/et_kernel.cpp, linked into this runner) remembers where each layer's
// pool tensors (0 codes, 1 scales, 2 stage) lived in its most recent call: the program's planned buffers.
extern "C" int pagedkv_et_pool_view(int64_t layer, int which, void** data, int64_t* nbytes);

namespace pagedkv_rt {

namespace {

std::string read_text(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw RunnerError(ErrorCode::kArtifact, std::string(what) + " " + path +
                                                " not found: push the artifacts dir made by `pagedkv export --format pte` "
                                                "(pagedkv deploy ARTIFACTS).");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The JSON file at path (read_text's `what`), or a kArtifact RunnerError naming it
Json read_json(const std::string& path, const char* what) {
  const std::string text = read_text(path, what);
  try {
    return Json::parse(text);
  } catch (const std::exception& e) {
    throw RunnerError(ErrorCode::kArtifact, path + " is not valid JSON (" + e.what() + "): re-run `pagedkv export`.");
  }
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int Runner::Impl::budget_blocks(int64_t budget_bytes) const {
  const int64_t per_block = group_block_bytes(0);      // bytes_per_token * block_size without groups
  const int64_t fixed = budget_fixed_bytes();          // pool_fixed_bytes without groups
  const int64_t room = budget_bytes - fixed;
  const int64_t fit = room < 0 ? 0 : room / per_block;
  if (fit < kMinPoolBlocks)
    throw RunnerError(ErrorCode::kArgument,
                      "pool budget of " + std::to_string(budget_bytes) + " bytes is too small: it holds fewer than " +
                          std::to_string(kMinPoolBlocks) + " blocks of " + std::to_string(block_size) +
                          " tokens; the smallest pool needs " +
                          std::to_string(fixed + kMinPoolBlocks * per_block) + " bytes (" +
                          std::to_string(per_block) + " per block + " + std::to_string(fixed) +
                          " that do not depend on the block count). Raise the budget.");
  return static_cast<int>(std::min<int64_t>(fit, groups[0].num_blocks));
}

void Runner::Impl::refresh_stats() {
  PoolStats s;
  const BlockManager& main = pool->main();
  s.total_blocks = main.num_blocks();
  s.usable_blocks = main.limit();
  s.used_blocks = main.num_used();
  s.free_blocks = main.num_free();
  s.block_size = block_size;
  s.sequences = static_cast<int>(pool->live_sequences().size());
  s.bytes_per_block = bytes_per_token * block_size;
  s.pool_fixed_bytes = pool_fixed_bytes;
  s.kv_bytes_in_use = s.sequences * stage_bytes_per_seq;
  for (size_t g = 0; g < groups.size(); ++g) {
    const BlockManager& p = pool->pool(g);
    s.kv_bytes_in_use += p.num_used() * group_block_bytes(g);
    if (grouped)
      s.groups.push_back(GroupStats{groups[g].window, static_cast<int>(groups[g].layers.size()), p.num_blocks(),
                                    p.limit(), p.num_used(), p.num_free(), peak_used[g], group_block_bytes(g)});
  }
  s.committed_bytes = committed_bytes();
  for (const auto& a : arenas) {
    s.reserved_bytes += static_cast<int64_t>(a->size);
    s.largest_allocation_bytes = std::max<int64_t>(s.largest_allocation_bytes, static_cast<int64_t>(a->size));
  }
  s.num_allocations = static_cast<int>(arenas.size());
  if (compact_mem) {  // the compact region: one mapping, all of it committed
    s.reserved_bytes += static_cast<int64_t>(compact_mem->size);
    s.largest_allocation_bytes = std::max<int64_t>(s.largest_allocation_bytes, static_cast<int64_t>(compact_mem->size));
    s.num_allocations += 1;
    s.compact_blocks = num_compact_blocks;
    for (const CompactInput& c : compact_inputs) s.compact_bytes += static_cast<int64_t>(c.bytes);
  }
  s.ladder = ladder;
  s.ladder.policy = cfg.policy;
  s.ladder.spilled_now = 0;
  for (const auto& kv : convs) s.ladder.spilled_now += kv.second.spill.empty() ? 0 : 1;
  s.ladder.compact_blocks_in_use = main.num_compact_blocks() - main.num_free_compact();
  // compact blocks held, in the compact spec, in the first group's layers (runtime_sim Engine.stats)
  s.kv_bytes_in_use += static_cast<int64_t>(s.ladder.compact_blocks_in_use) * kv_heads * block_size *
                       (compact_code_width + 2 * compact_scale_width) * static_cast<int64_t>(groups[0].layers.size());
  s.prefill_tokens = prefill_tokens;
  s.decode_tokens = decode_tokens;
  s.prefill_tok_s = prefill_s > 0 ? prefill_tokens / prefill_s : 0;
  s.decode_tok_s = decode_s > 0 ? decode_tokens / decode_s : 0;
  s.isa = pagedkv::isa_name(pagedkv::active_isa());
  s.threads = static_cast<int>(executorch::extension::threadpool::get_threadpool()->get_thread_count());
  std::lock_guard<std::mutex> g(stats_mu);
  snapshot = s;
}

void Runner::Impl::load_manifest(const std::string& dir) {
  manifest = read_json(dir + "/pagedkv.json", "manifest");
  const Json& m = manifest;
  try {
    // 1, or 2 when a layer group stores its own spec (toolkit/manifest.py GROUP_SPEC_FORMAT_VERSION;
    // checked against the groups in load_groups)
    if (m["format_version"].as_int() != 1 && m["format_version"].as_int() != 2)
      throw RunnerError(ErrorCode::kArtifact, "pagedkv.json format_version " +
                                                  std::to_string(m["format_version"].as_int()) +
                                                  ", this runner reads 1 and 2: re-export with a matching pagedkv.");
    const Json& pool = m["pool"];
    num_layers = static_cast<int>(pool["num_layers"].as_int());
    kv_heads = static_cast<int>(pool["num_kv_heads"].as_int());
    head_dim = static_cast<int>(pool["head_dim"].as_int());
    block_size = static_cast<int>(pool["block_size"].as_int());
    num_blocks = static_cast<int>(pool["num_blocks"].as_int());
    max_seqs = static_cast<int>(pool["max_seqs"].as_int());
    bytes_per_token = pool["bytes_per_token"].as_int();
    // PoolLayout.fixed_bytes: total_bytes == num_blocks * block_size * bytes_per_token + fixed
    pool_fixed_bytes = pool["total_bytes"].as_int() - static_cast<int64_t>(num_blocks) * block_size * bytes_per_token;
    if (num_blocks < 1 || block_size < 1 || bytes_per_token < 1 || pool_fixed_bytes < 0)
      throw RunnerError(ErrorCode::kArtifact,
                        dir + "/pagedkv.json's pool sizes do not add up (num_blocks " + std::to_string(num_blocks) +
                            ", block_size " + std::to_string(block_size) + ", bytes_per_token " +
                            std::to_string(bytes_per_token) + ", total_bytes " +
                            std::to_string(pool["total_bytes"].as_int()) +
                            "; total_bytes must be at least their product): re-run `pagedkv export`.");
    const std::string dtype = pool["codes_dtype"].as_string();
    int64_t elem = dtype == "float32" ? 4 : dtype == "float16" ? 2 : 1;
    int64_t n = 1;
    for (const Json& d : pool["codes_shape"].items()) n *= d.as_int();
    codes_bytes_per_layer = n * elem;
    int64_t stage_rows = pool["stage_shape"][0].as_int();
    int64_t stage_n = 1;
    for (const Json& d : pool["stage_shape"].items()) stage_n *= d.as_int();
    stage_bytes_per_seq = stage_rows > 1 ? stage_n / stage_rows * 2 * num_layers : 0;
    load_record_format(pool, elem);
    load_compact(pool, dir);
    const Json* pte = m["artifacts"].find("pte");
    if (!pte)
      throw RunnerError(ErrorCode::kArtifact, dir + " has no .pte artifact: export it with `pagedkv export --format pte`.");
    layers_per_arena = static_cast<int>((*pte)["layers_per_arena"].as_int());
    max_tokens_per_call = static_cast<int>((*pte)["max_tokens_per_call"].as_int());
    max_blocks_per_seq = static_cast<int>((*pte)["max_blocks_per_seq"].as_int());
    vocab_size = static_cast<int>(m["model"]["vocab_size"].as_int());
    for (const Json& e : m["model"]["eos_token_ids"].items()) eos.push_back(static_cast<int32_t>(e.as_int()));
    if (const Json* st = m.find("stop_token_ids"))  // the chat's extra stop ids (end-of-turn tokens)
      for (const Json& e : st->items()) eos.push_back(static_cast<int32_t>(e.as_int()));
    if (const Json* ct = m.find("chat_template"))
      if (ct->is_string()) chat_template_src = ct->as_string();
    if (const Json* tf = m.find("tokenizer_files"))
      for (const Json& e : tf->items()) tokenizer_files.push_back(e.as_string());
    pte_file = (*pte)["file"].as_string();
    if (const Json* sha = pte->find("sha256"); sha && sha->is_string()) sha_known = parse_sha256(sha->as_string());
    load_groups(m, *pte, dir);
  } catch (const RunnerError&) {
    throw;
  } catch (const std::exception& e) {
    throw RunnerError(ErrorCode::kArtifact, dir + "/pagedkv.json is incomplete (" + e.what() +
                                                "): re-run `pagedkv export --format pte`.");
  }
}

// The spec and record sizes of the pool (a conversation file must have the same ones).
void Runner::Impl::load_record_format(const Json& pool, int64_t elem) {
  const Json& sp = pool["spec"];
  auto num = [&](const char* k) -> uint32_t {
    const Json& v = sp[k];
    return v.is_number() ? static_cast<uint32_t>(v.as_int()) : (v.as_bool() ? 1u : 0u);
  };
  conv_spec = ConvSpec{num("k_bits"), num("v_bits"), num("k_group"), num("v_group"), num("k_sym"),
                       num("v_sym"), num("rotate"), num("fp_tail"), num("sink_blocks")};
  const bool is_float = conv_spec.k_bits == 16 || conv_spec.k_bits == 32;
  codes_itemsize = static_cast<uint32_t>(elem);
  code_bytes = static_cast<uint32_t>(pool["codes_shape"].items().back().as_int() * elem);
  scale_bytes = is_float ? 0 : static_cast<uint32_t>(pool["scales_shape"].items().back().as_int() * 2);
  has_stage = !is_float && (conv_spec.fp_tail || conv_spec.sink_blocks);
  spec_bits = RecordBits{static_cast<int>(conv_spec.k_bits), static_cast<int>(conv_spec.v_bits),
                         static_cast<int>(conv_spec.k_group), static_cast<int>(conv_spec.v_group),
                         conv_spec.k_sym != 0, conv_spec.v_sym != 0};
}

// The manifest's compact region (PoolLayout.to_dict with a compact region): compact (the compact
// spec) and num_compact_blocks together, and the shapes the spec gives; checked like the rest of the
// pool (toolkit/manifest.py _check_pool, toolkit/kv_spec.py check_compact), one line on any bad value.
void Runner::Impl::load_compact(const Json& pool, const std::string& dir) {
  auto bad = [&](const std::string& what) {
    return RunnerError(ErrorCode::kArtifact, dir + "/pagedkv.json's pool " + what +
                                                 ": re-run `pagedkv export --compact-blocks N`.");
  };
  num_compact_blocks = 0;
  const Json* spec = pool.find("compact");
  const Json* n = pool.find("num_compact_blocks");
  if (!spec && !n) return;  // a pool without a compact region
  if (!spec || !n) throw bad("has half a compact region (compact and num_compact_blocks go together)");
  if (!n->is_number() || n->as_int() < 1 || n->as_int() > kMaxCompactBlocks)
    throw bad("has num_compact_blocks " + (n->is_number() ? std::to_string(n->as_int()) : std::string("?")) +
              ", outside 1.." + std::to_string(kMaxCompactBlocks));
  if (!spec->is_object()) throw bad("has a compact spec that is not an object");
  auto num = [&](const char* k) -> int64_t {
    const Json* v = spec->find(k);
    if (!v) throw bad(std::string("has a compact spec without ") + k);
    return v->is_number() ? v->as_int() : (v->as_bool() ? 1 : 0);
  };
  pagedkv::PagedAttnParams p;
  p.D = head_dim;
  const int64_t kb = num("k_bits"), vb = num("v_bits"), kg = num("k_group"), vg = num("v_group");
  const bool rot = num("rotate") != 0;
  const std::string desc = "K" + std::to_string(kb) + "/V" + std::to_string(vb) + " groups " + std::to_string(kg) +
                           "/" + std::to_string(vg);
  auto group_ok = [&](int64_t g) { return g == 0 || (g >= 1 && g <= head_dim && head_dim % g == 0); };
  if (kb < 2 || kb > 8 || vb < 2 || vb > 8 || !group_ok(kg) || !group_ok(vg) || head_dim % 8)
    throw bad("has an invalid compact spec (" + desc + " for head_dim " + std::to_string(head_dim) + ")");
  if (conv_spec.k_bits == 16 || conv_spec.k_bits == 32)
    throw bad("has a compact region beside a float spec (the compact tier re-quantizes integer codes)");
  if (rot != (conv_spec.rotate != 0)) throw bad("has a compact spec whose rotation differs from the pool's");
  p.ck_bits = static_cast<int>(kb), p.cv_bits = static_cast<int>(vb);
  p.ck_group = static_cast<int>(kg), p.cv_group = static_cast<int>(vg);
  p.ck_sym = num("k_sym") != 0, p.cv_sym = num("v_sym") != 0;
  pagedkv::compact_record_widths(p, &compact_code_width, &compact_scale_width);
  if (compact_code_width + 2 * compact_scale_width >= static_cast<int>(code_bytes + scale_bytes))
    throw bad("has a compact spec (" + desc + ") that is not smaller than the pool's spec");
  num_compact_blocks = static_cast<int>(n->as_int());
  compact_bits = RecordBits{p.ck_bits, p.cv_bits, p.ck_group, p.cv_group, p.ck_sym, p.cv_sym};
  auto u = [&](const char* k) { return static_cast<uint32_t>(num(k)); };
  compact_conv_spec = ConvSpec{u("k_bits"), u("v_bits"), u("k_group"), u("v_group"), u("k_sym"),
                               u("v_sym"), u("rotate"), u("fp_tail"), u("sink_blocks")};
  const int64_t want_c[4] = {num_compact_blocks, kv_heads, block_size, compact_code_width};
  const int64_t want_s[4] = {num_compact_blocks, kv_heads, block_size, compact_scale_width};
  for (const auto& [key, want] : {std::make_pair("compact_codes_shape", want_c), std::make_pair("compact_scales_shape", want_s)}) {
    const Json* sh = pool.find(key);
    bool same = sh && sh->is_array() && sh->size() == 4;
    for (size_t i = 0; same && i < 4; ++i) same = (*sh)[i].is_number() && (*sh)[i].as_int() == want[i];
    if (!same)
      throw bad(std::string("has ") + (sh ? "a " : "no ") + key + (sh ? " other than" : ", expected") + " [" +
                std::to_string(want[0]) + ", " + std::to_string(want[1]) + ", " + std::to_string(want[2]) + ", " +
                std::to_string(want[3]) + "] (its compact spec and sizes)");
  }
}

bool Runner::Impl::parse_sha256(const std::string& hex) {
  if (hex.size() != 64) return false;
  for (size_t i = 0; i < 32; ++i) {
    unsigned v = 0;
    for (size_t k = 0; k < 2; ++k) {
      const char ch = hex[2 * i + k];
      const int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                  : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + static_cast<unsigned>(d);
    }
    model_sha[i] = static_cast<uint8_t>(v);
  }
  return true;
}

bool Runner::Impl::pool_views(std::vector<LayerPool>* out) const {
  // before this runner's first step the views may be a closed runner's (its arenas' addresses reused)
  if (!ran_step) return false;
  out->assign(static_cast<size_t>(num_layers), LayerPool{});
  const size_t rec = static_cast<size_t>(kv_heads) * block_size;
  const size_t stage_one = static_cast<size_t>(2 * 2) * kv_heads * block_size * head_dim * 2;
  for (int l = 0; l < num_layers; ++l) {
    const size_t nb = static_cast<size_t>(groups[static_cast<size_t>(layer_group[static_cast<size_t>(l)])].num_blocks);
    const GroupRecord& r = group_rec[static_cast<size_t>(layer_group[static_cast<size_t>(l)])];
    const size_t want[3] = {nb * rec * r.code_bytes, r.scale_bytes ? nb * rec * r.scale_bytes : 2,
                            (has_stage ? static_cast<size_t>(max_seqs) : 1) * stage_one};
    uint8_t** dst[3] = {&(*out)[static_cast<size_t>(l)].codes, &(*out)[static_cast<size_t>(l)].scales,
                        &(*out)[static_cast<size_t>(l)].stage};
    for (int w = 0; w < 3; ++w) {
      void* p = nullptr;
      int64_t n = 0;
      if (!pagedkv_et_pool_view(l, w, &p, &n) || static_cast<size_t>(n) != want[w]) return false;
      bool inside = false;
      for (size_t a = 1; a < arenas.size() && !inside; ++a)
        inside = static_cast<uint8_t*>(p) >= arenas[a]->ptr &&
                 static_cast<uint8_t*>(p) + n <= arenas[a]->ptr + arenas[a]->size;
      if (!inside) return false;  // another program ran last in this process
      *dst[w] = static_cast<uint8_t*>(p);
    }
  }
  return true;
}

// pool_views, running one scratch step (token 0 on a fresh sequence slot, released at once) if the
// kernels have not run in this runner yet: it writes only a free block and a free slot's stage rows.
std::vector<Runner::Impl::LayerPool> Runner::Impl::ensure_pool_views() {
  std::vector<LayerPool> v;
  if (pool_views(&v)) return v;
  Conv scratch{pool->new_sequence(), {}, {}, {}, 0, {}};
  try {
    step(scratch, {0});
  } catch (...) {
    pool->release(scratch.seq);
    throw;
  }
  pool->release(scratch.seq);
  if (!pool_views(&v))
    throw RunnerError(ErrorCode::kState, "the kernels' pool buffers are not this runner's: save or restore from the "
                                         "process that runs this runner only.");
  return v;
}

// A layer group's own spec (export --sliding-spec; toolkit/kv_spec.py check_stored_group_spec): a sliding group
// other than the first, quantized like the pool, differing from it only in the record's bits, groups
// and symmetry. Returns its record's bytes.
Runner::Impl::GroupRecord Runner::Impl::group_record(const Json& sp, size_t g,
                                                     const std::function<RunnerError(const std::string&)>& bad) const {
  const std::string which = "group " + std::to_string(g);
  if (!sp.is_object()) throw bad("gives " + which + " a spec that is not an object");
  auto u = [&](const char* k) -> uint32_t {  // a field as a conversation file stores it (booleans 0/1)
    const Json* v = sp.find(k);
    if (!v) throw bad("gives " + which + " a spec without " + k);
    return static_cast<uint32_t>(v->is_number() ? v->as_int() : (v->as_bool() ? 1 : 0));
  };
  const ConvSpec s{u("k_bits"), u("v_bits"), u("k_group"), u("v_group"), u("k_sym"), u("v_sym"), u("rotate"),
                   u("fp_tail"), u("sink_blocks")};
  if (const std::string why = group_spec_problem(conv_spec, s, static_cast<uint32_t>(head_dim), g,
                                                 static_cast<uint32_t>(groups[g].window));
      !why.empty())
    throw bad("gives " + which + " an invalid spec: " + why);
  int cb = 0, scales = 0;
  record_widths(RecordBits{static_cast<int>(s.k_bits), static_cast<int>(s.v_bits), static_cast<int>(s.k_group),
                           static_cast<int>(s.v_group), s.k_sym != 0, s.v_sym != 0},
                head_dim, &cb, &scales);
  return GroupRecord{static_cast<uint32_t>(cb), static_cast<uint32_t>(2 * scales), s};
}

// The manifest's "groups" entry (runtime_sim.session.manifest_groups): [{"window", "layers", "num_blocks"}],
// the layers of every group covering each layer once; absent for a model without sliding layers (one
// global group of the pool's blocks). The .pte's inputs must be the tables those groups imply.
void Runner::Impl::load_groups(const Json& m, const Json& pte, const std::string& dir) {
  auto bad = [&](const std::string& what) {
    return RunnerError(ErrorCode::kArtifact, dir + "/pagedkv.json's groups entry " + what + ": re-run `pagedkv export`.");
  };
  groups.clear();
  layer_group.assign(static_cast<size_t>(num_layers), -1);
  const Json* gs = m.find("groups");
  grouped = gs != nullptr && !gs->is_null();
  if (!grouped) {
    LayerGroup g{0, {}, num_blocks};
    for (int i = 0; i < num_layers; ++i) g.layers.push_back(i);
    groups.push_back(g);
  } else {
    if (!gs->is_array() || gs->size() == 0) throw bad("is not a non-empty list of layer groups");
    for (const Json& e : gs->items()) {
      if (!e.is_object()) throw bad("holds something that is not a layer group");
      LayerGroup g;
      const int64_t w = e["window"].as_int(), nb = e["num_blocks"].as_int();
      if (w < 0 || w > (int64_t{1} << 30)) throw bad("has window " + std::to_string(w));
      if (nb < 1 || nb > num_blocks)
        throw bad("gives a group " + std::to_string(nb) + " blocks, outside 1.." + std::to_string(num_blocks) +
                  " (the pool's num_blocks)");
      g.window = static_cast<int>(w);
      g.num_blocks = static_cast<int>(nb);
      for (const Json& l : e["layers"].items()) {
        const int64_t i = l.as_int();
        if (i < 0 || i >= num_layers)
          throw bad("names layer " + std::to_string(i) + ", the model has layers 0.." + std::to_string(num_layers - 1));
        if (layer_group[static_cast<size_t>(i)] >= 0) throw bad("puts layer " + std::to_string(i) + " in two groups");
        layer_group[static_cast<size_t>(i)] = static_cast<int>(groups.size());
        g.layers.push_back(static_cast<int>(i));
      }
      if (g.layers.empty()) throw bad("has a group without layers");
      if (g.window == 0 && g.num_blocks != num_blocks)
        throw bad("gives the global group " + std::to_string(g.num_blocks) + " blocks, the pool has " +
                  std::to_string(num_blocks));
      groups.push_back(g);
    }
    for (int i = 0; i < num_layers; ++i)
      if (layer_group[static_cast<size_t>(i)] < 0) throw bad("leaves layer " + std::to_string(i) + " out");
  }
  group_rec.assign(groups.size(), GroupRecord{code_bytes, scale_bytes, ConvSpec{}});
  if (grouped)
    for (size_t g = 0; g < groups.size(); ++g)
      if (const Json* sp = (*gs)[g].find("spec"); sp && !sp->is_null()) group_rec[g] = group_record(*sp, g, bad);
  if ((m["format_version"].as_int() == 2) != has_group_specs())
    throw bad("and format_version " + std::to_string(m["format_version"].as_int()) +
              " disagree (version 2 exactly when a group has its own spec)");
  for (size_t g = 0; g < groups.size(); ++g)
    for (int i : groups[g].layers) layer_group[static_cast<size_t>(i)] = static_cast<int>(g);
  peak_used.assign(groups.size(), 0);
  // the artifact's input names: input_ids, positions, seq_ids, block_tables, block_tables_1, ..., then
  // logits_rows (absent in programs exported before it)
  if (const Json* in = pte.find("inputs")) {
    std::vector<std::string> want = {"input_ids", "positions", "seq_ids", "block_tables"};
    for (size_t g = 1; g < groups.size(); ++g) want.push_back("block_tables_" + std::to_string(g));
    std::vector<std::string> have;
    for (const Json& x : in->items()) have.push_back(x.is_string() ? x.as_string() : "?");
    manifest_logits_rows = !have.empty() && have.back() == "logits_rows" ? 1 : 0;
    if (manifest_logits_rows) have.pop_back();
    // the compact region's inputs (compact_codes_L, compact_scales_L) come after the block tables
    size_t first_compact = have.size();
    while (first_compact > 0 && have[first_compact - 1].rfind("compact_", 0) == 0) --first_compact;
    const std::vector<std::string> compact_names(have.begin() + static_cast<long>(first_compact), have.end());
    have.resize(first_compact);
    if (have != want)
      throw RunnerError(ErrorCode::kArtifact,
                        dir + "/pagedkv.json describes " + std::to_string(groups.size()) + " layer group(s) (" +
                            std::to_string(groups.size()) + " block table(s)), but its .pte entry lists " +
                            std::to_string(have.size()) + " inputs (" + std::to_string(have.size() > 3 ? have.size() - 3 : 0) +
                            " block table(s)): the groups entry and the program disagree; re-run `pagedkv export`.");
    load_compact_inputs(compact_names, dir);
  } else if (num_compact_blocks) {
    throw RunnerError(ErrorCode::kArtifact, dir + "/pagedkv.json's pool has a compact region but its .pte entry "
                                                  "lists no inputs (the compact region's order): re-run `pagedkv export`.");
  }
}

// The .pte's compact inputs in the manifest's order (toolkit.manifest.compact_input_names): every layer
// of the global group(s) exactly once as compact_codes_L and compact_scales_L, no other layer; present
// exactly when the pool has a compact region.
void Runner::Impl::load_compact_inputs(const std::vector<std::string>& names, const std::string& dir) {
  auto bad = [&](const std::string& what) {
    return RunnerError(ErrorCode::kArtifact, dir + "/pagedkv.json's .pte entry " + what +
                                                 ": the program and its pool disagree; re-run `pagedkv export`.");
  };
  compact_inputs.clear();
  if (names.empty()) {
    if (num_compact_blocks)
      throw bad("lists no compact_codes_L / compact_scales_L inputs, but its pool has a compact region of " +
                std::to_string(num_compact_blocks) + " blocks");
    return;
  }
  if (!num_compact_blocks)
    throw bad("lists compact region inputs (" + names[0] + ", ...), but its pool describes no compact region");
  std::vector<uint8_t> seen(2 * static_cast<size_t>(num_layers), 0);
  for (const std::string& name : names) {
    CompactInput c;
    const std::string codes = "compact_codes_", scales = "compact_scales_";
    const bool is_codes = name.rfind(codes, 0) == 0;
    c.scales = name.rfind(scales, 0) == 0;
    const std::string digits = name.substr(is_codes ? codes.size() : c.scales ? scales.size() : name.size());
    bool ok = (is_codes || c.scales) && !digits.empty() && digits.size() <= 6 &&
              std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    c.layer = ok ? std::stoi(digits) : -1;
    if (!ok || c.layer >= num_layers)
      throw bad("lists the input '" + name + "' (a compact input is compact_codes_L or compact_scales_L of a layer L "
                "in 0.." + std::to_string(num_layers - 1) + ")");
    if (groups[static_cast<size_t>(layer_group[static_cast<size_t>(c.layer)])].window != 0)
      throw bad("gives layer " + std::to_string(c.layer) + " of a sliding group a compact region (only the global "
                "group's layers read one)");
    uint8_t& s = seen[2 * static_cast<size_t>(c.layer) + (c.scales ? 1 : 0)];
    if (s) throw bad("lists the input '" + name + "' twice");
    s = 1;
    c.shape = {num_compact_blocks, kv_heads, block_size, c.scales ? compact_scale_width : compact_code_width};
    if (compact_of_layer.empty()) compact_of_layer.assign(static_cast<size_t>(num_layers), {-1, -1});
    auto& slot = compact_of_layer[static_cast<size_t>(c.layer)];
    (c.scales ? slot.second : slot.first) = static_cast<int>(compact_inputs.size());
    compact_inputs.push_back(c);
  }
  for (const LayerGroup& g : groups)
    for (int l : g.layers)
      if (!g.window && !(seen[2 * static_cast<size_t>(l)] && seen[2 * static_cast<size_t>(l) + 1]))
        throw bad("lists no compact_codes_" + std::to_string(l) + " / compact_scales_" + std::to_string(l) +
                  " for global layer " + std::to_string(l));
}

// The compact region: one anonymous mapping (page aligned, zeroed), each tensor on a 64-byte boundary
// (toolkit.pool_layout.POOL_ALIGN), the tensors the program takes in the manifest's input order.
void Runner::Impl::allocate_compact(size_t alloc_index) {
  constexpr size_t kAlign = 64;
  size_t total = 0;
  for (CompactInput& c : compact_inputs) {
    total = (total + kAlign - 1) / kAlign * kAlign;
    c.offset = total;
    c.bytes = c.scales ? 2 : 1;
    for (int64_t d : c.shape) c.bytes *= static_cast<size_t>(d);
    total += c.bytes;
  }
  auto mem = std::make_unique<Arena>();
  mem->size = std::max<size_t>(total, 1);
  const bool fail = cfg.fail_allocation_at == static_cast<int>(alloc_index);
  void* p = fail ? MAP_FAILED : mmap(nullptr, mem->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw RunnerError(ErrorCode::kAllocation, "could not allocate the compact region (" +
                                                  std::to_string(num_compact_blocks) + " blocks, " +
                                                  std::to_string(mem->size) + " bytes)" +
                                                  (fail ? " [injected failure]" : "") +
                                                  ": free memory or export fewer --compact-blocks. Nothing stays allocated.");
  mem->ptr = static_cast<uint8_t*>(p);
  if (cfg.prefault) std::memset(mem->ptr, 0, mem->size);  // commit it now (a fresh mapping reads as zeros)
  using executorch::extension::make_tensor_ptr;
  for (const CompactInput& c : compact_inputs) {
    std::vector<executorch::aten::SizesType> sizes(c.shape.begin(), c.shape.end());
    compact_tensors.push_back(make_tensor_ptr(std::move(sizes), mem->ptr + c.offset,
                                              c.scales ? ScalarType::Half : ScalarType::Byte));
  }
  compact_mem = std::move(mem);
}

// The chat template: pagedkv.json's chat_template, else chat_template.jinja or tokenizer_config.json's
// chat_template among the exported tokenizer files (what runtime_sim's tokenizer reads). The special
// tokens the template may print come from tokenizer_config.json.
void Runner::Impl::load_chat_template(const std::string& dir) {
  Json cfg;
  if (listed("tokenizer_config.json")) {
    cfg = read_json(dir + "/tokenizer_config.json", "tokenizer config");
    for (const char* k : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
      const Json* v = cfg.find(k);
      if (v && v->is_object()) v = v->find("content");
      if (v && v->is_string()) template_vars[k] = TValue::str(v->as_string());
    }
  }
  std::string src = chat_template_src;
  if (src.empty() && listed("chat_template.jinja")) src = read_text(dir + "/chat_template.jinja", "chat template");
  if (src.empty()) {
    const Json* t = cfg.find("chat_template");
    if (t && t->is_string()) src = t->as_string();
  }
  if (src.empty()) return;
  try {
    chat_template = std::make_unique<ChatTemplate>(src);
  } catch (const TemplateError& e) {
    throw RunnerError(ErrorCode::kArtifact, std::string(e.what()) + " (in the artifacts' chat template): re-export, "
                                                                     "or report the template.");
  }
}

std::string Runner::Impl::render(const std::vector<std::pair<std::string, std::string>>& messages) const {
  if (!chat_template) {  // no template: plain lines, like runtime_sim's chat
    std::string s;
    for (const auto& m : messages) s += m.first + ": " + m.second + "\n";
    return s + "assistant:";
  }
  auto vars = template_vars;
  vars["messages"] = chat_messages(messages);
  vars["add_generation_prompt"] = TValue::boolean(true);
  try {
    return chat_template->render(vars);
  } catch (const TemplateError& e) {  // e.g. a template that requires alternating roles
    throw RunnerError(ErrorCode::kArgument, std::string(e.what()) + ": clear the conversation to start over.");
  }
}

namespace {

// Deep equality of two JSON values (objects as key sets, like Python's dict ==).
bool json_same(const Json& a, const Json& b) {
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Json::Type::kNull: return true;
    case Json::Type::kBool: return a.as_bool() == b.as_bool();
    case Json::Type::kNumber: return a.as_number() == b.as_number();
    case Json::Type::kString: return a.as_string() == b.as_string();
    case Json::Type::kArray:
      if (a.size() != b.size()) return false;
      for (size_t i = 0; i < a.size(); ++i)
        if (!json_same(a[i], b[i])) return false;
      return true;
    case Json::Type::kObject:
      if (a.size() != b.size()) return false;
      for (const auto& [k, v] : a.members())
        if (const Json* w = b.find(k); !w || !json_same(v, *w)) return false;
      return true;
  }
  return false;
}

}  // namespace

// The .pte's pool identity (its constant method pagedkv_pool, export/executorch_export.py) must be the
// manifest's (toolkit/manifest.py pool_identity: the pool's spec and shape fields, its compact spec,
// and the layer groups' own specs): a manifest edited or mixed up with another export is one line,
// before any memory is sized from it (runtime_sim/backends.py check_pte_pool).
void Runner::Impl::check_pool_identity(const std::string& pte) const {
  static const char* kMethod = "pagedkv_pool";  // toolkit/manifest.py PTE_POOL_METHOD
  auto names = module->method_names();
  if (!names.ok() || !names->count(kMethod))
    throw RunnerError(ErrorCode::kArtifact, pte + " carries no pool description (" + kMethod +
                                                "): it was not made by this `pagedkv export`; re-run it.");
  auto out = module->execute(kMethod);
  if (!out.ok() || out->empty() || !(*out)[0].isTensor())
    throw RunnerError(ErrorCode::kModel, "ExecuTorch could not run " + pte + "'s " + kMethod + " method: re-export it.");
  const auto& t = (*out)[0].toTensor();
  const std::string text(reinterpret_cast<const char*>(t.const_data_ptr<uint8_t>()), static_cast<size_t>(t.numel()));
  std::vector<std::string> diff;
  try {
    const Json got = Json::parse(text);
    const Json& pool = manifest["pool"];
    size_t want_keys = 0;
    for (const char* k : {"spec", "num_layers", "num_kv_heads", "head_dim", "block_size", "max_seqs", "codes_dtype"}) {
      ++want_keys;
      if (const Json* g = got.find(k); !g || !json_same(*g, pool[k])) diff.push_back(k);
    }
    if (const Json* c = pool.find("compact"); c && !c->is_null()) {
      ++want_keys;
      if (const Json* g = got.find("compact"); !g || !json_same(*g, *c)) diff.push_back("compact");
    } else if (got.find("compact")) {
      diff.push_back("compact");
    }
    // group index -> spec, for each layer group that stores its own
    std::vector<std::pair<std::string, const Json*>> own;
    if (const Json* gs = manifest.find("groups"); gs && gs->is_array())
      for (size_t i = 0; i < gs->size(); ++i)
        if (const Json* sp = (*gs)[i].find("spec"); sp && !sp->is_null()) own.emplace_back(std::to_string(i), sp);
    const Json* gg = got.find("group_specs");
    if (!own.empty()) ++want_keys;
    bool groups_same = own.empty() ? gg == nullptr : gg != nullptr && gg->size() == own.size();
    for (size_t i = 0; groups_same && i < own.size(); ++i) {
      const Json* g = gg->find(own[i].first);
      groups_same = g && json_same(*g, *own[i].second);
    }
    if (!groups_same) diff.push_back("group_specs");
    if (diff.empty() && got.size() != want_keys) diff.push_back("its description");
  } catch (const std::exception&) {
    diff = {"its description"};
  }
  if (diff.empty()) return;
  std::string names_list;
  for (const std::string& d : diff) names_list += (names_list.empty() ? "" : ", ") + d;
  throw RunnerError(ErrorCode::kArtifact, pte + " was exported for another pool than pagedkv.json describes (differs "
                                                "in " + names_list + "): the manifest was edited or mixed up; re-run "
                                                "`pagedkv export`.");
}

void Runner::Impl::allocate_and_load(const std::string& dir) {
  const std::string pte = dir + "/" + pte_file;
  { std::ifstream f(pte); if (!f) read_text(pte, "program"); }
  module = std::make_unique<Module>(pte, Module::LoadMode::Mmap);
  if (module->load() != et::Error::Ok)
    throw RunnerError(ErrorCode::kModel, "ExecuTorch could not load " + pte +
                                             ": is it a .pte from the same executorch version (1.5.1)?");
  check_pool_identity(pte);
  auto meta = module->method_meta("forward");
  if (!meta.ok()) throw RunnerError(ErrorCode::kModel, pte + " has no 'forward' method: re-export it.");
  const size_t nbuf = meta->num_memory_planned_buffers();
  const size_t want = 1 + static_cast<size_t>((num_layers + layers_per_arena - 1) / layers_per_arena);
  if (nbuf != want)
    throw RunnerError(ErrorCode::kArtifact, pte + " plans " + std::to_string(nbuf) + " memory arenas, the manifest " +
                                                "implies " + std::to_string(want) +
                                                " (activations + one per pool group): re-export the artifacts.");
  // ids, positions, seq_ids, one block table per group, then logits_rows (programs exported before it
  // compute every row's logits); the manifest's input names say which, else the count does
  has_logits_rows = manifest_logits_rows >= 0 ? manifest_logits_rows == 1 : meta->num_inputs() == 4 + groups.size();
  const size_t extra = has_logits_rows ? 1 : 0;
  const size_t n_compact = compact_inputs.size();  // after the tables, before logits_rows
  if (meta->num_inputs() != 3 + groups.size() + n_compact + extra)
    throw RunnerError(ErrorCode::kArtifact,
                      pte + " takes " + std::to_string(meta->num_inputs()) + " inputs (" +
                          std::to_string(meta->num_inputs() >= 3 + extra ? meta->num_inputs() - 3 - extra : 0) +
                          " block table(s)), but pagedkv.json describes " + std::to_string(groups.size()) +
                          " layer group(s), one block table each" +
                          (n_compact ? ", and " + std::to_string(n_compact) + " compact region inputs" : std::string()) +
                          ": the manifest and the program disagree; re-run `pagedkv export`.");
  for (size_t j = 0; j < n_compact; ++j) {  // each compact input as the program declares it
    const CompactInput& c = compact_inputs[j];
    const size_t idx = 3 + groups.size() + j;
    auto tm = meta->input_tensor_meta(idx);
    bool ok = tm.ok() && tm->scalar_type() == (c.scales ? ScalarType::Half : ScalarType::Byte) &&
              tm->sizes().size() == c.shape.size();
    for (size_t k = 0; ok && k < c.shape.size(); ++k) ok = tm->sizes()[k] == c.shape[k];
    if (!ok)
      throw RunnerError(ErrorCode::kArtifact,
                        pte + "'s input " + std::to_string(idx) + " is not " + (c.scales ? "compact_scales_" : "compact_codes_") +
                            std::to_string(c.layer) + " (" + (c.scales ? "float16" : "uint8") + " [" +
                            std::to_string(c.shape[0]) + ", " + std::to_string(c.shape[1]) + ", " +
                            std::to_string(c.shape[2]) + ", " + std::to_string(c.shape[3]) +
                            "]) as pagedkv.json's pool and input names give: re-run `pagedkv export`.");
  }
  // the budget decides how many blocks of group 0 are usable (and committed); the other groups' are all
  const int limit = cfg.pool_budget_bytes > 0 ? budget_blocks(cfg.pool_budget_bytes) : groups[0].num_blocks;
  budget_limit = limit;
  pool = std::make_unique<GroupedBlockManager>(groups, block_size, max_seqs, limit, num_compact_blocks);
  for (size_t i = 0; i < nbuf; ++i) {
    auto sz = meta->memory_planned_buffer_size(i);
    if (!sz.ok()) throw RunnerError(ErrorCode::kModel, "cannot read the size of memory arena " + std::to_string(i + 1));
    auto arena = std::make_unique<Arena>();
    arena->size = static_cast<size_t>(std::max<int64_t>(*sz, 1));
    const bool fail = cfg.fail_allocation_at == static_cast<int>(i);
    void* p = fail ? MAP_FAILED
                   : mmap(nullptr, arena->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw RunnerError(ErrorCode::kAllocation,
                        "could not allocate memory arena " + std::to_string(i + 1) + " (" +
                            (i == 0 ? std::string("activations")
                                    : per_layer_arenas() ? "KV pool of layer " + std::to_string(i - 1)
                                                         : "KV pool of layers from " + std::to_string((i - 1) * layers_per_arena)) +
                            ", " + std::to_string(arena->size) + " bytes)" + (fail ? " [injected failure]" : "") +
                            ": free memory or lower the pool budget. Nothing stays allocated.");
    }
    arena->ptr = static_cast<uint8_t*>(p);
    const size_t codes = i >= 1 && per_layer_arenas() ? static_cast<size_t>(codes_bytes_of_layer(static_cast<int>(i - 1))) : 0;
    if (codes > arena->size)
      throw RunnerError(ErrorCode::kArtifact,
                        "memory arena " + std::to_string(i + 1) + " (" + std::to_string(arena->size) +
                            " bytes) is smaller than layer " + std::to_string(i - 1) + "'s codes tensor of " +
                            std::to_string(codes) + " bytes (" +
                            std::to_string(groups[static_cast<size_t>(layer_group[i - 1])].num_blocks) +
                            " blocks): the .pte and pagedkv.json (pool / groups) do not match; re-export.");
    spans.emplace_back(arena->ptr, arena->size);
    arenas.push_back(std::move(arena));
  }
  if (n_compact) allocate_compact(nbuf);
  planned = std::make_unique<et::HierarchicalAllocator>(et::Span<et::Span<uint8_t>>(spans.data(), spans.size()));
  if (module->load_method("forward", planned.get()) != et::Error::Ok)
    throw RunnerError(ErrorCode::kModel, "ExecuTorch could not load method 'forward' of " + pte +
                                             " (missing kernel? the pagedkv kernels are linked into this runner)");
  // commit what the budget allows: non-block tensors, blocks < limit. After loading the method (which
  // writes nothing there): the load's own transient peak (XNNPACK packing the weights from the .pte's
  // mapped pages) then does not stack on the pool's pages (issue 23). Not the activations arena: its
  // plan is laid out for max_tokens_per_call tokens, and a call of fewer tokens (a smaller
  // prefill_chunk, a decode step) writes only the first part of each tensor's slot; pages never
  // written are never resident
  for (size_t i = 1; cfg.prefault && i < nbuf; ++i) {
    Arena& arena = *arenas[i];
    if (!per_layer_arenas() || layer_group[i - 1] != 0) {
      std::memset(arena.ptr, 0, arena.size);
    } else {
      const size_t codes = static_cast<size_t>(codes_bytes_of_layer(static_cast<int>(i - 1)));
      std::memset(arena.ptr + codes, 0, arena.size - codes);
    }
  }
  if (cfg.prefault) touch_blocks(0, limit, true);
  mapped = std::make_unique<MappedPages>(pte);
  mapped->prepare();
}

// One graph call for one conversation; returns the last token's logits.
std::vector<float> Runner::Impl::step(Conv& c, const std::vector<int32_t>& toks) {
  const int T = static_cast<int>(toks.size());
  const int start = pool->length(c.seq);
  const int width = (start + T + block_size - 1) / block_size;
  if (width > max_blocks_per_seq)
    throw RunnerError(ErrorCode::kArgument, "conversation would reach " + std::to_string(start + T) +
                                                " tokens, the .pte accepts at most " +
                                                std::to_string(max_blocks_per_seq * block_size) + ": clear it.");
  pool->reserve(c.seq, T);  // every group; throws kPoolExhausted with nothing changed
  c.last_used = ++clock;
  for (size_t g = 0; g < groups.size(); ++g) peak_used[g] = std::max(peak_used[g], pool->pool(g).num_used());
  std::vector<int64_t> ids(toks.begin(), toks.end()), pos(T), seq(T, c.seq);
  std::iota(pos.begin(), pos.end(), static_cast<int64_t>(start));
  // one table [max_seqs, width] per layer group; a sliding group's rows have holes (-1) before its window
  std::vector<std::vector<int64_t>> tables(groups.size(), std::vector<int64_t>(static_cast<size_t>(max_seqs) * width, -1));
  for (size_t g = 0; g < groups.size(); ++g)
    for (int s : pool->live_sequences()) {
      const auto& b = pool->pool(g).blocks(s);
      for (int j = 0; j < width && j < static_cast<int>(b.size()); ++j)
        tables[g][static_cast<size_t>(s) * width + j] = b[static_cast<size_t>(j)];
    }
  using executorch::extension::make_tensor_ptr;
  using executorch::extension::TensorPtr;
  auto t_ids = make_tensor_ptr({1, T}, ids.data(), ScalarType::Long);
  auto t_pos = make_tensor_ptr({T}, pos.data(), ScalarType::Long);
  auto t_seq = make_tensor_ptr({T}, seq.data(), ScalarType::Long);
  std::vector<TensorPtr> t_tabs;
  std::vector<et::EValue> inputs = {*t_ids, *t_pos, *t_seq};
  for (auto& t : tables) {  // block_tables, block_tables_1, ...: the .pte's input order
    t_tabs.push_back(make_tensor_ptr({max_seqs, width}, t.data(), ScalarType::Long));
    inputs.emplace_back(*t_tabs.back());
  }
  for (auto& t : compact_tensors) inputs.emplace_back(*t);  // the compact region, read in place
  int64_t last_row = T - 1;  // the LM head runs on the call's last token only
  auto t_rows = make_tensor_ptr({1}, &last_row, ScalarType::Long);
  if (has_logits_rows) inputs.emplace_back(*t_rows);
  if (mapped) mapped->release();  // unmap the file pages the previous call read (mapped_pages.h)
  auto res = module->forward(inputs);
  if (!res.ok()) {
    // the kernel checks its inputs before writing: the blocks reserved for this call are unused
    throw RunnerError(ErrorCode::kModel, "ExecuTorch forward failed (error " +
                                             std::to_string(static_cast<int>(res.error())) +
                                             "); see the log for the kernel's message");
  }
  pool->commit(c.seq, T);  // a sliding group hands back the blocks that left its window
  ran_step = true;
  if (codes_offset.empty() && per_layer_arenas()) {  // where the plan put each layer's codes (touch_blocks)
    std::vector<LayerPool> v;
    if (pool_views(&v))
      for (int l = 0; l < num_layers; ++l) {
        const Arena& a = *arenas[static_cast<size_t>(l) + 1];
        const size_t off = static_cast<size_t>(v[static_cast<size_t>(l)].codes - a.ptr);
        if (v[static_cast<size_t>(l)].codes < a.ptr || off + static_cast<size_t>(codes_bytes_of_layer(l)) > a.size) {
          codes_offset.clear();  // not in its own arena: keep the old assumption
          break;
        }
        codes_offset.push_back(off);
      }
  }
  c.history.insert(c.history.end(), toks.begin(), toks.end());
  const auto& out = res.get()[0].toTensor();
  const int V = static_cast<int>(out.size(out.dim() - 1));
  const float* data = out.const_data_ptr<float>();
  const size_t row = has_logits_rows ? 0 : static_cast<size_t>(T - 1);
  return std::vector<float>(data + row * V, data + (row + 1) * V);
}

Runner::Impl::Conv& Runner::Impl::conv(int id) {
  auto it = convs.find(id);
  if (it == convs.end())
    throw RunnerError(ErrorCode::kState, "unknown conversation " + std::to_string(id) + ": create one with new_conversation()");
  return it->second;
}

static int32_t sample(const std::vector<float>& logits, const Sampling& s, std::mt19937_64& rng) {
  if (s.temperature <= 0.f)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const size_t V = logits.size();
  std::vector<double> z(V);
  for (size_t i = 0; i < V; ++i) z[i] = static_cast<double>(logits[i]) / s.temperature;
  if (s.top_k > 0 && static_cast<size_t>(s.top_k) < V) {
    std::vector<double> tmp(z);
    std::nth_element(tmp.begin(), tmp.begin() + (s.top_k - 1), tmp.end(), std::greater<double>());
    const double kth = tmp[static_cast<size_t>(s.top_k - 1)];
    for (double& x : z)
      if (x < kth) x = -INFINITY;
  }
  const double mx = *std::max_element(z.begin(), z.end());
  std::vector<double> p(V);
  double sum = 0;
  for (size_t i = 0; i < V; ++i) sum += (p[i] = std::exp(z[i] - mx));
  for (double& x : p) x /= sum;
  if (s.top_p < 1.f) {
    std::vector<size_t> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
    double cum = 0;
    std::vector<double> keep(V, 0.0);
    for (size_t i : order) {
      if (cum >= s.top_p) break;
      keep[i] = p[i];
      cum += p[i];
    }
    p.swap(keep);
  }
  std::discrete_distribution<size_t> dist(p.begin(), p.end());
  return static_cast<int32_t>(dist(rng));
}

Runner::Runner(const RunnerConfig& cfg) : impl_(new Impl) {
  if (cfg.policy != "auto" && cfg.policy != "error" && cfg.policy != "sliding" && cfg.policy != "adaptive")
    throw RunnerError(ErrorCode::kArgument, "unknown pool policy '" + cfg.policy + "': use one of auto, error, sliding, "
                                            "adaptive.");
  if (cfg.compact_horizon < 1)
    throw RunnerError(ErrorCode::kArgument, "compact horizon " + std::to_string(cfg.compact_horizon) + " is invalid: give "
                                            "the number of recent tokens a conversation keeps in the default region (>= 1, e.g. 1024).");
  if (cfg.sink_blocks < 0)
    throw RunnerError(ErrorCode::kArgument, "sink_blocks " + std::to_string(cfg.sink_blocks) + " is invalid: give 0 "
                                            "(the spec's, at least 1) or the number of leading blocks never dropped.");
  impl_->cfg = cfg;
  const std::string& dir = cfg.artifacts_dir;
  impl_->load_manifest(dir);
  if (impl_->cfg.policy == "auto")  // the compact tier is the adaptive ladder's first rung
    impl_->cfg.policy = impl_->num_compact_blocks ? "adaptive" : "error";
  try {
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_file(dir + "/tokenizer.json"));
  } catch (const std::exception& e) {
    throw RunnerError(ErrorCode::kArtifact, std::string("tokenizer: ") + e.what());
  }
  // stop ids come from the manifest (the model's eos ids + the chat's end-of-turn ids), not from token names
  for (int32_t id : impl_->eos)
    if (std::find(stop_ids_.begin(), stop_ids_.end(), id) == stop_ids_.end()) stop_ids_.push_back(id);
  impl_->load_chat_template(dir);
  if (!cfg.isa.empty()) {
    pagedkv::Isa want = pagedkv::Isa::kAuto;
    for (pagedkv::Isa i : pagedkv::kAllIsas)
      if (cfg.isa == pagedkv::isa_name(i)) want = i;
    if (want == pagedkv::Isa::kAuto || !pagedkv::set_isa(want))
      throw RunnerError(ErrorCode::kArgument, "kernel code path '" + cfg.isa + "' is not available on this CPU");
  }
  // one pool for the whole model: the kernel library runs the attention on ExecuTorch's threadpool
  // (built with ET_USE_THREADPOOL), the same threads XNNPACK runs the linears on
  if (cfg.num_threads > 0)
    executorch::extension::threadpool::get_threadpool()->_unsafe_reset_threadpool(static_cast<uint32_t>(cfg.num_threads));
  impl_->allocate_and_load(dir);
  impl_->refresh_stats();
}

Runner::~Runner() {
  if (!impl_) return;
  for (auto& kv : impl_->convs)  // spill files are this runner's alone (their names carry its pid and address)
    if (!kv.second.spill.empty()) unlink(kv.second.spill.c_str());
}

int Runner::new_conversation() {
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->make_slot(nullptr);  // adaptive: spill the least recently used conversation if every slot is held
  int seq = impl_->pool->new_sequence();
  int id = impl_->next_conv++;
  impl_->convs[id] = Impl::Conv{seq, {}, {}, {}, impl_->clock, {}};
  impl_->refresh_stats();
  return id;
}

void Runner::clear(int conv) {
  std::lock_guard<std::mutex> g(impl_->mu);
  auto& c = impl_->conv(conv);
  if (!c.spill.empty()) {  // no slot yet: take one first, so a failure changes nothing
    impl_->make_slot(&c);
    const int seq = impl_->pool->new_sequence();
    impl_->drop_spill(c);
    c.seq = seq;
  } else {
    impl_->pool->release(c.seq);
    c.seq = impl_->pool->new_sequence();
  }
  c.history.clear();
  c.pending.clear();
  c.messages.clear();
  impl_->refresh_stats();
}

void Runner::close(int conv) {
  std::lock_guard<std::mutex> g(impl_->mu);
  auto& c = impl_->conv(conv);
  if (!c.spill.empty()) impl_->drop_spill(c);
  else impl_->pool->release(c.seq);
  impl_->convs.erase(conv);
  impl_->refresh_stats();
}

int Runner::conversation_length(int conv) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  const auto& c = impl_->conv(conv);
  return c.spill.empty() ? impl_->pool->length(c.seq) : static_cast<int>(c.history.size());
}


std::vector<int32_t> Runner::conversation_tokens(int conv) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  const auto& c = impl_->conv(conv);
  std::vector<int32_t> out = c.history;
  out.insert(out.end(), c.pending.begin(), c.pending.end());
  return out;
}

std::string Runner::render_chat(int conv, const std::string& user_text) const {
  std::vector<std::pair<std::string, std::string>> msgs;
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    msgs = impl_->conv(conv).messages;
  }
  msgs.emplace_back("user", utf8_lossy(user_text));
  return impl_->render(msgs);
}

std::vector<int32_t> Runner::chat(int conv, const std::string& user_text, int max_new_tokens, const Sampling& sampling,
                                  const TokenCallback& cb) {
  Impl& m = *impl_;
  std::vector<int32_t> held, fresh;
  size_t n_messages;
  std::tuple<std::vector<int32_t>, std::vector<int32_t>, int> before;
  {
    std::lock_guard<std::mutex> g(m.mu);
    Impl::Conv& c = m.resident(conv);  // a spilled conversation is mapped back first
    n_messages = c.messages.size();
    c.messages.emplace_back("user", utf8_lossy(user_text));  // messages are text (a conversation file's JSON)
    before = {c.history, c.pending, c.seq};
    std::vector<int32_t> ids;
    try {
      ids = tokenizer_->encode(m.render(c.messages));
    } catch (const std::invalid_argument& e) {  // text the tokenizer refuses (require_nfc)
      c.messages.resize(n_messages);
      throw RunnerError(ErrorCode::kArgument, e.what());
    } catch (...) {
      c.messages.resize(n_messages);
      throw;
    }
    held = c.history;
    held.insert(held.end(), c.pending.begin(), c.pending.end());
    if (held.size() >= ids.size() || !std::equal(held.begin(), held.end(), ids.begin())) {
      // the re-rendered conversation differs from the cache: start the cache over with all of it
      m.pool->release(c.seq);
      c.seq = m.pool->new_sequence();
      c.history.clear();
      c.pending.clear();
      held.clear();
    }
    fresh.assign(ids.begin() + static_cast<long>(held.size()), ids.end());
  }
  try {
    std::vector<int32_t> out = generate(conv, fresh, max_new_tokens, sampling, cb);
    std::vector<int32_t> reply(out);
    if (!reply.empty() && std::find(stop_ids_.begin(), stop_ids_.end(), reply.back()) != stop_ids_.end()) reply.pop_back();
    std::lock_guard<std::mutex> g(m.mu);
    // the reply as text, as HF's decode gives it: a byte token cut mid-character is U+FFFD
    m.conv(conv).messages.emplace_back("assistant", utf8_lossy(tokenizer_->decode(reply, true)));
    return out;
  } catch (...) {
    std::lock_guard<std::mutex> g(m.mu);
    auto it = m.convs.find(conv);
    if (it != m.convs.end()) {
      Impl::Conv& c = it->second;
      c.messages.resize(n_messages);
      if (std::tie(c.history, c.pending, c.seq) != std::tie(std::get<0>(before), std::get<1>(before), std::get<2>(before))) {
        m.pool->release(c.seq);  // part of the turn may be cached: drop it, the next turn prefills again
        c.seq = m.pool->new_sequence();
        c.history.clear();
        c.pending.clear();
      }
      m.refresh_stats();
    }
    throw;
  }
}

std::vector<int32_t> Runner::generate(int conv, const std::vector<int32_t>& prompt_ids, int max_new_tokens,
                                      const Sampling& sampling, const TokenCallback& cb) {
  std::lock_guard<std::mutex> g(impl_->mu);
  cancel_.store(false);
  Impl& m = *impl_;
  m.conv(conv);
  if (prompt_ids.empty()) throw RunnerError(ErrorCode::kArgument, "empty prompt: give at least one token.");
  for (int32_t t : prompt_ids)
    if (t < 0 || t >= m.vocab_size)
      throw RunnerError(ErrorCode::kArgument, "token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                                                  std::to_string(m.vocab_size - 1) + ")");
  auto& c = m.resident(conv);  // a spilled conversation is mapped back first (or prefilled again)
  std::vector<int32_t> toks = c.pending;
  toks.insert(toks.end(), prompt_ids.begin(), prompt_ids.end());
  int chunk = m.max_tokens_per_call;
  if (m.cfg.prefill_chunk > 0) chunk = std::min(chunk, m.cfg.prefill_chunk);
  // policy error: room for the whole prompt up front, never a half-prefilled turn (a sliding group trims
  // between the chunks); adaptive: the rungs that keep every token for the whole prompt, and if that is not
  // enough the calls slide (Engine.prefill); sliding: each call slides as it needs
  if (m.adaptive()) {
    try {
      m.make_room(c, static_cast<int>(toks.size()), chunk, false, "a prompt");
    } catch (const RunnerError& e) {
      if (e.code() != ErrorCode::kPoolExhausted) throw;
    }
  }
  const bool ladder = m.cfg.policy != "error";
  const std::vector<int> need = ladder ? std::vector<int>{} : m.pool->blocks_needed(c.seq, static_cast<int>(toks.size()), chunk);
  for (size_t g = 0; g < need.size(); ++g) {
    const int free = m.pool->pool(g).num_free();
    if (need[g] > free)
      throw RunnerError(ErrorCode::kPoolExhausted,
                        "KV block pool exhausted for a prompt of " + std::to_string(toks.size()) + " tokens" +
                            (m.grouped ? " in layer group " + std::to_string(g) + " (" +
                                             (m.groups[g].window ? "window " + std::to_string(m.groups[g].window)
                                                                 : std::string("global")) + ")"
                                       : std::string()) +
                            ": needs " + std::to_string(need[g]) + " block(s), only " + std::to_string(free) +
                            " free. Clear a conversation or give the pool a larger budget.");
  }
  c.pending.clear();
  double t0 = now_s();
  std::vector<float> logits;
  for (size_t a = 0; a < toks.size(); a += static_cast<size_t>(chunk)) {
    std::vector<int32_t> part(toks.begin() + static_cast<long>(a),
                              toks.begin() + static_cast<long>(std::min(toks.size(), a + static_cast<size_t>(chunk))));
    if (ladder) m.make_room(c, static_cast<int>(part.size()), 0, true, "a call");
    logits = m.step(c, part);
  }
  m.prefill_tokens += static_cast<int64_t>(toks.size());
  m.prefill_s += now_s() - t0;
  m.refresh_stats();

  std::mt19937_64 rng(sampling.seed);
  TokenStreamer streamer(*tokenizer_);
  std::vector<int32_t> out;
  for (int i = 0; i < max_new_tokens; ++i) {
    int32_t tok = sample(logits, sampling, rng);
    out.push_back(tok);
    const bool stop = !sampling.ignore_stop && std::find(stop_ids_.begin(), stop_ids_.end(), tok) != stop_ids_.end();
    bool go_on = true;
    if (cb) {
      std::string piece = streamer.push(tok);
      const bool last = stop || i == max_new_tokens - 1 || cancel_.load();
      if (last) piece += streamer.flush();
      go_on = cb(tok, piece);
      if (!go_on && !last) {  // the listener stopped it: hand over a partial character still pending
        std::string tail = streamer.flush();
        if (!tail.empty()) cb(tok, tail);
      }
    }
    if (stop || i == max_new_tokens - 1 || !go_on || cancel_.load()) {
      c.pending = {tok};  // fed at the start of the next turn, like runtime_sim's engine
      break;
    }
    double t1 = now_s();
    try {
      if (ladder) m.make_room(c, 1, 0, true, "a call");
      logits = m.step(c, {tok});
    } catch (...) {
      c.pending = {tok};
      m.refresh_stats();
      throw;
    }
    m.decode_tokens += 1;
    m.decode_s += now_s() - t1;
    m.refresh_stats();
  }
  m.refresh_stats();
  return out;
}

PoolStats Runner::stats() const {
  std::lock_guard<std::mutex> g(impl_->stats_mu);
  return impl_->snapshot;
}

// Bytes of [p, p + n) resident in memory (pages counted by mincore).
static int64_t resident_bytes(const uint8_t* p, size_t n) {
  if (!p || n == 0) return 0;
  const size_t ps = page_size();
  const size_t pages = (n + ps - 1) / ps;
  std::vector<unsigned char> vec(pages);
  if (mincore(const_cast<uint8_t*>(p), n, vec.data()) != 0) return -1;
  int64_t r = 0;
  for (unsigned char v : vec) r += (v & 1) ? static_cast<int64_t>(ps) : 0;
  return r;
}

MemoryUse Runner::memory_use() const {
  MemoryUse u;
  const Impl& m = *impl_;
  for (size_t i = 0; i < m.arenas.size(); ++i) {
    const int64_t res = resident_bytes(m.arenas[i]->ptr, m.arenas[i]->size);
    const int64_t size = static_cast<int64_t>(m.arenas[i]->size);
    (i == 0 ? u.activations_resident : u.pool_resident) += res;
    (i == 0 ? u.activations_reserved : u.pool_reserved) += size;
  }
  if (m.compact_mem) {  // the compact region is pool memory too
    u.pool_resident += resident_bytes(m.compact_mem->ptr, m.compact_mem->size);
    u.pool_reserved += static_cast<int64_t>(m.compact_mem->size);
  }
  u.program_path = m.cfg.artifacts_dir + "/" + m.pte_file;
  return u;
}

void Runner::check_invariants() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->pool->check_invariants();
}

}  // namespace pagedkv_rt
