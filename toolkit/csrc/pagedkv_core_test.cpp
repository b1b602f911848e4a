// Self-contained tests of the pagedkv core: fp16 conversion, pack/quantize round trips, zero groups,
// every available code path against the scalar one, and attention against a naive dense computation.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "pagedkv_core.h"

using namespace pagedkv;

static int g_fail = 0;
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      ++g_fail;                                            \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__);     \
      std::printf(__VA_ARGS__);                            \
      std::printf("\n");                                   \
    }                                                      \
  } while (0)

static std::mt19937 rng(1234);
static float randn() { return std::normal_distribution<float>(0.f, 1.f)(rng); }

static void test_fp16() {
  // every float16 value survives a round trip; halfway cases round to even
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t x = (uint16_t)h;
    if ((x & 0x7c00) == 0x7c00 && (x & 0x3ff)) continue;  // NaN
    CHECK(fp32_to_fp16(fp16_to_fp32(x)) == x, "fp16 round trip %04x", x);
  }
  CHECK(fp32_to_fp16(1.0f + 1.0f / 2048) == 0x3c00, "tie to even down");
  CHECK(fp32_to_fp16(1.0f + 3.0f / 2048) == 0x3c02, "tie to even up");
  CHECK(fp32_to_fp16(65504.f) == 0x7bff, "max");
  CHECK(fp32_to_fp16(65520.f) == 0x7c00, "overflow to inf");
  CHECK(fp32_to_fp16(std::ldexp(1.f, -25)) == 0, "2^-25 ties to zero");
  CHECK(fp32_to_fp16(std::ldexp(1.5f, -25)) == 1, "smallest subnormal");
  // nearest: compare against a brute force rounding of random floats
  for (int i = 0; i < 200000; ++i) {
    const float f = randn() * std::ldexp(1.f, (int)(rng() % 40) - 28);
    const uint16_t h = fp32_to_fp16(f);
    const double e = std::fabs((double)fp16_to_fp32(h) - f);
    const double e_up = std::fabs((double)fp16_to_fp32((uint16_t)(h + 1)) - f);
    const double e_dn = (h & 0x7fff) ? std::fabs((double)fp16_to_fp32((uint16_t)(h - 1)) - f) : 1e30;
    CHECK(e <= e_up && e <= e_dn, "fp16 nearest %g", f);
    if (g_fail > 20) return;
  }
}

static void test_quant_roundtrip() {
  for (int bits = 2; bits <= 8; ++bits)
    for (int sym = 0; sym < 2; ++sym)
      for (int D : {64, 128}) {
        if ((D * bits) % 8) continue;
        for (int group : {8, 32, D}) {
          std::vector<float> x(D), y(D);
          for (auto& v : x) v = randn() * 3.f;
          std::vector<uint8_t> codes(D * bits / 8);
          std::vector<uint16_t> meta(2 * (D / group));
          quantize_record(x.data(), D, bits, group, sym, codes.data(), meta.data());
          dequantize_record(codes.data(), meta.data(), D, bits, group, sym, y.data());
          for (int g = 0; g < D / group; ++g) {
            const float s = fp16_to_fp32(meta[g]);
            for (int i = g * group; i < (g + 1) * group; ++i)
              CHECK(std::fabs(x[i] - y[i]) <= 0.5f * s * 1.01f + 2e-3f * std::fabs(x[i]) + 1e-3f,
                    "bits %d sym %d group %d: x %g y %g s %g", bits, sym, group, x[i], y[i], s);
          }
          // re-quantizing the dequantized values is stable (codes identical)
          std::vector<uint8_t> codes2(codes.size());
          std::vector<uint16_t> meta2(meta.size());
          quantize_record(y.data(), D, bits, group, sym, codes2.data(), meta2.data());
          std::vector<float> y2(D);
          dequantize_record(codes2.data(), meta2.data(), D, bits, group, sym, y2.data());
          for (int i = 0; i < D; ++i) CHECK(std::fabs(y2[i] - y[i]) <= 1e-2f * (std::fabs(y[i]) + 1.f), "requant");
          if (g_fail > 20) return;
        }
      }
  // zero groups: scale 0, exact zeros back
  for (int sym = 0; sym < 2; ++sym) {
    std::vector<float> x(64, 0.f), y(64, 1.f);
    for (int i = 32; i < 64; ++i) x[i] = randn();
    std::vector<uint8_t> codes(32);
    std::vector<uint16_t> meta(4);
    quantize_record(x.data(), 64, 4, 32, sym, codes.data(), meta.data());
    CHECK(meta[0] == 0, "zero group scale");
    dequantize_record(codes.data(), meta.data(), 64, 4, 32, sym, y.data());
    for (int i = 0; i < 32; ++i) CHECK(y[i] == 0.f, "zero group value %g", y[i]);
  }
  // packing order: 4-bit value 0 is the low nibble
  {
    std::vector<float> x(8, 0.f);
    x[0] = -1.f;  // sym 4 bit: u = -7 + 8 = 1
    x[1] = 1.f;   // u = 15
    uint8_t codes[4];
    uint16_t meta[1];
    quantize_record(x.data(), 8, 4, 8, true, codes, meta);
    CHECK(codes[0] == 0xf1, "nibble order %02x", codes[0]);
  }
  // hadamard is its own inverse
  {
    std::vector<float> x(128), y;
    for (auto& v : x) v = randn();
    y = x;
    hadamard(y.data(), 128);
    hadamard(y.data(), 128);
    for (int i = 0; i < 128; ++i) CHECK(std::fabs(x[i] - y[i]) < 1e-5f, "hadamard inverse");
  }
}

