// The attention loop, written once and instantiated per code path with an `Ops` struct that
// provides the vector primitives. Included (once) by each per-ISA translation unit.
// The AVX2 and NEON paths get their Ops from pagedkv_attn_fused.h (fused::FusedOps<V>: the shapes
// below written once over a thin vector wrapper V, pagedkv_vec_avx2.h / pagedkv_vec_neon.h); the
// AVX-512 paths keep their own (pagedkv_core_avx512.cpp: 16-lane masks, VNNI); the scalar path uses the
// generic members only.
//
// Ops must provide (static):
//   float dot(const float* a, const float* b, int n);
//   void axpy(float* y, float a, const float* x, int n);      // y += a * x
//   void scale(float* y, float a, int n);                     // y *= a
//   void f16_to_f32(const uint16_t* h, float* out, int n);
//   void unpack4(const uint8_t* codes, int n, uint8_t* out);  // 4-bit LSB-first -> bytes
//   void dequant_u8(const uint8_t* u, const uint16_t* meta, int d, int group, bool sym, int bits, float* out);
// Optional fused fast path (Ops::kFastQuant = true, see pagedkv_core_avx2.cpp), used for quantized
// blocks with groups that are multiples of 16. The Ops read 8- and 4-bit codes; a spec with another
// width (Gemma's K7/V5, the compact tier's V3) has each run's records widened to 8-bit records in
// scratch first (widen_codes; the same scales), and the Ops read those:
//   void q_scores(const QuantRun&, const float* q, const float* qsum, int G, float scale, float* sc, int ldsc);
//   void v_accum(const QuantRun&, const float* p, int ldp, int G, float* acc);
//   float exp_sub(float* x, int n, float m);   // x[i] = exp(x[i] - m), returns the sum
//   float max_n(const float* x, int n);       // max of x[0..n), n >= 1
//   void q_prepare(const float* q, int G, int D, int k_bits, int k_group, float* out);
//        // the G query rows in the form q_scores reads (lane order, or int8 limbs: see
//        // split_q_limbs, VnniQ); out has room for 4 * G * D floats
// Optional: kRunKeys (<= kMaxRunKeys) when q_scores / v_accum read records through QuantRun::rec and
// convert the scales of every segment: consecutive quantized blocks are then grouped into runs of up
// to kRunKeys keys (fewer, longer runs: less per-run overhead).
// Optional row-wise softmax helpers (all G rows of sc at once, fewer horizontal reductions):
//   void row_max(const float* sc, int ldsc, int G, int n, float* out);           // out[g] = max row g
//   void row_exp(float* sc, int ldsc, int G, int n, const float* m, float* sum);  // exp_sub per row
//   bool rows_above(const float* sc, int ldsc, int G, int n, const float* thr);  // any x > thr[g] or NaN
// It never materialises the dequantized rows: scores = s * dot(q, u - c) (+ z * sum(q) when
// asymmetric) per group, and V accumulates (p * s) * (u - c) (+ p * z), the same quantities
// in another summation order (outputs agree with the reference to ~1e-6).
// The generic path dequantizes bit-identically to toolkit/quant.py::dequantize: (u - 2^(b-1)) * s, or
// u * s + z, in float32 without contraction. Only the dot/axpy summation order differs by path.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "pagedkv_internal.h"

