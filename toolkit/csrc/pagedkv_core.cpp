// pagedkv kernel core: validation, Hadamard rotation, quantization and pool writes (bit exact with
// toolkit/quant.py; this file must be compiled WITHOUT -ffast-math and with -ffp-contract=off),
// the scalar attention path, code-path selection and the thread pool.
#include "pagedkv_core.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "pagedkv_attn_impl.h"
#include "pagedkv_internal.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

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

// ------------------------------------------------------------------------------------------------
// scalar attention path

namespace {
struct ScalarOps {
  static float dot(const float* a, const float* b, int n) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
      s0 += a[i] * b[i];
      s1 += a[i + 1] * b[i + 1];
      s2 += a[i + 2] * b[i + 2];
      s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; ++i) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
  }
  static void axpy(float* y, float a, const float* x, int n) {
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
  }
  static void scale(float* y, float a, int n) {
    for (int i = 0; i < n; ++i) y[i] *= a;
  }
  static void f16_to_f32(const uint16_t* h, float* out, int n) {
    for (int i = 0; i < n; ++i) out[i] = fp16_to_fp32(h[i]);
  }
  static void unpack4(const uint8_t* codes, int n, uint8_t* out) { unpack_codes(codes, 4, n, out); }
  static void dequant_u8(const uint8_t* u, const uint16_t* meta, int d, int group, bool sym, int bits, float* out) {
    const int ng = d / group;
    const float c = (float)(1 << (bits - 1));
    for (int g = 0; g < ng; ++g) {
      const float s = fp16_to_fp32(meta[g]);
      const int i0 = g * group, i1 = i0 + group;
      if (sym) {
        for (int i = i0; i < i1; ++i) out[i] = ((float)u[i] - c) * s;
      } else {
        const float z = fp16_to_fp32(meta[ng + g]);
        for (int i = i0; i < i1; ++i) out[i] = (float)u[i] * s + z;
      }
    }
  }
};
}  // namespace

void attend_scalar(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<ScalarOps> a(c, scratch);
  a(t, h);
}

// ------------------------------------------------------------------------------------------------
// code path selection

bool isa_available(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
#if defined(PAGEDKV_HAVE_AVX2)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
      return false;
#endif
    case Isa::kAvx512:
#if defined(PAGEDKV_HAVE_AVX512)
      return isa_available(Isa::kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
      return false;
#endif
    case Isa::kAvx512Vnni:
#if defined(PAGEDKV_HAVE_AVX512)
      return isa_available(Isa::kAvx512) && __builtin_cpu_supports("avx512vnni");
#else
      return false;
#endif
    case Isa::kNeon:
#if defined(PAGEDKV_HAVE_NEON)
      return true;
#else
      return false;
#endif
    case Isa::kNeonDot:
#if defined(PAGEDKV_HAVE_NEON) && defined(__linux__)
      return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
      return false;
#endif
  }
  return false;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Vnni: return "avx512-vnni";
    case Isa::kNeon: return "neon";
    case Isa::kNeonDot: return "neon-dotprod";
  }
  return "?";
}

static Isa best_isa() {
  const char* env = std::getenv("PAGEDKV_ISA");
  if (env) {
    for (Isa i : kAllIsas)
      if (std::strcmp(env, isa_name(i)) == 0 && isa_available(i)) return i;
  }
  for (Isa i : {Isa::kNeonDot, Isa::kNeon, Isa::kAvx512Vnni, Isa::kAvx512, Isa::kAvx2})
    if (isa_available(i)) return i;
  return Isa::kScalar;
}

static std::atomic<int> g_isa{-1};

Isa active_isa() {
  int v = g_isa.load();
  if (v < 0) {
    v = (int)best_isa();
    g_isa.store(v);
  }
  return (Isa)v;
}

bool set_isa(Isa isa) {
  if (!isa_available(isa)) return false;
  g_isa.store((int)(isa == Isa::kAuto ? best_isa() : isa));
  return true;
}

static AttendFn attend_fn(Isa isa) {
  switch (isa) {
#if defined(PAGEDKV_HAVE_AVX2)
    case Isa::kAvx2: return attend_avx2;
#endif
#if defined(PAGEDKV_HAVE_AVX512)
    case Isa::kAvx512: return attend_avx512;
    case Isa::kAvx512Vnni: return attend_avx512_vnni;
#endif
#if defined(PAGEDKV_HAVE_NEON)
    case Isa::kNeon: return attend_neon;
    case Isa::kNeonDot: return attend_neon_dot;
#endif
    default: return attend_scalar;
  }
}

