"""The `pagedkv::quantized_paged_attention` op: its schema, the plain-PyTorch reference, fake impls.

One call handles a flat batch of T new tokens from any number of sequences (prefill chunks and
decode steps mixed). Token t belongs to sequence slot seq_ids[t] at position positions[t]; tokens of
one sequence are contiguous in the call with increasing positions. The op

1. rotates (optional Hadamard) and quantizes each new token's K/V and writes the record into its
   slot block_tables[s, p // bs] * bs + p % bs of the pool (so a block is always quantized, even
   while it is the float tail);
2. copies new tokens of the first block into the sequence's float16 sink stage (spec.sink_blocks);
3. lets each query at position p attend to the keys j <= p of its sequence (and j > p - window),
   reading: the sink block from the sink stage, the query's own block in float16 (from this call's
   inputs, else from the tail stage written by earlier calls) when fp_tail, every other block from
   the quantized pool, dequantized on the fly;
4. stores the float16 copies of each sequence's last block in this call into its tail stage.

Two forms: `quantized_paged_attention` mutates the pool tensors in place (ExecuTorch: pools are
mutable buffers) and has an `.out` overload; `quantized_paged_attention_functional` returns the
updated pools (torch.onnx cannot export mutation).
"""

from __future__ import annotations

import torch

from toolkit.errors import NonFiniteKVError, PagedKVError
from toolkit.quant import dequantize, hadamard, quantize

_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor{a} codes, Tensor{b} scales, Tensor{c} stage, "
    "Tensor positions, Tensor seq_ids, Tensor block_tables, Tensor sinks, int layer, "
    "int k_bits, int v_bits, int k_group, int v_group, bool k_sym, bool v_sym, bool rotate, "
    "bool fp_tail, int sink_blocks, float scale, int window, float softcap"
)
INPLACE_ARGS = _ARGS.format(a="(a!)", b="(b!)", c="(c!)")
FUNCTIONAL_ARGS = _ARGS.format(a="", b="", c="")
SCALAR_ARG_NAMES = (
    "layer", "k_bits", "v_bits", "k_group", "v_group", "k_sym", "v_sym", "rotate",
    "fp_tail", "sink_blocks", "scale", "window", "softcap",
)

# The mixed-table form (the compact tier, POOL_FORMAT.md "Compact region"): two more read-only pool
# tensors after stage, and the compact spec's record fields last. Block ids >= codes.shape[0] in a
# block table name compact block id - codes.shape[0]. A separate op, so that the default op, its
# artifacts and its kernels stay exactly as they are.
_MIXED_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor{a} codes, Tensor{b} scales, Tensor{c} stage, "
    "Tensor compact_codes, Tensor compact_scales, "
    "Tensor positions, Tensor seq_ids, Tensor block_tables, Tensor sinks, int layer, "
    "int k_bits, int v_bits, int k_group, int v_group, bool k_sym, bool v_sym, bool rotate, "
    "bool fp_tail, int sink_blocks, float scale, int window, float softcap, "
    "int ck_bits, int cv_bits, int ck_group, int cv_group, bool ck_sym, bool cv_sym"
)
MIXED_INPLACE_ARGS = _MIXED_ARGS.format(a="(a!)", b="(b!)", c="(c!)")
MIXED_FUNCTIONAL_ARGS = _MIXED_ARGS.format(a="", b="", c="")
COMPACT_SCALAR_ARG_NAMES = ("ck_bits", "cv_bits", "ck_group", "cv_group", "ck_sym", "cv_sym")

_lib = torch.library.Library("pagedkv", "DEF")
_lib.define(f"quantized_paged_attention({INPLACE_ARGS}) -> Tensor")
_lib.define(f"quantized_paged_attention.out({INPLACE_ARGS}, *, Tensor(d!) out) -> Tensor(d!)")
_lib.define(f"quantized_paged_attention_functional({FUNCTIONAL_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")
_lib.define(f"quantized_paged_attention_mixed({MIXED_INPLACE_ARGS}) -> Tensor")
_lib.define(f"quantized_paged_attention_mixed.out({MIXED_INPLACE_ARGS}, *, Tensor(d!) out) -> Tensor(d!)")
_lib.define(f"quantized_paged_attention_mixed_functional({MIXED_FUNCTIONAL_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")


