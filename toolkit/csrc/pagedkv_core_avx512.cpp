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
//     coefficients p * s in three 8-bit limbs, 4 keys per vpdpbusd (vacc_vnni; core bench, 16K, pool in
//     L1: the step ~4% faster at SmolLM2 dims, ~2% at 32/8/128 than with the float loop).
// Dequantized values are never written; sums run in another order than the reference (agreement ~1e-6).
// Not kept: an AMX-INT8 path (Sapphire Rapids tiles) for the same integer sums, bit-identical scores. K:
// tdpbusd of 16 code rows as they lie in the pool against the limbs of 4 heads; V: the coefficient limbs
// against the interleaved nibbles. The tiles are small here (M = 3 limbs x G heads <= 12 rows), the
// [key][head x limb] sums must be transposed back to rows of keys, and each tile load / product / store
// costs ~5 ns: core bench, 16K, 1 thread, pool in L1/L2, K pass 13% faster per run at SmolLM2 dims,
// V pass no faster, the step at 32/8/128 ~12% slower; from the L3 cache slower at both dims.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "pagedkv_attn_impl.h"

namespace pagedkv {
namespace {

using impl::QuantRun;

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
constexpr int kRK = kMaxRunKeys;  // keys per run (Ops::kRunKeys): four blocks of 16 tokens

// prefetch every cache line of [p, p + bytes) into L1
inline void prefetch_lines(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
  _mm_prefetch(c + bytes - 1, _MM_HINT_T0);
}

inline __mmask16 first_n(int n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u); }

// Loads / stores of the keys k of a row of scores or probabilities: plain when all 16 lanes are live.
// Masked stores do not forward to later loads (they wait for the store to commit), and the scores,
// softmax and V passes read each other's rows right away: with masked forms for full vectors the passes
// could not overlap (measured: ~20% of the step).
inline __m512 load_keys(const float* x, __mmask16 k, __m512 fill) {
  return k == 0xffff ? _mm512_loadu_ps(x) : _mm512_mask_loadu_ps(fill, k, x);
}
inline void store_keys(float* x, __mmask16 k, __m512 v) {
  if (k == 0xffff) {
    _mm512_storeu_ps(x, v);
  } else {
    _mm512_mask_storeu_ps(x, k, v);
  }
}

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
// Not kept: whole blocks ahead from the block-table walk, the next run spread over the V pass (with the
// pool in the cache, no faster); every line of the run after next into L2 (from memory 5-13% faster at
// SmolLM2 dims, with the pool in the cache 7-15% slower).
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
