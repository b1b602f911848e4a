// The one exception type the runner throws: a code the JNI bridge maps to a Java exception class,
// and a message that names the value and the fix.
#pragma once

#include <stdexcept>
#include <string>

namespace pagedkv_rt {

enum class ErrorCode : int {
  kArtifact = 1,      // artifacts dir / manifest / .pte / tokenizer missing or inconsistent
  kAllocation = 2,    // a pool arena could not be allocated
  kPoolExhausted = 3, // not enough free blocks for a request (nothing was changed)
  kState = 4,         // unknown conversation, all sequence slots in use, ...
  kModel = 5,         // ExecuTorch failed to load or run the program
  kArgument = 6,      // bad argument (empty prompt, budget too small, ...)
};

class RunnerError : public std::runtime_error {
 public:
  RunnerError(ErrorCode code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace pagedkv_rt
