"""ExecuTorch export: the compiled model with its pools as mutable buffers, linears on XNNPACK.

torch.export -> to_edge_transform_and_lower(XnnpackPartitioner) -> to_executorch. The in-place op
mutates the pool buffers, so each step writes K/V straight into the pool (no copies). Memory
planning puts each group of layers' pool tensors into its own memory arena (mem_id 2, 3, ...), so
the runtime allocates the pool as several buffers, none larger than the manifest says, instead of
one big block; everything else (activations) stays in arena 1.

Weights: "fp32", or "8da4w" (int8 dynamic activations, int4 grouped weights through torchao, the
scheme ExecuTorch's own LLM export uses; XNNPACK runs it), or "8da4w-e8": 8da4w plus the token
embedding as int8 with one fp32 scale per row (torchao IntxWeightOnlyConfig, as optimum-executorch's
--qembedding 8w), which ExecuTorch's quant fusion turns into quantized_decomposed::embedding_byte
(kernel: libexecutorch_kernels_quantized, registered by toolkit.native.load_executorch_kernels and
linked by the native runner). SmolLM2's fp32 embedding is 113 MB, more than all its int4 linears;
int8 makes it 28 MB. A tied LM head keeps its own int4 copy: XNNPACK packs its linears'
weights into its own buffers, so the gather cannot share them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from toolkit.compiler import PagedModel, group_table_names
from toolkit.errors import PagedKVError
from toolkit.manifest import PTE_POOL_METHOD, pool_identity

POOL_BUFFER_PREFIXES = ("codes_", "scales_", "stage_")


def _quantize_8da4w(model: torch.nn.Module, group_size: int = 32) -> None:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    quantize_(
        model,
        Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size)),
        filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m.in_features % group_size == 0,
    )


def _quantize_embeddings_int8(model: torch.nn.Module) -> None:
    """Token embeddings to int8, symmetric, one scale per row (the pattern ExecuTorch fuses into
    embedding_byte). Done after the linears: a tied head already has its own quantized copy."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    for mod in model.modules():
        if isinstance(mod, torch.nn.Embedding):
            # padding_idx only shapes gradients; as an argument of aten.embedding it keeps the
            # dequantize + embedding pattern from fusing (then the program has no kernel for it)
            mod.padding_idx = None
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              filter_fn=lambda m, fqn: isinstance(m, torch.nn.Embedding))


def _partitioner():
    """XNNPACK for everything it runs exactly. Its GELU ignores approximate="tanh" (Gemma's
    gelu_pytorch_tanh; measured ~4e-4 logit error on tiny Gemma models), so that GELU stays on
    ExecuTorch's portable kernel."""
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS, GeluConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    class ExactGeluConfig(GeluConfig):
        def check_constraints(self, node, ep) -> bool:
            approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
            return approximate == "none" and super().check_constraints(node, ep)

    configs = [c for c in ALL_PARTITIONER_CONFIGS if c is not GeluConfig] + [ExactGeluConfig]
    return XnnpackPartitioner(configs=configs)


class PoolArenas:
    """A memory-planning algorithm: pool buffers of layer i go to arena 2 + i // layers_per_arena,
    then ExecuTorch's default algorithms plan every tensor as usual."""

    def __init__(self, num_layers: int, layers_per_arena: int):
        from executorch.exir.memory_planning import MemoryPlanningAlgorithmSuite

        self.num_layers = num_layers
        self.layers_per_arena = max(1, layers_per_arena)
        self.suite = MemoryPlanningAlgorithmSuite()
        self.__name__ = "pagedkv_pool_arenas"

    def arena_of(self, fqn: str) -> int | None:
        name = fqn.rsplit(".", 1)[-1]
        for prefix in POOL_BUFFER_PREFIXES:
            if name.startswith(prefix):
                return 2 + int(name[len(prefix):]) // self.layers_per_arena
        return None

    def __call__(self, alignment, specs, graph_module, graph_signature, extra_padding=0):
        from executorch.exir.memory_planning import get_node_tensor_specs

        by_name = dict(graph_signature.inputs_to_buffers) if graph_signature else {}
        for node in graph_module.graph.nodes:
            if node.op == "placeholder" and node.target in by_name:
                arena = self.arena_of(by_name[node.target])
                if arena is not None:
                    for spec in get_node_tensor_specs(node):
                        spec.mem_id = arena
        return self.suite(alignment, specs, graph_module, graph_signature, extra_padding)


