// Conversation files (toolkit/CONVERSATION_FORMAT.md, the format runtime_sim's Engine.save / Engine.restore
// read and write): Runner::save / Runner::restore, and capture / restore_seq, which the spill rung
// (runner_ladder.cpp) shares.

#include <cstdio>
#include <cstring>

#include "runner_impl.h"

namespace pagedkv_rt {

namespace {

// A JSON string literal (the chat messages in a conversation file's app bytes).
std::string json_quote(const std::string& s) {
  std::string o = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') {
      o += '\\';
      o += static_cast<char>(ch);
    } else if (ch < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", ch);
      o += b;
    } else {
      o += static_cast<char>(ch);
    }
  }
  return o + "\"";
}

}  // namespace

// The pool as a conversation file without tokens or blocks (what a file must match).
ConversationFile Runner::Impl::describe_pool() const {
  ConversationFile f;
  f.model_sha256 = model_sha;
  f.num_layers = static_cast<uint32_t>(num_layers);
  f.num_kv_heads = static_cast<uint32_t>(kv_heads);
  f.head_dim = static_cast<uint32_t>(head_dim);
  f.block_size = static_cast<uint32_t>(block_size);
  f.spec = conv_spec;
  f.codes_itemsize = codes_itemsize;
  f.code_bytes = code_bytes;
  f.scale_bytes = scale_bytes;
  f.has_stage = has_stage;
  if (num_compact_blocks) {  // the compact region a file's compact blocks must match
    f.compact_spec = compact_conv_spec;
    f.compact_code_bytes = static_cast<uint32_t>(compact_code_width);
    f.compact_scale_bytes = static_cast<uint32_t>(2 * compact_scale_width);
  }
  for (const LayerGroup& g : groups) {
    ConvGroup cg;
    cg.window = static_cast<uint32_t>(g.window);
    cg.spec = group_rec[f.groups.size()].spec;  // a group's own spec (file version 3), else all zero
    for (int l : g.layers) cg.layers.push_back(static_cast<uint32_t>(l));
    f.groups.push_back(cg);
  }
  return f;
}

