"""A saved conversation: its KV blocks as they lie in the pool, its fp16 stage rows and its tokens.

    data = capture(...)            # what Engine.save gathers from the pool
    write(path, data)              # atomic: a temp file beside `path`, fsync, rename
    data = read(path)              # every field checked; ConversationFileError (one line) otherwise
    check_compatible(data, want)   # the same model (sha256), spec, dims and layer groups as the engine

The format is documented in toolkit/CONVERSATION_FORMAT.md (one home; the Android runner's
android_demo/native/src/conversation_file.cpp reads and writes the same bytes). Plain functions over
plain data; numpy only, no torch.
"""

from __future__ import annotations

import os
import struct
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from toolkit.errors import PagedKVError
from toolkit.kv_spec import KVQuantSpec

MAGIC = b"PKVCONV\0"
VERSION = 1
SPEC_FIELDS = ("k_bits", "v_bits", "k_group", "v_group", "k_sym", "v_sym", "rotate", "fp_tail", "sink_blocks")
ITEMSIZES = (1, 2, 4)  # codes element bytes: uint8, float16, float32
# sanity bounds: a header field past these is damage, not a real conversation
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM, MAX_TOKENS = 4096, 4096, 4096, 1 << 26


class ConversationFileError(PagedKVError):
    """A conversation file that cannot be restored here (damaged, or made for another model/pool)."""


@dataclass
class GroupBlocks:
    """One layer group of the saved sequence: which logical blocks it holds (False = a hole)."""

    window: int
    layers: tuple[int, ...]
    present: list[bool]

    @property
    def n_present(self) -> int:
        return sum(self.present)


