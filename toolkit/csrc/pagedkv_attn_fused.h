// The Ops of impl::Attend (pagedkv_attn_impl.h) written once over a vector wrapper V
// (pagedkv_vec_avx2.h, pagedkv_vec_neon.h): the plain primitives of the generic path and the fused
// quantized path, which never writes dequantized rows. An ISA file instantiates FusedOps<V> (and may
// replace a member: the NEON dotprod path has its own integer K scores).
//
// The fused path, per run of up to kRunKeys (64) keys of consecutive quantized blocks:
//   scores (scores_tile): per 4 keys (tiles of <= 3 query heads) or key pair (4 heads), fp32 FMAs of q
//     with the codes converted 16 dims at a time (one conversion serves all heads of the tile), reduced per K group
//     and scaled: score = scale * sum_groups (s * dot(q, u - c) [+ z' * sum(q)]). The next run's records
//     are prefetched a few lines per key pair, the first line of each block of the run after it earlier.
//   softmax (row_max / row_exp / rows_above): a row of the run's scores at a time, lanes past n masked,
//     with impl::Attend's lazy running maximum.
//   V sums (vacc_tile): the coefficients p * s per (group, head, key) once per run, then accumulators of
//     16 dims x the tile's heads stay in registers while the run's keys stream by.
// Both passes keep at least 8 independent FMA chains in flight: the FMA latency (4 cycles on most
// cores, 2 FMA pipes) would otherwise bound a tile of 1-3 heads.
// Codes are read centred (u - 2^(b-1)) when symmetric: (u - c) s is the reference's value, and
// dot(q, u) - c sum(q) would lose too much to cancellation (4.9e-4 against the core test's 2e-4
// bound, measured on AVX2); asymmetric codes are centred when V::kCentredAsym (z' = z + c s), else
// read as u (z' = z).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "pagedkv_attn_impl.h"

