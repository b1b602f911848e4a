// pagedkv kernel core: the op (validate -> rotate -> write -> attend -> tail stage), the scalar
// attention path and the choice of code path. The record format is in pagedkv_quant.cpp, the threads
// in pagedkv_threads.cpp, the SIMD attention paths in pagedkv_core_<isa>.cpp: the attention loop is
// impl::Attend (pagedkv_attn_impl.h), its fused quantized path written once over a vector wrapper per
// ISA for AVX2 and NEON (pagedkv_attn_fused.h over pagedkv_vec_<isa>.h) and by hand for AVX-512
// (pagedkv_avx512_*.h). Compiled WITHOUT -ffast-math and with -ffp-contract=off, like the record
// format: the op's writes must be bit exact.
#include "pagedkv_core.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "pagedkv_attn_impl.h"
#include "pagedkv_internal.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

namespace pagedkv {

// ------------------------------------------------------------------------------------------------
// scalar attention path

namespace {
struct ScalarOps {
  static float dot(const float* a, const float* b, int n) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
      s0 += a[i] * b[i];
      s1 += a[i + 1] * b[i + 1];
      s2 += a[i + 2] * b[i + 2];
      s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; ++i) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
  }
  static void axpy(float* y, float a, const float* x, int n) {
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
  }
  static void scale(float* y, float a, int n) {
    for (int i = 0; i < n; ++i) y[i] *= a;
  }
  static void f16_to_f32(const uint16_t* h, float* out, int n) {
    for (int i = 0; i < n; ++i) out[i] = fp16_to_fp32(h[i]);
  }
  static void unpack4(const uint8_t* codes, int n, uint8_t* out) { unpack_codes(codes, 4, n, out); }
  static void dequant_u8(const uint8_t* u, const uint16_t* meta, int d, int group, bool sym, int bits, float* out) {
    const int ng = d / group;
    const float c = (float)(1 << (bits - 1));
    for (int g = 0; g < ng; ++g) {
      const float s = fp16_to_fp32(meta[g]);
      const int i0 = g * group, i1 = i0 + group;
      if (sym) {
        for (int i = i0; i < i1; ++i) out[i] = ((float)u[i] - c) * s;
      } else {
        const float z = fp16_to_fp32(meta[ng + g]);
        for (int i = i0; i < i1; ++i) out[i] = (float)u[i] * s + z;
      }
    }
  }
};
}  // namespace

void attend_scalar(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<ScalarOps> a(c, scratch);
  a(t, h);
}

// ------------------------------------------------------------------------------------------------
// code path selection

bool isa_available(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
#if defined(PAGEDKV_HAVE_AVX2)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
      return false;
#endif
    case Isa::kAvx512:
#if defined(PAGEDKV_HAVE_AVX512)
      return isa_available(Isa::kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
      return false;
#endif
    case Isa::kAvx512Vnni:
#if defined(PAGEDKV_HAVE_AVX512)
      return isa_available(Isa::kAvx512) && __builtin_cpu_supports("avx512vnni");
#else
      return false;
#endif
    case Isa::kNeon:
#if defined(PAGEDKV_HAVE_NEON)
      return true;
#else
      return false;
#endif
    case Isa::kNeonDot:
#if defined(PAGEDKV_HAVE_NEON) && defined(__linux__)
      return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
      return false;
#endif
  }
  return false;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Vnni: return "avx512-vnni";
    case Isa::kNeon: return "neon";
    case Isa::kNeonDot: return "neon-dotprod";
  }
  return "?";
}

static Isa best_isa() {
  const char* env = std::getenv("PAGEDKV_ISA");
  if (env) {
    for (Isa i : kAllIsas)
      if (std::strcmp(env, isa_name(i)) == 0 && isa_available(i)) return i;
  }
  for (Isa i : {Isa::kNeonDot, Isa::kNeon, Isa::kAvx512Vnni, Isa::kAvx512, Isa::kAvx2})
    if (isa_available(i)) return i;
  return Isa::kScalar;
}

static std::atomic<int> g_isa{-1};

