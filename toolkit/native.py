"""Build and locate the native kernel libraries (toolkit/csrc): the ExecuTorch kernel library and the
onnxruntime custom-op library.

    python -m toolkit.native [--sanitize]     # or: make native

Libraries land in `build_dir()` (default <repo>/build/native, override with PAGEDKV_BUILD_DIR).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

from toolkit.errors import KernelLibraryMissing, PagedKVError

REPO = Path(__file__).resolve().parent.parent
CSRC = Path(__file__).resolve().parent / "csrc"
ET_LIB = "libpagedkv_et.so"
ORT_LIB = "libpagedkv_ort.so"
_HINT = "run `make native` (or `python -m toolkit.native`) to build it"

_et_handle: ctypes.CDLL | None = None


def build_dir(sanitize: bool = False) -> Path:
    base = os.environ.get("PAGEDKV_BUILD_DIR")
    d = Path(base) if base else REPO / "build" / "native"
    return d.with_name(d.name + "-asan") if sanitize else d


def _cmake() -> str:
    # the system cmake (a pip-installed cmake wrapper in the venv is not wanted here)
    for cand in ("/usr/bin/cmake", "/usr/local/bin/cmake"):
        if os.path.exists(cand):
            return cand
    found = shutil.which("cmake")
    if not found:
        raise KernelLibraryMissing("cmake is not installed: install cmake >= 3.20 to build the native kernels.")
    return found


def build(sanitize: bool = False, jobs: int | None = None, extra_args: list[str] | None = None) -> Path:
    """Configure and build toolkit/csrc with CMake; returns the build directory."""
    d = build_dir(sanitize)
    d.mkdir(parents=True, exist_ok=True)
    cmake = _cmake()
    args = [cmake, "-S", str(CSRC), "-B", str(d), f"-DPAGEDKV_PYTHON={sys.executable}"]
    if sanitize:
        # the sanitized build is for the core test; the host libraries would need an ASan runtime
        # preloaded into Python
        args += ["-DPAGEDKV_SANITIZE=ON", "-DPAGEDKV_BUILD_ET=OFF", "-DPAGEDKV_BUILD_ORT=OFF",
                 "-DCMAKE_BUILD_TYPE=RelWithDebInfo"]
    args += list(extra_args or [])
    subprocess.run(args, check=True)
    subprocess.run([cmake, "--build", str(d), "-j", str(jobs or os.cpu_count() or 2)], check=True)
    return d


def _lib(name: str) -> Path:
    p = build_dir() / name
    if not p.exists():
        raise KernelLibraryMissing(f"native kernel library {p} is missing: {_HINT}.")
    return p


def ort_library_path() -> str:
    """Path of the onnxruntime custom-op library (for SessionOptions.register_custom_ops_library)."""
    return str(_lib(ORT_LIB))


def et_library_path() -> str:
    return str(_lib(ET_LIB))


def load_executorch_kernels() -> ctypes.CDLL:
    """Register the pagedkv ExecuTorch kernels with the runtime of executorch's portable_lib (once).

    portable_lib must be imported first: it carries the runtime our library links against, and
    loading two copies of the runtime aborts the process. ExecuTorch's quantized kernels are registered
    too: portable_lib does not carry them, and .pte weights 8da4w-e8 gather with embedding_byte.
    """
    global _et_handle
    if _et_handle is None:
        import executorch
        import executorch.extension.pybindings.portable_lib  # noqa: F401

        quantized = Path(executorch.__path__[0]) / "lib" / "libexecutorch_kernels_quantized.so"
        ctypes.CDLL(str(quantized), mode=ctypes.RTLD_GLOBAL)
        _et_handle = ctypes.CDLL(et_library_path(), mode=ctypes.RTLD_GLOBAL)
    return _et_handle


def ort_kernels() -> ctypes.CDLL:
    """The onnxruntime custom-op library as ctypes sees it: the same loaded copy onnxruntime uses once
    a session has registered it (the dynamic loader opens one path once per process)."""
    return ctypes.CDLL(ort_library_path())


def set_kernel_threads(lib: ctypes.CDLL, threads: int) -> int:
    """Size of the C++ core's own thread pool in one loaded library: threads > 0, or 0 for the default
    (env PAGEDKV_NUM_THREADS, else every core). Returns the count now in effect. Each host library has
    its own copy of the core (built with hidden symbols), so its own setting. The onnxruntime and
    ExecuTorch libraries (and the Android runner) run the op on their runtime's threads instead (the
    session's intra-op threads, ExecuTorch's threadpool); the own pool serves calls without a host pool
    (the core bench and tests)."""
    if threads < 0:
        raise PagedKVError(f"threads={threads}: use a positive count, or 0 for the default.")
    lib.pagedkv_set_num_threads.argtypes = [ctypes.c_int]
    lib.pagedkv_set_num_threads(int(threads))
    lib.pagedkv_num_threads.restype = ctypes.c_int
    return int(lib.pagedkv_num_threads())


# The kernel core's code paths by PAGEDKV_ISA name (the values of pagedkv::Isa in pagedkv_core.h).
ISAS = {"scalar": 1, "avx2": 2, "neon": 3, "neon-dotprod": 4, "avx512": 5, "avx512-vnni": 6}


def available_isas(lib: ctypes.CDLL) -> list[str]:
    """The code paths one loaded library can run on this CPU (the build's paths the CPU supports);
    leaves the library on its automatic choice."""
    lib.pagedkv_set_isa.argtypes = [ctypes.c_int]
    have = [name for name, i in ISAS.items() if lib.pagedkv_set_isa(i)]
    lib.pagedkv_set_isa(0)
    return have


def set_isa(lib: ctypes.CDLL, name: str) -> None:
    """Force one library's code path (as PAGEDKV_ISA does at start-up); "auto" restores the best one."""
    lib.pagedkv_set_isa.argtypes = [ctypes.c_int]
    if not lib.pagedkv_set_isa(0 if name == "auto" else ISAS.get(name, -1)):
        raise PagedKVError(f"code path {name!r} is not available here: use one of {available_isas(lib)} or auto.")


def last_call_threads(lib: ctypes.CDLL) -> int:
    """How many threads ran the attention of the library's most recent op call (1: all on the calling
    thread; short calls always run there)."""
    lib.pagedkv_last_call_threads.restype = ctypes.c_int
    return int(lib.pagedkv_last_call_threads())


def last_call_pool(lib: ctypes.CDLL) -> str:
    """Where the library's most recent op call ran its parallel work: "caller" (too little work to
    split), "own" (the core's thread pool) or "host" (the runtime's threads)."""
    lib.pagedkv_last_call_pool.restype = ctypes.c_int
    return ("caller", "own", "host")[lib.pagedkv_last_call_pool()]


def et_pool_arrays(layout, groups=None) -> list[tuple]:
    """numpy views (no copies, writable) of the pool tensors the ExecuTorch kernels used in their most
    recent call, per layer: (codes, scales, stage) with the layout's shapes and dtypes (each layer with
    its layer group's block count when groups are given). They point into the planned memory of the
    program that ran last; valid while that program stays loaded."""
    import numpy as np

    from toolkit.block_pool import layer_layouts

    layouts = layer_layouts(layout, groups)

    lib = load_executorch_kernels()
    fn = lib.pagedkv_et_pool_view
    fn.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64)]
    fn.restype = ctypes.c_int
    out = []
    for layer in range(layout.num_layers):
        lay = layouts[layer]
        shapes = [(lay.codes_shape(), np.dtype(lay.codes_dtype_name)), (lay.scales_shape(), np.float16),
                  (lay.stage_shape(), np.float16)]
        views = []
        for which, (shape, dtype) in enumerate(shapes):
            ptr, nbytes = ctypes.c_void_p(), ctypes.c_int64()
            if not fn(layer, which, ctypes.byref(ptr), ctypes.byref(nbytes)):
                raise PagedKVError(f"layer {layer} of the ExecuTorch program has not run yet: run a step first.")
            want = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if nbytes.value != want:
                raise PagedKVError(f"layer {layer} pool tensor {which}: the program's buffer holds {nbytes.value} "
                                   f"bytes, the layout expects {want}; the .pte and its pagedkv.json disagree.")
            buf = (ctypes.c_uint8 * want).from_address(ptr.value)
            views.append(np.frombuffer(buf, dtype=dtype).reshape(shape))
        out.append(tuple(views))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m toolkit.native", description=__doc__.splitlines()[0])
    ap.add_argument("--sanitize", action="store_true", help="build with AddressSanitizer + UBSan")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    a = ap.parse_args(argv)
    d = build(sanitize=a.sanitize, jobs=a.jobs)
    print(f"built native kernels in {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