// ------------------------------------------------------------------------------------------------

struct Case {
  int Hq, Hkv, D, bs, NB, S, M;
  PagedAttnParams p;
  std::vector<float> q, k, v, sinks;
  std::vector<uint8_t> codes;  // raw bytes of the pool (uint8 / fp16 / fp32)
  std::vector<uint16_t> scales, stage;
  std::vector<int64_t> pos, seq, table;
  std::vector<uint8_t> ccodes;  // the compact region (mixed tables; p.num_compact blocks)
  std::vector<uint16_t> cscales;
};

static Case make_case(int Hq, int Hkv, int D, int bs, int kbits, int vbits, bool rotate, bool tail, int sink,
                      int window, float softcap, bool with_sinks, int float_bits, const std::vector<int>& lens) {
  Case c;
  c.Hq = Hq, c.Hkv = Hkv, c.D = D, c.bs = bs;
  c.S = (int)lens.size();
  int maxlen = 0;
  for (int n : lens) maxlen = std::max(maxlen, n);
  c.M = (maxlen + bs - 1) / bs + 1;
  c.NB = c.S * c.M + 1;
  PagedAttnParams& p = c.p;
  p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.block_size = bs, p.num_blocks = c.NB, p.stage_rows = c.S, p.table_rows = c.S;
  p.max_blocks_per_seq = c.M;
  p.float_pool = float_bits != 0;
  p.float_bits = float_bits ? float_bits : 32;
  p.k_bits = kbits, p.v_bits = vbits, p.k_group = 32, p.v_group = 32, p.k_sym = true, p.v_sym = false;
  p.rotate = rotate, p.fp_tail = tail, p.sink_blocks = sink, p.window = window, p.softcap = softcap;
  p.scale = 1.f / std::sqrt((float)D);
  record_widths(p, &p.code_width, &p.scale_width);
  const size_t elem = p.float_pool ? p.float_bits / 8 : 1;
  c.codes.assign((size_t)c.NB * Hkv * bs * p.code_width * elem, 0);
  c.scales.assign((size_t)c.NB * Hkv * bs * std::max(1, p.scale_width), 0);
  c.stage.assign((size_t)c.S * 4 * Hkv * bs * D, 0);
  // block tables: a shuffled set of distinct blocks
  std::vector<int64_t> ids;
  for (int i = 0; i < c.NB; ++i) ids.push_back(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  c.table.assign((size_t)c.S * c.M, -1);
  for (int s = 0, k = 0; s < c.S; ++s)
    for (int b = 0; b < c.M; ++b) c.table[s * c.M + b] = ids[k++];
  int T = 0;
  for (int s = 0; s < c.S; ++s)
    for (int i = 0; i < lens[s]; ++i) c.pos.push_back(i), c.seq.push_back(s), ++T;
  p.T = T;
  c.q.resize((size_t)Hq * T * D);
  c.k.resize((size_t)Hkv * T * D);
  c.v.resize((size_t)Hkv * T * D);
  for (auto& x : c.q) x = randn();
  for (auto& x : c.k) x = randn();
  for (auto& x : c.v) x = randn();
  c.sinks.assign(Hq, -INFINITY);
  if (with_sinks)
    for (auto& x : c.sinks) x = randn();
  return c;
}

static int run_case(Case& c, std::vector<float>& out, std::string* err = nullptr, const HostPool* host = nullptr) {
  out.assign((size_t)c.p.T * c.Hq * c.D, 0.f);
  PagedAttnBuffers b;
  b.q = c.q.data(), b.k = c.k.data(), b.v = c.v.data();
  b.codes = c.codes.data(), b.scales = c.scales.data(), b.stage = c.stage.data();
  b.positions = c.pos.data(), b.seq_ids = c.seq.data(), b.block_tables = c.table.data(), b.sinks = c.sinks.data();
  b.out = out.data();
  if (!c.ccodes.empty()) b.compact_codes = c.ccodes.data(), b.compact_scales = c.cscales.data();
  char msg[512] = {0};
  const int rc = paged_attention(c.p, b, msg, sizeof msg, host);
  if (err) *err = msg;
  if (rc && !err) std::printf("error: %s\n", msg);
  return rc;
}

static float qdq(float x, int bits, int group, bool sym, const float* grp, int idx) {
  (void)x;
  std::vector<uint8_t> codes(group * bits / 8 + 1);
  uint16_t meta[2];
  std::vector<float> y(group);
  quantize_record(grp, group, bits, group, sym, codes.data(), meta);
  dequantize_record(codes.data(), meta, group, bits, group, sym, y.data());
  return y[idx];
}

// Naive dense attention for a single-call prefill of every sequence (all tokens in this call).
static std::vector<float> naive(const Case& c) {
  const PagedAttnParams& p = c.p;
  const int T = p.T, D = c.D, G = c.Hq / c.Hkv, bs = c.bs;
  const bool quant = !p.float_pool;
  auto rot = [&](std::vector<float> x) {
    if (quant && p.rotate) hadamard(x.data(), D);
    return x;
  };
  auto row = [&](const std::vector<float>& src, int H, int h, int t) {
    return std::vector<float>(src.begin() + ((size_t)h * T + t) * D, src.begin() + ((size_t)h * T + t + 1) * D);
  };
  auto cache_val = [&](const std::vector<float>& x, int bits, bool sym, int j, bool full_prec) {
    std::vector<float> y(D);
    if (!quant) {
      for (int i = 0; i < D; ++i) y[i] = p.float_bits == 16 ? fp16_to_fp32(fp32_to_fp16(x[i])) : x[i];
    } else if (full_prec) {
      for (int i = 0; i < D; ++i) y[i] = fp16_to_fp32(fp32_to_fp16(x[i]));
    } else {
      for (int i = 0; i < D; ++i) y[i] = qdq(x[i], bits, 32, sym, x.data() + (i / 32) * 32, i % 32);
    }
    (void)j;
    return y;
  };
  std::vector<float> out((size_t)T * c.Hq * D);
  for (int t = 0; t < T; ++t) {
    const int s = (int)c.seq[t], P = (int)c.pos[t];
    for (int hq = 0; hq < c.Hq; ++hq) {
      const int h = hq / G;
      std::vector<float> q = rot(row(c.q, c.Hq, hq, t));
      std::vector<double> logits;
      std::vector<std::vector<float>> vals;
      for (int u = 0; u < T; ++u) {
        if (c.seq[u] != s) continue;
        const int j = (int)c.pos[u];
        if (j > P || (p.window > 0 && j <= P - p.window)) continue;
        const bool fp = quant && ((p.sink_blocks && j < bs) || (p.fp_tail && j / bs == P / bs));
        std::vector<float> kk = cache_val(rot(row(c.k, c.Hkv, h, u)), p.k_bits, p.k_sym, j, fp);
        std::vector<float> vv = cache_val(rot(row(c.v, c.Hkv, h, u)), p.v_bits, p.v_sym, j, fp);
        double sc = 0;
        for (int i = 0; i < D; ++i) sc += (double)q[i] * kk[i];
        sc *= p.scale;
        if (p.softcap > 0) sc = std::tanh(sc / p.softcap) * p.softcap;
        logits.push_back(sc);
        vals.push_back(vv);
      }
      double m = -INFINITY;
      for (double l : logits) m = std::max(m, l);
      if (c.sinks[hq] > -INFINITY) m = std::max(m, (double)c.sinks[hq]);
      double den = c.sinks[hq] > -INFINITY ? std::exp(c.sinks[hq] - m) : 0.0;
      std::vector<double> acc(D, 0.0);
      for (size_t i = 0; i < logits.size(); ++i) {
        const double e = std::exp(logits[i] - m);
        den += e;
        for (int d = 0; d < D; ++d) acc[d] += e * vals[i][d];
      }
      std::vector<float> o(D);
      for (int d = 0; d < D; ++d) o[d] = (float)(acc[d] / den);
      if (quant && p.rotate) hadamard(o.data(), D);
      std::copy(o.begin(), o.end(), out.begin() + ((size_t)t * c.Hq + hq) * D);
    }
  }
  return out;
}

// Largest |a - b| / (|b| + 1e-2); an output that is NaN on one side only counts as infinitely far
// (NaN on both sides agrees). A plain std::max would drop NaNs: std::max(m, NaN) is m.
static float max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0.f;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
      continue;
    }
    m = std::max(m, std::fabs(a[i] - b[i]) / (std::fabs(b[i]) + 1e-2f));
  }
  return m;
}

