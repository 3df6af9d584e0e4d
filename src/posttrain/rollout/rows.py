"""Prompt groups as training rows, the same for both loops: advantages within each group, failed (and,
with overlong filtering, truncated) samples masked out, prompt + completion right-padded.

The synchronous loop turns a whole step's samples into one batch (`samples_to_batch`). An asynchronous
rollout worker lays out its groups' rows as numpy arrays cut to each group's longest row
(`attach_rows`), cheap to pickle, and the trainer only stacks them (`stack_rows`): the stacked rows of
any groups equal `samples_to_batch` over them. `SAMPLES_CODEC` turns a scored group into JSON and back
(buffered groups survive a checkpoint; their rows are laid out again).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from posttrain.data.batch import batch_from_sequences, completion_values, make_batch
from posttrain.generation.params import GenerationResult
from posttrain.models.moe import NO_RECORD
from posttrain.rollout.advantages import group_advantages
from posttrain.rollout.config import GroupConfig
from posttrain.rollout.contracts import SamplesCodec
from posttrain.rollout.trajectory import Trajectory, Turn


@dataclass
class GroupSamples:
    """A scored prompt group: what a rollout worker returns inside its GroupResult."""

    prompt_id: int
    results: list[GenerationResult] | list[Trajectory]  # one per sample; trajectories for environments
    rewards: list[float]  # NaN where the reward failed
    failed: list[bool]
    metrics: dict[str, float] = field(default_factory=dict)  # reward summary, timings, probe check
    rows: dict[str, np.ndarray] | None = None  # training rows (attach_rows), None until laid out


def samples_to_batch(
    results: list[GenerationResult] | list[Trajectory],
    rewards: torch.Tensor,
    failed: torch.Tensor,
    group_ids: torch.Tensor,
    group: GroupConfig,
    pad_id: int,
    multiple_of: int = 1,
):
    """Advantages per prompt group, then a batch of prompt+completion rows (failed or filtered samples
    masked out), right-padded with masked rows to a multiple of `multiple_of` rows."""
    adv = group_advantages(
        rewards,
        group_ids,
        ~failed,
        leave_one_out=group.use_leave_one_out_baseline,
        std_scaling="group" if group.normalize_rewards else "none",
    )
    mask = (~failed).float()
    if group.overlong_filtering:
        mask = mask * torch.tensor([r.finish_reason != "length" for r in results], dtype=torch.float32)
    pad = -len(results) % multiple_of
    results = list(results) + [results[i % len(results)] for i in range(pad)]
    adv = torch.cat([adv, torch.zeros(pad)])
    mask = torch.cat([mask, torch.zeros(pad)])
    masks = [r.mask if isinstance(r, Trajectory) else None for r in results]
    batch = batch_from_sequences(
        [r.prompt_token_ids for r in results], [r.token_ids for r in results], pad_id, mask.tolist(), masks
    )
    batch["generation_logprobs"] = completion_values(batch, (_sampled(r) for r in results))
    if any(getattr(r, "routing", None) is not None for r in results):
        batch["routing"] = routing_rows(
            [getattr(r, "routing", None) for r in results], batch["input_ids"].shape[1]
        )
    batch["advantages"] = adv[:, None] * batch["token_mask"]
    clean = torch.where(failed, torch.zeros_like(rewards), rewards.float())  # a failed reward is NaN
    batch["rewards"] = torch.cat([clean, torch.zeros(pad)]) * mask
    metrics = {"advantage_abs_mean": float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))}
    return batch, metrics


def routing_rows(routing: list[torch.Tensor | None], width: int) -> torch.Tensor:
    """[B, width, L, k] the engine's recorded expert ids of each row (generation/routing.py), NO_RECORD
    where there is none (the last token, padding, a row without a record)."""
    shape = next(r.shape[1:] for r in routing if r is not None)
    out = torch.full((len(routing), width, *shape), NO_RECORD, dtype=torch.int16)
    for i, r in enumerate(routing):
        if r is not None:
            out[i, : r.shape[0]] = r
    return out


def _sampled(r: GenerationResult | Trajectory) -> list[float]:
    """The engine's logprobs of the trained tokens (a trajectory's sampled tokens only)."""
    if isinstance(r, Trajectory):
        return [lp for lp, m in zip(r.logprobs, r.mask) if m]
    return r.logprobs


# --------------------------------------------------------------------------- rows of one group each

ROW_KEYS = (
    "input_ids",
    "input_lengths",
    "token_mask",
    "sample_mask",
    "generation_logprobs",
    "advantages",
    "rewards",
)
OPTIONAL_ROW_KEYS = ("routing",)  # MoE routing replay: the engine's expert ids [rows, width, L, k]


def attach_rows(groups: list[GroupSamples], group: GroupConfig, pad_id: int) -> None:
    """Lay out the training rows of every group that has none yet: their rows of samples_to_batch
    over these groups (advantages within each group; failed and, with overlong_filtering, truncated
    samples masked), as numpy arrays cut to the group's longest row: cheap to pickle, and `stack_rows`
    of any groups' rows is their batch. One samples_to_batch call serves all the groups."""
    todo = [s for s in groups if s.rows is None]
    if not todo:
        return
    sizes = torch.tensor([len(s.results) for s in todo])
    batch, _ = samples_to_batch(
        [r for s in todo for r in s.results],
        torch.tensor([r for s in todo for r in s.rewards], dtype=torch.float32),
        torch.tensor([f for s in todo for f in s.failed], dtype=torch.bool),
        torch.arange(len(todo)).repeat_interleave(sizes),
        group,
        pad_id,
    )
    arrays = {k: batch[k].numpy() for k in (*ROW_KEYS, *OPTIONAL_ROW_KEYS) if k in batch.keys()}
    first = 0
    for s, n in zip(todo, sizes.tolist()):
        rows = slice(first, first + n)
        width = int(arrays["input_lengths"][rows].max())
        s.rows = {k: a[rows] if a.ndim == 1 else a[rows, :width] for k, a in arrays.items()}
        first += n