namespace pagedkv {
namespace {  // per translation unit, like the wrappers (see pagedkv_vec_neon.h)
namespace fused {

using impl::QuantRun;

// n fp16 values as float32
template <class V>
inline void f16_to_f32(const uint16_t* h, float* out, int n) {
  int i = 0;
  for (; i + V::N <= n; i += V::N) V::store(out + i, V::load_f16(h + i));
  for (; i < n; ++i) out[i] = fp16_to_fp32(h[i]);
}

// The run's fp16 scales/zeros as float32 into r.metaf, the segments back to back (q_scores does it
// once per run; v_accum reuses them)
template <class V>
inline void meta_to_f32(const QuantRun& r) {
  float* mf = r.metaf;
  for (int sg = 0; sg < r.nseg; ++sg) {
    const size_t nm = (size_t)r.seg_n[sg] * r.Ws;
    f16_to_f32<V>(r.seg_meta[sg], mf, (int)nm);
    mf += nm;
  }
}

// The next run's records and scales (QuantRun::next_*), a share of lines per key pair of the K pass
// (one burst would stall the loads behind it), and the first line of each block of the run after it
// (its page's translation).
template <class V>
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
    for (int b = 0; b < r.after_nseg; ++b) V::prefetch_far(r.after_codes[b]);
    for (int b = 0; b < r.next_nseg; ++b)
      for (size_t o = 0; o < r.block_meta_bytes; o += 64)
        V::prefetch(reinterpret_cast<const char*>(r.next_meta[b]) + o);
  }
  // the next `per` lines (called once per key pair of the K pass)
  void step() {
    for (size_t k = 0; k < per && blk < r.next_nseg; ++k) {
      V::prefetch(r.next_codes[blk] + 64 * off);
      if (++off == bl) off = 0, ++blk;
    }
  }
};

// Independent accumulators per (key, head) of a pass with `pairs` (key, head) pairs and `per` vectors
// per 16 dims: enough for 8 chains, at most one per vector
constexpr int chains(int pairs, int per) {
  return pairs >= 8 ? 1 : std::min(per, (8 + pairs - 1) / pairs);
}

// Scores of keys i, i+1 (NK = 2: codes c0, c1) or i (NK = 1) for GN <= 4 query heads; q in code order
// (FusedOps::q_prepare), m0 the float scales of key i.
template <class V, int BITS, bool SYM, int GN, int NK>
__attribute__((always_inline)) inline void scores_keys(const QuantRun& r, int ngk, const uint8_t* c0,
                                                       const uint8_t* c1, const float* m0, const float* q,
                                                       const float* qsum, float scale, float* sc, int ldsc, int i) {
  using F = typename V::F;
  using F4 = typename V::F4;
  constexpr int P = 16 / V::N;               // vectors per 16 dims
  constexpr bool CEN = SYM || V::kCentredAsym;
  constexpr int C = chains(GN * NK, P);
  const int D = r.D, kg = r.k_group;
  const uint8_t* const c[2] = {c0, c1};
  F4 tot[NK];  // lanes: heads 0..3
  for (int k = 0; k < NK; ++k) tot[k] = V::f4_zero();
  for (int gi = 0; gi < ngk; ++gi) {
    F a[NK][4][C];  // heads >= GN stay 0
    for (int k = 0; k < NK; ++k)
      for (int g = 0; g < 4; ++g)
        for (int h = 0; h < C; ++h) a[k][g][h] = V::zero();
    for (int j = gi * kg; j < (gi + 1) * kg; j += 16) {
      F x[NK][P];
      for (int k = 0; k < NK; ++k) V::template codes16<BITS, CEN>(c[k], j, x[k]);
      for (int g = 0; g < GN; ++g)
        for (int v = 0; v < P; ++v) {
          const F qv = V::load(q + (size_t)g * D + j + v * V::N);
          for (int k = 0; k < NK; ++k) a[k][g][v % C] = V::fma(qv, x[k][v], a[k][g][v % C]);
        }
    }
    for (int k = 0; k < NK; ++k)
      for (int g = 0; g < GN; ++g)
        for (int h = 1; h < C; ++h) a[k][g][0] = V::add(a[k][g][0], a[k][g][h]);
    F4 qs = V::f4_zero();
    if (!SYM) {
      float qa[4] = {0.f, 0.f, 0.f, 0.f};
      for (int g = 0; g < GN; ++g) qa[g] = qsum[(size_t)g * ngk + gi];
      qs = V::f4_load(qa);
    }
    for (int k = 0; k < NK; ++k) {
      const float* mk = m0 + (size_t)k * r.Ws;
      tot[k] = V::f4_fma(V::hsum4(a[k][0][0], a[k][1][0], a[k][2][0], a[k][3][0]), mk[gi], tot[k]);
      if (!SYM) tot[k] = V::f4_fma(qs, mk[ngk + gi] + (CEN ? (float)r.k_mid * mk[gi] : 0.f), tot[k]);
    }
  }
  for (int k = 0; k < NK; ++k) {
    float out[4];
    V::f4_store(out, V::f4_mul(tot[k], scale));
    for (int g = 0; g < GN; ++g) sc[(size_t)g * ldsc + i + k] = out[g];
  }
}

// Scores of keys i..i+3 for GN <= 3 query heads (scores_tile's main loop there): one accumulator per
// (key, head), the codes of one key at a time, and per head one hsum4 over the 4 keys, whose lanes are
// the head's 4 consecutive scores. Per key this halves scores_keys' epilogue (horizontal sums, scalar
// stores) and its register pressure (12 accumulators, 2 code vectors, no spill on AVX2's 16 registers).
// Each (key, head) sum takes the same operations in the same order as in scores_keys with one chain.
template <class V, int BITS, bool SYM, int GN>
__attribute__((always_inline)) inline void scores_keys4(const QuantRun& r, int ngk, int i, const float* q,
                                                        const float* qsum, float scale, float* sc, int ldsc) {
  static_assert(GN <= 3, "4 keys x 4 heads would need 16 accumulators");
  using F = typename V::F;
  using F4 = typename V::F4;
  constexpr int P = 16 / V::N;
  constexpr bool CEN = SYM || V::kCentredAsym;
  const int D = r.D, kg = r.k_group;
  const uint8_t* const c[4] = {r.rec(i), r.rec(i + 1), r.rec(i + 2), r.rec(i + 3)};
  const float* const m = r.metaf + (size_t)i * r.Ws;  // key k's float scales at m + k * Ws
  F4 tot[GN];  // lanes: keys i..i+3
  for (int g = 0; g < GN; ++g) tot[g] = V::f4_zero();
  for (int gi = 0; gi < ngk; ++gi) {
    F a[4][GN];
    for (int k = 0; k < 4; ++k)
      for (int g = 0; g < GN; ++g) a[k][g] = V::zero();
    for (int j = gi * kg; j < (gi + 1) * kg; j += 16)
      for (int k = 0; k < 4; ++k) {
        F x[P];
        V::template codes16<BITS, CEN>(c[k], j, x);
        for (int g = 0; g < GN; ++g)
          for (int v = 0; v < P; ++v) a[k][g] = V::fma(V::load(q + (size_t)g * D + j + v * V::N), x[v], a[k][g]);
      }
    alignas(16) float s4[4], z4[4];
    for (int k = 0; k < 4; ++k) {
      s4[k] = m[(size_t)k * r.Ws + gi];
      if (!SYM) z4[k] = m[(size_t)k * r.Ws + ngk + gi] + (CEN ? (float)r.k_mid * s4[k] : 0.f);
    }
    const F4 sv = V::f4_load(s4);
    for (int g = 0; g < GN; ++g) {
      tot[g] = V::f4_fmav(V::hsum4(a[0][g], a[1][g], a[2][g], a[3][g]), sv, tot[g]);
      if (!SYM) tot[g] = V::f4_fma(V::f4_load(z4), qsum[(size_t)g * ngk + gi], tot[g]);
    }
  }
  for (int g = 0; g < GN; ++g) V::f4_store(sc + (size_t)g * ldsc + i, V::f4_mul(tot[g], scale));
}

template <class V, int BITS, bool SYM, int GN>
void scores_tile(const QuantRun& r, const float* q, const float* qsum, float scale, float* sc, int ldsc, bool pf) {
  Prefetcher<V> pre(r, pf);
  const int ngk = r.D / r.k_group;
  int i = 0;
  if constexpr (GN <= 3) {
    for (; i + 4 <= r.n; i += 4) {
      pre.step();
      pre.step();
      scores_keys4<V, BITS, SYM, GN>(r, ngk, i, q, qsum, scale, sc, ldsc);
    }
  }
  for (; i + 2 <= r.n; i += 2) {
    pre.step();
    scores_keys<V, BITS, SYM, GN, 2>(r, ngk, r.rec(i), r.rec(i + 1), r.metaf + (size_t)i * r.Ws, q, qsum, scale, sc,
                                     ldsc, i);
  }
  if (i < r.n) {
    pre.step();
    scores_keys<V, BITS, SYM, GN, 1>(r, ngk, r.rec(i), r.rec(i), r.metaf + (size_t)i * r.Ws, q, qsum, scale, sc,
                                     ldsc, i);
  }
}

template <class V, int BITS, bool SYM>
void scores_all(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc) {
  const int ngk = r.D / r.k_group;
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    scores_tile<V, BITS, SYM, decltype(gn)::value>(r, q + (size_t)g0 * r.D, qsum + (size_t)g0 * ngk, scale,
                                                   sc + (size_t)g0 * ldsc, ldsc, g0 == 0);
  });
}

