// Plain NEON attention path (aarch64, ARMv8.0: also runs on a Cortex-A53). The generic path
// dequantizes bit-identically to the scalar path; quantized 8/4-bit blocks take the fused fp32 path
// (scores below, V accumulation and softmax from pagedkv_neon_ops.h), which never writes dequantized
// rows. The dotprod path (attend_neon_dot, selected at run time when getauxval(AT_HWCAP) &
// HWCAP_ASIMDDP) is pagedkv_core_neon_dot.cpp.
#include <algorithm>
#include <cstring>

#include "pagedkv_neon_ops.h"

namespace pagedkv {
namespace {

// [sum(v0), sum(v1), sum(v2), sum(v3)]
inline float32x4_t hsum4(float32x4_t v0, float32x4_t v1, float32x4_t v2, float32x4_t v3) {
  return vpaddq_f32(vpaddq_f32(v0, v1), vpaddq_f32(v2, v3));
}

// Scores of keys i, i+1 (NK = 2) or i (NK = 1) for GN <= 4 query heads, in fp32:
// score = scale * sum_groups (s * dot(q, u - c) [+ (z + c * s) * sum(q)]), c = 2^(b-1) (the centred
// form of s * u + z, see vacc_tile).
template <int BITS, bool SYM, int GN, int NK>
inline void scores_keys(const QuantRun& r, const uint8_t* c0, const float* m0, const float* q, const float* qsum,
                        float scale, float* sc, int ldsc, int i) {
  const int D = r.D, kg = r.k_group, ngk = D / kg;
  float32x4_t tot[NK];  // lanes: heads 0..3
  for (int k = 0; k < NK; ++k) tot[k] = vdupq_n_f32(0.f);
  for (int gi = 0; gi < ngk; ++gi) {
    float32x4_t acc[NK][4];  // heads >= GN stay 0
    for (int k = 0; k < NK; ++k)
      for (int g = 0; g < 4; ++g) acc[k][g] = vdupq_n_f32(0.f);
    for (int j = gi * kg; j < (gi + 1) * kg; j += 16) {
      float32x4_t x[NK][4];
      for (int k = 0; k < NK; ++k) load16f<BITS>(c0 + (size_t)k * r.W, j, x[k]);
      for (int g = 0; g < GN; ++g)
        for (int v = 0; v < 4; ++v) {
          const float32x4_t qv = vld1q_f32(q + (size_t)g * D + j + 4 * v);
          for (int k = 0; k < NK; ++k) acc[k][g] = vfmaq_f32(acc[k][g], qv, x[k][v]);
        }
    }
    float qa[4] = {0.f, 0.f, 0.f, 0.f};
    if (!SYM)
      for (int g = 0; g < GN; ++g) qa[g] = qsum[(size_t)g * ngk + gi];
    const float32x4_t qs = vld1q_f32(qa);
    for (int k = 0; k < NK; ++k) {
      const float* mk = m0 + (size_t)k * r.Ws;
      tot[k] = vfmaq_n_f32(tot[k], hsum4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]), mk[gi]);
      if (!SYM) tot[k] = vfmaq_n_f32(tot[k], qs, mk[ngk + gi] + (float)r.k_mid * mk[gi]);
    }
  }
  for (int k = 0; k < NK; ++k) {
    float out[4];
    vst1q_f32(out, vmulq_n_f32(tot[k], scale));
    for (int g = 0; g < GN; ++g) sc[(size_t)g * ldsc + i + k] = out[g];
  }
}

template <int BITS, bool SYM, int GN>
void scores_tile(const QuantRun& r, const float* q, const float* qsum, float scale, float* sc, int ldsc) {
  int i = 0;
  for (; i + 2 <= r.n; i += 2)
    scores_keys<BITS, SYM, GN, 2>(r, r.codes + (size_t)i * r.W, r.metaf + (size_t)i * r.Ws, q, qsum, scale, sc, ldsc, i);
  if (i < r.n)
    scores_keys<BITS, SYM, GN, 1>(r, r.codes + (size_t)i * r.W, r.metaf + (size_t)i * r.Ws, q, qsum, scale, sc, ldsc, i);
}

template <int BITS, bool SYM>
void scores_all(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc) {
  const int ngk = r.D / r.k_group;
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    scores_tile<BITS, SYM, decltype(gn)::value>(r, q + (size_t)g0 * r.D, qsum + (size_t)g0 * ngk, scale, sc + (size_t)g0 * ldsc, ldsc);
  });
}

struct NeonFp32Ops : NeonFusedOps {
  static constexpr bool kFastQuant = true;

  // load16f yields dims in natural order for both widths: q as is
  static void q_prepare(const float* q, int G, int D, int k_bits, int k_group, float* out) {
    std::memcpy(out, q, sizeof(float) * (size_t)G * D);
  }
  static void q_scores(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc) {
    // the run's fp16 scales/zeros as float32, once (v_accum reuses them)
    f16_to_f32(r.meta, r.metaf, r.n * (int)r.Ws);
    if (r.k_bits == 8) {
      r.k_sym ? scores_all<8, true>(r, q, qsum, G, scale, sc, ldsc) : scores_all<8, false>(r, q, qsum, G, scale, sc, ldsc);
    } else {
      r.k_sym ? scores_all<4, true>(r, q, qsum, G, scale, sc, ldsc) : scores_all<4, false>(r, q, qsum, G, scale, sc, ldsc);
    }
  }
};

}  // namespace

void attend_neon(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<NeonFp32Ops> a(c, scratch);
  a(t, h);
}

}  // namespace pagedkv
