#include "mapped_pages.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace pagedkv_rt {

std::vector<FileMapping> read_only_mappings(const std::string& path) {
  std::vector<FileMapping> out;
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return out;
  std::ifstream f("/proc/self/maps");
  std::string line;
  while (std::getline(f, line)) {
    // start-end perms offset major:minor inode [path]
    unsigned long long start = 0, end = 0, offset = 0, inode = 0;
    unsigned int maj = 0, min = 0;
    char perms[8] = {0};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s %llx %x:%x %llu", &start, &end, perms, &offset, &maj, &min,
                    &inode) != 7)
      continue;
    if (inode != static_cast<unsigned long long>(st.st_ino) || maj != major(st.st_dev) || min != minor(st.st_dev))
      continue;
    // read-only (private or shared; ExecuTorch maps the .pte MAP_SHARED): never written through this
    // mapping, so its pages are the file's and can be dropped
    if (std::strcmp(perms, "r--p") != 0 && std::strcmp(perms, "r--s") != 0) continue;
    out.push_back({static_cast<uintptr_t>(start), static_cast<uintptr_t>(end), offset});
  }
  return out;
}

static bool keep_requested() {
  const char* v = std::getenv("PAGEDKV_KEEP_MAPPED_PAGES");
  return v && *v && std::strcmp(v, "0") != 0;
}

MappedPages::MappedPages(std::string path) : path_(std::move(path)), enabled_(!keep_requested()) {}

void MappedPages::prepare() {
  if (!enabled_) return;
  const auto maps = read_only_mappings(path_);
  for (const auto& m : maps) {
    void* p = reinterpret_cast<void*>(m.start);
    madvise(p, m.end - m.start, MADV_RANDOM);
    madvise(p, m.end - m.start, MADV_DONTNEED);
  }
  const int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;  // advice only: without it the pages are merely larger
  for (const auto& m : maps)
    posix_fadvise(fd, static_cast<off_t>(m.offset), static_cast<off_t>(m.end - m.start), POSIX_FADV_DONTNEED);
  close(fd);
}

int64_t MappedPages::release() {
  if (!enabled_) return 0;
  int64_t n = 0;
  for (const auto& m : read_only_mappings(path_))
    if (madvise(reinterpret_cast<void*>(m.start), m.end - m.start, MADV_DONTNEED) == 0)
      n += static_cast<int64_t>(m.end - m.start);
  return n;
}

}  // namespace pagedkv_rt
