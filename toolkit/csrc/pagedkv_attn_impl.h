// The attention loop, written once and instantiated per code path with an `Ops` struct that
// provides the vector primitives. Included (once) by each per-ISA translation unit.
//
// Ops must provide (static):
//   float dot(const float* a, const float* b, int n);
//   void axpy(float* y, float a, const float* x, int n);      // y += a * x
//   void scale(float* y, float a, int n);                     // y *= a
//   void f16_to_f32(const uint16_t* h, float* out, int n);
//   void unpack4(const uint8_t* codes, int n, uint8_t* out);  // 4-bit LSB-first -> bytes
//   void dequant_u8(const uint8_t* u, const uint16_t* meta, int d, int group, bool sym, int bits, float* out);
//   float key_dot_q8(...) optional fast path, selected with Ops::kHasQ8Dot
// Dequantized values are bit-identical to toolkit/quant.py::dequantize: (u - 2^(b-1)) * s, or
// u * s + z, in float32 without contraction. Only the dot/axpy summation order differs by path.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>

#include "pagedkv_internal.h"

namespace pagedkv {
namespace impl {

enum class Src { kQuant, kF16, kF32 };

template <class Ops>
struct Attend {
  const AttnContext& c;
  const PagedAttnParams& P;
  const PagedAttnBuffers& B;
  int D, G, bs;
  float* krow;
  float* vrow;
  uint8_t* ubuf;  // unpacked codes
  float* sc;      // [G, bs]
  float* acc;     // [G, D]
  float* mx;      // [G]
  float* l;       // [G]
  const float* q;

  Attend(const AttnContext& ctx, float* scratch)
      : c(ctx), P(*ctx.p), B(*ctx.b), D(ctx.p->D), G(ctx.G), bs(ctx.p->block_size) {
    float* s = scratch;
    krow = s; s += D;
    vrow = s; s += D;
    ubuf = reinterpret_cast<uint8_t*>(s); s += (D + 3) / 4 + 1;
    sc = s; s += (size_t)G * bs;
    acc = s; s += (size_t)G * D;
    mx = s; s += G;
    l = s;
  }

  // K (part=0) or V (part=1) of a quantized record as floats.
  const float* load_quant(const uint8_t* rec, const uint16_t* meta, int part, float* dst) {
    const int bits = part ? P.v_bits : P.k_bits;
    const int group = part ? c.v_group : c.k_group;
    const bool sym = part ? P.v_sym : P.k_sym;
    const uint8_t* codes = part ? rec + c.kcb : rec;
    const uint16_t* m = part ? meta + c.ksc : meta;
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
    const float cap = P.softcap;
    for (int i = 0; i < n; ++i) {
      const float* kr = key(i, 0);
      for (int g = 0; g < G; ++g) {
        float s = Ops::dot(q + (size_t)g * D, kr, D) * scale;
        if (cap > 0.f) s = std::tanh(s / cap) * cap;
        sc[(size_t)g * bs + i] = s;
      }
    }
    for (int g = 0; g < G; ++g) {
      float* sg = sc + (size_t)g * bs;
      float bm = sg[0];
      for (int i = 1; i < n; ++i) bm = sg[i] > bm ? sg[i] : bm;
      const float mnew = bm > mx[g] ? bm : mx[g];
      if (mnew > mx[g]) {
        const float corr = std::exp(mx[g] - mnew);  // exp(-inf) = 0 on the first block
        l[g] *= corr;
        Ops::scale(acc + (size_t)g * D, corr, D);
        mx[g] = mnew;
      }
      float sum = 0.f;
      for (int i = 0; i < n; ++i) {
        const float e = std::exp(sg[i] - mnew);
        sg[i] = e;
        sum += e;
      }
      l[g] += sum;
    }
    for (int i = 0; i < n; ++i) {
      const float* vr = key(i, 1);
      for (int g = 0; g < G; ++g) Ops::axpy(acc + (size_t)g * D, sc[(size_t)g * bs + i], vr, D);
    }
  }

  const float* f16row(const uint16_t* h, float* dst) {
    Ops::f16_to_f32(h, dst, D);
    return dst;
  }

  void operator()(int t, int h) {
    const int Hkv = P.Hkv, M = P.max_blocks_per_seq;
    const int64_t pos = B.positions[t];
    const int64_t s = B.seq_ids[t];
    const int64_t* row = B.block_tables + s * M;
    q = c.qrot + ((size_t)t * P.Hq + (size_t)h * G) * D;
    for (int g = 0; g < G; ++g) {
      mx[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
    }
    std::memset(acc, 0, sizeof(float) * (size_t)G * D);

    const int64_t pb = pos / bs;
    const int64_t lo = P.window > 0 ? pos - P.window + 1 : 0;  // first visible key
    const int64_t b0 = lo > 0 ? lo / bs : 0;
    const size_t W = (size_t)P.code_width, Ws = (size_t)P.scale_width;
    const size_t stage_head = (size_t)bs * D;
    const size_t stage_kv = (size_t)Hkv * stage_head;  // stride of the K|V dim
    for (int64_t b = b0; b <= pb; ++b) {
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
        const size_t rec0 = ((size_t)blk * Hkv + h) * bs + o0;
        if (c.quantized) {
          const uint8_t* codes = static_cast<const uint8_t*>(B.codes) + rec0 * W;
          const uint16_t* meta = B.scales + rec0 * Ws;
          run(n, [&](int i, int part) {
            return load_quant(codes + (size_t)i * W, meta + (size_t)i * Ws, part, part ? vrow : krow);
          });
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
