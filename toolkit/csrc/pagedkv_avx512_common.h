// AVX-512 helpers shared by the K and V passes: fp16 loads, prefetch, lane masks, key-row loads/stores,
// widening of code widths other than 8/4 (VBMI).
// Part of the AVX-512 attention paths: included only by pagedkv_core_avx512.cpp (compiled with the
// AVX-512 flags), hence the unnamed namespace.
#pragma once

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

// impl::widen_codes with AVX-512 VBMI, 64 codes (8 BITS bytes) per step: a masked load (no byte past the
// codes), vpermb gives each group of 8 codes its own qword (source bytes 8-code group * BITS ..  + 7),
// vpmultishiftqb takes code k from bit k * BITS of its qword, then and + add. n a multiple of 8.
template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void widen_vbmi_n(const uint8_t* codes, int n, uint8_t add,
                                                                          uint8_t* out) {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 8; ++i) idx[8 * j + i] = (uint8_t)(j * BITS + i);
  uint64_t shifts = 0;
  for (int k = 0; k < 8; ++k) shifts |= (uint64_t)(k * BITS) << (8 * k);
  const __m512i vidx = _mm512_load_si512(idx), vsh = _mm512_set1_epi64((long long)shifts);
  const __m512i mask = _mm512_set1_epi8((char)((1 << BITS) - 1)), vadd = _mm512_set1_epi8((char)add);
  for (int i = 0; i < n; i += 64, codes += 8 * BITS) {
    const int m = n - i < 64 ? n - i : 64;  // codes of this step
    const __mmask64 lmask = _cvtu64_mask64(m * BITS / 8 >= 64 ? ~0ull : (1ull << (m * BITS / 8)) - 1);
    const __mmask64 smask = _cvtu64_mask64(m >= 64 ? ~0ull : (1ull << m) - 1);
    const __m512i src = _mm512_maskz_loadu_epi8(lmask, codes);
    const __m512i x = _mm512_multishift_epi64_epi8(vsh, _mm512_permutexvar_epi8(vidx, src));
    _mm512_mask_storeu_epi8(out + i, smask, _mm512_add_epi8(_mm512_and_si512(x, mask), vadd));
  }
}

inline void widen_avx512(const uint8_t* codes, int bits, int n, uint8_t add, uint8_t* out) {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  if (!vbmi) return impl::widen_codes(codes, bits, n, add, out);
  impl::with_bits(bits, [&](auto b) { widen_vbmi_n<decltype(b)::value>(codes, n, add, out); });
}

}  // namespace
}  // namespace pagedkv