namespace pagedkv {
namespace impl {

enum class Src { kQuant, kF16, kF32 };

// n quantized records of one KV head: consecutive records of one block, or (Ops with kRunKeys) the
// records of up to kMaxRunBlocks blocks, one segment per block.
struct QuantRun {
  const uint8_t* codes;   // first record's codes (stride W)
  const uint16_t* meta;   // first record's fp16 scales (stride Ws)
  size_t W, Ws;
  int n, D;
  int k_bits, k_group, v_bits, v_group;
  bool k_sym, v_sym;
  int kcb, ksc;           // V codes / V meta start inside a record
  float* metaf;           // scratch for the n * Ws scales/zeros as float32 (filled by q_scores)
  int nseg;               // segments (1 for one block)
  const uint16_t* const* seg_meta;  // [nseg] fp16 scales of each segment's first record
  const int* seg_n;       // [nseg] records per segment
  const uint8_t* const* recs;  // [n] codes of each record
  const uint8_t* rec(int i) const { return recs[i]; }
  // The blocks of the next run (kRunKeys Ops), for prefetching only: the codes and fp16 scales of each
  // of its next_nseg (<= kMaxRunBlocks) blocks, block_bytes / W records each.
  const uint8_t* const* next_codes;
  const uint16_t* const* next_meta;
  int next_nseg;
  size_t block_bytes, block_meta_bytes;  // one block's records: codes, scales
  // The codes of each of the after_nseg blocks of the run after the next one, for touching their
  // pages early (prefetching only).
  const uint8_t* const* after_codes;
  int after_nseg;
  // Asymmetric K / V on paths that read codes centred (Ops::kCentredAsym, NEON: u - 128 for 8 bits,
  // u - 8 for 4, and the zero point as z + mid * s): mid = 2^(b-1) of the width the codes were stored
  // in. Widened records hold such codes as u + 128 - mid, so that u' - 128 = u - mid stays small.
  int k_mid, v_mid;
};

// Calls f(std::integral_constant<int, GN>(), g0) for the tiles g0 = 0, 4, 8, .. of the G query heads of
// a KV head, GN = the heads of the tile (<= 4, a compile-time constant so that a tile's accumulators
// live in registers). The fused fast paths of every ISA split their work this way.
template <class F>
inline void for_head_tiles(int G, F&& f) {
  for (int g0 = 0; g0 < G; g0 += 4) {
    switch (G - g0) {
      case 1: f(std::integral_constant<int, 1>(), g0); break;
      case 2: f(std::integral_constant<int, 2>(), g0); break;
      case 3: f(std::integral_constant<int, 3>(), g0); break;
      default: f(std::integral_constant<int, 4>(), g0); break;
    }
  }
}

// The 8 codes of BITS bits in the low 8 BITS bits of w (LSB first), one per byte: three steps that
// each move the upper half of every field group to its place (fields 4-7 to bit 32, then 2-3 and 6-7
// to bits 16 and 48, then the odd fields to bytes 1, 3, 5, 7), plain 64-bit arithmetic
template <int BITS>
inline uint64_t spread_codes(uint64_t w) {
  constexpr int d = 8 - BITS;
  constexpr uint64_t m4 = (1ull << (4 * BITS)) - 1, m2 = ((1ull << (2 * BITS)) - 1) * 0x0000000100000001ull,
                     m1 = ((1ull << BITS) - 1) * 0x0001000100010001ull;
  if constexpr (d == 0) return w;
  w = (w & m4) | ((w << (4 * d)) & (m4 << 32));
  w = (w & m2) | ((w << (2 * d)) & (m2 << 16));
  return (w & m1) | ((w << d) & (m1 << 8));
}

// n codes of BITS bits (LSB first, n a multiple of 8) as bytes, plus `add` (no byte overflows: codes +
// add <= 255): 8 codes per BITS bytes, one little-endian 64-bit word each (an 8-byte load while 8 bytes
// remain, then BITS single bytes: it reads no byte past the codes; with 2 or 3 bits the last two or
// three groups)
template <int BITS>
inline void widen_codes_n(const uint8_t* codes, int n, uint8_t add, uint8_t* out) {
  const uint64_t adds = 0x0101010101010101ull * add;
  auto eight = [&](uint64_t w, uint8_t* o) {
    const uint64_t x = spread_codes<BITS>(w) + adds;
    std::memcpy(o, &x, 8);
  };
  const int nbytes = n * BITS / 8;
  int i = 0;
  for (; i + 8 < n && i * BITS / 8 + 8 <= nbytes; i += 8, codes += BITS) {
    uint64_t w;
    std::memcpy(&w, codes, 8);
    eight(w, out + i);
  }
  for (; i < n; i += 8, codes += BITS) {
    uint64_t w = 0;
    for (int b = 0; b < BITS; ++b) w |= (uint64_t)codes[b] << (8 * b);
    eight(w, out + i);
  }
}
// f(std::integral_constant<int, B>()) for a code width B in 2..8 (anything else: 8), so that a widening
// loop gets its width as a compile-time constant
template <class F>
inline void with_bits(int bits, F&& f) {
  switch (bits) {
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
    default: return f(std::integral_constant<int, 8>());
  }
}

inline void widen_codes(const uint8_t* codes, int bits, int n, uint8_t add, uint8_t* out) {
  with_bits(bits, [&](auto b) { widen_codes_n<decltype(b)::value>(codes, n, add, out); });
}

template <class T, class = void>
struct HasRowOps : std::false_type {};
template <class T>
struct HasRowOps<T, std::void_t<decltype(&T::row_max), decltype(&T::row_exp)>> : std::true_type {};

template <class T, class = void>
struct RunKeys : std::integral_constant<int, 0> {};
template <class T>
struct RunKeys<T, std::void_t<decltype(T::kRunKeys)>> : std::integral_constant<int, T::kRunKeys> {};

template <class T, class = void>
struct HasWiden : std::false_type {};
template <class T>
struct HasWiden<T, std::void_t<decltype(&T::widen)>> : std::true_type {};

template <class T, class = void>
struct CentredAsym : std::false_type {};
template <class T>
struct CentredAsym<T, std::void_t<decltype(T::kCentredAsym)>> : std::integral_constant<bool, T::kCentredAsym> {};

template <class T, class = void>
struct HasFastQuant : std::false_type {};
template <class T>
struct HasFastQuant<T, std::void_t<decltype(T::kFastQuant)>> : std::integral_constant<bool, T::kFastQuant> {};

template <class Ops>
struct Attend {
  const AttnContext& c;
  const PagedAttnParams& P;
  const PagedAttnBuffers& B;
  int D, G, bs;
  float* krow;
  float* vrow;
  uint8_t* ubuf;  // unpacked codes
  float* sc;      // [G, ld]: scores, then probabilities, of one run of keys
  int ld;         // keys a run may hold: run_capacity(bs)
  float* acc;     // [G, D]
  float* mx;      // [G]
  float* l;       // [G]
  float* qsum;    // [G, D / k_group] sums of q per K group (fast path, asymmetric K)
  float* qk;      // [4 * G * D] q as Ops::q_prepare wrote it (fast path)
  float* metaf;   // [ld * Ws] (fast path)
  float* rowm;    // [G] block maxima, then the new running maxima (row ops)
  float* rows;    // [G] row sums (row ops)
  uint8_t* wide;  // [ld, 2 D]: a run's records widened to 8-bit K and V codes (widen)
  const float* q;
  // One region of the pool as attention reads it: the default blocks, or (a mixed call) the compact
  // blocks, with their own spec, record widths and fused-path choice. A run never mixes regions.
  struct Region {
    const uint8_t* codes;
    const uint16_t* scales;
    size_t W, Ws;
    int k_bits, v_bits, k_group, v_group;
    bool k_sym, v_sym;
    int kcb, ksc;   // V codes / V meta start inside a record
    bool fast;      // quantized blocks go through Ops' fused path
    bool widen;     // ... after widen_run (K or V neither 8 nor 4 bits)
    int fk_bits;    // the K code width the fused path reads
    float* qk;      // q as Ops::q_prepare wrote it for (fk_bits, k_group), and its sums per K group: the
    float* qsum;    // default region's own (begin); the compact one shares them when they agree, else
                    // prepares its own at its first run (prepare_compact_q)
  };
  Region reg[2];    // 0 default, 1 compact (mixed calls only)
  int pend_reg = 0;         // region of the pending blocks
  bool cq_ready = false;    // the compact region's own q is prepared for this (t, h)
  bool fast;      // the default region's fused path (reg[0].fast)

