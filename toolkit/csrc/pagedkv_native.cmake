# What the two native builds share (toolkit/csrc/CMakeLists.txt and android_demo/native/CMakeLists.txt
# include this file), so both build the same core against ExecuTorch the same way.

# The kernel core's sources, per-file ISA flags and compile definitions for the target processor:
#   pagedkv_core_sources(<dir of the core sources> <out: sources> <out: definitions>)
# Each SIMD path is its own translation unit compiled for its ISA; the core picks one at run time.
function(pagedkv_core_sources dir out_src out_defs)
  set(src ${dir}/pagedkv_core.cpp ${dir}/pagedkv_quant.cpp ${dir}/pagedkv_threads.cpp)
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

# ExecuTorch from an executorch pip wheel: sets EXECUTORCH_ROOT (when empty: the package dir of
# `import executorch` in PAGEDKV_PYTHON, else the first python3 on PATH) and PAGEDKV_ET_INCLUDE /
# PAGEDKV_ET_DEFS (what executorch-config.cmake exports as EXECUTORCH_INCLUDE_DIRS /
# EXECUTORCH_COMPILE_DEFINITIONS). `hint` ends the error message when executorch cannot be found.
macro(pagedkv_find_executorch hint)
  if(NOT EXECUTORCH_ROOT)
    if(NOT PAGEDKV_PYTHON)
      find_program(PAGEDKV_PYTHON NAMES python3 python REQUIRED)
    endif()
    execute_process(COMMAND ${PAGEDKV_PYTHON} -c "import executorch; print(executorch.__path__[0])"
                    OUTPUT_VARIABLE EXECUTORCH_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _pagedkv_rc)
    if(NOT _pagedkv_rc EQUAL 0)
      message(FATAL_ERROR "executorch is not importable by ${PAGEDKV_PYTHON}: ${hint}")
    endif()
  endif()
  set(PAGEDKV_ET_INCLUDE ${EXECUTORCH_ROOT}/include ${EXECUTORCH_ROOT}/include/executorch/runtime/core/portable_type/c10)
  set(PAGEDKV_ET_DEFS C10_USING_CUSTOM_GENERATED_MACROS ET_EVENT_TRACER_ENABLED)
endmacro()
