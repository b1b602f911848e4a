// NEON dotprod attention path (this file alone is compiled with -march=armv8.2-a+dotprod; the caller
// checks getauxval(AT_HWCAP) & HWCAP_ASIMDDP before selecting it): the plain NEON path's shapes
// (pagedkv_attn_fused.h on pagedkv_vec_neon.h: runs of up to 64 keys, prefetch, row-wise softmax with the
// lazy running maximum, fp32 V sums in registers) with the K scores of 8/4-bit codes as int8 `sdot`
// (vdotq_s32) dot products, the way the avx512-vnni path does its K dots with vpdpbusd.
//
// Integer scores at fp32 accuracy: per (query head, K group) q is scaled by a power of two s with
// max|q| / s <= 127 * 65536 and rounded, Q = round(q / s) (|Q| < 2^23, so the rounding error is at
// most 0.5 * s <= 2^-23 * max|q|, like fp32 itself), then split into three balanced int8 limbs
// Q = 65536 a + 256 b + c. The codes enter sdot centred, u - 2^(b-1) (fits int8), so each limb's dot
// product is exact in int32 (and as a float: |dot| <= 2^14 per dim < 2^24 for groups up to 1024), and
// dot(q, u - 2^(b-1)) = s * (65536 A + 256 B + C) loses only the final float rounding.
// Asymmetric K: s_k u + z = s_k (u - 2^(b-1)) + (z + 2^(b-1) s_k), so the score adds
// (z + 2^(b-1) s_k) * sum(q); the centred form avoids the cancellation of s_k u against z (measured
// 2-3x closer to the exact dot than s_k * dot(q, u) + z * sum(q)).
// Per key pair, 16 dims and head: 3 limbs x 2 keys = 6 independent sdot chains (24 for a tile of 4
// heads), one code load per key for all heads.
#include <algorithm>
#include <cmath>
#include <limits>

#include "pagedkv_vec_neon.h"
#include "pagedkv_attn_fused.h"

