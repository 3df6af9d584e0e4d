"""Loading and saving Hugging Face causal LMs and tokenizers, and a tiny-model factory for tests and demos."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from posttrain.config import Config

TinyFamily = Literal["llama", "qwen2", "qwen3", "mistral", "gemma"]


class TinyModelConfig(Config):
    """Shape of a randomly initialised tiny model (used when `model.name` is `tiny`)."""

    family: TinyFamily = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    sliding_window: int | None = Field(
        None, ge=1, description="attention window in tokens (Mistral/Qwen2-style models); None: full"
    )


def tiny_config(vocab_size: int, cfg: TinyModelConfig | None = None, **overrides) -> PretrainedConfig:
    """A transformers config for a tiny Llama or Qwen2 model."""
    cfg = cfg or TinyModelConfig(**overrides)
    return AutoConfig.for_model(
        cfg.family,
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **({"sliding_window": cfg.sliding_window} if cfg.sliding_window is not None else {}),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_tiny_model(vocab_size: int, seed: int = 0, cfg: TinyModelConfig | None = None, **overrides):
    """A randomly initialised tiny causal LM in fp32 (deterministic for a seed)."""
    config = tiny_config(vocab_size, cfg, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model


def tie_lm_head(model) -> None:
    """Point the lm_head at the input embedding when the config ties them (after anything replaced
    either parameter: sharding, `to_empty`)."""
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.get_input_embeddings().weight


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """`from_pretrained` on a local directory or hub name, with fp32 master weights by default."""
    try:
        return AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype, attn_implementation=attn_implementation
        )
    except OSError as e:
        raise ValueError(
            f"could not load model '{name_or_path}': {e}. Pass a local directory with config.json and "
            "weights, or a hub name reachable from this machine"
        ) from e


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer; sets a pad token (the eos token) when the tokenizer has none."""
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except OSError as e:
        raise ValueError(f"could not load tokenizer '{name_or_path}': {e}") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def save_hf(model, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path, state_dict=None) -> Path:
    """Write a Hugging Face directory (safetensors + config + tokenizer) loadable by from_pretrained."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
