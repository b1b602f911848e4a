// Micro-benchmark of the core alone (no host): one decode step (T = 1, one sequence, the new token at
// position ctx) over `ctx` cached tokens with the default spec (K8 sym g64 / V4 asym g32, Hadamard, fp16
// sink and tail; BENCH_SPEC another), per code path. The pool holds random codes and scales in shuffled blocks (the cost does
// not depend on the values). benchmarks/kernels.py runs it next to the hosts and the peers:
//   pagedkv_core_bench [ctx=16384] [Hq=9] [Hkv=3] [D=64] [threads=1] [reps=200] [path: avx2|avx512|...]
//   pagedkv_core_bench --paths      the code paths available on this CPU
// Env: BENCH_SEQUENTIAL=1 blocks in order; BENCH_HOT_BLOCKS=n the table cycles over n blocks (with n = 8
// the pool stays in L1/L2: the step without cache misses). BENCH_WALK=1: no attention, the memory floor of
// the step: the same pool bytes read in the kernel's order (per KV head, the table's blocks: their records'
// codes and scales) with plain loads and no arithmetic on them, split evenly over the threads.
// BENCH_POOL_OFFSET=n: the codes start n bytes past a cache line (default 0, as the runtimes allocate
// them; numpy's own large arrays start 16 bytes past one). BENCH_COLD_MIB=n: before every timed call
// (attention or walk) the bench threads read an n MiB buffer (untimed; use more than twice the
// last-level cache), so the pool comes from memory as in a model whose weights and other layers pass
// through the caches between two calls of one layer; without it the pool of repeated calls stays in
// the last-level cache when it fits.
// "bytes" = what the step reads from the KV cache: codes + fp16 scales of the quantized keys, fp16 rows
// of the sink block and of the tail (same count as benchmarks/kernels.py).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "pagedkv_core.h"

using namespace pagedkv;

namespace {

// Sum of the 8-byte words of n bytes (n a multiple of 32), four independent sums (memcpy: plain loads)
inline uint64_t word(const char* c) {
  uint64_t w;
  std::memcpy(&w, c, 8);
  return w;
}
uint64_t read_words(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  uint64_t a = 0, b = 0, d = 0, e = 0;
  for (size_t i = 0; i < n; i += 32) a += word(c + i), b += word(c + i + 8), d += word(c + i + 16), e += word(c + i + 24);
  return a + b + d + e;
}

// BENCH_WALK: for the items [i0, i1) of the (KV head, block) walk, read each block's records for the head
uint64_t walk_items(const PagedAttnParams& p, const uint8_t* codes, const uint16_t* scales, const int64_t* table,
                    int nblk, int64_t i0, int64_t i1) {
  const size_t bs = p.block_size, W = p.code_width, Ws = p.scale_width;
  uint64_t sum = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const int h = (int)(i / nblk);
    const size_t rec0 = ((size_t)table[i % nblk] * p.Hkv + h) * bs;
    sum += read_words(codes + rec0 * W, bs * W);
    sum += read_words(scales + rec0 * Ws, bs * Ws * 2);
  }
  return sum;
}

// A helper thread for the walk with 2+ threads: spins on a generation counter (bench only)
struct WalkPool {
  std::vector<std::thread> th;
  std::atomic<int> gen{0}, done{0};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> sink{0};
  WalkPool(int n, const std::function<uint64_t(int)>& part) {
    for (int t = 1; t < n; ++t)
      th.emplace_back([this, t, part] {
        int seen = 0;
        for (;;) {
          while (gen.load(std::memory_order_acquire) == seen && !stop.load()) {
          }
          if (stop.load()) return;
          seen = gen.load();
          sink.fetch_add(part(t));
          done.fetch_add(1, std::memory_order_release);
        }
      });
  }
  uint64_t run(const std::function<uint64_t(int)>& part) {
    done.store(0);
    gen.fetch_add(1, std::memory_order_release);
    const uint64_t s = part(0);
    while (done.load(std::memory_order_acquire) < (int)th.size()) {
    }
    return s;
  }
  ~WalkPool() {
    stop.store(true);
    for (auto& t : th) t.join();
  }
};

