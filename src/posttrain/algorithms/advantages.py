"""Group-relative advantages (GRPO): reward minus a per-prompt-group baseline, optionally std-scaled.

Groups are identified by prompt id (not by comparing tokens). Failed samples (reward NaN / marked
failed) take no part: they are excluded from their group's baseline and std and get advantage 0; the
caller also sets their sample_mask to 0. A group whose samples all failed contributes nothing.
"""

from __future__ import annotations

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
    adv = torch.zeros_like(r)
    group_std = torch.zeros_like(r)
    for g in torch.unique(group_ids):
        members = (group_ids == g) & valid
        n = int(members.sum())
        if n == 0:
            continue
        total = r[members].sum()
        if leave_one_out and n > 1:
            baseline = (total - r[members]) / (n - 1)
        else:
            baseline = total / n
        adv[members] = r[members] - baseline
        group_std[members] = r[members].std(unbiased=True) if n > 1 else 0.0
    if std_scaling == "group":
        adv = adv / (group_std + eps)
    elif std_scaling == "batch":
        batch_std = r[valid].std(unbiased=True) if int(valid.sum()) > 1 else torch.zeros(())
        adv = adv / (batch_std + eps)
    return torch.where(valid, adv, torch.zeros_like(adv)).float()


def zero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> set[int]:
    """Ids of groups whose valid rewards are all equal (they carry no learning signal)."""
    out = set()
    for g in torch.unique(group_ids):
        members = (group_ids == g) & valid.bool()
        values = rewards[members]
        if len(values) == 0 or bool((values == values[0]).all()):
            out.add(int(g))
    return out
