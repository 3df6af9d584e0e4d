"""Context parallelism: one sequence split over the ranks of a group, attention over all of it.

Each of the `cp` ranks holds 1/cp of every row's tokens and runs the whole model on them. Attention is
the only place where tokens meet: it all-gathers the keys and values of the row from every rank
(`cp` times the local K/V, never the full activations, logits or MLP inputs) and attends its local
queries over them under a mask built from global token indices. The backward of that all-gather is
a reduce-scatter: each rank's queries contribute gradients to every rank's keys and values.

Layout: rank r holds the r-th contiguous 1/cp of the row (padded to a multiple of cp). Attention
runs as one SDPA call over a dense [q_local, T] mask, which costs the same on every rank whatever the
layout, so a load-balancing ("zigzag") layout would buy nothing here; it would with a kernel that
skips masked blocks.

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


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    fn(out, inp, group=group)


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
        _reduce_scatter(mine, stacked, ctx.group)
        return mine.movedim(0, ctx.dim).contiguous(), None, None, None


@dataclass
class ContextParallel:
    """The layout of one model call's sequence over a context-parallel group (see module docstring)."""

    group: dist.ProcessGroup
    local: torch.Tensor  # [q] global indices of this rank's tokens
    mask: torch.Tensor  # [b or 1, 1, q, T] True where a local query may attend to a key

    @staticmethod
    def build(group, total: int, segments: torch.Tensor | None, device: torch.device) -> ContextParallel:
        """Layout of `total` tokens (a multiple of cp). `segments` [b, total] numbers the sequences of
        packed rows (None: each row is one causal sequence)."""
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        assert total % n == 0, f"{total} tokens do not split over {n} context-parallel ranks"
        q = total // n
        local = torch.arange(rank * q, (rank + 1) * q, device=device)
        keys = torch.arange(total, device=device)
        mask = (keys[None, :] <= local[:, None])[None, None]
        if segments is not None:
            seg = segments.to(device)
            mask = mask & (seg[:, local][:, None, :, None] == seg[:, None, None, :])
        return ContextParallel(group, local, mask)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full-length tensor from every rank's local values along `dim`. The backward keeps this
        rank's slice (the consumers, loss and metrics, are the same on every rank)."""
        return _GatherSeq.apply(x, dim, self.group, False)


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
    if kwargs.get("s_aux") is not None:
        raise ValueError(
            "context parallelism does not implement attention sinks (gpt-oss-style models); "
            "use parallel.context_parallel_size=1"
        )
    if posttrain_cp is None:
        raise RuntimeError(
            "a context-parallel model was called without its layout: its attention did not receive the "
            "`posttrain_cp` keyword that posttrain.models.logprobs passes to the model (a model whose "
            "layers do not forward **kwargs to attention cannot run context-parallel)"
        )
    cp: ContextParallel = posttrain_cp
    keys = _GatherSeq.apply(key, 2, cp.group, True)
    values = _GatherSeq.apply(value, 2, cp.group, True)
    mask = cp.mask
    if sliding_window is not None:
        mask = mask & (cp.local[:, None] - torch.arange(keys.shape[2], device=mask.device) < sliding_window)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=keys.shape[1] != query.shape[1],
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
