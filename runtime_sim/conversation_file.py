"""A saved conversation: its KV blocks as they lie in the pool (compact-tier blocks as their compact
records), its fp16 stage rows and its tokens.

    data = engine.capture(cid)     # what Engine.save gathers from the pool (runtime_sim/conversation_state.py)
    write(path, data)              # atomic: a temp file beside `path`, fsync, rename
    data = read(path)              # every field checked; ConversationFileError (one line) otherwise
    check_compatible(data, want)   # the same model (sha256), spec, dims and layer groups as the engine

The format is documented in toolkit/CONVERSATION_FORMAT.md (one home; the Android runner's
android_demo/native/src/conversation_file.cpp reads and writes the same bytes). Plain functions over
plain data, nothing of the engine; numpy only, no torch.
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
VERSION = 2  # what write() writes; read() also reads version 1 (a version-2 file without compact blocks)
# what write() writes when a layer group stores its own spec (export --sliding-spec): each group carries it
GROUP_SPEC_VERSION = 3
READS = (1, 2, 3)
SPEC_FIELDS = ("k_bits", "v_bits", "k_group", "v_group", "k_sym", "v_sym", "rotate", "fp_tail", "sink_blocks")
ITEMSIZES = (1, 2, 4)  # codes element bytes: uint8, float16, float32
# sanity bounds: a header field past these is damage, not a real conversation
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM, MAX_TOKENS = 4096, 4096, 4096, 1 << 26


# GroupBlocks.present: what the group holds at each logical block
HOLE, DEFAULT, COMPACT = 0, 1, 2  # a hole / a block of the default region / of the compact region (version 2)


class ConversationFileError(PagedKVError):
    """A conversation file that cannot be restored here (damaged, or made for another model/pool)."""


@dataclass
class GroupBlocks:
    """One layer group of the saved sequence: what it holds at each logical block (HOLE, DEFAULT or
    COMPACT; a version-1 file has no COMPACT, and False/True read as HOLE/DEFAULT)."""

    window: int
    layers: tuple[int, ...]
    present: list[int]
    spec: KVQuantSpec | None = None  # the group's own spec (version 3); None: the file's spec

    @property
    def n_present(self) -> int:
        """Blocks of the default region (their records are in `codes`/`scales`)."""
        return sum(1 for p in self.present if p == DEFAULT)

    @property
    def n_compact(self) -> int:
        """Blocks of the compact region (their records are in `compact_codes`/`compact_scales`)."""
        return sum(1 for p in self.present if p == COMPACT)


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
    # the compact tier (version 2): the spec and record sizes of the compact blocks; None/0 when the file
    # holds none (describe(): the engine's compact region, None without one)
    compact: KVQuantSpec | None = None
    compact_code_bytes: int = 0
    compact_scale_bytes: int = 0
    # per layer: raw bytes of its group's present blocks in logical order,
    # codes [n_present, Hkv, bs, code_bytes] and scales [n_present, Hkv, bs, scale_bytes] (uint8 views)
    codes: list[np.ndarray] = field(default_factory=list)
    scales: list[np.ndarray] = field(default_factory=list)
    stage: list[np.ndarray] = field(default_factory=list)  # per layer [2, 2, Hkv, bs, D] float16, or []
    # per layer of a group holding compact blocks (None for the others): their records in the compact
    # spec, codes [n_compact, Hkv, bs, compact_code_bytes] and scales [..., compact_scale_bytes] (uint8)
    compact_codes: list[np.ndarray | None] = field(default_factory=list)
    compact_scales: list[np.ndarray | None] = field(default_factory=list)

    @property
    def n_compact(self) -> int:
        return sum(g.n_compact for g in self.groups)

    def group_record_bytes(self, grp: GroupBlocks) -> tuple[int, int]:
        """(code_bytes, scale_bytes) of the records of a group's layers: its own spec's, else the file's."""
        if grp.spec is None:
            return self.code_bytes, self.scale_bytes
        from toolkit.kv_spec import record_layout

        rec = record_layout(grp.spec, self.head_dim)
        return rec.code_width, 2 * rec.scale_width

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


