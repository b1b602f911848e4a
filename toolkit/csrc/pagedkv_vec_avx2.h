// The AVX2 + FMA + F16C vector wrapper (8 floats): the primitives pagedkv_attn_fused.h writes the
// attention shapes over. Included only by pagedkv_core_avx2.cpp (compiled with -mavx2 -mfma -mf16c),
// hence the unnamed namespace: no other translation unit can get this code.
//
// What a wrapper provides (pagedkv_vec_neon.h is the other one):
//   F (N floats), M (a lane mask), F4 (4 floats: one value per query head of a tile, or per key of 4)
//   arithmetic: zero, set1, bcast, load, store, add, sub, mul, max, fma(a, b, c) = a * b + c; on F4:
//     f4_zero, f4_load, f4_store, f4_fma (a * scalar + c), f4_fmav (a * b + c), f4_mul (by a scalar)
//   reductions: hsum, hmax, hsum4 (4 vectors -> their 4 sums as an F4)
//   softmax: exp (x <= 0, ExpConsts), live(i, n) (lanes i + lane < n), select, keep, gt_or_nan, any
//   conversions: load_f16 (N fp16 -> F), load_u8 (N unsigned codes -> F, not centred)
//   codes16<BITS, CENTRED>: 16 codes of dims j..j+15 as 16 / N vectors, in the wrapper's code order
//     (u - 2^(BITS-1) when CENTRED, else u), and to_code_order / from_code_order<BITS> that move 16
//     floats of natural dim order into that order and back
//   prefetch (into L1) and prefetch_far (outer levels: the page's translation)
//   kCentredAsym: asymmetric codes are read centred too (see QuantRun::k_mid)
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "pagedkv_internal.h"

namespace pagedkv {
namespace {

struct VecAvx2 {
  using F = __m256;
  using M = __m256;  // all-ones / all-zeros lanes
  using F4 = __m128;
  static constexpr int N = 8;
  // asymmetric codes stay uncentred (u s + z): the AVX2 conversion costs the same either way, and the
  // scores of the reference's asymmetric tests stay as before
  static constexpr bool kCentredAsym = false;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

  static float hsum(F v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
  }
  static float hmax(F v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
  // [sum(v0), sum(v1), sum(v2), sum(v3)]: three horizontal adds and one add of the halves
  static F4 hsum4(F v0, F v1, F v2, F v3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  }
  static F4 f4_zero() { return _mm_setzero_ps(); }
  static F4 f4_load(const float* p) { return _mm_loadu_ps(p); }
  static void f4_store(float* p, F4 x) { _mm_storeu_ps(p, x); }
  static F4 f4_fma(F4 a, float s, F4 c) { return _mm_fmadd_ps(a, _mm_set1_ps(s), c); }  // a * s + c
  static F4 f4_mul(F4 a, float s) { return _mm_mul_ps(a, _mm_set1_ps(s)); }
  static F4 f4_fmav(F4 a, F4 b, F4 c) { return _mm_fmadd_ps(a, b, c); }  // a * b + c

  // exp for the softmax only (ExpConsts); x <= 0 here. Below ExpConsts::kMin the result is 0.
  static F exp(F x) {
    using E = ExpConsts;
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(E::kMin), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(E::kMin));
    x = _mm256_min_ps(x, _mm256_set1_ps(E::kMax));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(E::kLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(E::kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(E::kLn2Lo), r);
    __m256 y = _mm256_set1_ps(E::kP[0]);
    for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(E::kP[i]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
  }
  static M live(int i, int n) {
    return _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  }
  static F select(M m, F a, F b) { return _mm256_blendv_ps(b, a, m); }  // m ? a : b
  static F keep(M m, F a) { return _mm256_and_ps(m, a); }               // m ? a : 0
  static M gt_or_nan(F x, F t) { return _mm256_cmp_ps(x, t, _CMP_NLE_UQ); }
  static M mask_none() { return _mm256_setzero_ps(); }
  static M mask_or(M a, M b) { return _mm256_or_ps(a, b); }
  static M mask_and(M a, M b) { return _mm256_and_ps(a, b); }
  static bool any(M m) { return _mm256_movemask_ps(m) != 0; }

  static F load_f16(const uint16_t* h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))); }
  static F load_u8(const uint8_t* u) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u))));
  }

  // 16 codes as floats, u - 2^(BITS-1) when CENTRED (exact small integers), else u.
  // 8 bits: x[0] = dims j..j+7, x[1] = dims j+8..j+15. 4 bits (value i in the low nibble first): the 8
  // bytes of dims j..j+15 zero-extended to 32-bit lanes straight from memory and split into their
  // nibbles without interleaving: x[0] = the even dims j, j+2, .., j+14, x[1] = the odd dims.
  template <int BITS, bool CENTRED>
  static void codes16(const uint8_t* codes, int j, F x[2]) {
    __m256i x0, x1;
    if (BITS == 8) {
      x0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j)));
      x1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j + 8)));
    } else {
      const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j / 2)));
      x0 = _mm256_and_si256(w, _mm256_set1_epi32(0x0f));
      x1 = _mm256_srli_epi32(w, 4);
    }
    if (CENTRED) {
      const __m256i c = _mm256_set1_epi32(1 << (BITS - 1));
      x0 = _mm256_sub_epi32(x0, c);
      x1 = _mm256_sub_epi32(x1, c);
    }
    x[0] = _mm256_cvtepi32_ps(x0);
    x[1] = _mm256_cvtepi32_ps(x1);
  }
  // natural order [d0..d7], [d8..d15] -> evens [d0, d2, .., d14], odds [d1, .., d15] (4 bits)
  template <int BITS>
  static void to_code_order(F x[2]) {
    if (BITS != 4) return;
    const __m256 ev = _mm256_shuffle_ps(x[0], x[1], 0x88), od = _mm256_shuffle_ps(x[0], x[1], 0xdd);
    x[0] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xd8));
    x[1] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xd8));
  }
  template <int BITS>
  static void from_code_order(F x[2]) {
    if (BITS != 4) return;
    const __m256 l = _mm256_unpacklo_ps(x[0], x[1]), h = _mm256_unpackhi_ps(x[0], x[1]);
    x[0] = _mm256_permute2f128_ps(l, h, 0x20);
    x[1] = _mm256_permute2f128_ps(l, h, 0x31);
  }

  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static void prefetch_far(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2); }
};

}  // namespace
}  // namespace pagedkv
