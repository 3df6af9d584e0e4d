"""Process groups, device meshes and FSDP2, as functions applied to modules (torchtitan style)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> torch.device:
    """The device of this rank: its CUDA device when CUDA is there, else CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(
    rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 600
) -> None:
    """Join the default process group (gloo on CPU, NCCL on GPU) unless already joined."""
    if dist.is_initialized():
        return
    os.environ.update(
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(default_device())
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def ensure_single_process_group() -> None:
    """A world-size-1 group for in-process (local backend) use of FSDP."""
    if not dist.is_initialized():
        init_distributed(0, 1, "127.0.0.1", free_port())


def build_dp_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D data-parallel mesh over all ranks, on its own process group rather than the default one.

    parallel/comms.py can then destroy and recreate the mesh's communicators while the default group
    stays up as the rendezvous (destroying the default group would destroy every group).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = dist.new_group(list(range(dist.get_world_size())), backend=backend, group_desc="dp")
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks of a Hugging Face causal LM (model.model.layers for Llama/Qwen2)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"cannot find decoder layers on {type(model).__name__}: expected `model.model.layers`; "
            "FSDP2 wrapping per layer supports Llama/Qwen2-style models"
        )
    return list(layers)


def apply_fsdp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """FSDP2 per decoder layer, then the root; gradients are summed (not averaged) over DP ranks.

    The loss contract already divides by the *global* token or sequence count, so FSDP's default
    averaging over ranks would divide twice.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": reshard_after_forward}
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