def fail(path, what: str, fix: str = "it cannot be restored; save the conversation again") -> None:
    raise ConversationFileError(f"conversation file {path} {what}: {fix}.")


# ------------------------------------------------------------------------------------------- write


def encode_header(d: ConversationData) -> bytes:
    """Everything before the block data: fixed fields, groups, tokens (CONVERSATION_FORMAT.md)."""
    if len(d.model_sha256) != 32:
        raise PagedKVError("model_sha256 must be 32 raw bytes")
    u = lambda *xs: struct.pack(f"<{len(xs)}I", *xs)  # noqa: E731
    spec = [int(getattr(d.spec, k)) for k in SPEC_FIELDS]
    if d.n_compact and d.compact is None:
        raise PagedKVError("a conversation with compact blocks needs its compact spec")
    # the compact spec and record sizes only when the file holds compact blocks (else zeros): a file
    # without any is the same bytes whether or not the engine that wrote it had a compact region
    compact = [int(getattr(d.compact, k)) for k in SPEC_FIELDS] + [d.compact_code_bytes, d.compact_scale_bytes] \
        if d.n_compact else [0] * (len(SPEC_FIELDS) + 2)
    version = GROUP_SPEC_VERSION if any(g.spec is not None for g in d.groups) else VERSION
    parts = [MAGIC, u(version), d.model_sha256,
             u(d.num_layers, d.num_kv_heads, d.head_dim, d.block_size), u(*spec),
             u(d.codes_itemsize, d.code_bytes, d.scale_bytes, int(d.has_stage)), u(*compact),
             u(len(d.tokens), len(d.pending), len(d.groups))]
    for g in d.groups:  # version 3: each group's own spec after its window (all zero: the file's spec)
        own = [int(getattr(g.spec, k)) for k in SPEC_FIELDS] if g.spec is not None else [0] * len(SPEC_FIELDS)
        parts += [u(g.window, *(own if version >= GROUP_SPEC_VERSION else []), len(g.layers), *g.layers,
                    len(g.present)), bytes(int(p) for p in g.present)]
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
            if g.n_compact:
                yield d.compact_codes[i]
                yield d.compact_scales[i]
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
            fail(self.path, f"is truncated (it ends inside the {what})")
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


def _spec_of(vals) -> KVQuantSpec:
    return KVQuantSpec(**{k: (bool(v) if k in ("k_sym", "v_sym", "rotate", "fp_tail") else int(v))
                          for k, v in zip(SPEC_FIELDS, vals)})


