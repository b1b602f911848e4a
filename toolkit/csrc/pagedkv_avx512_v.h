// AVX-512 V sums (float path): accumulators of 64 dims x all heads in registers, nibbles split in place.
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

// ---- V accumulation ----------------------------------------------------------------------------

// 32 dims j..j+31 of a record's V codes as two vectors (u - 2^(b-1) when SYM). 8 bits: a = dims
// j..j+15, b = j+16..j+31. 4 bits: the 16 bytes are widened once and their nibbles looked up, so a = the
// even dims j, j+2, .., j+30 and b = the odd dims (undone by unpermute32).
template <int BITS, bool SYM>
inline void load32(const uint8_t* codes, int j, __m512& a, __m512& b) {
  __m512i x0, x1;
  if (BITS == 8) {
    x0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j)));
    x1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j + 16)));
  } else {
    // the nibbles index a table of their float values (vpermps reads the low 4 bits of each lane)
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j / 2)));
    const __m512 table = SYM ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                             : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    a = _mm512_permutexvar_ps(x, table);
    b = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), table);
    return;
  }
  if (SYM) {
    const __m512i c = _mm512_set1_epi32(1 << (BITS - 1));
    x0 = _mm512_sub_epi32(x0, c);
    x1 = _mm512_sub_epi32(x1, c);
  }
  a = _mm512_cvtepi32_ps(x0);
  b = _mm512_cvtepi32_ps(x1);
}

// [evens of 32 dims], [odds] -> dims 0..15, 16..31
inline void unpermute32(__m512& a, __m512& b) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512 x = _mm512_permutex2var_ps(a, lo, b), y = _mm512_permutex2var_ps(a, hi, b);
  a = x;
  b = y;
}

// One pass over the run's keys for DIMS (64, 32 or 16) dims j0.. of GN heads: the accumulators stay in
// registers while the keys stream by (compile-time sizes, so nothing is spilled).
// acc[g][d] += zt[g][group(d)] + sum_i coef[g][group(d)][i] * (u_i[d] - c)   (c = 2^(b-1) when SYM)
template <int BITS, bool SYM, bool SPLIT, int GN, int DIMS>
inline void vacc_pass(const QuantRun& r, const float* coef, const float* zt, int j0, float* acc) {
  constexpr int NV = DIMS / 16;  // vectors per head
  const int vg = r.v_group, n = r.n, D = r.D;
  int go[NV];  // coef offset of the group of each vector's first dim
  for (int v = 0; v < NV; ++v) {
    // 4 bits: vector 2p holds the even dims of pair p, 2p+1 the odd ones; lanes 0-7 of both come from
    // the pair's first 16 dims, lanes 8-15 from the last 16 (SPLIT: different groups, see below)
    const int j = BITS == 4 && DIMS >= 32 ? j0 + (v / 2) * 32 : j0 + v * 16;
    go[v] = j / vg * kRK;
  }
  const int hi_off = DIMS >= 32 ? ((j0 + 16) / vg - j0 / vg) * kRK : 0;  // SPLIT: group step of lanes 8-15
  __m512 A[GN][NV];  // start from the zero-point sums of the groups (asym; lane order as the coefs)
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < NV; ++v) {
      A[g][v] = SYM ? _mm512_setzero_ps() : _mm512_set1_ps(zt[g * 32 + go[v] / kRK]);
      if (!SYM && BITS == 4 && SPLIT && DIMS >= 32)
        A[g][v] = _mm512_mask_blend_ps(0xff00, A[g][v], _mm512_set1_ps(zt[g * 32 + (go[v] + hi_off) / kRK]));
    }
  for (int i = 0; i < n; ++i) {
    const uint8_t* c = r.rec(i) + r.kcb;
    __m512 x[NV];
    if constexpr (DIMS == 16) {
      x[0] = load16<BITS, SYM>(c, j0);
    } else {
      for (int p = 0; p < NV / 2; ++p) load32<BITS, SYM>(c, j0 + p * 32, x[2 * p], x[2 * p + 1]);
    }
    for (int g = 0; g < GN; ++g) {
      const float* cf = coef + (size_t)g * 32 * kRK + i;
      for (int v = 0; v < NV; ++v) {
        __m512 w = _mm512_set1_ps(cf[go[v]]);
        if (BITS == 4 && SPLIT && DIMS >= 32) w = _mm512_mask_blend_ps(0xff00, w, _mm512_set1_ps(cf[go[v] + hi_off]));
        A[g][v] = _mm512_fmadd_ps(w, x[v], A[g][v]);
      }
    }
  }
  const __m512i perm16 = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  for (int g = 0; g < GN; ++g) {
    float* a = acc + (size_t)g * D + j0;
    if (BITS == 4) {  // back to natural dim order
      if constexpr (DIMS == 16) {
        A[g][0] = _mm512_permutexvar_ps(perm16, A[g][0]);
      } else {
        for (int p = 0; p < NV / 2; ++p) unpermute32(A[g][2 * p], A[g][2 * p + 1]);
      }
    }
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(a + v * 16, _mm512_add_ps(_mm512_loadu_ps(a + v * 16), A[g][v]));
  }
}