namespace pagedkv {
namespace {

using impl::QuantRun;

// The query as q_scores reads it, written by q_prepare into Attend's qk scratch (2 * G * D floats):
//   limbs int8  [G][D / 16][3][16]  a, b, c of 16 dims (4-bit K: even dims then odd dims, the order
//                                   load16k unpacks the nibbles of 8 code bytes in)
//   sq    float [ngk][G4]           s per (K group, head); G4 = G rounded up to 4, zero padded
// 3 G D + 4 G4 ngk bytes <= 3.25 G D + 0.75 D bytes (groups of >= 16 dims): within the 8 G D.
struct QPrep {
  int8_t* limbs;
  float* sq;
  int G4;
  QPrep(const float* base, int G, int D) {
    G4 = (G + 3) & ~3;
    limbs = reinterpret_cast<int8_t*>(const_cast<float*>(base));
    sq = const_cast<float*>(base) + (size_t)3 * G * D / 4;  // D % 16 == 0: a whole number of floats
  }
};

constexpr float kQMax = 127.f * 65536.f;  // max |Q|: keeps the top limb within [-127, 127]

// byte slot t (0..15) of a 16-dim chunk of limbs holds dim limb_dim(t) of the chunk
inline int limb_dim(int t, int k_bits) { return k_bits == 4 ? (t < 8 ? 2 * t : 2 * (t - 8) + 1) : t; }

// Splits one (head, K group) of q into limbs; returns s (NaN if the group has a non-finite value,
// so the scores become NaN as in the scalar path).
float split_q_limbs(const float* q, int n, int k_bits, int8_t* limbs) {
  float m = 0.f;
  bool finite = true;  // (a NaN would slip through the maximum: std::max(m, NaN) is m)
  for (int i = 0; i < n; ++i) {
    finite = finite && std::isfinite(q[i]);
    m = std::max(m, std::fabs(q[i]));
  }
  if (!finite) {
    std::fill(limbs, limbs + (size_t)3 * n, (int8_t)0);
    return std::numeric_limits<float>::quiet_NaN();
  }
  int e = 0;
  if (m > 0.f) {
    int E;
    std::frexp(m, &E);  // m = f * 2^E, f in [0.5, 1)
    e = E - 23;        // m / 2^e in [2^22, 2^23)
    if (std::ldexp(m, -e) > kQMax) ++e;
    e = std::max(e, -149);  // s stays a (subnormal) float; q / s is still an exact integer then
  }
  for (int j = 0; j < n; j += 16) {
    int8_t* dst = limbs + (size_t)j * 3;
    for (int t = 0; t < 16; ++t) {
      const int32_t Q = (int32_t)std::lrint(std::ldexp(q[j + limb_dim(t, k_bits)], -e));  // exact scaling
      // balanced base-256 digits: c, b in [-128, 127]; |Q| <= 127 * 65536 keeps a in [-127, 127]
      const int32_t c = ((Q + 128) & 255) - 128;
      const int32_t Q1 = (Q - c) / 256;
      const int32_t b = ((Q1 + 128) & 255) - 128;
      const int32_t a = (Q1 - b) / 256;
      dst[t] = (int8_t)a;
      dst[16 + t] = (int8_t)b;
      dst[32 + t] = (int8_t)c;
    }
  }
  return std::ldexp(1.f, e);
}

// 16 K codes as int8 for sdot, centred (u - 2^(b-1)) and in limb order: 8 bits: u ^ 0x80 read as int8
// is u - 128; 4 bits: 8 code bytes split into their nibbles without interleaving (even dims, then
// odd dims), minus 8.
template <int BITS>
inline int8x16_t load16k(const uint8_t* codes, int j) {
  if (BITS == 8) return vreinterpretq_s8_u8(veorq_u8(vld1q_u8(codes + j), vdupq_n_u8(0x80)));
  const uint8x8_t b = vld1_u8(codes + j / 2);
  const int8x16_t x = vreinterpretq_s8_u8(vcombine_u8(vand_u8(b, vdup_n_u8(0x0f)), vshr_n_u8(b, 4)));
  return vsubq_s8(x, vdupq_n_s8(8));
}

// [sum(v0), sum(v1), sum(v2), sum(v3)]
inline int32x4_t hsum4(int32x4_t v0, int32x4_t v1, int32x4_t v2, int32x4_t v3) {
  return vpaddq_s32(vpaddq_s32(v0, v1), vpaddq_s32(v2, v3));
}

// Scores of keys i, i+1 (NK = 2) or i (NK = 1) for the GN <= 4 query heads g0.. (g0 % 4 == 0):
// score = scale * sum_groups (s_k * s_q * (65536 A + 256 B + C) [+ (z_k + 2^(b-1) s_k) * sum(q)]),
// where A, B, C are the int32 dot products of the limbs with the centred codes.
template <int BITS, bool SYM, int GN, int NK>
inline void scores_keys(const QuantRun& r, const uint8_t* c0, const uint8_t* c1, const float* m0, const QPrep& qp,
                        int g0, const float* qsum, float scale, float* sc, int ldsc, int i) {
  const int D = r.D, kg = r.k_group, ngk = D / kg;
  const int8_t* ql = qp.limbs + (size_t)g0 * D * 3;
  float32x4_t tot[NK];  // lanes: heads g0..g0+3
  for (int k = 0; k < NK; ++k) tot[k] = vdupq_n_f32(0.f);
  for (int gi = 0; gi < ngk; ++gi) {
    int32x4_t acc[NK][4][3];  // [key][head][limb]; heads >= GN stay 0
    for (int k = 0; k < NK; ++k)
      for (int g = 0; g < 4; ++g)
        for (int l = 0; l < 3; ++l) acc[k][g][l] = vdupq_n_s32(0);
    for (int j = gi * kg; j < (gi + 1) * kg; j += 16) {
      int8x16_t x[NK];
      for (int k = 0; k < NK; ++k) x[k] = load16k<BITS>(k ? c1 : c0, j);
      for (int g = 0; g < GN; ++g) {
        const int8_t* qg = ql + ((size_t)g * D + j) * 3;
        for (int l = 0; l < 3; ++l) {
          const int8x16_t qv = vld1q_s8(qg + 16 * l);
          for (int k = 0; k < NK; ++k) acc[k][g][l] = vdotq_s32(acc[k][g][l], qv, x[k]);
        }
      }
    }
    const float32x4_t sq = vld1q_f32(qp.sq + (size_t)gi * qp.G4 + g0);
    float32x4_t qs = vdupq_n_f32(0.f);
    if (!SYM) {
      float qa[4] = {0.f, 0.f, 0.f, 0.f};
      for (int g = 0; g < GN; ++g) qa[g] = qsum[(size_t)(g0 + g) * ngk + gi];
      qs = vld1q_f32(qa);
    }
    for (int k = 0; k < NK; ++k) {
      float32x4_t L[3];
      for (int l = 0; l < 3; ++l)
        L[l] = vcvtq_f32_s32(hsum4(acc[k][0][l], acc[k][1][l], acc[k][2][l], acc[k][3][l]));
      // 65536 A and 256 B are exact; only the two additions round
      const float32x4_t t = vaddq_f32(vaddq_f32(vmulq_n_f32(L[0], 65536.f), vmulq_n_f32(L[1], 256.f)), L[2]);
      const float* mk = m0 + (size_t)k * r.Ws;
      tot[k] = vfmaq_n_f32(tot[k], vmulq_f32(t, sq), mk[gi]);
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
void scores_tile(const QuantRun& r, const QPrep& qp, int g0, const float* qsum, float scale, float* sc, int ldsc) {
  fused::Prefetcher<VecNeon> pre(r, g0 == 0);
  int i = 0;
  for (; i + 2 <= r.n; i += 2) {
    pre.step();
    scores_keys<BITS, SYM, GN, 2>(r, r.rec(i), r.rec(i + 1), r.metaf + (size_t)i * r.Ws, qp, g0, qsum, scale, sc,
                                  ldsc, i);
  }
  if (i < r.n) {
    pre.step();
    scores_keys<BITS, SYM, GN, 1>(r, r.rec(i), r.rec(i), r.metaf + (size_t)i * r.Ws, qp, g0, qsum, scale, sc, ldsc,
                                  i);
  }
}

template <int BITS, bool SYM>
void scores_all(const QuantRun& r, const QPrep& qp, const float* qsum, int G, float scale, float* sc, int ldsc) {
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    scores_tile<BITS, SYM, decltype(gn)::value>(r, qp, g0, qsum, scale, sc + (size_t)g0 * ldsc, ldsc);
  });
}

// ---- V sums with sdot (4-bit V codes) ------------------------------------------------------------
// acc[g][d] += sum_i c_i (u_i[d] - 8) + sum_i p_i z'_i with c_i = p_i s_i (the fp32 path's quantities,
// see fused::vacc_tile), the sums over the keys as exact int32 dot products, the way the avx512-vnni
// path does its 4-bit V sums with vpdpbusd. Per run, head and V group the coefficients are scaled by
// 2^-e (e from their largest magnitude, so that |Q_i| = |round(c_i 2^-e)| <= 127 * 65536, as the K
// path's q) and split into three balanced int8 limbs. The run's codes are transposed once (shared by
// all heads) into 16-byte vectors of 4 dims x 4 keys, so that one sdot by element adds 4 keys' products
// to 4 dims: per key, 16 dims and head 3 sdot, against 4 FMAs plus a 16-code conversion per head tile
// on the fp32 path. Per lane |sum| <= 64 keys * 128 * 8 < 2^24: each limb's sum is exact as a float.
constexpr int kVsMaxD = 256;  // the transposed codes live on the stack: D * 64 bytes at most

// The run's V codes centred (u - 8) as [dim quad][key quad] vectors of 16 bytes: bytes 4t..4t+3 hold
// dim t of the quad for keys 4kq..4kq+3 (keys past n: 0); nq4 key quads.
inline void transpose_v(const QuantRun& r, int nq4, int8_t* xt) {
  const int D = r.D, n = r.n;
  const size_t step = (size_t)nq4 * 16;  // from one dim quad to the next
  for (int kq = 0; kq < nq4; ++kq)
    for (int j = 0; j < D; j += 16) {
      int8x16_t x[4];
      for (int k = 0; k < 4; ++k) {
        const int i = 4 * kq + k;
        if (i >= n) {
          x[k] = vdupq_n_s8(0);
          continue;
        }
        const uint8x8_t b = vld1_u8(r.rec(i) + r.kcb + j / 2);
        const uint8x8x2_t z = vzip_u8(vand_u8(b, vdup_n_u8(0x0f)), vshr_n_u8(b, 4));
        x[k] = vsubq_s8(vreinterpretq_s8_u8(vcombine_u8(z.val[0], z.val[1])), vdupq_n_s8(8));
      }
      // [d0 k0 k1, d1 k0 k1, ...] and [d0 k2 k3, ...], then pairs of 16-bit lanes: [d0 k0 k1 k2 k3, d1 ..]
      const int16x8_t t0 = vreinterpretq_s16_s8(vzip1q_s8(x[0], x[1])), t1 = vreinterpretq_s16_s8(vzip2q_s8(x[0], x[1]));
      const int16x8_t t2 = vreinterpretq_s16_s8(vzip1q_s8(x[2], x[3])), t3 = vreinterpretq_s16_s8(vzip2q_s8(x[2], x[3]));
      int8_t* dst = xt + ((size_t)(j / 4) * nq4 + kq) * 16;
      vst1q_s8(dst, vreinterpretq_s8_s16(vzip1q_s16(t0, t2)));
      vst1q_s8(dst + step, vreinterpretq_s8_s16(vzip2q_s16(t0, t2)));
      vst1q_s8(dst + 2 * step, vreinterpretq_s8_s16(vzip1q_s16(t1, t3)));
      vst1q_s8(dst + 3 * step, vreinterpretq_s8_s16(vzip2q_s16(t1, t3)));
    }
}

// The coefficients cf[0 .. 4 nq4) (finite, 0 past the run's keys) as limbs: w[l * nq4 + kq] = the 4
// bytes of limb l of keys 4kq..4kq+3. Returns 2^e.
inline float coef_limbs(const float* cf, int nq4, int32_t* w) {
  float32x4_t m = vdupq_n_f32(0.f);
  for (int i = 0; i < 4 * nq4; i += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(cf + i)));
  const float mx = vmaxvq_f32(m);
  int e = 0;
  if (mx > 0.f) {
    int E;
    std::frexp(mx, &E);  // mx = f * 2^E, f in [0.5, 1)
    e = E - 23;
    if (std::ldexp(mx, -e) > kQMax) ++e;
    e = std::max(e, -100);  // 2^-e stays a normal float (coefficients below 2^-77 keep fewer bits)
  }
  const float inv = std::ldexp(1.f, -e);
  const int32x4_t c128 = vdupq_n_s32(128), m255 = vdupq_n_s32(255);
  const auto pack = [](int32x4_t v) {  // the low bytes of 4 lanes as one 32-bit word
    return vget_lane_s32(vreinterpret_s32_s8(vmovn_s16(vcombine_s16(vmovn_s32(v), vdup_n_s16(0)))), 0);
  };
  for (int kq = 0; kq < nq4; ++kq) {
    const int32x4_t Q = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(cf + 4 * kq), inv));  // exact scaling, then rounding
    // balanced base-256 digits, as split_q_limbs
    const int32x4_t c = vsubq_s32(vandq_s32(vaddq_s32(Q, c128), m255), c128);
    const int32x4_t Q1 = vshrq_n_s32(vsubq_s32(Q, c), 8);
    const int32x4_t b = vsubq_s32(vandq_s32(vaddq_s32(Q1, c128), m255), c128);
    const int32x4_t a = vshrq_n_s32(vsubq_s32(Q1, b), 8);
    w[kq] = pack(a);
    w[nq4 + kq] = pack(b);
    w[2 * nq4 + kq] = pack(c);
  }
  return std::ldexp(1.f, e);
}