// ------------------------------------------------------------------------------------------------
// a tiny persistent thread pool; the calling thread takes part

namespace {
thread_local std::vector<float> tl_scratch;

// n floats starting on a cache line
float* thread_scratch(size_t n) {
  if (tl_scratch.size() < n + kScratchAlignFloats) tl_scratch.resize(n + kScratchAlignFloats);
  const uintptr_t a = reinterpret_cast<uintptr_t>(tl_scratch.data()), line = 4 * kScratchAlignFloats;
  return reinterpret_cast<float*>((a + line - 1) / line * line);
}

// how long the caller of a parallel region spins for the workers before it sleeps
constexpr std::chrono::microseconds kCallerSpin{500};
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

class ThreadPool {
 public:
  ~ThreadPool() { resize(0); }

  void resize(int workers) {
    {
      std::unique_lock<std::mutex> lk(m_);
      stop_ = true;
      cv_.notify_all();
    }
    for (auto& th : threads_) th.join();
    threads_.clear();
    stop_ = false;
    const uint64_t g = gen_;
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this, g] { loop(g); });
  }
  int workers() const { return (int)threads_.size(); }

  // Calls fn(i) for i in [0, n) on the workers and the caller; returns when all are done.
  void run(int n, const std::function<void(int)>& fn) {
    if (threads_.empty() || n <= 1) {
      for (int i = 0; i < n; ++i) fn(i);
      return;
    }
    {
      std::unique_lock<std::mutex> lk(m_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      busy_ = (int)threads_.size();
      ++gen_;
    }
    cv_.notify_all();  // after unlocking: a woken worker need not wait for the mutex
    work();
    // The workers finish their last items (or have yet to wake up): wait for them on this core, which
    // has nothing else to do, for a while before sleeping; a sleeping caller is woken tens of
    // microseconds after the last worker is done.
    const auto spin_end = std::chrono::steady_clock::now() + kCallerSpin;
    while (busy_.load(std::memory_order_acquire) > 0 && std::chrono::steady_clock::now() < spin_end) cpu_relax();
    std::unique_lock<std::mutex> lk(m_);
    done_cv_.wait(lk, [this] { return busy_.load() == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (;;) {
      const int i = next_.fetch_add(1);
      if (i >= n_) break;
      (*fn_)(i);
    }
  }
  void loop(uint64_t seen) {
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || gen_ != seen; });
        if (stop_) return;
        seen = gen_;
      }
      work();
      std::unique_lock<std::mutex> lk(m_);
      if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_cv_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> busy_{0};
  uint64_t gen_ = 0;
  bool stop_ = false;
};

std::mutex g_pool_mutex;  // one parallel region at a time (hosts may call from several threads)
std::atomic<int> g_threads{0};
std::atomic<int> g_last_call_threads{0};  // see last_call_threads()
std::atomic<int> g_last_call_pool{0};     // see last_call_pool()
std::atomic<int> g_next_thread_slot{0};

// a small id per thread that ever ran attention items (for last_call_threads; slots repeat after 64)
int thread_slot() {
  thread_local const int slot = g_next_thread_slot.fetch_add(1) & 63;
  return slot;
}

ThreadPool& pool() {
  static ThreadPool* p = new ThreadPool();  // leaked on purpose: no join at static destruction
  return *p;
}

