# ExecuTorch built from source inside this build (PAGEDKV_EXECUTORCH=source; the Android app's mode).
#
# Configured like ExecuTorch's own Android build (tools/cmake/preset/android.cmake) but only with what
# the runner needs: the XNNPACK delegate, the optimized kernels (with the portable ones as their
# fallback), the quantized kernels (embedding_byte), the Module extension with its data loader / flat tensor / named data map, the tensor
# extension and the threadpool (pthreadpool + cpuinfo). Everything is static and ends up inside
# libpagedkv_runner.so next to our et_kernel.cpp, so one process holds exactly one ExecuTorch.
#
# The source is -DEXECUTORCH_SOURCE_DIR=<checkout with submodules> or, when that is empty, a
# FetchContent clone of PAGEDKV_EXECUTORCH_GIT_TAG with just the submodules below. ExecuTorch's
# CMake requires the checkout's directory to be named `executorch` (its headers are included as
# <executorch/...> relative to the parent dir).

# the submodules this configuration builds from (a subset of ExecuTorch's .gitmodules; third-party/json and
# gflags are added by its third-party/CMakeLists.txt in every configuration; pocketfft is the optimized
# kernels' FFT)
set(PAGEDKV_EXECUTORCH_SUBMODULES
    backends/xnnpack/third-party/XNNPACK
    backends/xnnpack/third-party/cpuinfo
    backends/xnnpack/third-party/pthreadpool
    backends/xnnpack/third-party/FP16
    backends/xnnpack/third-party/FXdiv
    third-party/flatbuffers
    third-party/flatcc
    third-party/json
    third-party/gflags
    third-party/pocketfft
    kernels/optimized/third-party/eigen)

macro(pagedkv_executorch_from_source)
  if(CMAKE_VERSION VERSION_LESS 3.24)
    message(FATAL_ERROR "building ExecuTorch from source needs CMake >= 3.24 (this is ${CMAKE_VERSION})")
  endif()
  if(NOT EXECUTORCH_SOURCE_DIR)
    include(FetchContent)
    # SOURCE_DIR ends in /executorch (ExecuTorch's rule above); SOURCE_SUBDIR names a dir without a
    # CMakeLists.txt so MakeAvailable only downloads: the add_subdirectory below sets the options first.
    FetchContent_Declare(pagedkv_executorch
      GIT_REPOSITORY https://github.com/pytorch/executorch.git
      GIT_TAG ${PAGEDKV_EXECUTORCH_GIT_TAG}
      GIT_SHALLOW TRUE
      GIT_SUBMODULES ${PAGEDKV_EXECUTORCH_SUBMODULES}
      GIT_PROGRESS TRUE
      SOURCE_DIR ${CMAKE_BINARY_DIR}/_deps/src/executorch
      SOURCE_SUBDIR pagedkv-download-only)
    FetchContent_MakeAvailable(pagedkv_executorch)
    set(EXECUTORCH_SOURCE_DIR ${CMAKE_BINARY_DIR}/_deps/src/executorch)
  endif()
  get_filename_component(EXECUTORCH_SOURCE_DIR "${EXECUTORCH_SOURCE_DIR}" ABSOLUTE)
  get_filename_component(_pagedkv_et_name "${EXECUTORCH_SOURCE_DIR}" NAME)
  if(NOT _pagedkv_et_name STREQUAL "executorch")
    message(FATAL_ERROR "EXECUTORCH_SOURCE_DIR=${EXECUTORCH_SOURCE_DIR}: ExecuTorch's CMake needs the checkout in a "
                        "directory named `executorch`; rename or symlink it.")
  endif()
  foreach(_sm ${PAGEDKV_EXECUTORCH_SUBMODULES})
    file(GLOB _pagedkv_sm_files "${EXECUTORCH_SOURCE_DIR}/${_sm}/*")
    if(NOT _pagedkv_sm_files)
      message(FATAL_ERROR "${EXECUTORCH_SOURCE_DIR}/${_sm} is empty: the checkout needs its submodules "
                          "(git submodule update --init ${_sm}).")
    endif()
  endforeach()

  # ExecuTorch options (its define_overridable_option takes a normal variable set before it as the value)
  set(EXECUTORCH_BUILD_SHARED OFF)
  set(EXECUTORCH_BUILD_TESTS OFF)
  set(EXECUTORCH_BUILD_EXECUTOR_RUNNER OFF)
  set(EXECUTORCH_BUILD_DEVTOOLS OFF)
  set(EXECUTORCH_ENABLE_EVENT_TRACER OFF)
  set(EXECUTORCH_BUILD_PYBIND OFF)
  set(EXECUTORCH_ENABLE_LOGGING ON)
  set(EXECUTORCH_LOG_LEVEL Info)
  set(EXECUTORCH_BUILD_XNNPACK ON)
  set(EXECUTORCH_BUILD_KERNELS_OPTIMIZED ON)
  set(EXECUTORCH_BUILD_PORTABLE_OPS ON)
  set(EXECUTORCH_BUILD_KERNELS_QUANTIZED ON)  # quantized_decomposed::embedding_byte (.pte weights 8da4w-e8)
  set(EXECUTORCH_BUILD_KERNELS_LLM OFF)
  set(EXECUTORCH_BUILD_EXTENSION_LLM OFF)
  set(EXECUTORCH_BUILD_EXTENSION_LLM_RUNNER OFF)
  set(EXECUTORCH_BUILD_EXTENSION_TRAINING OFF)
  set(EXECUTORCH_BUILD_EXTENSION_MODULE ON)
  set(EXECUTORCH_BUILD_EXTENSION_DATA_LOADER ON)
  set(EXECUTORCH_BUILD_EXTENSION_FLAT_TENSOR ON)
  set(EXECUTORCH_BUILD_EXTENSION_NAMED_DATA_MAP ON)
  set(EXECUTORCH_BUILD_EXTENSION_TENSOR ON)
  set(EXECUTORCH_BUILD_PTHREADPOOL ON)
  set(EXECUTORCH_BUILD_CPUINFO ON)
  if(ANDROID)
    set(EXECUTORCH_BUILD_ANDROID_JNI OFF)  # the app talks to our JNI bridge, not ExecuTorch's
    set(EXECUTORCH_PAL_DEFAULT android)    # ExecuTorch's log lines go to logcat
  endif()
  add_subdirectory(${EXECUTORCH_SOURCE_DIR} ${CMAKE_BINARY_DIR}/executorch-build EXCLUDE_FROM_ALL)
  set(EXECUTORCH_ROOT ${EXECUTORCH_SOURCE_DIR})

  # The runtime and the kernel libraries register themselves from static constructors: ExecuTorch
  # gives `executorch` and the generated op libraries INTERFACE --whole-archive link options
  # (executorch_target_link_options_shared_lib); the XNNPACK delegate's static archive has none in a
  # non-shared build, so it gets the same here (as extension/android/CMakeLists.txt does for its JNI).
  executorch_target_link_options_shared_lib(xnnpack_backend)
  set(PAGEDKV_ET_TARGETS
      executorch
      extension_module_static
      extension_data_loader
      extension_tensor
      extension_threadpool
      optimized_native_cpu_ops_lib
      quantized_ops_lib
      xnnpack_backend)
endmacro()
