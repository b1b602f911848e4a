// ExecuTorch kernel library: registers pagedkv::quantized_paged_attention.out (the in-place form:
// codes/scales/stage are mutable buffers updated in place; `out` is [1, T, Hq, D] float32) and
// pagedkv::quantized_paged_attention_mixed.out (the mixed-table op of the compact tier: compact_codes and
// compact_scales after stage, read only, and the compact spec's scalars last).
//
// It also remembers, per layer, where the pool tensors of the most recent successful call live
// (pagedkv_et_pool_view): the program's mutable buffers are otherwise out of reach of a host that runs
// the .pte through ExecuTorch's Python bindings, and a runtime needs them to copy blocks (fork /
// copy-on-write of a conversation) and tests need them to compare pools. The addresses stay valid as
// long as the loaded program lives (its planned memory does not move).
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/platform/log.h>
#ifndef ET_USE_THREADPOOL
#error "build with ET_USE_THREADPOOL and link libexecutorch_threadpool: the op runs on ExecuTorch's threadpool"
#endif
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "pagedkv_core.h"
#include "pagedkv_host.h"

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

struct TensorDims {
  int64_t d[8] = {0};
  int n = 0;
  explicit TensorDims(const Tensor& t) {
    n = (int)t.dim() > 8 ? 8 : (int)t.dim();
    for (int i = 0; i < n; ++i) d[i] = t.size(i);
  }
  pagedkv::Dims dims() const { return pagedkv::Dims{d, n}; }
};

struct PoolView {
  void* data[3] = {nullptr, nullptr, nullptr};  // codes, scales, stage
  int64_t nbytes[3] = {0, 0, 0};
};
std::mutex g_views_mutex;
std::vector<PoolView> g_views;  // by layer

void remember_pools(int64_t layer, Tensor& codes, Tensor& scales, Tensor& stage) {
  if (layer < 0 || layer > 4096) return;
  std::lock_guard<std::mutex> lk(g_views_mutex);
  if ((size_t)layer >= g_views.size()) g_views.resize((size_t)layer + 1);
  PoolView& v = g_views[(size_t)layer];
  Tensor* t[3] = {&codes, &scales, &stage};
  for (int i = 0; i < 3; ++i) {
    v.data[i] = t[i]->mutable_data_ptr();
    v.nbytes[i] = (int64_t)t[i]->nbytes();
  }
}

// pagedkv::HostPool::run on ExecuTorch's threadpool. parallel_for makes one task per thread (inline when
// the pool has one thread or the caller already runs inside it); each task takes the next item until
// none is left, so a worker that wakes late takes what remains instead of its fixed share (the caller,
// done with its own, would otherwise take that whole share too).
void run_on_et_threadpool(void*, int n, void (*fn)(void*, int), void* arg) {
  std::atomic<int> next{0};
  executorch::extension::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    for (int i; (i = next.fetch_add(1)) < n;) fn(arg, i);
  });
}

Tensor& fail(KernelRuntimeContext& ctx, Tensor& out, const char* msg) {
  ET_LOG(Error, "%s", msg);
  ctx.fail(Error::InvalidArgument);
  return out;
}

// Both ops (defined below the kernels): the compact tensors and scalars are null for the default op.
Tensor& run_op(KernelRuntimeContext&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&,
               const Tensor*, const Tensor*, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
               const pagedkv::OpScalars&, const pagedkv::CompactScalars*, Tensor&);

