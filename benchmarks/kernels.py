"""One decode step of attention (T=1, one sequence): our paged K8/V4 kernel against the peers.

    python benchmarks/kernels.py                 # 1K/4K/16K, 9/3/64 and 32/8/128, 1 and 2 threads
    python benchmarks/kernels.py --quick         # smoke run (1K and 4K, fewer repeats)
    python benchmarks/kernels.py --json out.json --ctx 4096 --dims 32/8/128 --threads 1

Implementations, measured side by side in one process (interleaved, rotating order, median of rounds;
et-custom-sdpa in its own group right after the others of the same cell, see ISOLATED):
  pagedkv-ort    our kernel (spec PRESETS["default"]: K8 sym g64 / V4 asym g32, Hadamard, fp16 sink +
                 tail) as a one-node ONNX model through our custom-op library; the pools are bound with
                 IOBinding (one OrtValue as input and output, no copies)
  pagedkv-et     the same kernel in ExecuTorch: a .pte with just the op, pools as mutable buffers (they
                 start zeroed: the same bytes read per step)
  gqa-fp32       onnxruntime com.microsoft GroupQueryAttention, fp32 BNSH cache bound in place
  gqa-int8       the same with an int8 cache (k/v_quant_type PER_CHANNEL, kv_cache_bit_width 8)
  gqa-int4       the same with an int4 cache (PER_CHANNEL, kv_cache_bit_width 4, uint8 packed)
  et-custom-sdpa ExecuTorch llama::update_cache + llama::custom_sdpa on an fp32 [1, S, Hkv, D] cache
                 (mutable buffers), start_pos baked into the .pte
  pagedkv-ort-spin
                 pagedkv-ort again, in a session whose intra-op threads spin for up to SPIN_US (1 ms) after
                 each call before they sleep (allow_spinning=1, session.intra_op.spin_duration_us) instead
                 of sleeping at once. Diagnostic only, not a peer of the targets: it shows what the
                 2-thread cells lose to waking the sleeping helper thread on every call (with 1 thread
                 the session has no helper, and the row repeats pagedkv-ort). onnxruntime bounds the spin
                 to about SPIN_US (a one-off check here: its threads were idle 2 ms after the last call),
                 so the 3 ms pause before every slice of the interleaved rounds outlasts it and the
                 others keep both cores.
  core-<path>    the C++ core alone (no host) on each code path of this CPU (avx2, avx512, ...; the hosts
                 use the best one), from toolkit/csrc/pagedkv_core_bench, run right after the others
  core-hot       the best path again with the block table cycling over 8 blocks (BENCH_HOT_BLOCKS=8):
                 the same work with the pool in L1/L2, i.e. the step without cache misses
  core-walk      no attention: the same pool bytes read in the kernel's order (per KV head, the table's
                 shuffled blocks) with plain loads and no arithmetic (BENCH_WALK=1), split over the threads:
                 the memory floor of the step's access pattern
  core-cold, core-walk-cold
                 the best path and the walk again with the caches flushed before every call (the bench
                 threads read --cold-mib MiB first, untimed: BENCH_COLD_MIB): the pool comes from memory,
                 as in a model whose weights and other layers' caches pass through the caches between two
                 calls of one layer. Everything else above runs the same step over and over, so its pool
                 stays in the last-level cache (260 MiB here, shared) from the second call of a slice on.

Threads: onnxruntime intra_op_num_threads (one session per count, allow_spinning=0 except -spin), ExecuTorch
_unsafe_reset_threadpool; our kernel runs on those same threads (the session's intra-op pool, ExecuTorch's
threadpool), the core alone on its own pool (pagedkv_core_bench's thread argument).

"bytes" is what the step must read from the KV cache (codes + fp16 scales/zeros, fp16 sink/tail
stage for ours; the whole cache for the others); bandwidth_fraction = bytes / ms / the machine's
memory read bandwidth with the same number of threads, measured here with numpy (best of max/sum over
a 512 MiB array split across the threads; measured before and after the cells, the higher of the two
counts). Note: at these sizes the caches may partly live in the CPU's last-level cache, so a fraction
above 1 is possible.
Our rows also carry paired_x_gqa-int8 and paired_x_gqa-fp32: the median over rounds of our time / the
peer's in the same round (paired_ratio), steadier than the ratio of medians on this shared box.
Writes benchmarks/results/kernels.json (rows) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

BLOCK = 16
IMPLS = ("pagedkv-ort", "pagedkv-et", "gqa-fp32", "gqa-int8", "gqa-int4", "et-custom-sdpa", "pagedkv-ort-spin",
         "core-paths")
ISOLATED = ("et-custom-sdpa",)
SPIN_US = 1000  # pagedkv-ort-spin: onnxruntime's intra-op spin, bounded (session.intra_op.spin_duration_us)
DIAGNOSTIC = ("pagedkv-ort-spin",)  # no time ratios against the peers (their sessions do not spin)


# ------------------------------------------------------------------------------------------------
# memory bandwidth


def measure_bandwidth(threads=(1, 2), mib: int = 512, reps: int = 7) -> dict:
    """Memory read bandwidth from numpy on an array larger than the last-level cache share, for each
    thread count n: n Python threads each reduce one slice (numpy releases the GIL in reductions), best
    of max and sum (medians of reps). No BLAS kernel: a multithreaded BLAS would make "1 thread" use
    every core. Also copy (bytes read + written), 1 thread."""
    import threading

    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    b = np.empty_like(a)
    a.max(), np.copyto(b, a)  # fault the pages in
    n = mib * 2**20

    def med(f):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    def parallel(nt, op):
        parts = np.array_split(a, nt)

        def run():
            ths = [threading.Thread(target=op, args=(x,)) for x in parts]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
        return run

    read = {}
    for nt in threads:
        read[nt] = max(n / med(parallel(nt, np.max)) / 1e9, n / med(parallel(nt, np.sum)) / 1e9)
    copy = 2 * n / med(lambda: np.copyto(b, a)) / 1e9
    del a, b
    return {"read_gbs": read, "copy_gbs": copy, "array_mib": mib}


# ------------------------------------------------------------------------------------------------
# our kernel


def _spec():
    from toolkit.quant import PRESETS

    return PRESETS["default"]


def _pools(hkv, d, ctx, seed):
    """Random pools for one sequence holding ctx tokens (+ the slot of the new token), shuffled blocks."""
    from toolkit.quant import record_layout

    spec = _spec()
    rec = record_layout(spec, d)
    nblk = ctx // BLOCK + 1
    nb = nblk + 1
    rng = np.random.default_rng(seed)
    codes = rng.integers(1, 256, size=(nb, hkv, BLOCK, rec.code_width), dtype=np.uint8)
    scales = rng.uniform(0.005, 0.05, size=(nb, hkv, BLOCK, rec.scale_width)).astype(np.float16)
    kg, vg = spec.groups(d)
    nk = (d // kg) * (1 if spec.k_sym else 2)
    if not spec.v_sym:  # V zeros: the group minimum, negative
        nvg = d // vg
        scales[..., nk + nvg:] = -rng.uniform(0.1, 0.5, size=scales[..., nk + nvg:].shape).astype(np.float16)
    stage = (rng.standard_normal((1, 2, 2, hkv, BLOCK, d)) * 0.5).astype(np.float16)
    table = rng.permutation(nb)[:nblk].astype(np.int64).reshape(1, nblk)
    return (*(_aligned_copy(a) for a in (codes, scales, stage)), table)


def _aligned_copy(a):
    """a in a cache-line-aligned array, as the runtimes allocate pools (toolkit.pool_layout)."""
    from toolkit.pool_layout import zeros_aligned

    out = zeros_aligned(a.shape, a.dtype)
    out[...] = a
    return out


def _our_bytes(hkv, d, ctx):
    from toolkit.quant import record_layout

    spec = _spec()
    rec = record_layout(spec, d)
    keys = ctx + 1
    tail = keys % BLOCK or BLOCK  # tokens of the last block (float16 from the stage / the call)
    fp16 = (BLOCK if spec.sink_blocks else 0) + (tail if spec.fp_tail else 0)
    quant = keys - fp16
    return hkv * (quant * (rec.code_width + 2 * rec.scale_width) + fp16 * 2 * 2 * d)


def _scalars(d):
    spec = _spec()
    kg, vg = spec.groups(d)
    return dict(layer=0, k_bits=spec.k_bits, v_bits=spec.v_bits, k_group=kg, v_group=vg, k_sym=spec.k_sym,
                v_sym=spec.v_sym, rotate=spec.rotate, fp_tail=spec.fp_tail, sink_blocks=spec.sink_blocks,
                scale=1.0 / math.sqrt(d), window=0, softcap=0.0)


def _step_inputs(hq, hkv, d, ctx, seed):
    rng = np.random.default_rng(seed + 1)
    return dict(
        q=rng.standard_normal((1, hq, 1, d)).astype(np.float32),
        k=rng.standard_normal((1, hkv, 1, d)).astype(np.float32),
        v=rng.standard_normal((1, hkv, 1, d)).astype(np.float32),
        positions=np.array([ctx], np.int64), seq_ids=np.zeros(1, np.int64),
        sinks=np.full(hq, -np.inf, np.float32),
    )


class OursOrt:
    def __init__(self, hq, hkv, d, ctx, seed, threads=(1,), spin_us=0):
        import onnxruntime as ort
        from onnx import TensorProto as TP
        from onnx import helper

        from toolkit import native

        codes, scales, stage, table = _pools(hkv, d, ctx, seed)
        x = _step_inputs(hq, hkv, d, ctx, seed)
        ins = [
            helper.make_tensor_value_info("q", TP.FLOAT, [1, hq, 1, d]),
            helper.make_tensor_value_info("k", TP.FLOAT, [1, hkv, 1, d]),
            helper.make_tensor_value_info("v", TP.FLOAT, [1, hkv, 1, d]),
            helper.make_tensor_value_info("codes", TP.UINT8, list(codes.shape)),
            helper.make_tensor_value_info("scales", TP.FLOAT16, list(scales.shape)),
            helper.make_tensor_value_info("stage", TP.FLOAT16, list(stage.shape)),
            helper.make_tensor_value_info("positions", TP.INT64, [1]),
            helper.make_tensor_value_info("seq_ids", TP.INT64, [1]),
            helper.make_tensor_value_info("block_tables", TP.INT64, list(table.shape)),
            helper.make_tensor_value_info("sinks", TP.FLOAT, [hq]),
        ]
        outs = [
            helper.make_tensor_value_info("out", TP.FLOAT, [1, 1, hq, d]),
            helper.make_tensor_value_info("codes_out", TP.UINT8, list(codes.shape)),
            helper.make_tensor_value_info("scales_out", TP.FLOAT16, list(scales.shape)),
            helper.make_tensor_value_info("stage_out", TP.FLOAT16, list(stage.shape)),
        ]
        attrs = {k: (float(v) if isinstance(v, float) else int(v)) for k, v in _scalars(d).items()}
        from export.onnx_export import DOMAIN, OP_TYPE, register_schema

        register_schema()
        node = helper.make_node(OP_TYPE, [i.name for i in ins], [o.name for o in outs], domain=DOMAIN, **attrs)
        model = helper.make_model(helper.make_graph([node], "qpa", ins, outs),
                                  opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
        model.ir_version = 10
        self.pools = [ort.OrtValue.ortvalue_from_numpy(a) for a in (codes, scales, stage)]
        self.keep = dict(x, block_tables=table)
        self.out = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, hq, d), np.float32))
        self.sessions = {}
        for n in threads:  # the op runs on the session's intra-op threads, configured as for GQA below
            so = ort.SessionOptions()
            so.register_custom_ops_library(native.ort_library_path())
            so.intra_op_num_threads = n
            so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_us else "0")
            if spin_us:
                so.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            b = sess.io_binding()
            for name in ("q", "k", "v", "positions", "seq_ids", "block_tables", "sinks"):
                b.bind_cpu_input(name, self.keep[name])
            for name, p in zip(("codes", "scales", "stage"), self.pools):
                b.bind_ortvalue_input(name, p)
                b.bind_ortvalue_output(name + "_out", p)
            b.bind_ortvalue_output("out", self.out)
            self.sessions[n] = (sess, b)
        self.cur = self.sessions[threads[0]]
        self.bytes = _our_bytes(hkv, d, ctx)

    def set_threads(self, n):
        self.cur = self.sessions[n]

    def __call__(self):
        sess, b = self.cur
        sess.run_with_iobinding(b)


class _OurModule:  # built lazily (torch import)
    pass


class OursEt:
    def __init__(self, hq, hkv, d, ctx, seed):
        import torch

        import toolkit.paged_attention  # noqa: F401  (registers the op)
        from toolkit import native

        native.load_executorch_kernels()
        codes, scales, stage, table = _pools(hkv, d, ctx, seed)
        kw = _scalars(d)

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                # initial values are not serialized into the .pte: the runtime's planned buffers
                # start zeroed (same bytes read per step)
                self.register_buffer("codes", torch.from_numpy(codes))
                self.register_buffer("scales", torch.from_numpy(scales))
                self.register_buffer("stage", torch.from_numpy(stage))

            def forward(self, q, k, v, positions, seq_ids, block_tables, sinks):
                return torch.ops.pagedkv.quantized_paged_attention(
                    q, k, v, self.codes, self.scales, self.stage, positions, seq_ids, block_tables, sinks,
                    *kw.values())

        x = _step_inputs(hq, hkv, d, ctx, seed)
        self.args = [torch.from_numpy(x[n]) for n in ("q", "k", "v", "positions", "seq_ids")] + [
            torch.from_numpy(table), torch.from_numpy(x["sinks"])]
        self.program, self.method = _et_load(M(), tuple(self.args))
        self.bytes = _our_bytes(hkv, d, ctx)

    def set_threads(self, n):  # the op runs on ExecuTorch's threadpool
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

        _unsafe_reset_threadpool(n)

    def __call__(self):
        self.method.execute(self.args)


def _et_load(module, args):
    import torch
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    ep = torch.export.export(module.eval(), args, strict=False)
    prog = to_edge_transform_and_lower(ep).to_executorch()
    program = Runtime.get().load_program(prog.buffer)
    return program, program.load_method("forward")


# ------------------------------------------------------------------------------------------------
# onnxruntime GroupQueryAttention


class Gqa:
    QUANT = {"fp32": ("NONE", 32), "int8": ("PER_CHANNEL", 8), "int4": ("PER_CHANNEL", 4)}

    def __init__(self, kind, hq, hkv, d, ctx, seed, threads):
        import onnxruntime as ort
        from onnx import TensorProto as TP
        from onnx import helper

        qt, bits = self.QUANT[kind]
        S = ctx + 1
        dd = d if bits >= 8 else d * bits // 8
        cache_t = {32: TP.FLOAT, 8: TP.INT8, 4: TP.UINT8}[bits]
        cache_np = {32: np.float32, 8: np.int8, 4: np.uint8}[bits]
        ins = [
            helper.make_tensor_value_info("query", TP.FLOAT, [1, 1, hq * d]),
            helper.make_tensor_value_info("key", TP.FLOAT, [1, 1, hkv * d]),
            helper.make_tensor_value_info("value", TP.FLOAT, [1, 1, hkv * d]),
            helper.make_tensor_value_info("past_key", cache_t, [1, hkv, S, dd]),
            helper.make_tensor_value_info("past_value", cache_t, [1, hkv, S, dd]),
            helper.make_tensor_value_info("seqlens_k", TP.INT32, [1]),
            helper.make_tensor_value_info("total_sequence_length", TP.INT32, []),
        ]
        names = [i.name for i in ins]
        attrs = dict(num_heads=hq, kv_num_heads=hkv, scale=1.0 / math.sqrt(d))
        if qt != "NONE":
            sshape = [1, hkv, 1, d]
            ins += [helper.make_tensor_value_info("k_scale", TP.FLOAT, sshape),
                    helper.make_tensor_value_info("v_scale", TP.FLOAT, sshape)]
            names += ["", "", "", "", "", "k_scale", "v_scale"]
            attrs.update(k_quant_type=qt, v_quant_type=qt, kv_cache_bit_width=bits)
        outs = [
            helper.make_tensor_value_info("output", TP.FLOAT, [1, 1, hq * d]),
            helper.make_tensor_value_info("present_key", cache_t, [1, hkv, S, dd]),
            helper.make_tensor_value_info("present_value", cache_t, [1, hkv, S, dd]),
        ]
        node = helper.make_node("GroupQueryAttention", names, [o.name for o in outs], domain="com.microsoft",
                                **attrs)
        model = helper.make_model(helper.make_graph([node], "gqa", ins, outs),
                                  opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        rng = np.random.default_rng(seed)
        if bits == 32:
            pk, pv = (rng.standard_normal((1, hkv, S, dd)).astype(np.float32) for _ in range(2))
        elif bits == 8:
            pk, pv = (rng.integers(-127, 128, (1, hkv, S, dd), dtype=np.int8) for _ in range(2))
        else:
            pk, pv = (rng.integers(0, 256, (1, hkv, S, dd), dtype=np.uint8) for _ in range(2))
        self.feeds = dict(
            query=rng.standard_normal((1, 1, hq * d)).astype(np.float32),
            key=rng.standard_normal((1, 1, hkv * d)).astype(np.float32),
            value=rng.standard_normal((1, 1, hkv * d)).astype(np.float32),
            seqlens_k=np.array([ctx], np.int32), total_sequence_length=np.array(ctx + 1, np.int32))
        if qt != "NONE":
            self.feeds.update(k_scale=rng.uniform(0.01, 0.05, (1, hkv, 1, d)).astype(np.float32),
                              v_scale=rng.uniform(0.01, 0.05, (1, hkv, 1, d)).astype(np.float32))
        self.caches = [ort.OrtValue.ortvalue_from_numpy(a) for a in (pk, pv)]
        self.out = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, hq * d), np.float32))
        self.sessions = {}
        for n in threads:
            so = ort.SessionOptions()
            so.intra_op_num_threads = n
            # no spinning: on a 2-core machine an idle spinning worker steals the core of whatever runs
            # next in the interleaved loop
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            b = sess.io_binding()
            for name, a in self.feeds.items():
                b.bind_cpu_input(name, a)
            b.bind_ortvalue_input("past_key", self.caches[0])
            b.bind_ortvalue_output("present_key", self.caches[0])
            b.bind_ortvalue_input("past_value", self.caches[1])
            b.bind_ortvalue_output("present_value", self.caches[1])
            b.bind_ortvalue_output("output", self.out)
            self.sessions[n] = (sess, b)
        scale_bytes = 0 if qt == "NONE" else 2 * hkv * d * 4
        self.bytes = 2 * hkv * (ctx + 1) * dd * np.dtype(cache_np).itemsize + scale_bytes
        self.cur = self.sessions[threads[0]]

    def set_threads(self, n):
        self.cur = self.sessions[n]

    def __call__(self):
        sess, b = self.cur
        sess.run_with_iobinding(b)


# ------------------------------------------------------------------------------------------------
# ExecuTorch llama::custom_sdpa


class EtSdpa:
    def __init__(self, hq, hkv, d, ctx, seed):
        import torch
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (registers llama::*)

        S = ctx + 1
        pos = ctx

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("k_cache", torch.zeros(1, S, hkv, d))
                self.register_buffer("v_cache", torch.zeros(1, S, hkv, d))

            def forward(self, q, k, v):
                torch.ops.llama.update_cache(k, self.k_cache, pos)
                torch.ops.llama.update_cache(v, self.v_cache, pos)
                return torch.ops.llama.custom_sdpa(q, self.k_cache, self.v_cache, pos, None, 0.0, True)

        g = torch.Generator().manual_seed(seed)
        self.args = [torch.randn(1, 1, hq, d, generator=g), torch.randn(1, 1, hkv, d, generator=g),
                     torch.randn(1, 1, hkv, d, generator=g)]
        self.program, self.method = _et_load(M(), tuple(self.args))
        self.bytes = 2 * hkv * (ctx + 1) * d * 4

    def set_threads(self, n):
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

        _unsafe_reset_threadpool(n)

    def __call__(self):
        self.method.execute(self.args)


# ------------------------------------------------------------------------------------------------


def _core_bench_exe() -> Path:
    from toolkit.native import build_dir

    exe = build_dir() / "pagedkv_core_bench"
    if not exe.exists():
        raise FileNotFoundError(f"{exe} not found: run `make native`")
    return exe


def core_paths() -> list:
    """The attention code paths of the core available on this CPU (scalar excluded), from the bench."""
    import subprocess

    out = subprocess.run([str(_core_bench_exe()), "--paths"], capture_output=True, text=True, check=True).stdout
    return [p for p in out.split() if p != "scalar"]


def core_bench_cmd(path, hq, hkv, d, ctx, threads, reps, hot_blocks=0, walk=False, cold_mib=0):
    """(argv, env) of one toolkit/csrc/pagedkv_core_bench run (see core_bench)."""
    env = dict(os.environ)
    if hot_blocks:
        env["BENCH_HOT_BLOCKS"] = str(hot_blocks)
    if walk:
        env["BENCH_WALK"] = "1"
    if cold_mib:
        env["BENCH_COLD_MIB"] = str(cold_mib)
    argv = [str(_core_bench_exe()), str(ctx), str(hq), str(hkv), str(d), str(threads), str(reps), path]
    return argv, env


def parse_core_bench(out: str) -> tuple:
    """(median ms, bytes) from pagedkv_core_bench's output line."""
    import re

    m = re.search(r"([\d.]+) ms .* bytes (\d+)", out)
    if not m:
        raise RuntimeError(f"unexpected pagedkv_core_bench output: {out!r}")
    return float(m.group(1)), int(m.group(2))


