// mapped_pages (src/mapped_pages.h) on a real file: release() unmaps the resident pages of the file's
// read-only mappings and nothing else, the data reads back the same, PAGEDKV_KEEP_MAPPED_PAGES=1 turns
// it off; release() keeps the ranges it found and reads /proc/self/maps again only when one of them
// changed (unmapped, an anonymous mapping in its place: never advised; the file mapped elsewhere: found).
// Built and run by tests/test_mapped_pages.py (plain g++, no ExecuTorch).
//
//   mapped_pages_test DIR [--bench EXTRA_MAPPINGS CALLS]
// --bench: after the checks, the microseconds per release() (kept ranges checked) against one read of
// /proc/self/maps (what each release() cost before), with EXTRA_MAPPINGS more file mappings in the process.
#include "mapped_pages.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>

using pagedkv_rt::MappedPages;
using pagedkv_rt::read_only_mappings;

static int failures = 0;
#define CHECK(c)                                                      \
  do {                                                                \
    if (!(c)) {                                                       \
      std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #c); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

// Rss in bytes of the mapping that starts at p (/proc/self/smaps)
static long long rss_of(const void* p) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool in = false;
  while (std::getline(f, line)) {
    unsigned long long a = 0, b = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &a, &b) == 2 && line.find(' ') > line.find('-')) {
      in = a == reinterpret_cast<unsigned long long>(p);
    } else if (in && line.rfind("Rss:", 0) == 0) {
      return std::atoll(line.c_str() + 4) * 1024;
    }
  }
  return -1;
}

static unsigned char pattern(size_t i) { return static_cast<unsigned char>((i * 7 + i / 4096) & 0xff); }

static bool same_as_file(const unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; i += 997)
    if (p[i] != pattern(i)) return false;
  return true;
}

