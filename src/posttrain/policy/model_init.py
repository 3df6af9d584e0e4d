"""Building the policy's model on one rank: rank-0 load, FSDP2 sharding, broadcast into the shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.models.context_parallel import register_attention
from posttrain.models.hf import build_tiny_model, load_model, load_tokenizer, tie_lm_head, tiny_config
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.parallel import mesh as pmesh
from posttrain.parallel.tensor_parallel import apply_tp, check_parallel_support
from posttrain.policy.config import ModelConfig, PolicyConfig


def build_tokenizer(cfg: ModelConfig):
    """The tokenizer of the model (the built-in char tokenizer for `tiny`)."""
    name = cfg.tokenizer or cfg.name
    return build_char_tokenizer() if name == "tiny" else load_tokenizer(name)


def load_full_model(cfg: ModelConfig, tokenizer):
    """The full model on the host in fp32 (rank 0 only under FSDP)."""
    if cfg.name == "tiny":
        return build_tiny_model(len(tokenizer), seed=cfg.seed, cfg=cfg.tiny)
    return load_model(cfg.name)


def model_config(cfg: ModelConfig, tokenizer=None):
    """The transformers config of the model (the tiny model's needs its tokenizer's size)."""
    if cfg.name == "tiny":
        return tiny_config(len(tokenizer if tokenizer is not None else build_tokenizer(cfg)), cfg.tiny)
    return AutoConfig.from_pretrained(cfg.name)


def build_policy_model(
    cfg: PolicyConfig, tokenizer, device: torch.device, meshes: pmesh.Meshes | None, dtype: torch.dtype
):
    """Full model on this device (`meshes` None), or tensor-parallel (when `meshes.tp`) and FSDP2-sharded
    with rank 0's weights broadcast into every shard."""
    if meshes is None:
        model = load_full_model(cfg.model, tokenizer).to(device)
    else:
        rank = dist.get_rank()
        full = load_full_model(cfg.model, tokenizer) if rank == 0 else None
        config = full.config if full is not None else model_config(cfg.model, tokenizer)
        check_parallel_support(
            config, cfg.parallel.layout(dist.get_world_size()), cfg.parallel.sequence_parallel
        )
        attn = "sdpa" if meshes.cp is None else register_attention()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
        if meshes.tp is not None:
            apply_tp(model, meshes.tp, sequence_parallel=cfg.parallel.sequence_parallel)
        pmesh.apply_fsdp(model, meshes.fsdp, param_dtype=dtype, cpu_offload=cfg.parallel.fsdp_cpu_offload)
        model.to_empty(device="cpu" if cfg.parallel.fsdp_cpu_offload else device)
        tie_lm_head(model)
        full_sd = full.state_dict() if full is not None else {}
        set_model_state_dict(
            model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
        full_buffers = dict(full.named_buffers()) if full is not None else {}
        for name, buf in model.named_buffers():
            local = pmesh.local_tensor(buf)  # a DTensor where it is replicated over tp
            if full is not None:
                local.copy_(full_buffers[name])
            dist.broadcast(local, src=0)
        del full
    if cfg.parallel.activation_checkpointing:
        pmesh.apply_activation_checkpointing(model)
    return model