// acc[g] += sum_i p[g][i] * v_i for GN <= 4 heads, v_i = s (u - c) (sym) or s u + z (asym): accumulated
// as (p s) * (u - c) + sum_i p z' (the codes as scores_keys reads them), 16 dims at a time kept in
// registers over the keys.
template <class V, int BITS, bool SYM, int GN>
void vacc_tile(const QuantRun& r, const float* p, int ldp, float* acc) {
  using F = typename V::F;
  constexpr int NK = kMaxRunKeys, P = 16 / V::N;
  constexpr bool CEN = SYM || V::kCentredAsym;
  const int D = r.D, vg = r.v_group, ngv = D / vg, n = r.n;
  const int nv = (n + V::N - 1) / V::N * V::N;  // p rows hold finite values up to run_capacity >= nv
  alignas(64) float coef[32 * 4 * NK];           // [group][head][key]
  alignas(64) float sv[NK], zv[NK];
  float zt[32 * 4];                              // [group][head]: sum_i p z'
  for (int k = 0; k < ngv; ++k) {
    const float* mk = r.metaf + r.ksc + k;
    for (int i = 0; i < n; ++i) sv[i] = mk[(size_t)i * r.Ws];
    for (int i = n; i < nv; ++i) sv[i] = 0.f;
    if (!SYM) {  // z + c s: c s is exact, one rounding of a value near the group's mid-range
      for (int i = 0; i < n; ++i) zv[i] = mk[(size_t)i * r.Ws + ngv] + (CEN ? (float)r.v_mid * sv[i] : 0.f);
      for (int i = n; i < nv; ++i) zv[i] = 0.f;
    }
    for (int g = 0; g < GN; ++g) {
      const float* pg = p + (size_t)g * ldp;
      float* cf = coef + ((size_t)k * 4 + g) * NK;
      F zs = V::zero();
      for (int i = 0; i < nv; i += V::N) {
        const F pv = V::load(pg + i);
        V::store(cf + i, V::mul(pv, V::load(sv + i)));
        if (!SYM) zs = V::fma(pv, V::load(zv + i), zs);
      }
      zt[k * 4 + g] = SYM ? 0.f : V::hsum(zs);
    }
  }
  // KS sets of accumulators take the keys in turn: at least 8 independent FMA chains in flight
  constexpr int KS = chains(GN * P, 8);
  for (int j = 0; j < D; j += 16) {
    const int k = j / vg;
    F A[GN][P];
    for (int g = 0; g < GN; ++g) {
      const F z = V::set1(SYM ? 0.f : zt[k * 4 + g]);
      for (int v = 0; v < P; ++v) A[g][v] = V::add(V::load(acc + (size_t)g * D + j + v * V::N), z);
      V::template to_code_order<BITS>(A[g]);
    }
    const float* cf = coef + (size_t)k * 4 * NK;
    F E[KS > 1 ? KS - 1 : 1][GN][P];
    for (int s = 0; s + 1 < KS; ++s)
      for (int g = 0; g < GN; ++g)
        for (int v = 0; v < P; ++v) E[s][g][v] = V::zero();
    int i = 0;
    for (; i + KS <= n; i += KS)
      for (int s = 0; s < KS; ++s) {
        F x[P];
        V::template codes16<BITS, CEN>(r.rec(i + s) + r.kcb, j, x);
        for (int g = 0; g < GN; ++g) {
          const F w = V::bcast(cf + g * NK + i + s);
          F* a = s ? E[s - 1][g] : A[g];
          for (int v = 0; v < P; ++v) a[v] = V::fma(w, x[v], a[v]);
        }
      }
    for (; i < n; ++i) {
      F x[P];
      V::template codes16<BITS, CEN>(r.rec(i) + r.kcb, j, x);
      for (int g = 0; g < GN; ++g) {
        const F w = V::bcast(cf + g * NK + i);
        for (int v = 0; v < P; ++v) A[g][v] = V::fma(w, x[v], A[g][v]);
      }
    }
    for (int s = 0; s + 1 < KS; ++s)
      for (int g = 0; g < GN; ++g)
        for (int v = 0; v < P; ++v) A[g][v] = V::add(A[g][v], E[s][g][v]);
    for (int g = 0; g < GN; ++g) {
      V::template from_code_order<BITS>(A[g]);
      for (int v = 0; v < P; ++v) V::store(acc + (size_t)g * D + j + v * V::N, A[g][v]);
    }
  }
}

