// AVX2 + FMA + F16C attention path (this file is compiled with -mavx2 -mfma -mf16c; the caller
// checks the CPU before selecting it). The generic path dequantizes bit-identically to the scalar
// path; quantized 8/4-bit blocks (other widths widened to 8 bits by impl::Attend) take the fused path
// below, which never writes dequantized rows:
//   runs of up to 64 keys (kRunKeys: consecutive blocks, records read through QuantRun::rec), so the
//     per-run work (scales to float, softmax bookkeeping) is shared by four blocks of 16 tokens;
//   K scores: fp32 FMAs of q with the codes converted per 8 dims, two keys at a time, all heads of a
//     tile from one conversion; the next run's records are prefetched a few lines per key pair;
//   softmax: row-wise (row_max / row_exp / rows_above), with impl::Attend's lazy running maximum;
//   V sums: accumulators of 16 dims x the tile's heads stay in registers while the keys stream by.
// The K scores and V sums keep at least 8 independent FMA chains in flight (the FMA latency bounds a
// chain; 3 heads x 2 keys alone would wait on it).
// Why fp32 FMAs and not integer dot products here (as avx512-vnni and NEON dotprod do): scores must
// stay at fp32 accuracy (q in three 8-bit limbs there). Plain AVX2 has no vpdpbusd: vpmaddubsw
// saturates 255 x 128 pairs and needs a vpmaddwd + vpaddd after it, so three limbs cost ~9 uops per
// head and 32 dims against 4 FMAs + a shared conversion in fp32: no gain on the multiply ports.
// Symmetric codes are centred before the conversion (u - 2^(b-1)): dot(q, u) - 2^(b-1) sum(q) instead
// saves one add per 8 codes but loses too much to cancellation (pagedkv_core_test: 4.9e-4 against the
// 2e-4 bound).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "pagedkv_attn_impl.h"

namespace pagedkv {
namespace {

using impl::QuantRun;

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}


// ---- fused quantized path ------------------------------------------------------------------------

// 16 codes of a record as floats: u - 2^(b-1) when SYM (exact small integers), else u.
// 8 bits: a = dims j..j+7, b = dims j+8..j+15. 4 bits (value i in the low nibble first): the 8 bytes
// of dims j..j+15 are zero-extended to 32-bit lanes straight from memory and split into their nibbles
// without interleaving, so a = the even dims j, j+2, .., j+14 and b = the odd dims j+1, .., j+15
// (callers use q / accumulators in that order: see permute16 / unpermute16).
template <int BITS, bool SYM>
inline void load16(const uint8_t* codes, int j, __m256& a, __m256& b) {
  __m256i x0, x1;
  if (BITS == 8) {
    x0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j)));
    x1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j + 8)));
  } else {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j / 2)));
    x0 = _mm256_and_si256(x, _mm256_set1_epi32(0x0f));
    x1 = _mm256_srli_epi32(x, 4);
  }
  if (SYM) {
    const __m256i c = _mm256_set1_epi32(1 << (BITS - 1));
    x0 = _mm256_sub_epi32(x0, c);
    x1 = _mm256_sub_epi32(x1, c);
  }
  a = _mm256_cvtepi32_ps(x0);
  b = _mm256_cvtepi32_ps(x1);
}

// natural order [d0..d7], [d8..d15] -> evens [d0, d2, .., d14], odds [d1, .., d15]
inline void permute16(__m256 lo, __m256 hi, __m256& ev, __m256& od) {
  ev = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xd8));
  od = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd)), 0xd8));
}
// inverse of permute16
inline void unpermute16(__m256 ev, __m256 od, __m256& lo, __m256& hi) {
  const __m256 l = _mm256_unpacklo_ps(ev, od), h = _mm256_unpackhi_ps(ev, od);
  lo = _mm256_permute2f128_ps(l, h, 0x20);
  hi = _mm256_permute2f128_ps(l, h, 0x31);
}

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// [sum(v0), ..., sum(v7)]
inline __m256 hsum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
  const __m256 s01 = _mm256_hadd_ps(v0, v1), s23 = _mm256_hadd_ps(v2, v3);
  const __m256 s45 = _mm256_hadd_ps(v4, v5), s67 = _mm256_hadd_ps(v6, v7);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Scores of keys i, i+1 (NK = 2) or i (NK = 1) for GN <= 4 query heads.