Isa active_isa() {
  int v = g_isa.load();
  if (v < 0) {
    v = (int)best_isa();
    g_isa.store(v);
  }
  return (Isa)v;
}

bool set_isa(Isa isa) {
  if (!isa_available(isa)) return false;
  g_isa.store((int)(isa == Isa::kAuto ? best_isa() : isa));
  return true;
}

static AttendFn attend_fn(Isa isa) {
  switch (isa) {
#if defined(PAGEDKV_HAVE_AVX2)
    case Isa::kAvx2: return attend_avx2;
#endif
#if defined(PAGEDKV_HAVE_AVX512)
    case Isa::kAvx512: return attend_avx512;
    case Isa::kAvx512Vnni: return attend_avx512_vnni;
#endif
#if defined(PAGEDKV_HAVE_NEON)
    case Isa::kNeon: return attend_neon;
    case Isa::kNeonDot: return attend_neon_dot;
#endif
    default: return attend_scalar;
  }
}

// ------------------------------------------------------------------------------------------------
// the op

namespace {
void set_err(char* err, size_t len, const char* fmt, ...) {
  if (!err || len == 0) return;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(err, len, fmt, ap);
  va_end(ap);
}

bool all_finite(const float* x, int n) {
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

// Split-K: at least kSplitItems (token, KV head, part) items, parts of at least 16 blocks. Each part
// repeats the per-item set-up (the prepared query, the state, a cold first run, the merge): with 33
// items instead of 12 the 16K step at SmolLM2 dims (3 KV heads) measured 3% slower with 1 thread and 9%
// with 2 (core bench). 12 parts share out evenly over 2, 3, 4 or 6 threads.
constexpr int64_t kSplitItems = 12;
constexpr int64_t kSplitMinBlocks = 16;
// Waking the pool's threads costs tens of microseconds: a call whose attention work (visible keys x
// KV heads x (query heads per KV head + 1) x head_dim) is below this runs on the calling thread
// (measured on the 2-core dev VM: 2 threads were slower up to ~1K cached tokens at SmolLM2 dims).
constexpr int64_t kParallelMinWork = int64_t(3) << 19;

// What the params resolve to, for every stage of one call.
struct CallSpec {
  bool quantized, use_sink, use_tail, rotate;
  int kg, vg;    // group sizes (0 in the params = head_dim)
  int kcb, ksc;  // K code bytes and K scale count of a record (V follows)
  bool compact;  // a compact region (num_compact > 0)
  int ckg, cvg, ckcb, cksc;  // the same for the compact spec
};

// This thread's buffers of one call (reused by the next).
struct CallScratch {
  std::vector<float> qrot, krot, vrot, partial;  // token-major, rotated when the spec rotates
  std::vector<uint16_t> k16, v16;                // fp16 of krot/vrot (sink and tail stages)
  std::vector<int32_t> n_prev, count;            // per token: earlier tokens of its sequence in the call
  std::vector<int64_t> last_pos;                 // per sequence: its last position in the call
};
thread_local CallScratch tl_call;

// The compact region of a mixed call (POOL_FORMAT.md "Compact region"): its spec and record widths.
int check_compact(const PagedAttnParams& P, const PagedAttnBuffers& B, CallSpec* s, char* err, size_t err_len) {
  const int D = P.D;
  s->compact = P.num_compact > 0;
  s->ckg = P.ck_group ? P.ck_group : D;
  s->cvg = P.cv_group ? P.cv_group : D;
  s->ckcb = s->cksc = 0;
  if (P.num_compact < 0) {
    set_err(err, err_len, "pagedkv: %d compact blocks (use 0 for none)", P.num_compact);
    return kErrShape;
  }
  if (!s->compact) return kOk;
  if (!s->quantized) {
    set_err(err, err_len, "pagedkv: a compact region needs a quantized pool (this pool is float%d)", P.float_bits);
    return kErrShape;
  }
  for (int bits : {P.ck_bits, P.cv_bits})
    if (bits < 2 || bits > 8 || (D * bits) % 8) {
      set_err(err, err_len, "pagedkv: unsupported compact bits %d for head_dim %d (use 2..8 with whole bytes)", bits,
              D);
      return kErrShape;
    }
  if (s->ckg <= 0 || s->cvg <= 0 || D % s->ckg || D % s->cvg) {
    set_err(err, err_len, "pagedkv: compact group sizes k=%d v=%d must divide head_dim %d", P.ck_group, P.cv_group, D);
    return kErrShape;
  }
  int cw, sw;
  compact_record_widths(P, &cw, &sw);
  if (P.compact_code_width != cw || P.compact_scale_width != sw) {
    set_err(err, err_len,
            "pagedkv: compact record widths (codes %d, scales %d) do not match the compact spec and head_dim %d "
            "(expected codes %d, scales %d): the compact region was allocated for another compact spec",
            P.compact_code_width, P.compact_scale_width, D, cw, sw);
    return kErrShape;
  }
  if (!B.compact_codes || !B.compact_scales) {
    set_err(err, err_len, "pagedkv: %d compact blocks but no compact codes/scales data", P.num_compact);
    return kErrShape;
  }
  s->ckcb = D * P.ck_bits / 8;
  s->cksc = (D / s->ckg) * (P.ck_sym ? 1 : 2);
  return kOk;
}

// Shapes, spec and record widths; nothing about the data yet.
int check_shapes(const PagedAttnParams& P, const PagedAttnBuffers& B, CallSpec* s, char* err, size_t err_len) {
  const int T = P.T, Hq = P.Hq, Hkv = P.Hkv, D = P.D, bs = P.block_size, M = P.max_blocks_per_seq;
  if (T < 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || bs <= 0 || P.num_blocks <= 0 || M <= 0 || P.table_rows <= 0) {
    set_err(err, err_len, "pagedkv: bad shapes (T=%d Hq=%d Hkv=%d D=%d block_size=%d num_blocks=%d M=%d rows=%d)",
            T, Hq, Hkv, D, bs, P.num_blocks, M, P.table_rows);
    return kErrShape;
  }
  if (Hq % Hkv) {
    set_err(err, err_len, "pagedkv: %d query heads is not a multiple of %d KV heads", Hq, Hkv);
    return kErrShape;
  }
  s->quantized = !P.float_pool;
  s->kg = P.k_group ? P.k_group : D;
  s->vg = P.v_group ? P.v_group : D;
  if (s->quantized) {
    for (int bits : {P.k_bits, P.v_bits})
      if (bits < 2 || bits > 8 || (D * bits) % 8) {
        set_err(err, err_len, "pagedkv: unsupported bits %d for head_dim %d (use 2..8 with whole bytes)", bits, D);
        return kErrShape;
      }
    if (s->kg <= 0 || s->vg <= 0 || D % s->kg || D % s->vg) {
      set_err(err, err_len, "pagedkv: group sizes k=%d v=%d must divide head_dim %d", P.k_group, P.v_group, D);
      return kErrShape;
    }
    if (P.rotate && (D & (D - 1))) {
      set_err(err, err_len, "pagedkv: rotate needs a power-of-two head_dim, got %d", D);
      return kErrShape;
    }
    if (P.sink_blocks != 0 && P.sink_blocks != 1) {
      set_err(err, err_len, "pagedkv: sink_blocks=%d (use 0 or 1)", P.sink_blocks);
      return kErrShape;
    }
  } else if (P.float_bits != 16 && P.float_bits != 32) {
    set_err(err, err_len, "pagedkv: float pool must be float16 or float32");
    return kErrShape;
  }
  int cw, sw;
  record_widths(P, &cw, &sw);
  if (P.code_width != cw || (s->quantized && P.scale_width != sw)) {
    set_err(err, err_len,
            "pagedkv: pool record widths (codes %d, scales %d) do not match the spec and head_dim %d "
            "(expected codes %d, scales %d): the pool was allocated for another KV spec",
            P.code_width, P.scale_width, D, cw, sw);
    return kErrShape;
  }
  s->use_sink = s->quantized && P.sink_blocks > 0;
  s->use_tail = s->quantized && P.fp_tail;
  s->rotate = s->quantized && P.rotate;
  s->kcb = s->quantized ? D * P.k_bits / 8 : D;
  s->ksc = s->quantized ? (D / s->kg) * (P.k_sym ? 1 : 2) : 0;
  if ((s->use_sink || s->use_tail) && (P.stage_rows <= 0 || !B.stage)) {
    set_err(err, err_len, "pagedkv: the spec keeps float sink/tail blocks but the stage tensor is empty");
    return kErrShape;
  }
  return check_compact(P, B, s, err, err_len);
}

// Every token's sequence slot, write block and block table (nothing written yet).
int check_slots(const PagedAttnParams& P, const PagedAttnBuffers& B, const CallSpec& s, char* err, size_t err_len) {
  const int bs = P.block_size, M = P.max_blocks_per_seq;
  const bool staged = s.use_sink || s.use_tail;
  for (int t = 0; t < P.T; ++t) {
    const int64_t seq = B.seq_ids[t], p = B.positions[t];
    if (seq < 0 || seq >= P.table_rows || (staged && seq >= P.stage_rows)) {
      set_err(err, err_len, "pagedkv: layer %d: sequence slot %lld out of range (block table rows %d, stage rows %d)",
              P.layer, (long long)seq, P.table_rows, staged ? P.stage_rows : P.table_rows);
      return kErrSlot;
    }
    if (p < 0 || p / bs >= M) {
      set_err(err, err_len,
              "pagedkv: layer %d: position %lld of sequence %lld does not fit the block table (%d blocks of %d)",
              P.layer, (long long)p, (long long)seq, M, bs);
      return kErrSlot;
    }
    const int64_t* row = B.block_tables + seq * M;
    const int64_t blk = row[p / bs];
    if (s.compact && blk >= P.num_blocks && blk < (int64_t)P.num_blocks + P.num_compact) {
      set_err(err, err_len,
              "pagedkv: layer %d: position %lld of sequence %lld maps to compact block %lld (id >= %d): new tokens "
              "are written to the pool's default region only; give the block table a default block there",
              P.layer, (long long)p, (long long)seq, (long long)blk, P.num_blocks);
      return kErrSlot;
    }
    if (blk < 0 || blk >= P.num_blocks) {
      set_err(err, err_len,
              "pagedkv: layer %d: sequence %lld position %lld has no valid block (block id %lld, pool has %d "
              "blocks): allocate the block before writing to it",
              P.layer, (long long)seq, (long long)p, (long long)blk, P.num_blocks);
      return kErrSlot;
    }
    const int64_t nblk = (int64_t)P.num_blocks + (s.compact ? P.num_compact : 0);  // ids of both regions
    for (int64_t b = 0; b < p / bs; ++b)
      if (row[b] < -1 || row[b] >= nblk) {
        if (s.compact)
          set_err(err, err_len,
                  "pagedkv: layer %d: block table of sequence %lld holds block id %lld (pool has %d blocks + %d "
                  "compact: use ids 0..%lld, or -1 for none)",
                  P.layer, (long long)seq, (long long)row[b], P.num_blocks, P.num_compact, (long long)nblk - 1);
        else
          set_err(err, err_len, "pagedkv: layer %d: block table of sequence %lld holds block id %lld (pool has %d blocks)",
                  P.layer, (long long)seq, (long long)row[b], P.num_blocks);
        return kErrSlot;
      }
  }
  return kOk;
}

// NaN/Inf in the new K or V (K first, like the reference): nothing may reach the pool.
int check_finite(const PagedAttnParams& P, const PagedAttnBuffers& B, char* err, size_t err_len) {
  for (int which = 0; which < 2; ++which) {
    const float* x = which ? B.v : B.k;
    for (int t = 0; t < P.T; ++t)
      for (int h = 0; h < P.Hkv; ++h)
        if (!all_finite(x + ((size_t)h * P.T + t) * P.D, P.D)) {
          set_err(err, err_len,
                  "non-finite %s (NaN or Inf) at layer %d, sequence %lld, position %lld: the model produced it "
                  "before the cache; nothing was written to the pool. Check the weights/dtype (fp16 overflow?) "
                  "or the input ids.",
                  which ? "V" : "K", P.layer, (long long)B.seq_ids[t], (long long)B.positions[t]);
          return kErrNonFinite;
        }
  }
  return kOk;
}

// q, k, v ([H, T, D]) -> token-major copies [T, H, D], Hadamard-rotated when the spec rotates; and
// their fp16 copies when the spec keeps float sink/tail blocks.
void rotate_inputs(const PagedAttnParams& P, const PagedAttnBuffers& B, const CallSpec& s, CallScratch& cs) {
  const int T = P.T, Hq = P.Hq, Hkv = P.Hkv, D = P.D;
  const size_t nq = (size_t)T * Hq * D, nk = (size_t)T * Hkv * D;
  if (cs.qrot.size() < nq) cs.qrot.resize(nq);
  if (cs.krot.size() < nk) cs.krot.resize(nk), cs.vrot.resize(nk);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < Hq; ++h) {
      float* dst = cs.qrot.data() + ((size_t)t * Hq + h) * D;
      std::memcpy(dst, B.q + ((size_t)h * T + t) * D, sizeof(float) * D);
      if (s.rotate) hadamard(dst, D);
    }
    for (int h = 0; h < Hkv; ++h) {
      float* kd = cs.krot.data() + ((size_t)t * Hkv + h) * D;
      float* vd = cs.vrot.data() + ((size_t)t * Hkv + h) * D;
      std::memcpy(kd, B.k + ((size_t)h * T + t) * D, sizeof(float) * D);
      std::memcpy(vd, B.v + ((size_t)h * T + t) * D, sizeof(float) * D);
      if (s.rotate) hadamard(kd, D), hadamard(vd, D);
    }
  }
  if (s.use_sink || s.use_tail) {
    if (cs.k16.size() < nk) cs.k16.resize(nk), cs.v16.resize(nk);
    for (size_t i = 0; i < nk; ++i) cs.k16[i] = fp32_to_fp16(cs.krot[i]), cs.v16[i] = fp32_to_fp16(cs.vrot[i]);
  }
}

