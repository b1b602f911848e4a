"""Model loading: clear errors for bad paths, HF dir round trip, the SmolLM2 cache, a tiny GGUF."""

import json
import subprocess
import zipfile

import pytest
import torch

from toolkit.errors import ArtifactError, PagedKVError
from toolkit.tiny_models import tiny_model

WORDS = [f"w{i}" for i in range(500)]


def tiny_tokenizer():
    """A word-level tokenizer over WORDS (ids 3..502) + <pad>/<s>/</s>, wrapped for transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 503, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def save_tiny_hf_dir(path, family="llama"):
    model = tiny_model(family)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model


def test_missing_path(tmp_path):
    from toolkit.model_loading import load_model

    with pytest.raises(ArtifactError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_dir_without_config(tmp_path):
    from toolkit.model_loading import load_model

    with pytest.raises(ArtifactError, match="no config.json"):
        load_model(tmp_path)


def test_dir_without_weights(tmp_path):
    from toolkit.model_loading import load_model

    tiny_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(ArtifactError, match=r"no \*\.safetensors or pytorch_model\.bin in"):
        load_model(tmp_path)


def test_not_a_gguf(tmp_path):
    from toolkit.model_loading import load_model

    (tmp_path / "m.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ArtifactError, match="not a GGUF file"):
        load_model(tmp_path / "m.gguf")
    (tmp_path / "m.bin").write_bytes(b"xx")
    with pytest.raises(ArtifactError, match="not a .gguf"):
        load_model(tmp_path / "m.bin")


def test_truncated_gguf(tmp_path, monkeypatch):
    from toolkit.model_loading import load_model

    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 7)
    with pytest.raises(ArtifactError, match="cannot read GGUF file"):
        load_model(tmp_path / "m.gguf")


def test_hf_dir_round_trip(tmp_path):
    from toolkit.model_loading import load_model

    ref = save_tiny_hf_dir(tmp_path)
    model, tok = load_model(tmp_path)
    assert model.dtype == torch.float32 and not model.training
    ids = torch.tensor([tok("w1 w2 w3 w4", add_special_tokens=False)["input_ids"]])
    assert ids.tolist() == [[4, 5, 6, 7]]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)


def _fake_model(monkeypatch, tmp_path, chunks, sha=None):
    """A registered model of three part packages (plus one without parts, like Gemma's metadata wheel),
    their wheels already in the download dir; pip must not run."""
    import hashlib

    from toolkit import model_registry

    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))
    pkgs = ("fake-meta==1.0",) + tuple(f"fake-part{i}==1.0" for i in range(1, len(chunks) + 1))
    members = tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in range(1, len(chunks) + 1))
    joined = b"".join(chunks)
    m = model_registry.RegisteredModel("fake", "a fake model", pkgs, members, "fake.gguf",
                                       sha or hashlib.sha256(joined).hexdigest(), len(joined), "none", False)
    monkeypatch.setitem(model_registry.MODELS, "fake", m)
    dl = model_registry.model_dir("fake") / "download"
    dl.mkdir(parents=True)
    with zipfile.ZipFile(dl / "fake_meta-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_meta/__init__.py", "")
    for i, chunk in enumerate(chunks, 1):
        with zipfile.ZipFile(dl / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(members[i - 1], chunk)
    monkeypatch.setattr(model_registry.subprocess, "run", lambda *a, **k: pytest.fail("must not call pip"))
    return m


def test_registered_parts_joined_in_order_and_cached(tmp_path, monkeypatch):
    from toolkit import model_loading, model_registry

    chunks = [b"GGUF", b"-part2-", b"-part3-"]
    _fake_model(monkeypatch, tmp_path, chunks)
    assert model_registry.cached_file("fake") is None
    path = model_registry.model_file("fake")
    assert path.read_bytes() == b"".join(chunks) and not list(path.parent.glob("*.partial"))
    assert model_registry.cached_file("fake") == path
    monkeypatch.setattr(model_registry.zipfile, "ZipFile", lambda *a: pytest.fail("re-joined a cached file"))
    assert model_loading.named_model_path("fake") == path


def test_registered_bad_hash_is_clear_and_keeps_nothing(tmp_path, monkeypatch):
    from toolkit import model_registry

    _fake_model(monkeypatch, tmp_path, [b"GGUF", b"x"], sha="a5fd" + "0" * 60)
    with pytest.raises(ArtifactError, match="sha256 .* expected a5fd0000"):
        model_registry.model_file("fake")
    assert not any(model_registry.model_dir("fake").glob("*.gguf*"))


def test_registered_missing_part_is_clear(tmp_path, monkeypatch):
    from toolkit import model_registry

    _fake_model(monkeypatch, tmp_path, [b"GGUF", b"x"])
    (model_registry.model_dir("fake") / "download" / "fake_part2-1.0-py3-none-any.whl").unlink()
    fake = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for fake-part2==1.0")
    monkeypatch.setattr(model_registry.subprocess, "run", lambda *a, **k: fake)
    with pytest.raises(PagedKVError, match="could not download fake-meta==1.0 ... with pip .exit 1.*fake-part2"):
        model_registry.model_file("fake")


def test_registry_rows_are_complete():
    """Every named model has pinned packages, one member per part and a full sha256 (the real downloads are
    exercised by the benchmarks and `make demo`, not here)."""
    from toolkit.model_registry import MODELS

    assert {"smollm2", "gemma3-270m", "qwen2.5-coder-1.5b"} <= set(MODELS)
    for m in MODELS.values():
        assert all("==" in p for p in m.packages) and m.members and len(m.sha256) == 64 and m.size > 0
        assert len(set(m.members)) == len(m.members)


def test_unknown_model_name_is_one_line():
    from toolkit.model_registry import model_file

    with pytest.raises(PagedKVError, match="unknown model name 'nope': the named models are smollm2"):
        model_file("nope")


# ----------------------------------------------------------------------------------------------
# A tiny llama written as GGUF with the `gguf` package, loaded through transformers' GGUF path


def write_tiny_llama_gguf(path, model):
    import gguf
    import numpy as np

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else 10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens = ["<pad>", "<s>", "</s>"] + [f"t{i}" for i in range(cfg.vocab_size - 3)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (cfg.vocab_size - 3))
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)

    def permute(t, heads):  # HF -> llama.cpp rotary layout (transformers undoes it on load)
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_round_trip_and_cache(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from toolkit import model_loading

    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "cache"))
    ref = tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, ref)
    ids = torch.tensor([[1, 5, 9, 200, 7, 3]])
    model, tok = model_loading.load_model(path)
    out = model_loading.converted_gguf_dir(path)
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    with torch.no_grad():
        first = model(ids).logits
        torch.testing.assert_close(first, ref(ids).logits, rtol=1e-4, atol=1e-4)
    # the second load reads the cached fp32 copy, not the GGUF
    monkeypatch.setattr(model_loading, "_forget_quantization", lambda *a: pytest.fail("converted the GGUF again"))
    model2, tok2 = model_loading.load_model(path)
    with torch.no_grad():
        torch.testing.assert_close(model2(ids).logits, first)
    assert tok2.convert_ids_to_tokens([5]) == tok.convert_ids_to_tokens([5])


def test_models_command_lists_the_registry_offline(tmp_path):
    """`pagedkv models --json`: every registered model, cached or not, without touching the network (an empty
    cache here)."""
    import os
    import sys

    env = dict(os.environ, PAGEDKV_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "toolkit.cli", "models", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["models"]}
    assert set(rows) >= {"smollm2", "gemma3-270m", "qwen2.5-coder-1.5b"}
    assert not any(r["cached"] for r in rows.values()) and rows["qwen2.5-coder-1.5b"]["packages"] == 22
