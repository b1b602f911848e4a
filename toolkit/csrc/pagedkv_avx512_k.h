// AVX-512 K scores (float path): one load of a key's codes for all query heads, transpose-add reductions.
// Part of the AVX-512 attention paths: included only by pagedkv_core_avx512.cpp (compiled with the
// AVX-512 flags), hence the unnamed namespace.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "pagedkv_avx512_common.h"

namespace pagedkv {
namespace {

// ---- K scores ------------------------------------------------------------------------------------

// 16 codes of a record (dims j..j+15) as floats: u - 2^(b-1) when SYM (exact small integers), else u.
// 8 bits: natural order. 4 bits: the 8 bytes of dims j..j+15 are widened and split into nibbles ->
// lanes 0-7 = even dims, 8-15 = odd dims (q_prepare stores q in that order).
template <int BITS, bool SYM>
inline __m512 load16(const uint8_t* codes, int j) {
  __m512i x;
  if (BITS == 8) {
    x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j)));
  } else {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j / 2)));
    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(0x0f)), hi = _mm256_srli_epi32(b, 4);
    x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  if (SYM) x = _mm512_sub_epi32(x, _mm512_set1_epi32(1 << (BITS - 1)));
  return _mm512_cvtepi32_ps(x);
}

// sums of 16 vectors v[0..15] (stride 16 floats): lane k = sum of the lanes of v[k]
inline __m512 reduce16(const float* v) {
  __m512 c[4];
  for (int q = 0; q < 4; ++q) {
    const float* w = v + q * 64;
    const __m512 v0 = _mm512_load_ps(w), v1 = _mm512_load_ps(w + 16);
    const __m512 v2 = _mm512_load_ps(w + 32), v3 = _mm512_load_ps(w + 48);
    // per 128-bit lane: a = [v0 0+2, v1 0+2, v0 1+3, v1 1+3], b the same for v2, v3
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
    // per 128-bit lane: [v0, v1, v2, v3] partial sums of that lane
    c[q] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee));
  }
  // add the four 128-bit lanes of each c: lanes of the result = v0..v15
  const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xee));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d, e, 0x88), _mm512_shuffle_f32x4(d, e, 0xdd));
}

// [sum(v0), sum(v1), sum(v2), sum(v3)] (lane sums, one transpose-add tree)
inline __m128 hsum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee));
  const __m512 d = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0x4e));
  return _mm512_castps512_ps128(_mm512_add_ps(d, _mm512_shuffle_f32x4(d, d, 0xb1)));
}

