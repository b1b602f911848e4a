"""What the KV cache needs to know about a model, read from its HF config: the one ModelDims.

    d = model_dims(config)        # ModelDims(num_layers, num_heads, num_kv_heads, head_dim, vocab_size)
    windows = layer_windows(config)  # per layer, the sliding window (0 = global attention)

Plain data and attribute reads only: importing this module imports neither torch nor transformers, so
memory planning and the simulator (runtime_sim.plan / runtime_sim.simulate) use it without them.
"""

from __future__ import annotations

from dataclasses import dataclass


def text_config(config):
    """The text part of a config (multimodal configs nest it; plain ones are their own text config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def model_dims(config) -> ModelDims:
    cfg = text_config(config)
    heads = cfg.num_attention_heads
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    return ModelDims(
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
    )


def layer_windows(config) -> list[int]:
    """Per layer, the sliding window HF's attention uses (0 = global): from config.layer_types where
    the family has it (Gemma 2/3, Qwen2/3, ...), else config.sliding_window for every layer (Mistral)."""
    cfg = text_config(config)
    n = cfg.num_hidden_layers
    window = int(getattr(cfg, "sliding_window", None) or 0)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else 0 for t in types[:n]]
    if getattr(cfg, "model_type", "") in ("mistral", "phi3"):
        return [window] * n
    return [0] * n


__all__ = ["ModelDims", "layer_windows", "model_dims"]