// Each new token's K/V record into its block of the pool.
void write_records(const PagedAttnParams& P, const PagedAttnBuffers& B, const CallSpec& s, const CallScratch& cs) {
  const int Hkv = P.Hkv, D = P.D, bs = P.block_size, M = P.max_blocks_per_seq;
  const size_t W = (size_t)P.code_width, Ws = (size_t)P.scale_width;
  for (int t = 0; t < P.T; ++t) {
    const int64_t seq = B.seq_ids[t], p = B.positions[t];
    const int64_t blk = B.block_tables[seq * M + p / bs];
    for (int h = 0; h < Hkv; ++h) {
      const size_t rec = ((size_t)blk * Hkv + h) * bs + (size_t)(p % bs);
      const float* kx = cs.krot.data() + ((size_t)t * Hkv + h) * D;
      const float* vx = cs.vrot.data() + ((size_t)t * Hkv + h) * D;
      if (s.quantized) {
        uint8_t* codes = static_cast<uint8_t*>(B.codes) + rec * W;
        uint16_t* meta = B.scales + rec * Ws;
        quantize_record(kx, D, P.k_bits, s.kg, P.k_sym, codes, meta);
        quantize_record(vx, D, P.v_bits, s.vg, P.v_sym, codes + s.kcb, meta + s.ksc);
      } else if (P.float_bits == 16) {
        uint16_t* codes = static_cast<uint16_t*>(B.codes) + rec * W;
        for (int d = 0; d < D; ++d) codes[d] = fp32_to_fp16(kx[d]), codes[D + d] = fp32_to_fp16(vx[d]);
      } else {
        float* codes = static_cast<float*>(B.codes) + rec * W;
        std::memcpy(codes, kx, sizeof(float) * D);
        std::memcpy(codes + D, vx, sizeof(float) * D);
      }
    }
  }
}

