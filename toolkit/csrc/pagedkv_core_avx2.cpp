// AVX2 + FMA + F16C attention path (this file is compiled with -mavx2 -mfma -mf16c; the caller
// checks the CPU before selecting it). Dequantized values are bit-identical to the scalar path.
#include <immintrin.h>

#include "pagedkv_attn_impl.h"

namespace pagedkv {
namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

struct Avx2Ops {
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
