# The kernel core's sources, per-file ISA flags and compile definitions for the target processor.
# Included by toolkit/csrc/CMakeLists.txt and android_demo/native/CMakeLists.txt, so both build the
# same core:   pagedkv_core_sources(<dir of the core sources> <out: sources> <out: definitions>)
# Each SIMD path is its own translation unit compiled for its ISA; the core picks one at run time.
function(pagedkv_core_sources dir out_src out_defs)
  set(src ${dir}/pagedkv_core.cpp)
  set(defs "")
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|i.86)$")
    list(APPEND src ${dir}/pagedkv_core_avx2.cpp ${dir}/pagedkv_core_avx512.cpp)
    set_source_files_properties(${dir}/pagedkv_core_avx2.cpp PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c")
    # -Wno-(maybe-)uninitialized: false positives from GCC 12's AVX-512 intrinsic headers (GCC bug 105593)
    set_source_files_properties(${dir}/pagedkv_core_avx512.cpp PROPERTIES COMPILE_OPTIONS
      "-mavx2;-mfma;-mf16c;-mavx512f;-mavx512bw;-mavx512vl;-mavx512dq;-Wno-maybe-uninitialized;-Wno-uninitialized")
    list(APPEND defs PAGEDKV_HAVE_AVX2=1 PAGEDKV_HAVE_AVX512=1)
  elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "^(aarch64|arm64|ARM64)$")
    list(APPEND src ${dir}/pagedkv_core_neon.cpp ${dir}/pagedkv_core_neon_dot.cpp)
    # only the dotprod path may use ARMv8.2 instructions: the rest runs on ARMv8.0 (Cortex-A53)
    set_source_files_properties(${dir}/pagedkv_core_neon_dot.cpp PROPERTIES COMPILE_OPTIONS "-march=armv8.2-a+dotprod")
    list(APPEND defs PAGEDKV_HAVE_NEON=1)
  endif()
  set(${out_src} ${src} PARENT_SCOPE)
  set(${out_defs} ${defs} PARENT_SCOPE)
endfunction()