template <class V, int BITS, bool SYM>
void vacc_all(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    vacc_tile<V, BITS, SYM, decltype(gn)::value>(r, p + (size_t)g0 * ldp, ldp, acc + (size_t)g0 * r.D);
  });
}

// f(std::integral_constant<int, B>(), std::integral_constant<bool, S>()) for the 8- or 4-bit codes
// (bits) of the fused path and their symmetry
template <class Fn>
inline void with_width(int bits, bool sym, Fn&& f) {
  using B8 = std::integral_constant<int, 8>;
  using B4 = std::integral_constant<int, 4>;
  using T = std::true_type;
  using N = std::false_type;
  if (bits == 8) {
    sym ? f(B8(), T()) : f(B8(), N());
  } else {
    sym ? f(B4(), T()) : f(B4(), N());
  }
}

template <class V>
struct FusedOps {
  using F = typename V::F;
  static constexpr bool kFastQuant = true;
  static constexpr int kRunKeys = kMaxRunKeys;  // runs of several blocks (QuantRun::rec)
  static constexpr bool kCentredAsym = V::kCentredAsym;

  // ---- fused quantized path ----
  static void q_scores(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc) {
    meta_to_f32<V>(r);
    with_width(r.k_bits, r.k_sym, [&](auto b, auto s) {
      scores_all<V, decltype(b)::value, decltype(s)::value>(r, q, qsum, G, scale, sc, ldsc);
    });
  }
  static void v_accum(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
    with_width(r.v_bits, r.v_sym, [&](auto b, auto s) {
      vacc_all<V, decltype(b)::value, decltype(s)::value>(r, p, ldp, G, acc);
    });
  }
  // q in the code order q_scores reads for k_bits
  static void q_prepare(const float* q, int G, int D, int k_bits, int k_group, float* out) {
    constexpr int P = 16 / V::N;
    for (int j = 0; j < G * D; j += 16) {
      F x[P];
      for (int v = 0; v < P; ++v) x[v] = V::load(q + j + v * V::N);
      if (k_bits == 4) V::template to_code_order<4>(x);
      for (int v = 0; v < P; ++v) V::store(out + j + v * V::N, x[v]);
    }
  }
  // a run's records widened to 8 bits (impl::Attend::widen_run): the wrapper's own loop if it has one
  static void widen(const uint8_t* codes, int bits, int n, uint8_t add, uint8_t* out) {
    if constexpr (impl::HasWiden<V>::value) {
      V::widen(codes, bits, n, add, out);
    } else {
      impl::widen_codes(codes, bits, n, add, out);
    }
  }