def stack_rows(groups: list[dict[str, np.ndarray]], pad_id: int) -> TensorDict:
    """The batch of several groups' rows (`attach_rows`), right-padded to the longest row of them all. An
    optional key (`routing`) that only some groups have is NO_RECORD in the others' rows."""
    width = max(g["input_ids"].shape[1] for g in groups)
    n = sum(len(g["input_lengths"]) for g in groups)
    out = {}
    optional = [k for k in OPTIONAL_ROW_KEYS if any(k in g for g in groups)]
    for key in (*ROW_KEYS, *optional):
        first = next(g[key] for g in groups if key in g)
        if first.ndim == 1:
            out[key] = torch.from_numpy(np.concatenate([g[key] for g in groups]))
            continue
        fill = NO_RECORD if key == "routing" else pad_id if key == "input_ids" else 0
        full = np.full((n, width, *first.shape[2:]), fill, dtype=first.dtype)
        row = 0
        for g in groups:
            rows = len(g["input_lengths"])
            if key in g:
                full[row : row + rows, : g[key].shape[1]] = g[key]
            row += rows
        out[key] = torch.from_numpy(full)
    return make_batch(**out)


def groups_to_batch(groups: list[GroupSamples], group: GroupConfig, pad_id: int) -> TensorDict:
    """One training batch of several groups, equal to `samples_to_batch` over them (advantages within
    each group, failed samples masked): the rows the rollout worker laid out, stacked; a group without
    them (restored from a checkpoint) gets them laid out here."""
    attach_rows(groups, group, pad_id)
    return stack_rows([s.rows for s in groups], pad_id)


# --------------------------------------------------------------------------- codec


def _encode(s: GroupSamples) -> dict[str, Any]:
    out = asdict(replace(s, rows=None))  # the rows are rebuilt from the results after a resume
    del out["rows"]
    for r in out["results"]:
        r.pop("routing", None)  # MoE expert ids are not kept across a checkpoint
    out["rewards"] = [None if f else r for r, f in zip(s.rewards, s.failed)]
    for r in out["results"]:
        if "mask" in r and not math.isfinite(r["reward"]):  # a failed trajectory
            r["reward"] = None
    out["metrics"] = {k: v for k, v in s.metrics.items() if math.isfinite(v)}
    return out


def _decode_result(r: dict[str, Any]) -> GenerationResult | Trajectory:
    if "mask" not in r:
        return GenerationResult(**r)
    turns = [Turn(**t) for t in r["turns"]]
    reward = math.nan if r["reward"] is None else float(r["reward"])
    return Trajectory(**{**r, "turns": turns, "reward": reward})


def _decode(d: dict[str, Any]) -> GroupSamples:
    rewards = [math.nan if r is None else float(r) for r in d["rewards"]]
    results = [_decode_result(r) for r in d["results"]]
    return GroupSamples(d["prompt_id"], results, rewards, list(d["failed"]), dict(d["metrics"]))


SAMPLES_CODEC = SamplesCodec(_encode, _decode)  # buffered groups survive a checkpoint (JSON)