def core_reps(ctx: int, cold: bool = False) -> int:
    """Timed steps of one pagedkv_core_bench cell by default: ~2M cached tokens' worth, 20..400 (30 cold)."""
    return 30 if cold else max(20, min(400, int(2e6 / ctx)))


def core_bench(path, hq, hkv, d, ctx, threads, reps=None, hot_blocks=0, walk=False, cold_mib=0):
    """(median ms, bytes) of one decode step of the core alone on one code path (toolkit/csrc/
    pagedkv_core_bench: the default spec, random codes, shuffled blocks; hot_blocks > 0: the block table
    cycles over that many blocks, so the pool stays in the nearest caches; walk: only the reads of the
    step's pool bytes, in its order, no attention; cold_mib > 0: the caches flushed before every call by
    reading that many MiB)."""
    import subprocess

    reps = reps or core_reps(ctx, cold=bool(cold_mib))
    argv, env = core_bench_cmd(path, hq, hkv, d, ctx, threads, reps, hot_blocks, walk, cold_mib)
    return parse_core_bench(subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout)


def build(impl, hq, hkv, d, ctx, threads, seed=0):
    if impl == "pagedkv-ort":
        return OursOrt(hq, hkv, d, ctx, seed, threads)
    if impl == "pagedkv-ort-spin":
        return OursOrt(hq, hkv, d, ctx, seed, threads, spin_us=SPIN_US)
    if impl == "pagedkv-et":
        return OursEt(hq, hkv, d, ctx, seed)
    if impl.startswith("gqa-"):
        return Gqa(impl[4:], hq, hkv, d, ctx, seed, threads)
    if impl == "et-custom-sdpa":
        return EtSdpa(hq, hkv, d, ctx, seed)
    raise ValueError(impl)