template <bool SYM, int GN>
void vsdot_tile(const QuantRun& r, const float* p, int ldp, float* acc, const int8_t* xt, int nq4) {
  constexpr int kMaxGroups = kVsMaxD / 16;
  const int D = r.D, vg = r.v_group, ngv = D / vg, n = r.n;
  alignas(16) float cf[kMaxRunKeys];
  alignas(16) int32_t w[GN][kMaxGroups][3 * kMaxRunKeys / 4];  // [head][group][limb * nq4 + key quad]
  float se[GN][kMaxGroups], zt[GN][kMaxGroups];
  for (int k = 0; k < ngv; ++k) {
    const float* mk = r.metaf + r.ksc + k;
    for (int g = 0; g < GN; ++g) {
      const float* pg = p + (size_t)g * ldp;
      float zs = 0.f;
      for (int i = 0; i < 4 * nq4; ++i) {
        const float sv = i < n ? mk[(size_t)i * r.Ws] : 0.f;
        cf[i] = i < n ? pg[i] * sv : 0.f;
        if (!SYM && i < n) zs += pg[i] * (mk[(size_t)i * r.Ws + ngv] + (float)r.v_mid * sv);  // z' = z + 8 s
      }
      se[g][k] = coef_limbs(cf, nq4, w[g][k]);
      zt[g][k] = zs;
    }
  }
  for (int dq = 0; dq < D / 4; ++dq) {
    const int k = dq * 4 / vg;
    const int8_t* x = xt + (size_t)dq * nq4 * 16;
    int32x4_t A[GN][3];
    for (int g = 0; g < GN; ++g)
      for (int l = 0; l < 3; ++l) A[g][l] = vdupq_n_s32(0);
    for (int kb = 0; kb < nq4; kb += 4) {
      int8x16_t W[GN][3];  // limb l of key quads kb..kb+3, one per 32-bit lane
      for (int g = 0; g < GN; ++g)
        for (int l = 0; l < 3; ++l) W[g][l] = vreinterpretq_s8_s32(vld1q_s32(&w[g][k][l * nq4 + kb]));
      const auto quad = [&](auto t) {
        constexpr int T = decltype(t)::value;
        const int8x16_t X = vld1q_s8(x + (size_t)(kb + T) * 16);
        for (int g = 0; g < GN; ++g)
          for (int l = 0; l < 3; ++l) A[g][l] = vdotq_laneq_s32(A[g][l], X, W[g][l], T);
      };
      quad(std::integral_constant<int, 0>());
      quad(std::integral_constant<int, 1>());
      quad(std::integral_constant<int, 2>());
      quad(std::integral_constant<int, 3>());
    }
    for (int g = 0; g < GN; ++g) {
      // 65536 A and 256 B are exact; only the two additions round
      const float32x4_t v = vaddq_f32(vaddq_f32(vmulq_n_f32(vcvtq_f32_s32(A[g][0]), 65536.f),
                                                vmulq_n_f32(vcvtq_f32_s32(A[g][1]), 256.f)),
                                      vcvtq_f32_s32(A[g][2]));
      float* a = acc + (size_t)g * D + dq * 4;
      vst1q_f32(a, vfmaq_n_f32(vaddq_f32(vld1q_f32(a), vdupq_n_f32(zt[g][k])), v, se[g][k]));
    }
  }
}

