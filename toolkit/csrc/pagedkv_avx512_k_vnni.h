// AVX-512 VNNI K scores: 8-bit K codes against q in three int8 limbs (vpdpbusd), 16 keys at a time.
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

// ---- K scores with AVX-512 VNNI (8-bit K codes, K groups of 64 or 128 dims) ---------------------
// q is split per (head, K group) into three int8 limbs exactly as the NEON sdot path does (Q = q / s_q
// rounded, |Q| <= 127 * 65536, Q = 65536 a + 256 b + c). vpdpbusd multiplies the raw u8 codes with the
// signed limbs; subtracting 128 * sum(limb) makes A, B, C the exact dots with the centred codes. Keys go
// 16 at a time: the 64-byte code rows of 16 keys are transposed by dwords (lane k = key k, one vector per
// 4 dims), so each vpdpbusd takes one broadcast dword of a limb and no horizontal sums are needed.

// The prepared query in Attend's qk scratch (q_prepare; floats of room: 4 * G * D):
//   limbs int8  [G][D / 64][3][64]  limb l of the 64 dims of row j (as dwords: 4 dims each)
//   off   int32 [G][ngk][3]         128 * sum of the limb over the group (centring offset)
//   sq    float [G][ngk]            s_q (NaN when the group of q is not finite)
struct VnniQ {
  const int8_t* limbs;
  const int32_t* off;
  const float* sq;
  VnniQ(const float* base, int G, int D, int ngk) {
    limbs = reinterpret_cast<const int8_t*>(base);
    off = reinterpret_cast<const int32_t*>(base + (size_t)3 * G * D / 4);
    sq = base + (size_t)3 * G * D / 4 + (size_t)3 * G * ngk;
  }
};

// groups of 64 or 128 dims keep 256 A + B within int32 (see scores_vnni)
inline bool vnni_scores_apply(int k_bits, int k_group) { return k_bits == 8 && (k_group == 64 || k_group == 128); }

// q rows -> VnniQ (see above) at out. Runs once per attention call and split part, so vectorized:
// Q = round-to-nearest-even(q * 2^-e) in double (exact scaling, as lrint(ldexp(q, -e)) in the NEON path).
inline void vnni_q_prepare(const float* q, int G, int D, int k_group, float* out) {
  const int ngk = D / k_group;
  int8_t* limbs = reinterpret_cast<int8_t*>(out);
  int32_t* off = reinterpret_cast<int32_t*>(out + (size_t)3 * G * D / 4);
  float* sq = out + (size_t)3 * G * D / 4 + (size_t)3 * G * ngk;
  const __m512i k128 = _mm512_set1_epi32(128), k255 = _mm512_set1_epi32(255);
  for (int g = 0; g < G; ++g)
    for (int gi = 0; gi < ngk; ++gi) {
      const float* qg = q + (size_t)g * D + (size_t)gi * k_group;
      __m512 mx = _mm512_setzero_ps();
      __mmask16 bad = 0;  // NaN or infinity
      for (int j = 0; j < k_group; j += 16) {
        const __m512 v = _mm512_loadu_ps(qg + j);
        bad |= _mm512_fpclass_ps_mask(v, 0x01 | 0x08 | 0x10 | 0x80);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
      }
      const float m = _mm512_reduce_max_ps(mx);
      int e = 0;
      if (!bad && m > 0.f) {
        int E;
        std::frexp(m, &E);  // m = f * 2^E, f in [0.5, 1)
        e = E - 23;        // m / 2^e in [2^22, 2^23)
        if (std::ldexp(m, -e) > 127.f * 65536.f) ++e;
        e = std::max(e, -149);
      }
      sq[g * ngk + gi] = bad ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.f, e);
      const __m512d inv = _mm512_set1_pd(std::ldexp(1.0, -e));
      __m512i sums[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int j = 0; j < k_group; j += 16) {
        const __m512 v = _mm512_loadu_ps(qg + j);
        const __m256i lo = _mm512_cvtpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), inv));
        const __m256i hi = _mm512_cvtpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)), inv));
        const __m512i Q = bad ? _mm512_setzero_si512() : _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        // balanced base-256 digits: c, b in [-128, 127], a in [-127, 127]
        const __m512i c = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(Q, k128), k255), k128);
        const __m512i Q1 = _mm512_srai_epi32(_mm512_sub_epi32(Q, c), 8);
        const __m512i b = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(Q1, k128), k255), k128);
        const __m512i a = _mm512_srai_epi32(_mm512_sub_epi32(Q1, b), 8);
        const __m512i d[3] = {a, b, c};
        const int dim = gi * k_group + j;  // row dim / 64, offset dim % 64
        for (int l = 0; l < 3; ++l) {
          int8_t* dst = limbs + (((size_t)g * (D / 64) + dim / 64) * 3 + l) * 64 + dim % 64;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(d[l]));
          sums[l] = _mm512_add_epi32(sums[l], d[l]);
        }
      }
      for (int l = 0; l < 3; ++l) off[(g * ngk + gi) * 3 + l] = 128 * _mm512_reduce_add_epi32(sums[l]);
    }
}