// score = scale * sum_groups (s_k * dot(q, u - c) [+ z_k * sum(q)])
template <int BITS, bool SYM, int GN, int NK>
__attribute__((always_inline)) inline void scores_keys(const QuantRun& r, int ngk, const uint8_t* c0,
                                                       const uint8_t* c1, const float* m0, const float* q,
                                                       const float* qsum, float scale, float* sc, int ldsc, int i) {
  const int D = r.D, kg = r.k_group;
  const float* m1 = m0 + r.Ws;
  __m256 tot = _mm256_setzero_ps();  // lanes: key0 heads 0..3, key1 heads 0..3
  // with fewer than 8 (key, head) pairs the two halves of 16 dims go to separate accumulators: at least
  // 8 independent FMA chains in flight
  constexpr bool kSplit = GN * NK < 8;
  for (int gi = 0; gi < ngk; ++gi) {
    __m256 a0[4], a1[4], b0[4], b1[4];
    for (int g = 0; g < 4; ++g) a0[g] = a1[g] = b0[g] = b1[g] = _mm256_setzero_ps();
    for (int j = gi * kg; j < (gi + 1) * kg; j += 16) {
      __m256 x0a, x0b, x1a, x1b;
      load16<BITS, SYM>(c0, j, x0a, x0b);
      if (NK == 2) load16<BITS, SYM>(c1, j, x1a, x1b);
      for (int g = 0; g < GN; ++g) {
        const __m256 qa = _mm256_loadu_ps(q + (size_t)g * D + j), qb = _mm256_loadu_ps(q + (size_t)g * D + j + 8);
        if (kSplit) {
          a0[g] = _mm256_fmadd_ps(qa, x0a, a0[g]);
          b0[g] = _mm256_fmadd_ps(qb, x0b, b0[g]);
          if (NK == 2) a1[g] = _mm256_fmadd_ps(qa, x1a, a1[g]);
          if (NK == 2) b1[g] = _mm256_fmadd_ps(qb, x1b, b1[g]);
        } else {
          a0[g] = _mm256_fmadd_ps(qb, x0b, _mm256_fmadd_ps(qa, x0a, a0[g]));
          if (NK == 2) a1[g] = _mm256_fmadd_ps(qb, x1b, _mm256_fmadd_ps(qa, x1a, a1[g]));
        }
      }
    }
    if (kSplit)
      for (int g = 0; g < GN; ++g) {
        a0[g] = _mm256_add_ps(a0[g], b0[g]);
        a1[g] = _mm256_add_ps(a1[g], b1[g]);
      }
    const __m256 sums = hsum8(a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]);
    const float s0 = m0[gi], s1 = NK == 2 ? m1[gi] : 0.f;
    const __m256 vs = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
    tot = _mm256_fmadd_ps(sums, vs, tot);
    if (!SYM) {  // + z * sum(q over the group)
      const float z0 = m0[ngk + gi], z1 = NK == 2 ? m1[ngk + gi] : 0.f;
      float qs[4] = {0.f, 0.f, 0.f, 0.f};
      for (int g = 0; g < GN; ++g) qs[g] = qsum[g * ngk + gi];
      const __m256 vq = _mm256_setr_ps(qs[0], qs[1], qs[2], qs[3], qs[0], qs[1], qs[2], qs[3]);
      tot = _mm256_fmadd_ps(vq, _mm256_setr_ps(z0, z0, z0, z0, z1, z1, z1, z1), tot);
    }
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, _mm256_mul_ps(tot, _mm256_set1_ps(scale)));
  for (int g = 0; g < GN; ++g) {
    sc[(size_t)g * ldsc + i] = out[g];
    if (NK == 2) sc[(size_t)g * ldsc + i + 1] = out[4 + g];
  }
}

// The next run's records and scales (QuantRun::next_*), a share of lines per key pair of the K pass
// (one burst would stall the loads behind it), and the first line of each block of the run after it
// (its page's translation).
struct Prefetcher {
  const QuantRun& r;
  const size_t bl;  // lines per block
  size_t per = 0;   // lines per key pair
  int blk = 0;      // the cursor: line `off` of next block blk
  size_t off = 0;
  Prefetcher(const QuantRun& run, bool on) : r(run), bl((run.block_bytes + 63) / 64) {
    if (!on) {
      blk = r.next_nseg;  // nothing to prefetch
      return;
    }
    per = ((size_t)r.next_nseg * bl * 2 + r.n - 1) / r.n;
    for (int b = 0; b < r.after_nseg; ++b) _mm_prefetch(reinterpret_cast<const char*>(r.after_codes[b]), _MM_HINT_T2);
    for (int b = 0; b < r.next_nseg; ++b)
      for (size_t o = 0; o < r.block_meta_bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(r.next_meta[b]) + o, _MM_HINT_T0);
  }
  // the next `per` lines (called once per key pair of the K pass)
  void step() {
    for (size_t k = 0; k < per && blk < r.next_nseg; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(r.next_codes[blk]) + 64 * off, _MM_HINT_T0);
      if (++off == bl) off = 0, ++blk;
    }
  }
};

