// AVX-512 helpers shared by the K and V passes: fp16 loads, prefetch, lane masks, key-row loads/stores.
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

}  // namespace
}  // namespace pagedkv
