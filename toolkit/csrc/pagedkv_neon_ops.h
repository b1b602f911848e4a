// NEON primitives shared by the plain NEON path (pagedkv_core_neon.cpp, ARMv8.0) and the dotprod
// path (pagedkv_core_neon_dot.cpp, compiled with -march=armv8.2-a+dotprod).
//
// Everything here is in an anonymous namespace on purpose: each translation unit gets its own copy
// compiled with its own -march. With external (inline) linkage the linker could keep the ARMv8.2
// copy of a function for both paths, and the ARMv8.0 path would fault on a Cortex-A53.
#pragma once

#include <arm_neon.h>

#include "pagedkv_attn_impl.h"

namespace pagedkv {
namespace {

using impl::QuantRun;

// The generic-path primitives (see pagedkv_attn_impl.h). Dequantized values are bit-identical to
// the scalar path.
struct NeonOps {
  static float dot(const float* a, const float* b, int n) {
    float32x4_t s0 = vdupq_n_f32(0.f), s1 = vdupq_n_f32(0.f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
      s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
    }
    float s = vaddvq_f32(vaddq_f32(s0, s1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float* y, float a, const float* x, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vfmaq_n_f32(vld1q_f32(y + i), vld1q_f32(x + i), a));
    for (; i < n; ++i) y[i] += a * x[i];
  }
  static void scale(float* y, float a, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vmulq_n_f32(vld1q_f32(y + i), a));
    for (; i < n; ++i) y[i] *= a;
  }
  static void f16_to_f32(const uint16_t* h, float* out, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
    for (; i < n; ++i) out[i] = fp16_to_fp32(h[i]);
  }
  static void unpack4(const uint8_t* codes, int n, uint8_t* out) {
    const uint8x16_t mask = vdupq_n_u8(0x0f);
    int i = 0;
    for (; i + 32 <= n; i += 32) {
      const uint8x16_t b = vld1q_u8(codes + i / 2);
      const uint8x16x2_t z = vzipq_u8(vandq_u8(b, mask), vshrq_n_u8(b, 4));
      vst1q_u8(out + i, z.val[0]);
      vst1q_u8(out + i + 16, z.val[1]);
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
      const float32x4_t vs = vdupq_n_f32(s), vz = vdupq_n_f32(z), vc = vdupq_n_f32(c);
      for (; i + 8 <= i1; i += 8) {
        const uint16x8_t w = vmovl_u8(vld1_u8(u + i));
        const float32x4_t f0 = vcvtq_f32_u32(vmovl_u16(vget_low_u16(w)));
        const float32x4_t f1 = vcvtq_f32_u32(vmovl_u16(vget_high_u16(w)));
        // separate mul and add (no fused multiply-add): same rounding as the reference
        if (sym) {
          vst1q_f32(out + i, vmulq_f32(vsubq_f32(f0, vc), vs));
          vst1q_f32(out + i + 4, vmulq_f32(vsubq_f32(f1, vc), vs));
        } else {
          vst1q_f32(out + i, vaddq_f32(vmulq_f32(f0, vs), vz));
          vst1q_f32(out + i + 4, vaddq_f32(vmulq_f32(f1, vs), vz));
        }
      }
      for (; i < i1; ++i) out[i] = sym ? ((float)u[i] - c) * s : (float)u[i] * s + z;
    }
  }
};

// ---- fp32 parts of the fused quantized path (V accumulation, softmax) ---------------------------

// 16 codes of a record, dims j..j+15 in natural order, as the floats u - 2^(b-1) (exact small
// integers; u - 2^(b-1) fits int8, for 8 bits u ^ 0x80 read as int8 is u - 128). 4 bits: value i in
// the low nibble first.
template <int BITS>
inline void load16f(const uint8_t* codes, int j, float32x4_t x[4]) {
  int8x16_t c;
  if (BITS == 8) {
    c = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(codes + j), vdupq_n_u8(0x80)));
  } else {
    const uint8x8_t b = vld1_u8(codes + j / 2);
    const uint8x8x2_t z = vzip_u8(vand_u8(b, vdup_n_u8(0x0f)), vshr_n_u8(b, 4));
    c = vsubq_s8(vreinterpretq_s8_u8(vcombine_u8(z.val[0], z.val[1])), vdupq_n_s8(8));
  }
  const int16x8_t lo = vmovl_s8(vget_low_s8(c)), hi = vmovl_high_s8(c);
  x[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
  x[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
  x[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
  x[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}

// acc[g] += sum_i p[g][i] * v_i for GN <= 4 heads, v_i = s * (u - c) (sym) or s * u + z (asym), c =
// 2^(b-1) (r.v_mid for asym): accumulated as (p * s) * (u - c) + sum_i p * z', z' = z + c * s (asym) or 0, 16 dims at a
// time kept in registers over the keys. The centred form keeps asym terms small: p * s * u and p * z
// would largely cancel (measured: about 2x lower rms error than accumulating s * u + z).
template <int BITS, bool SYM, int GN>
void vacc_tile(const QuantRun& r, const float* p, int ldp, float* acc) {
  const int D = r.D, vg = r.v_group, ngv = D / vg, n = r.n;
  const uint8_t* vc = r.codes + r.kcb;
  const int n4 = (n + 3) & ~3;  // p rows hold finite values up to bs >= n4 (bs % 8 == 0)
  alignas(16) float coef[32 * 4 * 32];  // [group][head][key]
  alignas(16) float sv[32], zv[32];
  float zt[32 * 4];  // [group][head]
  for (int k = 0; k < ngv; ++k) {
    const float* mk = r.metaf + r.ksc + k;
    for (int i = 0; i < n4; ++i) sv[i] = i < n ? mk[(size_t)i * r.Ws] : 0.f;
    if (!SYM)  // z + c * s: c * s is exact, one rounding of a value near the group's mid-range
      for (int i = 0; i < n4; ++i) zv[i] = i < n ? mk[(size_t)i * r.Ws + ngv] + (float)r.v_mid * sv[i] : 0.f;
    for (int g = 0; g < GN; ++g) {
      const float* pg = p + (size_t)g * ldp;
      float* cf = coef + ((size_t)k * 4 + g) * 32;
      float32x4_t zs = vdupq_n_f32(0.f);
      for (int i = 0; i < n4; i += 4) {
        const float32x4_t pv = vld1q_f32(pg + i);
        vst1q_f32(cf + i, vmulq_f32(pv, vld1q_f32(sv + i)));
        if (!SYM) zs = vfmaq_f32(zs, pv, vld1q_f32(zv + i));
      }
      zt[k * 4 + g] = SYM ? 0.f : vaddvq_f32(zs);
    }
  }
  for (int j = 0; j < D; j += 16) {
    const int k = j / vg;
    float32x4_t A[GN][4];
    for (int g = 0; g < GN; ++g) {
      const float32x4_t z = vdupq_n_f32(SYM ? 0.f : zt[k * 4 + g]);
      for (int v = 0; v < 4; ++v) A[g][v] = vaddq_f32(vld1q_f32(acc + (size_t)g * D + j + 4 * v), z);
    }
    const float* cf = coef + (size_t)k * 4 * 32;
    for (int i = 0; i < n; ++i) {
      float32x4_t x[4];
      load16f<BITS>(vc + (size_t)i * r.W, j, x);
      for (int g = 0; g < GN; ++g) {
        const float w = cf[g * 32 + i];
        for (int v = 0; v < 4; ++v) A[g][v] = vfmaq_n_f32(A[g][v], x[v], w);
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int v = 0; v < 4; ++v) vst1q_f32(acc + (size_t)g * D + j + 4 * v, A[g][v]);
  }
}

template <int BITS, bool SYM>
void vacc_all(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
  impl::for_head_tiles(G, [&](auto gn, int g0) {
    vacc_tile<BITS, SYM, decltype(gn)::value>(r, p + (size_t)g0 * ldp, ldp, acc + (size_t)g0 * r.D);
  });
}

// exp for the softmax only (ExpConsts); x <= 0 here. Below ExpConsts::kMin the result is 0.
inline float32x4_t exp_f32x4(float32x4_t x) {
  using E = ExpConsts;
  const uint32x4_t keep = vcgeq_f32(x, vdupq_n_f32(E::kMin));
  x = vmaxq_f32(x, vdupq_n_f32(E::kMin));
  x = vminq_f32(x, vdupq_n_f32(E::kMax));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(E::kLog2e)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(E::kLn2Hi));  // x - n * ln2, in two parts
  r = vfmsq_f32(r, n, vdupq_n_f32(E::kLn2Lo));
  float32x4_t y = vdupq_n_f32(E::kP[0]);
  for (int i = 1; i < 6; ++i) y = vfmaq_f32(vdupq_n_f32(E::kP[i]), y, r);
  y = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.f)), y, vmulq_f32(r, r));
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);  // 2^n
  return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(vmulq_f32(y, vreinterpretq_f32_s32(e))), keep));
}