// fp16 rows of token t into stage `which` (0 sink, 1 tail) of its sequence, at its place in the block.
void write_stage(const PagedAttnParams& P, const PagedAttnBuffers& B, const CallScratch& cs, int t, int which) {
  const int Hkv = P.Hkv, D = P.D, bs = P.block_size;
  const size_t stage_head = (size_t)bs * D, stage_kv = (size_t)Hkv * stage_head;
  const int64_t seq = B.seq_ids[t], p = B.positions[t];
  for (int kv = 0; kv < 2; ++kv)
    for (int h = 0; h < Hkv; ++h)
      std::memcpy(B.stage + ((size_t)seq * 4 + 2 * which + kv) * stage_kv + h * stage_head + (size_t)(p % bs) * D,
                  (kv ? cs.v16 : cs.k16).data() + ((size_t)t * Hkv + h) * D, sizeof(uint16_t) * D);
}

// Per token: the tokens of its sequence earlier in this call; per sequence: its last position.
void count_call_tokens(const PagedAttnParams& P, const PagedAttnBuffers& B, CallScratch& cs) {
  if (cs.n_prev.size() < (size_t)P.T) cs.n_prev.resize(P.T);
  if (cs.count.size() < (size_t)P.table_rows) cs.count.resize(P.table_rows), cs.last_pos.resize(P.table_rows);
  std::fill(cs.count.begin(), cs.count.begin() + P.table_rows, 0);
  std::fill(cs.last_pos.begin(), cs.last_pos.begin() + P.table_rows, (int64_t)-1);
  for (int t = 0; t < P.T; ++t) {
    const int64_t seq = B.seq_ids[t];
    cs.n_prev[t] = cs.count[seq]++;
    cs.last_pos[seq] = std::max(cs.last_pos[seq], B.positions[t]);
  }
}

