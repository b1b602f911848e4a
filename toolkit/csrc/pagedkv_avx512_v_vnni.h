// AVX-512 VNNI + VBMI V sums: 4-bit V codes against the coefficients in three u8 limbs (vpdpbusd).
// Part of the AVX-512 attention paths: included only by pagedkv_core_avx512.cpp (compiled with the
// AVX-512 flags), hence the unnamed namespace.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "pagedkv_avx512_v.h"

namespace pagedkv {
namespace {

// ---- V accumulation with AVX-512 VNNI + VBMI (4-bit V codes, groups of a multiple of 32 dims) ---
// acc[g][d] += sum_i c_i * (u_i[d] - c) (+ sum_i p_i z_i) with c_i = p_i * s_i, the sums over the keys as
// exact integer dot products. Per run, head and V group the coefficients are scaled by 2^-e (e from their
// maximum, so that Q_i = round(c_i 2^-e) < 2^24: 24 bits, as a float mantissa) and the three bytes of Q
// are the u8 limbs of vpdpbusd; the codes are its s8 operand (u, or u - 8 when sym), four keys per dword.
// Per 4 keys and 32 dims: the keys' 16 code bytes interleaved by one vpermt2b, split into nibbles (even /
// odd dims), and per head 3 limbs x 2 vpdpbusd: ~12 port-0/5 instructions per key at 64 dims x 3 heads
// against ~20 for the float loop (vacc_pass). Per limb and lane |A| <= 64 keys * 255 * 15, so
// 256 A_a + A_b stays below 2^31. Agreement with the scalar path as the float loop's (core tests).
// Returns false (nothing written) when a coefficient is negative or not finite (NaN scores, a corrupt
// pool): the caller then takes the float path, which handles them as the reference does.
inline bool vnni_v_apply(int v_bits, int v_group, int D) {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  return vbmi && v_bits == 4 && v_group % 32 == 0 && D % 64 == 0;
}

// acc += u (u8) . s (s8) per dword, in place (the intrinsic form makes GCC 12 copy every accumulator
// of the loop below twice per iteration)
__attribute__((target("avx512f,avx512vnni"))) inline __m512i dpb_rr(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
  return acc;
}

// [32 bytes at a | 32 bytes at b]
inline __m512i load_2x32(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// vpermt2b indices over the table [key 0 | key 1] (32 code bytes each), [key 2 | key 3]: output dword l of
// half h = byte 16 h + l of keys 0..3 (lane l holds dims 2l (low nibble) and 2l + 1 of the half)
struct VnniVIdx {
  alignas(64) uint8_t b[2][64];
  constexpr VnniVIdx() : b() {
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 16; ++l)
        for (int m = 0; m < 4; ++m) b[h][4 * l + m] = (uint8_t)((m / 2) * 64 + (m % 2) * 32 + 16 * h + l);
  }
};
constexpr VnniVIdx kVnniVIdxTable;
constexpr const uint8_t (&kVnniVIdx)[2][64] = kVnniVIdxTable.b;

template <bool SYM, int GN>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi"))) bool vacc_vnni(const QuantRun& r, const float* p,
                                                                                 int ldp, float* acc) {
  const int D = r.D, vg = r.v_group, ngv = D / vg, n = r.n;
  const int nq = (n + 3) / 4, nch = (n + 15) / 16;
  static_assert(257LL * kRK * 255 * 15 < (1LL << 31), "256 A_a + A_b must fit in int32");
  constexpr int kQB = kRK * 4;  // limb bytes per (head, group): kRK / 4 quads x 16
  // [head][group][quad]: 16 bytes [c of keys 0-3 | b | a | 0] (Q = 65536 a + 256 b + c)
  alignas(64) uint8_t lq[4 * 32 * kQB];
  alignas(64) float zt[4 * 32 + 4];  // [head][group]: sum_i p * z (asym)
  ZeroSums zs(zt);
  float pw[4][32];                   // [head][group]: 2^e
  __mmask16 mk[kRK / 16];
  for (int ch = 0; ch < kRK / 16; ++ch) mk[ch] = first_n(n - 16 * ch);
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)r.Ws));
  // the bytes of each key's Q, limb by limb, per 128-bit lane (4 keys)
  const __m512i limb_order = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, -1, -1, -1, -1));
  __m512 csum = _mm512_setzero_ps(), cmin = _mm512_setzero_ps();  // not finite / negative when a coefficient is
  for (int k = 0; k < ngv; ++k) {
    __m512 sv[kRK / 16], zv[kRK / 16];
    gather_v_meta<SYM>(r, ngv, k, nch, mk, rows, sv, zv);
    for (int g = 0; g < GN; ++g) {
      const float* pg = p + (size_t)g * ldp;
      __m512 cq[kRK / 16], cmax = _mm512_setzero_ps(), pz = _mm512_setzero_ps();
      for (int ch = 0; ch < nch; ++ch) {
        const __m512 pc = load_keys(pg + 16 * ch, mk[ch], _mm512_setzero_ps());
        cq[ch] = _mm512_mul_ps(pc, sv[ch]);
        cmax = _mm512_max_ps(cmax, cq[ch]);
        cmin = _mm512_min_ps(cmin, cq[ch]);
        csum = _mm512_add_ps(csum, cq[ch]);
        if (!SYM) pz = _mm512_fmadd_ps(pc, zv[ch], pz);
      }
      // e such that max c * 2^-e is in [2^23, 2^24) (from the exponent bits; at least -126, so that
      // 2^e and 2^-e are normal floats)
      const float m = _mm512_reduce_max_ps(cmax);
      uint32_t mb;
      std::memcpy(&mb, &m, 4);
      const int e = (mb >> 23) & 0xff ? std::max((int)((mb >> 23) & 0xff) - 150, -126) : 0;
      const uint32_t pb = (uint32_t)(e + 127) << 23, ib = (uint32_t)(127 - e) << 23;
      float inv;
      std::memcpy(&pw[g][k], &pb, 4);
      std::memcpy(&inv, &ib, 4);
      const __m512 vinv = _mm512_set1_ps(inv);
      uint8_t* dst = lq + ((size_t)g * 32 + k) * kQB;
      for (int ch = 0; ch < nch; ++ch)  // exact scaling (a power of two), then round to nearest even
        _mm512_store_si512(dst + 64 * ch, _mm512_shuffle_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(cq[ch], vinv)), limb_order));
      if (!SYM) zs.add(pz, g * 32 + k);
    }
  }
  if (_mm512_fpclass_ps_mask(csum, 0x01 | 0x08 | 0x10 | 0x80) | _mm512_fpclass_ps_mask(cmin, 0x10 | 0x40)) return false;
  zs.flush();
  const __m512i nib = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
  for (int slab = 0; slab < D / 64; ++slab)
    for (int h = 0; h < 2; ++h) {
      const int j0 = slab * 64 + h * 32, k = j0 / vg;  // the half's first dim and its group
      const __m512i idx = _mm512_load_si512(kVnniVIdx[h]);
      __m512i A[GN][3][2];  // [head][limb c, b, a][even dims, odd dims]
      for (int g = 0; g < GN; ++g)
        for (int l = 0; l < 3; ++l) A[g][l][0] = A[g][l][1] = _mm512_setzero_si512();
      const uint8_t* lk[GN];
      for (int g = 0; g < GN; ++g) lk[g] = lq + ((size_t)g * 32 + k) * kQB;
      for (int qd = 0; qd < nq; ++qd) {
        const int i = 4 * qd;
        const uint8_t* c0 = r.rec(i) + r.kcb + 32 * slab;  // keys past n repeat the last (coefficient 0)
        const uint8_t* c1 = r.rec(std::min(i + 1, n - 1)) + r.kcb + 32 * slab;
        const uint8_t* c2 = r.rec(std::min(i + 2, n - 1)) + r.kcb + 32 * slab;
        const uint8_t* c3 = r.rec(std::min(i + 3, n - 1)) + r.kcb + 32 * slab;
        const __m512i x = _mm512_permutex2var_epi8(load_2x32(c0, c1), idx, load_2x32(c2, c3));
        __m512i lo = _mm512_and_si512(x, nib), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), nib);
        if (SYM) lo = _mm512_sub_epi8(lo, eight), hi = _mm512_sub_epi8(hi, eight);
        for (int g = 0; g < GN; ++g)
          for (int l = 0; l < 3; ++l) {
            int32_t w;
            std::memcpy(&w, lk[g] + 16 * qd + 4 * l, 4);
            const __m512i cb = _mm512_set1_epi32(w);
            A[g][l][0] = dpb_rr(A[g][l][0], cb, lo);
            A[g][l][1] = dpb_rr(A[g][l][1], cb, hi);
          }
      }
      const __m512 k256 = _mm512_set1_ps(256.f);
      for (int g = 0; g < GN; ++g) {
        const __m512 s = _mm512_set1_ps(pw[g][k]);
        __m512 v[2];
        for (int o = 0; o < 2; ++o) {
          const __m512i ab = _mm512_add_epi32(_mm512_slli_epi32(A[g][2][o], 8), A[g][1][o]);
          v[o] = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(ab), k256, _mm512_cvtepi32_ps(A[g][0][o])), s);
        }
        unpermute32(v[0], v[1]);
        const __m512 z = SYM ? _mm512_setzero_ps() : _mm512_set1_ps(zt[g * 32 + k]);
        float* a = acc + (size_t)g * D + j0;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_add_ps(v[0], z)));
        _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_add_ps(v[1], z)));
      }
    }
  return true;
}

}  // namespace
}  // namespace pagedkv