  static constexpr bool kHasFast = HasFastQuant<Ops>::value;
  // Lazy softmax maximum (row ops): probabilities of at most e^kSlack. A larger slack takes the lazy path
  // more often (8: ~1% faster step at 16K) but moved one random case of the core tests from 8e-5 to
  // 1.1e-4 relative difference to the scalar path; with 1 the tests' differences stay as without it.
  static constexpr float kSlack = 1.f;
  // Ops that take runs of several blocks (QuantRun::rec): consecutive quantized blocks are grouped
  // into runs of up to kRunKeys keys, each one q_scores / softmax / v_accum
  static constexpr int kRunKeys = RunKeys<Ops>::value;
  static_assert(kRunKeys <= kMaxRunKeys, "kRunKeys above kMaxRunKeys");
  const uint8_t* pend_codes[kMaxRunBlocks];  // quantized blocks waiting for their run
  const uint16_t* pend_meta[kMaxRunBlocks];
  int pend_n[kMaxRunBlocks];
  int pend = 0, pend_keys = 0, cur_h = 0;
  const uint8_t* recs[kMaxRunKeys];  // the record pointers of a run (QuantRun::recs)
  // where the pending blocks came from (the look-ahead of QuantRun::next_*)
  const int64_t* pend_row = nullptr;
  int64_t pend_last = -1, pend_end = -1;  // last block pended, last block of this walk
  const uint8_t* next_codes[kMaxRunBlocks];
  const uint16_t* next_meta[kMaxRunBlocks];
  const uint8_t* after_codes[kMaxRunBlocks];

