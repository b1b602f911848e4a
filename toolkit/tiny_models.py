"""Tiny random-weight configs of the supported families, for tests and quick exports.

Every model has head_dim 64 (so the default spec's groups and the Hadamard rotation apply), 2
layers, GQA where the family allows it, and each family's special feature switched on (sliding
window, logit softcap, QK norm, ...).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COMMON = dict(
    vocab_size=512, num_hidden_layers=2, max_position_embeddings=512, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
LLAMA_LIKE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", **LLAMA_LIKE),
    "qwen2": dict(model_type="qwen2", **LLAMA_LIKE),
    "qwen3": dict(model_type="qwen3", **LLAMA_LIKE),
    "mistral": dict(model_type="mistral", sliding_window=24, **LLAMA_LIKE),
    "phi3": dict(
        model_type="phi3", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
    ),
    "gemma2": dict(
        model_type="gemma2", sliding_window=24, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
        query_pre_attn_scalar=64, layer_types=["sliding_attention", "full_attention"], **LLAMA_LIKE,
    ),
    "gemma3": dict(
        model_type="gemma3_text", sliding_window=24, query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"], **LLAMA_LIKE,
    ),
    "gpt2": dict(
        model_type="gpt2", n_embd=256, n_head=4, n_layer=2, n_positions=512, vocab_size=512,
        bos_token_id=1, eos_token_id=2,
    ),
}


def tiny_config(family: str, num_layers: int = 2):
    kwargs = dict(TINY_CONFIGS[family])
    model_type = kwargs.pop("model_type")
    if model_type == "gpt2":
        kwargs["n_layer"] = num_layers
    else:
        kwargs = {**COMMON, **kwargs, "num_hidden_layers": num_layers}
        if "layer_types" in kwargs:
            kwargs["layer_types"] = kwargs["layer_types"][:num_layers]
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "eager", num_layers: int = 2,
               vocab_size: int | None = None):
    """A float32 eval-mode model with deterministic random weights (scaled up so logits are not flat);
    vocab_size overrides the config's (a real model's share of logits in the activations)."""
    torch.manual_seed(seed)
    config = tiny_config(family, num_layers)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model.eval()


# The Split regexes of Qwen2's and Llama 3's tokenizer.json (byte-level BPE families the runner reads)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|", 1)


def tiny_bpe_tokenizer(lines: list[str], vocab_size: int = 512, split: str | None = None, nfc: bool = False):
    """A byte-level BPE (ByteLevel decoder) trained on `lines`, as a transformers PreTrainedTokenizerFast
    with <pad>=0, <s>=1, </s>=2 like the tiny models' config. Pre-tokenizer: GPT-2's (ByteLevel with its
    regex), or with `split` (QWEN2_SPLIT, LLAMA3_SPLIT) that Split regex then ByteLevel without one, as
    Qwen2 and Llama 3 have it; nfc: an NFC normalizer (as HF's Qwen2 tokenizer.json has)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def plant_key_outliers(model, magnitude: float = 60.0, channels: tuple[int, ...] = (30, 31, 62, 63)):
    """Give every layer's k_proj a bias that puts a few channels of each KV head far above the rest, as
    Qwen2.5's keys have (its k_proj bias and the "massive" low-frequency RoPE channels; with HF's
    rotate-half RoPE, channels i and i + head_dim/2 form a pair, and the last ones turn slowest).
    In place; returns the model. Needs a family whose k_proj has a bias (qwen2)."""
    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        proj = layer.self_attn.k_proj
        if proj.bias is None:
            raise ValueError("plant_key_outliers needs a k_proj with a bias (e.g. the qwen2 family)")
        d = model.config.head_dim
        with torch.no_grad():
            for h in range(proj.out_features // d):
                for c in channels:
                    sign = 1.0 if torch.rand((), generator=gen) > 0.5 else -1.0
                    proj.bias[h * d + c] = sign * magnitude
    return model
