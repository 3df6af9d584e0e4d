"""Groups of multi-turn episodes, the same for the synchronous and the asynchronous loop: play them
(rollout/trajectory.py), turn them into rewards and failure flags with their metrics, and validate on
held-out samples.

A group is `num_generations_per_prompt` trajectories of one environment sample; trajectory k of a
group draws from stream k of the group's seed (the synchronous loop with its default per-step seeds:
the step's seed, stream i * G + k for the i-th sample). A failed trajectory (the environment raised or
timed out) has reward NaN and `failed` set: it is excluded from advantages and counted (`env/failed`),
never rewarded 0.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import torch

from posttrain.envs.build import EnvSuite
from posttrain.generation.params import SamplingParams
from posttrain.rollout.chat import ChatRenderer
from posttrain.rollout.config import GroupConfig
from posttrain.rollout.groups import group_streams, validation_seed
from posttrain.rollout.trajectory import Trajectory, env_call, opening, run_group, run_trajectory
from posttrain.tasks.datasets import PromptItem
from posttrain.tasks.task import SFTExample


async def play_groups(
    engine: Any,
    tokenizer: Any,
    suite: EnvSuite,
    items: list[PromptItem],
    group_size: int,
    sampling: SamplingParams,
    seed_of: Callable[[int], tuple[int, int]],
) -> list[list[Trajectory]]:
    """The groups of `items`, all played concurrently; `seed_of(i)` is group i's (seed, first stream)."""
    groups = [
        run_group(engine, tokenizer, suite, suite.sample(it), group_size, sampling, *seed_of(i))
        for i, it in enumerate(items)
    ]
    return list(await asyncio.gather(*groups))


def play_step(
    engine: Any,
    tokenizer: Any,
    suite: EnvSuite,
    items: list[PromptItem],
    group_size: int,
    sampling: SamplingParams,
    seed: int | list[int],
) -> list[Trajectory]:
    """The synchronous loop's groups of one step, flattened in group order (blocking); trajectory k
    of group i draws from stream i * G + k of `seed`, or from stream k of `seed[i]` (one seed per
    group), as single-turn samples do."""
    starts = group_streams(seed, len(items), group_size)
    play = play_groups(engine, tokenizer, suite, items, group_size, sampling, starts.__getitem__)
    return [t for group in asyncio.run(play) for t in group]


def trajectory_rewards(trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rewards (NaN where failed), failure flags and the episodes' metrics (means over trajectories,
    `env/failed` a count)."""
    rewards = torch.tensor([math.nan if t.failed else t.reward for t in trajs], dtype=torch.float32)
    failed = torch.tensor([t.failed for t in trajs], dtype=torch.bool)
    return rewards, failed, episode_metrics(trajs)


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Turns, tool calls, lengths, cut and failed episodes, and the environments' own info (means)."""
    n = max(len(trajs), 1)
    ok = [t for t in trajs if not t.failed]
    out = {
        "env/failed": float(len(trajs) - len(ok)),
        "env/turns": sum(len(t.turns) for t in trajs) / n,
        "env/tool_calls": sum(t.num_tool_calls for t in trajs) / n,
        "env/truncated_fraction": sum(t.finish_reason == "length" for t in ok) / max(len(ok), 1),
        "env/solved_fraction": sum(t.solved() for t in ok) / max(len(ok), 1),
        "env/trajectory_tokens": sum(len(t.prompt_token_ids) + len(t.token_ids) for t in trajs) / n,
        "env/sampled_tokens": sum(sum(t.mask) for t in trajs) / n,
        "reward_failed": float(len(trajs) - len(ok)),
    }
    keys = sorted({k for t in ok for k in t.info if not k.startswith("turn_reward_")})
    for k in keys:  # the environment's own metrics, where they do not shadow the ones above
        values = [t.info[k] for t in ok if k in t.info]
        out.setdefault(f"env/{k}", sum(values) / len(values))
    return out


CURVES = ("reward", "val/accuracy", "env/tool_calls", "env/turns")  # curves.png (absent keys are skipped)


# counts (failed episodes, reward-model scores that were not finite): summed over draws or groups,
# never averaged; the other metrics under these prefixes are means
_COUNTS = ("env/failed", "reward/model_failed")