  Attend(const AttnContext& ctx, float* scratch)
      : c(ctx), P(*ctx.p), B(*ctx.b), D(ctx.p->D), G(ctx.G), bs(ctx.p->block_size) {
    // every array starts on a cache line (scratch does: thread_scratch): no vector load or store of a
    // row splits across two lines
    float* s = scratch;
    auto take = [&s](size_t n) {
      float* a = s;
      s += (n + kScratchAlignFloats - 1) / kScratchAlignFloats * kScratchAlignFloats;
      return a;
    };
    krow = take(D);
    vrow = take(D);
    ubuf = reinterpret_cast<uint8_t*>(take((D + 3) / 4 + 1));
    ld = run_capacity(bs);
    sc = take((size_t)G * ld);
    acc = take((size_t)G * D);
    mx = take(G);
    l = take(G);
    qsum = take((size_t)G * 32);
    qk = take(4 * (size_t)G * D);
    rowm = take(G);
    rows = take(G);
    wide = reinterpret_cast<uint8_t*>(take((size_t)ld * 2 * D / 4));
    const bool compact = c.num_compact > 0;
    float* cqk = take(compact ? 4 * (size_t)G * D : 0);
    float* cqsum = take(compact ? (size_t)G * 32 : 0);
    metaf = take(0);
    reg[0] = region(static_cast<const uint8_t*>(B.codes), B.scales, P.code_width, P.scale_width, P.k_bits, P.v_bits,
                    c.k_group, c.v_group, P.k_sym, P.v_sym, c.kcb, c.ksc);
    reg[0].qk = qk, reg[0].qsum = qsum;
    fast = reg[0].fast;
    if (compact) {
      Region& r = reg[1];
      r = region(B.compact_codes, B.compact_scales, P.compact_code_width, P.compact_scale_width, P.ck_bits, P.cv_bits,
                 c.ck_group, c.cv_group, P.ck_sym, P.cv_sym, c.ckcb, c.cksc);
      const bool share = reg[0].fast && r.fk_bits == reg[0].fk_bits && r.k_group == reg[0].k_group;
      r.qk = share ? qk : cqk;
      r.qsum = share ? qsum : cqsum;
    }
  }

  Region region(const uint8_t* codes, const uint16_t* scales, int W, int Ws, int k_bits, int v_bits, int k_group,
                int v_group, bool k_sym, bool v_sym, int kcb, int ksc) const {
    Region r{codes, scales, (size_t)W, (size_t)Ws, k_bits, v_bits, k_group, v_group, k_sym, v_sym, kcb, ksc,
             false, false, k_bits, nullptr, nullptr};
    r.fast = kHasFast && c.quantized && k_bits >= 2 && k_bits <= 8 && v_bits >= 2 && v_bits <= 8 && D % 16 == 0 &&
             k_group % 16 == 0 && v_group % 16 == 0 && D / k_group <= 32 && D / v_group <= 32 && bs <= 32 &&
             bs % 8 == 0;
    r.widen = r.fast && !((k_bits == 8 || k_bits == 4) && (v_bits == 8 || v_bits == 4));
    r.fk_bits = r.widen ? 8 : k_bits;
    return r;
  }

