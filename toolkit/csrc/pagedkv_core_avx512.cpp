// AVX-512 attention paths (compiled with -mavx512f/bw/vl/dq + AVX2/FMA/F16C; the caller checks the CPU
// before selecting one): avx512, and avx512-vnni, which differs in the K scores of 8-bit K codes and the
// V sums of 4-bit V codes (vpdpbusd, compiled for VNNI function by function). Same structure as the AVX2
// path, 16 lanes wide, on runs of up to 64 keys (four blocks of 16 tokens: kRunKeys):
//   K scores: per key, the group dot products of all query heads from one load of the key's codes
//     (q rows stay in L1); the vectors of 16 keys x 1 head are reduced at once by a transpose-add tree
//     (about 3 shuffles/adds per score instead of a full horizontal sum each), then scaled per key.
//     VNNI: integer dot products of 16 keys at a time with q in three int8 limbs (scores_vnni).
//   softmax: the row maxima and sums of all heads through one transpose-reduce per 4 heads.
//   V: the accumulators of 64 dims x all heads live in registers while the run's keys stream by; 4-bit
//     codes are split into their nibbles without interleaving (evens/odds lane order, undone once per
//     run); zero-point sums of all (head, group) pairs reduced four at a time.
//     VNNI (with VBMI, 4-bit V in groups of 32k dims): integer dot products of the codes with the
//     coefficients p * s in three 8-bit limbs, 4 keys per vpdpbusd (vacc_vnni).
// Dequantized values are never written; sums run in another order than the reference (agreement ~1e-6).
//
// The passes live in headers by concern (one translation unit, so inlining is unchanged):
//   pagedkv_avx512_common.h   fp16 loads, prefetch, lane masks
//   pagedkv_avx512_k.h        K scores, float path
//   pagedkv_avx512_k_vnni.h   K scores, vpdpbusd (avx512-vnni)
//   pagedkv_avx512_v.h        V sums, float path
//   pagedkv_avx512_v_vnni.h   V sums, vpdpbusd (avx512-vnni with VBMI)
// This file: the softmax exp, the per-run dispatch on bits/groups/heads and the Ops of impl::Attend.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "pagedkv_attn_impl.h"
#include "pagedkv_avx512_common.h"
#include "pagedkv_avx512_k.h"
#include "pagedkv_avx512_k_vnni.h"
#include "pagedkv_avx512_v.h"
#include "pagedkv_avx512_v_vnni.h"

namespace pagedkv {
namespace {

// exp for the softmax only (ExpConsts; the power of two applied by vscalefps); x <= 0 here. Below
// ExpConsts::kMin (or NaN) the result is 0.
inline __m512 exp512(__m512 x) {
  using E = ExpConsts;
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(E::kMin), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(E::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(E::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(E::kLn2Lo), r);
  __m512 y = _mm512_set1_ps(E::kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(E::kP[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_scalef_ps(keep, y, n);
}

// K scores of all heads, by tiles of up to 4 heads; NCH as for scores_tile
template <int BITS, bool SYM, int NCH>
void scores_all(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc,
                float* tv) {
  const int ngk = r.D / r.k_group;
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    scores_tile<BITS, SYM, decltype(gn)::value, NCH>(r, q + (size_t)g0 * r.D, qsum + (size_t)g0 * ngk, scale,
                                                     sc + (size_t)g0 * ldsc, ldsc, tv);
  });
}

template <int BITS, bool SYM>
void scores_by_group(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc,
                     float* tv) {
  switch (r.k_group) {
    case 16: scores_all<BITS, SYM, 1>(r, q, qsum, G, scale, sc, ldsc, tv); break;
    case 32: scores_all<BITS, SYM, 2>(r, q, qsum, G, scale, sc, ldsc, tv); break;
    case 64: scores_all<BITS, SYM, 4>(r, q, qsum, G, scale, sc, ldsc, tv); break;
    default: scores_all<BITS, SYM, 0>(r, q, qsum, G, scale, sc, ldsc, tv); break;
  }
}

template <int BITS, bool SYM, bool SPLIT>
void vacc_all(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    vacc_tile<BITS, SYM, decltype(gn)::value, SPLIT>(r, p + (size_t)g0 * ldp, ldp, acc + (size_t)g0 * r.D);
  });
}

// n fp16 values -> float
inline void f16_to_f32_n(const uint16_t* h, float* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  for (; i < n; ++i) out[i] = h2f(h[i]);
}

// VNNI: 8-bit K in groups of 64 or 128 dims takes the vpdpbusd scores above (the avx512-vnni code path)
template <bool VNNI>
struct Avx512Ops {
  static constexpr bool kFastQuant = true;
  static constexpr int kRunKeys = kRK;  // runs of several blocks (QuantRun::rec)