Tensor& quantized_paged_attention_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                      Tensor& codes, Tensor& scales, Tensor& stage, const Tensor& positions,
                                      const Tensor& seq_ids, const Tensor& block_tables, const Tensor& sinks,
                                      int64_t layer, int64_t k_bits, int64_t v_bits, int64_t k_group, int64_t v_group,
                                      bool k_sym, bool v_sym, bool rotate, bool fp_tail, int64_t sink_blocks,
                                      double scale, int64_t window, double softcap, Tensor& out) {
  pagedkv::OpScalars s;
  s.layer = layer, s.k_bits = k_bits, s.v_bits = v_bits, s.k_group = k_group, s.v_group = v_group;
  s.k_sym = k_sym, s.v_sym = v_sym, s.rotate = rotate, s.fp_tail = fp_tail, s.sink_blocks = sink_blocks;
  s.scale = scale, s.window = window, s.softcap = softcap;
  return run_op(ctx, q, k, v, codes, scales, stage, nullptr, nullptr, positions, seq_ids, block_tables, sinks, s,
                nullptr, out);
}

Tensor& quantized_paged_attention_mixed_out(
    KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& codes, Tensor& scales,
    Tensor& stage, const Tensor& compact_codes, const Tensor& compact_scales, const Tensor& positions,
    const Tensor& seq_ids, const Tensor& block_tables, const Tensor& sinks, int64_t layer, int64_t k_bits,
    int64_t v_bits, int64_t k_group, int64_t v_group, bool k_sym, bool v_sym, bool rotate, bool fp_tail,
    int64_t sink_blocks, double scale, int64_t window, double softcap, int64_t ck_bits, int64_t cv_bits,
    int64_t ck_group, int64_t cv_group, bool ck_sym, bool cv_sym, Tensor& out) {
  pagedkv::OpScalars s;
  s.layer = layer, s.k_bits = k_bits, s.v_bits = v_bits, s.k_group = k_group, s.v_group = v_group;
  s.k_sym = k_sym, s.v_sym = v_sym, s.rotate = rotate, s.fp_tail = fp_tail, s.sink_blocks = sink_blocks;
  s.scale = scale, s.window = window, s.softcap = softcap;
  pagedkv::CompactScalars c;
  c.ck_bits = ck_bits, c.cv_bits = cv_bits, c.ck_group = ck_group, c.cv_group = cv_group;
  c.ck_sym = ck_sym, c.cv_sym = cv_sym;
  return run_op(ctx, q, k, v, codes, scales, stage, &compact_codes, &compact_scales, positions, seq_ids, block_tables,
                sinks, s, &c, out);
}

