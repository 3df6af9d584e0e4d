"""Mixture-of-experts routing: find a model's routers, record the experts they choose, replay recorded
choices (rollout routing replay, "R3").

transformers' MoE families (Qwen3-MoE, Mixtral, OLMoE, gpt-oss) route with a `*TopKRouter` module per
MoE layer whose forward takes the layer's hidden states flattened to [N, H] (N: the call's tokens in
row-major order) and returns (router logits [N, E], gate weights [N, k], expert ids [N, k]).

Recording (the engine): forward hooks keep each router's expert ids, per call, in layer order.

Replay (the trainer): each router's forward is wrapped so that, for every token with a record, the
recorded expert ids replace the router's own top-k, and the gate weights are the trainer's router
probabilities at those experts: softmax over all experts, taken at the chosen ones, renormalized over
them where the family does (`norm_topk_prob`; Mixtral and gpt-oss always). So the router keeps its
gradient and the experts that run are the engine's. A token without a record (id -1) keeps the
router's own choice. Replay counts how many decisions it overrode (`ReplayStats`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

NO_RECORD = -1  # an expert id for a token the engine did not route (the last token of a sample, padding)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def routing_shape(model: torch.nn.Module) -> tuple[int, int] | None:
    """(MoE layers, experts per token) of `model`, or None for a dense model."""
    found = routers(model)
    return (len(found), int(found[0].top_k)) if found else None


@contextlib.contextmanager
def record_routing(model: torch.nn.Module):
    """Yields a list that receives, for each forward of the model during the block, the expert ids
    [N, L, k] (int16) of its N tokens at its L MoE layers."""
    found = routers(model)
    calls: list[torch.Tensor] = []
    pending: list[torch.Tensor] = []

    def keep(module, args, output):
        pending.append(output[2].to(torch.int16))
        if len(pending) == len(found):
            calls.append(torch.stack(pending, dim=1))
            pending.clear()

    handles = [r.register_forward_hook(keep) for r in found]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@dataclass
class ReplayStats:
    """Router decisions replay saw: `differ` of the `total` recorded ones chose other experts. Counted
    while `active` (the caller turns it off, e.g. for a backward's recomputation of the forward)."""

    differ: int = 0
    total: int = 0
    active: bool = True


def _replayed(router: torch.nn.Module, original, replay: torch.Tensor, stats: ReplayStats):
    renorm = getattr(router, "norm_topk_prob", True)

    def forward(hidden_states: torch.Tensor):
        logits, scores, own = original(hidden_states)
        recorded = replay.to(own.device, torch.long)
        have = (recorded >= 0).all(-1)
        chosen = torch.where(have[:, None], recorded, own)
        if stats.active:
            with torch.no_grad():
                same = (own.sort(-1).values == chosen.sort(-1).values).all(-1)
                stats.differ += int((~same & have).sum())
                stats.total += int(have.sum())
        probs = torch.softmax(logits.float(), dim=-1)
        gates = probs.gather(-1, chosen)
        if renorm:
            gates = gates / gates.sum(-1, keepdim=True)
        return logits, gates.to(scores.dtype), chosen.to(own.dtype)

    return forward


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, replay: torch.Tensor, stats: ReplayStats | None = None):
    """During the block, the model's single forward over N tokens (row-major) routes by `replay`
    [N, L, k] (NO_RECORD where the router decides itself); see the module docstring."""
    found = routers(model)
    if replay.shape[1] != len(found):
        raise ValueError(f"routing of {replay.shape[1]} MoE layers replayed on a model with {len(found)}")
    stats = stats if stats is not None else ReplayStats()
    saved: list[tuple[torch.nn.Module, Any]] = []
    try:
        for i, router in enumerate(found):
            saved.append((router, router.__dict__.get("forward")))
            router.forward = _replayed(router, type(router).forward.__get__(router), replay[:, i], stats)
        yield stats
    finally:
        for router, before in saved:
            if before is None:
                del router.forward
            else:
                router.forward = before


def microbatch_routing(data: Any, packed: Any = None, multiple: int = 1) -> torch.Tensor:
    """A micro-batch's `routing` [b, t, L, k] as the [N, L, k] replay of its model call: row-major over
    the padded [b, t], or the rows' real tokens end to end for a packed row; each row padded (NO_RECORD)
    to a multiple of `multiple` where the call pads it so (sequence parallelism)."""
    routing = data["routing"]
    if packed is not None:
        routing = torch.cat([routing[i, :n] for i, n in enumerate(packed.lengths)])[None]
    t = routing.shape[1]
    pad = -(-t // multiple) * multiple - t
    if pad:
        routing = torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, pad), value=NO_RECORD)
    return routing.reshape(-1, *routing.shape[2:])


@contextlib.contextmanager
def capture_router_outputs(model: torch.nn.Module):
    """Yields a list that receives, for the model's forward during the block, each MoE layer's router
    (logits [N, E], expert ids [N, k]) in layer order (the ids a replay chose, when it runs inside)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(module, args, output):
        out.append((output[0], output[2]))

    handles = [r.register_forward_hook(keep) for r in routers(model)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def router_losses(
    layers: list[tuple[torch.Tensor, torch.Tensor]], segment: torch.Tensor, keep: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence [count]: the load-balancing loss E x sum_i f_i P_i and the z-loss mean_t lse_t^2,
    each averaged over the MoE layers. `layers`: router (logits [N, E], ids [N, k]) of one model call;
    `segment` [N]: each token's sequence (0..count-1); `keep` [N]: the tokens that count (not padding)."""
    seg = segment[keep]
    n = torch.zeros(count, device=seg.device).index_add_(0, seg, torch.ones_like(seg, dtype=torch.float32))
    n = n.clamp(min=1)
    aux = torch.zeros(count, device=seg.device)
    z = torch.zeros(count, device=seg.device)
    for logits, ids in layers:
        logits, ids = logits[keep].float(), ids[keep].long()
        e, k = logits.shape[-1], ids.shape[-1]
        probs = torch.softmax(logits, dim=-1)
        with torch.no_grad():
            f = torch.zeros(count, e, device=seg.device)
            f.index_put_(
                (seg[:, None].expand_as(ids), ids), torch.ones_like(ids, dtype=f.dtype), accumulate=True
            )
            f = f / (n[:, None] * k)
        mean_p = torch.zeros(count, e, device=seg.device).index_add_(0, seg, probs) / n[:, None]
        aux = aux + e * (f * mean_p).sum(-1)
        lse = torch.logsumexp(logits, dim=-1).square()
        z = z + torch.zeros(count, device=seg.device).index_add_(0, seg, lse) / n
    return aux / max(len(layers), 1), z / max(len(layers), 1)
