"""Group-relative advantages (GRPO): reward minus a per-prompt-group baseline, optionally std-scaled;
and PPO's: GAE over token rewards with a critic's values (`gae`, `token_rewards`, `masked_whiten`).

Groups are identified by prompt id (not by comparing tokens). Failed samples (reward NaN / marked
failed) take no part: they are excluded from their group's baseline and std and get advantage 0; the
caller also sets their sample_mask to 0. A group whose samples all failed contributes nothing.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

StdScaling = Literal["none", "group", "batch"]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    leave_one_out: bool = False,
    std_scaling: StdScaling = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample advantages [N] from rewards [N] and group ids [N].

    leave_one_out: the baseline of a sample is the mean of the *other* valid samples of its group
    (RLOO); otherwise the group mean. std_scaling: divide by the group's (or the batch's) reward std.
    """
    rewards = rewards.double()
    valid = torch.isfinite(rewards) if valid is None else (valid.bool() & torch.isfinite(rewards))
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    _, inv = torch.unique(group_ids, return_inverse=True)
    n = _group_sum(valid.double(), inv)  # valid members per group, at each sample
    total = _group_sum(r, inv)
    mean = total / n.clamp(min=1)
    if leave_one_out:
        baseline = torch.where(n > 1, (total - r) / (n - 1).clamp(min=1), mean)
    else:
        baseline = mean
    adv = r - baseline
    if std_scaling == "group":  # unbiased std of each group's valid rewards (0 for a single member)
        sq = _group_sum(torch.where(valid, (r - mean) ** 2, torch.zeros_like(r)), inv)
        adv = adv / (torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq)) + eps)
    elif std_scaling == "batch":
        batch_std = r[valid].std(unbiased=True) if int(valid.sum()) > 1 else torch.zeros(())
        adv = adv / (batch_std + eps)
    return torch.where(valid, adv, torch.zeros_like(adv)).float()


def _group_sum(values: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Per-sample sum of `values` over the sample's group (`inv`: group index of each sample)."""
    size = int(inv.max()) + 1 if len(inv) else 0
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, inv, values)
    return sums[inv]


def zero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> set[int]:
    """Ids of groups whose valid rewards are all equal (they carry no learning signal)."""
    ids, inv = torch.unique(group_ids, return_inverse=True)
    valid = valid.bool()
    vals = rewards.double()
    lo = torch.full((len(ids),), math.inf, dtype=torch.float64, device=vals.device)
    hi = torch.full((len(ids),), -math.inf, dtype=torch.float64, device=vals.device)
    lo.scatter_reduce_(0, inv[valid], vals[valid], "amin")
    hi.scatter_reduce_(0, inv[valid], vals[valid], "amax")
    flat = (lo == hi) | (lo > hi)  # all equal, or no valid member (lo stays +inf, hi -inf)
    return set(ids[flat].tolist())


# --------------------------------------------------------------------------- PPO: GAE over token rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each row's trained tokens, (advantages, returns) [B, T].

    rewards [B, T]: each trained token's reward (the sample's reward on its last one, any per-token KL
    penalty on all); values [B, T]: the critic's value of the state each token was sampled from; mask
    [B, T]: the trained tokens. A row's trained tokens are its time steps, in order: tokens between them
    (an environment's replies, padding) are skipped, and the value after the last one is 0 (terminal).

        delta_t = r_t + gamma * V_next(t) - V_t,   A_t = delta_t + gamma * lam * A_next(t),   R_t = A_t + V_t

    Computed in float64, returned in float32; 0 outside the mask."""
    r, v, m = rewards.double(), values.double(), mask.bool()
    adv = torch.zeros_like(r)
    carry = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    next_value = torch.zeros_like(carry)
    for t in range(r.shape[1] - 1, -1, -1):
        here = m[:, t]
        current = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * carry
        adv[:, t] = torch.where(here, current, torch.zeros_like(current))
        carry = torch.where(here, current, carry)
        next_value = torch.where(here, v[:, t], next_value)
    returns = (adv + v) * m
    return adv.float(), returns.float()


def token_rewards(
    scores: torch.Tensor, mask: torch.Tensor, per_token: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, T] PPO's token rewards: `per_token` (e.g. -kl_coef * KL(pi || pi_ref) per token) on the trained
    tokens, plus each row's scalar score [B] on its last trained token (rows without one get nothing)."""
    m = mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if per_token is not None:
        out = torch.where(m, per_token.float(), out)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(m)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(-1).values
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] += scores.float()[rows]
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the masked entries (unbiased std, as verl and TRL), 0 outside the mask."""
    m = mask.bool()
    picked = values.double()[m]
    if picked.numel() < 2:
        return torch.zeros_like(values)
    out = (values.double() - picked.mean()) / (picked.var(unbiased=True) + eps).sqrt()
    return torch.where(m, out, torch.zeros_like(out)).to(values.dtype)
