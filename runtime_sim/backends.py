"""Backends the engine runs on. Each keeps the pool tensors and runs one step of the graph.

- TorchBackend: the compiled PagedModel in eager PyTorch (the reference).
- OrtBackend: the .onnx on onnxruntime (pools bound in place with IOBinding).
- ExecuTorchBackend: the .pte on ExecuTorch's runtime (pools are the program's mutable buffers).

Every backend exposes its pools as numpy views, `pool_arrays()` -> [(codes, scales, stage)] per layer;
block and stage copies (fork / copy-on-write) are written once on top of them.

A model with a compact region (the compact tier, issue 25; the manifest's pool.compact /
num_compact_blocks) has, in each layer of its global group, two more tensors the graph reads
(compact_codes_i, compact_scales_i): the torch backend holds them as the model's buffers, the
onnxruntime and ExecuTorch backends allocate them from the manifest and pass them as inputs.
`compact_block(src, dst)` re-quantizes default block src into compact block dst in every such layer
(toolkit.quant.compact_block's numbers: runtime_sim/compact.py drives it between steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from toolkit.errors import ArtifactError, KernelLibraryMissing, PagedKVError
from toolkit.manifest import LOGITS_ROWS, compact_input_layers
from toolkit.pool_layout import zeros_aligned

if TYPE_CHECKING:  # torch (and transformers) only where a backend needs them: not for onnxruntime
    from toolkit.compiler import PagedModel


def copy_pool_block(backend, src: int, dst: int, layers=None) -> None:
    """Copy block src to block dst in every layer, or in `layers` (one layer group's; each group has
    its own block ids) (codes and scales; float pools have no scales)."""
    pools = backend.pool_arrays()
    for codes, scales, _ in (pools if layers is None else [pools[i] for i in layers]):
        codes[dst] = codes[src]
        if scales.shape[0] > 1:
            scales[dst] = scales[src]


def allocate_compact(layout, layers) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Zeroed compact regions (compact_codes, compact_scales) of the given layers, from the layout."""
    return {i: (zeros_aligned(layout.compact_codes_shape(), "uint8"), zeros_aligned(layout.compact_scales_shape(),
                                                                                    "float16"))
            for i in layers}


def check_compact_ids(layout, src: int, dst: int) -> None:
    if not 0 <= src < layout.num_blocks or not 0 <= dst < layout.num_compact_blocks:
        raise PagedKVError(f"compact_block({src}, {dst}): the source must be a default block (0..{layout.num_blocks - 1}) "
                           f"and the destination a compact block index (0..{layout.num_compact_blocks - 1}).")


def copy_pool_stage(backend, src_seq: int, dst_seq: int) -> None:
    """Copy the fp16 sink/tail stage rows of sequence slot src_seq to dst_seq in every layer."""
    for _, _, stage in backend.pool_arrays():
        if stage.shape[0] > 1:
            stage[dst_seq] = stage[src_seq]