int default_threads() {
  if (const char* env = std::getenv("PAGEDKV_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc ? (int)hc : 1;
}
}  // namespace

void set_num_threads(int n) { g_threads.store(n > 0 ? n : 0); }

int last_call_threads() { return g_last_call_threads.load(); }

CallPool last_call_pool() { return (CallPool)g_last_call_pool.load(); }

int num_threads() {
  const int n = g_threads.load();
  return n > 0 ? n : default_threads();
}

// ------------------------------------------------------------------------------------------------
// the op

namespace {
void set_err(char* err, size_t len, const char* fmt, ...) {
  if (!err || len == 0) return;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(err, len, fmt, ap);
  va_end(ap);
}

bool all_finite(const float* x, int n) {
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

// Split-K: at least kSplitItems (token, KV head, part) items, parts of at least 16 blocks. Each part
// repeats the per-item set-up (the prepared query, the state, a cold first run, the merge): with 33
// items instead of 12 the 16K step at SmolLM2 dims (3 KV heads) measured 3% slower with 1 thread and 9%
// with 2 (core bench). 12 parts share out evenly over 2, 3, 4 or 6 threads.
constexpr int64_t kSplitItems = 12;
constexpr int64_t kSplitMinBlocks = 16;
// Waking the pool's threads costs tens of microseconds: a call whose attention work (visible keys x
// KV heads x (query heads per KV head + 1) x head_dim) is below this runs on the calling thread
// (measured on the 2-core dev VM: 2 threads were slower up to ~1K cached tokens at SmolLM2 dims).
constexpr int64_t kParallelMinWork = int64_t(3) << 19;

struct CallScratch {
  std::vector<float> qrot, krot, vrot, partial;
  std::vector<uint16_t> k16, v16;
  std::vector<int32_t> n_prev, count;
  std::vector<int64_t> last_pos;
};
thread_local CallScratch tl_call;
}  // namespace

void record_widths(const PagedAttnParams& p, int* code_width, int* scale_width) {
  if (p.float_pool) {
    *code_width = 2 * p.D;
    *scale_width = 0;
    return;
  }
  const int kg = p.k_group ? p.k_group : p.D, vg = p.v_group ? p.v_group : p.D;
  *code_width = p.D * p.k_bits / 8 + p.D * p.v_bits / 8;
  *scale_width = (kg > 0 ? p.D / kg : 0) * (p.k_sym ? 1 : 2) + (vg > 0 ? p.D / vg : 0) * (p.v_sym ? 1 : 2);
}

int paged_attention(const PagedAttnParams& P, const PagedAttnBuffers& B, char* err, size_t err_len,
                    const HostPool* host) {
  const int T = P.T, Hq = P.Hq, Hkv = P.Hkv, D = P.D, bs = P.block_size, M = P.max_blocks_per_seq;
  if (T < 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || bs <= 0 || P.num_blocks <= 0 || M <= 0 || P.table_rows <= 0) {
    set_err(err, err_len, "pagedkv: bad shapes (T=%d Hq=%d Hkv=%d D=%d block_size=%d num_blocks=%d M=%d rows=%d)",
            T, Hq, Hkv, D, bs, P.num_blocks, M, P.table_rows);
    return kErrShape;
  }
  if (Hq % Hkv) {
    set_err(err, err_len, "pagedkv: %d query heads is not a multiple of %d KV heads", Hq, Hkv);
    return kErrShape;
  }
  const bool quantized = !P.float_pool;
  const int kg = P.k_group ? P.k_group : D, vg = P.v_group ? P.v_group : D;
  if (quantized) {
    for (int bits : {P.k_bits, P.v_bits})
      if (bits < 2 || bits > 8 || (D * bits) % 8) {
        set_err(err, err_len, "pagedkv: unsupported bits %d for head_dim %d (use 2..8 with whole bytes)", bits, D);
        return kErrShape;
      }
    if (kg <= 0 || vg <= 0 || D % kg || D % vg) {
      set_err(err, err_len, "pagedkv: group sizes k=%d v=%d must divide head_dim %d", P.k_group, P.v_group, D);
      return kErrShape;
    }
    if (P.rotate && (D & (D - 1))) {
      set_err(err, err_len, "pagedkv: rotate needs a power-of-two head_dim, got %d", D);
      return kErrShape;
    }
    if (P.sink_blocks != 0 && P.sink_blocks != 1) {
      set_err(err, err_len, "pagedkv: sink_blocks=%d (use 0 or 1)", P.sink_blocks);
      return kErrShape;
    }
  } else if (P.float_bits != 16 && P.float_bits != 32) {
    set_err(err, err_len, "pagedkv: float pool must be float16 or float32");
    return kErrShape;
  }
  int cw, sw;
  record_widths(P, &cw, &sw);
  if (P.code_width != cw || (quantized && P.scale_width != sw)) {
    set_err(err, err_len,
            "pagedkv: pool record widths (codes %d, scales %d) do not match the spec and head_dim %d "
            "(expected codes %d, scales %d): the pool was allocated for another KV spec",
            P.code_width, P.scale_width, D, cw, sw);
    return kErrShape;
  }
  const bool use_sink = quantized && P.sink_blocks > 0;
  const bool use_tail = quantized && P.fp_tail;
  const bool rotate = quantized && P.rotate;
  if ((use_sink || use_tail) && (P.stage_rows <= 0 || !B.stage)) {
    set_err(err, err_len, "pagedkv: the spec keeps float sink/tail blocks but the stage tensor is empty");
    return kErrShape;
  }
  if (T == 0) return kOk;

  // ---- validate slots and block tables (nothing written yet)
  for (int t = 0; t < T; ++t) {
    const int64_t s = B.seq_ids[t], p = B.positions[t];
    if (s < 0 || s >= P.table_rows || ((use_sink || use_tail) && s >= P.stage_rows)) {
      set_err(err, err_len, "pagedkv: layer %d: sequence slot %lld out of range (block table rows %d, stage rows %d)",
              P.layer, (long long)s, P.table_rows, (use_sink || use_tail) ? P.stage_rows : P.table_rows);
      return kErrSlot;
    }
    if (p < 0 || p / bs >= M) {
      set_err(err, err_len,
              "pagedkv: layer %d: position %lld of sequence %lld does not fit the block table (%d blocks of %d)",
              P.layer, (long long)p, (long long)s, M, bs);
      return kErrSlot;
    }
    const int64_t* row = B.block_tables + s * M;
    const int64_t blk = row[p / bs];
    if (blk < 0 || blk >= P.num_blocks) {
      set_err(err, err_len,
              "pagedkv: layer %d: sequence %lld position %lld has no valid block (block id %lld, pool has %d "
              "blocks): allocate the block before writing to it",
              P.layer, (long long)s, (long long)p, (long long)blk, P.num_blocks);
      return kErrSlot;
    }
    for (int64_t b = 0; b < p / bs; ++b)
      if (row[b] < -1 || row[b] >= P.num_blocks) {
        set_err(err, err_len, "pagedkv: layer %d: block table of sequence %lld holds block id %lld (pool has %d blocks)",
                P.layer, (long long)s, (long long)row[b], P.num_blocks);
        return kErrSlot;
      }
  }
  // ---- non-finite K/V (K first, like the reference)
  for (int which = 0; which < 2; ++which) {
    const float* x = which ? B.v : B.k;
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < Hkv; ++h)
        if (!all_finite(x + ((size_t)h * T + t) * D, D)) {
          set_err(err, err_len,
                  "non-finite %s (NaN or Inf) at layer %d, sequence %lld, position %lld: the model produced it "
                  "before the cache; nothing was written to the pool. Check the weights/dtype (fp16 overflow?) "
                  "or the input ids.",
                  which ? "V" : "K", P.layer, (long long)B.seq_ids[t], (long long)B.positions[t]);
          return kErrNonFinite;
        }
  }

  // ---- rotate (token-major copies)
  CallScratch& cs = tl_call;
  const size_t nq = (size_t)T * Hq * D, nk = (size_t)T * Hkv * D;
  if (cs.qrot.size() < nq) cs.qrot.resize(nq);
  if (cs.krot.size() < nk) cs.krot.resize(nk), cs.vrot.resize(nk);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < Hq; ++h) {
      float* dst = cs.qrot.data() + ((size_t)t * Hq + h) * D;
      std::memcpy(dst, B.q + ((size_t)h * T + t) * D, sizeof(float) * D);
      if (rotate) hadamard(dst, D);
    }
    for (int h = 0; h < Hkv; ++h) {
      float* kd = cs.krot.data() + ((size_t)t * Hkv + h) * D;
      float* vd = cs.vrot.data() + ((size_t)t * Hkv + h) * D;
      std::memcpy(kd, B.k + ((size_t)h * T + t) * D, sizeof(float) * D);
      std::memcpy(vd, B.v + ((size_t)h * T + t) * D, sizeof(float) * D);
      if (rotate) hadamard(kd, D), hadamard(vd, D);
    }
  }

  // ---- 1. write the records
  const size_t W = (size_t)P.code_width, Ws = (size_t)P.scale_width;
  const int kcb = quantized ? D * P.k_bits / 8 : D;
  const int ksc = quantized ? (D / kg) * (P.k_sym ? 1 : 2) : 0;
  for (int t = 0; t < T; ++t) {
    const int64_t s = B.seq_ids[t], p = B.positions[t];
    const int64_t blk = B.block_tables[s * M + p / bs];
    for (int h = 0; h < Hkv; ++h) {
      const size_t rec = ((size_t)blk * Hkv + h) * bs + (size_t)(p % bs);
      const float* kx = cs.krot.data() + ((size_t)t * Hkv + h) * D;
      const float* vx = cs.vrot.data() + ((size_t)t * Hkv + h) * D;
      if (quantized) {
        uint8_t* codes = static_cast<uint8_t*>(B.codes) + rec * W;
        uint16_t* meta = B.scales + rec * Ws;
        quantize_record(kx, D, P.k_bits, kg, P.k_sym, codes, meta);
        quantize_record(vx, D, P.v_bits, vg, P.v_sym, codes + kcb, meta + ksc);
      } else if (P.float_bits == 16) {
        uint16_t* codes = static_cast<uint16_t*>(B.codes) + rec * W;
        for (int d = 0; d < D; ++d) codes[d] = fp32_to_fp16(kx[d]), codes[D + d] = fp32_to_fp16(vx[d]);
      } else {
        float* codes = static_cast<float*>(B.codes) + rec * W;
        std::memcpy(codes, kx, sizeof(float) * D);
        std::memcpy(codes + D, vx, sizeof(float) * D);
      }
    }
  }

  // ---- fp16 copies, 2. sink stage, in-call bookkeeping
  const size_t stage_head = (size_t)bs * D, stage_kv = (size_t)Hkv * stage_head;
  if (use_sink || use_tail) {
    if (cs.k16.size() < nk) cs.k16.resize(nk), cs.v16.resize(nk);
    for (size_t i = 0; i < nk; ++i) cs.k16[i] = fp32_to_fp16(cs.krot[i]), cs.v16[i] = fp32_to_fp16(cs.vrot[i]);
  }
  if (use_sink) {
    for (int t = 0; t < T; ++t) {
      const int64_t s = B.seq_ids[t], p = B.positions[t];
      if (p >= bs) continue;
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < Hkv; ++h)
          std::memcpy(B.stage + (size_t)s * 4 * stage_kv + kv * stage_kv + h * stage_head + (size_t)p * D,
                      (kv ? cs.v16 : cs.k16).data() + ((size_t)t * Hkv + h) * D, sizeof(uint16_t) * D);
    }
  }
  if (cs.n_prev.size() < (size_t)T) cs.n_prev.resize(T);
  if (cs.count.size() < (size_t)P.table_rows) cs.count.resize(P.table_rows), cs.last_pos.resize(P.table_rows);
  std::fill(cs.count.begin(), cs.count.begin() + P.table_rows, 0);
  std::fill(cs.last_pos.begin(), cs.last_pos.begin() + P.table_rows, (int64_t)-1);
  for (int t = 0; t < T; ++t) {
    const int64_t s = B.seq_ids[t];
    cs.n_prev[t] = cs.count[s]++;
    cs.last_pos[s] = std::max(cs.last_pos[s], B.positions[t]);
  }

  // ---- 3. attention, split over (token, kv head)
  AttnContext ctx;
  ctx.p = &P;
  ctx.b = &B;
  ctx.qrot = cs.qrot.data();
  ctx.k16 = use_tail ? cs.k16.data() : nullptr;
  ctx.v16 = use_tail ? cs.v16.data() : nullptr;
  ctx.n_prev = cs.n_prev.data();
  ctx.G = Hq / Hkv;
  ctx.k_group = kg;
  ctx.v_group = vg;
  ctx.kcb = kcb;
  ctx.ksc = ksc;
  ctx.quantized = quantized;
  ctx.use_sink = use_sink;
  ctx.use_tail = use_tail;
  ctx.rotate = rotate;
  const AttendFn fn = attend_fn(active_isa());
  const size_t scratch_n = attn_scratch_floats(ctx);
  // Split-K: with few (token, KV head) items (decode), cut each item's visible blocks into parts so
  // that several threads share one long sequence; the parts are merged afterwards. The split depends
  // only on the shapes (never on the thread count), so results do not change with the threads.
  int split = 1;
  if (T * Hkv < kSplitItems) {
    int64_t max_blocks = 0;
    for (int t = 0; t < T; ++t) {
      const int64_t p = B.positions[t];
      const int64_t lo = P.window > 0 ? std::max<int64_t>(0, p - P.window + 1) : 0;
      max_blocks = std::max(max_blocks, p / bs - lo / bs + 1);
    }
    const int64_t want = (kSplitItems + T * Hkv - 1) / (T * Hkv);
    split = (int)std::max<int64_t>(1, std::min<int64_t>(want, max_blocks / kSplitMinBlocks));
  }
  ctx.split = split;
  if (split > 1) {
    const size_t n = (size_t)T * Hkv * split * ctx.partial_stride();
    if (cs.partial.size() < n) cs.partial.resize(n);
    ctx.partial = cs.partial.data();
  }
  const int items = T * Hkv * split;
  std::atomic<uint64_t> ran_on{0};  // the thread slots that ran items of this call
  const std::function<void(int)> task = [&](int i) {
    ran_on.fetch_or(uint64_t(1) << thread_slot(), std::memory_order_relaxed);
    if (split == 1) {
      fn(ctx, i / Hkv, i % Hkv, thread_scratch(scratch_n));
    } else {
      AttnContext c = ctx;
      c.part = i % split;
      const int th = i / split;
      fn(c, th / Hkv, th % Hkv, thread_scratch(scratch_n));
    }
  };
  int64_t work = 0;
  for (int t = 0; t < T; ++t) {
    const int64_t p = B.positions[t];
    work += P.window > 0 ? std::min<int64_t>(p + 1, P.window) : p + 1;
  }
  work *= (int64_t)Hkv * (ctx.G + 1) * D;
  // little work runs on the calling thread; the split above does not depend on the threads, so
  // neither does the result
  const bool parallel = work >= kParallelMinWork && items > 1;
  CallPool ran_in = CallPool::kCaller;
  if (host && host->run) {  // the host's threads
    if (parallel) {
      ran_in = CallPool::kHost;
      host->run(host->ctx, items, [](void* f, int i) { (*static_cast<const std::function<void(int)>*>(f))(i); },
                const_cast<void*>(static_cast<const void*>(&task)));
    } else {
      for (int i = 0; i < items; ++i) task(i);
    }
  } else {
    std::lock_guard<std::mutex> lk(g_pool_mutex);
    const int want = parallel ? std::min(num_threads(), items) - 1 : 0;
    const int nthreads = std::max(0, std::min(num_threads() - 1, 64));
    if (pool().workers() != nthreads) pool().resize(nthreads);
    if (want <= 0) {
      for (int i = 0; i < items; ++i) task(i);
    } else {
      ran_in = CallPool::kOwn;
      pool().run(items, task);
    }
  }
  g_last_call_threads.store(__builtin_popcountll(ran_on.load()));
  g_last_call_pool.store((int)ran_in);
  if (split > 1) {  // merge the parts (part = -1)
    float* scratch = thread_scratch(scratch_n);
    for (int i = 0; i < T * Hkv; ++i) fn(ctx, i / Hkv, i % Hkv, scratch);
  }

  // ---- 4. tail stage: the tokens in each sequence's last block of this call
  if (use_tail) {
    for (int t = 0; t < T; ++t) {
      const int64_t s = B.seq_ids[t], p = B.positions[t];
      if (p / bs != cs.last_pos[s] / bs) continue;
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < Hkv; ++h)
          std::memcpy(B.stage + ((size_t)s * 4 + 2) * stage_kv + kv * stage_kv + h * stage_head + (size_t)(p % bs) * D,
                      (kv ? cs.v16 : cs.k16).data() + ((size_t)t * Hkv + h) * D, sizeof(uint16_t) * D);
    }
  }
  return kOk;
}

}  // namespace pagedkv

extern "C" {
int pagedkv_set_isa(int isa) { return pagedkv::set_isa((pagedkv::Isa)isa) ? 1 : 0; }
int pagedkv_active_isa(void) { return (int)pagedkv::active_isa(); }
void pagedkv_set_num_threads(int n) { pagedkv::set_num_threads(n); }
int pagedkv_num_threads(void) { return pagedkv::num_threads(); }
int pagedkv_last_call_threads(void) { return pagedkv::last_call_threads(); }
int pagedkv_last_call_pool(void) { return (int)pagedkv::last_call_pool(); }
}
