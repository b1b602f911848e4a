// The NEON vector wrapper (4 floats, AArch64 Advanced SIMD): the primitives pagedkv_attn_fused.h writes
// the attention shapes over (the list is in pagedkv_vec_avx2.h). Used by the plain NEON path
// (pagedkv_core_neon.cpp, ARMv8.0) and the dotprod path (pagedkv_core_neon_dot.cpp, compiled with
// -march=armv8.2-a+dotprod).
//
// Everything here is in an anonymous namespace on purpose: each translation unit gets its own copy
// compiled with its own -march. With external (inline) linkage the linker could keep the ARMv8.2
// copy of a function for both paths, and the ARMv8.0 path would fault on a Cortex-A53.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#include "pagedkv_attn_impl.h"

namespace pagedkv {
namespace {

struct VecNeon {
  using F = float32x4_t;
  using M = uint32x4_t;
  using F4 = float32x4_t;
  static constexpr int N = 4;
  // asymmetric codes are read centred, u - 2^(b-1), with the zero point as z + 2^(b-1) s: 8-bit codes
  // centre for free (u ^ 0x80 read as int8), and the centred form keeps p s u and p z from cancelling
  // (measured: about 2x lower rms error in the V sums than accumulating s u + z)
  static constexpr bool kCentredAsym = true;

  static F zero() { return vdupq_n_f32(0.f); }
  static F set1(float x) { return vdupq_n_f32(x); }
  static F bcast(const float* p) { return vld1q_dup_f32(p); }
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F x) { vst1q_f32(p, x); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F max(F a, F b) { return vmaxq_f32(a, b); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }

  static float hsum(F v) { return vaddvq_f32(v); }
  static float hmax(F v) { return vmaxvq_f32(v); }
  static F4 hsum4(F v0, F v1, F v2, F v3) { return vpaddq_f32(vpaddq_f32(v0, v1), vpaddq_f32(v2, v3)); }
  static F4 f4_zero() { return vdupq_n_f32(0.f); }
  static F4 f4_load(const float* p) { return vld1q_f32(p); }
  static void f4_store(float* p, F4 x) { vst1q_f32(p, x); }
  static F4 f4_fma(F4 a, float s, F4 c) { return vfmaq_n_f32(c, a, s); }  // a * s + c
  static F4 f4_mul(F4 a, float s) { return vmulq_n_f32(a, s); }
  static F4 f4_fmav(F4 a, F4 b, F4 c) { return vfmaq_f32(c, a, b); }  // a * b + c

  // exp for the softmax only (ExpConsts); x <= 0 here. Below ExpConsts::kMin the result is 0.
  static F exp(F x) {
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
  static M live(int i, int n) {
    static const uint32_t kIota[4] = {0, 1, 2, 3};
    return vcltq_u32(vld1q_u32(kIota), vdupq_n_u32((uint32_t)(n - i)));
  }
  static F select(M m, F a, F b) { return vbslq_f32(m, a, b); }
  static F keep(M m, F a) { return vreinterpretq_f32_u32(vandq_u32(m, vreinterpretq_u32_f32(a))); }
  static M gt_or_nan(F x, F t) { return vmvnq_u32(vcleq_f32(x, t)); }  // !(x <= t): x > t or unordered
  static M mask_none() { return vdupq_n_u32(0); }
  static M mask_or(M a, M b) { return vorrq_u32(a, b); }
  static M mask_and(M a, M b) { return vandq_u32(a, b); }
  static bool any(M m) { return vmaxvq_u32(m) != 0; }

  static F load_f16(const uint16_t* h) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h))); }
  static F load_u8(const uint8_t* u) {
    uint32_t w;
    std::memcpy(&w, u, 4);
    const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(w));
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
  }

  // 16 codes of dims j..j+15 in natural order as floats, u - 2^(BITS-1) when CENTRED (through int8: u ^
  // 0x80 read as int8 is u - 128; 4 bits: value i in the low nibble first), else u
  template <int BITS, bool CENTRED>
  static void codes16(const uint8_t* codes, int j, F x[4]) {
    uint8x16_t u;
    if (BITS == 8) {
      u = vld1q_u8(codes + j);
    } else {
      const uint8x8_t b = vld1_u8(codes + j / 2);
      const uint8x8x2_t z = vzip_u8(vand_u8(b, vdup_n_u8(0x0f)), vshr_n_u8(b, 4));
      u = vcombine_u8(z.val[0], z.val[1]);
    }
    if (CENTRED) {
      const int8x16_t c = BITS == 8 ? vreinterpretq_s8_u8(veorq_u8(u, vdupq_n_u8(0x80)))
                                    : vsubq_s8(vreinterpretq_s8_u8(u), vdupq_n_s8((int8_t)(1 << (BITS - 1))));
      const int16x8_t lo = vmovl_s8(vget_low_s8(c)), hi = vmovl_high_s8(c);
      x[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
      x[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
      x[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
      x[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
    } else {
      const uint16x8_t lo = vmovl_u8(vget_low_u8(u)), hi = vmovl_high_u8(u);
      x[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
      x[1] = vcvtq_f32_u32(vmovl_high_u16(lo));
      x[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
      x[3] = vcvtq_f32_u32(vmovl_high_u16(hi));
    }
  }
  // the code order is the natural one for both widths
  template <int BITS>
  static void to_code_order(F*) {}
  template <int BITS>
  static void from_code_order(F*) {}

  static void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
  static void prefetch_far(const void* p) { __builtin_prefetch(p, 0, 1); }

  // impl::widen_codes with NEON, 16 codes (2 BITS bytes) per step: code k spans bits k*BITS .. +BITS-1,
  // inside the 16-bit word of bytes (k*BITS)/8 and the next; tbl gathers those byte pairs into 16-bit
  // lanes, ushl shifts each right by (k*BITS) % 8, the narrowing move keeps the low bytes, then and + add.
  // The 2 BITS source bytes are copied into a 16-byte buffer first (no read past the codes). n a
  // multiple of 8.
  template <int BITS>
  static void widen_n(const uint8_t* codes, int n, uint8_t add, uint8_t* out) {
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
  static void widen(const uint8_t* codes, int bits, int n, uint8_t add, uint8_t* out) {
    impl::with_bits(bits, [&](auto b) { widen_n<decltype(b)::value>(codes, n, add, out); });
  }
};

}  // namespace
}  // namespace pagedkv
