"""The parallel layout of one policy: sizes, the facts derived from them, and its process groups.

`ParallelDims` is the one object that says how the ranks are laid out (torchtitan style): the (dp, cp,
tp) sizes over `world` ranks and the switches that shape the model (sequence parallelism, FSDP2 mode,
CPU offload), validated once, with every derived fact (`*_enabled`, the dp index of a rank, how model
calls split a sequence) answered here rather than recomputed by each caller. `build_mesh()` creates the
device meshes (parallel/mesh.py) and keeps them; `parallel/parallelize.py` applies the layout to a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from posttrain.models.logprobs import SequenceSplit
from posttrain.parallel import mesh as pmesh

FsdpMode = Literal["auto", "always", "never"]


@dataclass
class ParallelDims:
    """Sizes of the (dp, cp, tp) mesh over `world` ranks, and the switches that go with them.

    Ranks are row-major: rank = (d * cp + c) * tp + t. `sequence_parallel` is the request; it takes effect
    only with tp > 1 (`sp_enabled`). `fsdp` is the FSDP2 mode of `ParallelConfig.fsdp`; `fsdp_enabled` is
    the decision. `meshes` is set by `build_mesh()` (None before, and when FSDP is off)."""

    world: int
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    fsdp: FsdpMode = "auto"
    cpu_offload: bool = False
    ep: int = 1  # expert parallelism: experts sharded over the dp ranks (parallel/expert_parallel.py)
    meshes: pmesh.Meshes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        per = self.tp * self.cp
        if self.world % per:
            valid = list(range(per, 4 * per + 1, per))
            raise ValueError(
                f"tensor_parallel_size={self.tp} x context_parallel_size={self.cp} = {per} does not divide "
                f"the {self.world} ranks (cluster.num_workers); run a multiple of {per} ranks "
                f"(cluster.backend='ray', cluster.num_workers in {valid}, ...), or choose sizes whose "
                f"product divides {self.world}"
            )
        if self.world > 1 and self.fsdp == "never":
            raise ValueError("parallel.fsdp='never' needs a single rank; use fsdp='auto' for several ranks")
        if self.ep > 1 and (self.cp > 1 or self.dp % self.ep):
            raise ValueError(
                f"expert_parallel_size={self.ep} with context_parallel_size={self.cp} over {self.world} ranks "
                f"(tensor_parallel_size={self.tp}): expert parallelism shards the experts over groups of "
                f"data-parallel ranks; use context_parallel_size=1 and an expert_parallel_size that divides "
                f"the data-parallel size {self.world // (self.tp * self.cp)}"
            )

    # ------------------------------------------------------------------ sizes and derived facts

    @property
    def dp(self) -> int:
        """Data-parallel shards: world / (tp x cp)."""
        return self.world // (self.tp * self.cp)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def sp_enabled(self) -> bool:
        """Sequence parallelism: asked for, and there are tensor-parallel ranks to shard over."""
        return self.sequence_parallel and self.tp_enabled

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 sharding: always, or (auto) with more than one rank or with CPU offload (which FSDP2
        implements). Every multi-rank layout runs under FSDP2, so tp or cp > 1 implies it."""
        return self.fsdp == "always" or (self.fsdp == "auto" and (self.world > 1 or self.cpu_offload))

    @property
    def sequence_multiple(self) -> int:
        """Model calls pad each sequence to a multiple of this: tp under sequence parallelism, times cp
        (each context-parallel chunk a multiple of tp)."""
        return (self.tp if self.sp_enabled else 1) * self.cp

    def dp_index(self, rank: int) -> int:
        """The data-parallel shard that `rank` works on."""
        return rank // (self.tp * self.cp)

    def seed_offset(self, rank: int) -> int:
        """What `rank` adds to the run seed for its generators: its (dp, cp) coordinate d * cp + c. The
        ranks of one tensor-parallel group share it (they hold the same activations after a row-parallel
        reduction); ranks that hold other rows or other query blocks do not."""
        return rank // self.tp

    def dp_leaders(self) -> list[int]:
        """One rank per data-parallel shard (cp and tp index 0): whose results stand for the shard."""
        return [d * self.tp * self.cp for d in range(self.dp)]

    def sizes(self) -> dict[str, int]:
        """{"dp": .., "cp": .., "tp": ..} (recorded in checkpoints)."""
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp}

    def param_device(self, device: torch.device) -> torch.device:
        """Where sharded parameters live: the host under FSDP2 CPU offload, else `device`."""
        return torch.device("cpu") if self.cpu_offload else device

    # ------------------------------------------------------------------ process groups and meshes

    def init_process_group(self, rank: int, master_addr: str, master_port: int | None) -> None:
        """Join the default process group (several ranks), or a world-size-1 one for FSDP2 on one rank."""
        if self.world > 1:
            pmesh.init_distributed(rank, self.world, master_addr, master_port or pmesh.free_port())
        elif self.fsdp_enabled:
            pmesh.ensure_single_process_group()

    def build_mesh(self, device: torch.device) -> pmesh.Meshes | None:
        """Create (collectively, on every rank) and keep the meshes of this layout; None without FSDP2."""
        if self.fsdp_enabled:
            self.meshes = pmesh.build_mesh(device, self.tp, self.cp)
        return self.meshes

    def dp_group(self) -> dist.ProcessGroup | None:
        """The group that reduces over data-parallel shards (None: the default group, pure DP)."""
        if self.meshes is None or self.meshes.dp is None:
            return None
        return self.meshes.dp.get_group()

    def sequence_split(self) -> SequenceSplit:
        """How model calls lay out the sequence (see `sequence_multiple`), with the cp mesh if any."""
        return SequenceSplit(self.sequence_multiple, self.meshes.cp if self.meshes is not None else None)