// Split-K parts per (token, KV head): with few items (decode) each item's visible blocks are cut into
// parts so that several threads share one long sequence. Depends only on the shapes (never on the
// thread count), so results do not change with the threads.
int split_parts(const PagedAttnParams& P, const PagedAttnBuffers& B) {
  const int64_t items = (int64_t)P.T * P.Hkv;
  if (items >= kSplitItems) return 1;
  int64_t max_blocks = 0;
  for (int t = 0; t < P.T; ++t) {
    const int64_t p = B.positions[t];
    const int64_t lo = P.window > 0 ? std::max<int64_t>(0, p - P.window + 1) : 0;
    max_blocks = std::max(max_blocks, p / P.block_size - lo / P.block_size + 1);
  }
  const int64_t want = (kSplitItems + items - 1) / items;
  return (int)std::max<int64_t>(1, std::min<int64_t>(want, max_blocks / kSplitMinBlocks));
}

// Attention work of the call (visible keys x KV heads x (G + 1) x head_dim): decides the threads.
int64_t attention_work(const PagedAttnParams& P, const PagedAttnBuffers& B) {
  int64_t keys = 0;
  for (int t = 0; t < P.T; ++t) {
    const int64_t p = B.positions[t];
    keys += P.window > 0 ? std::min<int64_t>(p + 1, P.window) : p + 1;
  }
  return keys * P.Hkv * (P.Hq / P.Hkv + 1) * P.D;
}