Tensor& run_op(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& codes,
               Tensor& scales, Tensor& stage, const Tensor* compact_codes, const Tensor* compact_scales,
               const Tensor& positions, const Tensor& seq_ids, const Tensor& block_tables, const Tensor& sinks,
               const pagedkv::OpScalars& s, const pagedkv::CompactScalars* compact, Tensor& out) {
  const int64_t layer = s.layer;
  if (q.scalar_type() != ScalarType::Float || k.scalar_type() != ScalarType::Float ||
      v.scalar_type() != ScalarType::Float || out.scalar_type() != ScalarType::Float)
    return fail(ctx, out, "pagedkv: q, k, v and out must be float32");
  if (scales.scalar_type() != ScalarType::Half || stage.scalar_type() != ScalarType::Half)
    return fail(ctx, out, "pagedkv: scales and stage must be float16");
  if (positions.scalar_type() != ScalarType::Long || seq_ids.scalar_type() != ScalarType::Long ||
      block_tables.scalar_type() != ScalarType::Long)
    return fail(ctx, out, "pagedkv: positions, seq_ids and block_tables must be int64");
  if (sinks.numel() && sinks.scalar_type() != ScalarType::Float) return fail(ctx, out, "pagedkv: sinks must be float32");
  const ScalarType cst = codes.scalar_type();
  const pagedkv::CodesType ct = cst == ScalarType::Byte    ? pagedkv::CodesType::kUInt8
                                : cst == ScalarType::Half  ? pagedkv::CodesType::kFloat16
                                : cst == ScalarType::Float ? pagedkv::CodesType::kFloat32
                                                           : pagedkv::CodesType::kOther;
  char err[1024] = {0};
  pagedkv::PagedAttnParams p;
  TensorDims dq(q), dk(k), dv(v), dc(codes), ds(scales), dst(stage), dp(positions), di(seq_ids), dt(block_tables),
      dsk(sinks);
  int rc = pagedkv::params_from_shapes(dq.dims(), dk.dims(), dv.dims(), dc.dims(), ct, ds.dims(), dst.dims(), dp.dims(),
                                       di.dims(), dt.dims(), dsk.dims(), s, &p, err, sizeof err);
  if (rc) return fail(ctx, out, err);
  if (compact) {
    if (compact_codes->scalar_type() != ScalarType::Byte || compact_scales->scalar_type() != ScalarType::Half)
      return fail(ctx, out, "pagedkv: compact_codes must be uint8 and compact_scales float16");
    TensorDims dcc(*compact_codes), dcs(*compact_scales);
    rc = pagedkv::compact_params_from_shapes(dcc.dims(), pagedkv::CodesType::kUInt8, dcs.dims(), *compact, &p, err,
                                             sizeof err);
    if (rc) return fail(ctx, out, err);
  }
  const executorch::aten::SizesType want[4] = {1, (executorch::aten::SizesType)p.T, (executorch::aten::SizesType)p.Hq,
                                               (executorch::aten::SizesType)p.D};
  if (executorch::runtime::resize_tensor(out, executorch::aten::ArrayRef<executorch::aten::SizesType>(want, 4)) !=
      Error::Ok)
    return fail(ctx, out, "pagedkv: cannot resize out to [1, T, Hq, D]");
  pagedkv::PagedAttnBuffers b;
  b.q = q.const_data_ptr<float>();
  b.k = k.const_data_ptr<float>();
  b.v = v.const_data_ptr<float>();
  b.codes = codes.mutable_data_ptr();
  b.scales = static_cast<uint16_t*>(scales.mutable_data_ptr());
  b.stage = static_cast<uint16_t*>(stage.mutable_data_ptr());
  b.positions = positions.const_data_ptr<int64_t>();
  b.seq_ids = seq_ids.const_data_ptr<int64_t>();
  b.block_tables = block_tables.const_data_ptr<int64_t>();
  b.sinks = sinks.numel() ? sinks.const_data_ptr<float>() : nullptr;
  b.out = out.mutable_data_ptr<float>();
  if (compact) {
    b.compact_codes = compact_codes->const_data_ptr<uint8_t>();
    b.compact_scales = static_cast<const uint16_t*>(compact_scales->const_data_ptr());
  }
  pagedkv::HostPool host;  // ExecuTorch's threadpool (the one XNNPACK runs the linears on)
  host.run = run_on_et_threadpool;
  rc = pagedkv::paged_attention(p, b, err, sizeof err, &host);
  if (rc) return fail(ctx, out, err);
  remember_pools(layer, codes, scales, stage);
  return out;
}

}  // namespace

// Where the pool tensor `which` (0 codes, 1 scales, 2 stage) of `layer` lived in the most recent
// successful call of the op for that layer. Returns 1 and sets *data / *nbytes, or 0 if that layer
// has not run yet.
extern "C" __attribute__((visibility("default"))) int pagedkv_et_pool_view(int64_t layer, int which, void** data,
                                                                           int64_t* nbytes) {
  std::lock_guard<std::mutex> lk(g_views_mutex);
  if (layer < 0 || (size_t)layer >= g_views.size() || which < 0 || which > 2) return 0;
  const PoolView& v = g_views[(size_t)layer];
  if (!v.data[which]) return 0;
  *data = v.data[which];
  *nbytes = v.nbytes[which];
  return 1;
}

EXECUTORCH_LIBRARY(pagedkv, "quantized_paged_attention.out", quantized_paged_attention_out);
EXECUTORCH_LIBRARY(pagedkv, "quantized_paged_attention_mixed.out", quantized_paged_attention_mixed_out);