  // ---- softmax over rows of n <= kRunKeys scores (lanes past n masked) ----
  static void row_max(const float* sc, int ldsc, int G, int n, float* out) {
    const F ninf = V::set1(-std::numeric_limits<float>::infinity());
    for (int g = 0; g < G; ++g) {
      const float* x = sc + (size_t)g * ldsc;
      F m = ninf;
      for (int i = 0; i < n; i += V::N) m = V::max(m, V::select(V::live(i, n), V::load(x + i), ninf));
      out[g] = V::hmax(m);
    }
  }
  // any score above its row's threshold (or NaN)
  static bool rows_above(const float* sc, int ldsc, int G, int n, const float* thr) {
    auto any = V::mask_none();
    for (int g = 0; g < G; ++g) {
      const float* x = sc + (size_t)g * ldsc;
      const F t = V::set1(thr[g]);
      for (int i = 0; i < n; i += V::N)
        any = V::mask_or(any, V::mask_and(V::live(i, n), V::gt_or_nan(V::load(x + i), t)));
    }
    return V::any(any);
  }
  // x = exp(x - m[g]) for the n keys of each row (lanes past n: 0), sum[g] = the row's sum
  static void row_exp(float* sc, int ldsc, int G, int n, const float* m, float* sum) {
    for (int g = 0; g < G; ++g) {
      float* x = sc + (size_t)g * ldsc;
      const F vm = V::set1(m[g]);
      F vs = V::zero();
      for (int i = 0; i < n; i += V::N) {
        const F e = V::keep(V::live(i, n), V::exp(V::sub(V::load(x + i), vm)));
        V::store(x + i, e);
        vs = V::add(vs, e);
      }
      sum[g] = V::hsum(vs);
    }
  }
  static float max_n(const float* x, int n) {
    float m = x[0];
    int i = 0;
    if (n >= V::N) {
      F v = V::load(x);
      for (i = V::N; i + V::N <= n; i += V::N) v = V::max(v, V::load(x + i));
      m = V::hmax(v);
    }
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }
  static float exp_sub(float* x, int n, float m) {
    const F vm = V::set1(m);
    F vs = V::zero();
    int i = 0;
    for (; i + V::N <= n; i += V::N) {
      const F e = V::exp(V::sub(V::load(x + i), vm));
      V::store(x + i, e);
      vs = V::add(vs, e);
    }
    float sum = V::hsum(vs);
    for (; i < n; ++i) {
      const float e = std::exp(x[i] - m);
      x[i] = e;
      sum += e;
    }
    return sum;
  }

