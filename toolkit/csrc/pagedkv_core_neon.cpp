// NEON attention path (aarch64). Dequantized values are bit-identical to the scalar path.
// attend_neon_dot is selected at run time when the CPU has the dotprod extension
// (getauxval(AT_HWCAP) & HWCAP_ASIMDDP); it currently shares the plain NEON kernel (see TODO).
#include <arm_neon.h>

#include "pagedkv_attn_impl.h"

namespace pagedkv {
namespace {

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
    for (; i + 1 < n; i += 2) {
      out[i] = codes[i / 2] & 0x0f;
      out[i + 1] = codes[i / 2] >> 4;
    }
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

}  // namespace

void attend_neon(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<NeonOps> a(c, scratch);
  a(t, h);
}

// TODO(sdot): an int8 `sdot` key path for k_bits == 8 that keeps ~1e-5 agreement with the reference
// (q split into int8 limbs). Until then the dotprod selection runs the plain NEON kernel.
void attend_neon_dot(const AttnContext& c, int t, int h, float* scratch) { attend_neon(c, t, h, scratch); }

}  // namespace pagedkv
