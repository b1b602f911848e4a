// The core's threads: a tiny persistent thread pool (the calling thread takes part), the per-thread
// scratch of attend calls, and run_items, which runs one call's work items on the host's pool, the
// core's own pool or the calling thread.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "pagedkv_core.h"
#include "pagedkv_internal.h"

namespace pagedkv {

namespace {
thread_local std::vector<float> tl_scratch;
}  // namespace

float* thread_scratch(size_t n) {
  if (tl_scratch.size() < n + kScratchAlignFloats) tl_scratch.resize(n + kScratchAlignFloats);
  const uintptr_t a = reinterpret_cast<uintptr_t>(tl_scratch.data()), line = 4 * kScratchAlignFloats;
  return reinterpret_cast<float*>((a + line - 1) / line * line);
}

namespace {

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

void run_items(int items, bool parallel, const HostPool* host, const std::function<void(int)>& fn) {
  std::atomic<uint64_t> ran_on{0};  // the thread slots that ran items of this call
  const std::function<void(int)> task = [&](int i) {
    ran_on.fetch_or(uint64_t(1) << thread_slot(), std::memory_order_relaxed);
    fn(i);
  };
  parallel = parallel && items > 1;
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
}

}  // namespace pagedkv
