# Native kernels (toolkit/csrc). Included by the top Makefile.
#   make native        release build of libpagedkv_et.so, libpagedkv_ort.so, pagedkv_core_test
#   make native-test   build + run pagedkv_core_test, and again built with ASan + UBSan
PAGEDKV_PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
PAGEDKV_BUILD_DIR ?= build/native

.PHONY: native native-test
native:
	PAGEDKV_BUILD_DIR=$(abspath $(PAGEDKV_BUILD_DIR)) $(PAGEDKV_PYTHON) -m toolkit.native

native-test: native
	$(PAGEDKV_BUILD_DIR)/pagedkv_core_test
	PAGEDKV_BUILD_DIR=$(abspath $(PAGEDKV_BUILD_DIR)) $(PAGEDKV_PYTHON) -m toolkit.native --sanitize
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $(PAGEDKV_BUILD_DIR)-asan/pagedkv_core_test