// 16 rows of 16 dwords -> u[d] = dword d of every row (lane k = row k): in-lane 4x4 transposes of 4 rows
// at a time, then 4x4 transposes of their 128-bit lanes
__attribute__((target("avx512f,avx512vnni"))) inline void transpose16(const __m512i* r, __m512i* u) {
  __m512i t[4][4];  // [rows 4i..4i+3][m]: position 4 L + k = row 4 i + k, dword 4 L + m
  for (int i = 0; i < 4; ++i) {
    const __m512i a0 = _mm512_unpacklo_epi32(r[4 * i], r[4 * i + 1]), a1 = _mm512_unpackhi_epi32(r[4 * i], r[4 * i + 1]);
    const __m512i a2 = _mm512_unpacklo_epi32(r[4 * i + 2], r[4 * i + 3]);
    const __m512i a3 = _mm512_unpackhi_epi32(r[4 * i + 2], r[4 * i + 3]);
    t[i][0] = _mm512_unpacklo_epi64(a0, a2), t[i][1] = _mm512_unpackhi_epi64(a0, a2);
    t[i][2] = _mm512_unpacklo_epi64(a1, a3), t[i][3] = _mm512_unpackhi_epi64(a1, a3);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i b0 = _mm512_shuffle_i32x4(t[0][m], t[1][m], 0x44), b1 = _mm512_shuffle_i32x4(t[0][m], t[1][m], 0xee);
    const __m512i b2 = _mm512_shuffle_i32x4(t[2][m], t[3][m], 0x44), b3 = _mm512_shuffle_i32x4(t[2][m], t[3][m], 0xee);
    u[m] = _mm512_shuffle_i32x4(b0, b2, 0x88), u[4 + m] = _mm512_shuffle_i32x4(b0, b2, 0xdd);
    u[8 + m] = _mm512_shuffle_i32x4(b1, b3, 0x88), u[12 + m] = _mm512_shuffle_i32x4(b1, b3, 0xdd);
  }
}