def export_pte(paged: PagedModel, path: Path, weights: str = "fp32", layers_per_arena: int = 1,
               max_tokens: int = 128, progress=None) -> dict:
    """Write the .pte; returns its manifest entry (without sha256)."""
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    layout = paged.layout
    if weights in ("8da4w", "8da4w-e8"):
        _quantize_8da4w(paged.hf)
    elif weights != "fp32":
        raise PagedKVError(f"weights '{weights}' cannot be exported to .pte: use fp32, 8da4w or 8da4w-e8.")
    if weights == "8da4w-e8":
        import executorch.kernels.quantized  # noqa: F401  (registers the quantized_decomposed out variants)

        _quantize_embeddings_int8(paged.hf)
    # block tables can be wider than the pool when the sliding policy leaves holes (-1) behind
    max_blocks = max(layout.num_blocks, 4096)
    t = torch.export.Dim("T", min=1, max=max_tokens)
    m = torch.export.Dim("M", min=1, max=max_blocks)
    # one block table per layer group (the first alone for a model without sliding layers)
    tables = [torch.zeros(layout.max_seqs, 2, dtype=torch.int64) for _ in paged.groups]
    example = (torch.zeros(1, 2, dtype=torch.int64), torch.arange(2), torch.zeros(2, dtype=torch.int64), *tables)
    dyn = ({1: t}, {0: t}, {0: t}, {1: m})
    if len(tables) > 1:  # *more_tables: one varargs entry (none at all for one table, as before groups)
        dyn += (tuple({1: m} for _ in tables[1:]),)
    t0 = time.time()
    with torch.no_grad():
        exported = torch.export.export(paged, example, dynamic_shapes=dyn, strict=False)
    if progress:
        progress(f"torch.export done in {time.time() - t0:.0f}s; lowering to XNNPACK")
    t0 = time.time()
    # what the program bakes in about its pool, as a constant method the runtime compares with the manifest
    identity = json.dumps(pool_identity(layout)).encode("utf-8")
    edge = to_edge_transform_and_lower(exported, partitioner=[_partitioner()], constant_methods={
        PTE_POOL_METHOD: torch.tensor(list(identity), dtype=torch.uint8)})
    if progress:
        progress(f"lowered in {time.time() - t0:.0f}s; planning memory")
    arenas = PoolArenas(layout.num_layers, layers_per_arena)
    et = edge.to_executorch(
        ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(memory_planning_algo=arenas),
                                # dequantize + embedding -> embedding_byte (a no-op without quantized weights)
                                do_quant_fusion_and_const_prop=weights == "8da4w-e8")
    )
    path = Path(path)
    path.write_bytes(et.buffer)
    sizes = list(et.executorch_program.execution_plan[0].non_const_buffer_sizes)
    return {
        "file": path.name,
        "weights": weights,
        "inputs": ["input_ids", "positions", "seq_ids"] + group_table_names(paged.groups),
        "outputs": ["logits"],
        "max_tokens_per_call": max_tokens,
        "max_blocks_per_seq": max_blocks,
        "layers_per_arena": arenas.layers_per_arena,
        # non_const_buffer_sizes[0] is reserved; [1] activations; [2..] one per group of layers' pools
        "arena_bytes": sizes[1:],
        "largest_arena_bytes": max(sizes[1:]) if len(sizes) > 1 else 0,
    }
