"""Context parallelism: one sequence split over the ranks of a group, attention over all of it.

Each of the `cp` ranks holds 1/cp of every row's tokens and runs the whole model on them. Attention is
the only place where tokens meet: it all-gathers the keys and values of the row from every rank
(`cp` times the local K/V, never the full activations, logits or MLP inputs) and attends its local
queries over them under a mask built from global token indices. The backward of that all-gather is
a reduce-scatter: each rank's queries contribute gradients to every rank's keys and values.

Load balance: under a causal mask the last tokens do the most work, so the sequence (padded to a
multiple of 2*cp) is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r (the "zigzag"
layout). Any layout works for correctness, since the mask is built from the global index of every
query and key.

Packing: a packed row carries one segment id per token; a query attends to a key only in its own
segment and not after it, exactly as the block-diagonal mask of an unpacked, packed row does.

This departs from torch's experimental `context_parallel` (ring attention over the SDPA kernels): that
one takes no attention mask (so no packing) and does not run on CPU. This one runs the same on
gloo and NCCL and takes any mask; its cost is a [q_local, T] boolean mask per model call and K/V for
the whole row during attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ATTN_IMPLEMENTATION = "posttrain_context_parallel"


class _GatherSeq(torch.autograd.Function):
    """All-gather along `dim` (rank order). Backward: `scatter_sum=True` sums every rank's gradient of
    the gathered tensor and keeps this rank's slice (the consumers differ per rank: attention queries);
    `scatter_sum=False` keeps this rank's slice of its own gradient (the consumers are replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, scatter_sum: bool) -> torch.Tensor:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.dim, ctx.group, ctx.scatter_sum, ctx.n, ctx.rank = dim, group, scatter_sum, n, rank
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.scatter_sum:
            return grad.chunk(ctx.n, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None
        stacked = grad.movedim(ctx.dim, 0).contiguous()  # rank r's slice is the r-th chunk of dim 0
        mine = stacked.new_empty((stacked.shape[0] // ctx.n, *stacked.shape[1:]))
        dist.reduce_scatter_tensor(mine, stacked, group=ctx.group)
        return mine.movedim(0, ctx.dim).contiguous(), None, None, None


def zigzag_indices(total: int, cp: int, rank: int) -> torch.Tensor:
    """Global token indices held by `rank`: chunks rank and 2*cp-1-rank of 2*cp equal chunks."""
    chunk = total // (2 * cp)
    ar = torch.arange(chunk)
    return torch.cat([rank * chunk + ar, (2 * cp - 1 - rank) * chunk + ar])


@dataclass
class ContextParallel:
    """The layout of one model call's sequence over a context-parallel group (see module docstring)."""

    group: dist.ProcessGroup
    local: torch.Tensor  # [q] global indices of this rank's tokens
    order: torch.Tensor  # [T] global index of each position of the rank-order concatenation
    mask: torch.Tensor  # [b or 1, 1, q, T] True where a local query may attend to a (rank-order) key

    @staticmethod
    def build(group, total: int, segments: torch.Tensor | None, device: torch.device) -> ContextParallel:
        """Layout of `total` tokens (a multiple of 2*cp). `segments` [b, total] numbers the sequences of
        packed rows (None: each row is one causal sequence)."""
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        order = torch.cat([zigzag_indices(total, n, r) for r in range(n)]).to(device)
        local = order.view(n, -1)[rank]
        mask = (order[None, :] <= local[:, None])[None, None]
        if segments is not None:
            seg = segments.to(device)
            mask = mask & (seg[:, local][:, None, :, None] == seg[:, order][:, None, None, :])
        return ContextParallel(group, local, order, mask)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full-length tensor from every rank's local values along `dim`, in token order. The
        backward keeps this rank's slice (the consumers, loss and metrics, are the same on every rank)."""
        gathered = _GatherSeq.apply(x, dim, self.group, False)
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return gathered.index_select(dim, inverse)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def context_parallel_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    posttrain_cp=None,
    **kwargs,
):
    """Attention of this rank's queries over the whole row's keys/values (the `AttentionInterface`
    signature of transformers: [b, h, q, d] in, ([b, q, h, d], None) out). A sliding window (Mistral)
    narrows the mask: a key sits less than `sliding_window` tokens before its query, as in
    transformers' masks."""
    if softcap is not None:
        raise ValueError(
            "context parallelism does not implement attention logit soft-capping (Gemma2-style models); "
            "use parallel.context_parallel_size=1"
        )
    if posttrain_cp is None:
        raise RuntimeError(
            "a context-parallel model was called without its layout; call it through "
            "posttrain.models.logprobs (which passes posttrain_cp=ContextParallel)"
        )
    cp: ContextParallel = posttrain_cp
    keys = _GatherSeq.apply(key, 2, cp.group, True)
    values = _GatherSeq.apply(value, 2, cp.group, True)
    groups = query.shape[1] // keys.shape[1]
    keys, values = _repeat_kv(keys, groups), _repeat_kv(values, groups)
    mask = cp.mask
    if sliding_window is not None:
        mask = mask & (cp.local[:, None] - cp.order[None, :] < sliding_window)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # the attention above builds its own mask from the layout


def register_attention() -> str:
    """Register the context-parallel attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, context_parallel_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    except ImportError:  # older transformers build masks only for the implementations they know
        pass
    return ATTN_IMPLEMENTATION
