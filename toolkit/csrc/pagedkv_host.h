// Shared by the ExecuTorch and onnxruntime hosts: turn tensor shapes + the op's scalar arguments into
// PagedAttnParams, checking every shape. Header only, no framework headers.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <cstdio>

#include "pagedkv_core.h"

namespace pagedkv {

struct Dims {
  const int64_t* d = nullptr;
  int n = 0;
  int64_t numel() const {
    int64_t m = 1;
    for (int i = 0; i < n; ++i) m *= d[i];
    return m;
  }
};

enum class CodesType { kUInt8, kFloat16, kFloat32, kOther };

struct OpScalars {
  int64_t layer = 0, k_bits = 8, v_bits = 4, k_group = 64, v_group = 32;
  bool k_sym = true, v_sym = false, rotate = true, fp_tail = true;
  int64_t sink_blocks = 1;
  double scale = 1.0;
  int64_t window = 0;
  double softcap = 0.0;
};

// The mixed op's compact spec (its last scalar arguments; defaults: toolkit.kv_spec.COMPACT_SPEC).
struct CompactScalars {
  int64_t ck_bits = 4, cv_bits = 3, ck_group = 64, cv_group = 64;
  bool ck_sym = true, cv_sym = false;
};

inline int host_fail(char* err, size_t len, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (err && len) std::vsnprintf(err, len, fmt, ap);
  va_end(ap);
  return kErrShape;
}

// Returns kOk or kErrShape (message in err).
inline int params_from_shapes(Dims q, Dims k, Dims v, Dims codes, CodesType ct, Dims scales, Dims stage,
                              Dims positions, Dims seq_ids, Dims tables, Dims sinks, const OpScalars& s,
                              PagedAttnParams* out, char* err, size_t len) {
  PagedAttnParams p;
  if (q.n != 4 || q.d[0] != 1) return host_fail(err, len, "pagedkv: q must be [1, Hq, T, D]");
  if (k.n != 4 || v.n != 4 || k.d[0] != 1 || v.d[0] != 1)
    return host_fail(err, len, "pagedkv: k and v must be [1, Hkv, T, D]");
  p.Hq = (int)q.d[1];
  p.T = (int)q.d[2];
  p.D = (int)q.d[3];
  p.Hkv = (int)k.d[1];
  for (int i = 1; i < 4; ++i)
    if (k.d[i] != v.d[i]) return host_fail(err, len, "pagedkv: k and v shapes differ");
  if (k.d[2] != p.T || k.d[3] != p.D) return host_fail(err, len, "pagedkv: k/v [1,Hkv,T,D] do not match q [1,Hq,T,D]");
  if (ct == CodesType::kOther) return host_fail(err, len, "pagedkv: codes must be uint8, float16 or float32");
  if (codes.n != 4) return host_fail(err, len, "pagedkv: codes must be [num_blocks, Hkv, block_size, width]");
  p.num_blocks = (int)codes.d[0];
  p.block_size = (int)codes.d[2];
  p.code_width = (int)codes.d[3];
  if (codes.d[1] != p.Hkv)
    return host_fail(err, len, "pagedkv: codes has %lld KV heads, k has %d", (long long)codes.d[1], p.Hkv);
  p.float_pool = ct != CodesType::kUInt8;
  p.float_bits = ct == CodesType::kFloat16 ? 16 : 32;
  p.k_bits = (int)s.k_bits;
  p.v_bits = (int)s.v_bits;
  p.k_group = (int)s.k_group;
  p.v_group = (int)s.v_group;
  p.k_sym = s.k_sym;
  p.v_sym = s.v_sym;
  p.rotate = s.rotate;
  p.fp_tail = s.fp_tail;
  p.sink_blocks = (int)s.sink_blocks;
  p.scale = (float)s.scale;
  p.window = (int)s.window;
  p.softcap = (float)s.softcap;
  p.layer = (int)s.layer;
  if (!p.float_pool) {
    if (scales.n != 4 || scales.d[0] != codes.d[0] || scales.d[1] != codes.d[1] || scales.d[2] != codes.d[2])
      return host_fail(err, len, "pagedkv: scales must be [num_blocks, Hkv, block_size, scale_width] like codes");
    p.scale_width = (int)scales.d[3];
  }
  if (stage.n != 6 || stage.d[1] != 2 || stage.d[2] != 2 || stage.d[3] != p.Hkv || stage.d[4] != p.block_size ||
      stage.d[5] != p.D)
    return host_fail(err, len, "pagedkv: stage must be [S, 2, 2, Hkv, block_size, D]");
  p.stage_rows = (int)stage.d[0];
  if (positions.numel() != p.T || seq_ids.numel() != p.T)
    return host_fail(err, len, "pagedkv: positions and seq_ids need T=%d entries", p.T);
  if (tables.n != 2) return host_fail(err, len, "pagedkv: block_tables must be [S, max_blocks]");
  p.table_rows = (int)tables.d[0];
  p.max_blocks_per_seq = (int)tables.d[1];
  if (sinks.numel() != p.Hq && sinks.numel() != 0)
    return host_fail(err, len, "pagedkv: sinks needs Hq=%d entries (or none)", p.Hq);
  *out = p;
  return kOk;
}

// The mixed op's compact region (after params_from_shapes): compact_codes uint8 [NC, Hkv, block_size, CW],
// compact_scales float16 [NC, Hkv, block_size, CWs] (the caller checks the dtypes it can see).
inline int compact_params_from_shapes(Dims ccodes, CodesType cct, Dims cscales, const CompactScalars& c,
                                      PagedAttnParams* p, char* err, size_t len) {
  if (cct != CodesType::kUInt8) return host_fail(err, len, "pagedkv: compact_codes must be uint8");
  if (ccodes.n != 4 || ccodes.d[1] != p->Hkv || ccodes.d[2] != p->block_size)
    return host_fail(err, len, "pagedkv: compact_codes must be [num_compact_blocks, Hkv=%d, block_size=%d, width]",
                     p->Hkv, p->block_size);
  if (cscales.n != 4 || cscales.d[0] != ccodes.d[0] || cscales.d[1] != ccodes.d[1] || cscales.d[2] != ccodes.d[2])
    return host_fail(err, len,
                     "pagedkv: compact_scales must be [num_compact_blocks, Hkv, block_size, scale_width] like "
                     "compact_codes");
  p->num_compact = (int)ccodes.d[0];
  p->compact_code_width = (int)ccodes.d[3];
  p->compact_scale_width = (int)cscales.d[3];
  p->ck_bits = (int)c.ck_bits;
  p->cv_bits = (int)c.cv_bits;
  p->ck_group = (int)c.ck_group;
  p->cv_group = (int)c.cv_group;
  p->ck_sym = c.ck_sym;
  p->cv_sym = c.cv_sym;
  return kOk;
}

}  // namespace pagedkv
