"""Process groups, device meshes and FSDP2, as functions applied to modules (torchtitan style).

The ranks form a (dp, cp, tp) mesh, row-major: rank = (d * cp + c) * tp + t. Ranks that share a dp
index hold the same data (a data-parallel shard); cp splits its sequences, tp its weights. FSDP2
shards parameters over the flattened (dp, cp) dimension; tensor parallelism (parallel/tensor_parallel.py)
over tp. Every group is created here with `new_group` (never the default group), so parallel/comms.py
can tear all of them down and rebuild them while the default group stays up as the rendezvous.
"""

from __future__ import annotations

import inspect
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly DTensor) tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


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


@dataclass(frozen=True)
class Layout:
    """Sizes of the (dp, cp, tp) mesh over `world` ranks."""

    world: int
    tp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if self.world % (self.tp * self.cp):
            per = self.tp * self.cp
            valid = list(range(per, 4 * per + 1, per))
            raise ValueError(
                f"tensor_parallel_size={self.tp} x context_parallel_size={self.cp} = {per} does not divide "
                f"the {self.world} ranks (cluster.num_workers); run a multiple of {per} ranks "
                f"(cluster.backend='ray', cluster.num_workers in {valid}, ...), or choose sizes whose "
                f"product divides {self.world}"
            )

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp)

    def dp_index(self, rank: int) -> int:
        """The data-parallel shard that `rank` works on."""
        return rank // (self.tp * self.cp)

    def sizes(self) -> dict[str, int]:
        """{"dp": .., "cp": .., "tp": ..} (recorded in checkpoints)."""
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp}

    def dp_leaders(self) -> list[int]:
        """One rank per data-parallel shard (cp and tp index 0): whose results stand for the shard."""
        return [d * self.tp * self.cp for d in range(self.dp)]


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


def _groups_along(ranks: torch.Tensor, dim: int, backend: str, desc: str) -> dist.ProcessGroup:
    """Create (world-collectively) every group along `dim` of the rank grid; return this rank's."""
    mine = None
    me = dist.get_rank()
    for members in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
        group = dist.new_group(members, backend=backend, group_desc=desc)
        if me in members:
            mine = group
    assert mine is not None
    return mine


def build_mesh(device: torch.device, layout: Layout) -> Meshes:
    """The meshes of `layout` over all ranks (collective: every rank calls it in the same order)."""
    if layout.tp == 1 and layout.cp == 1:
        return Meshes(fsdp=build_dp_mesh(device))
    backend = "nccl" if device.type == "cuda" else "gloo"
    ranks = torch.arange(layout.world).view(layout.dp, layout.cp, layout.tp)
    groups = [_groups_along(ranks, d, backend, name) for d, name in enumerate(("dp", "cp", "tp"))]
    root = DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=("dp", "cp", "tp"))
    dp_cp = root["dp", "cp"]
    if "backend_override" in inspect.signature(dp_cp._flatten).parameters:
        fsdp = dp_cp._flatten("dp_cp", backend_override=backend)  # its own groups, even world-wide
    else:  # older torch: where dp x cp spans the world, the flattened mesh reuses the default group
        fsdp = dp_cp._flatten("dp_cp")
    tp = root["tp"] if layout.tp > 1 else None
    cp = root["cp"] if layout.cp > 1 else None
    return Meshes(fsdp=fsdp, tp=tp, cp=cp, dp=root["dp"], root=root)


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