static void test_attention_vs_naive() {
  struct Cfg { int Hq, Hkv, D, bs, kb, vb; bool rot, tail; int sink, window; float cap; bool sinks; int fb; std::vector<int> lens; };
  std::vector<Cfg> cfgs = {
      {4, 2, 64, 16, 8, 4, false, false, 0, 0, 0.f, false, 32, {37, 5}},
      {8, 2, 64, 16, 8, 4, true, true, 1, 0, 0.f, true, 0, {50, 1, 17}},
      {3, 1, 128, 32, 8, 4, true, true, 1, 20, 30.f, false, 0, {70}},
      {4, 4, 64, 16, 4, 4, true, false, 0, 0, 0.f, true, 0, {33}},
      {6, 2, 64, 16, 5, 3, false, true, 0, 9, 0.f, false, 0, {40, 18}},
      {2, 1, 64, 32, 16, 16, false, false, 0, 0, 0.f, false, 16, {45}},
  };
  for (const Cfg& f : cfgs) {
    Case c = make_case(f.Hq, f.Hkv, f.D, f.bs, f.fb ? f.fb : f.kb, f.fb ? f.fb : f.vb, f.rot, f.tail, f.sink,
                       f.window, f.cap, f.sinks, f.fb, f.lens);
    std::vector<float> out;
    CHECK(run_case(c, out) == 0, "run");
    const std::vector<float> ref = naive(c);
    const float e = max_rel(out, ref);
    CHECK(e < 2e-4f, "attention vs naive (Hq %d Hkv %d D %d kb %d vb %d): max rel err %g", f.Hq, f.Hkv, f.D, f.kb,
          f.vb, e);
  }
}

// the SIMD code paths of this CPU
static std::vector<Isa> simd_paths() {
  std::vector<Isa> paths;
  for (Isa i : kAllIsas)
    if (i != Isa::kScalar && isa_available(i)) paths.push_back(i);
  return paths;
}