// The run's V sums by sdot; false (nothing written) when it does not apply (not 4-bit codes, D above
// kVsMaxD) or a probability or V scale is not finite (NaN scores, a corrupt pool): the caller then takes
// the fp32 path, which carries them as the reference does.
inline bool vsdot_all(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
  if (r.v_bits != 4 || r.D > kVsMaxD || r.D % 16 != 0) return false;
  const int n = r.n, ngv = r.D / r.v_group;
  float32x4_t m = vdupq_n_f32(0.f);  // NEON's max propagates NaN
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < n; i += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(p + (size_t)g * ldp + i)));
  bool finite = vmaxvq_f32(m) <= std::numeric_limits<float>::max();
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < ngv; ++k) finite = finite && std::isfinite(r.metaf[(size_t)i * r.Ws + r.ksc + k]);
  if (!finite) return false;
  const int nq4 = (n + 15) / 16 * 4;
  alignas(16) int8_t xt[kVsMaxD * kMaxRunKeys];
  transpose_v(r, nq4, xt);
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    constexpr int GN = decltype(gn)::value;
    const float* pg = p + (size_t)g0 * ldp;
    float* ag = acc + (size_t)g0 * r.D;
    r.v_sym ? vsdot_tile<true, GN>(r, pg, ldp, ag, xt, nq4) : vsdot_tile<false, GN>(r, pg, ldp, ag, xt, nq4);
  });
  return true;
}

