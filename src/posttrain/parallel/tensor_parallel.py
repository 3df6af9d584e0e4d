"""Tensor (and sequence) parallelism for Hugging Face decoders, as a function applied to the model.

`apply_tp(model, tp_mesh, sequence_parallel)` shards, per decoder layer, q/k/v and gate/up
column-wise (each rank owns whole attention heads and a slice of the MLP) and o/down row-wise (their
outputs are summed over the group); the embedding row-wise over the vocabulary; and the lm_head
column-wise with its output left sharded on the vocabulary, so logprobs are computed by
models/vocab_parallel.py without gathering [.., V]. With `sequence_parallel`, the activations between
those blocks (norms, residuals) are sharded on the sequence: all-gathered before attention and the MLP,
reduce-scattered after.

Every other parameter (norm weights, Qwen3's per-head q/k norms) becomes a DTensor replicated over the
group, so that all parameters live on the same (dp_cp, tp) mesh once FSDP2 shards them (one grad norm,
one checkpoint layout) and a gradient that each rank computed from a part of the input (sequence shards,
its own heads) is summed over the group.

LoRA layers (models/lora.py) are sharded with their base layer: under a column-wise layer A is
replicated and B column-wise (B's output rows are the base layer's); under a row-wise layer A is
row-wise (its partial output summed like the base layer's) and B replicated. The adapter's output then
has the base layer's layout, so peft's `base(x) + B(A(x)) * scaling` adds matching local tensors.

A mixture-of-experts block (router and fused experts, Qwen3-MoE and Mixtral) is not split: its
parameters stay plain tensors (FSDP2 shards them over the data-parallel ranks alone, or expert
parallelism over its expert groups) and every rank of the group routes and runs the experts for all
the call's tokens, from the same input, so their gradients agree without a reduction. Under sequence
parallelism its input is all-gathered first and each rank keeps its part of the output. The router
therefore sees every token of the call in order, as routing replay and the router losses need.

Departures from HF's own `base_model_tp_plan`: our plans also shard the embedding and lm_head over the
vocabulary and know sequence parallelism; a scalar head (`score`, reward models and critics) is
replicated. A model type without a plan here falls back to its config's
`base_model_tp_plan` when that uses only "colwise"/"rowwise" entries; otherwise it is refused.
"""

from __future__ import annotations

import fnmatch
import logging
import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from posttrain.models.families import check_trainable
from posttrain.models.hf import tie_lm_head
from posttrain.models.lora import ADAPTER, lora_layers
from posttrain.parallel.dims import ParallelDims
from posttrain.parallel.expert_parallel import expert_modules
from posttrain.parallel.mesh import decoder_layers

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "qwen3_moe", "mixtral")


class Replicated(ParallelStyle):
    """Parameters replicated over the group; the input is taken as a DTensor with `input_layout` (its
    rank-local part) and the output handed back as this rank's local tensor. A gradient computed from
    sharded inputs is partial; FSDP2 redistributes it to the parameter's replicated layout, which sums
    it over the group."""

    def __init__(self, input_layout: Shard | Replicate | None = None) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        layout = self.input_layout

        def to_dtensor(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [layout], run_check=False) if isinstance(x, torch.Tensor) else x
                for x in inputs
            )

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


def check_tp_divides(config, tp: int) -> None:
    """Raise ValueError naming the numbers and the valid sizes when `tp` does not divide the model."""
    if tp == 1:
        return
    dims = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    }
    if _has_dense_mlp(config):
        dims["intermediate_size"] = config.intermediate_size
    bad = {k: v for k, v in dims.items() if v % tp}
    if bad:
        g = math.gcd(*dims.values())
        valid = [d for d in range(1, g + 1) if g % d == 0]
        raise ValueError(
            f"parallel.tensor_parallel_size={tp} does not divide "
            + ", ".join(f"{k}={v}" for k, v in bad.items())
            + f" of this model ({', '.join(f'{k}={v}' for k, v in dims.items())}); "
            f"valid tensor_parallel_size values: {valid}"
        )