  // ---- the generic path's primitives (float rows: fp16/fp32 pools, the sink/tail rows, odd shapes) ----
  static float dot(const float* a, const float* b, int n) {
    F s0 = V::zero(), s1 = V::zero();
    int i = 0;
    for (; i + 2 * V::N <= n; i += 2 * V::N) {
      s0 = V::fma(V::load(a + i), V::load(b + i), s0);
      s1 = V::fma(V::load(a + i + V::N), V::load(b + i + V::N), s1);
    }
    for (; i + V::N <= n; i += V::N) s0 = V::fma(V::load(a + i), V::load(b + i), s0);
    float s = V::hsum(V::add(s0, s1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float* y, float a, const float* x, int n) {  // y += a x
    const F va = V::set1(a);
    int i = 0;
    for (; i + V::N <= n; i += V::N) V::store(y + i, V::fma(va, V::load(x + i), V::load(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
  }
  static void scale(float* y, float a, int n) {
    const F va = V::set1(a);
    int i = 0;
    for (; i + V::N <= n; i += V::N) V::store(y + i, V::mul(va, V::load(y + i)));
    for (; i < n; ++i) y[i] *= a;
  }
  static void f16_to_f32(const uint16_t* h, float* out, int n) { fused::f16_to_f32<V>(h, out, n); }
  static void unpack4(const uint8_t* codes, int n, uint8_t* out) {
    const int n8 = n & ~7;
    impl::widen_codes_n<4>(codes, n8, 0, out);
    unpack_codes(codes + n8 / 2, 4, n - n8, out + n8);  // the rest
  }
  // u (unsigned codes, one per byte) dequantized exactly as the reference: (u - c) s or u s + z, a
  // separate multiply and add (no contraction: the file is built with -ffp-contract=off)
  static void dequant_u8(const uint8_t* u, const uint16_t* meta, int d, int group, bool sym, int bits, float* out) {
    const int ng = d / group;
    const float c = (float)(1 << (bits - 1));
    for (int g = 0; g < ng; ++g) {
      const float s = fp16_to_fp32(meta[g]);
      const float z = sym ? 0.f : fp16_to_fp32(meta[ng + g]);
      const int i0 = g * group, i1 = i0 + group;
      const F vs = V::set1(s), vz = V::set1(z), vc = V::set1(c);
      int i = i0;
      for (; i + V::N <= i1; i += V::N) {
        const F f = V::load_u8(u + i);
        V::store(out + i, sym ? V::mul(V::sub(f, vc), vs) : V::add(V::mul(f, vs), vz));
      }
      for (; i < i1; ++i) out[i] = sym ? ((float)u[i] - c) * s : (float)u[i] * s + z;
    }
  }
};

}  // namespace fused
}  // namespace
}  // namespace pagedkv