// conv's blocks as they lie in the pool (default and compact region), stage rows, tokens and messages
ConversationFile Runner::Impl::capture(Conv& c) {
  const int n = pool->length(c.seq);
  if (n != static_cast<int>(c.history.size()))
    throw RunnerError(ErrorCode::kState, "a conversation is in the middle of a step: save it between turns.");
  ConversationFile f = describe_pool();
  f.tokens = c.history;
  f.pending = c.pending;
  // the chat's messages, as `pagedkv chat` stores them (runtime_sim/chat.py ChatSession.save)
  f.app = "{\"system_prompt\": null, \"messages\": [";
  for (size_t i = 0; i < c.messages.size(); ++i)
    f.app += (i ? ", " : "") + std::string("{\"role\": ") + json_quote(c.messages[i].first) +
             ", \"content\": " + json_quote(c.messages[i].second) + "}";
  f.app += "]}";
  const int nb = (n + block_size - 1) / block_size;
  std::vector<LayerPool> views;
  if (nb || has_stage) views = ensure_pool_views();
  const size_t rec = static_cast<size_t>(kv_heads) * block_size;
  f.codes.resize(f.num_layers);
  f.scales.resize(f.num_layers);
  f.compact_codes.resize(f.num_layers);
  f.compact_scales.resize(f.num_layers);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& table = pool->pool(gi).blocks(c.seq);
    const int nd = pool->pool(gi).num_blocks();  // ids >= nd: the compact region (group 0 only)
    ConvGroup& cg = f.groups[gi];
    for (int i = 0; i < nb; ++i) {
      const int b = i < static_cast<int>(table.size()) ? table[static_cast<size_t>(i)] : -1;
      cg.present.push_back(b < 0 ? kBlockHole : b < nd ? kBlockDefault : kBlockCompact);
    }
    const size_t cb = rec * group_rec[gi].code_bytes, sb = rec * group_rec[gi].scale_bytes;  // one block's
    for (int l : groups[gi].layers) {
      const LayerPool& v = views[static_cast<size_t>(l)];
      auto& codes = f.codes[static_cast<size_t>(l)];
      auto& scales = f.scales[static_cast<size_t>(l)];
      for (int i = 0; i < nb; ++i) {
        if (cg.present[static_cast<size_t>(i)] != kBlockDefault) continue;
        const size_t b = static_cast<size_t>(table[static_cast<size_t>(i)]);
        codes.insert(codes.end(), v.codes + b * cb, v.codes + (b + 1) * cb);
        if (sb) scales.insert(scales.end(), v.scales + b * sb, v.scales + (b + 1) * sb);
      }
      if (!cg.n_compact()) continue;
      const uint8_t* cc = compact_region(l, false);
      const uint8_t* cs = compact_region(l, true);
      const size_t cw = rec * static_cast<size_t>(compact_code_width), sw = rec * 2 * static_cast<size_t>(compact_scale_width);
      for (int i = 0; i < nb; ++i) {
        if (cg.present[static_cast<size_t>(i)] != kBlockCompact) continue;
        const size_t b = static_cast<size_t>(table[static_cast<size_t>(i)] - nd);
        f.compact_codes[static_cast<size_t>(l)].insert(f.compact_codes[static_cast<size_t>(l)].end(), cc + b * cw, cc + (b + 1) * cw);
        f.compact_scales[static_cast<size_t>(l)].insert(f.compact_scales[static_cast<size_t>(l)].end(), cs + b * sw, cs + (b + 1) * sw);
      }
    }
  }
  if (has_stage) {
    const size_t sb = f.stage_bytes();
    for (int l = 0; l < num_layers; ++l) {
      const uint8_t* p = views[static_cast<size_t>(l)].stage + static_cast<size_t>(c.seq) * sb;
      f.stage.emplace_back(p, p + sb);
    }
  }
  return f;
}

// Free default blocks each group needs to restore f, at its peak (runtime_sim.conversation_file
// blocks_to_restore): the default blocks before the last one stay while the last one is allocated; a
// hole is dropped and a compact block moved to the compact region as soon as it is restored.
std::vector<int> Runner::Impl::blocks_to_restore(const ConversationFile& f) const {
  const int nb = static_cast<int>((f.tokens.size() + f.block_size - 1) / f.block_size);
  std::vector<int> need;
  for (const ConvGroup& g : f.groups) {
    int k = nb ? 1 : 0;
    for (int i = 0; i + 1 < nb; ++i) k += g.present[static_cast<size_t>(i)] == kBlockDefault ? 1 : 0;
    need.push_back(k);
  }
  return need;
}