def parse(raw: bytes, path="(bytes)") -> ConversationData:
    if len(raw) < len(MAGIC) + 4 or raw[:len(MAGIC)] != MAGIC:
        fail(path, "is not a pagedkv conversation file (bad magic)", "give a file written by /save or Engine.save")
    version = struct.unpack_from("<I", raw, len(MAGIC))[0]
    if version not in READS:
        fail(path, f"has format version {version}, this pagedkv reads {' and '.join(map(str, READS))}",
              "restore it with the pagedkv that saved it, or save the conversation again")
    if len(raw) < len(MAGIC) + 8:
        fail(path, "is truncated (no checksum)")
    body = memoryview(raw)[:-4]
    if zlib.crc32(body) != struct.unpack_from("<I", raw, len(raw) - 4)[0]:
        fail(path, "is damaged or truncated (checksum mismatch)")
    r = _Reader(body, path)
    r.take(len(MAGIC) + 4, "header")
    sha = bytes(r.take(32, "model sha256"))
    num_layers, heads, head_dim, bs = r.u32(4, "header")
    spec_vals = r.u32(len(SPEC_FIELDS), "spec")
    itemsize, code_bytes, scale_bytes, has_stage = r.u32(4, "header")
    compact_vals = r.u32(len(SPEC_FIELDS) + 2, "compact spec") if version >= 2 else [0] * (len(SPEC_FIELDS) + 2)
    n_tokens, n_pending, n_groups = r.u32(3, "header")
    if not (1 <= num_layers <= MAX_LAYERS and 1 <= heads <= MAX_HEADS and 1 <= head_dim <= MAX_HEAD_DIM
            and bs in (16, 32) and itemsize in ITEMSIZES and has_stage in (0, 1)
            and n_tokens <= MAX_TOKENS and n_pending <= MAX_TOKENS and 1 <= n_groups <= num_layers
            and 0 < code_bytes <= 8 * head_dim * 4 and scale_bytes <= 8 * head_dim):
        fail(path, "has an impossible header (damaged)")
    try:
        spec = _spec_of(spec_vals).validate(head_dim)
    except PagedKVError as e:
        fail(path, f"holds an invalid KV spec ({e})")
    from toolkit.kv_spec import check_compact, check_stored_group_spec, record_layout

    rec = record_layout(spec, head_dim)
    want = (4 if spec.k_bits == 32 else 2, 2 * head_dim * (4 if spec.k_bits == 32 else 2), 0) if spec.is_float else \
        (1, rec.code_width, 2 * rec.scale_width)
    if (itemsize, code_bytes, scale_bytes) != want:
        fail(path, "has record sizes its spec does not give (damaged)")
    compact, compact_code_bytes, compact_scale_bytes = None, 0, 0
    if any(compact_vals):  # the compact tier's spec (version 2, a file holding compact blocks)
        try:
            compact = check_compact(spec, _spec_of(compact_vals[:len(SPEC_FIELDS)]), head_dim)
        except PagedKVError as e:
            fail(path, f"holds an invalid compact spec ({e})")
        compact_code_bytes, compact_scale_bytes = compact_vals[len(SPEC_FIELDS):]
        crec = record_layout(compact, head_dim)
        if (compact_code_bytes, compact_scale_bytes) != (crec.code_width, 2 * crec.scale_width):
            fail(path, "has compact record sizes its compact spec does not give (damaged)")
    n_blocks, n_full = -(-n_tokens // bs), n_tokens // bs
    kinds = (HOLE, DEFAULT, COMPACT) if version >= 2 else (HOLE, DEFAULT)
    groups, seen = [], set()
    for gi in range(n_groups):
        (window,) = r.u32(1, "layer groups")
        own = None
        if version >= GROUP_SPEC_VERSION and any(vals := r.u32(len(SPEC_FIELDS), "layer groups")):
            try:
                own = check_stored_group_spec(spec, _spec_of(vals), head_dim, gi, window, "the file")
            except PagedKVError as e:
                fail(path, f"holds an invalid layer-group spec (damaged: {e})")
        (n_layers,) = r.u32(1, "layer groups")
        if not 1 <= n_layers <= num_layers:
            fail(path, "has an impossible layer group (damaged)")
        layers = tuple(r.u32(n_layers, "layer groups"))
        (nb,) = r.u32(1, "layer groups")
        present = list(r.take(nb, "layer groups"))
        if nb != n_blocks or any(i >= num_layers or i in seen for i in layers) or \
                any(b not in kinds for b in present):
            fail(path, "has an impossible layer group (damaged)")
        if COMPACT in present and (window or compact is None or COMPACT in present[n_full:]):
            # compact blocks: only full blocks of a global group, and only with a compact spec
            fail(path, "has a compact block where none can be (damaged)")
        seen.update(layers)
        groups.append(GroupBlocks(window, layers, present, own))
    if len(seen) != num_layers:
        fail(path, "has layer groups that do not cover every layer (damaged)")
    if compact is not None and not any(g.n_compact for g in groups):
        fail(path, "has a compact spec but no compact block (damaged)")
    if version >= GROUP_SPEC_VERSION and not any(g.spec is not None for g in groups):
        fail(path, f"has format version {version} but no layer group with its own spec (damaged)")
    tokens = np.frombuffer(r.take(4 * n_tokens, "tokens"), "<i4").tolist()
    pending = np.frombuffer(r.take(4 * n_pending, "tokens"), "<i4").tolist()
    if any(t < 0 for t in tokens + pending):
        fail(path, "holds a negative token id (damaged)")
    (n_app,) = r.u32(1, "application data")
    app = bytes(r.take(n_app, "application data"))
    d = ConversationData(sha, num_layers, heads, head_dim, bs, spec, itemsize, code_bytes, scale_bytes,
                         bool(has_stage), tokens, pending, groups, app, compact, compact_code_bytes,
                         compact_scale_bytes)
    d.codes, d.scales = [None] * num_layers, [None] * num_layers
    d.compact_codes, d.compact_scales = [None] * num_layers, [None] * num_layers

    def records(n, width, what):
        shape = d.record_shape(n, width)
        return np.frombuffer(r.take(int(np.prod(shape)), what), np.uint8).reshape(shape)

    for g in groups:
        g_code_bytes, g_scale_bytes = d.group_record_bytes(g)
        for i in g.layers:
            d.codes[i] = records(g.n_present, g_code_bytes, f"codes of layer {i}")
            if g_scale_bytes:
                d.scales[i] = records(g.n_present, g_scale_bytes, f"scales of layer {i}")
            if g.n_compact:
                d.compact_codes[i] = records(g.n_compact, compact_code_bytes, f"compact codes of layer {i}")
                d.compact_scales[i] = records(g.n_compact, compact_scale_bytes, f"compact scales of layer {i}")
    if has_stage:
        st = d.stage_shape()
        d.stage = [np.frombuffer(r.take(2 * int(np.prod(st)), f"stage rows of layer {i}"), "<f2").reshape(st)
                   for i in range(num_layers)]
    if r.pos != len(body):
        fail(path, f"has {len(body) - r.pos} unexpected byte(s) after its data (damaged)")
    return d


# ----------------------------------------------------------------------------------- compatibility


def check_compatible(d: ConversationData, want: ConversationData, path) -> None:
    """`want` describes the engine (a ConversationData without tokens or blocks): the file must be for
    the same model, pool format and layer groups, or restoring it would attend over foreign K/V."""
    if d.model_sha256 != want.model_sha256:
        fail(path, f"was saved with another model (sha256 {d.model_sha256.hex()[:12]}..., this engine runs "
                    f"{want.model_sha256.hex()[:12]}...)", "restore it with the artifacts that saved it")
    for key in ("num_layers", "num_kv_heads", "head_dim", "block_size", "codes_itemsize", "code_bytes",
                "scale_bytes", "has_stage"):
        if getattr(d, key) != getattr(want, key):
            fail(path, f"has {key}={getattr(d, key)}, this engine's pool has {getattr(want, key)}",
                  "restore it with the artifacts that saved it")
    if d.spec != want.spec:
        fail(path, f"was saved with KV spec {d.spec.describe()}, this engine's pool is {want.spec.describe()}",
              "restore it with the artifacts that saved it")
    have = [(g.window, g.layers) for g in d.groups]
    need = [(g.window, g.layers) for g in want.groups]
    if have != need:
        fail(path, f"has layer groups {have}, this engine's are {need}", "restore it with the artifacts that saved it")
    own = lambda c: [g.spec.describe() if g.spec is not None else None for g in c.groups]  # noqa: E731
    if own(d) != own(want):
        fail(path, f"has layer-group specs {own(d)}, this engine's are {own(want)} (None: the pool's spec)",
              "restore it with the artifacts that saved it")
    if d.n_compact:  # compact blocks are restored into the engine's compact region, in the same spec
        if want.compact is None:
            fail(path, f"holds {d.n_compact} block(s) in the compact tier (re-quantized to {d.compact.describe()}), "
                        "this engine's model has no compact region",
                  "restore it with a model compiled with compact_blocks=N on the torch backend, like the one that "
                  "saved it")
        if (d.compact, d.compact_code_bytes, d.compact_scale_bytes) != \
                (want.compact, want.compact_code_bytes, want.compact_scale_bytes):
            fail(path, f"holds compact blocks in spec {d.compact.describe()}, this engine's compact region is "
                        f"{want.compact.describe()}", "restore it with the artifacts that saved it")


def blocks_to_restore(d: ConversationData) -> list[int]:
    """Free default blocks each layer group needs to restore d, at its peak: the default blocks before
    the last one stay while the last one is allocated (each logical block is allocated in the default
    region as it is restored; a hole is dropped, a compact block moved to the compact region at once)."""
    nb = -(-len(d.tokens) // d.block_size)
    return [sum(1 for p in grp.present[:nb - 1] if p == DEFAULT) + (1 if nb else 0) for grp in d.groups]
