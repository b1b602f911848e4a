"""pagedkv core: quantization formats, block pool, the paged attention op, the HF compiler step.

Public API (torch is imported only by the functions that need it):

    import toolkit
    model, tokenizer = toolkit.load_model("smollm2")         # HF dir, .gguf, or 'smollm2'
    paged = toolkit.compile(model, "default:v_group=16")     # same spec strings as the CLI, or a dict
    logits = paged(input_ids[None], positions, seq_ids, block_tables)
    spec = toolkit.resolve_spec({"k_bits": 6})               # KVQuantSpec from a name / 'PRESET:f=v' / dict
    manifest = toolkit.read_manifest("artifacts/smollm2")    # validated pagedkv.json of an artifacts dir

Errors on bad input derive from toolkit.errors.PagedKVError (one line saying what to fix).
Exporting and running artifacts live one layer up: export.artifacts.export_artifacts,
runtime_sim.session.open_artifacts.
"""

from __future__ import annotations

import logging as _logging

from toolkit.errors import PagedKVError  # noqa: F401

# torchao (pulled in by transformers/executorch) logs a warning per optional CUDA extension it
# cannot load on a CPU-only machine, and torch's pytree warns about torchao's enums: noise to users.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

__all__ = ["compile", "load_model", "resolve_spec", "read_manifest", "PagedKVError"]


def compile(model, spec="default", *, block_size: int = 16, num_blocks: int = 256, max_seqs: int = 4):
    """Rewrite a HF causal LM's attention to the paged op, with a pool of `num_blocks` blocks of
    `block_size` tokens shared by `max_seqs` sequences. `spec`: a preset name, 'PRESET:field=value,...',
    a dict of KVQuantSpec fields (over 'default') or a KVQuantSpec. Returns a PagedModel."""
    from toolkit.compiler import compile as _compile

    return _compile(model, spec, block_size=block_size, num_blocks=num_blocks, max_seqs=max_seqs)


def load_model(path="smollm2"):
    """(float32 eval model, tokenizer) from a HF model dir, a .gguf file, or 'smollm2'."""
    from toolkit.model_loading import load_model as _load

    return _load(path)


def resolve_spec(spec):
    """KVQuantSpec from a preset name, 'PRESET:field=value,...', a dict of fields, or a KVQuantSpec."""
    from toolkit.kv_spec import resolve_spec as _resolve

    return _resolve(spec)


def read_manifest(art_dir):
    """The validated pagedkv.json of an artifacts dir made by `pagedkv export`."""
    from toolkit.manifest import read_manifest as _read

    return _read(art_dir)
