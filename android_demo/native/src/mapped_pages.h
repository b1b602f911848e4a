// Keep the program file's mapped pages from piling up in the process's resident memory (issue 23).
//
// ExecuTorch's Module (LoadMode::Mmap) maps the .pte read-only and keeps the constant segment mapped
// for the program's life; the portable embedding op reads the int8 token table from it, one row per
// token. Every row read maps the page-cache folio around it (64 KiB of fault-around, or a whole
// large folio of up to 2 MiB where the kernel's page cache holds them: Linux 6.18 on ext4 here), so
// an 8K-token prompt ends with the whole 27 MiB table resident although a call reads at most 64
// rows. These are clean file pages: unmapping them loses nothing, the next read maps them again
// from the page cache.
//
// prepare(): once, after the program is loaded. Marks the file's read-only mappings MADV_RANDOM (no
// readahead: a fault reads only its own small folio), unmaps their resident pages and drops the
// file's cached pages of those ranges (posix_fadvise DONTNEED: pages no process maps), so later
// faults build small folios instead of re-mapping the large ones the load's readahead made.
// Measured on Linux 6.18 / ext4 with a 126 MiB .pte, touching one byte per MiB: 126 MiB mapped
// as loaded, 99 MiB with MADV_RANDOM alone or with the eviction alone, 8 MiB (64 KiB per touch)
// with both.
// release(): before each graph call. Unmaps (MADV_DONTNEED) the pages the previous call mapped, so
// at most one call's rows are mapped (a 64-token prefill chunk: at most 64 x 64 KiB), and what the
// last call mapped stays visible in the runner's memory breakdown.
//
// Only mappings of this exact file (same device and inode) that are read-only (r--p, or r--s as
// ExecuTorch's MmapDataLoader maps it) are touched. prepare() finds them in /proc/self/maps and keeps
// the list; release() does not re-read /proc/self/maps (its cost grows with the process's mappings:
// ~100 in the host runner, thousands in an Android app process; one read took 170-280 us with 143
// mappings and 3.4-4.9 ms with 3,043 on a loaded 2-core Xeon, i.e. 0.5-0.8% and 10-15% of a 33 ms
// decode step at ~30 tok/s, against 2-6 us for release() on kept ranges: `mapped_pages_test DIR
// --bench 100 2000` and `--bench 3000 300`, native/tests/mapped_pages_test.cpp) but checks each kept range
// first, with one readlink of /proc/self/map_files/START-END: that entry exists only while one mapping
// spans exactly [START, END) and is file-backed, and it names the file. Only when every kept range is
// still exactly a mapping of the file named as in prepare() are the kept ranges advised; otherwise
// (one unmapped, split, or reused: an anonymous mapping there has no entry, so MADV_DONTNEED never
// reaches its data) release() re-reads /proc/self/maps and keeps the new list. Where map_files is not
// readable (an old kernel or a sandbox denying it), or no mapping of the file was found, every release()
// re-reads /proc/self/maps.
// Assumed, not checked per call: a kept range's protection does not change (nothing mprotects the
// program's mapping; ExecuTorch's loader maps it PROT_READ). A mapping of the file made after the last
// (re-)read is not released until a kept range changes.
// PAGEDKV_KEEP_MAPPED_PAGES=1 turns both off (for before/after measurements).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pagedkv_rt {

struct FileMapping {
  uintptr_t start = 0, end = 0;  // [start, end) in this process
  uint64_t offset = 0;           // file offset of start
};

// The read-only mappings of `path` in this process (by device and inode, from /proc/self/maps).
std::vector<FileMapping> read_only_mappings(const std::string& path);

class MappedPages {
 public:
  explicit MappedPages(std::string path);
  bool enabled() const { return enabled_; }
  void prepare();     // once after loading: see above
  int64_t release();  // before a graph call: bytes of mapping advised (0 when off or nothing mapped)
  int64_t rereads() const { return rereads_; }  // release() calls that re-read /proc/self/maps

 private:
  void remember(std::vector<FileMapping> maps);  // keep maps and each one's map_files link target
  bool kept_ranges_unchanged() const;

  std::string path_;
  bool enabled_;
  std::vector<FileMapping> kept_;   // the file's read-only mappings at the last read of /proc/self/maps
  std::vector<std::string> links_;  // readlink of /proc/self/map_files/START-END of each kept range
  bool links_ok_ = false;           // every kept range's link was readable (else release() re-reads)
  int64_t rereads_ = 0;
};

}  // namespace pagedkv_rt