  // The n records of recs[] as 8-bit K | V records in `wide` (recs[] then point there). Symmetric codes
  // move to the 8-bit centre, u + 128 - 2^(b-1), so that (u' - 128) s = (u - 2^(b-1)) s; asymmetric
  // ones keep their value (u s + z), or on centred paths move the same way (see QuantRun::k_mid). The
  // scales stay in the pool.
  void widen_run(const Region& R, int n) {
    const auto add = [](int bits, bool sym) {
      return sym || CentredAsym<Ops>::value ? (uint8_t)(128 - (1 << (bits - 1))) : (uint8_t)0;
    };
    const uint8_t kadd = add(R.k_bits, R.k_sym), vadd = add(R.v_bits, R.v_sym);
    // Ops::widen (optional): the same bytes by the path's own vector instructions
    const auto widen = [](const uint8_t* codes, int bits, int n, uint8_t a, uint8_t* out) {
      if constexpr (HasWiden<Ops>::value) {
        Ops::widen(codes, bits, n, a, out);
      } else {
        widen_codes(codes, bits, n, a, out);
      }
    };
    for (int i = 0; i < n; ++i) {
      uint8_t* dst = wide + (size_t)i * 2 * D;
      widen(recs[i], R.k_bits, D, kadd, dst);
      widen(recs[i] + R.kcb, R.v_bits, D, vadd, dst + D);
      recs[i] = dst;
    }
  }

  // x[i] = exp(x[i] - m) for i < n; returns the sum
  static float exp_sub(float* x, int n, float m) {
    if constexpr (kHasFast) {
      return Ops::exp_sub(x, n, m);
    } else {
      float sum = 0.f;
      for (int i = 0; i < n; ++i) {
        const float e = std::exp(x[i] - m);
        x[i] = e;
        sum += e;
      }
      return sum;
    }
  }

  // K (part=0) or V (part=1) of a quantized record of region R as floats.
  const float* load_quant(const Region& R, const uint8_t* rec, const uint16_t* meta, int part, float* dst) {
    const int bits = part ? R.v_bits : R.k_bits;
    const int group = part ? R.v_group : R.k_group;
    const bool sym = part ? R.v_sym : R.k_sym;
    const uint8_t* codes = part ? rec + R.kcb : rec;
    const uint16_t* m = part ? meta + R.ksc : meta;
    const uint8_t* u;
    if (bits == 8) {
      u = codes;
    } else if (bits == 4) {
      Ops::unpack4(codes, D, ubuf);
      u = ubuf;
    } else {
      unpack_codes(codes, bits, D, ubuf);
      u = ubuf;
    }
    Ops::dequant_u8(u, m, D, group, sym, bits, dst);
    return dst;
  }

  // One run of n consecutive keys (offsets o0..o0+n-1 of a block) from one kind of source.
  // kptr(i)/vptr(i) give the record pointers of key i.
  template <class KeyFn>
  void run(int n, KeyFn&& key) {
    const float scale = P.scale;
    for (int i = 0; i < n; ++i) {
      const float* kr = key(i, 0);
      for (int g = 0; g < G; ++g) sc[(size_t)g * ld + i] = Ops::dot(q + (size_t)g * D, kr, D) * scale;
    }
    softmax(n);
    for (int i = 0; i < n; ++i) {
      const float* vr = key(i, 1);
      for (int g = 0; g < G; ++g) Ops::axpy(acc + (size_t)g * D, sc[(size_t)g * ld + i], vr, D);
    }
  }

  // online softmax over the n scores in sc: rescale the state, scores -> probabilities
  void softmax(int n) {
    const float cap = P.softcap;
    if constexpr (HasRowOps<Ops>::value) {
      if (cap > 0.f)
        for (int g = 0; g < G; ++g)
          for (int i = 0; i < n; ++i) sc[(size_t)g * ld + i] = std::tanh(sc[(size_t)g * ld + i] / cap) * cap;
      // Lazy maximum: while no score is more than kSlack above a row's running maximum, that maximum
      // stays the reference of the exps: no row maxima, no rescale, and nothing for the exps to wait on
      // but a compare whose branch is rarely taken. (mx, l, acc) stay a consistent state for the
      // merge of split parts and the sinks, whatever the reference.
      for (int g = 0; g < G; ++g) rowm[g] = mx[g] + kSlack;  // -inf on the first run: never lazy
      if (!Ops::rows_above(sc, ld, G, n, rowm)) {
        Ops::row_exp(sc, ld, G, n, mx, rows);
        for (int g = 0; g < G; ++g) l[g] += rows[g];
        return;
      }
      Ops::row_max(sc, ld, G, n, rowm);
      for (int g = 0; g < G; ++g) {
        const float mnew = rowm[g] > mx[g] ? rowm[g] : mx[g];
        if (mnew > mx[g]) rescale(g, mx[g], mnew);
        rowm[g] = mnew;
      }
      Ops::row_exp(sc, ld, G, n, rowm, rows);
      for (int g = 0; g < G; ++g) l[g] += rows[g];
      return;
    }
    for (int g = 0; g < G; ++g) {
      float* sg = sc + (size_t)g * ld;
      if (cap > 0.f)
        for (int i = 0; i < n; ++i) sg[i] = std::tanh(sg[i] / cap) * cap;
      float bm;
      if constexpr (kHasFast) {
        bm = Ops::max_n(sg, n);
      } else {
        bm = sg[0];
        for (int i = 1; i < n; ++i) bm = sg[i] > bm ? sg[i] : bm;
      }
      const float mnew = bm > mx[g] ? bm : mx[g];
      if (mnew > mx[g]) rescale(g, mx[g], mnew);
      l[g] += exp_sub(sg, n, mnew);
    }
  }