// Scores of the run's keys for GN <= 4 query heads. tv: scratch [GN][kRK][16] (64-byte aligned).
// score = scale * sum_groups s_k * dot(q, u - c)              (sym, c = 2^(b-1))
//       = scale * sum_groups (s_k * dot(q, u) + z_k * sum(q))   (asym)
// Per key and head the group sums stay in one vector; the vectors of 16 keys are reduced together by
// reduce16.
// NCH: 16-dim chunks per K group when it is 1, 2 or 4 (unrolled, two keys interleaved), else 0: then
// (and for an odd last key) the one-key loop below, which measured ~5% faster than folding both into one
// template on the number of keys.
template <int BITS, bool SYM, int GN, int NCH>
void scores_tile(const QuantRun& r, const float* q, const float* qsum, float scale, float* sc, int ldsc, float* tv) {
  const int D = r.D, kg = NCH ? NCH * 16 : r.k_group, ngk = D / kg, n = r.n;
  int i = 0;
  if constexpr (NCH > 0) {
    for (; i + 2 <= n; i += 2) {
      const uint8_t* c0 = r.rec(i);
      const uint8_t* c1 = r.rec(i + 1);
      const float* m0 = r.metaf + (size_t)i * r.Ws;
      const float* m1 = m0 + r.Ws;
      __m512 t0[GN], t1[GN];
      for (int gi = 0; gi < ngk; ++gi) {
        __m512 a0[GN], a1[GN];
        for (int g = 0; g < GN; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
        for (int ch = 0; ch < NCH; ++ch) {
          const int j = gi * kg + ch * 16;
          const __m512 x0 = load16<BITS, SYM>(c0, j), x1 = load16<BITS, SYM>(c1, j);
          for (int g = 0; g < GN; ++g) {
            const __m512 qv = _mm512_loadu_ps(q + (size_t)g * D + j);
            a0[g] = _mm512_fmadd_ps(qv, x0, a0[g]);
            a1[g] = _mm512_fmadd_ps(qv, x1, a1[g]);
          }
        }
        if (ngk == 1) {
          for (int g = 0; g < GN; ++g) t0[g] = a0[g], t1[g] = a1[g];
        } else {
          const __m512 s0 = _mm512_set1_ps(m0[gi]), s1 = _mm512_set1_ps(m1[gi]);
          for (int g = 0; g < GN; ++g) {
            t0[g] = gi ? _mm512_fmadd_ps(a0[g], s0, t0[g]) : _mm512_mul_ps(a0[g], s0);
            t1[g] = gi ? _mm512_fmadd_ps(a1[g], s1, t1[g]) : _mm512_mul_ps(a1[g], s1);
          }
        }
      }
      for (int g = 0; g < GN; ++g) {
        _mm512_store_ps(tv + ((size_t)g * kRK + i) * 16, t0[g]);
        _mm512_store_ps(tv + ((size_t)g * kRK + i + 1) * 16, t1[g]);
      }
    }
  }
  for (; i < n; ++i) {
    const uint8_t* c = r.rec(i);
    const float* m = r.metaf + (size_t)i * r.Ws;
    __m512 tot[GN];
    for (int gi = 0; gi < ngk; ++gi) {
      __m512 a[GN];
      for (int g = 0; g < GN; ++g) a[g] = _mm512_setzero_ps();
      for (int j = gi * kg; j < (gi + 1) * kg; j += 16) {
        const __m512 x = load16<BITS, SYM>(c, j);
        for (int g = 0; g < GN; ++g) a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)g * D + j), x, a[g]);
      }
      if (ngk == 1) {  // the scale is applied after the reduction, 16 keys at a time
        for (int g = 0; g < GN; ++g) tot[g] = a[g];
      } else {
        const __m512 s = _mm512_set1_ps(m[gi]);
        for (int g = 0; g < GN; ++g) tot[g] = gi ? _mm512_fmadd_ps(a[g], s, tot[g]) : _mm512_mul_ps(a[g], s);
      }
    }
    for (int g = 0; g < GN; ++g) _mm512_store_ps(tv + ((size_t)g * kRK + i) * 16, tot[g]);
  }
  for (int i0 = 0; i0 < n; i0 += 16) {
    const int cnt = std::min(16, n - i0);
    // per key: scale * the K scale (one group; gathered, lanes = keys), or scale
    __m512 mul = _mm512_set1_ps(scale);
    if (ngk == 1) {
      const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)r.Ws));
      mul = _mm512_mul_ps(mul, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), first_n(cnt), rows,
                                                        r.metaf + (size_t)i0 * r.Ws, 4));
    }
    for (int g = 0; g < GN; ++g) {
      __m512 s = _mm512_mul_ps(reduce16(tv + ((size_t)g * kRK + i0) * 16), mul);
      if (!SYM) {  // + scale * z * sum(q over the group)
        alignas(64) float zq[16] = {0.f};
        for (int k = 0; k < cnt; ++k) {
          const float* z = r.metaf + (size_t)(i0 + k) * r.Ws + ngk;
          float t = 0.f;
          for (int gi = 0; gi < ngk; ++gi) t += z[gi] * qsum[g * ngk + gi];
          zq[k] = t * scale;
        }
        s = _mm512_add_ps(s, _mm512_load_ps(zq));
      }
      store_keys(sc + (size_t)g * ldsc + i0, first_n(cnt), s);
    }
  }
}

}  // namespace
}  // namespace pagedkv
