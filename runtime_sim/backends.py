"""Backends the engine runs on. Each keeps the pool tensors and runs one step of the graph.

- TorchBackend: the compiled PagedModel in eager PyTorch (the reference).
"""

from __future__ import annotations

import numpy as np
import torch

from toolkit.compiler import PagedModel
from toolkit.errors import KernelLibraryMissing, PagedKVError


class TorchBackend:
    name = "torch"

    def __init__(self, paged: PagedModel):
        self.paged = paged
        self.layout = paged.layout

    def forward(self, ids, positions, seq_ids, tables) -> np.ndarray:
        with torch.no_grad():
            logits = self.paged(
                torch.from_numpy(ids)[None],
                torch.from_numpy(positions),
                torch.from_numpy(seq_ids),
                torch.from_numpy(tables),
            )
        return logits[0].float().numpy()

    def copy_block(self, src: int, dst: int) -> None:
        for codes, scales, _ in self.paged.pool_tensors():
            codes[dst] = codes[src]
            if scales.shape[0] > 1:
                scales[dst] = scales[src]

    def copy_stage(self, src_seq: int, dst_seq: int) -> None:
        for _, _, stage in self.paged.pool_tensors():
            if stage.shape[0] > 1:
                stage[dst_seq] = stage[src_seq]


class OrtBackend:
    """The exported .onnx on onnxruntime. Pools are OrtValues bound as both input and output of
    every step (IOBinding), so they are updated in place and never copied between steps."""

    name = "onnxruntime"

    def __init__(self, onnx_path, layout, inputs: list[str], outputs: list[str], native: bool | None = None,
                 threads: int = 0):
        import onnxruntime as ort

        self.layout = layout
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        self.native = False
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
        self.session = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        self.inputs, self.outputs = inputs, outputs
        # numpy arrays own the memory; the OrtValues wrap it without a copy (CPU)
        self.arrays = [t.numpy() for i in range(layout.num_layers) for t in layout.allocate_layer()]
        self.pools = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays]
        self.binding = self.session.io_binding()
        self.binding.bind_output(outputs[0], "cpu")  # first, so get_outputs()[0] is the logits
        for name, out_name, value in zip(inputs[4:], outputs[1:], self.pools):
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(out_name, value)

    def forward(self, ids, positions, seq_ids, tables) -> np.ndarray:
        b = self.binding
        b.bind_cpu_input(self.inputs[0], np.ascontiguousarray(ids[None]))
        b.bind_cpu_input(self.inputs[1], np.ascontiguousarray(positions))
        b.bind_cpu_input(self.inputs[2], np.ascontiguousarray(seq_ids))
        b.bind_cpu_input(self.inputs[3], np.ascontiguousarray(tables))
        b.bind_output(self.outputs[0], "cpu")  # logits change shape with T: let ORT allocate them
        self.session.run_with_iobinding(b)
        return b.get_outputs()[0].numpy()[0]

    def copy_block(self, src: int, dst: int) -> None:
        for i in range(self.layout.num_layers):
            for a in (self.arrays[3 * i], self.arrays[3 * i + 1]):
                if a.shape[0] > 1:
                    a[dst] = a[src]

    def copy_stage(self, src_seq: int, dst_seq: int) -> None:
        for i in range(self.layout.num_layers):
            a = self.arrays[3 * i + 2]
            if a.shape[0] > 1:
                a[dst_seq] = a[src_seq]


class ExecuTorchBackend:
    """The exported .pte on the ExecuTorch runtime (portable_lib) with the pagedkv kernel library.

    The pool lives in the program's mutable buffers (one memory arena per layer); the runtime
    allocates those arenas when the program loads and the op updates them in place every step."""

    name = "executorch"

    def __init__(self, pte_path, layout, entry: dict):
        import torch  # noqa: F401  (portable_lib needs torch's libraries loaded)

        from toolkit.native import load_executorch_kernels

        load_executorch_kernels()
        from executorch.extension.pybindings.portable_lib import _load_for_executorch

        self.layout = layout
        self.max_tokens = int(entry.get("max_tokens_per_call", 64))
        self.module = _load_for_executorch(str(pte_path))

    def forward(self, ids, positions, seq_ids, tables) -> np.ndarray:
        if len(ids) > self.max_tokens:
            raise PagedKVError(
                f"{len(ids)} tokens in one call, the .pte accepts at most {self.max_tokens}: lower the prefill "
                "chunk or re-export with a larger --max-tokens-per-call."
            )
        out = self.module.forward(
            (torch.from_numpy(ids)[None], torch.from_numpy(positions), torch.from_numpy(seq_ids),
             torch.from_numpy(tables))
        )
        return out[0][0].numpy()

    def copy_block(self, src: int, dst: int) -> None:
        raise PagedKVError(
            "copy-on-write (fork of a conversation with a partial last block) is not available on the "
            "executorch backend: the pool lives inside the program's buffers. Use the onnxruntime backend."
        )

    def copy_stage(self, src_seq: int, dst_seq: int) -> None:
        self.copy_block(src_seq, dst_seq)
