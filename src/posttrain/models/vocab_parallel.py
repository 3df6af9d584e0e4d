"""Logprobs and top-k from logits whose vocabulary is sharded over tensor-parallel ranks, without ever
gathering the full [.., V] logits onto one rank.

A tensor-parallel lm_head returns a DTensor sharded on its last dim: each rank holds the logits of a
contiguous slice [lo, hi) of the vocabulary. `VocabShard.of(logits)` reads that slice and the group
from the DTensor (a plain tensor is a shard that holds everything, and every reduction below is then
the identity). Log-softmax needs only two numbers per position from each rank: the local max
(all-reduced MAX, no gradient: logsumexp does not depend on it) and the local sum of exp (all-reduced
SUM). The target's logit is picked on the rank that owns it (zero elsewhere) and all-reduced.

Autograd: every rank of the group computes the same loss from the same reduced values, so the
backward of these all-reduces is the identity (each rank's share of the gradient is the gradient of
the reduced value), as in Megatron's vocab-parallel cross-entropy. An all-reduce whose backward also
all-reduced would multiply gradients by the group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


class _SumOverGroup(torch.autograd.Function):
    """All-reduce SUM in forward; identity in backward (the consumers are replicated over the group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _LocalLogprobs(torch.autograd.Function):
    """`logits.gather(targets) - logsumexp(logits)` over a whole (unsharded) vocabulary, with one fused
    backward: `exp(logits - lse) * -g`, then `g` added at each target. Autograd's own backward of the
    two ops builds a zero [.., V] buffer for the gather, scatters into it and adds it to the
    logsumexp's gradient (two more passes over the logits' size); this gives the same values bit for
    bit (the same products and sums, in a commutative order), except that a zero entry may be -0.0
    where autograd's is +0.0, which changes no sum (tests/test_vocab_parallel.py; the golden runs
    stay bit-identical). Not twice differentiable (its backward works in place)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1)
        index = targets.unsqueeze(-1)
        ctx.save_for_backward(logits, index, lse)
        return torch.gather(logits, -1, index).squeeze(-1) - lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, index, lse = ctx.saved_tensors
        g = grad.unsqueeze(-1)
        out = (logits - lse.unsqueeze(-1)).exp_().mul_(-g)
        return out.scatter_add_(-1, index, g), None


@dataclass
class VocabShard:
    """The slice [lo, lo + size) of the vocabulary this rank's logits cover, and the group holding the rest."""

    lo: int
    size: int
    group: dist.ProcessGroup | None = None

    @staticmethod
    def of(logits: torch.Tensor) -> tuple[torch.Tensor, VocabShard]:
        """(this rank's logits as a plain tensor, its shard) for plain or vocab-sharded DTensor logits."""
        if not isinstance(logits, DTensor):
            return logits, VocabShard(0, logits.shape[-1])
        mesh, placements = logits.device_mesh, logits.placements
        last = logits.ndim - 1
        if mesh.ndim != 1 or not isinstance(placements[0], Shard) or placements[0].dim not in (-1, last):
            raise RuntimeError(
                f"expected logits sharded on the vocabulary over a 1-D tensor-parallel mesh, got "
                f"placements {placements} on a {mesh.ndim}-D mesh"
            )
        local = logits.to_local()
        _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, placements)
        return local, VocabShard(int(offset[-1]), local.shape[-1], mesh.get_group())

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else _SumOverGroup.apply(x, self.group)

    def logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        """logsumexp over the whole vocabulary of this rank's fp32 logits [..., size] -> [...]."""
        if self.group is None:
            return torch.logsumexp(logits, dim=-1)
        peak = logits.detach().amax(dim=-1)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        summed = self._sum(torch.exp(logits - peak.unsqueeze(-1)).sum(dim=-1))
        return peak + torch.log(summed)

    def localize(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ids as indices into this rank's slice, clamped in range; mask of the ids this rank owns)."""
        if self.group is None:
            return ids, None
        owned = (ids >= self.lo) & (ids < self.lo + self.size)
        return (ids - self.lo).clamp(0, self.size - 1), owned

    def owned_sum(self, picked: torch.Tensor, owned: torch.Tensor | None) -> torch.Tensor:
        """Values picked with `localize`d ids, kept where this rank owns the id, summed over the group."""
        if owned is None:
            return picked
        return self._sum(torch.where(owned, picked, torch.zeros_like(picked)))

    def pick(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """logits[..., ids] over the whole vocabulary: [..., size] and [...] -> [...]."""
        local, owned = self.localize(ids)
        return self.owned_sum(torch.gather(logits, -1, local.unsqueeze(-1)).squeeze(-1), owned)

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """logprob of `targets[..., i]` under this rank's `logits[..., i, :]`, in fp32."""
        logits = logits.float()
        if self.group is None:
            return _LocalLogprobs.apply(logits, targets)
        return self.pick(logits, targets) - self.logsumexp(logits)

    def topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k values and global token ids over the whole vocabulary (no gradient)."""
        if self.group is None:
            return torch.topk(logits, k, dim=-1)
        kk = min(k, self.size)
        vals, idx = torch.topk(logits, kk, dim=-1)
        if kk < k:  # a shard narrower than k: pad with -inf candidates that never win
            pad = (0, k - kk)
            vals = torch.nn.functional.pad(vals, pad, value=float("-inf"))
            idx = torch.nn.functional.pad(idx, pad)
        n = dist.get_world_size(self.group)
        all_vals = [torch.empty_like(vals) for _ in range(n)]
        all_ids = [torch.empty_like(idx) for _ in range(n)]
        dist.all_gather(all_vals, vals.contiguous(), group=self.group)
        dist.all_gather(all_ids, (idx + self.lo).contiguous(), group=self.group)
        vals, where = torch.topk(torch.cat(all_vals, dim=-1), k, dim=-1)
        return vals, torch.gather(torch.cat(all_ids, dim=-1), -1, where)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logprob of `targets[..., i]` under `logits[..., i, :]` in fp32, without a full log-softmax copy.
    `logits` may be a vocab-sharded DTensor (then nothing of size V leaves its rank)."""
    local, shard = VocabShard.of(logits)
    return shard.logprobs(local, targets)