// A new sequence slot holding f's blocks (compact ones in free compact blocks, all or none) and stage
// rows; every check first, so any failure leaves the pool as it was. Returns the slot.
int Runner::Impl::restore_seq(const ConversationFile& f, const std::string& path) {
  check_conversation_compatible(f, describe_pool(), path);
  auto bad = [&](const std::string& what) {
    return RunnerError(ErrorCode::kArgument, "conversation file " + path + " " + what +
                                                 ": it cannot be restored; save the conversation again.");
  };
  for (const auto* v : {&f.tokens, &f.pending})
    for (int32_t t : *v)
      if (t >= vocab_size)
        throw bad("holds a token id outside this model's vocabulary of " + std::to_string(vocab_size) + " (damaged)");
  const int n = static_cast<int>(f.tokens.size()), bs = block_size, nb = (n + bs - 1) / bs;
  if (nb > max_blocks_per_seq)
    throw bad("holds " + std::to_string(n) + " tokens, the .pte accepts at most " + std::to_string(max_blocks_per_seq * bs));
  for (size_t gi = 0; gi < f.groups.size(); ++gi) {  // holes only where a window (or a dropped block) can be
    const ConvGroup& cg = f.groups[gi];
    const int dead = dead_blocks(static_cast<int>(cg.window), bs, n);
    for (int i = 0; i < dead && i < nb; ++i)
      if (cg.present[static_cast<size_t>(i)])
        throw bad("holds blocks of layer group " + std::to_string(gi) + " that its window would not keep (damaged)");
    if (n % bs && !cg.present[static_cast<size_t>(nb - 1)])  // a partly filled block is never dropped
      throw bad("has a hole at the last, partly filled block of layer group " + std::to_string(gi) + " (damaged)");
    if (gi != 0 && cg.n_compact())  // the compact region belongs to the first (global) group
      throw RunnerError(ErrorCode::kArgument, "conversation file " + path + " holds compact blocks in layer group " +
                                                  std::to_string(gi) + ", which has no compact region here: restore "
                                                  "it with the artifacts that saved it.");
  }
  if (static_cast<int>(pool->live_sequences().size()) >= max_seqs)
    throw RunnerError(ErrorCode::kState, "all " + std::to_string(max_seqs) + " conversation slots are in use: close "
                                         "a conversation before restoring " + path + ".");
  const std::vector<int> need = blocks_to_restore(f);
  for (size_t gi = 0; gi < f.groups.size(); ++gi) {
    const int free = pool->pool(gi).num_free();
    if (need[gi] > free)
      throw RunnerError(ErrorCode::kPoolExhausted,
                        "KV block pool exhausted restoring " + path + " (" + std::to_string(n) + " tokens)" +
                            (grouped ? " in layer group " + std::to_string(gi) : std::string()) + ": needs " +
                            std::to_string(need[gi]) + " block(s), only " + std::to_string(free) +
                            " free. Clear a conversation or give the pool a larger budget.");
  }
  const int n_compact = static_cast<int>(f.n_compact());
  if (n_compact > pool->main().num_free_compact())
    throw RunnerError(ErrorCode::kPoolExhausted,
                      "KV block pool exhausted restoring " + path + ": its " + std::to_string(n_compact) +
                          " compact-tier block(s) need as many free blocks of the compact region, only " +
                          std::to_string(pool->main().num_free_compact()) +
                          " free. Clear a conversation (or restore it where fewer blocks are compacted).");
  std::vector<LayerPool> views;
  if (nb || has_stage) views = ensure_pool_views();
  const int seq = pool->new_sequence();
  try {
    for (int i = 0; i < nb; ++i) {  // block by block, so a sliding group hands back what left its window
      const int len = std::min(bs, n - i * bs);
      pool->reserve(seq, len);
      pool->commit(seq, len);
      for (size_t gi = 0; gi < f.groups.size(); ++gi) {
        const auto& t = pool->pool(gi).blocks(seq);
        const uint8_t kind = f.groups[gi].present[static_cast<size_t>(i)];
        if (kind == kBlockHole && t[static_cast<size_t>(i)] >= 0 && len == bs)
          pool->pool(gi).drop_blocks(seq, {i});  // a block the saver's pool dropped (sliding policy)
        else if (kind == kBlockCompact)
          pool->pool(gi).compact(seq, i);  // only its compact records are written below
      }
    }
    const size_t rec = static_cast<size_t>(kv_heads) * bs;
    for (size_t gi = 0; gi < f.groups.size(); ++gi) {
      const auto& t = pool->pool(gi).blocks(seq);
      const int nd = pool->pool(gi).num_blocks();
      for (int i = 0; i < nb; ++i)
        if ((t[static_cast<size_t>(i)] >= 0) != (f.groups[gi].present[static_cast<size_t>(i)] != kBlockHole))
          throw bad("holds blocks of layer group " + std::to_string(gi) + " that its window would not keep (damaged)");
      const size_t cb = rec * group_rec[gi].code_bytes, sb = rec * group_rec[gi].scale_bytes;  // one block's
      for (int l : groups[gi].layers) {
        const LayerPool& v = views[static_cast<size_t>(l)];
        size_t k = 0, kc = 0;  // the file's k-th default and kc-th compact block of this layer
        const size_t cw = rec * static_cast<size_t>(compact_code_width), sw = rec * 2 * static_cast<size_t>(compact_scale_width);
        for (int i = 0; i < nb; ++i) {
          const int id = t[static_cast<size_t>(i)];
          if (id < 0) continue;
          if (id >= nd) {  // a compact block: its compact records into the compact region
            const size_t b = static_cast<size_t>(id - nd);
            std::memcpy(compact_region(l, false) + b * cw, f.compact_codes[static_cast<size_t>(l)].data() + kc * cw, cw);
            std::memcpy(compact_region(l, true) + b * sw, f.compact_scales[static_cast<size_t>(l)].data() + kc * sw, sw);
            ++kc;
            continue;
          }
          const size_t b = static_cast<size_t>(id);
          std::memcpy(v.codes + b * cb, f.codes[static_cast<size_t>(l)].data() + k * cb, cb);
          if (sb) std::memcpy(v.scales + b * sb, f.scales[static_cast<size_t>(l)].data() + k * sb, sb);
          ++k;
        }
      }
    }
    if (has_stage)
      for (int l = 0; l < num_layers; ++l)
        std::memcpy(views[static_cast<size_t>(l)].stage + static_cast<size_t>(seq) * f.stage_bytes(),
                    f.stage[static_cast<size_t>(l)].data(), f.stage_bytes());
  } catch (...) {
    pool->release(seq);
    throw;
  }
  for (size_t gi = 0; gi < groups.size(); ++gi) peak_used[gi] = std::max(peak_used[gi], pool->pool(gi).num_used());
  return seq;
}

