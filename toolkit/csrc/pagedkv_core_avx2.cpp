// AVX2 + FMA + F16C attention path (this file is compiled with -mavx2 -mfma -mf16c; the caller
// checks the CPU before selecting it): impl::Attend over the shapes of pagedkv_attn_fused.h on the
// AVX2 wrapper (pagedkv_vec_avx2.h, 8 floats). The generic path dequantizes bit-identically to the
// scalar path; quantized 8/4-bit blocks (other widths widened to 8 bits by impl::Attend) take the
// fused path: runs of up to 64 keys, fp32 K scores with prefetch of the next run, row-wise softmax with
// the lazy running maximum, V sums in registers, >= 8 FMA chains in each pass.
// Why fp32 FMAs and not integer dot products here (as avx512-vnni and NEON dotprod do): scores must
// stay at fp32 accuracy (q in three 8-bit limbs there). Plain AVX2 has no vpdpbusd: vpmaddubsw
// saturates 255 x 128 pairs and needs a vpmaddwd + vpaddd after it, so three limbs cost ~9 uops per
// head and 32 dims against 4 FMAs + a shared conversion in fp32: no gain on the multiply ports.
#include "pagedkv_vec_avx2.h"
#include "pagedkv_attn_fused.h"

namespace pagedkv {

void attend_avx2(const AttnContext& c, int t, int h, float* scratch) {
  impl::Attend<fused::FusedOps<VecAvx2>> a(c, scratch);
  a(t, h);
}

}  // namespace pagedkv