def _check_finite(x: torch.Tensor, name: str, layer: int, positions: torch.Tensor, seq_ids: torch.Tensor):
    bad = ~torch.isfinite(x).all(dim=-1).all(dim=0)  # [T] (x is [Hkv, T, D])
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise NonFiniteKVError(
            f"non-finite {name} (NaN or Inf) at layer {layer}, sequence {int(seq_ids[t])}, position "
            f"{int(positions[t])}: the model produced it before the cache; nothing was written to the pool. "
            "Check the weights/dtype (fp16 overflow?) or the input ids."
        )


def _check_metadata(positions, seq_ids, block_tables, num_blocks: int, block_size: int, layer: int,
                    num_compact: int = 0):
    """The paging metadata of a call (eager only; a few reductions over [T] and [S, M]): every token's
    sequence row and block exist, its position is >= 0, and its slot's block is a real block of the
    default region (new tokens are never written to the compact region, ids num_blocks ..
    num_blocks + num_compact - 1, which the table may name for older blocks). Errors name the bad
    value instead of surfacing as an IndexError or a NaN further down."""
    t = positions.shape[0]
    if seq_ids.shape[0] != t:
        raise PagedKVError(f"{t} positions but {seq_ids.shape[0]} seq_ids: give one of each per token.")
    if t == 0:
        return
    rows, width = block_tables.shape
    bad = (seq_ids < 0) | (seq_ids >= rows)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise PagedKVError(f"seq_ids[{i}]={int(seq_ids[i])} is not a sequence of the block table ({rows} rows): "
                           f"use 0..{rows - 1}.")
    bad = positions < 0
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise PagedKVError(f"positions[{i}]={int(positions[i])} is negative: positions count from 0.")
    col = positions // block_size
    bad = col >= width
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise PagedKVError(f"position {int(positions[i])} of sequence {int(seq_ids[i])} needs block-table column "
                           f"{int(col[i])}, but the table has {width} column(s): allocate a block for it first.")
    blocks = block_tables[seq_ids, col]
    bad = (blocks < 0) | (blocks >= num_blocks)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        b = int(blocks[i])
        what = ("no block (-1)" if b < 0 else f"compact block {b} (id >= {num_blocks})" if b < num_blocks + num_compact
                else f"block {b}, outside the pool of {num_blocks}")
        raise PagedKVError(f"layer {layer}: position {int(positions[i])} of sequence {int(seq_ids[i])} maps to "
                           f"{what}: the block table must give every written token a block of the pool's "
                           "default region.")
    live = block_tables[seq_ids]
    total = num_blocks + num_compact
    bad = live >= total
    if bool(bad.any()):
        extra = f" + {num_compact} compact" if num_compact else ""
        raise PagedKVError(f"the block table names block {int(live[bad].max())}, outside the pool of {num_blocks}"
                           f"{extra} blocks: use ids 0..{total - 1}, or -1 for none.")


