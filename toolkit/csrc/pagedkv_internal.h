// Internal: what the core's translation units share (pagedkv_core.cpp: the op and code-path choice;
// pagedkv_quant.cpp: the record format; pagedkv_threads.cpp: threads; pagedkv_core_<isa>.cpp: the
// attention paths).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "pagedkv_core.h"

namespace pagedkv {

struct AttnContext {
  const PagedAttnParams* p;
  const PagedAttnBuffers* b;
  const float* qrot;       // [T, Hq, D] (Hadamard-rotated when rotate)
  const uint16_t* k16;     // [T, Hkv, D] fp16 of this call's rotated K (when use_tail), else null
  const uint16_t* v16;
  const int32_t* n_prev;   // [T] tokens of the same sequence earlier in this call
  int G;                   // query heads per KV head
  int k_group, v_group;    // resolved group sizes
  int kcb, ksc;            // K code bytes, K scale count (V follows in the record)
  bool quantized, use_sink, use_tail, rotate;
  // The compact region of a mixed call (num_compact > 0; block ids >= num_blocks): the compact spec's
  // resolved groups, K code bytes and K scale count
  int num_compact = 0;
  int ck_group = 0, cv_group = 0, ckcb = 0, cksc = 0;
  // Split-K (flash-decoding): when split > 1 the visible blocks of each (token, KV head) are cut into
  // `split` contiguous parts. part >= 0: attend over that part only and write the partial state
  // (max[G], sum[G], acc[G*D]) to partial + ((t * Hkv + h) * split + part) * partial_stride().
  // part == -1: merge the `split` partials of (t, h) and write the output.
  int split = 1;
  int part = -1;
  float* partial = nullptr;
  size_t partial_stride() const { return (size_t)G * (2 + (size_t)p->D); }
};

// Keys one fused run may hold: consecutive blocks up to kMaxRunKeys keys (Ops::kRunKeys), at least one
// block.
constexpr int kMaxRunKeys = 64;
constexpr int kMaxRunBlocks = 8;  // blocks of >= 8 tokens (the fast path's minimum)
inline int run_capacity(int block_size) { return block_size < kMaxRunKeys ? kMaxRunKeys : block_size; }

// The arrays of an attend call's scratch start on cache lines (floats per line)
constexpr size_t kScratchAlignFloats = 16;

// Floats of per-thread scratch one attend call needs (13 arrays, each padded to a cache line; 2 more
// for the compact region's own prepared q and q sums in a mixed call).
inline size_t attn_scratch_floats(const AttnContext& c) {
  const size_t D = (size_t)c.p->D, bs = (size_t)run_capacity(c.p->block_size), G = (size_t)c.G;
  const bool compact = c.num_compact > 0;
  const size_t Ws = (size_t)(compact && c.p->compact_scale_width > c.p->scale_width ? c.p->compact_scale_width
                                                                                   : c.p->scale_width);
  return 2 * D + 2 * D /*unpacked codes*/ + G * bs + G * D + 2 * G + 64 + G * 32 /*q sums per K group*/ +
         4 * G * D /*prepared q*/ + 2 * G /*row ops*/ + bs * 2 * D / 4 /*a run's widened records*/ +
         (compact ? 4 * G * D + G * 32 + 2 * kScratchAlignFloats : 0) /*the compact region's q*/ + bs * Ws +
         8 /*float meta of a run*/ + 13 * kScratchAlignFloats;
}

// Attention for token t and KV head h: all G query heads of that KV head, written to out.
using AttendFn = void (*)(const AttnContext& c, int t, int h, float* scratch);

void attend_scalar(const AttnContext& c, int t, int h, float* scratch);
#if defined(PAGEDKV_HAVE_AVX2)
void attend_avx2(const AttnContext& c, int t, int h, float* scratch);
#endif
#if defined(PAGEDKV_HAVE_AVX512)
void attend_avx512(const AttnContext& c, int t, int h, float* scratch);
void attend_avx512_vnni(const AttnContext& c, int t, int h, float* scratch);
#endif
#if defined(PAGEDKV_HAVE_NEON)
void attend_neon(const AttnContext& c, int t, int h, float* scratch);
void attend_neon_dot(const AttnContext& c, int t, int h, float* scratch);
#endif

// The softmax exp of the SIMD paths (Cephes-style, ~1 ulp, for x <= 0): n = round(x * log2 e),
// r = x - n * ln2 (ln2 in two parts), exp(r) = 1 + r + r^2 * (((((p0 r + p1) r + p2) r + p3) r + p4) r + p5),
// times 2^n; below kMin the result is 0 (no subnormal probabilities: they slow every FMA they touch).
// Paths that build 2^n from exponent bits first clamp x to [kMin, kMax].
struct ExpConsts {
  static constexpr float kMin = -87.3f, kMax = 88.3f, kLog2e = 1.44269504088896341f;
  static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  static constexpr float kP[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                  4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};
};

// Generic bit unpacking (any 2..8 bits): codes -> n unsigned values as bytes.
void unpack_codes(const uint8_t* codes, int bits, int n, uint8_t* out);

// n floats of this thread's scratch, starting on a cache line (reused by the thread's next call).
float* thread_scratch(size_t n);

// Runs fn(i) for every i in [0, items): when `parallel`, on the host's pool (if any) or the core's own
// (set_num_threads), else on the calling thread; records last_call_threads() / last_call_pool().
void run_items(int items, bool parallel, const HostPool* host, const std::function<void(int)>& fn);

}  // namespace pagedkv
