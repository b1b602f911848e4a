// Plain NEON attention path (aarch64, ARMv8.0: also runs on a Cortex-A53): impl::Attend over the
// shapes of pagedkv_attn_fused.h on the NEON wrapper (pagedkv_vec_neon.h, 4 floats), the same as the
// AVX2 path: runs of up to 64 keys, fp32 K scores with prefetch, row-wise softmax with the lazy running
// maximum, V sums in registers, >= 8 FMA chains. The generic path dequantizes bit-identically to the
// scalar path. The dotprod path (attend_neon_dot, selected at run time when getauxval(AT_HWCAP) &
// HWCAP_ASIMDDP) is pagedkv_core_neon_dot.cpp.
#include "pagedkv_vec_neon.h"
#include "pagedkv_attn_fused.h"

namespace pagedkv {

void attend_neon(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<fused::FusedOps<VecNeon>> a(c, scratch);
  a(t, h);
}

}  // namespace pagedkv
