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

8da4w's weights are symmetric round-to-nearest int4: on SmolLM2 (a Q4_1 GGUF, whose blocks are
asymmetric 4-bit grids) 8da4w-e8 costs +65% PPL, KLD 0.58 (benchmarks/results/weights_fidelity_pte.json).
Eager diagnosis (ctx 512 x 3 windows, KLD vs fp32): symmetric int4 linears 0.42, the int4 head 0.12,
XNNPACK's per-token int8 activations 0.020, the int8 embedding 0.0001. Hence "8da4w-asym-e8h8":
  - linears: asymmetric 4-bit blocks of 32 (AsymInt4Linear: XNNPACK's symmetric int4 kernel plus a
    per-block offset linear), exact on GGUF 4-bit grids (every SmolLM2 linear block);
  - activations: int8 with one scale per 192 inputs instead of per token (ChunkedLinear);
  - the LM head: int8 weights, one scale per row (8da8w), the token embedding int8 (embedding_byte).
Eager, same windows: KLD 0.0086, +0.86% PPL, top-1 94.8%. Every linear (block sums and offsets too)
runs on XNNPACK, packed from the mapped file as for 8da4w; only the chunks' slices run outside it.
q/k/v and gate/up are fused (LinearPart) and the offsets run once per linear: the export's time
follows the graph's node count (torch.export and the lowering trace every node through fake tensors in
some 25 passes; about 2 s per activation chunk of a linear here), so a linear has at most MAX_ACT_PIECES
chunks. In a GGUF model some linears are int8 instead (_quantize_asym4, export/linear_inputs.py: where the
offset term cancels the int4 product on the calibration inputs; Qwen2.5-1.5B eager, ctx 512 x 2: KLD 0.20
with int4 everywhere, 0.0068 with 29 of its 112 linears int8). The exported SmolLM2 program (ExecuTorch,
ctx 512 x 8 windows, default KV, before the int8 linears): +0.52% PPL, KLD 0.0084; the runner's peak RSS
at 8K is 223 MiB (216 with 32-token prefill chunks) against llama.cpp's 368 (f16 KV) (BENCHMARKS.md, The
memory a phone sees).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from toolkit.compiler import PagedModel, group_table_names
from export.formats import ASYM_WEIGHTS, PTE_WEIGHTS
from toolkit.errors import PagedKVError
from toolkit.manifest import LOGITS_ROWS, PTE_POOL_METHOD, compact_input_names, pool_identity

POOL_BUFFER_PREFIXES = ("codes_", "scales_", "stage_")


def _quantize_8da4w(model: torch.nn.Module, group_size: int = 32) -> None:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    quantize_(
        model,
        Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size)),
        filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m.in_features % group_size == 0,
    )


ACT_CHUNK = 192  # inputs per int8 activation scale in the 8da4w-asym-e8h8 linears (see ChunkedLinear)
MAX_ACT_PIECES = 8  # the most activation chunks of one linear: each is a node group the export traces ~2 s