def _has_dense_mlp(config) -> bool:
    """Whether some decoder layer has a dense MLP (`intermediate_size` wide): every layer of a dense
    model; a Qwen3-MoE layer in `mlp_only_layers` or off its `decoder_sparse_step`; no Mixtral layer."""
    if config.model_type == "mixtral":
        return False
    if config.model_type == "qwen3_moe" and config.num_experts > 0:
        return bool(config.mlp_only_layers) or config.decoder_sparse_step > 1
    return True


def moe_block(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer's `mlp` is a mixture-of-experts block (a router beside fused experts)."""
    mlp = getattr(layer, "mlp", None)
    return mlp is not None and bool(expert_modules(mlp))


def _layer_plan(sequence_parallel: bool, moe: bool = False) -> dict[str, ParallelStyle]:
    attn_out = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=attn_out),
    }
    if not moe:
        plan["mlp.gate_proj"] = ColwiseParallel()
        plan["mlp.up_proj"] = ColwiseParallel()
        plan["mlp.down_proj"] = RowwiseParallel(output_layouts=attn_out)
    if sequence_parallel:
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
        if not moe:
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        else:  # the block's output is whole on every rank: each keeps its part of the sequence
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            )
    return plan


def _from_hf_plan(config) -> dict[str, ParallelStyle]:
    """A decoder-layer plan from the config's `base_model_tp_plan` (colwise/rowwise entries only)."""
    model_type = config.model_type
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    unknown = {k: v for k, v in hf_plan.items() if v not in styles}
    if not hf_plan or unknown:
        raise ValueError(
            f"tensor parallelism has no plan for model type '{model_type}'"
            + (f" (its base_model_tp_plan uses {sorted(set(unknown.values()))})" if unknown else "")
            + f"; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}. Use tensor_parallel_size=1"
        )
    return {k: styles[v]() for k, v in hf_plan.items()}


def check_parallel_support(config, dims: ParallelDims) -> None:
    """Raise ValueError, naming the fix, when `dims` cannot run this model: a TP size that does not
    divide it, a model type without a TP plan (or without our plan, for sequence parallelism), or
    attention that context parallelism does not implement. Cheap: the driver calls it before any rank
    starts, and `parallelize()` on every rank. The model type must be in the support table
    (models/families.py) with the layout's flags."""
    if dims.cp_enabled and getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"context parallelism does not implement attention logit soft-capping (model type "
            f"'{config.model_type}'); use parallel.context_parallel_size=1"
        )
    check_trainable(config, tensor_parallel=dims.tp_enabled, context_parallel=dims.cp_enabled)
    if dims.tp_enabled and getattr(config, "router_jitter_noise", 0):
        raise ValueError(
            f"router_jitter_noise={config.router_jitter_noise} (model type '{config.model_type}') with "
            f"tensor_parallel_size={dims.tp}: every rank of the group runs the MoE block whole and must "
            "route alike, and the jitter is random per rank (it also scales the block's input in place, "
            "which the tensor-parallel input forbids). Set router_jitter_noise=0 in the model's config, "
            "or use tensor_parallel_size=1"
        )
    if dims.tp_enabled:
        check_tp_divides(config, dims.tp)
        _tp_plan(config, dims.sequence_parallel)


def _tp_plan(config, sequence_parallel: bool) -> dict[str, ParallelStyle] | None:
    """The config's own plan for a model type we have no plan for (None: ours applies)."""
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_MODEL_TYPES:
        return None
    if sequence_parallel:
        raise ValueError(
            f"sequence parallelism has no plan for model type '{model_type}'; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. Set parallel.sequence_parallel=false"
        )
    return _from_hf_plan(config)


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> torch.nn.Module:
    """Shard `model` over `tp_mesh` in place (see the module docstring); returns it."""
    hf_plan = _tp_plan(model.config, sequence_parallel)
    check_tp_divides(model.config, tp_mesh.size())
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    # DTensor logs each (dp_cp, tp) grad-norm or full-tensor gather that takes two collectives instead
    # of one over a flattened mesh: a few scalar reductions per step, not worth a line per step per rank
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if hf_plan is not None:
        parallelize_module(model.model, tp_mesh, _with_adapters(model.model, hf_plan))
    else:
        for layer in decoder_layers(model):
            plan = _layer_plan(sequence_parallel, moe_block(layer))
            parallelize_module(layer, tp_mesh, _with_adapters(layer, plan))
    embed_out = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=embed_out)
    }
    if hasattr(model, "lm_head"):
        plan["lm_head"] = ColwiseParallel(
            input_layouts=embed_out, output_layouts=Shard(-1), use_local_output=False
        )
    parallelize_module(model, tp_mesh, plan)
    tie_lm_head(model)  # both are sharded on the vocabulary (dim 0 of the weight)
    if hasattr(model, "score"):
        _replicate_score_head(model.score, tp_mesh, sequence_parallel)
    _replicate_the_rest(model, tp_mesh, sequence_parallel)
    _refreeze(model, frozen)
    return model


