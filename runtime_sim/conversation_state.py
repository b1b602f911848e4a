"""An engine's pool <-> a ConversationData (runtime_sim/conversation_file.py): what Engine.capture reads out
of the pool for a saved conversation, and what Engine.restore writes back. Functions of an engine's
public parts (backend, pool, groups, manifest, conversation(), block_tables()); the file format itself
knows nothing of the engine.
"""

from __future__ import annotations

import numpy as np

from runtime_sim.conversation_file import (COMPACT, DEFAULT, HOLE, ConversationData, GroupBlocks, blocks_to_restore,
                                           check_compatible, fail)
from toolkit.errors import PagedKVError


def model_sha256(engine) -> bytes:
    """The identity of the model whose K/V the pool holds: the sha256 the manifest records for the
    artifact the backend runs (.onnx or .pte; the Android runner reads the .pte's), or, for the torch
    backend, a sha256 over the model's parameters (names, dtypes, shapes, bytes)."""
    be = engine.backend
    kind = {"onnxruntime": "onnx", "executorch": "pte"}.get(getattr(be, "name", ""))
    entry = ((engine.manifest or {}).get("artifacts") or {}).get(kind) if kind else None
    if entry and entry.get("sha256"):
        return bytes.fromhex(entry["sha256"])
    cached = getattr(be, "_conversation_model_sha256", None)
    if cached is not None:
        return cached
    if not hasattr(be, "paged"):
        raise PagedKVError(f"the {getattr(be, 'name', 'unknown')} backend has no manifest sha256 to identify its "
                           "model: open the artifacts with runtime_sim.session.open_artifacts to save or restore.")
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(be.paged.hf.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    be._conversation_model_sha256 = h.digest()
    return be._conversation_model_sha256


def describe(engine) -> ConversationData:
    """The engine's pool as a ConversationData without tokens or blocks (what a file must match)."""
    from toolkit.kv_spec import record_layout

    lay = engine.backend.layout
    itemsize = int(np.dtype(lay.codes_dtype_name).itemsize)
    compact = lay.compact if getattr(lay, "num_compact_blocks", 0) else None
    crec = record_layout(compact, lay.head_dim) if compact is not None else None
    return ConversationData(
        model_sha256=model_sha256(engine), num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim, block_size=lay.block_size, spec=lay.spec, codes_itemsize=itemsize,
        code_bytes=lay.codes_shape()[-1] * itemsize, scale_bytes=0 if lay.spec.is_float else lay.scales_shape()[-1] * 2,
        has_stage=lay.uses_stage, tokens=[], pending=[],
        groups=[GroupBlocks(g.window, tuple(g.layers), [], g.spec) for g in engine.groups], compact=compact,
        compact_code_bytes=crec.code_width if crec else 0, compact_scale_bytes=2 * crec.scale_width if crec else 0)


def pool_arrays(engine) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The backend's pool tensors (numpy views). The ExecuTorch backend learns where its buffers are on
    its first step: if it has not run yet, one step on a scratch sequence (one block, released at once)
    shows them; no conversation holds data before a first step, so none is touched."""
    try:
        return engine.backend.pool_arrays()
    except PagedKVError:
        pass
    pool = engine.pool
    seq = pool.new_sequence()
    try:
        pool.reserve(seq, 1)
        engine.backend.forward(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, seq, np.int64),
                               engine.block_tables(1))
    finally:
        pool.release(seq)
    return engine.backend.pool_arrays()


def compact_arrays(engine) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """layer -> (compact_codes, compact_scales) numpy views of the compact region ({} without one): the
    backend's compact_arrays() (torch, onnxruntime and ExecuTorch backends all have it)."""
    return engine.backend.compact_arrays() if hasattr(engine.backend, "compact_arrays") else {}


def capture(engine, cid: int) -> ConversationData:
    """A conversation's blocks (copies of its pool records), stage rows and tokens."""
    conv = engine.conversation(cid)
    pool, bs = engine.pool, engine.pool.block_size
    n = pool.length(conv.seq)
    if list(conv.history) != pool.tokens(conv.seq):
        raise PagedKVError(f"conversation {cid} is in the middle of a step: save it between turns.")
    d = describe(engine)
    d.tokens, d.pending = list(conv.history), list(conv.pending)
    arrays = pool_arrays(engine) if n or d.has_stage else []
    nb = -(-n // bs)
    d.codes, d.scales = [None] * d.num_layers, [None] * d.num_layers
    d.compact_codes, d.compact_scales = [None] * d.num_layers, [None] * d.num_layers

    def rows(a, ids, width):  # the records of these blocks (copies), [len(ids), Hkv, bs, width] uint8
        return a[ids].view(np.uint8) if len(ids) else np.zeros(d.record_shape(0, width), np.uint8)

    for g, grp in enumerate(d.groups):
        table = pool.block_table(conv.seq, g)[:nb]
        n_default = engine.groups[g].num_blocks  # ids >= n_default: the compact region (group 0 only)
        grp.present = [HOLE if b < 0 else DEFAULT if b < n_default else COMPACT for b in table]
        ids = np.asarray([b for b in table if 0 <= b < n_default], np.int64)
        cids = np.asarray([b - n_default for b in table if b >= n_default], np.int64)
        carrays = compact_arrays(engine) if len(cids) else {}
        g_code_bytes, g_scale_bytes = d.group_record_bytes(grp)
        for i in grp.layers:
            codes, scales, _ = arrays[i] if arrays else (None, None, None)
            d.codes[i] = rows(codes, ids, g_code_bytes)
            if g_scale_bytes:
                d.scales[i] = rows(scales, ids, g_scale_bytes)
            if len(cids):
                if i not in carrays:
                    raise PagedKVError(f"conversation {cid} holds compact blocks, but the {engine.backend.name} "
                                       f"backend shows no compact region for layer {i}: save it with the backend "
                                       "that compacted it.")
                d.compact_codes[i] = rows(carrays[i][0], cids, d.compact_code_bytes)
                d.compact_scales[i] = rows(carrays[i][1], cids, d.compact_scale_bytes)
    if not d.n_compact:  # the file names a compact spec only when it holds compact blocks
        d.compact, d.compact_code_bytes, d.compact_scale_bytes = None, 0, 0
    if d.has_stage:
        d.stage = [np.array(arrays[i][2][conv.seq]) for i in range(d.num_layers)]
    return d


def restore_sequence(engine, d: ConversationData, path) -> int:
    """The pool part of restore_data: a new sequence slot holding the file's blocks and stage rows
    (the engine's adaptive policy maps a spilled conversation back into its own Conversation). Compact
    blocks go into free blocks of the engine's compact region, all of them or none (PoolExhausted)."""
    from toolkit.errors import PoolExhausted, PoolStateError

    check_compatible(d, describe(engine), path)
    vocab = ((engine.manifest or {}).get("model") or {}).get("vocab_size")
    if vocab and any(t >= vocab for t in d.tokens + d.pending):
        fail(path, f"holds a token id outside this model's vocabulary of {vocab} (damaged)")
    pool, bs = engine.pool, engine.pool.block_size
    n = len(d.tokens)
    nb = -(-n // bs)
    if len(pool.live_sequences()) >= pool.max_seqs:
        raise PoolStateError(f"all {pool.max_seqs} sequence slots are in use: close a conversation before "
                             f"restoring {path}.")
    from toolkit.block_pool import dead_blocks

    for g, grp in enumerate(d.groups):  # holes only where this engine's pool could have made them
        if any(grp.present[:dead_blocks(grp.window, bs, n)]) or (n % bs and not grp.present[-1]):
            fail(path, f"holds blocks of layer group {g} that its window would not keep (damaged)")
        if grp.n_compact and g != 0:  # the engine's compact region belongs to its first (global) group
            fail(path, f"holds compact blocks in layer group {g}, which has no compact region here",
                  "restore it with the artifacts that saved it")
    for g, (need, p) in enumerate(zip(blocks_to_restore(d), pool.pools)):
        if need > p.num_free_blocks:
            raise PoolExhausted(need, p.num_free_blocks, what=f"restoring {path} ({n} tokens) in layer group {g}")
    if d.n_compact > pool.main.num_free_compact_blocks:
        raise PoolExhausted(d.n_compact, pool.main.num_free_compact_blocks,
                            what=f"restoring {path}: its compact-tier blocks in the compact region")
    arrays = pool_arrays(engine) if nb or d.has_stage else []
    carrays = compact_arrays(engine) if d.n_compact else {}
    seq = pool.new_sequence()
    try:
        for i in range(nb):
            chunk = d.tokens[i * bs:(i + 1) * bs]
            pool.reserve(seq, len(chunk))  # a fresh sequence: no copy-on-write copies
            pool.commit(seq, chunk)  # registers full blocks in the prefix cache; sliding groups trim
            for grp, p in zip(d.groups, pool.pools):
                b = p.block_table(seq)[i]
                if grp.present[i] == HOLE and b >= 0:
                    p.drop_blocks(seq, [i])
                elif grp.present[i] == COMPACT:
                    b, _ = p.compact(seq, i)  # only its compact records are written below
                else:
                    continue
                p.forget_cached(b)  # a default block never written: no later sequence may share it
        tables = [pool.block_table(seq, g)[:nb] for g in range(len(d.groups))]
        for g, (grp, table) in enumerate(zip(d.groups, tables)):  # every check before the first record is written
            n_default = engine.groups[g].num_blocks
            if [HOLE if b < 0 else DEFAULT if b < n_default else COMPACT for b in table] != list(grp.present):
                fail(path, f"holds blocks of layer group {g} that its window (or the pool) would not keep (damaged)")
        for g, (grp, table) in enumerate(zip(d.groups, tables)):
            n_default = engine.groups[g].num_blocks
            ids = np.asarray([b for b in table if 0 <= b < n_default], np.int64)
            cids = np.asarray([b - n_default for b in table if b >= n_default], np.int64)
            for i in grp.layers:
                if len(ids):
                    codes, scales, _ = arrays[i]
                    codes[ids] = d.codes[i].view(codes.dtype).reshape((len(ids),) + codes.shape[1:])
                    if d.scale_bytes:
                        scales[ids] = d.scales[i].view(scales.dtype).reshape((len(ids),) + scales.shape[1:])
                if len(cids):
                    ccodes, cscales = carrays[i]
                    ccodes[cids] = d.compact_codes[i].view(ccodes.dtype).reshape((len(cids),) + ccodes.shape[1:])
                    cscales[cids] = d.compact_scales[i].view(cscales.dtype).reshape((len(cids),) + cscales.shape[1:])
        if d.has_stage:
            for i in range(d.num_layers):
                arrays[i][2][seq] = d.stage[i]
    except BaseException:  # the slot and its blocks go back; none of them keeps a prefix-cache entry
        held = [(p, b) for p in pool.pools for b in p.block_table(seq) if 0 <= b < p.num_blocks]
        pool.release(seq)
        for p, b in held:
            if not p.refcount(b):
                p.forget_cached(b)
        raise
    return seq