// Attention of every (token, KV head), split into parts and merged when split_parts says so.
void attend_all(const PagedAttnParams& P, const PagedAttnBuffers& B, const CallSpec& s, CallScratch& cs,
                const HostPool* host) {
  const int T = P.T, Hkv = P.Hkv;
  AttnContext ctx;
  ctx.p = &P;
  ctx.b = &B;
  ctx.qrot = cs.qrot.data();
  ctx.k16 = s.use_tail ? cs.k16.data() : nullptr;
  ctx.v16 = s.use_tail ? cs.v16.data() : nullptr;
  ctx.n_prev = cs.n_prev.data();
  ctx.G = P.Hq / Hkv;
  ctx.k_group = s.kg;
  ctx.v_group = s.vg;
  ctx.kcb = s.kcb;
  ctx.ksc = s.ksc;
  ctx.quantized = s.quantized;
  ctx.num_compact = s.compact ? P.num_compact : 0;
  ctx.ck_group = s.ckg;
  ctx.cv_group = s.cvg;
  ctx.ckcb = s.ckcb;
  ctx.cksc = s.cksc;
  ctx.use_sink = s.use_sink;
  ctx.use_tail = s.use_tail;
  ctx.rotate = s.rotate;
  ctx.split = split_parts(P, B);
  const int split = ctx.split;
  if (split > 1) {
    const size_t n = (size_t)T * Hkv * split * ctx.partial_stride();
    if (cs.partial.size() < n) cs.partial.resize(n);
    ctx.partial = cs.partial.data();
  }
  const AttendFn fn = attend_fn(active_isa());
  const size_t scratch_n = attn_scratch_floats(ctx);
  run_items(T * Hkv * split, attention_work(P, B) >= kParallelMinWork, host, [&](int i) {
    if (split == 1) {
      fn(ctx, i / Hkv, i % Hkv, thread_scratch(scratch_n));
    } else {
      AttnContext c = ctx;
      c.part = i % split;
      const int th = i / split;
      fn(c, th / Hkv, th % Hkv, thread_scratch(scratch_n));
    }
  });
  if (split > 1) {  // merge the parts (part = -1)
    float* scratch = thread_scratch(scratch_n);
    for (int i = 0; i < T * Hkv; ++i) fn(ctx, i / Hkv, i % Hkv, scratch);
  }
}
}  // namespace

