"""Building the policy's model on one rank: rank-0 load, `parallelize()` on the meta device, broadcast into
the shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain.logging import get_logger
from posttrain.models.cpu_gemm import apply_cpu_matmul
from posttrain.models.families import attn_implementation, check_generation_support, check_trainable
from posttrain.models.hf import (
    build_tiny_model,
    load_hf_config,
    load_model,
    load_tokenizer,
    tie_lm_head,
    tiny_config,
)
from posttrain.models.lora import LoraSettings, add_lora
from posttrain.models.rope import length_rotaries
from posttrain.models.scalar_head import (
    SCORE_HEAD,
    build_tiny_score_model,
    check_score_source,
    load_score_model,
    score_model_config,
)
from posttrain.models.tokenizer import build_char_tokenizer, build_chat_tokenizer, pad_token_id
from posttrain.parallel.dims import ParallelDims
from posttrain.parallel.mesh import local_tensor
from posttrain.parallel.parallelize import parallelize
from posttrain.policy.config import ModelConfig, PolicyConfig

log = get_logger(__name__)


def build_tokenizer(cfg: ModelConfig):
    """The tokenizer of the model (the built-in char tokenizer for `tiny`; `tiny-chat`: the char
    tokenizer with chat tokens and a chat template, for multi-turn environments)."""
    name = cfg.tokenizer or cfg.name
    if name == "tiny-chat":
        return build_chat_tokenizer()
    return build_char_tokenizer() if name == "tiny" else load_tokenizer(name)


def load_full_model(cfg: ModelConfig, tokenizer):
    """The full model on the host in fp32 (rank 0 only under FSDP): a causal LM, or with `head=score` a
    scalar-head model (models/scalar_head.py)."""
    if cfg.head == "score":
        pad = pad_token_id(tokenizer)
        if cfg.name == "tiny":
            return build_tiny_score_model(len(tokenizer), pad, seed=cfg.seed, cfg=cfg.tiny)
        return load_score_model(cfg.name, pad, seed=cfg.seed)
    if cfg.name == "tiny":
        return build_tiny_model(len(tokenizer), seed=cfg.seed, cfg=cfg.tiny)
    return load_model(cfg.name)


def engine_model(cfg: ModelConfig, lora: LoraSettings | None, tokenizer):
    """The model an engine starts from: the policy's base model, with the policy's LoRA adapters when
    weight sync sends adapters alone (`lora.engine=adapters`; their values come with each sync)."""
    if cfg.head != "lm":
        raise ValueError("an engine generates with a causal LM: policy.model.head must be 'lm', not 'score'")
    check_generation_support(model_config(cfg, tokenizer))  # before weights load
    model = load_full_model(cfg, tokenizer)
    for rope in length_rotaries(model):
        log.warning(
            "%s: its rotary embedding (%s) changes frequencies past %d tokens. The trainer scores every "
            "sequence at its own length; the engine samples a sequence past that length with the step's "
            "frequencies and keeps its cached keys' rotation, so its sampled logprobs there differ from "
            "the trainer's (importance weights correct for it; keep completions under the length to avoid it)",
            cfg.name,
            rope.module.rope_type,
            rope.limit,
        )
    if lora is not None and lora.engine == "adapters":
        model = add_lora(model, lora)
    return apply_cpu_matmul(model, cfg.cpu_matmul)  # after LoRA: its adapters' layers too, as the trainer's


def model_config(cfg: ModelConfig, tokenizer=None):
    """The transformers config of the model (the tiny model's needs its tokenizer's size); with
    `head=score`, checked as a scalar-head source and given one output."""
    if cfg.name == "tiny" or cfg.head == "score":
        tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg)
    config = tiny_config(len(tokenizer), cfg.tiny) if cfg.name == "tiny" else load_hf_config(cfg.name)
    if cfg.head == "lm":
        return config
    if cfg.name != "tiny":
        check_score_source(config, cfg.name)
    return score_model_config(config, pad_token_id(tokenizer))


def build_policy_model(
    cfg: PolicyConfig, tokenizer, device: torch.device, dims: ParallelDims, dtype: torch.dtype
):
    """The model of this rank, parallelized by `parallelize()`: the full model on this device without
    FSDP2; otherwise built on the meta device, sharded, materialized, and filled with rank 0's weights
    (broadcast into every shard). With `cfg.lora`, adapters are injected before parallelizing (rank 0's
    initialization is the one every layout gets). Under FSDP2, `dims.build_mesh()` must have run."""
    ac = cfg.parallel.activation_checkpointing
    config = model_config(cfg.model, tokenizer)
    check_trainable(config, dims.tp_enabled, dims.cp_enabled)  # before weights load
    check_dropout_support(cfg, config)  # also checked by Policy before its ranks start
    if not dims.fsdp_enabled:
        model = _with_layers(load_full_model(cfg.model, tokenizer), cfg).to(device)
        return parallelize(model, dims, param_dtype=dtype, activation_checkpointing=ac)
    full = _with_layers(load_full_model(cfg.model, tokenizer), cfg) if dist.get_rank() == 0 else None
    config = full.config if full is not None else config
    auto = AutoModelForSequenceClassification if cfg.model.head == "score" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation(config))
    _with_layers(model, cfg)
    parallelize(model, dims, param_dtype=dtype, activation_checkpointing=ac)
    model.to_empty(device=dims.param_device(device))
    tie_lm_head(model)
    _load_from_rank0(model, full)
    return model


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every dropout off: nn.Dropout modules at p=0 and the float `*dropout*` attributes
    that attention modules read at forward time (e.g. Llama's `attention_dropout`) at 0. The config is
    left as it is, so a saved model keeps the values it came with."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


def dropout_settings(config) -> dict[str, float]:
    """The non-zero dropout probabilities of a transformers config (`*dropout*` and `*pdrop*` keys, in
    nested sub-configs too), by key."""
    found: dict[str, float] = {}

    def walk(values: dict, prefix: str) -> None:
        for key, value in ((str(k), v) for k, v in values.items()):
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif ("dropout" in key or "pdrop" in key) and _is_number(value) and value > 0:
                found[prefix + key] = float(value)

    walk(config.to_dict(), "")
    return found


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_dropout_support(cfg: PolicyConfig, config) -> None:
    """Refuse the model's own dropout under tensor parallelism (`model.disable_dropout=false`, a config
    with non-zero dropout, tensor_parallel_size > 1): dropout on local heads and on sequence-parallel
    shards would need a generator shared by the group for replicated activations and distinct per rank
    for sharded ones, which is not built; each rank seeds its generators alike within the group."""
    tp = cfg.parallel.tensor_parallel_size
    found = dropout_settings(config) if tp > 1 and not cfg.model.disable_dropout else {}
    if found:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(found.items()))
        raise ValueError(
            f"policy.model.disable_dropout=false with tensor_parallel_size={tp}, and the model's config has "
            f"dropout ({settings}): the ranks of a tensor-parallel group would drop their activations "
            "without a tensor-parallel random generator, which is not built. Set "
            "policy.model.disable_dropout=true (the default), or use tensor_parallel_size=1"
        )


def _with_layers(model: torch.nn.Module, cfg: PolicyConfig) -> torch.nn.Module:
    """`model` with the layers the policy trains through: `cfg.lora`'s adapters (a score head, often
    new, trains in full next to them, never adapted), then every linear layer on the GEMM of
    `model.cpu_matmul` (before parallelizing: FSDP2 subclasses the modules' classes). The model's own
    dropout is off first (`model.disable_dropout`); the adapters' `lora_dropout` stays as configured."""
    if cfg.model.disable_dropout:
        without_dropout(model)
    if cfg.lora is not None:
        with_lora(model, cfg.lora, cfg.model.head)
    return apply_cpu_matmul(model, cfg.model.cpu_matmul)


def with_lora(model: torch.nn.Module, lora: LoraSettings, head: str) -> torch.nn.Module:
    """`model` with `lora`'s adapters, as the policy trains it: with `head=score` the score head is never
    adapted and trains in full (it is often new), so LoRA checkpoints save it next to the adapters."""
    if head == "lm":
        return add_lora(model, lora)
    add_lora(model, lora, exclude=(SCORE_HEAD,))
    model.score.weight.requires_grad_(True)
    return model


def _load_from_rank0(model: torch.nn.Module, full: torch.nn.Module | None) -> None:
    """Broadcast rank 0's full weights and buffers into this rank's shards (`full` None off rank 0)."""
    full_sd = full.state_dict() if full is not None else {}
    set_model_state_dict(
        model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    full_buffers = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        local = local_tensor(buf)  # a DTensor where it is replicated over tp
        if full is not None:
            local.copy_(full_buffers[name])
        dist.broadcast(local, src=0)