def mean_metrics(
    summaries: list[dict[str, float]], prefix: str, weights: list[float] | None = None
) -> dict[str, float]:
    """The metrics under `prefix` of several draws or groups: means weighted by `weights` (each
    summary's samples; None: equal), each over the summaries that have it; counts (`_COUNTS`) summed."""
    weights = [1.0] * len(summaries) if weights is None else weights
    out = {}
    for key in sorted({k for s in summaries for k in s if k.startswith(prefix)}):
        pairs = [(s[key], w) for s, w in zip(summaries, weights) if key in s]
        if key in _COUNTS:
            out[key] = float(sum(v for v, _ in pairs))
        else:
            out[key] = sum(v * w for v, w in pairs) / max(sum(w for _, w in pairs), 1e-12)
    return out


def mean_episode_metrics(
    summaries: list[dict[str, float]], weights: list[float] | None = None
) -> dict[str, float]:
    """The `env/` metrics of several draws or groups (see `mean_metrics`)."""
    return mean_metrics(summaries, "env/", weights)


def validate_env(
    engine: Any, tokenizer: Any, suite: EnvSuite, sampling: SamplingParams, group: GroupConfig
) -> dict[str, float]:
    """Held-out episodes: accuracy = solved fraction (greedy when k=1; a failed episode counts as
    unsolved and is counted in `val/reward_failed`), pass@k for k > 1, mean reward, turns, tool calls."""
    if suite.eval is None:
        raise ValueError(f"environment {suite.name!r} has no held-out samples; set its eval split")
    items = suite.eval.items[: group.val_max_prompts]
    k = group.val_num_generations

    async def play() -> list[Trajectory]:
        runs = []
        for i, it in enumerate(items):
            for j in range(k):
                params = sampling.model_copy(update={"greedy": k == 1})
                seed = validation_seed(group.seed, i * k + j)
                runs.append(run_trajectory(engine, tokenizer, suite, suite.sample(it), params, seed, 0))
        return list(await asyncio.gather(*runs))

    trajs = asyncio.run(play())
    solved = torch.tensor([t.solved() for t in trajs]).view(len(items), k)
    ok = [t.reward for t in trajs if not t.failed]
    out = {
        "val/accuracy": float(solved.float().mean()),
        "val/reward": sum(ok) / len(ok) if ok else math.nan,
        "val/reward_failed": float(sum(t.failed for t in trajs)),
        "val/turns": sum(len(t.turns) for t in trajs) / len(trajs),
        "val/tool_calls": sum(t.num_tool_calls for t in trajs) / len(trajs),
    }
    without = [t.solved() for t in trajs if t.num_tool_calls == 0]
    if without and len(without) < len(trajs):  # tools were used: how far the model gets without them
        out["val/accuracy_without_tools"] = sum(without) / len(without)
    if k > 1:
        out[f"val/pass@{k}"] = float(solved.any(dim=1).float().mean())
    return out


async def _openings(suite: EnvSuite, items: list[PromptItem]) -> list[tuple[list[dict], list[dict]]]:
    """The opening messages and tool schemas of each item's environment (reset, then closed; one at
    a time: a plain reset runs on a thread of its own)."""
    out, timeout = [], suite.limits.step_timeout_s
    for it in items:
        env = suite.make_env(suite.sample(it))
        try:
            out.append(
                opening(await env_call(env.reset, timeout=timeout, what="reset()"), suite.system_prompt)
            )
        finally:
            if hasattr(env, "close"):
                await env_call(env.close, timeout=timeout, what="close()")
    return out


def demonstration_examples(suite: EnvSuite, tokenizer: Any, items: list[PromptItem]) -> list[SFTExample]:
    """Supervised warm-start examples from the environment's ideal episodes: each conversation built
    token for token as a trajectory is, trained on the assistant's tokens only."""
    if suite.demonstration is None:
        raise ValueError(
            f"environment {suite.name!r} has no demonstrations for a supervised warm start; "
            "start RL from a model that already follows its format"
        )
    openings = asyncio.run(_openings(suite, items))
    out = []
    for it, (messages, tools) in zip(items, openings):
        demo = suite.demonstration(suite.sample(it))
        if suite.system_prompt and demo[0]["role"] != "system":
            demo = [messages[0], *demo]
        prompt, rest, mask = ChatRenderer(tokenizer, tools).conversation(demo)
        text = tokenizer.decode(rest, skip_special_tokens=False)
        out.append(SFTExample(it.prompt_id, it.prompt, text, prompt, rest, mask))
    return out