// Runs `base` on the scalar path and on every SIMD path: pools bit-identical, outputs within 2e-4 (the
// paths sum in other orders: ~2e-6 absolute on outputs of ~3, which max_rel's 1e-2 floor turns into up
// to ~1.3e-4 for outputs near zero; a wrong code or scale is off by 1e-2 or more).
static void check_paths_agree(const Case& base, const char* what, int index) {
  set_isa(Isa::kScalar);
  Case c0 = base;
  std::vector<float> out0;
  CHECK(run_case(c0, out0) == 0, "run");
  for (Isa isa : simd_paths()) {
    set_isa(isa);
    Case c1 = base;
    std::vector<float> out1;
    run_case(c1, out1);
    CHECK(c1.codes == c0.codes && c1.scales == c0.scales && c1.stage == c0.stage, "%s pools differ", isa_name(isa));
    const float e = max_rel(out1, out0);
    CHECK(e < 2e-4f, "%s vs scalar, %s %d: max rel err %g", isa_name(isa), what, index, e);
  }
  set_isa(Isa::kAuto);
}

static void test_paths_agree() {
  const std::vector<Isa> paths = simd_paths();
  std::printf("code paths: scalar");
  for (Isa i : paths) std::printf(" %s", isa_name(i));
  std::printf("\n");
  for (int trial = 0; trial < 12; ++trial) {
    const int kb = 2 + (int)(rng() % 7), vb = 2 + (int)(rng() % 7);
    const int fb = trial == 10 ? 16 : trial == 11 ? 32 : 0;
    const int G = 1 + (int)(rng() % 4);
    std::vector<int> lens = {1 + (int)(rng() % 60), 1 + (int)(rng() % 5)};
    Case base = make_case(2 * G, 2, trial % 2 ? 128 : 64, trial % 3 ? 16 : 32, fb ? fb : kb, fb ? fb : vb,
                          !fb && trial % 2, !fb && trial % 4 != 0, !fb && (trial % 3 == 0), trial == 5 ? 7 : 0,
                          trial == 6 ? 20.f : 0.f, trial % 2, fb, lens);
    check_paths_agree(base, "trial", trial);
  }
}

// Other groups / symmetry than make_case's (32, 32, sym K, asym V): new record widths, empty pools.
static void set_quant_spec(Case& c, int k_group, int v_group, bool k_sym, bool v_sym) {
  PagedAttnParams& p = c.p;
  p.k_group = k_group, p.v_group = v_group, p.k_sym = k_sym, p.v_sym = v_sym;
  record_widths(p, &p.code_width, &p.scale_width);
  c.codes.assign((size_t)c.NB * c.Hkv * c.bs * p.code_width, 0);
  c.scales.assign((size_t)c.NB * c.Hkv * c.bs * std::max(1, p.scale_width), 0);
}

// Quantized specs whose sequences span several full blocks, so the fused fast path (groups of 16k,
// bs <= 32, bs % 8 == 0; widths other than 8/4 bits through widened records) runs over many blocks: the default spec (K8 sym g64, V4 asym
// g32, rotate, fp tail, sink block) and variations of group size, symmetry, G (tiles of 4 heads and
// a remainder), window (odd run lengths) and softcap.
static void test_quant_paths_agree() {
  struct Cfg { int G, D, bs, kb, vb, kg, vg; bool ks, vs; int window; float cap; std::vector<int> lens; };
  const std::vector<Cfg> cfgs = {
      {3, 64, 16, 8, 4, 64, 32, true, false, 0, 0.f, {200, 37}},      // the default spec
      {4, 128, 32, 8, 4, 32, 32, true, false, 0, 0.f, {150, 70}},
      {5, 64, 16, 8, 8, 64, 16, false, true, 45, 0.f, {120, 9}},      // asym K, sym V 8-bit, window
      {2, 128, 8, 4, 8, 16, 64, false, true, 0, 20.f, {90, 33}},      // 4-bit asym K, softcap
      {8, 256, 32, 4, 4, 128, 256, true, true, 0, 0.f, {100}},
      {1, 64, 16, 4, 4, 64, 64, false, false, 33, 0.f, {130, 64}},
      {4, 256, 16, 7, 5, 64, 32, true, false, 0, 0.f, {120, 40}},     // Gemma 3's best: widened records
      {3, 64, 16, 4, 3, 64, 64, true, false, 40, 0.f, {150}},        // the compact spec, window
      {2, 128, 32, 6, 2, 32, 16, false, true, 0, 0.f, {90, 17}},
  };
  for (size_t n = 0; n < cfgs.size(); ++n) {
    const Cfg& f = cfgs[n];
    Case base = make_case(2 * f.G, 2, f.D, f.bs, f.kb, f.vb, true, true, 1, f.window, f.cap, n % 2 == 0, 0, f.lens);
    set_quant_spec(base, f.kg, f.vg, f.ks, f.vs);
    if (n == 0) {  // a zero query row and a small-magnitude head
      std::fill(base.q.begin(), base.q.begin() + f.D, 0.f);
      for (size_t i = (size_t)base.p.T * f.D; i < (size_t)2 * base.p.T * f.D; ++i) base.q[i] *= 1e-2f;
    }
    check_paths_agree(base, "quantized spec", (int)n);
  }
}

// A query with a NaN or an infinity: every SIMD path gives NaN exactly where the scalar path does, the
// other outputs as in check_paths_agree.
static void test_nonfinite_query_paths_agree() {
  Case base = make_case(6, 2, 64, 16, 8, 4, true, true, 1, 0, 0.f, false, 0, {200, 90});
  set_quant_spec(base, 64, 32, true, false);  // the default spec
  const int T = base.p.T, D = base.D;
  base.q[((size_t)0 * T + 199) * D + 5] = NAN;        // head 0 (KV head 0), last token of sequence 0
  base.q[((size_t)4 * T + 150) * D + 7] = INFINITY;   // head 4 (KV head 1)
  set_isa(Isa::kScalar);
  Case c0 = base;
  std::vector<float> out0;
  CHECK(run_case(c0, out0) == 0, "run");
  size_t nans = 0;
  for (float x : out0) nans += std::isnan(x);
  CHECK(nans >= (size_t)D, "scalar path: %zu NaN outputs, expected the rows of the non-finite queries", nans);
  check_paths_agree(base, "non-finite query", 0);  // max_rel: NaN on one path only fails
}

