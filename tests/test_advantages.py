"""Group-relative advantages: baselines, std scaling, failed samples, group identity by prompt id."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.rollout.advantages import group_advantages, zero_variance_groups


def test_group_mean_baseline_with_std_scaling():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3])
    adv = group_advantages(rewards, groups, std_scaling="group")
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std()
    torch.testing.assert_close(adv[:4], (torch.tensor([0.5, -0.5, 0.5, -0.5]) / (std + 1e-6)).float())
    assert torch.all(adv[4:] == 0)


def test_leave_one_out_and_no_std():
    rewards = torch.tensor([3.0, 1.0, 2.0])
    adv = group_advantages(rewards, torch.zeros(3, dtype=torch.long), leave_one_out=True, std_scaling="none")
    torch.testing.assert_close(adv, torch.tensor([3 - 1.5, 1 - 2.5, 2 - 2.0]))


def test_batch_std_scaling():
    rewards = torch.tensor([1.0, 0.0, 4.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = group_advantages(rewards, groups, std_scaling="batch")
    expected = torch.tensor([0.5, -0.5, 1.0, -1.0]) / (rewards.std() + 1e-6)
    torch.testing.assert_close(adv, expected)


def test_failed_samples_are_excluded_not_zeroed():
    """A failed reward (NaN) must not pull the baseline down as a 0 would."""
    rewards = torch.tensor([1.0, math.nan, 1.0, 0.0])
    adv = group_advantages(rewards, torch.zeros(4, dtype=torch.long), std_scaling="none")
    mean = (1 + 1 + 0) / 3
    torch.testing.assert_close(adv, torch.tensor([1 - mean, 0.0, 1 - mean, -mean]))
    valid = torch.tensor([True, True, False, True])
    adv2 = group_advantages(
        torch.tensor([1.0, 0.0, 5.0, 0.0]), torch.zeros(4, dtype=torch.long), valid, std_scaling="none"
    )
    assert adv2[2] == 0 and adv2[0] == pytest.approx(1 - 1 / 3)


def test_groups_by_prompt_id_not_by_position():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    interleaved = group_advantages(rewards, torch.tensor([5, 9, 5, 9]), std_scaling="none")
    torch.testing.assert_close(interleaved, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_zero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert zero_variance_groups(rewards, groups, torch.ones(6, dtype=torch.bool)) == {0, 2}


def _loop_reference(rewards, groups, valid, leave_one_out, std_scaling):
    """Per-group loop, the definition the vectorized code must match."""
    r = [float(x) for x in rewards]
    ok = [bool(v) and math.isfinite(x) for v, x in zip(valid, r)]
    out = [0.0] * len(r)
    members_of: dict[int, list[int]] = {}
    for i, g in enumerate(groups.tolist()):
        if ok[i]:
            members_of.setdefault(g, []).append(i)
    all_valid = [r[i] for i in range(len(r)) if ok[i]]
    batch_std = torch.tensor(all_valid, dtype=torch.float64).std().item() if len(all_valid) > 1 else 0.0
    for members in members_of.values():
        vals = [r[i] for i in members]
        n, total = len(vals), sum(vals)
        std = torch.tensor(vals, dtype=torch.float64).std().item() if n > 1 else 0.0
        for i in members:
            base = (total - r[i]) / (n - 1) if leave_one_out and n > 1 else total / n
            scale = {"none": 1.0, "group": std + 1e-6, "batch": batch_std + 1e-6}[std_scaling]
            out[i] = (r[i] - base) / scale
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("std_scaling", ["none", "group", "batch"])
def test_vectorized_advantages_match_a_per_group_loop(leave_one_out, std_scaling):
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = int(torch.randint(1, 30, (1,), generator=g))
        rewards = torch.randint(0, 3, (n,), generator=g).float()
        if trial % 2:
            rewards = torch.rand(n, generator=g)
        rewards[torch.rand(n, generator=g) > 0.9] = math.nan  # failed rewards
        groups = torch.randint(0, 5, (n,), generator=g) * 11  # sparse, unordered prompt ids
        valid = torch.rand(n, generator=g) > 0.2
        got = group_advantages(rewards, groups, valid, leave_one_out=leave_one_out, std_scaling=std_scaling)
        want = _loop_reference(rewards, groups, valid, leave_one_out, std_scaling)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        usable = valid & torch.isfinite(rewards)
        assert zero_variance_groups(rewards, groups, usable) == {
            gid
            for gid in set(groups.tolist())
            if len({float(rewards[i]) for i in range(n) if groups[i] == gid and usable[i]}) <= 1
        }
