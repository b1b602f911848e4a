// pagedkv kernel core: quantized paged attention on plain data (no torch / ORT / ExecuTorch headers).
//
// Semantics: toolkit/paged_attention.py::reference_paged_attention is the ground truth. One call
// takes T new tokens (any mix of prefill chunks and decode steps of several sequences), writes their
// K/V records into the pool and attends over each token's sequence.
//
// Layouts (all contiguous, row-major):
//   q      float32 [Hq, T, D]        (the op's [1, Hq, T, D])
//   k, v   float32 [Hkv, T, D]
//   codes  uint8 [NB, Hkv, bs, W]    (float pools: float16 bits (uint16) or float32, W = 2*D)
//   scales uint16 (float16 bits) [NB, Hkv, bs, Ws]
//   stage  uint16 (float16 bits) [S, 2 (sink|tail), 2 (K|V), Hkv, bs, D]
//   positions, seq_ids int64 [T]; block_tables int64 [S_rows, M]; sinks float32 [Hq]
//   out    float32 [T, Hq, D]
//   compact_codes uint8 [NC, Hkv, bs, CW], compact_scales uint16 (float16 bits) [NC, Hkv, bs, CWs]
//          (the mixed op only: the compact region, read only; POOL_FORMAT.md "Compact region")
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagedkv {

struct PagedAttnParams {
  int T = 0, Hq = 0, Hkv = 0, D = 0;
  int block_size = 0, num_blocks = 0;
  int stage_rows = 0;          // S: rows of the stage tensor
  int table_rows = 0;          // S_rows: rows of block_tables
  int max_blocks_per_seq = 0;  // M
  int k_bits = 8, v_bits = 4, k_group = 64, v_group = 32;  // group 0 = head_dim
  bool k_sym = true, v_sym = false, rotate = true, fp_tail = true;
  int sink_blocks = 1;
  float scale = 1.0f;
  int window = 0;       // > 0: keys j > p - window
  float softcap = 0.f;  // > 0: s = tanh(s / softcap) * softcap
  bool float_pool = false;
  int float_bits = 32;  // 16 or 32 when float_pool
  int layer = 0;        // only used in error messages
  // Expected tensor element counts / widths the host saw (checked against the params).
  int code_width = 0;   // W
  int scale_width = 0;  // Ws (ignored for float pools)
  // The compact region (the mixed op; quantized pools only): num_compact > 0 compact blocks whose
  // records follow the compact spec below (rotate, fp_tail and sink_blocks are the pool's). A block-table
  // id b >= num_blocks names compact block b - num_blocks; new tokens are never written there.
  int num_compact = 0;  // NC (0: no compact region, the default op)
  int ck_bits = 4, cv_bits = 3, ck_group = 64, cv_group = 64;  // group 0 = head_dim
  bool ck_sym = true, cv_sym = false;
  int compact_code_width = 0;   // CW
  int compact_scale_width = 0;  // CWs
};

struct PagedAttnBuffers {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  void* codes = nullptr;
  uint16_t* scales = nullptr;
  uint16_t* stage = nullptr;
  const int64_t* positions = nullptr;
  const int64_t* seq_ids = nullptr;
  const int64_t* block_tables = nullptr;
  const float* sinks = nullptr;
  float* out = nullptr;
  const uint8_t* compact_codes = nullptr;    // when num_compact > 0
  const uint16_t* compact_scales = nullptr;
};

enum Status : int {
  kOk = 0,
  kErrShape = 1,      // shapes / params inconsistent
  kErrNonFinite = 2,  // NaN/Inf in K or V: nothing written
  kErrSlot = 3,       // a write slot without a block, or a block id out of range
  kErrInternal = 4,
};

// A host runtime's thread pool (onnxruntime's intra-op pool, ExecuTorch's threadpool): run(ctx, n, fn,
// arg) calls fn(arg, i) for every i in [0, n), on any of the host's threads in any order, and returns
// when all are done. With one, a call's parallel work runs on the host's threads (already awake in a
// model, and no second set of threads competing for the cores) instead of the core's own pool.
struct HostPool {
  void (*run)(void* ctx, int n, void (*fn)(void* arg, int i), void* arg) = nullptr;
  void* ctx = nullptr;
};

// Runs the op. Returns a Status; on error writes a message into err (if err_len > 0) and, for the
// checked errors (shape, non-finite, slot), leaves the pools untouched. host: the caller's thread
// pool, or nullptr for the core's own (set_num_threads). The results do not depend on either.
int paged_attention(const PagedAttnParams& p, const PagedAttnBuffers& b, char* err, size_t err_len,
                    const HostPool* host = nullptr);

// Record widths for a quantized spec (codes bytes, fp16 scale count) or float pool (elements, 0).
void record_widths(const PagedAttnParams& p, int* code_width, int* scale_width);
// The same for the compact spec (ck_bits, cv_bits, ck_group, cv_group, ck_sym, cv_sym).
void compact_record_widths(const PagedAttnParams& p, int* code_width, int* scale_width);

// ---- code paths and threads ------------------------------------------------------------------
enum class Isa : int { kAuto = 0, kScalar = 1, kAvx2 = 2, kNeon = 3, kNeonDot = 4, kAvx512 = 5, kAvx512Vnni = 6 };
// Every code path (isa_available says which this build and CPU have).
inline constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Vnni, Isa::kNeon, Isa::kNeonDot};
// Selects the attention code path (kAuto: best available). Returns false if not available here.
bool set_isa(Isa isa);
Isa active_isa();
bool isa_available(Isa isa);
const char* isa_name(Isa isa);
// The core's own thread pool, used by calls without a HostPool: 0 = default (env PAGEDKV_NUM_THREADS,
// else hardware concurrency).
void set_num_threads(int n);
int num_threads();
// Diagnostics of the most recent call: how many threads ran its attention (1: all on the calling
// thread; counts up to 64 distinct threads), and where its parallel region went: none (too little
// work, the calling thread), the core's own pool, or the host's pool.
int last_call_threads();
enum class CallPool : int { kCaller = 0, kOwn = 1, kHost = 2 };
CallPool last_call_pool();

