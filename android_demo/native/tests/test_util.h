// A tiny test harness: CHECK records a failure and continues; run() prints PASS/FAIL per test.
#pragma once

#include <algorithm>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace t {

inline int& failures() { static int f = 0; return f; }
inline int& current_failures() { static int f = 0; return f; }

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::printf("    CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++t::current_failures();                                                   \
    }                                                                            \
  } while (0)

#define CHECK_EQ(a, b)                                                                                   \
  do {                                                                                                   \
    auto _va = (a);                                                                                      \
    auto _vb = (b);                                                                                      \
    if (!(_va == _vb)) {                                                                                 \
      std::printf("    CHECK_EQ failed at %s:%d: %s (%lld) != %s (%lld)\n", __FILE__, __LINE__, #a,        \
                  static_cast<long long>(_va), #b, static_cast<long long>(_vb));                         \
      ++t::current_failures();                                                                           \
    }                                                                                                    \
  } while (0)

struct Summary {
  int passed = 0, failed = 0, skipped = 0;
  std::vector<std::string> only;  // run only these tests (empty: all)
  void run(const std::string& name, const std::function<void()>& fn) {
    if (!only.empty() && std::find(only.begin(), only.end(), name) == only.end()) {
      ++skipped;
      return;
    }
    current_failures() = 0;
    try {
      fn();
    } catch (const std::exception& e) {
      std::printf("    unexpected exception: %s\n", e.what());
      ++current_failures();
    }
    if (current_failures()) {
      ++failed;
      std::printf("FAIL %s\n", name.c_str());
    } else {
      ++passed;
      std::printf("PASS %s\n", name.c_str());
    }
    std::fflush(stdout);
  }
  int finish() {
    if (skipped) std::printf("(%d not selected by --only)\n", skipped);
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
  }
};

template <class F>
std::string expect_throw(F&& f) {  // returns the message, or "" if nothing was thrown
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace t