  static bool use_vnni(int k_bits, int k_group) { return VNNI && vnni_scores_apply(k_bits, k_group); }
  static void widen(const uint8_t* codes, int bits, int n, uint8_t add, uint8_t* out) {
    widen_avx512(codes, bits, n, add, out);
  }

  static void q_scores(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc) {
    // the run's fp16 scales/zeros as float32, the segments back to back (v_accum reuses them)
    float* mf = r.metaf;
    for (int sg = 0; sg < r.nseg; ++sg) {
      f16_to_f32_n(r.seg_meta[sg], mf, (size_t)r.seg_n[sg] * r.Ws);
      mf += (size_t)r.seg_n[sg] * r.Ws;
    }
    if (use_vnni(r.k_bits, r.k_group)) {
      const VnniQ vq(q, G, r.D, r.D / r.k_group);
      impl::for_head_tiles(G, [&](auto gn, int g0) {
        constexpr int GN = decltype(gn)::value;
        if (r.k_group == 64) {
          r.k_sym ? scores_vnni<true, GN, 1>(r, vq, g0, qsum, scale, sc, ldsc)
                  : scores_vnni<false, GN, 1>(r, vq, g0, qsum, scale, sc, ldsc);
        } else {
          r.k_sym ? scores_vnni<true, GN, 2>(r, vq, g0, qsum, scale, sc, ldsc)
                  : scores_vnni<false, GN, 2>(r, vq, g0, qsum, scale, sc, ldsc);
        }
      });
      return;
    }
    alignas(64) float tv[4 * kRK * 16];
    if (r.k_bits == 8) {
      r.k_sym ? scores_by_group<8, true>(r, q, qsum, G, scale, sc, ldsc, tv)
              : scores_by_group<8, false>(r, q, qsum, G, scale, sc, ldsc, tv);
    } else {
      r.k_sym ? scores_by_group<4, true>(r, q, qsum, G, scale, sc, ldsc, tv)
              : scores_by_group<4, false>(r, q, qsum, G, scale, sc, ldsc, tv);
    }
  }

  static void v_accum(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
    if (VNNI && vnni_v_apply(r.v_bits, r.v_group, r.D)) {
      impl::for_head_tiles(G, [&](auto gn, int g0) {
        constexpr int GN = decltype(gn)::value;
        const float* pg = p + (size_t)g0 * ldp;
        float* ag = acc + (size_t)g0 * r.D;
        const bool done = r.v_sym ? vacc_vnni<true, GN>(r, pg, ldp, ag) : vacc_vnni<false, GN>(r, pg, ldp, ag);
        if (!done) r.v_sym ? vacc_tile<4, true, GN, false>(r, pg, ldp, ag) : vacc_tile<4, false, GN, false>(r, pg, ldp, ag);
      });
      return;
    }
    if (r.v_bits == 8) {
      r.v_sym ? vacc_all<8, true, false>(r, p, ldp, G, acc) : vacc_all<8, false, false>(r, p, ldp, G, acc);
    } else if (r.v_group % 32 != 0) {  // lanes 0-7 / 8-15 of a 4-bit vector in different groups
      r.v_sym ? vacc_all<4, true, true>(r, p, ldp, G, acc) : vacc_all<4, false, true>(r, p, ldp, G, acc);
    } else {
      r.v_sym ? vacc_all<4, true, false>(r, p, ldp, G, acc) : vacc_all<4, false, false>(r, p, ldp, G, acc);
    }
  }

  // q rows in the form q_scores reads: VnniQ, or the lane order of the fp32 scores (4-bit K: per 16
  // dims, the 8 even dims then the 8 odd)
  static void q_prepare(const float* q, int G, int D, int k_bits, int k_group, float* out) {
    if (use_vnni(k_bits, k_group)) {
      vnni_q_prepare(q, G, D, k_group, out);
      return;
    }
    const __m512i idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int j = 0; j < G * D; j += 16) {
      __m512 a = _mm512_loadu_ps(q + j);
      if (k_bits == 4) a = _mm512_permutexvar_ps(idx, a);
      _mm512_storeu_ps(out + j, a);
    }
  }