// BENCH_COLD_MIB: evicts the pool from the caches of every bench thread (see the top)
struct Evictor {
  std::vector<uint8_t> buf;
  int threads = 1;
  std::atomic<uint64_t> sink{0};
  explicit Evictor(int n) : threads(n) {
    if (const char* e = std::getenv("BENCH_COLD_MIB")) buf.assign((size_t)std::max(0, std::atoi(e)) << 20, 1);
  }
  void read(size_t lo, size_t hi) {
    uint64_t s = 0;
    for (size_t i = lo; i < hi; i += 64) s += buf[i];
    sink.fetch_add(s);
  }
  void operator()() {  // each thread reads its share, so every core's private caches are refilled too
    if (buf.empty()) return;
    std::vector<std::thread> th;
    const size_t n = buf.size();
    for (int t = 1; t < threads; ++t) th.emplace_back([this, n, t] { read(n * t / threads, n * (t + 1) / threads); });
    read(0, n / threads);
    for (auto& x : th) x.join();
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--paths") == 0) {
    for (Isa isa : kAllIsas)
      if (isa_available(isa)) std::printf("%s\n", isa_name(isa));
    return 0;
  }
  const int ctx = argc > 1 ? std::atoi(argv[1]) : 16384;
  const int Hq = argc > 2 ? std::atoi(argv[2]) : 9;
  const int Hkv = argc > 3 ? std::atoi(argv[3]) : 3;
  const int D = argc > 4 ? std::atoi(argv[4]) : 64;
  const int threads = argc > 5 ? std::atoi(argv[5]) : 1;
  const int reps = argc > 6 ? std::atoi(argv[6]) : 200;
  const char* only = argc > 7 ? argv[7] : nullptr;
  const int bs = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);

  PagedAttnParams p;
  p.T = 1, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.block_size = bs;
  p.k_bits = 8, p.v_bits = 4, p.k_group = 64, p.v_group = 32, p.k_sym = true, p.v_sym = false;
  p.rotate = true, p.fp_tail = true, p.sink_blocks = 1, p.scale = 1.f / std::sqrt((float)D);
  // BENCH_SPEC=k_bits,v_bits,k_group,v_group,k_sym,v_sym: another quantized spec (e.g. Gemma's "best":
  // 7,5,64,32,1,0)
  if (const char* e = std::getenv("BENCH_SPEC")) {
    int kb, vb, kg, vg, ks, vs;
    if (std::sscanf(e, "%d,%d,%d,%d,%d,%d", &kb, &vb, &kg, &vg, &ks, &vs) != 6) {
      std::printf("error: BENCH_SPEC wants k_bits,v_bits,k_group,v_group,k_sym,v_sym\n");
      return 2;
    }
    p.k_bits = kb, p.v_bits = vb, p.k_group = kg, p.v_group = vg, p.k_sym = ks != 0, p.v_sym = vs != 0;
  }
  const int M = (ctx + 1 + bs - 1) / bs;
  p.num_blocks = M, p.stage_rows = 1, p.table_rows = 1, p.max_blocks_per_seq = M;
  record_widths(p, &p.code_width, &p.scale_width);

  const size_t pool_off = std::getenv("BENCH_POOL_OFFSET") ? (size_t)std::atoi(std::getenv("BENCH_POOL_OFFSET")) % 64 : 0;
  const size_t ncodes = (size_t)M * Hkv * bs * p.code_width;
  std::vector<uint8_t> codes_buf(ncodes + 128);
  uint8_t* const codes = reinterpret_cast<uint8_t*>(((uintptr_t)codes_buf.data() + 63) & ~(uintptr_t)63) + pool_off;
  std::vector<uint16_t> scales((size_t)M * Hkv * bs * p.scale_width), stage((size_t)4 * Hkv * bs * D);
  for (size_t i = 0; i < ncodes; ++i) codes[i] = (uint8_t)rng();
  for (auto& s : scales) s = fp32_to_fp16(0.01f + 0.01f * std::fabs(nd(rng)));
  for (auto& s : stage) s = fp32_to_fp16(nd(rng));
  std::vector<int64_t> table(M);
  for (int i = 0; i < M; ++i) table[i] = i;
  if (!std::getenv("BENCH_SEQUENTIAL")) std::shuffle(table.begin(), table.end(), rng);
  // BENCH_HOT_BLOCKS=n: the table cycles over n blocks (a cache-resident pool: the cost without misses)
  if (const char* hot = std::getenv("BENCH_HOT_BLOCKS"))
    for (int i = 0; i < M; ++i) table[i] = i % std::max(1, std::atoi(hot));
  std::vector<float> q((size_t)Hq * D), k((size_t)Hkv * D), v((size_t)Hkv * D), out((size_t)Hq * D);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  const int64_t pos = ctx, seq = 0;

  PagedAttnBuffers b;
  b.q = q.data(), b.k = k.data(), b.v = v.data(), b.codes = codes, b.scales = scales.data();
  b.stage = stage.data(), b.positions = &pos, b.seq_ids = &seq, b.block_tables = table.data(), b.out = out.data();
  const int64_t keys = ctx + 1, tail = keys % bs ? keys % bs : bs, fp16 = bs + tail;
  const int64_t bytes = Hkv * ((keys - fp16) * (p.code_width + 2 * (int64_t)p.scale_width) + fp16 * 2 * 2 * D);
  set_num_threads(threads);
  if (std::getenv("BENCH_WALK")) {
    const int64_t items = (int64_t)Hkv * M;
    const auto part = [&](int t) {
      return walk_items(p, codes, scales.data(), table.data(), M, items * t / threads, items * (t + 1) / threads);
    };
    WalkPool wp(threads, part);
    uint64_t sum = 0;
    std::vector<double> ts;
    Evictor evict(threads);
    for (int i = 0; i < reps + 5; ++i) {
      evict();
      const auto t0 = std::chrono::steady_clock::now();
      sum += wp.run(part);
      if (i >= 5) ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    const double ms = ts[ts.size() / 2];
    std::printf("%-13s ctx %6d Hq %2d Hkv %d D %3d threads %d: %8.4f ms  %6.2f GB/s  (checksum %llu)  bytes %lld\n",
                "walk", ctx, Hq, Hkv, D, threads, ms, bytes / ms / 1e6, (unsigned long long)(sum + wp.sink.load()) % 997,
                (long long)bytes);
    return 0;
  }
  std::vector<float> ref;
  for (Isa isa : kAllIsas) {
    if (!isa_available(isa) || (only ? std::strcmp(only, isa_name(isa)) != 0 : isa == Isa::kScalar && ctx > 4096))
      continue;
    set_isa(isa);
    char err[256];
    for (int i = 0; i < 5; ++i)
      if (paged_attention(p, b, err, sizeof err) != kOk) {
        std::printf("error: %s\n", err);
        return 1;
      }
    std::vector<double> ts;
    Evictor evict(threads);
    for (int i = 0; i < reps; ++i) {
      evict();
      const auto t0 = std::chrono::steady_clock::now();
      paged_attention(p, b, err, sizeof err);
      ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    const double ms = ts[ts.size() / 2];
    float diff = 0.f;
    if (ref.empty()) ref = out;
    for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, std::fabs(out[i] - ref[i]));
    std::printf("%-13s ctx %6d Hq %2d Hkv %d D %3d threads %d: %8.4f ms  %6.2f GB/s  max|diff| %.2e  bytes %lld\n",
                isa_name(isa), ctx, Hq, Hkv, D, threads, ms, bytes / ms / 1e6, diff, (long long)bytes);
  }
  return 0;
}