int64_t Runner::save(int conv, const std::string& path) {
  std::lock_guard<std::mutex> g(impl_->mu);
  Impl& m = *impl_;
  if (!m.sha_known)
    throw RunnerError(ErrorCode::kArtifact, "pagedkv.json has no sha256 for the .pte, which a conversation file "
                                            "names its model by: re-run `pagedkv export --format pte`.");
  Impl::Conv& c = m.resident(conv);  // a spilled conversation is mapped back first (Engine.save)
  const int64_t size = static_cast<int64_t>(write_conversation_file(path, m.capture(c)));
  m.refresh_stats();
  return size;
}

int Runner::restore(const std::string& path) {
  std::lock_guard<std::mutex> g(impl_->mu);
  Impl& m = *impl_;
  if (!m.sha_known)
    throw RunnerError(ErrorCode::kArtifact, "pagedkv.json has no sha256 for the .pte, which a conversation file "
                                            "names its model by: re-run `pagedkv export --format pte`.");
  // every check before the pool changes
  ConversationFile f = read_conversation_file(path);
  check_conversation_compatible(f, m.describe_pool(), path);
  std::vector<std::pair<std::string, std::string>> messages;
  if (!f.app.empty()) {  // the chat's messages (written by save or by `pagedkv chat`'s /save)
    try {
      const Json app = Json::parse(f.app);
      if (const Json* ms = app.find("messages"))
        for (const Json& e : ms->items()) messages.emplace_back(e["role"].as_string(), e["content"].as_string());
    } catch (const std::exception&) {
      throw RunnerError(ErrorCode::kArgument, "conversation file " + path + " holds application data that are not "
                                              "chat messages: it cannot be restored; save the conversation again.");
    }
  }
  m.room_for_file(f, nullptr);  // adaptive: spill idle conversations to make room
  int seq;
  try {
    seq = m.restore_seq(f, path);
  } catch (...) {
    m.refresh_stats();
    throw;
  }
  const int id = m.next_conv++;
  m.convs[id] = Impl::Conv{seq, f.tokens, f.pending, messages, m.clock, {}};
  m.refresh_stats();
  return id;
}

}  // namespace pagedkv_rt