// ---- quantization building blocks (bit exact with toolkit/quant.py), exposed for tests ---------
uint16_t fp32_to_fp16(float x);  // round to nearest even
float fp16_to_fp32(uint16_t h);
// In place orthonormal Hadamard along d (power of two): FWHT butterflies then * float(1/sqrt(d)).
void hadamard(float* x, int d);
// x[D] -> packed codes (D*bits/8 bytes) and fp16 meta (G scales, then G zeros if !sym).
void quantize_record(const float* x, int d, int bits, int group, bool sym, uint8_t* codes, uint16_t* meta);
void dequantize_record(const uint8_t* codes, const uint16_t* meta, int d, int bits, int group, bool sym, float* out);

}  // namespace pagedkv

// Plain C entry points (for ctypes / other hosts). The rest of the core is built with hidden
// visibility: each host library keeps its own copy of it (its own thread pool and settings), even
// when another one is loaded into the same process with RTLD_GLOBAL.
#define PAGEDKV_C_API __attribute__((visibility("default")))
extern "C" {
PAGEDKV_C_API int pagedkv_set_isa(int isa);  // returns 1 on success
PAGEDKV_C_API int pagedkv_active_isa(void);
PAGEDKV_C_API void pagedkv_set_num_threads(int n);
PAGEDKV_C_API int pagedkv_num_threads(void);  // the threads a call may use (the core's own pool)
PAGEDKV_C_API int pagedkv_last_call_threads(void);
PAGEDKV_C_API int pagedkv_last_call_pool(void);  // 0 calling thread, 1 the core's pool, 2 the host's
}