  // a new running maximum for row g: rescale its state
  void rescale(int g, float mold, float mnew) {
    const float corr = std::exp(mold - mnew);  // exp(-inf) = 0 on the first block
    l[g] *= corr;
    Ops::scale(acc + (size_t)g * D, corr, D);
    mx[g] = mnew;
  }

  // fused path: the nseg pending quantized blocks (all of region pend_reg) as one run
  void run_quant(int nseg) {
    if constexpr (kHasFast) {
      const Region& R = reg[pend_reg];
      const size_t W = R.W;
      int n = 0;
      for (int s = 0; s < nseg; ++s)
        for (int i = 0; i < pend_n[s]; ++i) recs[n++] = pend_codes[s] + (size_t)i * W;
      // the next run's blocks, if they are plain pool blocks of this walk and of the same region
      const size_t Ws = R.Ws;
      // and the blocks of the run after it
      int next_nseg = 0, after_nseg = 0;
      if (kRunKeys > 0)
        for (int64_t b = pend_last + 1; b <= pend_end && after_nseg < kRunKeys / bs; ++b) {
          const int64_t blk = pend_row[b];
          if (blk < 0 || (c.use_tail && b == pend_end) || (blk >= P.num_blocks) != (pend_reg == 1)) break;
          const size_t rec0 = block_rec(pend_reg ? blk - P.num_blocks : blk, cur_h);
          const uint8_t* codes = R.codes + rec0 * W;
          if (next_nseg < kRunKeys / bs) {
            next_codes[next_nseg] = codes;
            next_meta[next_nseg++] = R.scales + rec0 * Ws;
          } else {
            after_codes[after_nseg++] = codes;
          }
        }
      if (pend_reg == 1 && R.qk != reg[0].qk && !cq_ready) {
        prepare_q(R);
        cq_ready = true;
      }
      if (R.widen) {
        run_widened(R, n, nseg);
        return;
      }
      QuantRun r{pend_codes[0], pend_meta[0], W, Ws, n, D, R.k_bits, R.k_group, R.v_bits,
                 R.v_group, R.k_sym, R.v_sym, R.kcb, R.ksc, metaf, nseg, pend_meta, pend_n, recs,
                 next_codes, next_meta, next_nseg, (size_t)bs * W, (size_t)bs * Ws * 2, after_codes, after_nseg,
                 1 << (R.k_bits - 1), 1 << (R.v_bits - 1)};
      Ops::q_scores(r, R.qk, R.qsum, G, P.scale, sc, ld);
      softmax(n);
      Ops::v_accum(r, sc, ld, G, acc);
    }
  }

  // run_quant of a region whose records are widened first: the run's records in 8-bit form, no
  // look-ahead into the pool's (other) layout. Out of line: the common widths never come here.
  [[gnu::noinline]] void run_widened(const Region& R, int n, int nseg) {
    if constexpr (kHasFast) {
      widen_run(R, n);
      QuantRun r{wide, pend_meta[0], 2 * (size_t)D, R.Ws, n, D, 8, R.k_group, 8, R.v_group, R.k_sym, R.v_sym,
                 D, R.ksc, metaf, nseg, pend_meta, pend_n, recs, next_codes, next_meta, 0,
                 (size_t)bs * 2 * D, (size_t)bs * R.Ws * 2, after_codes, 0,
                 1 << (R.k_bits - 1), 1 << (R.v_bits - 1)};
      Ops::q_scores(r, R.qk, R.qsum, G, P.scale, sc, ld);
      softmax(n);
      Ops::v_accum(r, sc, ld, G, acc);
    }
  }