int main(int argc, char** argv) {
  const bool bench = argc == 5 && std::strcmp(argv[2], "--bench") == 0;
  if (argc != 2 && !bench) {
    std::fprintf(stderr, "usage: mapped_pages_test DIR [--bench EXTRA_MAPPINGS CALLS]\n");
    return 2;
  }
  const std::string path = std::string(argv[1]) + "/program.bin";
  const size_t n = 4 << 20;
  {
    std::string data(n, '\0');
    for (size_t i = 0; i < n; ++i) data[i] = static_cast<char>(pattern(i));
    std::ofstream(path, std::ios::binary).write(data.data(), static_cast<std::streamsize>(n));
    const int fd = open(path.c_str(), O_RDONLY);
    fsync(fd);  // clean pages, as a .pte that was written long before
    close(fd);
  }
  const int fd = open(path.c_str(), O_RDONLY);
  auto* ro = static_cast<unsigned char*>(mmap(nullptr, n, PROT_READ, MAP_PRIVATE, fd, 0));
  // a shared read-only mapping of its second MiB (how ExecuTorch's MmapDataLoader maps the .pte)
  auto* ros = static_cast<unsigned char*>(mmap(nullptr, 1 << 20, PROT_READ, MAP_SHARED, fd, 1 << 20));
  // a private writable mapping of the same file holding a written page: never advised
  auto* rw = static_cast<unsigned char*>(mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0));
  close(fd);
  CHECK(ro != MAP_FAILED && ros != MAP_FAILED && rw != MAP_FAILED);
  rw[0] = 0xAB;
  volatile unsigned sum = 0;
  for (size_t i = 0; i < n; i += 4096) sum += ro[i];
  for (size_t i = 0; i < (1 << 20); i += 4096) sum += ros[i];
  CHECK(rss_of(ro) == static_cast<long long>(n));
  CHECK(rss_of(ros) == 1 << 20);

  auto maps = read_only_mappings(path);
  CHECK(maps.size() == 2);  // ro and ros, not rw
  for (const auto& m : maps) {
    const bool is_ro = m.start == reinterpret_cast<uintptr_t>(ro);
    CHECK(is_ro || m.start == reinterpret_cast<uintptr_t>(ros));
    CHECK(m.end - m.start == (is_ro ? n : size_t{1} << 20));
    CHECK(m.offset == (is_ro ? 0u : 1u << 20));
  }
  CHECK(read_only_mappings(path + ".missing").empty());

  unsetenv("PAGEDKV_KEEP_MAPPED_PAGES");
  MappedPages mp(path);
  CHECK(mp.enabled());
  CHECK(mp.release() == static_cast<long long>(n + (1 << 20)));
  CHECK(rss_of(ro) == 0);       // unmapped from this process
  CHECK(rss_of(ros) == 0);
  for (size_t i = 0; i < (1 << 20); i += 4093) CHECK(ros[i] == pattern(i + (1 << 20)));  // read again
  CHECK(same_as_file(ro, n));   // and read again from the file on demand
  CHECK(rss_of(ro) > 0);
  CHECK(rw[0] == 0xAB);         // the written private page is untouched
  CHECK(rss_of(rw) > 0);

  mp.prepare();  // once after loading: no readahead, the file's cached pages dropped, our pages unmapped
  CHECK(rss_of(ro) == 0);
  CHECK(same_as_file(ro, n));
  CHECK(rw[0] == 0xAB);

  // later calls check the kept ranges instead of reading /proc/self/maps again
  const long long rereads = mp.rereads();
  for (int i = 0; i < 3; ++i) {
    for (size_t j = 0; j < n; j += 4096) sum += ro[j];
    CHECK(mp.release() == static_cast<long long>(n + (1 << 20)));
    CHECK(rss_of(ro) == 0 && rss_of(ros) == 0);
  }
  CHECK(mp.rereads() == rereads);  // fails where /proc/self/map_files is not readable (then each call re-reads)

  // a kept range reused by an anonymous mapping holding data: never advised, the maps are read again
  munmap(ros, 1 << 20);
  auto* anon = static_cast<unsigned char*>(
      mmap(ros, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0));
  CHECK(anon == ros);
  std::memset(anon, 0x5A, 1 << 20);
  CHECK(mp.release() == static_cast<long long>(n));  // only ro now
  CHECK(mp.rereads() == rereads + 1);
  bool intact = true;
  for (size_t i = 0; i < (1 << 20); ++i) intact = intact && anon[i] == 0x5A;
  CHECK(intact);
  CHECK(rss_of(anon) == 1 << 20);
  CHECK(mp.release() == static_cast<long long>(n) && mp.rereads() == rereads + 1);  // kept again

  // the file unmapped and mapped again elsewhere: found by the next call
  const int fd2 = open(path.c_str(), O_RDONLY);
  auto* moved = static_cast<unsigned char*>(mmap(nullptr, n, PROT_READ, MAP_PRIVATE, fd2, 0));  // elsewhere:
  close(fd2);                                                                                    // ro is still mapped
  CHECK(moved != MAP_FAILED && moved != ro);
  munmap(ro, n);
  ro = moved;
  CHECK(same_as_file(ro, n));
  CHECK(rss_of(ro) > 0);
  CHECK(mp.release() == static_cast<long long>(n));
  CHECK(mp.rereads() == rereads + 2);
  CHECK(rss_of(ro) == 0);
  CHECK(rw[0] == 0xAB);

  if (bench) {  // the per-call cost: release() with its checks against one read of /proc/self/maps
    const int extra = std::atoi(argv[3]), calls = std::atoi(argv[4]);
    const std::string other = std::string(argv[1]) + "/other.bin";
    std::ofstream(other, std::ios::binary).write(std::string(8192, 'x').data(), 8192);
    const int fo = open(other.c_str(), O_RDONLY);
    for (int i = 0; i < extra; ++i)  // alternate protections so that neighbours never merge
      mmap(nullptr, 4096, (i & 1) ? PROT_READ : PROT_NONE, MAP_PRIVATE, fo, (i & 1) * 4096);
    close(fo);
    using clk = std::chrono::steady_clock;
    auto per_call_us = [&](auto&& f) {
      const auto t0 = clk::now();
      for (int i = 0; i < calls; ++i) f();
      return std::chrono::duration<double, std::micro>(clk::now() - t0).count() / calls;
    };
    const long long r0 = mp.rereads();
    const double kept = per_call_us([&] { mp.release(); });
    const double reread = per_call_us([&] { read_only_mappings(path); });
    CHECK(mp.rereads() == r0);
    std::ifstream maps("/proc/self/maps");
    int lines = 0;
    for (std::string l; std::getline(maps, l);) ++lines;
    std::printf("bench: %d mappings in the process; release() %.1f us per call (2 kept ranges checked + "
                "madvise); one read of /proc/self/maps %.1f us\n", lines, kept, reread);
  }

  setenv("PAGEDKV_KEEP_MAPPED_PAGES", "1", 1);
  MappedPages keep(path);
  CHECK(!keep.enabled());
  const long long before = rss_of(ro);
  CHECK(keep.release() == 0);
  CHECK(rss_of(ro) == before);

  munmap(ro, n);
  munmap(anon, 1 << 20);
  munmap(rw, 8192);
  std::remove(path.c_str());
  if (failures) return 1;
  std::printf("mapped_pages_test: ok\n");
  return 0;
}