template <int BITS, bool SYM, int GN>
void scores_tile(const QuantRun& r, const float* q, const float* qsum, float scale, float* sc, int ldsc, bool pf) {
  Prefetcher pre(r, pf);
  const int ngk = r.D / r.k_group;
  int i = 0;
  for (; i + 2 <= r.n; i += 2) {
    pre.step();
    scores_keys<BITS, SYM, GN, 2>(r, ngk, r.rec(i), r.rec(i + 1), r.metaf + (size_t)i * r.Ws, q, qsum, scale, sc, ldsc, i);
  }
  if (i < r.n) {
    pre.step();
    scores_keys<BITS, SYM, GN, 1>(r, ngk, r.rec(i), r.rec(i), r.metaf + (size_t)i * r.Ws, q, qsum, scale, sc, ldsc, i);
  }
}

template <int BITS, bool SYM>
void scores_all(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc) {
  const int ngk = r.D / r.k_group;
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    scores_tile<BITS, SYM, decltype(gn)::value>(r, q + (size_t)g0 * r.D, qsum + (size_t)g0 * ngk, scale,
                                                sc + (size_t)g0 * ldsc, ldsc, g0 == 0);
  });
}

// acc[g] += sum_i p[g][i] * v_i for GN <= 4 heads, v_i = s * (u - c) (sym) or s * u + z (asym):
// accumulated as (p * s) * (u - c) + sum_i p * z, 16 dims at a time kept in registers over the keys.
template <int BITS, bool SYM, int GN>
void vacc_tile(const QuantRun& r, const float* p, int ldp, float* acc) {
  constexpr int NK = kMaxRunKeys;
  const int D = r.D, vg = r.v_group, ngv = D / vg, n = r.n;
  const int n8 = (n + 7) & ~7;            // p rows hold finite values up to run_capacity >= n8
  alignas(32) float coef[32 * 4 * NK];     // [group][head][key]
  alignas(32) float sv[NK], zv[NK];
  float zt[32 * 4];                        // [group][head]
  for (int k = 0; k < ngv; ++k) {
    const float* mk = r.metaf + r.ksc + k;
    for (int i = 0; i < n; ++i) sv[i] = mk[(size_t)i * r.Ws];
    if (!SYM)
      for (int i = 0; i < n8; ++i) zv[i] = i < n ? mk[(size_t)i * r.Ws + ngv] : 0.f;
    for (int g = 0; g < GN; ++g) {
      const float* pg = p + (size_t)g * ldp;
      float* cf = coef + ((size_t)k * 4 + g) * NK;
      __m256 zs = _mm256_setzero_ps();
      for (int i = 0; i < n8; i += 8) {
        const __m256 pv = _mm256_loadu_ps(pg + i);
        _mm256_store_ps(cf + i, _mm256_mul_ps(pv, _mm256_load_ps(sv + i)));
        if (!SYM) zs = _mm256_fmadd_ps(pv, _mm256_load_ps(zv + i), zs);
      }
      zt[k * 4 + g] = SYM ? 0.f : hsum(zs);
    }
  }
  for (int j = 0; j < D; j += 16) {
    const int k = j / vg;
    __m256 A[GN][2];
    for (int g = 0; g < GN; ++g) {
      const __m256 z = _mm256_set1_ps(SYM ? 0.f : zt[k * 4 + g]);
      A[g][0] = _mm256_add_ps(_mm256_loadu_ps(acc + (size_t)g * D + j), z);
      A[g][1] = _mm256_add_ps(_mm256_loadu_ps(acc + (size_t)g * D + j + 8), z);
      if (BITS == 4) permute16(A[g][0], A[g][1], A[g][0], A[g][1]);
    }
    const float* cf = coef + (size_t)k * 4 * NK;
    // KS sets of accumulators take the keys in turn, so that at least 8 independent FMA chains are in
    // flight (one per set, head and half: a single set of 3 heads waits on the FMA latency)
    constexpr int KS = GN == 1 ? 4 : GN == 4 ? 1 : 2;
    __m256 E[KS > 1 ? KS - 1 : 1][GN][2];
    for (int s = 0; s + 1 < KS; ++s)
      for (int g = 0; g < GN; ++g) E[s][g][0] = E[s][g][1] = _mm256_setzero_ps();
    int i = 0;
    for (; i + KS <= n; i += KS) {
      for (int s = 0; s < KS; ++s) {
        __m256 xa, xb;
        load16<BITS, SYM>(r.rec(i + s) + r.kcb, j, xa, xb);
        for (int g = 0; g < GN; ++g) {
          const __m256 w = _mm256_broadcast_ss(cf + g * NK + i + s);
          __m256* a = s ? E[s - 1][g] : A[g];
          a[0] = _mm256_fmadd_ps(w, xa, a[0]);
          a[1] = _mm256_fmadd_ps(w, xb, a[1]);
        }
      }
    }
    for (; i < n; ++i) {
      __m256 xa, xb;
      load16<BITS, SYM>(r.rec(i) + r.kcb, j, xa, xb);
      for (int g = 0; g < GN; ++g) {
        const __m256 w = _mm256_broadcast_ss(cf + g * NK + i);
        A[g][0] = _mm256_fmadd_ps(w, xa, A[g][0]);
        A[g][1] = _mm256_fmadd_ps(w, xb, A[g][1]);
      }
    }
    for (int s = 0; s + 1 < KS; ++s)
      for (int g = 0; g < GN; ++g) {
        A[g][0] = _mm256_add_ps(A[g][0], E[s][g][0]);
        A[g][1] = _mm256_add_ps(A[g][1], E[s][g][1]);
      }
    for (int g = 0; g < GN; ++g) {
      if (BITS == 4) unpermute16(A[g][0], A[g][1], A[g][0], A[g][1]);
      _mm256_storeu_ps(acc + (size_t)g * D + j, A[g][0]);
      _mm256_storeu_ps(acc + (size_t)g * D + j + 8, A[g][1]);
    }
  }
}