def _replicate_score_head(score: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """A scalar head (models/scalar_head.py: hidden -> 1, too narrow to split) is replicated over the
    group and reads the whole sequence: under sequence parallelism its input is all-gathered first."""
    if sequence_parallel:
        parallelize_module(
            score,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        )
    parallelize_module(score, tp_mesh, Replicated())


def _refreeze(model: torch.nn.Module, frozen: list[str]) -> None:
    """Parameters that were frozen before sharding stay frozen (LoRA's base): torch's `SequenceParallel`
    re-registers the norms' weights as new parameters, which require gradients."""
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)


def _with_adapters(root: torch.nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` with each LoRA layer's entry split into its base layer and its two adapters (see the module
    docstring). A pattern key (`layers.*.mlp.fc1`) that names adapted layers is expanded into the modules
    it names, so that layers it also names but LoRA left alone (a `target_modules` regex that picks some
    layers) keep the key's style."""
    adapted = set(lora_layers(root))
    if not adapted:
        return plan
    names = [name for name, _ in root.named_modules()]
    out: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        matched = [name for name in names if _names(name, key)]
        if not adapted.intersection(matched):
            out[key] = style
            continue
        for name in matched:
            if name not in adapted:
                out[name] = style
                continue
            out[f"{name}.base_layer"] = style
            out[f"{name}.lora_A.{ADAPTER}"], out[f"{name}.lora_B.{ADAPTER}"] = _adapter_styles(style)
    return out


def _names(name: str, key: str) -> bool:
    """Whether plan `key` names module `name`, matched one dotted part at a time as `parallelize_module`
    does (`*` does not cross a dot)."""
    parts, atoms = name.split("."), key.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms))


def _adapter_styles(style: ParallelStyle) -> tuple[ParallelStyle, ParallelStyle]:
    """(A's style, B's style) for an adapter on a layer sharded by `style`."""
    if isinstance(style, ColwiseParallel):
        layout = style.input_layouts[0]
        return Replicated(layout), ColwiseParallel(
            input_layouts=layout,
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    if isinstance(style, RowwiseParallel):
        out = style.output_layouts[0]
        return RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=out), Replicated(out)
    raise ValueError(
        f"LoRA under tensor parallelism supports column- and row-wise layers, not {type(style).__name__}; "
        "leave that module out of policy.lora.target_modules or use tensor_parallel_size=1"
    )


def _replicate_the_rest(model: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Modules still holding plain parameters (norms) become replicated DTensor modules: inside attention
    (Qwen3's per-head q/k norms) their input is this rank's heads [b, t, heads/tp, d]; elsewhere it is
    the residual stream (sharded on the sequence under sequence parallelism). A mixture-of-experts block
    is left as it is (see the module docstring)."""
    skip = {id(m) for layer in decoder_layers(model) if moe_block(layer) for m in layer.mlp.modules()}
    for name, module in model.named_modules():
        if id(module) in skip:
            continue
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            if fnmatch.fnmatch(name, "*self_attn.*"):
                style: ParallelStyle = Replicated(Shard(2))
            elif sequence_parallel:
                style = SequenceParallel(use_local_output=True)
            else:
                style = Replicated()
            parallelize_module(module, tp_mesh, style)