def time_cell(runners: dict, rounds: int, target_s: float, samples_out: dict | None = None) -> dict:
    """Interleaved: every round runs each implementation for ~target_s; returns median ms per call
    (samples_out, if given, gets each implementation's ms per round, in round order)."""
    iters = {}
    for name, r in runners.items():  # warm up + calibrate
        t = time.perf_counter()
        r()
        if time.perf_counter() - t > 0.1:  # pathologically slow (see et-custom-sdpa at 1 thread): 1 call
            iters[name] = 1
            continue
        for _ in range(2):
            r()
        t = time.perf_counter()
        n = 0
        while time.perf_counter() - t < target_s / 2 or n < 3:
            r()
            n += 1
        per = (time.perf_counter() - t) / n
        iters[name] = max(2, int(target_s / per))
    samples = {name: [] for name in runners}
    names = list(runners)
    for k in range(rounds):
        order = names[k % len(names):] + names[: k % len(names)]  # rotate the order every round
        for name in order:
            r, n = runners[name], iters[name]
            time.sleep(0.003)  # untimed: let the previous runtime's worker threads stop spinning
            t = time.perf_counter()
            for _ in range(n):
                r()
            samples[name].append((time.perf_counter() - t) / n * 1e3)
    if samples_out is not None:
        samples_out.update(samples)
    return {name: statistics.median(s) for name, s in samples.items()}