void record_widths(const PagedAttnParams& p, int* code_width, int* scale_width) {
  if (p.float_pool) {
    *code_width = 2 * p.D;
    *scale_width = 0;
    return;
  }
  const int kg = p.k_group ? p.k_group : p.D, vg = p.v_group ? p.v_group : p.D;
  *code_width = p.D * p.k_bits / 8 + p.D * p.v_bits / 8;
  *scale_width = (kg > 0 ? p.D / kg : 0) * (p.k_sym ? 1 : 2) + (vg > 0 ? p.D / vg : 0) * (p.v_sym ? 1 : 2);
}

void compact_record_widths(const PagedAttnParams& p, int* code_width, int* scale_width) {
  PagedAttnParams c = p;
  c.float_pool = false;
  c.k_bits = p.ck_bits, c.v_bits = p.cv_bits, c.k_group = p.ck_group, c.v_group = p.cv_group;
  c.k_sym = p.ck_sym, c.v_sym = p.cv_sym;
  record_widths(c, code_width, scale_width);
}

int paged_attention(const PagedAttnParams& P, const PagedAttnBuffers& B, char* err, size_t err_len,
                    const HostPool* host) {
  CallSpec s;
  if (int rc = check_shapes(P, B, &s, err, err_len)) return rc;
  if (P.T == 0) return kOk;
  if (int rc = check_slots(P, B, s, err, err_len)) return rc;
  if (int rc = check_finite(P, B, err, err_len)) return rc;

  CallScratch& cs = tl_call;
  rotate_inputs(P, B, s, cs);
  write_records(P, B, s, cs);
  if (s.use_sink)  // the first block's tokens, also as fp16
    for (int t = 0; t < P.T; ++t)
      if (B.positions[t] < P.block_size) write_stage(P, B, cs, t, 0);
  count_call_tokens(P, B, cs);
  attend_all(P, B, s, cs, host);
  if (s.use_tail)  // after attending: the tokens in each sequence's last block of this call, as fp16
    for (int t = 0; t < P.T; ++t)
      if (B.positions[t] / P.block_size == cs.last_pos[B.seq_ids[t]] / P.block_size) write_stage(P, B, cs, t, 1);
  return kOk;
}

}  // namespace pagedkv

extern "C" {
int pagedkv_set_isa(int isa) { return pagedkv::set_isa((pagedkv::Isa)isa) ? 1 : 0; }
int pagedkv_active_isa(void) { return (int)pagedkv::active_isa(); }
void pagedkv_set_num_threads(int n) { pagedkv::set_num_threads(n); }
int pagedkv_num_threads(void) { return pagedkv::num_threads(); }
int pagedkv_last_call_threads(void) { return pagedkv::last_call_threads(); }
int pagedkv_last_call_pool(void) { return (int)pagedkv::last_call_pool(); }
}