@dataclass
class ConversationData:
    model_sha256: bytes  # 32 raw bytes: the model file the backend runs (the manifest's sha256)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    spec: KVQuantSpec
    codes_itemsize: int  # 1 (uint8 codes), 2 (float16 pool), 4 (float32 pool)
    code_bytes: int  # bytes of one record in the codes tensor
    scale_bytes: int  # bytes of one record in the scales tensor (0: a float spec has none)
    has_stage: bool  # the fp16 sink/tail rows of the sequence slot are stored
    tokens: list[int]  # the cache's tokens, positions 0..len-1
    pending: list[int]  # tokens not in the cache yet (fed first on the next turn)
    groups: list[GroupBlocks]
    app: bytes = b""  # the application's own data, opaque here (pagedkv chat: its messages as JSON)
    # per layer: raw bytes of its group's present blocks in logical order,
    # codes [n_present, Hkv, bs, code_bytes] and scales [n_present, Hkv, bs, scale_bytes] (uint8 views)
    codes: list[np.ndarray] = field(default_factory=list)
    scales: list[np.ndarray] = field(default_factory=list)
    stage: list[np.ndarray] = field(default_factory=list)  # per layer [2, 2, Hkv, bs, D] float16, or []

    def record_shape(self, n: int, width: int) -> tuple[int, ...]:
        return (n, self.num_kv_heads, self.block_size, width)

    def stage_shape(self) -> tuple[int, ...]:
        return (2, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def group_of_layer(self) -> list[int]:
        out = [-1] * self.num_layers
        for g, grp in enumerate(self.groups):
            for i in grp.layers:
                out[i] = g
        return out


def _fail(path, what: str, fix: str = "it cannot be restored; save the conversation again") -> None:
    raise ConversationFileError(f"conversation file {path} {what}: {fix}.")


# ------------------------------------------------------------------------------------------- write


def encode_header(d: ConversationData) -> bytes:
    """Everything before the block data: fixed fields, groups, tokens (CONVERSATION_FORMAT.md)."""
    if len(d.model_sha256) != 32:
        raise PagedKVError("model_sha256 must be 32 raw bytes")
    u = lambda *xs: struct.pack(f"<{len(xs)}I", *xs)  # noqa: E731
    spec = [int(getattr(d.spec, k)) for k in SPEC_FIELDS]
    parts = [MAGIC, u(VERSION), d.model_sha256,
             u(d.num_layers, d.num_kv_heads, d.head_dim, d.block_size), u(*spec),
             u(d.codes_itemsize, d.code_bytes, d.scale_bytes, int(d.has_stage)),
             u(len(d.tokens), len(d.pending), len(d.groups))]
    for g in d.groups:
        parts += [u(g.window, len(g.layers), *g.layers, len(g.present)), bytes(int(p) for p in g.present)]
    parts += [np.asarray(d.tokens, "<i4").tobytes(), np.asarray(d.pending, "<i4").tobytes(),
              u(len(d.app)), bytes(d.app)]
    return b"".join(parts)


def _payload(d: ConversationData):
    """The file's chunks in order (bytes or contiguous arrays), without the checksum."""
    yield encode_header(d)
    for g in d.groups:
        for i in g.layers:
            yield d.codes[i]
            if d.scale_bytes:
                yield d.scales[i]
    if d.has_stage:
        for i in range(d.num_layers):
            yield d.stage[i]


def write(path, d: ConversationData) -> int:
    """Write atomically (temp file in the same directory, fsync, rename): a crash leaves the old
    file or the new one, never half of one. Returns the file's size in bytes."""
    if sys.byteorder != "little":
        raise PagedKVError("conversation files are little-endian; this machine is not")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    crc, size = 0, 0
    try:
        with open(tmp, "wb") as f:
            for chunk in _payload(d):
                mv = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
                                if isinstance(chunk, np.ndarray) else chunk)
                crc = zlib.crc32(mv, crc)
                f.write(mv)
                size += len(mv)
            f.write(struct.pack("<I", crc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConversationFileError(f"cannot write conversation file {path} ({e.strerror or e}): "
                                    "free some space or choose another path; nothing was changed.") from None
    return size + 4


# -------------------------------------------------------------------------------------------- read


class _Reader:
    def __init__(self, buf: memoryview, path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            _fail(self.path, f"is truncated (it ends inside the {what})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self, n: int, what: str) -> list[int]:
        return list(struct.unpack(f"<{n}I", self.take(4 * n, what)))


def read(path) -> ConversationData:
    """Parse and check a conversation file (magic, version, checksum, sizes, bounds); the arrays it
    returns are views of the file's bytes."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConversationFileError(f"conversation file {path} does not exist: check the name "
                                    "(/save NAME writes one).") from None
    except OSError as e:
        raise ConversationFileError(f"cannot read conversation file {path} ({e.strerror or e}).") from None
    return parse(raw, path)


def parse(raw: bytes, path="(bytes)") -> ConversationData:
    if len(raw) < len(MAGIC) + 4 or raw[:len(MAGIC)] != MAGIC:
        _fail(path, "is not a pagedkv conversation file (bad magic)", "give a file written by /save or Engine.save")
    version = struct.unpack_from("<I", raw, len(MAGIC))[0]
    if version != VERSION:
        _fail(path, f"has format version {version}, this pagedkv reads {VERSION}",
              "restore it with the pagedkv that saved it, or save the conversation again")
    if len(raw) < len(MAGIC) + 8:
        _fail(path, "is truncated (no checksum)")
    body = memoryview(raw)[:-4]
    if zlib.crc32(body) != struct.unpack_from("<I", raw, len(raw) - 4)[0]:
        _fail(path, "is damaged or truncated (checksum mismatch)")
    r = _Reader(body, path)
    r.take(len(MAGIC) + 4, "header")
    sha = bytes(r.take(32, "model sha256"))
    num_layers, heads, head_dim, bs = r.u32(4, "header")
    spec_vals = r.u32(len(SPEC_FIELDS), "spec")
    itemsize, code_bytes, scale_bytes, has_stage = r.u32(4, "header")
    n_tokens, n_pending, n_groups = r.u32(3, "header")
    if not (1 <= num_layers <= MAX_LAYERS and 1 <= heads <= MAX_HEADS and 1 <= head_dim <= MAX_HEAD_DIM
            and bs in (16, 32) and itemsize in ITEMSIZES and has_stage in (0, 1)
            and n_tokens <= MAX_TOKENS and n_pending <= MAX_TOKENS and 1 <= n_groups <= num_layers
            and 0 < code_bytes <= 8 * head_dim * 4 and scale_bytes <= 8 * head_dim):
        _fail(path, "has an impossible header (damaged)")
    try:
        spec = KVQuantSpec(**{k: (bool(v) if k in ("k_sym", "v_sym", "rotate", "fp_tail") else int(v))
                              for k, v in zip(SPEC_FIELDS, spec_vals)}).validate(head_dim)
    except PagedKVError as e:
        _fail(path, f"holds an invalid KV spec ({e})")
    from toolkit.kv_spec import record_layout

    rec = record_layout(spec, head_dim)
    want = (4 if spec.k_bits == 32 else 2, 2 * head_dim * (4 if spec.k_bits == 32 else 2), 0) if spec.is_float else \
        (1, rec.code_width, 2 * rec.scale_width)
    if (itemsize, code_bytes, scale_bytes) != want:
        _fail(path, "has record sizes its spec does not give (damaged)")
    n_blocks = -(-n_tokens // bs)
    groups, seen = [], set()
    for _ in range(n_groups):
        window, n_layers = r.u32(2, "layer groups")
        if not 1 <= n_layers <= num_layers:
            _fail(path, "has an impossible layer group (damaged)")
        layers = tuple(r.u32(n_layers, "layer groups"))
        (nb,) = r.u32(1, "layer groups")
        present = [bool(b) for b in r.take(nb, "layer groups")]
        if nb != n_blocks or any(i >= num_layers or i in seen for i in layers) or \
                any(b not in (0, 1) for b in body[r.pos - nb:r.pos]):
            _fail(path, "has an impossible layer group (damaged)")
        seen.update(layers)
        groups.append(GroupBlocks(window, layers, present))
    if len(seen) != num_layers:
        _fail(path, "has layer groups that do not cover every layer (damaged)")
    tokens = np.frombuffer(r.take(4 * n_tokens, "tokens"), "<i4").tolist()
    pending = np.frombuffer(r.take(4 * n_pending, "tokens"), "<i4").tolist()
    if any(t < 0 for t in tokens + pending):
        _fail(path, "holds a negative token id (damaged)")
    (n_app,) = r.u32(1, "application data")
    app = bytes(r.take(n_app, "application data"))
    d = ConversationData(sha, num_layers, heads, head_dim, bs, spec, itemsize, code_bytes, scale_bytes,
                         bool(has_stage), tokens, pending, groups, app)
    d.codes, d.scales = [None] * num_layers, [None] * num_layers
    for g in groups:
        n = g.n_present
        for i in g.layers:
            for name, width, out in (("codes", code_bytes, d.codes), ("scales", scale_bytes, d.scales)):
                if name == "scales" and not scale_bytes:
                    continue
                shape = d.record_shape(n, width)
                out[i] = np.frombuffer(r.take(int(np.prod(shape)), f"{name} of layer {i}"), np.uint8).reshape(shape)
    if has_stage:
        st = d.stage_shape()
        d.stage = [np.frombuffer(r.take(2 * int(np.prod(st)), f"stage rows of layer {i}"), "<f2").reshape(st)
                   for i in range(num_layers)]
    if r.pos != len(body):
        _fail(path, f"has {len(body) - r.pos} unexpected byte(s) after its data (damaged)")
    return d


# ----------------------------------------------------------------------------------- compatibility


def check_compatible(d: ConversationData, want: ConversationData, path) -> None:
    """`want` describes the engine (a ConversationData without tokens or blocks): the file must be for
    the same model, pool format and layer groups, or restoring it would attend over foreign K/V."""
    if d.model_sha256 != want.model_sha256:
        _fail(path, f"was saved with another model (sha256 {d.model_sha256.hex()[:12]}..., this engine runs "
                    f"{want.model_sha256.hex()[:12]}...)", "restore it with the artifacts that saved it")
    for key in ("num_layers", "num_kv_heads", "head_dim", "block_size", "codes_itemsize", "code_bytes",
                "scale_bytes", "has_stage"):
        if getattr(d, key) != getattr(want, key):
            _fail(path, f"has {key}={getattr(d, key)}, this engine's pool has {getattr(want, key)}",
                  "restore it with the artifacts that saved it")
    if d.spec != want.spec:
        _fail(path, f"was saved with KV spec {d.spec.describe()}, this engine's pool is {want.spec.describe()}",
              "restore it with the artifacts that saved it")
    have = [(g.window, g.layers) for g in d.groups]
    need = [(g.window, g.layers) for g in want.groups]
    if have != need:
        _fail(path, f"has layer groups {have}, this engine's are {need}", "restore it with the artifacts that saved it")


# ------------------------------------------------------------------------------ engine <-> file


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
    lay = engine.backend.layout
    itemsize = int(np.dtype(lay.codes_dtype_name).itemsize)
    return ConversationData(
        model_sha256=model_sha256(engine), num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim, block_size=lay.block_size, spec=lay.spec, codes_itemsize=itemsize,
        code_bytes=lay.codes_shape()[-1] * itemsize, scale_bytes=0 if lay.spec.is_float else lay.scales_shape()[-1] * 2,
        has_stage=lay.uses_stage, tokens=[], pending=[],
        groups=[GroupBlocks(g.window, tuple(g.layers), []) for g in engine.groups])


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
                               engine._tables(1))
    finally:
        pool.release(seq)
    return engine.backend.pool_arrays()


def capture(engine, cid: int) -> ConversationData:
    """A conversation's blocks (copies of its pool records), stage rows and tokens."""
    conv = engine._conv(cid)
    pool, bs = engine.pool, engine.pool.block_size
    n = pool.length(conv.seq)
    if list(conv.history) != pool.tokens(conv.seq):
        raise PagedKVError(f"conversation {cid} is in the middle of a step: save it between turns.")
    d = describe(engine)
    d.tokens, d.pending = list(conv.history), list(conv.pending)
    arrays = pool_arrays(engine) if n or d.has_stage else []
    nb = -(-n // bs)
    d.codes, d.scales = [None] * d.num_layers, [None] * d.num_layers
    for g, grp in enumerate(d.groups):
        table = pool.block_table(conv.seq, g)[:nb]
        if any(b >= engine.groups[g].num_blocks for b in table):  # ids of the compact region (issue 25)
            raise PagedKVError(f"conversation {cid} has blocks in the compact tier: the conversation file does not "
                               "hold compact records yet; save it before compacting (runtime_sim/compact.py).")
        grp.present = [b >= 0 for b in table]
        ids = np.asarray([b for b in table if b >= 0], np.int64)
        for i in grp.layers:
            codes, scales, _ = arrays[i] if arrays else (None, None, None)
            d.codes[i] = codes[ids].view(np.uint8) if len(ids) else np.zeros(d.record_shape(0, d.code_bytes), np.uint8)
            if d.scale_bytes:
                d.scales[i] = scales[ids].view(np.uint8) if len(ids) else \
                    np.zeros(d.record_shape(0, d.scale_bytes), np.uint8)
    if d.has_stage:
        d.stage = [np.array(arrays[i][2][conv.seq]) for i in range(d.num_layers)]
    return d


def save(engine, cid: int, path, app: bytes = b"") -> int:
    """Engine.save: write conversation cid to path (atomic). Returns the file's size in bytes."""
    d = capture(engine, cid)
    d.app = bytes(app)
    return write(path, d)


def restore(engine, path) -> int:
    """Engine.restore: a new conversation holding the file's cache, its blocks written straight into
    the pool (no prefill). Everything is checked before the pool changes; on any error it is as before."""
    return restore_data(engine, read(path), path)


def blocks_to_restore(d: ConversationData) -> list[int]:
    """Free blocks each layer group needs to restore d, at its peak: the present blocks before the
    last one stay while the last one is allocated (holes are dropped as soon as their block is written)."""
    nb = -(-len(d.tokens) // d.block_size)
    return [sum(grp.present[:nb - 1]) + (1 if nb else 0) for grp in d.groups]


def restore_data(engine, d: ConversationData, path) -> int:
    """restore() of an already read file (the chat reads its messages from d.app)."""
    from runtime_sim.engine import Conversation

    if engine.policy == "adaptive":  # room by spilling idle conversations, once the file is known to fit
        check_compatible(d, describe(engine), path)
        engine._room_for_file(d, set())
    seq = restore_sequence(engine, d, path)
    cid = engine._next_id
    engine._next_id += 1
    engine.conversations[cid] = Conversation(seq, list(d.tokens), list(d.pending), last_used=engine.clock)
    return cid


def restore_sequence(engine, d: ConversationData, path) -> int:
    """The pool part of restore_data: a new sequence slot holding the file's blocks and stage rows
    (the engine's adaptive policy maps a spilled conversation back into its own Conversation)."""
    from toolkit.errors import PoolExhausted, PoolStateError

    check_compatible(d, describe(engine), path)
    vocab = ((engine.manifest or {}).get("model") or {}).get("vocab_size")
    if vocab and any(t >= vocab for t in d.tokens + d.pending):
        _fail(path, f"holds a token id outside this model's vocabulary of {vocab} (damaged)")
    pool, bs = engine.pool, engine.pool.block_size
    n = len(d.tokens)
    nb = -(-n // bs)
    if len(pool.live_sequences()) >= pool.max_seqs:
        raise PoolStateError(f"all {pool.max_seqs} sequence slots are in use: close a conversation before "
                             f"restoring {path}.")
    from toolkit.block_pool import dead_blocks

    for g, grp in enumerate(d.groups):  # holes only where this engine's pool could have made them
        if any(grp.present[:dead_blocks(grp.window, bs, n)]) or (n % bs and not grp.present[-1]):
            _fail(path, f"holds blocks of layer group {g} that its window would not keep (damaged)")
    for g, (need, p) in enumerate(zip(blocks_to_restore(d), pool.pools)):
        if need > p.num_free_blocks:
            raise PoolExhausted(need, p.num_free_blocks, what=f"restoring {path} ({n} tokens) in layer group {g}")
    arrays = pool_arrays(engine) if nb or d.has_stage else []
    seq = pool.new_sequence()
    try:
        for i in range(nb):
            chunk = d.tokens[i * bs:(i + 1) * bs]
            pool.reserve(seq, len(chunk))  # a fresh sequence: no copy-on-write copies
            pool.commit(seq, chunk)  # registers full blocks in the prefix cache; sliding groups trim
            for grp, p in zip(d.groups, pool.pools):
                if not grp.present[i] and p.block_table(seq)[i] >= 0:
                    p.drop_blocks(seq, [i])
        for g, grp in enumerate(d.groups):
            table = pool.block_table(seq, g)[:nb]
            if [b >= 0 for b in table] != grp.present:
                _fail(path, f"holds blocks of layer group {g} that its window (or the pool) would not keep (damaged)")
            ids = np.asarray([b for b in table if b >= 0], np.int64)
            if not len(ids):
                continue
            for i in grp.layers:
                codes, scales, _ = arrays[i]
                codes[ids] = d.codes[i].view(codes.dtype).reshape((len(ids),) + codes.shape[1:])
                if d.scale_bytes:
                    scales[ids] = d.scales[i].view(scales.dtype).reshape((len(ids),) + scales.shape[1:])
        if d.has_stage:
            for i in range(d.num_layers):
                arrays[i][2][seq] = d.stage[i]
    except BaseException:
        pool.release(seq)
        raise
    return seq