// The scales (and, asym, zeros) of V group k for the run's keys as vectors, lanes = keys: sv[ch], zv[ch]
// for the 16-key chunks ch < nch, gathered from the float meta (rows: lane k = k * Ws).
template <bool SYM>
inline void gather_v_meta(const QuantRun& r, int ngv, int k, int nch, const __mmask16* mk, __m512i rows, __m512* sv,
                          __m512* zv) {
  const float* mv = r.metaf + r.ksc;
  for (int ch = 0; ch < nch; ++ch) {
    const float* m = mv + (size_t)16 * ch * r.Ws;
    sv[ch] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk[ch], rows, m + k, 4);
    if (!SYM) zv[ch] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk[ch], rows, m + ngv + k, 4);
  }
}

// Sums of p * z vectors (one per (head, group) pair) into zt[index], reduced four at a time by hsum4.
struct ZeroSums {
  float* zt;
  __m512 v[4];
  int n = 0, at[4];
  explicit ZeroSums(float* out) : zt(out) {}
  void add(__m512 pz, int index) {
    v[n] = pz;
    at[n++] = index;
    if (n == 4) flush();
  }
  void flush() {
    if (!n) return;
    for (int j = n; j < 4; ++j) v[j] = _mm512_setzero_ps();
    alignas(16) float t[4];
    _mm_store_ps(t, hsum4(v[0], v[1], v[2], v[3]));
    for (int j = 0; j < n; ++j) zt[at[j]] = t[j];
    n = 0;
  }
};

// acc[g] += sum_i p[g][i] * v_i for GN <= 4 heads (g0..g0+GN-1 of the KV head), v_i = s * (u - c)
// (sym, c = 2^(b-1)) or s * u + z (asym), as sum_i (p * s) * (u - c) [+ sum_i p * z]; the zero-point
// sums of all (head, group) pairs are reduced four at a time.
// SPLIT: v_group is not a multiple of 32, so lanes 0-7 and 8-15 of a 4-bit vector can belong to
// different groups: their coefficients are blended per lane.
template <int BITS, bool SYM, int GN, bool SPLIT>
void vacc_tile(const QuantRun& r, const float* p, int ldp, float* acc) {
  const int D = r.D, vg = r.v_group, ngv = D / vg, n = r.n;
  alignas(64) float coef[4 * 32 * kRK];  // [head][group][key]: p * s
  alignas(64) float zt[4 * 32 + 4];      // [head][group]: sum_i p * z (asym)
  ZeroSums zs(zt);
  const int nch = (n + 15) / 16;         // 16-key chunks
  __mmask16 mk[kRK / 16];
  for (int ch = 0; ch < kRK / 16; ++ch) mk[ch] = first_n(n - 16 * ch);
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)r.Ws));
  for (int k = 0; k < ngv; ++k) {
    __m512 sv[kRK / 16], zv[kRK / 16];
    gather_v_meta<SYM>(r, ngv, k, nch, mk, rows, sv, zv);
    for (int g = 0; g < GN; ++g) {
      const float* pg = p + (size_t)g * ldp;
      float* cf = coef + ((size_t)g * 32 + k) * kRK;
      __m512 pz = _mm512_setzero_ps();
      for (int ch = 0; ch < nch; ++ch) {
        const __m512 pc = load_keys(pg + 16 * ch, mk[ch], _mm512_setzero_ps());
        _mm512_store_ps(cf + 16 * ch, _mm512_mul_ps(pc, sv[ch]));
        if (!SYM) pz = _mm512_fmadd_ps(pc, zv[ch], pz);
      }
      if (!SYM) zs.add(pz, g * 32 + k);
    }
  }
  zs.flush();
  int j0 = 0;
  for (; j0 + 64 <= D; j0 += 64) vacc_pass<BITS, SYM, SPLIT, GN, 64>(r, coef, zt, j0, acc);
  if (j0 + 32 <= D) vacc_pass<BITS, SYM, SPLIT, GN, 32>(r, coef, zt, j0, acc), j0 += 32;
  if (j0 < D) vacc_pass<BITS, SYM, SPLIT, GN, 16>(r, coef, zt, j0, acc);
}

}  // namespace
}  // namespace pagedkv
