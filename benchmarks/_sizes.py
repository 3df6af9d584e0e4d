"""The model sizes of the size sweep (benchmarks/sweep.py): Llama-3/Qwen2.5-style decoders (grouped-query
attention, SwiGLU MLP of ~2.7-4x the hidden size, tied embeddings as the small Llama-3.2 and Qwen2.5
models have) with a real-size 32000-token vocabulary (Llama-2/Mistral), from ~3M to ~150M parameters.
Each entry is a `TinyModelConfig` shape (posttrain's `model.tiny`)."""

from __future__ import annotations

VOCAB = 32000

SIZES: dict[str, dict] = {
    "3m": {
        "hidden_size": 80,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "20m": {
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
    },
    "60m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 12,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "150m": {
        "hidden_size": 768,
        "intermediate_size": 2816,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    },
}


def shape(name: str) -> dict:
    """The `model.tiny` section of size `name` (tied embeddings, room for 1024 positions)."""
    return {**SIZES[name], "tie_word_embeddings": True, "max_position_embeddings": 1024}
