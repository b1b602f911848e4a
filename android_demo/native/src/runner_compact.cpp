// The compact tier (issue 25; runtime_sim/compact.py): a conversation's aged default blocks re-quantized
// from the pool's spec into the compact region's smaller one (requantize_records), the block table naming
// the compact block and the default block freed. Runner::compact is the direct call (the app's trim); the
// ladder's compact rung (runner_ladder.cpp compact_one) calls compact_aged with what its step is short of.

#include "pagedkv_core.h"
#include "runner_impl.h"

namespace pagedkv_rt {

void record_widths(const RecordBits& b, int d, int* code_bytes, int* scale_count) {
  const int kg = b.k_group ? b.k_group : d, vg = b.v_group ? b.v_group : d;
  *code_bytes = d * b.k_bits / 8 + d * b.v_bits / 8;
  *scale_count = d / kg * (b.k_sym ? 1 : 2) + d / vg * (b.v_sym ? 1 : 2);
}

void requantize_records(const uint8_t* codes, const uint16_t* scales, size_t n, const RecordBits& src,
                        const RecordBits& dst, int d, uint8_t* out_codes, uint16_t* out_scales) {
  int scw = 0, ssw = 0, dcw = 0, dsw = 0;
  record_widths(src, d, &scw, &ssw);
  record_widths(dst, d, &dcw, &dsw);
  // a record: K codes, then V codes; K's scales (and zero points when asymmetric), then V's
  const int sk_codes = d * src.k_bits / 8, sk_meta = d / (src.k_group ? src.k_group : d) * (src.k_sym ? 1 : 2);
  const int dk_codes = d * dst.k_bits / 8, dk_meta = d / (dst.k_group ? dst.k_group : d) * (dst.k_sym ? 1 : 2);
  std::vector<float> x(static_cast<size_t>(d));
  for (size_t r = 0; r < n; ++r) {
    const uint8_t* c = codes + r * static_cast<size_t>(scw);
    const uint16_t* m = scales + r * static_cast<size_t>(ssw);
    uint8_t* oc = out_codes + r * static_cast<size_t>(dcw);
    uint16_t* om = out_scales + r * static_cast<size_t>(dsw);
    pagedkv::dequantize_record(c, m, d, src.k_bits, src.k_group ? src.k_group : d, src.k_sym, x.data());
    pagedkv::quantize_record(x.data(), d, dst.k_bits, dst.k_group ? dst.k_group : d, dst.k_sym, oc, om);
    pagedkv::dequantize_record(c + sk_codes, m + sk_meta, d, src.v_bits, src.v_group ? src.v_group : d, src.v_sym,
                               x.data());
    pagedkv::quantize_record(x.data(), d, dst.v_bits, dst.v_group ? dst.v_group : d, dst.v_sym, oc + dk_codes,
                             om + dk_meta);
  }
}


// Default block src re-quantized into block dst of the compact region (0-based) in every global layer.
void Runner::Impl::requantize_block(const std::vector<LayerPool>& views, int src, int dst) {
  const size_t rec = static_cast<size_t>(kv_heads) * block_size;
  for (int l : groups[0].layers) {
    const LayerPool& v = views[static_cast<size_t>(l)];
    requantize_records(v.codes + static_cast<size_t>(src) * rec * code_bytes,
                       reinterpret_cast<const uint16_t*>(v.scales + static_cast<size_t>(src) * rec * scale_bytes), rec,
                       spec_bits, compact_bits, head_dim,
                       compact_region(l, false) + static_cast<size_t>(dst) * rec * compact_code_width,
                       reinterpret_cast<uint16_t*>(compact_region(l, true) +
                                                   static_cast<size_t>(dst) * rec * 2 * compact_scale_width));
  }
}

// runtime_sim.compact.aged_blocks: logical blocks of seq that may move to the compact region, oldest
// first: from past the sink to the last block ending at least horizon tokens back, default blocks only
// (every block here is held by one sequence: the runner shares none).
std::vector<int> Runner::Impl::aged_blocks(int seq, int horizon) const {
  const BlockManager& main = pool->main();
  const auto& table = main.blocks(seq);
  const int len = main.length(seq);
  const int last = len >= horizon ? (len - horizon) / block_size : 0;  // blocks i < last end >= horizon back
  std::vector<int> out;
  for (int i = std::max(1, static_cast<int>(conv_spec.sink_blocks)); i < last && i < static_cast<int>(table.size()); ++i)
    if (table[static_cast<size_t>(i)] >= 0 && table[static_cast<size_t>(i)] < main.num_blocks()) out.push_back(i);
  return out;
}

// runtime_sim.compact.compact_aged: move c's aged blocks, oldest first, while the compact region has free
// blocks: all of them, or at most limit (> 0; the ladder asks for what its step is short of).
std::vector<std::tuple<int, int, int>> Runner::Impl::compact_aged(Conv& c, int horizon, int limit) {
  std::vector<std::tuple<int, int, int>> moved;
  BlockManager& main = pool->main();
  const std::vector<int> aged = aged_blocks(c.seq, horizon);
  if (aged.empty() || !main.num_free_compact()) return moved;
  const std::vector<LayerPool> views = ensure_pool_views();
  const int n = main.num_blocks();
  for (int i : aged) {
    if (!main.num_free_compact() || (limit > 0 && static_cast<int>(moved.size()) >= limit)) break;
    const std::pair<int, int> ids = main.compact(c.seq, i);  // the default block is freed, its records intact
    requantize_block(views, ids.first, ids.second - n);
    moved.emplace_back(i, ids.first, ids.second);
  }
  return moved;
}

std::vector<std::tuple<int, int, int>> Runner::compact(int conv, int horizon) {
  std::lock_guard<std::mutex> g(impl_->mu);
  Impl& m = *impl_;
  if (horizon < 1)
    throw RunnerError(ErrorCode::kArgument, "horizon " + std::to_string(horizon) + " is invalid: give the number of "
                                            "recent tokens kept in the default region (>= 1).");
  if (!m.num_compact_blocks || m.groups[0].window)
    throw RunnerError(ErrorCode::kArgument, "this model has no compact region: export it with `pagedkv export "
                                            "--compact-blocks N` to use the compact tier.");
  Impl::Conv& c = m.conv(conv);
  if (!c.spill.empty())
    throw RunnerError(ErrorCode::kState, "conversation " + std::to_string(conv) + " lies in a spill file: its next "
                                         "turn restores it; compact it then.");
  auto moved = m.compact_aged(c, horizon);
  m.pool->check_invariants();
  m.refresh_stats();
  return moved;
}

std::vector<uint8_t> Runner::block_kinds(int conv) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  const Impl& m = *impl_;
  auto it = m.convs.find(conv);
  if (it == m.convs.end())
    throw RunnerError(ErrorCode::kState, "unknown conversation " + std::to_string(conv) + ": create one with new_conversation()");
  std::vector<uint8_t> out;
  if (!it->second.spill.empty()) return out;
  const BlockManager& main = m.pool->main();
  for (int32_t b : main.blocks(it->second.seq))
    out.push_back(b < 0 ? kBlockHole : b < main.num_blocks() ? kBlockDefault : kBlockCompact);
  return out;
}

}  // namespace pagedkv_rt