// impl::widen_codes with NEON, 16 codes (2 BITS bytes) per step: code k spans bits k*BITS .. +BITS-1,
// inside the 16-bit word of bytes (k*BITS)/8 and the next; tbl gathers those byte pairs into 16-bit lanes,
// ushl shifts each right by (k*BITS) % 8, the narrowing move keeps the low bytes, then and + add. The
// 2 BITS source bytes are copied into a 16-byte buffer first (no read past the codes). n a multiple of 8.
template <int BITS>
void widen_neon_n(const uint8_t* codes, int n, uint8_t add, uint8_t* out) {
  alignas(16) uint8_t lo_idx[16], hi_idx[16];
  alignas(16) int16_t sh[16];
  for (int k = 0; k < 16; ++k) {
    const int b = (k * BITS) >> 3;
    uint8_t* idx = k < 8 ? lo_idx : hi_idx;
    idx[2 * (k & 7)] = (uint8_t)b, idx[2 * (k & 7) + 1] = (uint8_t)(b + 1);
    sh[k] = (int16_t)(-((k * BITS) & 7));
  }
  const uint8x16_t tlo = vld1q_u8(lo_idx), thi = vld1q_u8(hi_idx);
  const int16x8_t slo = vld1q_s16(sh), shi = vld1q_s16(sh + 8);
  const uint8x16_t mask = vdupq_n_u8((uint8_t)((1 << BITS) - 1)), va = vdupq_n_u8(add);
  alignas(16) uint8_t buf[16] = {0};
  int i = 0;
  for (; i + 16 <= n; i += 16, codes += 2 * BITS) {
    std::memcpy(buf, codes, 2 * BITS);
    const uint8x16_t src = vld1q_u8(buf);
    const uint16x8_t a = vshlq_u16(vreinterpretq_u16_u8(vqtbl1q_u8(src, tlo)), slo);
    const uint16x8_t b = vshlq_u16(vreinterpretq_u16_u8(vqtbl1q_u8(src, thi)), shi);
    const uint8x16_t x = vcombine_u8(vmovn_u16(a), vmovn_u16(b));
    vst1q_u8(out + i, vaddq_u8(vandq_u8(x, mask), va));
  }
  if (i < n) impl::widen_codes(codes, BITS, n - i, add, out + i);  // the last 8 codes
}