class TorchBackend:
    name = "torch"

    def __init__(self, paged: PagedModel):
        self.paged = paged
        self.layout = paged.layout
        self.groups = paged.groups

    def forward(self, ids, positions, seq_ids, tables, rows=None) -> np.ndarray:
        """tables: one [S, M] array, or a list of one per layer group. rows: the indices into this call's
        tokens whose logits are wanted ([len(rows), vocab]; None: every token's). Every backend's forward
        has this contract."""
        import torch

        tables = tables if isinstance(tables, list) else [tables]
        with torch.no_grad():
            logits = self.paged(
                torch.from_numpy(ids)[None],
                torch.from_numpy(positions),
                torch.from_numpy(seq_ids),
                *[torch.from_numpy(t) for t in tables],
                logits_rows=None if rows is None else torch.as_tensor(rows, dtype=torch.int64),
            )
        return logits[0].float().numpy()

    def pool_arrays(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return [tuple(t.numpy() for t in layer) for layer in self.paged.pool_tensors()]

    def compact_arrays(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """layer -> numpy views of (compact_codes, compact_scales) ({} without a compact region)."""
        return {i: tuple(t.numpy() for t in pair) for i, pair in self.paged.compact_pool_tensors().items()}

    copy_block = copy_pool_block
    copy_stage = copy_pool_stage

    def compact_block(self, src: int, dst: int) -> None:
        """Re-quantize default block src into compact block dst (an index of the compact region) in every
        layer that has one (toolkit.quant.compact_block; the compact tier, runtime_sim/compact.py)."""
        from toolkit.quant import compact_block

        lay = self.layout
        pools = self.paged.pool_tensors()
        for i, (ccodes, cscales) in self.paged.compact_pool_tensors().items():
            codes, scales, _ = pools[i]
            compact_block(codes, scales, ccodes, cscales, src, dst, lay.spec, lay.compact, lay.head_dim)


class OrtBackend:
    """The exported .onnx on onnxruntime. Pools are OrtValues bound as both input and output of
    every step (IOBinding), so they are updated in place and never copied between steps."""

    name = "onnxruntime"

    def __init__(self, onnx_path, layout, inputs: list[str], outputs: list[str], native: bool | None = None,
                 threads: int = 0, manifest_layout=None, groups=None):
        import onnxruntime as ort

        self.layout = layout
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        self.native = False
        # threads of the pagedkv kernel (native only): it runs on the session's intra-op threads
        self.kernel_threads = None
        if native is not False:
            from toolkit import native as native_lib

            if native is None:  # use the kernel when it has been built
                try:
                    native_lib.ort_library_path()
                    native = True
                except KernelLibraryMissing:
                    native = False
        if native:
            so.register_custom_ops_library(str(native_lib.ort_library_path()))
            self.native = True
        try:
            self.session = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types on a damaged file
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ArtifactError(f"onnxruntime cannot load {onnx_path} ({msg[:200]}): re-run `pagedkv export`.") from None
        # the graph against the manifest: its inputs, pool shapes/dtypes and baked-in pool identity
        from toolkit.manifest import ONNX_POOL_KEY, check_graph_pool

        check_graph_pool(
            str(onnx_path), manifest_layout or layout, inputs,
            [(i.name, list(i.shape), i.type) for i in self.session.get_inputs()],
            self.session.get_modelmeta().custom_metadata_map.get(ONNX_POOL_KEY), groups,
        )
        if [o.name for o in self.session.get_outputs()] != list(outputs):
            raise ArtifactError(f"{onnx_path}: the graph's outputs are not the manifest's: re-run `pagedkv export`.")
        if self.native:  # 0: onnxruntime's default (one thread per physical core)
            self.kernel_threads = threads or None
        self.inputs, self.outputs = inputs, outputs
        self.has_rows = inputs[-1] == LOGITS_ROWS
        self.compact_layers = compact_input_layers(inputs)  # [] without a compact region
        if self.compact_layers and not layout.num_compact_blocks:
            raise ArtifactError(f"{onnx_path} reads a compact region the manifest's pool does not describe: re-run "
                                "`pagedkv export`.")
        self.set_groups(groups)

    def set_groups(self, groups) -> None:
        """Allocate and bind the pools: one global group (None) or the manifest's layer groups, each
        layer's pool with its group's blocks and one block-table input per group."""
        import onnxruntime as ort

        from toolkit.block_pool import layer_layouts

        self.groups = groups
        n_tables = len(groups) if groups else 1
        # numpy arrays own the memory; the OrtValues wrap it without a copy (CPU)
        self.arrays = None  # the previous pools (if any) go before the new ones are made
        self.arrays = [a for lay in layer_layouts(self.layout, groups) for a in lay.allocate_layer_numpy()]
        self.pools = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays]
        self.binding = self.session.io_binding()
        self.binding.bind_output(self.outputs[0], "cpu")  # first, so get_outputs()[0] is the logits
        for name, out_name, value in zip(self.inputs[3 + n_tables:], self.outputs[1:], self.pools):
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(out_name, value)
        # the compact region: inputs only (the graph reads it; compact_block writes it between steps)
        self.compact = allocate_compact(self.layout, self.compact_layers)
        self.compact_values = []
        for i, arrays in self.compact.items():
            for kind, a in zip(("codes", "scales"), arrays):
                self.compact_values.append(ort.OrtValue.ortvalue_from_numpy(a))
                self.binding.bind_ortvalue_input(f"compact_{kind}_{i}", self.compact_values[-1])

    def forward(self, ids, positions, seq_ids, tables, rows=None) -> np.ndarray:
        """tables: one [S, M] array, or a list of one per layer group; rows as TorchBackend.forward. A
        graph with a logits_rows input computes only those rows; an older one computes all and we
        take them."""
        b = self.binding
        b.bind_cpu_input(self.inputs[0], np.ascontiguousarray(ids[None]))
        b.bind_cpu_input(self.inputs[1], np.ascontiguousarray(positions))
        b.bind_cpu_input(self.inputs[2], np.ascontiguousarray(seq_ids))
        for name, table in zip(self.inputs[3:], tables if isinstance(tables, list) else [tables]):
            b.bind_cpu_input(name, np.ascontiguousarray(table))
        if self.has_rows:
            want = np.arange(len(ids), dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
            b.bind_cpu_input(LOGITS_ROWS, np.ascontiguousarray(want))
        b.bind_output(self.outputs[0], "cpu")  # logits change shape with T: let ORT allocate them
        self.session.run_with_iobinding(b)
        logits = b.get_outputs()[0].numpy()[0]
        return logits if self.has_rows or rows is None else logits[np.asarray(rows)]

    def pool_arrays(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return [tuple(self.arrays[3 * i:3 * i + 3]) for i in range(self.layout.num_layers)]

    def compact_arrays(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """layer -> (compact_codes, compact_scales), the arrays the graph reads ({} without a compact region)."""
        return self.compact

    copy_block = copy_pool_block
    copy_stage = copy_pool_stage

    def compact_block(self, src: int, dst: int) -> None:
        """Re-quantize default block src into compact block dst (an index of the compact region) in every
        layer that has one, in numpy (runtime_sim.requant: toolkit.quant.compact_block's bits, no torch)."""
        from runtime_sim.requant import requantize_np

        lay = self.layout
        check_compact_ids(lay, src, dst)
        pools = self.pool_arrays()
        for i, (ccodes, cscales) in self.compact.items():
            codes, scales, _ = pools[i]
            ccodes[dst], cscales[dst] = requantize_np(codes[src], scales[src], lay.spec, lay.compact, lay.head_dim)


def check_pte_pool(module, where: str, layout, groups=None) -> None:
    """The .pte carries its pool identity as a constant method (export/executorch_export.py): compare it
    with the manifest's pool, the way OrtBackend compares the ONNX graph's metadata."""
    import json

    from toolkit.manifest import PTE_POOL_METHOD, pool_identity

    if PTE_POOL_METHOD not in module.method_names():
        raise ArtifactError(f"{where} carries no pool description ({PTE_POOL_METHOD}): it was not made by this "
                            "`pagedkv export`; re-run it.")
    got = bytes(module.run_method(PTE_POOL_METHOD, ())[0].numpy().tobytes()).decode("utf-8", "replace")
    from toolkit.manifest import check_identity

    check_identity(where, pool_identity(layout, groups), got)


class ExecuTorchBackend:
    """The exported .pte on the ExecuTorch runtime (portable_lib) with the pagedkv kernel library.

    The pool lives in the program's mutable buffers (one memory arena per layer); the runtime
    allocates those arenas when the program loads and the op updates them in place every step. The
    kernel library reports where they are (toolkit.native.et_pool_arrays); this backend takes those
    views right after its own first step (the program's planned memory does not move afterwards), so
    they stay its own even when other programs run later."""

    name = "executorch"

    def __init__(self, pte_path, layout, entry: dict, threads: int = 0, groups=None):
        import torch  # portable_lib needs torch's libraries loaded (and the compact inputs are torch views)

        from toolkit.native import load_executorch_kernels

        load_executorch_kernels()
        from executorch.extension.pybindings import portable_lib

        # threads > 0 resizes ExecuTorch's threadpool, which the linears (XNNPACK) and the pagedkv
        # kernels share; the pool is one per process, so this applies to every program in it
        if threads > 0:
            portable_lib._unsafe_reset_threadpool(threads)
        self.kernel_threads = int(portable_lib._threadpool_get_thread_count())

        self.layout = layout
        self.groups = groups  # the manifest's layer groups (one block table each), None: one global group
        self.max_tokens = int(entry.get("max_tokens_per_call", 64))
        self.has_rows = entry.get("inputs", [None])[-1] == LOGITS_ROWS
        # the most logits rows one call computes (export --max-logits-rows); a call that needs more is split
        self.max_rows = entry.get("max_logits_rows", self.max_tokens)
        if type(self.max_rows) is not int or self.max_rows < 1:
            raise ArtifactError(f"{pte_path}: the manifest's max_logits_rows {self.max_rows!r} is not a positive "
                                "integer: re-run `pagedkv export`.")
        try:
            self.module = portable_lib._load_for_executorch(str(pte_path))
        except Exception as e:  # the runtime raises RuntimeError with its own error code on a damaged file
            raise ArtifactError(f"ExecuTorch cannot load {pte_path} ({str(e)[:200]}): re-run `pagedkv export`.") from None
        check_pte_pool(self.module, str(pte_path), layout, groups)
        self._pools = None  # numpy views of the program's pool buffers, known after the first step
        # the compact region: this backend's memory, read by the program in place (an input it does not plan)
        layers = compact_input_layers(entry.get("inputs", []))
        if layers and not layout.num_compact_blocks:
            raise ArtifactError(f"{pte_path} reads a compact region the manifest's pool does not describe: re-run "
                                "`pagedkv export`.")
        self.compact = allocate_compact(layout, layers)
        self._compact_inputs = [torch.from_numpy(a) for pair in self.compact.values() for a in pair]

    def forward(self, ids, positions, seq_ids, tables, rows=None) -> np.ndarray:
        """rows as TorchBackend.forward: a program with a logits_rows input computes only those rows;
        an older one computes all and we take them."""
        if len(ids) > self.max_tokens:
            raise PagedKVError(
                f"{len(ids)} tokens in one call, the .pte accepts at most {self.max_tokens}: lower the prefill "
                "chunk or re-export with a larger --max-tokens-per-call."
            )
        want = None
        if self.has_rows:
            want = np.arange(len(ids), dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
            if len(want) > self.max_rows:
                return self._forward_split(ids, positions, seq_ids, tables, want)
        import torch

        tables = tables if isinstance(tables, list) else [tables]
        inputs = [torch.from_numpy(ids)[None], torch.from_numpy(positions), torch.from_numpy(seq_ids),
                  *[torch.from_numpy(t) for t in tables], *self._compact_inputs]
        if self.has_rows:
            inputs.append(torch.from_numpy(np.ascontiguousarray(want)))
        out = self.module.forward(tuple(inputs))
        if self._pools is None:
            from toolkit.native import et_pool_arrays

            self._pools = et_pool_arrays(self.layout, self.groups)
        logits = out[0][0].numpy()
        return logits if self.has_rows or rows is None else logits[np.asarray(rows)]

    def _forward_split(self, ids, positions, seq_ids, tables, want) -> np.ndarray:
        """A call that needs more logits rows than the program computes, as consecutive calls over the
        same tokens that each end at (or before) max_rows of the wanted rows: the pool sees the same writes
        in the same order, as with a smaller prefill chunk."""
        wanted, back = np.unique(want, return_inverse=True)  # ascending, each row once
        parts, start = [], 0
        for i in range(0, len(wanted), self.max_rows):
            group = wanted[i:i + self.max_rows]
            end = int(group[-1]) + 1
            parts.append(self.forward(ids[start:end], positions[start:end], seq_ids[start:end], tables,
                                      rows=group - start))
            start = end
        if start < len(ids):  # tokens after the last wanted row still go into the pool
            self.forward(ids[start:], positions[start:], seq_ids[start:], tables, rows=[len(ids) - start - 1])
        return np.concatenate(parts)[back]

    def pool_arrays(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        if self._pools is None:  # the kernels report the buffers when they first run
            raise PagedKVError("the executorch backend's pool buffers are known after its first step; run one first.")
        return self._pools

    def compact_arrays(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """layer -> (compact_codes, compact_scales), the arrays the program reads ({} without a compact region)."""
        return self.compact

    copy_block = copy_pool_block
    copy_stage = copy_pool_stage

    def compact_block(self, src: int, dst: int) -> None:
        """Re-quantize default block src into compact block dst (an index of the compact region) in every
        layer that has one (toolkit.quant.compact_block on the program's pool buffers and this backend's
        compact arrays)."""
        import torch

        from toolkit.quant import compact_block

        lay = self.layout
        check_compact_ids(lay, src, dst)
        pools = self.pool_arrays()
        for i, (ccodes, cscales) in self.compact.items():
            codes, scales, _ = pools[i]
            compact_block(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(ccodes),
                          torch.from_numpy(cscales), src, dst, lay.spec, lay.compact, lay.head_dim)
