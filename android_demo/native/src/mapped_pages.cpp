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

// "/proc/self/map_files/START-END" of a mapping (lowercase hex, no leading zeros: the kernel's names)
static std::string map_files_entry(const FileMapping& m) {
  char name[64];
  std::snprintf(name, sizeof name, "/proc/self/map_files/%lx-%lx", static_cast<unsigned long>(m.start),
                static_cast<unsigned long>(m.end));
  return name;
}

// the link target of a map_files entry, or "" when there is no such mapping (or it cannot be read)
static std::string map_files_link(const FileMapping& m) {
  char buf[4096];
  const ssize_t n = readlink(map_files_entry(m).c_str(), buf, sizeof buf);
  return n > 0 && static_cast<size_t>(n) < sizeof buf ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

void MappedPages::remember(std::vector<FileMapping> maps) {
  kept_ = std::move(maps);
  links_.clear();
  links_ok_ = !kept_.empty();  // nothing mapped yet: look again next time
  for (const auto& m : kept_) {
    links_.push_back(map_files_link(m));
    links_ok_ = links_ok_ && !links_.back().empty();
  }
}

bool MappedPages::kept_ranges_unchanged() const {
  if (!links_ok_) return false;
  for (size_t i = 0; i < kept_.size(); ++i)
    if (map_files_link(kept_[i]) != links_[i]) return false;
  return true;
}

void MappedPages::prepare() {
  if (!enabled_) return;
  remember(read_only_mappings(path_));
  for (const auto& m : kept_) {
    void* p = reinterpret_cast<void*>(m.start);
    madvise(p, m.end - m.start, MADV_RANDOM);
    madvise(p, m.end - m.start, MADV_DONTNEED);
  }
  const int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;  // advice only: without it the pages are merely larger
  for (const auto& m : kept_)
    posix_fadvise(fd, static_cast<off_t>(m.offset), static_cast<off_t>(m.end - m.start), POSIX_FADV_DONTNEED);
  close(fd);
}

int64_t MappedPages::release() {
  if (!enabled_) return 0;
  if (!kept_ranges_unchanged()) {  // a kept range changed (or cannot be checked): read the maps again
    remember(read_only_mappings(path_));
    ++rereads_;
  }
  int64_t n = 0;
  for (const auto& m : kept_)
    if (madvise(reinterpret_cast<void*>(m.start), m.end - m.start, MADV_DONTNEED) == 0)
      n += static_cast<int64_t>(m.end - m.start);
  return n;
}

}  // namespace pagedkv_rt