// acc += u (u8) . the dword at q (s8) in every lane. Written as an embedded broadcast ({1to16}): GCC 12
// emits the intrinsic form as a separate broadcast per product, twice the instructions of this loop
// (measured slower).
__attribute__((target("avx512f,avx512vnni"))) inline __m512i dpb(__m512i acc, __m512i u, const int32_t* q) {
  __asm__("vpdpbusd %[q]%{1to16%}, %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [q] "m"(*q));
  return acc;
}

// One 64-dim row of 16 keys (u: transpose16 of their code rows) against HT <= 3 heads: per head the limb
// dots A, B, C, added to ab (256 A + B, exact in int32, see scores_vnni) and cc (C). ql[h]: the 3 x 16
// limb dwords of head h for this row. Also prefetches the npf lines at pf, spread over the dword steps.
// P partial sums per chain, each over a contiguous share of the 16 dwords, keep >= 9 dependency chains in
// flight (12 for 2 heads, 18 for 3; the sums of the first share are done early, so the registers hold the
// sums and the dwords still to come: with 3 heads ~10% faster scores than one sum per chain, measured on
// a hot pool; by dword parity all 16 dwords would stay live and spill).
template <int HT, int NPF = -1>
__attribute__((target("avx512f,avx512vnni"))) inline void vnni_row(const __m512i* u, const int32_t* const* ql, __m512i* ab,
                                                               __m512i* cc, const char* pf, int npf_rt) {
  constexpr int P = HT == 1 ? 3 : 2;
  const int npf = NPF >= 0 ? NPF : npf_rt;
  __m512i A[HT][P], B[HT][P], C[HT][P];
  for (int h = 0; h < HT; ++h)
    for (int p = 0; p < P; ++p) A[h][p] = B[h][p] = C[h][p] = _mm512_setzero_si512();
#pragma GCC unroll 16
  for (int d = 0; d < 16; ++d) {
    for (int o = d; o < npf; o += 16) _mm_prefetch(pf + 64 * o, _MM_HINT_T0);
#pragma GCC unroll 3
    for (int h = 0; h < HT; ++h) {
      const int p = d * P / 16;
      A[h][p] = dpb(A[h][p], u[d], ql[h] + d);
      B[h][p] = dpb(B[h][p], u[d], ql[h] + 16 + d);
      C[h][p] = dpb(C[h][p], u[d], ql[h] + 32 + d);
    }
  }
  for (int h = 0; h < HT; ++h) {
    for (int p = 1; p < P; ++p) {
      A[h][0] = _mm512_add_epi32(A[h][0], A[h][p]);
      B[h][0] = _mm512_add_epi32(B[h][0], B[h][p]);
      C[h][0] = _mm512_add_epi32(C[h][0], C[h][p]);
    }
    ab[h] = _mm512_add_epi32(ab[h], _mm512_add_epi32(_mm512_slli_epi32(A[h][0], 8), B[h][0]));
    cc[h] = _mm512_add_epi32(cc[h], C[h][0]);
  }
}

// vnni_row with the prefetch count as a compile-time constant for the counts every K8/V4 row has (24
// lines, 12 per tile at 4 heads: a share of 16 records of 1.5 D bytes per 64 dims; 0 without
// prefetch): the prefetches are then plain instructions at fixed offsets instead of a counted loop per
// dword step (core bench, 16K, pool in L1: ~4% faster steps at SmolLM2 dims, ~2% at 32/8/128)
template <int HT>
__attribute__((target("avx512f,avx512vnni"))) inline void vnni_row_pf(const __m512i* u, const int32_t* const* ql, __m512i* ab,
                                                                  __m512i* cc, const char* pf, int npf) {
  switch (npf) {
    case 0: return vnni_row<HT, 0>(u, ql, ab, cc, pf, 0);
    case 12: return vnni_row<HT, 12>(u, ql, ab, cc, pf, 12);
    case 24: return vnni_row<HT, 24>(u, ql, ab, cc, pf, 24);
    default: return vnni_row<HT>(u, ql, ab, cc, pf, npf);
  }
}

// The 16 records of the next run's chunk j (keys 16 j ..) when they lie in one of its blocks; else
// their lines are prefetched here, record by record, and null is returned (also when it has no chunk j).
inline const char* next_run_chunk(const QuantRun& r, int j) {
  const size_t W = r.W, bn = r.block_bytes / W, k0 = 16 * (size_t)j;  // bn: records per block
  if (k0 / bn >= (size_t)r.next_nseg) return nullptr;
  if (k0 % bn + 16 <= bn) return reinterpret_cast<const char*>(r.next_codes[k0 / bn] + (k0 % bn) * W);
  for (size_t k = k0; k < k0 + 16 && k / bn < (size_t)r.next_nseg; ++k)
    prefetch_lines(r.next_codes[k / bn] + (k % bn) * W, W);
  return nullptr;
}

// scores of the run's keys for GN <= 4 heads g0.. (see above). Per 16 keys, head and K group: A, B, C
// accumulate over the group's rows; |A|, |B| <= 128 * 255 * 128 for groups of <= 128 dims, so 256 A + B
// stays below 2^31.
// Prefetched while a 16-key chunk is scored (core bench, 16K, shuffled pool: without any prefetch
// 0.90 ms, with these 0.70 at SmolLM2 dims):
// - every line of the records of the chunk two ahead (in a run's last two chunks, the next run's first
//   two: QuantRun::next_codes), a share per 64-dim row, spread over its 16 dword steps in vnni_row (one
//   or two lines per step: against the whole share before the row, 4% faster steps at SmolLM2 dims and
//   7-10% at 32/8/128, as a burst of prefetches probably stalls the loads behind it; all at once was ~8%
//   slower still). Two chunks ahead rather than one: with the pool evicted from the caches before each
//   call (BENCH_COLD_MIB: a model whose weights and other layers pass through the caches between two
//   calls of one layer) 5% / 10% faster steps at SmolLM2 dims with 1 / 2 threads and 0.3-3% at 32/8/128
//   (one chunk's K pass is shorter than a miss to memory); with the pool in the cache within the noise;
// - the scales of one of the next run's blocks per chunk;
// - the first line of each block of the run after the next, one block per chunk, into L2. That line
//   matters for its page: a shuffled pool puts nearly every block on another 4 KiB page, and the
//   prefetch walks the page's translation a run before the block is read (1 thread, pool evicted before
//   each call: 3-5% faster steps at SmolLM2 dims, ~3% at 32/8/128; in the cache within the noise).
// NR: 64-dim rows per K group (1 or 2), a compile-time count so that the row loop unrolls and the per-row
// prefetch share is computed once per chunk (the K pass measured ~15% of its time in per-chunk
// bookkeeping with both at run time).
template <bool SYM, int GN, int NR>
__attribute__((target("avx512f,avx512vnni"))) void scores_vnni(const QuantRun& r, const VnniQ& vq, int g0, const float* qsum,
                                                          float scale, float* sc, int ldsc) {
  static_assert(NR == 1 || NR == 2, "K groups of 64 or 128 dims");
  const int D = r.D, ngk = D / (64 * NR), nrow = D / 64, n = r.n;
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)r.Ws));
  // 16 keys inside one segment (block) are rows base + k W: no per-key pointers
  int sg = 0, s0 = 0;  // the segment of key i0 and its first key
  auto flat_at = [&](int i) {  // keys i..i+15 in one segment (i >= s0)
    int g = sg, f = s0;
    while (i >= f + r.seg_n[g]) f += r.seg_n[g++];
    return i + 16 <= f + r.seg_n[g];
  };
  const int nc = (n + 15) / 16;  // 16-key chunks
  for (int i0 = 0; i0 < n; i0 += 16) {
    const __mmask16 live = first_n(n - i0);
    while (i0 >= s0 + r.seg_n[sg]) s0 += r.seg_n[sg++];
    const bool flat = flat_at(i0);
    const uint8_t* base = r.rec(i0);
    const size_t W = r.W;
    const uint8_t* cp[16];
    if (!flat)
      for (int k = 0; k < 16; ++k) cp[k] = r.rec(std::min(i0 + k, n - 1));  // pad with the last key
    const int c = i0 / 16;  // this chunk, of nc
    // the next run's scales: one block per chunk, the rest with the last chunk
    for (int b = c; b < (c + 1 == nc ? r.next_nseg : std::min(c + 1, r.next_nseg)); ++b)
      prefetch_lines(r.next_meta[b], r.block_meta_bytes);
    // the first line of the run after the next's blocks, spread over the chunks (see above)
    for (int b = c * r.after_nseg / nc; b < (c + 1) * r.after_nseg / nc; ++b)
      _mm_prefetch(reinterpret_cast<const char*>(r.after_codes[b]), _MM_HINT_T2);
    // the records of the chunk two ahead: this run's chunk c + 2, past the run's end the next run's
    // chunk c + 2 - nc (for a run of one chunk also the next run's chunk 0, which no chunk before
    // covered). A contiguous range is issued a share per 64-dim row below (pf); records that span
    // blocks, every line of each, now.
    const char* pf = nullptr;
    size_t pf_bytes = 0;
    if (c + 2 < nc) {
      const int t = i0 + 32;
      if (t + 16 <= n && flat_at(t)) {
        pf = reinterpret_cast<const char*>(r.rec(t)), pf_bytes = 16 * W;
      } else {
        for (int k = t; k < std::min(t + 16, n); ++k) prefetch_lines(r.rec(k), W);
      }
    } else {
      pf = next_run_chunk(r, c + 2 - nc);
      pf_bytes = pf ? 16 * W : 0;
      if (nc == 1) {
        const char* p0 = next_run_chunk(r, 0);
        if (p0) prefetch_lines(p0, 16 * W);
      }
    }
    const size_t share = (pf_bytes + 64 * nrow - 1) / (64 * nrow) * 64;  // bytes of pf per row (whole lines)
    const float* m0 = r.metaf + (size_t)i0 * r.Ws;
    __m512 tot[GN];
    for (int gi = 0; gi < ngk; ++gi) {
      __m512i ab[GN], cc[GN];
      for (int g = 0; g < GN; ++g) ab[g] = cc[g] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int row = gi * NR; row < (gi + 1) * NR; ++row) {
        __m512i x[16], u[16];
        const size_t o0 = share * row, o1 = std::min(share * (row + 1), pf_bytes);
        const int npf = o1 > o0 ? (int)((o1 - o0 + 63) / 64) : 0;  // lines of this row's share
        if (flat) {
          for (int k = 0; k < 16; ++k) x[k] = _mm512_loadu_si512(base + k * W + 64 * row);
        } else {
          for (int k = 0; k < 16; ++k) x[k] = _mm512_loadu_si512(cp[k] + 64 * row);
        }
        transpose16(x, u);
        const int32_t* ql[GN];
        for (int g = 0; g < GN; ++g)
          ql[g] = reinterpret_cast<const int32_t*>(vq.limbs + ((size_t)(g0 + g) * nrow + row) * 3 * 64);
        if constexpr (GN == 4) {  // two tiles of 2 heads (registers)
          vnni_row_pf<2>(u, ql, ab, cc, pf + o0, npf / 2);
          vnni_row_pf<2>(u, ql + 2, ab + 2, cc + 2, pf + o0 + 64 * (npf / 2), npf - npf / 2);
        } else {
          vnni_row_pf<GN>(u, ql, ab, cc, pf + o0, npf);
        }
      }
      const __m512 ks = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, rows, m0 + gi, 4);
      __m512 zk = _mm512_setzero_ps();  // asym: z_k + 128 s_k multiplies sum(q) (the codes enter centred)
      if (!SYM) zk = _mm512_fmadd_ps(ks, _mm512_set1_ps(128.f), _mm512_mask_i32gather_ps(zk, live, rows, m0 + ngk + gi, 4));
      for (int g = 0; g < GN; ++g) {
        const int32_t* off = vq.off + ((g0 + g) * ngk + gi) * 3;
        // the centred dots: 256 A + B and C (exact integers), then 256 (256 A + B) + C in float
        const __m512i sab = _mm512_sub_epi32(ab[g], _mm512_set1_epi32(256 * off[0] + off[1]));
        const __m512i scc = _mm512_sub_epi32(cc[g], _mm512_set1_epi32(off[2]));
        const __m512 dq = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sab), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(scc));
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(dq, _mm512_set1_ps(vq.sq[(g0 + g) * ngk + gi])), ks);
        if (!SYM) v = _mm512_fmadd_ps(zk, _mm512_set1_ps(qsum[(size_t)(g0 + g) * ngk + gi]), v);
        tot[g] = gi ? _mm512_add_ps(tot[g], v) : v;
      }
    }
    for (int g = 0; g < GN; ++g)
      store_keys(sc + (size_t)(g0 + g) * ldsc + i0, live, _mm512_mul_ps(tot[g], _mm512_set1_ps(scale)));
  }
}

}  // namespace
}  // namespace pagedkv
