"""`parallelize(model, dims)`: the one place that applies a parallel layout to a Hugging Face causal LM.

In order (torchtitan style): tensor parallelism with its plan and sequence parallelism
(parallel/tensor_parallel.py), activation checkpointing, the context-parallel attention
(models/context_parallel.py), expert parallelism (parallel/expert_parallel.py), and FSDP2 over the
flattened (dp, cp) mesh (the experts excluded when they are expert-parallel), with mixed precision and the
CPU-offload policy. Under FSDP2 the model is expected on the meta device (materialize and load it after);
without FSDP2 (one rank) only activation checkpointing applies.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from posttrain.models.context_parallel import register_attention
from posttrain.parallel.dims import ParallelDims
from posttrain.parallel.expert_parallel import apply_ep
from posttrain.parallel.mesh import decoder_layers
from posttrain.parallel.tensor_parallel import apply_tp, check_parallel_support


def parallelize(
    model: torch.nn.Module,
    dims: ParallelDims,
    *,
    param_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
) -> torch.nn.Module:
    """Apply `dims` to `model` in place (see the module docstring); returns it. Under FSDP2, call
    `dims.build_mesh(device)` first. Raises ValueError, naming the fix, when the layout cannot run this
    model (parallel/tensor_parallel.check_parallel_support)."""
    check_parallel_support(model.config, dims)
    meshes = dims.meshes
    assert meshes is not None or not dims.fsdp_enabled, "call dims.build_mesh(device) before parallelize()"
    if meshes is not None and meshes.tp is not None:
        apply_tp(model, meshes.tp, sequence_parallel=dims.sp_enabled)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if meshes is not None and meshes.cp is not None:
        model.set_attn_implementation(register_attention())
    ignored = apply_ep(model, meshes.fsdp, dims.ep) if meshes is not None and dims.ep > 1 else set()
    if meshes is not None:
        apply_fsdp(model, meshes.fsdp, param_dtype=param_dtype, cpu_offload=dims.cpu_offload, ignored=ignored)
    return model


def apply_fsdp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    ignored: set[torch.nn.Parameter] | None = None,
) -> torch.nn.Module:
    """FSDP2 per decoder layer, then the root; gradients are summed (not averaged) over DP ranks.

    The loss contract already divides by the *global* token or sequence count, so FSDP's default
    averaging over ranks would divide twice.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": reshard_after_forward}
    if ignored:  # expert-parallel experts: sharded by parallel/expert_parallel.py, not by FSDP2
        kwargs["ignored_params"] = ignored
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    sharded = [*decoder_layers(model), model]
    for module in sharded:
        fully_shard(module, **kwargs)
    for module in sharded:  # both settings are per FSDP module (they do not recurse)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute decoder-layer activations in backward (non-reentrant)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