// The plain NEON path with its own K scores and 4-bit V sums
struct NeonDotOps : fused::FusedOps<VecNeon> {
  static void v_accum(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
    if (!vsdot_all(r, p, ldp, G, acc)) fused::FusedOps<VecNeon>::v_accum(r, p, ldp, G, acc);
  }

  static void q_prepare(const float* q, int G, int D, int k_bits, int k_group, float* out) {
    QPrep qp(out, G, D);
    const int ngk = D / k_group;
    std::fill(qp.sq, qp.sq + (size_t)ngk * qp.G4, 0.f);
    for (int g = 0; g < G; ++g)
      for (int gi = 0; gi < ngk; ++gi) {
        const size_t d0 = (size_t)g * D + (size_t)gi * k_group;
        qp.sq[(size_t)gi * qp.G4 + g] = split_q_limbs(q + d0, k_group, k_bits, qp.limbs + d0 * 3);
      }
  }
  // q is what q_prepare wrote
  static void q_scores(const QuantRun& r, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc) {
    fused::meta_to_f32<VecNeon>(r);
    const QPrep qp(q, G, r.D);
    if (r.k_bits == 8) {
      r.k_sym ? scores_all<8, true>(r, qp, qsum, G, scale, sc, ldsc)
              : scores_all<8, false>(r, qp, qsum, G, scale, sc, ldsc);
    } else {
      r.k_sym ? scores_all<4, true>(r, qp, qsum, G, scale, sc, ldsc)
              : scores_all<4, false>(r, qp, qsum, G, scale, sc, ldsc);
    }
  }
};

}  // namespace

void attend_neon_dot(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<NeonDotOps> a(c, scratch);
  a(t, h);
}

}  // namespace pagedkv