def paired_ratio(ours: list, peer: list) -> float:
    """Median over rounds of ours / peer within the same round. This box has slow phases lasting
    seconds (another tenant, the clock): a round's two slices, under a second apart, share the phase,
    so this ratio moves less between runs than the ratio of the two medians."""
    return statistics.median(a / b for a, b in zip(ours, peer))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1K and 4K, few repeats")
    ap.add_argument("--ctx", type=int, nargs="+", default=None, help="cached tokens (default 1024 4096 16384)")
    ap.add_argument("--dims", nargs="+", default=["9/3/64", "32/8/128"], help="q_heads/kv_heads/head_dim")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per cell (default 15, quick 3)")
    ap.add_argument("--slice", type=float, default=None,
                    help="seconds per implementation per round (default 0.03, quick 0.02)")
    ap.add_argument("--cold-mib", type=int, default=512,
                    help="MiB read before every call of core-cold / core-walk-cold (0: skip those rows)")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "kernels.json")
    ap.add_argument("--table", type=Path, default=None, metavar="JSON",
                    help="measure nothing: print the BENCHMARKS.md table (one row per cell) of a results file")
    args = ap.parse_args(argv)
    if args.table:
        print(pivot(json.loads(args.table.read_text())))
        return 0
    ctxs = args.ctx or ([1024, 4096] if args.quick else [1024, 4096, 16384])
    from benchmarks.e2e import cpu_model

    cpu = cpu_model()
    # the path our kernel ran in the hosts: PAGEDKV_ISA when set (and available), else the best one
    forced_isa = os.environ.get("PAGEDKV_ISA") or "auto"
    rounds = args.rounds or (3 if args.quick else 15)
    target = args.slice or (0.02 if args.quick else 0.03)

    # measured before and after the cells; the higher of the two is the denominator (it moves by up to
    # ~15% between runs here, and the higher one gives the lower, conservative, fractions)
    def show_bw(b, when):
        print(f"memory read bandwidth {when} (numpy, {b['array_mib']} MiB): "
              + ", ".join(f"{n} thread(s) {g:.1f} GB/s" for n, g in b["read_gbs"].items())
              + f"; copy {b['copy_gbs']:.1f} GB/s", flush=True)

    bw_before = measure_bandwidth(tuple(args.threads), 256 if args.quick else 512)
    show_bw(bw_before, "before")
    paths = core_paths() if "core-paths" in args.impls else []
    rows = []
    for dims in args.dims:
        hq, hkv, d = (int(x) for x in dims.split("/"))
        for ctx in ctxs:
            t0 = time.time()
            runners = {}
            for impl in args.impls:
                if impl == "core-paths":  # not a runner: pagedkv_core_bench, below
                    continue
                try:
                    runners[impl] = build(impl, hq, hkv, d, ctx, args.threads)
                except Exception as e:  # a peer that cannot run this config: say so, keep going
                    print(f"  {impl} {dims} ctx {ctx}: not run ({type(e).__name__}: {str(e)[:200]})", flush=True)
            for n in args.threads:
                for r in runners.values():
                    r.set_threads(n)
                # ExecuTorch's custom_sdpa is timed in its own group after the others: at 1 thread its
                # calls take seconds here and its thread pool disturbs whatever runs next
                main_group = {k: v for k, v in runners.items() if k not in ISOLATED}
                per_round: dict = {}
                ms = time_cell(main_group, rounds, target, per_round) if main_group else {}
                for k in ISOLATED:
                    if k in runners:
                        ms.update(time_cell({k: runners[k]}, max(3, rounds // 3), target))
                sizes = {impl: runners[impl].bytes for impl in ms}
                for path in paths:  # the core alone, per code path, right after the hosts
                    ms[f"core-{path}"], sizes[f"core-{path}"] = core_bench(path, hq, hkv, d, ctx, n)
                if paths:  # the best path (--paths lists the plainest first) over 8 repeated blocks: no cache misses
                    ms["core-hot"], sizes["core-hot"] = core_bench(paths[-1], hq, hkv, d, ctx, n, hot_blocks=8)
                    ms["core-walk"], sizes["core-walk"] = core_bench(paths[-1], hq, hkv, d, ctx, n, walk=True)
                    if args.cold_mib:
                        ms["core-cold"], sizes["core-cold"] = core_bench(paths[-1], hq, hkv, d, ctx, n,
                                                                         cold_mib=args.cold_mib)
                        ms["core-walk-cold"], sizes["core-walk-cold"] = core_bench(
                            paths[-1], hq, hkv, d, ctx, n, walk=True, cold_mib=args.cold_mib)
                for impl, m in ms.items():
                    b = sizes[impl]
                    paired = ({f"paired_x_{peer}": round(paired_ratio(per_round[impl], per_round[peer]), 4)
                               for peer in ("gqa-int8", "gqa-fp32") if peer in per_round}
                              if impl.startswith("pagedkv-") and impl in per_round else {})
                    rows.append(dict(impl=impl, ctx=ctx, threads=n, q_heads=hq, kv_heads=hkv, head_dim=d, ms=round(m, 4),
                                     bytes=int(b), gb_s=round(b / (m * 1e-3) / 1e9, 2), cpu=cpu,
                                     **({"pagedkv_isa": forced_isa} if impl.startswith("pagedkv-") else {}), **paired))
                print(f"  {dims} ctx {ctx} threads {n}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()),
                      flush=True)
            del runners
            print(f"  ({time.time() - t0:.0f}s)", flush=True)

    bw_after = measure_bandwidth(tuple(args.threads), 256 if args.quick else 512)
    show_bw(bw_after, "after")
    bw = dict(bw_after, read_gbs={n: max(bw_before["read_gbs"][n], bw_after["read_gbs"][n]) for n in args.threads})
    for r in rows:
        r["mem_read_gbs"] = round(bw["read_gbs"][r["threads"]], 2)
        r["bandwidth_fraction"] = round(r["bytes"] / (r["ms"] * 1e-3) / (bw["read_gbs"][r["threads"]] * 1e9), 4)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print()
    print(markdown(rows, bw))
    for r in rows:
        if "paired_x_gqa-int8" in r:
            print(f"paired (median of per-round ratios) {r['q_heads']}/{r['kv_heads']}/{r['head_dim']} ctx {r['ctx']} "
                  f"threads {r['threads']}: {r['impl']} / gqa-int8 {r['paired_x_gqa-int8']:.3f}")
    print(f"\nwrote {args.json}")
    return 0


def markdown(rows, bw) -> str:
    import onnxruntime

    lines = [f"One decode step (T=1), {platform.machine()}, {os.cpu_count()} cores, onnxruntime "
             f"{onnxruntime.__version__}; memory read bandwidth (numpy, the higher of before and after the cells) "
             + ", ".join(f"{n} thread(s) {g:.1f} GB/s" for n, g in bw["read_gbs"].items()) + ". "
             "ms = median; x = time / gqa-fp32, xi8 = time / gqa-int8; bw = fraction of the memory bandwidth "
             "measured with the same thread count.",
             "",
             "| dims q/kv/d | ctx | thr | impl | MiB read | ms | x fp32 | x int8 | GB/s | bw |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    key = lambda r: (r["q_heads"], r["kv_heads"], r["head_dim"], r["ctx"], r["threads"])  # noqa: E731
    ref = {key(r) + (r["impl"],): r["ms"] for r in rows}
    for r in rows:
        f32 = ref.get(key(r) + ("gqa-fp32",))
        i8 = ref.get(key(r) + ("gqa-int8",))
        lines.append(
            f"| {r['q_heads']}/{r['kv_heads']}/{r['head_dim']} | {r['ctx']} | {r['threads']} | {r['impl']} | "
            f"{r['bytes'] / 2**20:.2f} | {r['ms']:.3f} | {r['ms'] / f32:.2f} | {r['ms'] / i8:.2f} | "
            f"{r['gb_s']:.1f} | {r['bandwidth_fraction']:.2f} |" if f32 and i8 and r["impl"] not in DIAGNOSTIC else
            f"| {r['q_heads']}/{r['kv_heads']}/{r['head_dim']} | {r['ctx']} | {r['threads']} | {r['impl']} | "
            f"{r['bytes'] / 2**20:.2f} | {r['ms']:.3f} | - | - | {r['gb_s']:.1f} | {r['bandwidth_fraction']:.2f} |")
    return "\n".join(lines)


def pivot(rows) -> str:
    """One line per (dims, ctx, threads): every implementation's ms, ours / GQA int8 and / fp32 (ours = the
    ORT host), our bandwidth fraction."""
    impls = [i for i in ("pagedkv-ort", "pagedkv-et", "pagedkv-ort-spin") if any(r["impl"] == i for r in rows)]
    impls += sorted({r["impl"] for r in rows if r["impl"].startswith("core-")})
    impls += [i for i in ("gqa-fp32", "gqa-int8", "gqa-int4", "et-custom-sdpa") if any(r["impl"] == i for r in rows)]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["q_heads"], r["kv_heads"], r["head_dim"], r["ctx"], r["threads"]), {})[r["impl"]] = r
    head = ["q/kv heads, head_dim", "ctx", "threads"] + impls + ["ours / GQA int8", "paired", "ours / GQA fp32",
                                                                  "ours bw"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
    for (hq, hkv, d, ctx, thr), c in cells.items():
        ours = c.get("pagedkv-ort")
        ratio = lambda ref: f"{ours['ms'] / c[ref]['ms']:.2f}" if ours and ref in c else "-"  # noqa: E731
        vals = ["-" if i not in c else f"{c[i]['ms']:.3f}" if c[i]["ms"] < 10 else f"{c[i]['ms']:.2f}" for i in impls]
        ctx_s = f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)
        lines.append(f"| {hq}/{hkv}/{d} | {ctx_s} | {thr} | " + " | ".join(vals)
                     + f" | {ratio('gqa-int8')} | "
                     + (f"{ours['paired_x_gqa-int8']:.2f}" if ours and "paired_x_gqa-int8" in ours else "-")
                     + f" | {ratio('gqa-fp32')} | "
                     + (f"{ours['bandwidth_fraction']:.2f}" if ours else "-") + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
