"""The paged op on the native kernel core, from PyTorch on the CPU.

    with native_op():          # torch.ops.pagedkv.quantized_paged_attention now runs the C++ core
        logits = paged(ids, positions, seq_ids, tables)

The plain-PyTorch reference (toolkit/paged_attention.py) stays the op's definition and what the tests
check every kernel against; it gathers and dequantizes a copy of every block it reads, which makes a
long evaluation slow. Inside `native_op()` the in-place op's CPU kernel is the core's `pagedkv_call_op`
(libpagedkv_ort.so, loaded with ctypes; no onnxruntime needed), which writes the same records and
returns the same attention up to float rounding (the native kernel tests bound it). Leaving the block
restores the reference. Export and tracing never reach it (they use the op's fake implementation).
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

import toolkit.paged_attention  # noqa: F401  (defines torch.ops.pagedkv)
from toolkit import native
from toolkit.errors import NonFiniteKVError, PagedKVError

_CODES_TYPE = {torch.uint8: 0, torch.float16: 1, torch.float32: 2}
_NON_FINITE = 2  # pagedkv::Status kErrNonFinite


def _lib() -> ctypes.CDLL:
    lib = native.ort_kernels()
    # (a library built before the mixed op has only the default entry point)
    for fn in [lib.pagedkv_call_op] + ([lib.pagedkv_call_op_mixed] if hasattr(lib, "pagedkv_call_op_mixed") else []):
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.POINTER(ctypes.c_int64)),
            ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_char_p,
            ctypes.c_size_t,
        ]
    return lib


def call_native(lib, q, k, v, codes, scales, stage, positions, seq_ids, block_tables, sinks, *scalars, compact=None):
    """One call of the in-place op on the core: updates codes/scales/stage, returns out [1, T, Hq, D].
    compact: (compact_codes, compact_scales) for the mixed op (scalars then end with the compact spec's 6)."""
    for name, pool in (("codes", codes), ("scales", scales), ("stage", stage)):
        if not pool.is_contiguous() or pool.device.type != "cpu":
            raise PagedKVError(f"the native op needs contiguous CPU pool tensors ({name} is not).")
    if codes.dtype not in _CODES_TYPE:
        raise PagedKVError(f"the native op cannot read codes of dtype {codes.dtype}.")
    ins = [
        q.contiguous().float(), k.contiguous().float(), v.contiguous().float(), codes, scales, stage,
        positions.contiguous().long(), seq_ids.contiguous().long(), block_tables.contiguous().long(),
        sinks.contiguous().float(),
    ]
    _, hq, t, d = q.shape
    out = torch.empty((1, t, hq, d), dtype=torch.float32)
    data = [x.data_ptr() for x in ins] + [out.data_ptr()]
    if compact is not None:  # read only: contiguous copies are fine
        ccodes, cscales = compact[0].contiguous(), compact[1].contiguous()
        if ccodes.dtype != torch.uint8 or cscales.dtype != torch.float16:
            raise PagedKVError("the native mixed op needs uint8 compact_codes and float16 compact_scales.")
        ins += [ccodes, cscales]
        data += [ccodes.data_ptr(), cscales.data_ptr()]
    ptrs = (ctypes.c_void_p * len(data))(*data)
    shapes = [(ctypes.c_int64 * max(1, x.dim()))(*x.shape) for x in ins]
    shape_ptrs = (ctypes.POINTER(ctypes.c_int64) * len(ins))(
        *[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes])
    ndims = (ctypes.c_int * len(ins))(*[x.dim() for x in ins])
    vals = (ctypes.c_double * len(scalars))(*[float(x) for x in scalars])
    err = ctypes.create_string_buffer(1024)
    fn = lib.pagedkv_call_op if compact is None else lib.pagedkv_call_op_mixed
    rc = fn(ptrs, shape_ptrs, ndims, _CODES_TYPE[codes.dtype], vals, err, len(err))
    if rc:
        msg = err.value.decode(errors="replace")
        raise (NonFiniteKVError if rc == _NON_FINITE else PagedKVError)(msg)
    return out


@contextlib.contextmanager
def native_op():
    """Within the block, the in-place op runs on the native core for CPU tensors. Raises
    KernelLibraryMissing (with the build command) when libpagedkv_ort.so has not been built."""
    lib = _lib()
    reg = torch.library.Library("pagedkv", "IMPL")

    def kernel(*args):
        return call_native(lib, *args)

    def mixed_kernel(q, k, v, codes, scales, stage, ccodes, cscales, *rest):
        return call_native(lib, q, k, v, codes, scales, stage, *rest, compact=(ccodes, cscales))

    reg.impl("quantized_paged_attention", kernel, "CPU")
    if hasattr(lib, "pagedkv_call_op_mixed"):
        reg.impl("quantized_paged_attention_mixed", mixed_kernel, "CPU")
    try:
        yield
    finally:
        reg._destroy()