// A pool whose V scales were flipped negative (as a corrupt pool could hold; the writer never stores one):
// every path still computes u * s + z as the reference does (the integer V path of avx512-vnni hands such
// runs to its float loop).
static void test_negative_scales_paths_agree() {
  Case base = make_case(6, 2, 64, 16, 8, 4, true, true, 1, 0, 0.f, false, 0, {150});
  set_quant_spec(base, 64, 32, true, false);  // the default spec
  set_isa(Isa::kScalar);
  std::vector<float> out;
  CHECK(run_case(base, out) == 0, "prefill");
  const int ngk = base.D / base.p.k_group, ngv = base.D / base.p.v_group;
  for (size_t r = 0; r < base.scales.size() / base.p.scale_width; r += 3)  // every third record: V scales
    for (int g = 0; g < ngv; ++g) base.scales[r * base.p.scale_width + ngk + g] ^= 0x8000;
  // a decode step of token 150 over the altered pool
  Case step = base;
  step.p.T = 1;
  step.pos = {150}, step.seq = {0};
  step.q.resize((size_t)step.Hq * base.D), step.k.resize((size_t)step.Hkv * base.D), step.v.resize((size_t)step.Hkv * base.D);
  for (auto& x : step.q) x = randn();
  for (auto& x : step.k) x = randn();
  for (auto& x : step.v) x = randn();
  check_paths_agree(step, "negative V scales", 0);
}

// ------------------------------------------------------------------------------------------------
// Mixed default/compact block tables (the compact tier, POOL_FORMAT.md "Compact region")

// A quantized spec: bits, groups, symmetry.
struct QSpec { int kb, vb, kg, vg; bool ks, vs; };

// The record dequantize(quantize(x)) of one of K (part 0) / V (part 1) under spec q: what the pool
// holds for x.
static std::vector<float> qdq_part(const std::vector<float>& x, const QSpec& q, int part) {
  const int D = (int)x.size(), bits = part ? q.vb : q.kb, group = part ? q.vg : q.kg;
  const bool sym = part ? q.vs : q.ks;
  std::vector<uint8_t> codes((size_t)D * bits / 8);
  std::vector<uint16_t> meta(2 * (D / group));
  std::vector<float> y(D);
  quantize_record(x.data(), D, bits, group, sym, codes.data(), meta.data());
  dequantize_record(codes.data(), meta.data(), D, bits, group, sym, y.data());
  return y;
}

// Mixed case: every sequence prefilled (first call, the default op), then the full blocks marked in
// `moved` re-quantized into the compact region (dequantize the default record, quantize with the
// compact spec) and their table entries pointed there (id NB + compact block), then `extra` more tokens
// per sequence in one call (returned as the case to run). full: the case with all tokens in one call
// (the naive reference's history).
struct Mixed {
  Case call, full;
  QSpec dspec, cspec;
  std::vector<std::vector<int>> moved;  // per sequence: its logical blocks in the compact region
};