  // q in the form region R's fused path reads: Ops::q_prepare for its K width and group, and the sums
  // of q per K group (asymmetric K)
  void prepare_q(const Region& R) {
    if constexpr (kHasFast) Ops::q_prepare(q, G, D, R.fk_bits, R.k_group, R.qk);
    const int ngk = D / R.k_group;
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < ngk; ++k) {
        const float* qg = q + (size_t)g * D + (size_t)k * R.k_group;
        float sum = 0.f;
        for (int i = 0; i < R.k_group; ++i) sum += qg[i];
        R.qsum[g * ngk + k] = sum;
      }
  }

  // a quantized block of region ri for the fused path: run now, or add it to the pending run (a run
  // holds the blocks of one region: a block of the other one runs the pending ones first)
  void quant_block(int ri, const uint8_t* codes, const uint16_t* meta, int n, int64_t b) {
    if (pend && ri != pend_reg) flush_pending();
    pend_reg = ri;
    if (kRunKeys > 0 && pend_keys + n > kRunKeys) flush_pending();
    pend_last = b;
    pend_codes[pend] = codes, pend_meta[pend] = meta, pend_n[pend] = n;
    ++pend, pend_keys += n;
    if (kRunKeys == 0 || pend_keys + bs > kRunKeys || pend == kMaxRunBlocks) flush_pending();
  }
  void flush_pending() {
    if (pend) run_quant(pend);
    pend = pend_keys = 0;
  }

  // the first record of KV head h in pool block blk
  size_t block_rec(int64_t blk, int h) const { return ((size_t)blk * P.Hkv + h) * bs; }

  const float* f16row(const uint16_t* h, float* dst) {
    Ops::f16_to_f32(h, dst, D);
    return dst;
  }

  void operator()(int t, int h) {
    if (c.split > 1 && c.part < 0) {
      merge(t, h);
      return;
    }
    const int64_t pos = B.positions[t];
    const int64_t pb = pos / bs;
    const int64_t lo = P.window > 0 ? pos - P.window + 1 : 0;  // first visible key
    const int64_t b0 = lo > 0 ? lo / bs : 0;
    int64_t first = b0, last = pb;
    if (c.split > 1) {  // this part's share of the visible blocks
      const int64_t nb = pb - b0 + 1;
      first = b0 + nb * c.part / c.split;
      last = b0 + nb * (c.part + 1) / c.split - 1;
    }
    begin(t, h);
    blocks(t, h, first, last);
    if (c.split > 1) {
      float* dst = c.partial + ((size_t)t * P.Hkv + h) * c.split * c.partial_stride() + c.part * c.partial_stride();
      std::memcpy(dst, mx, sizeof(float) * G);
      std::memcpy(dst + G, l, sizeof(float) * G);
      std::memcpy(dst + 2 * G, acc, sizeof(float) * (size_t)G * D);
      return;
    }
    finish(t, h);
  }

  void begin(int t, int h) {
    q = c.qrot + ((size_t)t * P.Hq + (size_t)h * G) * D;
    for (int g = 0; g < G; ++g) {
      mx[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
    }
    std::memset(acc, 0, sizeof(float) * (size_t)G * D);
    std::memset(sc, 0, sizeof(float) * (size_t)G * ld);  // the fast path reads whole vectors of sc rows
    if (fast) prepare_q(reg[0]);
    cq_ready = false;
  }

  // merge the split partials of (t, h) into the state, then finish
  void merge(int t, int h) {
    const size_t stride = c.partial_stride();
    const float* src = c.partial + ((size_t)t * P.Hkv + h) * c.split * stride;
    for (int g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int p = 0; p < c.split; ++p) m = src[p * stride + g] > m ? src[p * stride + g] : m;
      float sum = 0.f;
      float* a = acc + (size_t)g * D;
      std::memset(a, 0, sizeof(float) * D);
      if (m > -std::numeric_limits<float>::infinity()) {
        for (int p = 0; p < c.split; ++p) {
          const float* ps = src + p * stride;
          if (!(ps[g] > -std::numeric_limits<float>::infinity())) continue;  // empty part
          const float w = std::exp(ps[g] - m);
          sum += ps[G + g] * w;
          Ops::axpy(a, w, ps + 2 * G + (size_t)g * D, D);
        }
      }
      mx[g] = m;
      l[g] = sum;
    }
    finish(t, h);
  }

