"""Expert parallelism (`parallel.expert_parallel_size`): the experts of every MoE layer sharded over the
data-parallel ranks, tokens sent to the rank that holds their expert and back by all-to-all.

Layout: ep divides the data-parallel size dp (cp = 1). The dp ranks of one tensor-parallel index form a
(dp/ep, ep) grid, dp index = replica x ep + e: each row of ep ranks is one expert group. Under tensor
parallelism (parallel/tensor_parallel.py leaves MoE blocks unsplit) each tensor-parallel index has its
own groups: the ranks of a tensor-parallel group hold the same experts and exchange the same tokens.
Each fused expert tensor of transformers' MoE experts (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) becomes a DTensor sharded on dim 0 over the group (replicated over the dp/ep rows), so rank e of a group holds experts [e E/ep, (e+1) E/ep)
whole; FSDP2 leaves them alone (`ignored_params`) and shards everything else as before. Checkpoints,
exports and weight syncs read them as any DTensor (a full tensor is gathered where one is needed).
With more than one row, each row's tokens train its copy of the experts: `sync_expert_grads` sums the
rows' expert gradients before the optimizer step (a no-op when ep = dp).

Forward of one MoE layer on each rank (its N tokens, k experts each): the N x k (token, expert) pairs
are sorted by the rank that owns the expert; an all-to-all of the counts, then of the hidden states and
expert ids, brings every rank the tokens of its experts; each local expert runs its rows
(gate/up, SiLU-style activation, down: transformers' math); a second all-to-all returns the outputs,
which are weighted by the gates and summed per token. Both all-to-alls carry gradients (backward is
the reverse all-to-all), so an expert's gradient sums every rank's tokens routed to it, and the loss
contract (divide by the global count once) holds as it is. Every rank runs the same number of model
calls (dummy micro-batches keep them matched), so the collectives line up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from posttrain.parallel.mesh import group_backend, groups_along

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The fused experts modules of an MoE model (3-D `gate_up_proj` and `down_proj`), in layer order."""
    return [
        m
        for m in model.modules()
        if all(isinstance(getattr(m, n, None), torch.nn.Parameter) for n in EXPERT_TENSORS)
        and m.gate_up_proj.dim() == 3
    ]


def check_expert_parallel(model: torch.nn.Module, ep: int) -> None:
    """Refuse a model that expert parallelism cannot shard, naming the fix."""
    found = expert_modules(model)
    name = getattr(model.config, "model_type", type(model).__name__)
    if not found:
        raise ValueError(
            f"parallel.expert_parallel_size={ep}: model type '{name}' has no fused MoE experts to shard; "
            "use expert_parallel_size=1"
        )
    for m in found:
        if (
            getattr(m, "has_bias", False)
            or getattr(m, "is_transposed", False)
            or not getattr(m, "is_concatenated", True)
        ):
            raise ValueError(
                f"parallel.expert_parallel_size={ep}: the experts of '{name}' use biases or another weight "
                "layout (gpt-oss); expert parallelism runs Qwen3-MoE, Mixtral and OLMoE experts. Use "
                "expert_parallel_size=1"
            )
        experts = m.gate_up_proj.shape[0]
        if experts % ep:
            raise ValueError(
                f"parallel.expert_parallel_size={ep} does not divide the {experts} experts of '{name}'; use a "
                f"divisor of {experts}"
            )


def expert_mesh(dp_mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The mesh the experts are sharded over: `dp_mesh` (this rank's data-parallel ranks) itself when
    ep = dp, else a (dp/ep, ep) grid of the same ranks (collective: every rank builds every tensor-parallel
    index's groups in the same order; ranks are (dp, tp) row-major, mesh.py)."""
    dp = dp_mesh.size()
    if ep == dp:
        return dp_mesh
    backend = group_backend(dp_mesh.device_type)
    world = dist.get_world_size()
    ranks = torch.arange(world).view(dp // ep, ep, world // dp)
    groups = [groups_along(ranks, d, backend, name) for d, name in enumerate(("ep_replicate", "ep"))]
    mine = ranks[..., dist.get_rank() % (world // dp)]
    return DeviceMesh.from_group(
        groups, dp_mesh.device_type, mesh=mine, mesh_dim_names=("ep_replicate", "ep")
    )


def apply_ep(model: torch.nn.Module, dp_mesh: DeviceMesh, ep: int) -> set[torch.nn.Parameter]:
    """Shard every experts module over `ep` ranks of `dp_mesh` (see the module docstring); returns the
    expert parameters (for FSDP2's `ignored_params`)."""
    check_expert_parallel(model, ep)
    mesh = expert_mesh(dp_mesh, ep)
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    params: set[torch.nn.Parameter] = set()
    for experts in expert_modules(model):
        for name in EXPERT_TENSORS:
            old = getattr(experts, name)
            new = torch.nn.Parameter(distribute_tensor(old.data, mesh, placements), old.requires_grad)
            setattr(experts, name, new)
            params.add(new)
        experts.forward = _ExpertParallelForward(experts)
    return params


def replicated_experts(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The expert parameters replicated over the rows of a (dp/ep, ep) expert mesh (empty for a dense
    model, one rank, or ep = dp): what `sync_expert_grads` sums. Found once, not on every step."""
    return [
        p
        for experts in expert_modules(model)
        for p in (getattr(experts, name) for name in EXPERT_TENSORS)
        if isinstance(p, DTensor) and p.device_mesh.ndim == 2
    ]


def sync_expert_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of `params` (`replicated_experts`) over the replica rows of their mesh."""
    for p in params:
        if p.grad is None:  # every rank of the row joins the all-reduce, used or not
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad.to_local(), group=p.device_mesh.get_group(0))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _ExpertParallelForward:
    """The experts module's forward under expert parallelism (see the module docstring)."""

    def __init__(self, experts: torch.nn.Module) -> None:
        self.experts = experts  # the group is read from the parameters' mesh on every call (comms rebind it)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        m = self.experts
        mesh = m.gate_up_proj.device_mesh
        dim = mesh.ndim - 1  # the expert-group dimension
        self.group, self.ep, self.rank = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
        gate_up, down = _local(m.gate_up_proj), _local(m.down_proj)
        per_rank = gate_up.shape[0]
        n, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        token = torch.arange(n, device=hidden_states.device).repeat_interleave(k)
        order = torch.argsort(expert // per_rank, stable=True)
        send = torch.bincount(expert // per_rank, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        x = all_to_all_single_autograd(hidden_states[token[order]], recv_sizes, send_sizes, self.group)
        ids = torch.empty(sum(recv_sizes), dtype=expert.dtype, device=expert.device)
        dist.all_to_all_single(ids, expert[order].contiguous(), recv_sizes, send_sizes, group=self.group)
        local = ids - self.rank * per_rank
        out = x * 0  # tied to x even when this rank received no tokens: its backward all-to-alls still run
        for e in range(per_rank):
            rows = torch.nonzero(local == e).flatten()
            if rows.numel() == 0:
                continue
            # the experts stay fp32 (FSDP2's mixed precision skips them): compute in the activations' dtype
            g, u = torch.nn.functional.linear(x[rows], gate_up[e].to(x.dtype)).chunk(2, dim=-1)
            out = out.index_add(0, rows, torch.nn.functional.linear(m.act_fn(g) * u, down[e].to(x.dtype)))
        back = all_to_all_single_autograd(out, send_sizes, recv_sizes, self.group)
        weights = top_k_weights.reshape(-1)[order, None].to(back.dtype)
        result = torch.zeros_like(hidden_states)
        return result.index_add(0, token[order], (back * weights).to(result.dtype))
