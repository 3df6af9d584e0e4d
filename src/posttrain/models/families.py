"""Which model families posttrain trains, generates with and parallelizes: one table, checked before any
weights load.

Every entry was verified on a tiny random model of the family (scripts/check_model_families.py, CPU,
fp32): trainer logprobs of right-padded rows equal each row run alone and packed rows equal padded
ones (1e-5), a backward gives finite gradients; `generate`: the engine's greedy equals transformers'
generate; `tensor_parallel` / `context_parallel`: 2 gloo ranks give the one-rank logprobs (1e-5).
A model type that is not in the table is refused with the reason when its config shows an architecture
posttrain does not implement (recurrent or state-space layers, latent attention, ALiBi,
encoder-decoder), and as unverified otherwise.

The attention implementation is chosen per family: SDPA where transformers implements it, else eager
(Gemma2, gpt-oss). Both take the explicit 4-D masks of packed rows and shared-prefix plans
(models/logprobs.py); context parallelism replaces either with its own attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoModelForCausalLM, PretrainedConfig

ENGINE_WINDOWS = "sliding-window attention (the engine keeps windowed layers' KV to the window)"


@dataclass(frozen=True)
class Support:
    """What posttrain does with one model type (see the module docstring for what was verified)."""

    train: bool = True
    generate: bool = True
    tensor_parallel: bool = False
    context_parallel: bool = False
    notes: str = ""


MOE = (
    "mixture of experts (transformers' fused experts; data, expert, tensor and context parallelism, the "
    "experts unsplit by tensor parallelism; routing replay and router losses: policy.moe, not with context "
    "parallelism)"
)

SUPPORTED: dict[str, Support] = {
    "llama": Support(tensor_parallel=True, context_parallel=True, notes="also Llama-3 rope scaling"),
    "mistral": Support(tensor_parallel=True, context_parallel=True, notes=ENGINE_WINDOWS),
    "qwen2": Support(
        tensor_parallel=True, context_parallel=True, notes=f"use_sliding_window: {ENGINE_WINDOWS}"
    ),
    "qwen3": Support(tensor_parallel=True, context_parallel=True),
    "gemma": Support(tensor_parallel=True, context_parallel=True),
    "gemma2": Support(
        tensor_parallel=True,
        notes="eager attention (no SDPA in transformers); context parallelism does not implement logit "
        f"soft-capping; {ENGINE_WINDOWS}",
    ),
    "gemma3_text": Support(
        context_parallel=True, notes=f"tensor parallelism: no colwise/rowwise plan; {ENGINE_WINDOWS}"
    ),
    "gpt_oss": Support(
        notes="eager attention (no SDPA in transformers); MoE trains on CPU; tensor parallelism: no plan "
        f"for its experts; context parallelism does not implement attention sinks (it gave wrong logprobs); "
        f"{ENGINE_WINDOWS}"
    ),
    "qwen3_moe": Support(tensor_parallel=True, context_parallel=True, notes=MOE),
    "mixtral": Support(tensor_parallel=True, context_parallel=True, notes=f"{MOE}; {ENGINE_WINDOWS}"),
    "olmoe": Support(
        context_parallel=True,
        notes=f"{MOE}; tensor parallelism: no colwise/rowwise plan (q/k norms span all heads)",
    ),
    "phi3": Support(context_parallel=True, notes="tensor parallelism: no colwise/rowwise plan (fused qkv)"),
    "olmo2": Support(context_parallel=True, notes="tensor parallelism: no colwise/rowwise plan"),
    "granite": Support(tensor_parallel=True, context_parallel=True),
    "phi": Support(tensor_parallel=True, context_parallel=True),
    "cohere": Support(tensor_parallel=True, context_parallel=True),
    "olmo": Support(tensor_parallel=True, context_parallel=True),
    "starcoder2": Support(tensor_parallel=True, context_parallel=True),
    "stablelm": Support(
        notes="tensor parallelism: no plan; context parallelism: its layers do not pass the layout to attention"
    ),
    "glm": Support(context_parallel=True, notes="tensor parallelism: no colwise/rowwise plan"),
}

# Model types that were tried and fail, with why (the first lines of their refusal).
REFUSED: dict[str, str] = {
    "bloom": "it adds ALiBi position biases built from a 2-D padding mask, which packed rows and the "
    "explicit 4-D masks of posttrain's trainer do not give it",
    "deepseek_v3": "its multi-head latent attention (MLA) has keys and values of different head sizes, "
    "which the trainer's attention and the engine's KV cache do not implement",
    "mamba": "its layers are a state-space recurrence, not attention: packing, masks and the engine's KV "
    "cache do not apply",
    "lfm2": "its short-convolution layers carry state across tokens: packed rows leak between sequences "
    "and the engine's KV cache has no convolution state",
    "gpt_neox": "its decoder layers are not at model.model.layers, where FSDP2 (more than one rank) wraps "
    "them (one rank trains and generates correctly)",
    "qwen3_next": "its linear-attention (Gated DeltaNet) layers are recurrent: packed rows leak between "
    "sequences and the engine's KV cache has no recurrent state",
}


def attn_implementation(config: PretrainedConfig) -> str:
    """The trainer's attention for this config: SDPA where transformers implements it for the model
    class (it takes our boolean 4-D masks and is fast), else eager (gpt-oss). Attention logit
    soft-capping (Gemma2) is eager always: SDPA has no soft-capping, and transformers 5.17 still let
    Gemma2 run SDPA without it (5.24 refuses SDPA for Gemma2)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "eager"
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