// The fp32 members of an Ops struct with kFastQuant (q_scores / q_prepare come from the path).
struct NeonFusedOps : NeonOps {
  static constexpr bool kCentredAsym = true;  // asymmetric codes read as u - 2^(b-1) (QuantRun::k_mid)
  static void widen(const uint8_t* codes, int bits, int n, uint8_t add, uint8_t* out) {
    impl::with_bits(bits, [&](auto b) { widen_neon_n<decltype(b)::value>(codes, n, add, out); });
  }
  static void v_accum(const QuantRun& r, const float* p, int ldp, int G, float* acc) {
    if (r.v_bits == 8) {
      r.v_sym ? vacc_all<8, true>(r, p, ldp, G, acc) : vacc_all<8, false>(r, p, ldp, G, acc);
    } else {
      r.v_sym ? vacc_all<4, true>(r, p, ldp, G, acc) : vacc_all<4, false>(r, p, ldp, G, acc);
    }
  }
  static float max_n(const float* x, int n) {
    float m = x[0];
    int i = 0;
    if (n >= 4) {
      float32x4_t v = vld1q_f32(x);
      for (i = 4; i + 4 <= n; i += 4) v = vmaxq_f32(v, vld1q_f32(x + i));
      m = vmaxvq_f32(v);
    }
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }
  static float exp_sub(float* x, int n, float m) {
    const float32x4_t vm = vdupq_n_f32(m);
    float32x4_t vs = vdupq_n_f32(0.f);
    int i = 0;
    for (; i + 4 <= n; i += 4) {
      const float32x4_t e = exp_f32x4(vsubq_f32(vld1q_f32(x + i), vm));
      vst1q_f32(x + i, e);
      vs = vaddq_f32(vs, e);
    }
    float sum = vaddvq_f32(vs);
    for (; i < n; ++i) {
      const float e = std::exp(x[i] - m);
      x[i] = e;
      sum += e;
    }
    return sum;
  }
};

}  // namespace
}  // namespace pagedkv
