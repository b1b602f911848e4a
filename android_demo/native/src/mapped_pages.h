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
// ExecuTorch's MmapDataLoader maps it) are touched, re-read from /proc/self/maps each time (a range freed since is never advised).
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

 private:
  std::string path_;
  bool enabled_;
};

}  // namespace pagedkv_rt