static Mixed make_mixed(int G, int D, int bs, QSpec ds, QSpec cs, bool tail, int sink, int window, float cap,
                        bool with_sinks, const std::vector<int>& prefill, int extra, unsigned seed) {
  std::vector<int> total;
  for (int n : prefill) total.push_back(n + extra);
  Mixed m;
  m.dspec = ds, m.cspec = cs;
  m.full = make_case(2 * G, 2, D, bs, ds.kb, ds.vb, true, tail, sink, window, cap, with_sinks, 0, total);
  set_quant_spec(m.full, ds.kg, ds.vg, ds.ks, ds.vs);
  Case& f = m.full;
  const int T = f.p.T, Hkv = f.Hkv, Hq = f.Hq;
  // first call: the prefill tokens of every sequence
  Case pre = f;
  std::vector<int> idx_pre, idx_new;
  for (int t = 0; t < T; ++t) (f.pos[t] < prefill[f.seq[t]] ? idx_pre : idx_new).push_back(t);
  auto subset = [&](Case& c, const std::vector<int>& idx) {
    const int n = (int)idx.size();
    c.p.T = n;
    c.pos.clear(), c.seq.clear();
    c.q.assign((size_t)Hq * n * D, 0.f), c.k.assign((size_t)Hkv * n * D, 0.f), c.v.assign((size_t)Hkv * n * D, 0.f);
    for (int i = 0; i < n; ++i) {
      const int t = idx[i];
      c.pos.push_back(f.pos[t]), c.seq.push_back(f.seq[t]);
      for (int h = 0; h < Hq; ++h)
        std::copy_n(f.q.begin() + ((size_t)h * T + t) * D, D, c.q.begin() + ((size_t)h * n + i) * D);
      for (int h = 0; h < Hkv; ++h) {
        std::copy_n(f.k.begin() + ((size_t)h * T + t) * D, D, c.k.begin() + ((size_t)h * n + i) * D);
        std::copy_n(f.v.begin() + ((size_t)h * T + t) * D, D, c.v.begin() + ((size_t)h * n + i) * D);
      }
    }
  };
  subset(pre, idx_pre);
  std::vector<float> out;
  set_isa(Isa::kScalar);
  CHECK(run_case(pre, out) == 0, "mixed: prefill");
  set_isa(Isa::kAuto);
  // the compact region: the chosen full blocks (never one the second call writes into), re-quantized
  Case& c = m.call;
  c = pre;
  subset(c, idx_new);
  PagedAttnParams& p = c.p;
  p.ck_bits = cs.kb, p.cv_bits = cs.vb, p.ck_group = cs.kg, p.cv_group = cs.vg, p.ck_sym = cs.ks, p.cv_sym = cs.vs;
  compact_record_widths(p, &p.compact_code_width, &p.compact_scale_width);
  const int W = p.code_width, Ws = p.scale_width, CW = p.compact_code_width, CWs = p.compact_scale_width;
  m.moved.assign(c.S, {});
  std::vector<std::pair<int, int>> chosen;
  for (int s = 0; s < c.S; ++s)
    for (int b = 0; b < prefill[s] / bs; ++b)
      if (rng() % 5 < 3) chosen.push_back({s, b}), m.moved[s].push_back(b);
  p.num_compact = (int)chosen.size() + 2;  // two compact blocks the table never names (random bytes)
  c.ccodes.resize((size_t)p.num_compact * Hkv * bs * CW);
  c.cscales.resize((size_t)p.num_compact * Hkv * bs * CWs);
  for (auto& x : c.ccodes) x = (uint8_t)rng();
  for (auto& x : c.cscales) x = (uint16_t)(rng() & 0x3bff);
  std::vector<int> ids(p.num_compact);
  for (int i = 0; i < p.num_compact; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<float> kx(D), vx(D);
  for (size_t i = 0; i < chosen.size(); ++i) {
    const int s = chosen[i].first, b = chosen[i].second, cid = ids[i];
    const int64_t blk = c.table[(size_t)s * c.M + b];
    for (int h = 0; h < Hkv; ++h)
      for (int o = 0; o < bs; ++o) {
        const size_t r = ((size_t)blk * Hkv + h) * bs + o, cr = ((size_t)cid * Hkv + h) * bs + o;
        const uint8_t* rc = c.codes.data() + r * W;
        const uint16_t* rm = c.scales.data() + r * Ws;
        dequantize_record(rc, rm, D, ds.kb, ds.kg, ds.ks, kx.data());
        dequantize_record(rc + D * ds.kb / 8, rm + (D / ds.kg) * (ds.ks ? 1 : 2), D, ds.vb, ds.vg, ds.vs, vx.data());
        uint8_t* cc = c.ccodes.data() + cr * CW;
        uint16_t* cm = c.cscales.data() + cr * CWs;
        quantize_record(kx.data(), D, cs.kb, cs.kg, cs.ks, cc, cm);
        quantize_record(vx.data(), D, cs.vb, cs.vg, cs.vs, cc + D * cs.kb / 8, cm + (D / cs.kg) * (cs.ks ? 1 : 2));
      }
    c.table[(size_t)s * c.M + b] = c.NB + cid;
  }
  return m;
}

// Naive dense attention of the second call's tokens over the whole history: float16 for the sink block
// and the query's own block, the compact spec applied to the default one's values for moved blocks.
static std::vector<float> naive_mixed(const Mixed& m) {
  const Case& f = m.full;
  const PagedAttnParams& p = f.p;
  const int T = p.T, D = f.D, G = f.Hq / f.Hkv, bs = f.bs;
  auto row = [&](const std::vector<float>& src, int h, int t) {
    std::vector<float> x(src.begin() + ((size_t)h * T + t) * D, src.begin() + ((size_t)h * T + t + 1) * D);
    hadamard(x.data(), D);
    return x;
  };
  std::vector<float> out;
  for (int t = 0; t < T; ++t) {
    const int s = (int)f.seq[t], P = (int)f.pos[t];
    bool in_call = false;
    for (size_t i = 0; i < m.call.pos.size(); ++i) in_call |= m.call.seq[i] == s && m.call.pos[i] == P;
    if (!in_call) continue;
    for (int hq = 0; hq < f.Hq; ++hq) {
      const int h = hq / G;
      const std::vector<float> q = row(f.q, hq, t);
      std::vector<double> logits;
      std::vector<std::vector<float>> vals;
      for (int u = 0; u < T; ++u) {
        const int j = (int)f.pos[u];
        if (f.seq[u] != s || j > P || (p.window > 0 && j <= P - p.window)) continue;
        std::vector<float> kk = row(f.k, h, u), vv = row(f.v, h, u);
        if ((p.sink_blocks && j < bs) || (p.fp_tail && j / bs == P / bs)) {
          for (int i = 0; i < D; ++i) kk[i] = fp16_to_fp32(fp32_to_fp16(kk[i])), vv[i] = fp16_to_fp32(fp32_to_fp16(vv[i]));
        } else {
          kk = qdq_part(kk, m.dspec, 0), vv = qdq_part(vv, m.dspec, 1);
          const auto& mv = m.moved[s];
          if (std::find(mv.begin(), mv.end(), j / bs) != mv.end())
            kk = qdq_part(kk, m.cspec, 0), vv = qdq_part(vv, m.cspec, 1);
        }
        double sc = 0;
        for (int i = 0; i < D; ++i) sc += (double)q[i] * kk[i];
        sc *= p.scale;
        if (p.softcap > 0) sc = std::tanh(sc / p.softcap) * p.softcap;
        logits.push_back(sc);
        vals.push_back(vv);
      }
      double mx = -INFINITY;
      for (double l : logits) mx = std::max(mx, l);
      if (f.sinks[hq] > -INFINITY) mx = std::max(mx, (double)f.sinks[hq]);
      double den = f.sinks[hq] > -INFINITY ? std::exp(f.sinks[hq] - mx) : 0.0;
      std::vector<double> acc(D, 0.0);
      for (size_t i = 0; i < logits.size(); ++i) {
        const double e = std::exp(logits[i] - mx);
        den += e;
        for (int d = 0; d < D; ++d) acc[d] += e * vals[i][d];
      }
      std::vector<float> o(D);
      for (int d = 0; d < D; ++d) o[d] = (float)(acc[d] / den);
      hadamard(o.data(), D);
      out.insert(out.end(), o.begin(), o.end());
    }
  }
  return out;
}

// Mixed tables: every code path against the naive reference and the scalar path (pools bit-identical,
// the compact region untouched), over default/compact spec pairs that take each way a compact run can
// go: the default region's prepared q shared (same K width and group after widening), its own q (other
// K group or width), widened or not, the generic path for compact blocks next to fused default ones,
// asymmetric K (q sums per group), windows, softcap, sinks, and split-K decode.
static void test_mixed_tables() {
  const QSpec kDefault{8, 4, 64, 32, true, false}, kBest{7, 5, 64, 32, true, false};
  const QSpec kCompact{4, 3, 64, 64, true, false};
  struct Cfg { int G, D, bs; QSpec ds, cs; bool tail; int sink, window; float cap; bool sinks; std::vector<int> prefill; int extra; };
  const std::vector<Cfg> cfgs = {
      {3, 64, 16, kDefault, kCompact, true, 1, 0, 0.f, false, {150, 70}, 3},            // the compact tier as built
      {2, 64, 16, kBest, kCompact, true, 1, 0, 0.f, true, {130, 40}, 2},                // both widened
      {4, 64, 16, kDefault, {4, 2, 32, 32, true, false}, true, 1, 40, 0.f, false, {120}, 5},  // own q; wider meta
      {2, 128, 32, {4, 4, 64, 64, true, true}, kCompact, false, 0, 0, 20.f, true, {200, 33}, 1},  // 4-bit default
      {3, 64, 16, kDefault, {4, 3, 8, 8, true, false}, true, 1, 0, 0.f, false, {100, 50}, 4},    // generic compact
      {1, 64, 8, kDefault, {8, 4, 32, 32, false, true}, true, 0, 0, 0.f, true, {90, 64}, 2},     // asym K, no widen
      {4, 64, 16, kDefault, kCompact, true, 1, 0, 0.f, false, {600}, 1},                // split-K decode
      {2, 64, 16, {5, 4, 64, 64, true, true}, {5, 2, 64, 64, true, false}, true, 1, 100, 0.f, false, {300}, 1},
  };
  std::vector<Isa> paths = simd_paths();
  paths.insert(paths.begin(), Isa::kScalar);
  for (size_t n = 0; n < cfgs.size(); ++n) {
    const Cfg& f = cfgs[n];
    Mixed m = make_mixed(f.G, f.D, f.bs, f.ds, f.cs, f.tail, f.sink, f.window, f.cap, f.sinks, f.prefill, f.extra,
                         (unsigned)n);
    size_t nmoved = 0;
    for (const auto& v : m.moved) nmoved += v.size();
    CHECK(nmoved > 0, "mixed case %zu moves no block", n);
    const std::vector<float> ref = naive_mixed(m);
    for (Isa isa : paths) {
      set_isa(isa);
      Case c = m.call;
      std::vector<float> out;
      CHECK(run_case(c, out) == 0, "mixed case %zu on %s", n, isa_name(isa));
      CHECK(c.ccodes == m.call.ccodes && c.cscales == m.call.cscales, "mixed case %zu: compact region written", n);
      const float e = max_rel(out, ref);
      CHECK(e < 2e-4f, "mixed case %zu on %s vs naive: max rel err %g", n, isa_name(isa), e);
    }
    set_isa(Isa::kAuto);
    check_paths_agree(m.call, "mixed table", (int)n);
    // the same call with the moved blocks' entries pointing back to their default blocks and the compact
    // region still passed: exactly the default op's bits (a table without compact ids reads the same)
    if (n == 0) {
      Mixed d = make_mixed(f.G, f.D, f.bs, f.ds, f.cs, f.tail, f.sink, f.window, f.cap, f.sinks, f.prefill, f.extra, 0);
      Case plain = d.call, with = d.call;
      plain.table = with.table = d.full.table;
      plain.p.num_compact = 0, plain.ccodes.clear(), plain.cscales.clear();
      for (Isa isa : paths) {
        set_isa(isa);
        Case a = plain, b = with;
        std::vector<float> oa, ob;
        CHECK(run_case(a, oa) == 0 && run_case(b, ob) == 0, "run");
        CHECK(oa == ob && a.codes == b.codes && a.stage == b.stage, "%s: an unused compact region changes the result",
              isa_name(isa));
      }
      set_isa(Isa::kAuto);
    }
  }
}

static void test_mixed_errors() {
  Mixed m = make_mixed(2, 64, 16, {8, 4, 64, 32, true, false}, {4, 3, 64, 64, true, false}, true, 1, 0, 0.f, false,
                       {70}, 2, 0);
  std::vector<float> out;
  std::string msg;
  auto fails = [&](Case c, int want, const char* what, const char* needle) {
    const std::vector<uint8_t> codes0 = c.codes, cc0 = c.ccodes;
    const std::vector<uint16_t> stage0 = c.stage;
    CHECK(run_case(c, out, &msg) == want, "%s must fail (got: %s)", what, msg.c_str());
    CHECK(msg.find(needle) != std::string::npos, "%s: message %s", what, msg.c_str());
    CHECK(c.codes == codes0 && c.stage == stage0 && c.ccodes == cc0, "%s: nothing written on error", what);
  };
  Case a = m.call;  // the new tokens' block (70, 71: logical block 4) named in the compact region
  a.table[4] = a.NB + 1;
  fails(a, kErrSlot, "a write slot in a compact block", "compact block");
  Case b = m.call;
  b.table[1] = b.NB + b.p.num_compact;  // past both regions
  fails(b, kErrSlot, "a block id past the compact region", "compact");
  Case c = m.call;
  c.p.compact_code_width += 1;
  fails(c, kErrShape, "compact widths of another spec", "compact record widths");
  Case d = m.call;
  d.p.ck_bits = 9;
  fails(d, kErrShape, "compact bits 9", "compact bits");
  Case e = m.call;
  e.ccodes.clear();
  fails(e, kErrShape, "no compact data", "no compact");
  Case g = m.call;  // without a compact region, compact ids are out of range as before
  g.p.num_compact = 0;
  g.table[1] = g.NB;
  fails(g, kErrSlot, "compact ids without a compact region", "pool has");
}

static void test_errors() {
  Case c = make_case(2, 1, 64, 16, 8, 4, true, true, 1, 0, 0.f, false, 0, {20});
  std::vector<uint8_t> codes0 = c.codes;
  c.k[5 * 64 + 3] = NAN;
  std::vector<float> out;
  std::string msg;
  CHECK(run_case(c, out, &msg) == kErrNonFinite, "NaN K must fail");
  CHECK(msg.find("non-finite K") != std::string::npos && msg.find("position 5") != std::string::npos, "msg: %s",
        msg.c_str());
  CHECK(c.codes == codes0, "nothing written on error");
  Case d = make_case(2, 1, 64, 16, 8, 4, true, true, 1, 0, 0.f, false, 0, {20});
  d.table[1] = -1;  // positions 16..19 have no block
  CHECK(run_case(d, out, &msg) == kErrSlot, "hole slot must fail: %s", msg.c_str());
  Case e = make_case(2, 1, 64, 16, 8, 4, true, true, 1, 0, 0.f, false, 0, {20});
  e.p.code_width = 10;
  CHECK(run_case(e, out, &msg) == kErrShape, "bad width must fail");
}

static void test_threads() {
  // enough work that the call runs on the thread pool (kParallelMinWork)
  Case base = make_case(8, 2, 64, 16, 8, 4, true, true, 1, 0, 0.f, true, 0, {160, 40, 3});
  set_num_threads(1);
  Case a = base;
  std::vector<float> oa, ob;
  run_case(a, oa);
  CHECK(last_call_pool() == CallPool::kCaller, "1 thread: no parallel region");
  set_num_threads(4);
  Case b = base;
  run_case(b, ob);
  CHECK(last_call_pool() == CallPool::kOwn, "4 threads: the core's own pool");
  set_num_threads(0);
  CHECK(oa == ob && a.codes == b.codes && a.stage == b.stage, "threads change the result");
}

// A host pool as a runtime would bring one: 3 threads of its own, items handed out from the end.
struct TestHost {
  int calls = 0;
  static void run(void* self, int n, void (*fn)(void*, int), void* arg) {
    static_cast<TestHost*>(self)->calls++;
    std::atomic<int> next{n - 1};
    auto work = [&] {
      for (int i; (i = next.fetch_sub(1)) >= 0;) fn(arg, i);
    };
    std::vector<std::thread> th;
    for (int t = 0; t < 3; ++t) th.emplace_back(work);
    for (auto& t : th) t.join();
  }
};

static void test_host_pool() {
  Case base = make_case(8, 2, 64, 16, 8, 4, true, true, 1, 0, 0.f, true, 0, {160, 40, 3});
  set_num_threads(1);
  Case a = base, b = base;
  std::vector<float> oa, ob;
  run_case(a, oa);
  TestHost host;
  HostPool hp;
  hp.run = TestHost::run;
  hp.ctx = &host;
  run_case(b, ob, nullptr, &hp);
  set_num_threads(0);
  CHECK(host.calls == 1 && last_call_pool() == CallPool::kHost, "the host pool ran %d parallel regions, want 1",
        host.calls);
  CHECK(last_call_threads() >= 1 && last_call_threads() <= 3, "last_call_threads %d", last_call_threads());
  CHECK(oa == ob && a.codes == b.codes && a.stage == b.stage, "a host pool changes the result");
  Case c = make_case(2, 1, 64, 16, 8, 4, true, true, 1, 0, 0.f, false, 0, {20});  // little work: no region
  std::vector<float> oc;
  run_case(c, oc, nullptr, &hp);
  CHECK(host.calls == 1 && last_call_threads() == 1 && last_call_pool() == CallPool::kCaller,
        "a short call must stay on the calling thread");
}

int main() {
  test_fp16();
  test_quant_roundtrip();
  test_attention_vs_naive();
  test_paths_agree();
  test_quant_paths_agree();
  test_nonfinite_query_paths_agree();
  test_negative_scales_paths_agree();
  test_mixed_tables();
  test_mixed_errors();
  test_errors();
  test_threads();
  test_host_pool();
  std::printf("active path: %s, threads %d\n", isa_name(active_isa()), num_threads());
  if (g_fail) {
    std::printf("%d FAILED\n", g_fail);
    return 1;
  }
  std::printf("all pagedkv core tests passed\n");
  return 0;
}
