// A plain C entry point to the whole op, for hosts without a runtime of their own: Python through
// ctypes (toolkit/native_op.py runs `pagedkv eval` on it), tests, other languages. Same shapes and
// checks as the onnxruntime and ExecuTorch hosts (params_from_shapes); parallel work on the core's
// own thread pool.
#include <cstdint>

#include "pagedkv_core.h"
#include "pagedkv_host.h"

namespace {
using namespace pagedkv;

CodesType codes_type_of(int codes_type) {
  return codes_type == 0 ? CodesType::kUInt8
         : codes_type == 1 ? CodesType::kFloat16
         : codes_type == 2 ? CodesType::kFloat32
                           : CodesType::kOther;
}

// The op's scalar arguments in schema order (toolkit.paged_attention.SCALAR_ARG_NAMES), as doubles.
OpScalars op_scalars(const double* scalars) {
  OpScalars s;
  s.layer = (int64_t)scalars[0];
  s.k_bits = (int64_t)scalars[1];
  s.v_bits = (int64_t)scalars[2];
  s.k_group = (int64_t)scalars[3];
  s.v_group = (int64_t)scalars[4];
  s.k_sym = scalars[5] != 0;
  s.v_sym = scalars[6] != 0;
  s.rotate = scalars[7] != 0;
  s.fp_tail = scalars[8] != 0;
  s.sink_blocks = (int64_t)scalars[9];
  s.scale = scalars[10];
  s.window = (int64_t)scalars[11];
  s.softcap = scalars[12];
  return s;
}

// The default op's tensors: data[0..9] = q, k, v, codes, scales, stage, positions, seq_ids,
// block_tables, sinks; out = data[10].
PagedAttnBuffers op_buffers(void* const* data, const Dims* d) {
  PagedAttnBuffers b;
  b.q = static_cast<const float*>(data[0]);
  b.k = static_cast<const float*>(data[1]);
  b.v = static_cast<const float*>(data[2]);
  b.codes = data[3];
  b.scales = static_cast<uint16_t*>(data[4]);
  b.stage = static_cast<uint16_t*>(data[5]);
  b.positions = static_cast<const int64_t*>(data[6]);
  b.seq_ids = static_cast<const int64_t*>(data[7]);
  b.block_tables = static_cast<const int64_t*>(data[8]);
  b.sinks = d[9].numel() > 0 ? static_cast<const float*>(data[9]) : nullptr;
  b.out = static_cast<float*>(data[10]);
  return b;
}
}  // namespace

// data: q, k, v, codes, scales, stage, positions, seq_ids, block_tables, sinks, out (11 pointers;
//       sinks may be null when its shape has 0 elements); the pools are updated in place.
// shapes / ndims: the shapes of the first 10 tensors (out is [1, T, Hq, D] float32).
// codes_type: 0 uint8, 1 float16, 2 float32.
// scalars: the op's scalar arguments in schema order (layer, k_bits, v_bits, k_group, v_group, k_sym,
//          v_sym, rotate, fp_tail, sink_blocks, scale, window, softcap), as doubles.
// Returns 0, or a pagedkv::Status with a message in err.
extern "C" PAGEDKV_C_API int pagedkv_call_op(void* const* data, const int64_t* const* shapes, const int* ndims,
                                            int codes_type, const double* scalars, char* err, size_t err_len) {
  Dims d[10];
  for (int i = 0; i < 10; ++i) d[i] = Dims{shapes[i], ndims[i]};
  const OpScalars s = op_scalars(scalars);
  PagedAttnParams p;
  int rc = params_from_shapes(d[0], d[1], d[2], d[3], codes_type_of(codes_type), d[4], d[5], d[6], d[7], d[8], d[9], s,
                              &p, err, err_len);
  if (rc) return rc;
  return paged_attention(p, op_buffers(data, d), err, err_len);
}

// The mixed op (pagedkv::quantized_paged_attention_mixed): the default op's 11 pointers and 10 shapes as
// above, then compact_codes (uint8) and compact_scales (float16) as data[11], data[12] and shapes[10],
// shapes[11] (read only); scalars: the default op's 13, then the compact spec's 6 (ck_bits, cv_bits,
// ck_group, cv_group, ck_sym, cv_sym; COMPACT_SCALAR_ARG_NAMES).
extern "C" PAGEDKV_C_API int pagedkv_call_op_mixed(void* const* data, const int64_t* const* shapes, const int* ndims,
                                                  int codes_type, const double* scalars, char* err, size_t err_len) {
  Dims d[12];
  for (int i = 0; i < 12; ++i) d[i] = Dims{shapes[i], ndims[i]};
  const OpScalars s = op_scalars(scalars);
  CompactScalars compact;
  compact.ck_bits = (int64_t)scalars[13];
  compact.cv_bits = (int64_t)scalars[14];
  compact.ck_group = (int64_t)scalars[15];
  compact.cv_group = (int64_t)scalars[16];
  compact.ck_sym = scalars[17] != 0;
  compact.cv_sym = scalars[18] != 0;
  PagedAttnParams p;
  int rc = params_from_shapes(d[0], d[1], d[2], d[3], codes_type_of(codes_type), d[4], d[5], d[6], d[7], d[8], d[9], s,
                              &p, err, err_len);
  if (rc) return rc;
  rc = compact_params_from_shapes(d[10], CodesType::kUInt8, d[11], compact, &p, err, err_len);
  if (rc) return rc;
  PagedAttnBuffers b = op_buffers(data, d);
  b.compact_codes = static_cast<const uint8_t*>(data[11]);
  b.compact_scales = static_cast<const uint16_t*>(data[12]);
  return paged_attention(p, b, err, err_len);
}