def _tracing(x: torch.Tensor) -> bool:
    """True under torch.export / ONNX export (no data-dependent Python decisions allowed)."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (
        torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or isinstance(x, (torch._subclasses.FakeTensor, FunctionalTensor))
    )


def _within_window(dist, window):
    """dist = query position - key position; window <= 0 means unlimited. Works for ints and tensors."""
    if isinstance(window, torch.Tensor):
        return (window <= 0) | (dist < window)
    return dist < window if window > 0 else torch.ones_like(dist, dtype=torch.bool)


def _one_hot_rows(seq_ids, offsets, select, num_rows: int, block_size: int) -> torch.Tensor:
    """[rows, block_size, T] float one-hot: token t lands in (seq_ids[t], offsets[t]) when select[t]."""
    rows = torch.arange(num_rows, device=seq_ids.device)
    offs = torch.arange(block_size, device=seq_ids.device)
    match = (seq_ids[None, None, :] == rows[:, None, None]) & (offsets[None, None, :] == offs[None, :, None])
    return (match & select[None, None, :]).float()


def _update_stage(old: torch.Tensor, one_hot: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
    """old [S, Hkv, bs, D] fp16; one_hot [S, bs, T]; new_rows [T, Hkv, D] -> updated fp16 copy."""
    scattered = torch.einsum("sot,thd->shod", one_hot, new_rows.float())
    hit = one_hot.sum(-1) > 0  # [S, bs]
    return torch.where(hit[:, None, :, None], scattered, old.float()).to(old.dtype)


def _gather_dequantized(codes, scales, idx, hkv: int, bs: int, k_bits, v_bits, k_group, v_group, k_sym, v_sym, d):
    """The blocks idx [n, M] of one region, dequantized: (K, V) [n, Hkv, M*bs, D] float32."""
    n, m = idx.shape
    gathered = codes[idx].permute(0, 2, 1, 3, 4).reshape(n, hkv, m * bs, -1)
    gscales = scales[idx].permute(0, 2, 1, 3, 4).reshape(n, hkv, m * bs, -1)
    kcb = d * k_bits // 8
    ksc = (d // k_group) * (1 if k_sym else 2)
    k_all = dequantize(gathered[..., :kcb], gscales[..., :ksc], k_bits, k_group, k_sym, d)
    v_all = dequantize(gathered[..., kcb:], gscales[..., ksc:], v_bits, v_group, v_sym, d)
    return k_all, v_all


def reference_paged_attention(
    q, k, v, codes, scales, stage, positions, seq_ids, block_tables, sinks, layer,
    k_bits, v_bits, k_group, v_group, k_sym, v_sym, rotate, fp_tail, sink_blocks, scale, window, softcap,
    compact=None,
):
    """Plain-PyTorch semantics of the op. Returns (out [1,T,Hq,D] fp32, codes, scales, stage), new tensors.

    It dequantizes a gathered copy of each query's blocks: clear, not fast; the native kernels
    fuse the dequantization into the dot products instead.

    compact: None, or the mixed op's compact region (compact_codes, compact_scales, ck_bits, cv_bits,
    ck_group, cv_group, ck_sym, cv_sym): block-table ids >= codes.shape[0] read the compact region's
    records (id - codes.shape[0]) with its spec; everything else is as without it.
    """
    _, hq, t, d = q.shape
    hkv = k.shape[1]
    grp = hq // hkv
    bs = codes.shape[2]
    m = block_tables.shape[1]
    quantized = codes.dtype == torch.uint8
    positions = positions.to(torch.int64)
    seq_ids = seq_ids.to(torch.int64)
    block_tables = block_tables.to(torch.int64)

    tracing = _tracing(k)
    nd = codes.shape[0]
    nc = compact[0].shape[0] if compact is not None else 0
    if not tracing:
        _check_metadata(positions, seq_ids, block_tables, nd, bs, layer, nc)
        _check_finite(k[0], "K", layer, positions, seq_ids)
        _check_finite(v[0], "V", layer, positions, seq_ids)

    qt = q[0].transpose(0, 1).float()  # [T, Hq, D]
    kt = k[0].transpose(0, 1).float()  # [T, Hkv, D]
    vt = v[0].transpose(0, 1).float()
    if quantized and rotate:
        qt, kt, vt = hadamard(qt), hadamard(kt), hadamard(vt)

    # 1. write the new tokens' records
    blocks = block_tables[seq_ids, positions // bs]
    offsets = positions % bs
    codes = codes.clone()
    if quantized:
        kc, km = quantize(kt, k_bits, k_group, k_sym)
        vc, vm = quantize(vt, v_bits, v_group, v_sym)
        codes[blocks, :, offsets] = torch.cat((kc, vc), dim=-1)
        scales = scales.clone()
        scales[blocks, :, offsets] = torch.cat((km, vm), dim=-1)
    else:
        codes[blocks, :, offsets] = torch.cat((kt, vt), dim=-1).to(codes.dtype)

    # 2. gather + dequantize every block of each query's sequence (once when the call holds a
    #    single sequence, e.g. a long prefill: then all queries share the gathered keys)
    rows = block_tables[seq_ids]  # [T, M]
    row_ok = (rows >= 0).repeat_interleave(bs, dim=1)  # [T, L]
    shared = not tracing and bool((seq_ids == seq_ids[0]).all())
    idx = rows[:1].clamp(min=0) if shared else rows.clamp(min=0)
    n = idx.shape[0]
    if quantized and not nc:  # the default op: one region (exactly the graph the ONNX function exports)
        k_all, v_all = _gather_dequantized(codes, scales, idx, hkv, bs, k_bits, v_bits, k_group, v_group,
                                           k_sym, v_sym, d)
    elif quantized:  # mixed table: each block from its region, dequantized with its region's spec
        ccodes, cscales, ck_bits, cv_bits, ck_group, cv_group, ck_sym, cv_sym = compact
        in_compact = idx >= nd  # [n, M]
        k_all, v_all = _gather_dequantized(codes, scales, torch.where(in_compact, 0, idx), hkv, bs,
                                           k_bits, v_bits, k_group, v_group, k_sym, v_sym, d)
        kc_all, vc_all = _gather_dequantized(ccodes, cscales, torch.where(in_compact, idx - nd, 0), hkv, bs,
                                             ck_bits, cv_bits, ck_group, cv_group, ck_sym, cv_sym, d)
        sel = in_compact.repeat_interleave(bs, dim=1)[:, None, :, None]  # [n, 1, L, 1]
        k_all = torch.where(sel, kc_all, k_all)
        v_all = torch.where(sel, vc_all, v_all)
    else:
        gathered = codes[idx].permute(0, 2, 1, 3, 4).reshape(n, hkv, m * bs, -1)
        k_all, v_all = gathered[..., :d].float(), gathered[..., d:].float()

    p = positions[:, None]
    j = torch.arange(m * bs)[None, :]
    visible = (j <= p) & row_ok & _within_window(p - j, window)
    use_sink = quantized and sink_blocks > 0
    use_tail = quantized and fp_tail
    quant_mask = visible
    if use_sink:
        quant_mask = quant_mask & (j >= bs)
    if use_tail:
        quant_mask = quant_mask & (j // bs != p // bs)

    keys, vals, masks = [k_all], [v_all], [quant_mask]
    new_stage = stage
    if use_sink or use_tail:
        new_stage = stage.clone()
        k16, v16 = kt.half(), vt.half()
        o = torch.arange(bs)[None, :]
        n_rows = stage.shape[0]
    if use_sink:
        hot = _one_hot_rows(seq_ids, positions, positions < bs, n_rows, bs)
        new_stage[:, 0, 0] = _update_stage(stage[:, 0, 0], hot, k16)
        new_stage[:, 0, 1] = _update_stage(stage[:, 0, 1], hot, v16)
        keys.append(new_stage[seq_ids, 0, 0].float())  # [T, Hkv, bs, D]
        vals.append(new_stage[seq_ids, 0, 1].float())
        sink_mask = (o <= p) & (rows[:, :1] >= 0) & _within_window(p - o, window)
        masks.append(sink_mask)
    if use_tail:
        same_seq = seq_ids[:, None] == seq_ids[None, :]
        earlier = torch.ones(t, t, dtype=torch.bool).tril(-1)
        n_prev = (same_seq & earlier).sum(1, keepdim=True)  # tokens of my sequence before me in this call
        jt = (p // bs) * bs + o  # [T, bs] positions of my block
        dist = p - jt
        in_call = (dist >= 0) & (dist <= n_prev)
        src = (torch.arange(t)[:, None] - dist).clamp(0, t - 1)
        from_call_k = k16[src].permute(0, 2, 1, 3)  # [T, Hkv, bs, D]
        from_call_v = v16[src].permute(0, 2, 1, 3)
        sel = in_call[:, None, :, None]
        keys.append(torch.where(sel, from_call_k, stage[seq_ids, 1, 0]).float())
        vals.append(torch.where(sel, from_call_v, stage[seq_ids, 1, 1]).float())
        tail_mask = (dist >= 0) & _within_window(dist, window)
        if use_sink:
            tail_mask = tail_mask & (p // bs >= sink_blocks)
        masks.append(tail_mask)
        last_pos = torch.where(same_seq, positions[None, :], -1).amax(1)
        hot = _one_hot_rows(seq_ids, offsets, positions // bs == last_pos // bs, n_rows, bs)
        new_stage[:, 1, 0] = _update_stage(stage[:, 1, 0], hot, k16)
        new_stage[:, 1, 1] = _update_stage(stage[:, 1, 1], hot, v16)

    # 3. attention over [quantized keys | sink keys | tail keys] with one softmax
    mask = torch.cat(masks, dim=1)  # [T, L']
    qg = qt.reshape(t, hkv, grp, d)
    if shared:  # quantized keys [1, Hkv, L, D] broadcast over the queries
        s_q = torch.einsum("thgd,hld->thgl", qg, k_all[0])
        s_fp = [torch.einsum("thgd,thld->thgl", qg, kk) for kk in keys[1:]]
        s = torch.cat([s_q] + s_fp, dim=-1) * scale
    else:
        s = torch.einsum("thgd,thld->thgl", qg, torch.cat(keys, dim=2)) * scale
    if isinstance(softcap, torch.Tensor):
        s = torch.where(softcap > 0, torch.tanh(s / softcap) * softcap, s)
    elif softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    sink_logit = sinks.float().reshape(1, hkv, grp, 1).expand(t, hkv, grp, 1)
    probs = torch.softmax(torch.cat((s, sink_logit), dim=-1), dim=-1)[..., :-1]
    if shared:
        lq = k_all.shape[2]
        out = torch.einsum("thgl,hld->thgd", probs[..., :lq], v_all[0])
        start = lq
        for vv in vals[1:]:
            out = out + torch.einsum("thgl,thld->thgd", probs[..., start : start + bs], vv)
            start += bs
        out = out.reshape(t, hq, d)
    else:
        out = torch.einsum("thgl,thld->thgd", probs, torch.cat(vals, dim=2)).reshape(t, hq, d)
    if quantized and rotate:
        out = hadamard(out)
    return out.unsqueeze(0), codes, scales, new_stage


# ----------------------------------------------------------------------------------------------
# torch.library registrations


def _inplace_impl(q, k, v, codes, scales, stage, *rest):
    out, new_codes, new_scales, new_stage = reference_paged_attention(q, k, v, codes, scales, stage, *rest)
    codes.copy_(new_codes)
    scales.copy_(new_scales)
    stage.copy_(new_stage)
    return out


def _inplace_out_impl(q, k, v, codes, scales, stage, *rest, out):
    out.copy_(_inplace_impl(q, k, v, codes, scales, stage, *rest))
    return out


def _functional_impl(*args):
    return reference_paged_attention(*args)


def _split_mixed(args):
    """The mixed op's arguments -> (the default op's arguments, compact=...)."""
    q, k, v, codes, scales, stage, ccodes, cscales, *rest = args
    base, cspec = rest[:-6], rest[-6:]
    return (q, k, v, codes, scales, stage, *base), (ccodes, cscales, *cspec)


def _mixed_inplace_impl(*args):
    base, compact = _split_mixed(args)
    out, new_codes, new_scales, new_stage = reference_paged_attention(*base, compact=compact)
    codes, scales, stage = base[3:6]
    codes.copy_(new_codes)
    scales.copy_(new_scales)
    stage.copy_(new_stage)
    return out


def _mixed_inplace_out_impl(*args, out):
    out.copy_(_mixed_inplace_impl(*args))
    return out


def _mixed_functional_impl(*args):
    base, compact = _split_mixed(args)
    return reference_paged_attention(*base, compact=compact)


_lib.impl("quantized_paged_attention", _inplace_impl, "CompositeExplicitAutograd")
_lib.impl("quantized_paged_attention_mixed", _mixed_inplace_impl, "CompositeExplicitAutograd")
_lib.impl("quantized_paged_attention_mixed.out", _mixed_inplace_out_impl, "CompositeExplicitAutograd")
_lib.impl("quantized_paged_attention_mixed_functional", _mixed_functional_impl, "CompositeExplicitAutograd")
_lib.impl("quantized_paged_attention.out", _inplace_out_impl, "CompositeExplicitAutograd")
_lib.impl("quantized_paged_attention_functional", _functional_impl, "CompositeExplicitAutograd")


def _out_like(q):
    _, hq, t, d = q.shape
    return q.new_empty((1, t, hq, d), dtype=torch.float32)


@torch.library.register_fake("pagedkv::quantized_paged_attention")
def _inplace_fake(q, *args):
    return _out_like(q)


@torch.library.register_fake("pagedkv::quantized_paged_attention.out")
def _inplace_out_fake(q, *args, out):
    return out


@torch.library.register_fake("pagedkv::quantized_paged_attention_functional")
def _functional_fake(q, k, v, codes, scales, stage, *args):
    return _out_like(q), torch.empty_like(codes), torch.empty_like(scales), torch.empty_like(stage)


@torch.library.register_fake("pagedkv::quantized_paged_attention_mixed")
def _mixed_inplace_fake(q, *args):
    return _out_like(q)


@torch.library.register_fake("pagedkv::quantized_paged_attention_mixed.out")
def _mixed_inplace_out_fake(q, *args, out):
    return out


@torch.library.register_fake("pagedkv::quantized_paged_attention_mixed_functional")
def _mixed_functional_fake(q, k, v, codes, scales, stage, *args):
    return _out_like(q), torch.empty_like(codes), torch.empty_like(scales), torch.empty_like(stage)
