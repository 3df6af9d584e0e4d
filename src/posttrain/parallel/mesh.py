"""Process groups, device meshes, and gathering (possibly sharded) tensors whole.

The ranks form a (dp, cp, tp) mesh, row-major: rank = (d * cp + c) * tp + t. Ranks that share a dp
index hold the same data (a data-parallel shard); cp splits its sequences, tp its weights. FSDP2
shards parameters over the flattened (dp, cp) dimension; tensor parallelism (parallel/tensor_parallel.py)
over tp. Every group is created here with `new_group` (never the default group), so parallel/comms.py
can tear all of them down and rebuild them while the default group stays up as the rendezvous.
parallel/dims.py decides the sizes; parallel/parallelize.py applies them to a model.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly DTensor) tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly DTensor) tensor: shards gathered (a collective over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_full_weights(model: torch.nn.Module, unique: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for each entry of the model's state dict (parameters and persistent buffers),
    gathering DTensor shards one tensor at a time. Under FSDP2 or TP every rank must consume the
    iterator in step (each gather is a collective). `unique`: a tensor the state dict lists under
    several names (tied embeddings) comes once, under its first name (what a weight sync sends: the
    receiving model is tied the same way)."""
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if unique:
            if id(t) in seen:
                continue
            seen.add(id(t))
        yield name, full_tensor(t).detach()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict as copies on the host (collective under FSDP2 or TP, as above)."""
    return {name: t.to("cpu", copy=True) for name, t in iter_full_weights(model)}


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


def group_backend(device_type: str) -> str:
    """The backend of the process groups on `device_type`: gloo on CPU; on a GPU, NCCL for CUDA tensors
    and gloo beside it for CPU ones (FSDP's CPU offload reduces gradient norms over host tensors)."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def init_distributed(
    rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 600
) -> None:
    """Join the default process group (gloo on CPU, NCCL and gloo on GPU) unless already joined."""
    if dist.is_initialized():
        return
    os.environ.update(
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        group_backend(device.type), rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def ensure_single_process_group() -> None:
    """A world-size-1 group for in-process (local backend) use of FSDP."""
    if not dist.is_initialized():
        init_distributed(0, 1, "127.0.0.1", free_port())


def build_dp_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D data-parallel mesh over all ranks, on its own process group rather than the default one.

    parallel/comms.py can then destroy and recreate the mesh's communicators while the default group
    stays up as the rendezvous (destroying the default group would destroy every group).
    """
    backend = group_backend(device.type)
    group = dist.new_group(list(range(dist.get_world_size())), backend=backend, group_desc="dp")
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))


@dataclass
class Meshes:
    """The meshes a worker's model is parallelized over. `fsdp` is 1-D (dp, or dp x cp flattened).
    Pure data parallelism uses `fsdp` alone; otherwise `root` (dp, cp, tp) and `dp` are set, `tp` when
    tp > 1 and `cp` when cp > 1."""

    fsdp: DeviceMesh
    tp: DeviceMesh | None = None
    cp: DeviceMesh | None = None
    dp: DeviceMesh | None = None
    root: DeviceMesh | None = None

    def all(self) -> list[DeviceMesh]:
        return [m for m in (self.root, self.fsdp, self.tp, self.cp, self.dp) if m is not None]


def groups_along(ranks: torch.Tensor, dim: int, backend: str, desc: str) -> dist.ProcessGroup:
    """Create (world-collectively) every group along `dim` of the rank grid; return this rank's."""
    mine = None
    me = dist.get_rank()
    for members in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
        group = dist.new_group(members, backend=backend, group_desc=desc)
        if me in members:
            mine = group
    assert mine is not None
    return mine


def build_mesh(device: torch.device, tp: int = 1, cp: int = 1) -> Meshes:
    """The meshes of a (dp, cp, tp) layout over all ranks (collective: every rank calls it in the same
    order). ParallelDims.build_mesh is the usual way in."""
    if tp == 1 and cp == 1:
        return Meshes(fsdp=build_dp_mesh(device))
    backend = group_backend(device.type)
    world = dist.get_world_size()
    ranks = torch.arange(world).view(world // (cp * tp), cp, tp)
    groups = [groups_along(ranks, d, backend, name) for d, name in enumerate(("dp", "cp", "tp"))]
    root = DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=("dp", "cp", "tp"))
    dp_cp = root["dp", "cp"]
    if "backend_override" in inspect.signature(dp_cp._flatten).parameters:
        fsdp = dp_cp._flatten("dp_cp", backend_override=backend)  # its own groups, even world-wide
    else:  # older torch: where dp x cp spans the world, the flattened mesh reuses the default group
        fsdp = dp_cp._flatten("dp_cp")
    return Meshes(
        fsdp=fsdp,
        tp=root["tp"] if tp > 1 else None,
        cp=root["cp"] if cp > 1 else None,
        dp=root["dp"],
        root=root,
    )


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


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients of `params` to a global norm of `max_norm`; returns the norm before clipping.
    Parameters may be DTensors on different meshes (expert-parallel experts beside FSDP2's shards): each
    mesh's norm is taken on its own, then combined (torch's clip refuses mixed meshes)."""
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        key = p.device_mesh if isinstance(p, DTensor) else None
        by_mesh.setdefault(key, []).append(p)
    if len(by_mesh) == 1:
        return float(full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)))
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        squares.append(full_tensor(norm).double() ** 2)
    total = float(torch.stack(squares).sum().sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1:  # as torch's clip: scale every gradient by max_norm / (norm + 1e-6)
        for p in params:
            p.grad.mul_(coef)
    return total