  // row-wise softmax helpers: rows of up to kRK keys, four rows per transpose-reduce
  template <bool MAX>
  static void rows_reduce(const float* x, int ldx, int G, int n, float* out) {
    const __m512 fill = _mm512_set1_ps(MAX ? -std::numeric_limits<float>::infinity() : 0.f);
    auto op = [](__m512 a, __m512 b) { return MAX ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); };
    auto row = [&](int g) {
      if (g >= G) return fill;
      const float* xg = x + (size_t)g * ldx;
      __m512 a = load_keys(xg, first_n(n), fill);
      for (int i = 16; i < n; i += 16) a = op(a, load_keys(xg + i, first_n(n - i), fill));
      return a;
    };
    for (int g0 = 0; g0 < G; g0 += 4) {
      const __m512 v0 = row(g0), v1 = row(g0 + 1), v2 = row(g0 + 2), v3 = row(g0 + 3);
      const __m512 a = op(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
      const __m512 b = op(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
      const __m512 c = op(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee));  // [r0 r1 r2 r3] per lane
      const __m512 d = op(c, _mm512_shuffle_f32x4(c, c, 0x4e));
      const __m512 e = op(d, _mm512_shuffle_f32x4(d, d, 0xb1));
      alignas(16) float t[4];  // a plain store: the caller reads out right away (see store_keys)
      _mm_store_ps(t, _mm512_castps512_ps128(e));
      for (int g = g0; g < std::min(g0 + 4, G); ++g) out[g] = t[g - g0];
    }
  }
  static void row_max(const float* sc, int ldsc, int G, int n, float* out) { rows_reduce<true>(sc, ldsc, G, n, out); }
  // whether a score of some row g is above thr[g] or NaN
  static bool rows_above(const float* sc, int ldsc, int G, int n, const float* thr) {
    __mmask16 any = 0;
    for (int g = 0; g < G; ++g) {
      const float* x = sc + (size_t)g * ldsc;
      const __m512 t = _mm512_set1_ps(thr[g]);
      for (int i = 0; i < n; i += 16)
        any |= _mm512_mask_cmp_ps_mask(first_n(n - i), load_keys(x + i, first_n(n - i), t), t, _CMP_NLE_UQ);
    }
    return any != 0;
  }
  static void row_exp(float* sc, int ldsc, int G, int n, const float* m, float* sum) {
    for (int g = 0; g < G; ++g) {
      float* x = sc + (size_t)g * ldsc;
      const __m512 vm = _mm512_set1_ps(m[g]);
      for (int i = 0; i < n; i += 16) {
        const __mmask16 k = first_n(n - i);
        store_keys(x + i, k, _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(load_keys(x + i, k, _mm512_setzero_ps()), vm))));
      }
    }
    rows_reduce<false>(sc, ldsc, G, n, sum);
  }

  static float max_n(const float* x, int n) {
    __m512 m = _mm512_set1_ps(x[0]);
    for (int i = 0; i < n; i += 16) m = _mm512_mask_max_ps(m, first_n(n - i), m, _mm512_maskz_loadu_ps(first_n(n - i), x + i));
    return _mm512_reduce_max_ps(m);
  }

  static float exp_sub(float* x, int n, float m) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 vs = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
      const __mmask16 k = first_n(n - i);
      const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm)));
      _mm512_mask_storeu_ps(x + i, k, e);
      vs = _mm512_add_ps(vs, e);
    }
    return _mm512_reduce_add_ps(vs);
  }

  // ---- generic path primitives
  static float dot(const float* a, const float* b, int n) {
    __m512 s = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
      const __mmask16 k = first_n(n - i);
      s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), s);
    }
    return _mm512_reduce_add_ps(s);
  }
  static void axpy(float* y, float a, const float* x, int n) {
    const __m512 va = _mm512_set1_ps(a);
    for (int i = 0; i < n; i += 16) {
      const __mmask16 k = first_n(n - i);
      _mm512_mask_storeu_ps(y + i, k, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, y + i)));
    }
  }
  static void scale(float* y, float a, int n) {
    const __m512 va = _mm512_set1_ps(a);
    for (int i = 0; i < n; i += 16) {
      const __mmask16 k = first_n(n - i);
      _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(k, y + i)));
    }
  }
  static void f16_to_f32(const uint16_t* h, float* out, int n) { f16_to_f32_n(h, out, (size_t)n); }
  static void unpack4(const uint8_t* codes, int n, uint8_t* out) { unpack_codes(codes, 4, n, out); }
  static void dequant_u8(const uint8_t* u, const uint16_t* meta, int d, int group, bool sym, int bits, float* out) {
    const int ng = d / group;
    const float c = (float)(1 << (bits - 1));
    for (int g = 0; g < ng; ++g) {
      const float s = fp16_to_fp32(meta[g]);
      const float z = sym ? 0.f : fp16_to_fp32(meta[ng + g]);
      const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z), vc = _mm512_set1_ps(c);
      for (int i = g * group; i < (g + 1) * group; i += 16) {
        const __mmask16 k = first_n((g + 1) * group - i);
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, u + i)));
        // no FMA: (u - c) * s and u * s + z round exactly as the reference
        const __m512 r = sym ? _mm512_mul_ps(_mm512_sub_ps(f, vc), vs) : _mm512_add_ps(_mm512_mul_ps(f, vs), vz);
        _mm512_mask_storeu_ps(out + i, k, r);
      }
    }
  }
};

}  // namespace

void attend_avx512(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<Avx512Ops<false>> a(c, scratch);
  a(t, h);
}

void attend_avx512_vnni(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<Avx512Ops<true>> a(c, scratch);
  a(t, h);
}

}  // namespace pagedkv