def _architecture_problem(config: PretrainedConfig) -> str | None:
    """Why a config's architecture cannot run in posttrain, read from its features; None if none shows."""
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; posttrain trains decoder-only causal LMs"
    other = sorted(set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"})
    if other:
        return f"it has {', '.join(other)} layers (recurrent or linear attention), which posttrain does not implement"
    if getattr(config, "kv_lora_rank", None):
        return "it uses multi-head latent attention (MLA), which posttrain does not implement"
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        return "it uses ALiBi position biases, which posttrain's packed masks do not carry"
    if getattr(config, "state_size", None) or getattr(config, "ssm_cfg", None):
        return "it has state-space (Mamba-style) layers, which posttrain does not implement"
    return None


def _refusal(model_type: str, what: str, why: str) -> ValueError:
    listed = ", ".join(t for t, s in SUPPORTED.items() if getattr(s, what))
    doing = {"train": "training", "generate": "generation"}[what]
    return ValueError(
        f"model type '{model_type}' is not supported for {doing}: {why}. Supported model types for {doing}: "
        f"{listed} (the table in posttrain/models/families.py; README, 'Model support')"
    )


def family_support(config: PretrainedConfig, what: str = "train") -> Support:
    """The table's entry for `config`; ValueError naming why and what is supported when there is none,
    or when the entry does not support `what` ("train" or "generate")."""
    model_type = getattr(config, "model_type", None) or "unknown"
    support = SUPPORTED.get(model_type)
    if support is None:
        why = REFUSED.get(model_type) or _architecture_problem(config)
        raise _refusal(model_type, what, why or "it has not been verified with posttrain (see the table)")
    if not getattr(support, what):
        raise _refusal(model_type, what, support.notes or "not verified")
    return support


def check_trainable(
    config: PretrainedConfig, tensor_parallel: bool = False, context_parallel: bool = False
) -> None:
    """Refuse, before any weights load, a model the trainer cannot run in this layout (ValueError naming
    why and what is supported)."""
    support = family_support(config, "train")
    model_type = config.model_type
    if tensor_parallel and not support.tensor_parallel:
        raise ValueError(
            f"tensor parallelism is not supported for model type '{model_type}' ({support.notes or 'not verified'}); "
            "use parallel.tensor_parallel_size=1"
        )
    if context_parallel and not support.context_parallel:
        raise ValueError(
            f"context parallelism is not supported for model type '{model_type}' ({support.notes or 'not verified'}); "
            "use parallel.context_parallel_size=1"
        )


def check_generation_support(config: PretrainedConfig) -> None:
    """Refuse a model the generation engine cannot run (ValueError naming why and what is supported).
    The engine calls this when it is built (generation/engine.py, `_build_model`)."""
    family_support(config, "generate")


def support_table_markdown() -> str:
    """The README's 'Model support' table, generated from `SUPPORTED` and `REFUSED`."""
    yes = {True: "yes", False: "no"}
    lines = [
        "| model type | train | generate | tensor parallel | context parallel | notes |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in SUPPORTED.items():
        flags = (s.train, s.generate, s.tensor_parallel, s.context_parallel)
        lines.append(f"| {name} | " + " | ".join(yes[f] for f in flags) + f" | {s.notes} |")
    for name, why in REFUSED.items():
        lines.append(f"| {name} | no | no | no | no | refused: {why} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m posttrain.models.families: the README's table
    print(support_table_markdown())