def act_chunk(k: int, group: int, most: int = ACT_CHUNK, max_pieces: int = MAX_ACT_PIECES) -> int:
    """The largest multiple of `group` that divides k and is at most `most` inputs, or k/max_pieces when that
    is more (k itself when none is). The export's time follows the linears' pieces (torch.export and the
    XNNPACK lowering trace each through fake tensors in some 25 passes: about 2 s a piece on the AMD EPYC
    here); max_pieces bounds them on wide linears (Qwen2.5-1.5B's down_proj, 8960 inputs: 56 pieces of 160
    without the bound, 8 of 1120 with it)."""
    most = min(max(most, -(-k // max_pieces)), k)
    for c in range(most - most % group, 0, -group):
        if k % c == 0:
            return c
    return k


class ChunkedLinear(torch.nn.Module):
    """y = sum_i x[.., chunk i] @ W[:, chunk i]^T + bias: one XNNPACK linear per chunk of inputs, so
    each chunk's activations get their own int8 scale. XNNPACK's dynamic quantization has one scale per
    token over all K inputs, and SmolLM2's activations have outlier channels that then take the int8
    range from the rest: one scale per 192 inputs halves the KLD of per-token scales (eager, SmolLM2,
    ctx 512 x 3 windows, 0.0243 -> 0.0108). The weights are the same bytes, split by columns."""

    def __init__(self, pieces: list, bias: torch.Tensor | None = None):
        super().__init__()
        self.pieces = torch.nn.ModuleList(pieces)
        self.widths = [p.in_features for p in pieces]
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    def _cols(self, x: torch.Tensor, start: int, width: int) -> torch.Tensor:
        # x itself for a single chunk: a slice of all columns would export as a copy outside XNNPACK
        return x if width == x.shape[-1] else x[..., start:start + width]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The quantized product of x (without the bias)."""
        y, start = None, 0
        for i, width in enumerate(self.widths):
            part = self.pieces[i](self._cols(x, start, width))
            y = part if y is None else y + part
            start += width
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        return y if self.bias is None else y + self.bias


class AsymInt4Linear(ChunkedLinear):
    """y = x W^T with W stored as asymmetric 4-bit blocks (scale s, zero point zp per `group` inputs),
    run on XNNPACK's symmetric int4 kernel (qb4w): s*(q - zp) = s*(q - 8) + s*(8 - zp), so

        y = sum_c 8da4w(x_c; codes q - 8, scale s) + sums(x) @ offsets^T,  offsets[n, b] = s*(8 - zp)

    with one 8da4w linear per chunk x_c of inputs (ChunkedLinear: one int8 activation scale per chunk)
    and the offsets once over all K inputs: sums(x) [rows, K/group] are the block sums of x, computed as
    x.reshape(-1, group) @ ones[1, group]^T then .reshape(-1, K/group) (a -1 reshape is XNNPACK's
    static_reshape with the token count inferred, so all of it stays in the linears' XNNPACK partition),
    then one fp32 linear with the offsets (1/group of the int4 work). The block sums were a [K/group, K]
    fp32 0/1 matrix before, one per linear: 12 MiB of SmolLM2's .pte and XNNPACK packs a copy of each.
    Left out when every offset is 0 (a Q4_0-style grid). XNNPACK stores the scales as bf16: s is rounded to bf16 here so the eager module
    computes what the program does, and the offsets keep the exact s (W's error is then at most
    |q-8| * |bf16(s) - s|). Blocks on a 16-level affine grid (a GGUF Q4_0 / Q4_1 / Q4_K model's
    dequantization) are stored exactly; other blocks are asymmetric round-to-nearest
    (export.onnx_export.pack_int4_affine)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 32,
                 chunk: int = ACT_CHUNK, max_pieces: int = MAX_ACT_PIECES):
        import numpy as np
        from torchao.quantization import IntxUnpackedToInt8Tensor
        from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
            IntxUnpackedToInt8TensorActivationQuantization as ActQ)

        from export.onnx_export import pack_int4_affine

        n, k = weight.shape
        packed, scale, zp, exact = pack_int4_affine(weight.detach().float().numpy().T, group)
        codes = torch.from_numpy(np.stack((packed & 15, packed >> 4), axis=-1).reshape(n, k).astype(np.int8) - 8)
        s = torch.from_numpy(scale).reshape(n, k // group)
        s_bf16 = s.to(torch.bfloat16).float()
        c = act_chunk(k, group, chunk, max_pieces)
        pieces = []
        for i in range(0, k, c):
            piece = torch.nn.Linear(c, n, bias=False)
            piece.weight = torch.nn.Parameter(IntxUnpackedToInt8Tensor(
                qdata=codes[:, i:i + c].contiguous(), scale=s_bf16[:, i // group:(i + c) // group].contiguous(),
                zero_point=torch.zeros(n, c // group, dtype=torch.int8), target_dtype=torch.int4,
                block_size=(1, group), dtype=torch.float32, activation_quantization=ActQ.INT8_ASYM_PER_TOKEN),
                requires_grad=False)
            pieces.append(piece)
        super().__init__(pieces, bias)
        self.group, self.nb, self.exact_blocks, self.out_rows = group, k // group, exact, n
        offsets = (s * (8 - torch.from_numpy(zp).reshape(n, self.nb))).float()
        self.offsets = self.block_ones = None
        if offsets.any():
            self.offsets = torch.nn.Parameter(offsets.contiguous(), requires_grad=False)
            self.block_ones = torch.nn.Parameter(torch.ones(1, group), requires_grad=False)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        # the block offsets over all K inputs at once (fp32), not per activation chunk
        y = super().product(x)
        if self.offsets is None:
            return y
        sums = torch.nn.functional.linear(x.reshape(-1, self.group), self.block_ones).reshape(-1, self.nb)
        off = torch.nn.functional.linear(sums, self.offsets)  # [rows, n]
        # the exported program's x is [1, T, K] (or [T, K]): [T, n] broadcasts onto y without a reshape
        # that names the token count (a symbolic reshape would leave XNNPACK); eager batches reshape
        if x.dim() > 2 and math.prod(x.shape[:-2]) != 1:
            off = off.reshape(y.shape)
        return y + off


class _SharedInput:
    """What the parts of one fused linear share: the input they were last called with and its product
    (plain attributes, not module state: torch.export refuses tensors assigned to modules in forward)."""

    def __init__(self, fused: torch.nn.Module, n_parts: int):
        self.fused, self.n_parts = fused, n_parts
        self.x = self.y = None
        self.left: set = set()


class LinearPart(torch.nn.Module):
    """Output columns [start, stop) of a linear fused from sibling projections of one input (q/k/v,
    gate/up). The first part called with an input computes the fused product; the other parts called
    with that same tensor take their columns of it. A part called with any other input computes the
    product for it: the result never depends on call order, only the work does. Fusing keeps every
    number (the same int8 activation scale per chunk of the shared input, the same weights) and divides
    the graph's linear nodes, whose count sets the export's time (torch.export + XNNPACK lowering run
    every node through fake tensors in some 25 passes)."""

    def __init__(self, shared: _SharedInput, index: int, start: int, stop: int):
        super().__init__()
        if index == 0:
            self.fused = shared.fused  # registered once, under the first part
        self.shared, self.index, self.start, self.stop = shared, index, start, stop
        self.in_features, self.out_features = sum(shared.fused.widths), stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sh = self.shared
        if sh.x is not x or self.index not in sh.left:
            sh.x, sh.y, sh.left = x, sh.fused(x), set(range(sh.n_parts))
        sh.left.discard(self.index)
        y = sh.y[..., self.start:self.stop].contiguous()  # callers .view() it
        if not sh.left:
            sh.x = sh.y = None
        return y


# sibling projections that read the same input, fused into one linear (Llama, Qwen, Mistral, Gemma names)
FUSE_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 32, chunk: int = ACT_CHUNK,
                 max_pieces: int = MAX_ACT_PIECES) -> ChunkedLinear:
    """A linear as 8da8w (int8 weights, a scale per output row and chunk) in ChunkedLinear pieces. The LM
    head: at 4 bits SmolLM2's head alone cost +12.8% PPL (eager, ctx 512 x 3 windows), at 8 bits +1.4%.
    And the linears that int4 serves badly in a GGUF model (_quantize_asym4)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    n, k = weight.shape
    c = act_chunk(k, group, chunk, max_pieces)
    pieces = []
    for i in range(0, k, c):
        piece = torch.nn.Linear(c, n, bias=False)
        piece.weight = torch.nn.Parameter(weight.detach()[:, i:i + c].float().contiguous(), requires_grad=False)
        quantize_(piece, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)))
        pieces.append(piece)
    return ChunkedLinear(pieces, bias)


# In a model whose linears lie on a 4-bit grid (a GGUF's Q4 dequantization: a linear is on it when at least
# MIN_GRID_FRACTION of its sampled blocks are), a linear is stored as int8 (_int8_linear) instead of int4
# when int4 multiplies its output error on the calibration inputs by more than INT8_GAIN
# (export/linear_inputs.py). Qwen2.5-1.5B (eager, ctx 512 x 2): 29 of 112 linears int8, KLD 0.0068 where
# int4 everywhere measures 0.20. A model off the grid (fp16/fp32 weights) keeps int4 everywhere: every
# linear is rounded then, and 8 bits would double its size.
INT8_GAIN = 2.0
MIN_GRID_FRACTION = 0.5
GRID_SAMPLE_ROWS = 64  # rows of each weight whose blocks say whether it is on the grid


def grid_fraction(weight: torch.Tensor, group: int = 32, rows: int = GRID_SAMPLE_ROWS) -> float:
    """The fraction of the first `rows` rows' blocks of `group` inputs that lie on a 16-level affine grid
    (export.onnx_export.grid_steps, as pack_int4_affine stores them exactly)."""
    import numpy as np

    from export.onnx_export import grid_steps

    x = weight.detach()[:rows].double().numpy().reshape(-1, group)
    return float(np.isfinite(grid_steps(x)).mean())


def _quantize_asym4(model: torch.nn.Module, group_size: int = 32, chunk: int = ACT_CHUNK,
                    max_pieces: int = MAX_ACT_PIECES, inputs: dict | None = None) -> dict:
    """Every Linear but the LM head -> AsymInt4Linear, sibling projections of one input (FUSE_SIBLINGS)
    fused into one linear behind LinearParts; the head -> _int8_linear (activation chunks:
    act_chunk(K, group_size, chunk, max_pieces)). In a model on the 4-bit grid, a linear that int4 serves
    badly on its calibration inputs -> _int8_linear too (INT8_GAIN; inputs: {linear's qualified name: sample
    inputs [rows, K]}, linear_inputs.sample_linear_inputs; None: int4 everywhere). Returns the int4 block
    counts and how many linears (fused ones counted once) are int4 and int8."""
    from export.linear_inputs import relative_error

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inputs = inputs or {}
    total = exact = int4 = int8 = 0

    def quantizable(mod) -> bool:
        return isinstance(mod, torch.nn.Linear) and mod is not head and mod.in_features % group_size == 0

    grid_model = any(grid_fraction(m.weight, group_size) >= MIN_GRID_FRACTION
                     for m in model.modules() if quantizable(m))

    def linear(weight, bias, x):
        nonlocal total, exact, int4, int8
        q = AsymInt4Linear(weight, bias, group_size, chunk, max_pieces)
        if grid_model and x is not None:
            q8 = _int8_linear(weight, bias, group_size, chunk, max_pieces)
            if relative_error(q, x, weight) > INT8_GAIN * relative_error(q8, x, weight):
                int8 += 1
                return q8
        int4 += 1
        total += q.nb * q.out_rows
        exact += q.exact_blocks
        return q

    for pname, parent in list(model.named_modules()):
        qual = (lambda child: f"{pname}.{child}") if pname else (lambda child: child)  # noqa: E731
        for names in FUSE_SIBLINGS:
            mods = [getattr(parent, n, None) for n in names]
            if not all(quantizable(m) for m in mods) or len({m.in_features for m in mods}) > 1:
                continue
            weight = torch.cat([m.weight.detach() for m in mods])
            has_bias = [m.bias is not None for m in mods]
            bias = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features)
                              for m in mods]) if any(has_bias) else None
            q = linear(weight, bias, inputs.get(qual(names[0])))
            shared, start = _SharedInput(q, len(names)), 0
            for i, (name, m) in enumerate(zip(names, mods)):
                setattr(parent, name, LinearPart(shared, i, start, start + m.out_features))
                start += m.out_features
        for name, child in list(parent.named_children()):
            if child is head and isinstance(child, torch.nn.Linear) and child.in_features % group_size == 0:
                setattr(parent, name, _int8_linear(child.weight, child.bias, group_size, chunk, max_pieces))
            elif quantizable(child):
                setattr(parent, name, linear(child.weight, child.bias, inputs.get(qual(name))))
    return {"int4_blocks": total, "int4_exact_blocks": exact, "int4_linears": int4, "int8_linears": int8}


def _own_float_tensors(model: torch.nn.Module) -> int:
    """Give every plain (not quantized) parameter and buffer of `model` its own memory; returns their
    bytes. The weights transformers loads from safetensors live in the file's memory map, which stays
    mapped while any tensor of it does: after quantization only norms, biases and the like are left of
    it, but every page the calibration read (all the fp32 weights: 6 GiB of Qwen2.5-1.5B) stays in the
    process's resident set through the lowering. With the last tensor of the map gone, so are its pages."""
    import gc

    copied = 0
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or type(t) not in (torch.Tensor, torch.nn.Parameter):
                    continue
                own = t.detach().clone()
                table[name] = torch.nn.Parameter(own, requires_grad=False) if isinstance(t, torch.nn.Parameter) else own
                copied += own.numel() * own.element_size()
    gc.collect()
    return copied


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


class CompactInputs(torch.nn.Module):
    """The program of a model with a compact region (the compact tier, issue 25): forward(input_ids,
    positions, seq_ids, block_tables, *more_tables, *compact, logits_rows) with the region's tensors
    (compact_codes_i, compact_scales_i of each of paged.compact_layers()) as inputs, read by the mixed op.
    As buffers they would become constants of the program (the op never writes them): zeros stored in
    the file, in memory the runtime cannot write. As inputs that are not memory-planned
    (MemoryPlanningPass(alloc_graph_input=False)) the runtime owns them: ExecuTorch reads the caller's
    memory in place, and the runtime re-quantizes blocks into it between steps."""

    def __init__(self, paged: PagedModel):
        super().__init__()
        self.paged = paged
        self.layers = paged.compact_layers()

    def forward(self, input_ids, positions, seq_ids, block_tables, *rest, logits_rows=None):
        g = len(self.paged.groups) - 1
        tables, flat = (block_tables, *rest[:g]), rest[g:]
        compact = {i: tuple(flat[2 * j:2 * j + 2]) for j, i in enumerate(self.layers)}
        logits, _ = self.paged.run(input_ids, positions, seq_ids, tables, self.paged.pool_tensors(), functional=False,
                                   logits_rows=logits_rows, compact=compact)
        return logits


def _without_compact_buffers(paged: PagedModel):
    """The compact buffers taken off `paged` (restored on exit): the program reads the region from its inputs."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        saved = {name: paged._buffers.pop(name) for name in list(paged._buffers) if name.startswith("compact_")}
        try:
            yield
        finally:
            paged._buffers.update(saved)

    return ctx()


def export_pte(paged: PagedModel, path: Path, weights: str = "fp32", layers_per_arena: int = 1,
               max_tokens: int = 128, max_logits_rows: int | None = None, progress=None,
               linear_inputs: dict | None = None) -> dict:
    """Write the .pte; returns its manifest entry (without sha256). A model with a compact region takes
    it as inputs (CompactInputs, between the tables and logits_rows); without one the program is the one
    exported before the compact tier. max_logits_rows: the most logits rows one call computes (None: as
    many as its tokens). The memory planner sizes the logits buffer for it: at SmolLM2's vocabulary
    64 rows take 12 MiB of the activation arena, 1 row (a chat on a phone) 192 KiB. linear_inputs: the
    linears' calibration inputs (export/linear_inputs.py), by which 8da4w-asym-e8h8 stores some linears as
    int8 (_quantize_asym4); None: int4 everywhere."""
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    from export.stages import StageClock

    layout = paged.layout
    clock = StageClock(progress)
    quant_info = {}
    if weights in ("8da4w", "8da4w-e8"):
        _quantize_8da4w(paged.hf)
    elif weights == ASYM_WEIGHTS:
        quant_info = _quantize_asym4(paged.hf, inputs=linear_inputs)
    elif weights != "fp32":
        raise PagedKVError(f"weights '{weights}' cannot be exported to .pte: use one of {', '.join(PTE_WEIGHTS)}.")
    if weights in ("8da4w-e8", ASYM_WEIGHTS):
        import executorch.kernels.quantized  # noqa: F401  (registers the quantized_decomposed out variants)

        _quantize_embeddings_int8(paged.hf)
    if weights != "fp32":
        _own_float_tensors(paged.hf)
        clock.done(f"quantizing weights to {weights}", f"{quant_info['int4_linears']} linears int4, "
                   f"{quant_info['int8_linears']} int8; {quant_info['int4_exact_blocks']} of {quant_info['int4_blocks']} "
                   "int4 blocks on a 4-bit grid, stored exactly" if quant_info else "")
    # block tables can be wider than the pool when the sliding policy leaves holes (-1) behind
    max_blocks = max(layout.num_blocks, 4096)
    t = torch.export.Dim("T", min=1, max=max_tokens)
    m = torch.export.Dim("M", min=1, max=max_blocks)
    # one block table per layer group (the first alone for a model without sliding layers)
    tables = [torch.zeros(layout.max_seqs, 2, dtype=torch.int64) for _ in paged.groups]
    example = (torch.zeros(1, 2, dtype=torch.int64), torch.arange(2), torch.zeros(2, dtype=torch.int64), *tables)
    names = ["input_ids", "positions", "seq_ids", "block_tables"]
    dyn = dict(zip(names, ({1: t}, {0: t}, {0: t}, {1: m})))
    compact_layers = paged.compact_layers()
    compact = [x for i in compact_layers for x in paged.compact_pool_tensors()[i]]
    if len(tables) > 1 or compact:  # *more_tables (+ *compact): one varargs entry (none at all for one table)
        dyn["rest" if compact else "more_tables"] = tuple([{1: m} for _ in tables[1:]] + [None] * len(compact))
    # logits_rows: the rows of the call whose logits the program computes (the program's last input);
    # one row is a static shape (torch.export specializes a dimension whose max is 1)
    rows = min(max_logits_rows or max_tokens, max_tokens)
    example_rows = torch.tensor([0, 1][:min(rows, 2)])
    dyn[LOGITS_ROWS] = {0: torch.export.Dim("R", min=1, max=rows)} if rows > 1 else None
    with torch.no_grad():
        if compact:
            with _without_compact_buffers(paged):
                exported = torch.export.export(CompactInputs(paged), (*example, *compact),
                                               kwargs={LOGITS_ROWS: example_rows}, dynamic_shapes=dyn,
                                               strict=False)
        else:
            exported = torch.export.export(paged, example, kwargs={LOGITS_ROWS: example_rows},
                                           dynamic_shapes=dyn, strict=False)
    clock.done("torch.export")
    # what the program bakes in about its pool, as a constant method the runtime compares with the manifest
    identity = json.dumps(pool_identity(layout, paged.groups)).encode("utf-8")
    edge = to_edge_transform_and_lower(exported, partitioner=[_partitioner()], constant_methods={
        PTE_POOL_METHOD: torch.tensor(list(identity), dtype=torch.uint8)})
    clock.done("to_edge and XNNPACK lowering")
    arenas = PoolArenas(layout.num_layers, layers_per_arena)
    # a compact region's inputs are the runtime's memory (CompactInputs): graph inputs are not planned then
    planning = MemoryPlanningPass(memory_planning_algo=arenas, **({"alloc_graph_input": False} if compact else {}))
    et = edge.to_executorch(
        ExecutorchBackendConfig(memory_planning_pass=planning,
                                # dequantize + embedding -> embedding_byte (a no-op without quantized weights)
                                do_quant_fusion_and_const_prop=weights in ("8da4w-e8", ASYM_WEIGHTS))
    )
    clock.done("memory planning and emitting")
    path = Path(path)
    path.write_bytes(et.buffer)
    clock.done("serializing")
    sizes = list(et.executorch_program.execution_plan[0].non_const_buffer_sizes)
    return {
        "file": path.name,
        "weights": weights,
        "inputs": ["input_ids", "positions", "seq_ids"] + group_table_names(paged.groups)
        + compact_input_names(compact_layers) + [LOGITS_ROWS],
        "outputs": ["logits"],
        "max_tokens_per_call": max_tokens,
        "max_logits_rows": rows,
        "max_blocks_per_seq": max_blocks,
        "layers_per_arena": arenas.layers_per_arena,
        # non_const_buffer_sizes[0] is reserved; [1] activations; [2..] one per group of layers' pools
        "arena_bytes": sizes[1:],
        "largest_arena_bytes": max(sizes[1:]) if len(sizes) > 1 else 0,
        "stages": clock.rows,
        **quant_info,
    }