template <int BITS, bool SYM>
void vacc_all(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    vacc_tile<BITS, SYM, decltype(gn)::value>(r, p + (size_t)g0 * ldp, ldp, acc + (size_t)g0 * r.D);
  });
}

// exp for the softmax only (ExpConsts); x <= 0 here. Below ExpConsts::kMin the result is 0.
inline __m256 exp256(__m256 x) {
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

// lanes i..i+7 of a row of n keys: all-ones for i + lane < n
inline __m256 live_lanes(int i, int n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

struct Avx2Ops {
  static constexpr bool kFastQuant = true;
  static constexpr int kRunKeys = kMaxRunKeys;  // runs of several blocks (QuantRun::rec)

  static void q_scores(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc) {
    // the run's fp16 scales/zeros as float32, the segments back to back, once (v_accum reuses them)
    float* mf = r.metaf;
    for (int sg = 0; sg < r.nseg; ++sg) {
      const uint16_t* m = r.seg_meta[sg];
      const size_t nm = (size_t)r.seg_n[sg] * r.Ws;
      size_t i = 0;
      for (; i + 8 <= nm; i += 8)
        _mm256_storeu_ps(mf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + i))));
      for (; i < nm; ++i) mf[i] = h2f(m[i]);
      mf += nm;
    }
    if (r.k_bits == 8) {
      r.k_sym ? scores_all<8, true>(r, q, qsum, G, scale, sc, ldsc) : scores_all<8, false>(r, q, qsum, G, scale, sc, ldsc);
    } else {
      r.k_sym ? scores_all<4, true>(r, q, qsum, G, scale, sc, ldsc) : scores_all<4, false>(r, q, qsum, G, scale, sc, ldsc);
    }
  }
  static void v_accum(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
    if (r.v_bits == 8) {
      r.v_sym ? vacc_all<8, true>(r, p, ldp, G, acc) : vacc_all<8, false>(r, p, ldp, G, acc);
    } else {
      r.v_sym ? vacc_all<4, true>(r, p, ldp, G, acc) : vacc_all<4, false>(r, p, ldp, G, acc);
    }
  }
  // q in the lane order q_scores reads for k_bits (4 bits: evens/odds per 16 dims)
  static void q_prepare(const float* q, int G, int D, int k_bits, int k_group, float* out) {
    for (int j = 0; j < G * D; j += 16) {
      __m256 a = _mm256_loadu_ps(q + j), b = _mm256_loadu_ps(q + j + 8);
      if (k_bits == 4) permute16(a, b, a, b);
      _mm256_storeu_ps(out + j, a);
      _mm256_storeu_ps(out + j + 8, b);
    }
  }
  // row-wise softmax helpers (see pagedkv_attn_impl.h): rows of n <= kRunKeys keys, lanes past n masked
  static void row_max(const float* sc, int ldsc, int G, int n, float* out) {
    for (int g = 0; g < G; ++g) {
      const float* x = sc + (size_t)g * ldsc;
      const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      __m256 m = ninf;
      for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_blendv_ps(ninf, _mm256_loadu_ps(x + i), live_lanes(i, n)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      out[g] = _mm_cvtss_f32(h);
    }
  }
  static bool rows_above(const float* sc, int ldsc, int G, int n, const float* thr) {
    __m256 any = _mm256_setzero_ps();
    for (int g = 0; g < G; ++g) {
      const float* x = sc + (size_t)g * ldsc;
      const __m256 t = _mm256_set1_ps(thr[g]);
      for (int i = 0; i < n; i += 8)
        any = _mm256_or_ps(any, _mm256_and_ps(live_lanes(i, n), _mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_NLE_UQ)));
    }
    return _mm256_movemask_ps(any) != 0;
  }
  // x = exp(x - m[g]) for the n keys of each row (lanes past n: 0), sum[g] = the row's sum
  static void row_exp(float* sc, int ldsc, int G, int n, const float* m, float* sum) {
    for (int g = 0; g < G; ++g) {
      float* x = sc + (size_t)g * ldsc;
      const __m256 vm = _mm256_set1_ps(m[g]);
      __m256 vs = _mm256_setzero_ps();
      for (int i = 0; i < n; i += 8) {
        const __m256 e = _mm256_and_ps(live_lanes(i, n), exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
        _mm256_storeu_ps(x + i, e);
        vs = _mm256_add_ps(vs, e);
      }
      sum[g] = hsum(vs);
    }
  }
  static float max_n(const float* x, int n) {
    float m = x[0];
    int i = 0;
    if (n >= 8) {
      __m256 v = _mm256_loadu_ps(x);
      for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      m = _mm_cvtss_f32(h);
    }
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }
  static float exp_sub(float* x, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
      _mm256_storeu_ps(x + i, e);
      vs = _mm256_add_ps(vs, e);
    }
    float sum = hsum(vs);
    for (; i < n; ++i) {
      const float e = std::exp(x[i] - m);
      x[i] = e;
      sum += e;
    }
    return sum;
  }

  static float dot(const float* a, const float* b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float* y, float a, const float* x, int n) {
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
  }
  static void scale(float* y, float a, int n) {
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] *= a;
  }
  static void f16_to_f32(const uint16_t* h, float* out, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < n; ++i) out[i] = fp16_to_fp32(h[i]);
  }
  static void unpack4(const uint8_t* codes, int n, uint8_t* out) {
    const __m128i mask = _mm_set1_epi8(0x0f);
    int i = 0;
    for (; i + 32 <= n; i += 32) {  // 16 bytes -> 32 values
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i / 2));
      const __m128i lo = _mm_and_si128(b, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_unpacklo_epi8(lo, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 16), _mm_unpackhi_epi8(lo, hi));
    }
    unpack_codes(codes + i / 2, 4, n - i, out + i);  // the rest
  }
  static void dequant_u8(const uint8_t* u, const uint16_t* meta, int d, int group, bool sym, int bits, float* out) {
    const int ng = d / group;
    const float c = (float)(1 << (bits - 1));
    for (int g = 0; g < ng; ++g) {
      const float s = fp16_to_fp32(meta[g]);
      const float z = sym ? 0.f : fp16_to_fp32(meta[ng + g]);
      const int i0 = g * group, i1 = i0 + group;
      int i = i0;
      const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z), vc = _mm256_set1_ps(c);
      for (; i + 8 <= i1; i += 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + i));
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
        // no FMA here: (u - c) * s and u * s + z exactly as the reference rounds them
        const __m256 r = sym ? _mm256_mul_ps(_mm256_sub_ps(f, vc), vs) : _mm256_add_ps(_mm256_mul_ps(f, vs), vz);
        _mm256_storeu_ps(out + i, r);
      }
      for (; i < i1; ++i) out[i] = sym ? ((float)u[i] - c) * s : (float)u[i] * s + z;
    }
  }
};

}  // namespace

void attend_avx2(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<Avx2Ops> a(c, scratch);
  a(t, h);
}

}  // namespace pagedkv