  void blocks(int t, int h, int64_t bfirst, int64_t blast) {
    const int Hkv = P.Hkv, M = P.max_blocks_per_seq;
    const int64_t pos = B.positions[t];
    const int64_t s = B.seq_ids[t];
    const int64_t* row = B.block_tables + s * M;
    const int64_t pb = pos / bs;
    const int64_t lo = P.window > 0 ? pos - P.window + 1 : 0;  // first visible key
    const size_t W = (size_t)P.code_width;  // float pools (quantized blocks: their Region)
    const size_t stage_head = (size_t)bs * D;
    const size_t stage_kv = (size_t)Hkv * stage_head;  // stride of the K|V dim
    pend_row = row, pend_end = blast, cur_h = h;
    for (int64_t b = bfirst; b <= blast; ++b) {
      const int64_t first = b * bs;
      const int o0 = (int)(lo > first ? lo - first : 0);
      const int o1 = (int)(b == pb ? pos - first : bs - 1);
      const int n = o1 - o0 + 1;
      if (n <= 0) continue;
      if (c.use_sink && b == 0) {
        if (row[0] < 0) continue;
        const uint16_t* base = B.stage + (size_t)s * 4 * stage_kv + (size_t)h * stage_head;  // [s,0,0,h]
        run(n, [&](int i, int part) {
          return f16row(base + (size_t)part * stage_kv + (size_t)(o0 + i) * D, part ? vrow : krow);
        });
      } else if (c.use_tail && b == pb) {
        flush_pending();
        const uint16_t* base = B.stage + ((size_t)s * 4 + 2) * stage_kv + (size_t)h * stage_head;  // [s,1,0,h]
        const int64_t np = c.n_prev[t];
        run(n, [&](int i, int part) {
          const int o = o0 + i;
          const int64_t dist = pos - (first + o);
          const uint16_t* src;
          if (dist <= np) {
            src = (part ? c.v16 : c.k16) + ((size_t)(t - dist) * Hkv + h) * D;
          } else {
            src = base + (size_t)part * stage_kv + (size_t)o * D;
          }
          return f16row(src, part ? vrow : krow);
        });
      } else {
        const int64_t blk = row[b];
        if (blk < 0) continue;
        const int ri = blk >= P.num_blocks;  // ids past the default blocks: the compact region (mixed call)
        const Region& R = reg[ri];
        const size_t rec0 = block_rec(ri ? blk - P.num_blocks : blk, h) + o0;
        if (c.quantized) {
          const uint8_t* codes = R.codes + rec0 * R.W;
          const uint16_t* meta = R.scales + rec0 * R.Ws;
          if (R.fast) {
            quant_block(ri, codes, meta, n, b);
          } else {
            flush_pending();  // (a fused run of the other region)
            run(n, [&](int i, int part) {
              return load_quant(R, codes + (size_t)i * R.W, meta + (size_t)i * R.Ws, part, part ? vrow : krow);
            });
          }
        } else if (P.float_bits == 16) {
          const uint16_t* codes = static_cast<const uint16_t*>(B.codes) + rec0 * W;
          run(n, [&](int i, int part) {
            return f16row(codes + (size_t)i * W + (size_t)part * D, part ? vrow : krow);
          });
        } else {
          const float* codes = static_cast<const float*>(B.codes) + rec0 * W;
          run(n, [&](int i, int part) { return codes + (size_t)i * W + (size_t)part * D; });
        }
      }
    }
    flush_pending();
  }

  void finish(int t, int h) {
    // attention sinks: an extra logit in the denominator only
    for (int g = 0; g < G; ++g) {
      const int hq = h * G + g;
      float* a = acc + (size_t)g * D;
      float denom = l[g];
      if (B.sinks) {
        const float sk = B.sinks[hq];
        if (sk > -std::numeric_limits<float>::infinity()) {
          const float mnew = sk > mx[g] ? sk : mx[g];
          const float corr = std::exp(mx[g] - mnew);
          denom = l[g] * corr + std::exp(sk - mnew);
          Ops::scale(a, corr, D);
        }
      }
      float* o = B.out + ((size_t)t * P.Hq + hq) * D;
      const float inv = 1.0f / denom;
      for (int d = 0; d < D; ++d) o[d] = a[d] * inv;
      if (c.rotate) hadamard(o, D);
    }
  }
};

}  // namespace impl
}  // namespace pagedkv
