// Quantization building blocks of the pool format: float16 conversion, the Hadamard rotation, bit
// packing, and one record's quantize/dequantize. Bit exact with toolkit/quant.py: this file must be
// compiled WITHOUT -ffast-math and with -ffp-contract=off (CMakeLists.txt sets both).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "pagedkv_core.h"
#include "pagedkv_internal.h"

namespace pagedkv {

// ------------------------------------------------------------------------------------------------
// float16 <-> float32

uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                                     // below 2^-14: subnormal or zero
    if (ax < 0x33000000u) return (uint16_t)sign;              // below 2^-25 -> 0
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return (uint16_t)(sign | h);
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return (uint16_t)(sign | h);
}

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu;
  uint32_t x;
  if (e == 0) {
    if (m == 0) {
      x = sign;
    } else {  // subnormal: normalise
      int ee = 113;
      while (!(m & 0x400u)) {
        m <<= 1;
        --ee;
      }
      x = sign | ((uint32_t)ee << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (e == 31) {
    x = sign | 0x7f800000u | (m << 13);
  } else {
    x = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// ------------------------------------------------------------------------------------------------
// Hadamard, quantization, packing

void hadamard(float* x, int d) {
  for (int h = 1; h < d; h *= 2) {
    for (int i = 0; i < d; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float inv = (float)(1.0 / std::sqrt((double)d));
  for (int i = 0; i < d; ++i) x[i] = x[i] * inv;
}

static void pack_codes(const uint8_t* u, int bits, int n, uint8_t* out) {
  const int nbytes = n * bits / 8;
  if (bits == 8) {
    std::memcpy(out, u, (size_t)n);
    return;
  }
  std::memset(out, 0, (size_t)nbytes);
  for (int i = 0; i < n; ++i) {
    const int bit = i * bits, byte = bit >> 3, sh = bit & 7;
    const uint32_t v = (uint32_t)u[i] << sh;
    out[byte] |= (uint8_t)(v & 0xffu);
    if (sh + bits > 8) out[byte + 1] |= (uint8_t)(v >> 8);
  }
}

void unpack_codes(const uint8_t* codes, int bits, int n, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, codes, (size_t)n);
    return;
  }
  const uint32_t mask = (1u << bits) - 1u;
  for (int i = 0; i < n; ++i) {
    const int bit = i * bits, byte = bit >> 3, sh = bit & 7;
    uint32_t w = codes[byte];
    if (sh + bits > 8) w |= (uint32_t)codes[byte + 1] << 8;
    out[i] = (uint8_t)((w >> sh) & mask);
  }
}

void quantize_record(const float* x, int d, int bits, int group, bool sym, uint8_t* codes, uint16_t* meta) {
  uint8_t u[1024];
  uint8_t* ub = d <= 1024 ? u : new uint8_t[(size_t)d];
  const int ng = d / group;
  for (int g = 0; g < ng; ++g) {
    const float* xg = x + (size_t)g * group;
    uint8_t* ug = ub + (size_t)g * group;
    if (sym) {
      const int qmax = (1 << (bits - 1)) - 1;
      float amax = 0.f;
      for (int i = 0; i < group; ++i) amax = std::max(amax, std::fabs(xg[i]));
      float sc = amax / (float)qmax;
      if (sc > 65504.f) sc = 65504.f;
      const uint16_t s16 = fp32_to_fp16(sc);
      const float s = (s16 & 0x7fffu) == 0 ? 1.f : fp16_to_fp32(s16);
      for (int i = 0; i < group; ++i) {
        float r = std::nearbyint(xg[i] / s);
        r = std::min(std::max(r, (float)-qmax), (float)qmax);
        ug[i] = (uint8_t)((int)r + (1 << (bits - 1)));
      }
      meta[g] = s16;
    } else {
      const int levels = (1 << bits) - 1;
      float lo = xg[0], hi = xg[0];
      for (int i = 1; i < group; ++i) {
        lo = std::min(lo, xg[i]);
        hi = std::max(hi, xg[i]);
      }
      const uint16_t z16 = fp32_to_fp16(std::min(std::max(lo, -65504.f), 65504.f));
      float sc = (hi - lo) / (float)levels;
      if (sc > 65504.f) sc = 65504.f;
      const uint16_t s16 = fp32_to_fp16(sc);
      const float s = (s16 & 0x7fffu) == 0 ? 1.f : fp16_to_fp32(s16);
      const float z = fp16_to_fp32(z16);
      for (int i = 0; i < group; ++i) {
        float r = std::nearbyint((xg[i] - z) / s);
        r = std::min(std::max(r, 0.f), (float)levels);
        ug[i] = (uint8_t)(int)r;
      }
      meta[g] = s16;
      meta[ng + g] = z16;
    }
  }
  pack_codes(ub, bits, d, codes);
  if (ub != u) delete[] ub;
}

void dequantize_record(const uint8_t* codes, const uint16_t* meta, int d, int bits, int group, bool sym, float* out) {
  std::vector<uint8_t> u((size_t)d);
  unpack_codes(codes, bits, d, u.data());
  const int ng = d / group;
  const float c = (float)(1 << (bits - 1));
  for (int g = 0; g < ng; ++g) {
    const float s = fp16_to_fp32(meta[g]);
    const float z = sym ? 0.f : fp16_to_fp32(meta[ng + g]);
    for (int i = g * group; i < (g + 1) * group; ++i) out[i] = sym ? ((float)u[i] - c) * s : (float)u[i] * s + z;
  }
}

}  // namespace pagedkv
