"""Tiny random-weight configs of the decoder families users pick (a test helper, not the library).

Every config has 2 layers, hidden size 32 and the character tokenizer's vocabulary, so a model builds in
milliseconds. Windowed families get a window of WINDOW tokens, so prompts of ~20 tokens plus their
completions run well past it; where full and windowed layers alternate, both kinds are present.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

WINDOW = 6
_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
_TWO_KINDS = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}

FAMILIES: dict[str, tuple[str, dict]] = {  # name -> (model_type, config overrides)
    "llama": ("llama", {}),
    "llama3_rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "max_window_layers": 1, **_TWO_KINDS}),
    "qwen3": ("qwen3", {"head_dim": 8}),
    "gemma": ("gemma", {"head_dim": 8}),
    "gemma2": (
        "gemma2",
        {"head_dim": 8, "query_pre_attn_scalar": 8, "attn_logit_softcapping": 50.0, **_TWO_KINDS},
    ),
    "gemma3_text": ("gemma3_text", {"head_dim": 8, "query_pre_attn_scalar": 8, **_TWO_KINDS}),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "qwen3_moe": (
        "qwen3_moe",
        {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW}),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": (
        "gpt_oss",
        {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, **_TWO_KINDS},
    ),
}


def family_config(name: str, vocab_size: int, **overrides) -> PretrainedConfig:
    """The tiny config of family `name` (a FAMILIES key, or any other transformers model type with the
    common shape alone)."""
    model_type, extra = FAMILIES.get(name, (name, {}))
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **{**_COMMON, **extra, **overrides},  # overrides may replace a common key (max_position_embeddings)
    )


def save_family_model(name: str, tokenizer, out: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight model of family `name` (config `overrides` on top) saved with `tokenizer` as a
    local HF directory."""
    torch.manual_seed(seed)
    config = family_config(name, len(tokenizer), **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than init scale, so the logits are not all alike (greedy ties)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
