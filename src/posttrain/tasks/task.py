"""What a built task hands to the training loops: prompt datasets, a safe reward scorer, SFT examples.

Also the config fields every task shares (seed, prompt formatting, reward-failure policy, an optional
reward function by import path) so each task's config only adds what is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from posttrain.config import Config
from posttrain.tasks.datasets import PromptDataset, PromptFormatConfig
from posttrain.tasks.rewards import RewardConfig, RewardScorer, load_reward_fn


class TaskConfigBase(Config):
    """Fields shared by every task config."""

    seed: int = Field(
        0,
        description="Seed for problem generation and the train/eval splits; the training prompts' order "
        "comes from it and the run's seed (grpo.seed / seed).",
    )
    prompt_format: PromptFormatConfig = Field(default_factory=PromptFormatConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    reward_fn: str | None = Field(
        None,
        description="Use this reward function instead of the task's own: 'package.module:function' or "
        "'path/to/file.py:function', called as fn(prompts, completions, metadata) -> list[float].",
    )


@dataclass(frozen=True)
class SFTExample:
    """A prompt with its correct completion (ending in EOS), for the supervised warm start."""

    prompt_id: int
    prompt: str
    completion: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_mask: list[int] | None = None  # 1 on trained tokens (a conversation's replies); None = all


@dataclass
class Task:
    """A ready task: `train` / `eval` prompts, a `reward` scorer, and SFT examples when the task has them.

    `reward(prompts, completions, metadata)` returns a `RewardResult`; pass each prompt item's `metadata`.
    """

    name: str
    train: PromptDataset
    eval: PromptDataset | None
    reward: RewardScorer
    sft_examples: list[SFTExample] = field(default_factory=list)
    sft_completion_key: str = "answer"  # the metadata field holding a prompt's correct completion


def make_scorer(cfg: TaskConfigBase, default_fn: Callable[..., Any] | None) -> RewardScorer:
    """The task's reward scorer: `cfg.reward_fn` when set, else the task's own reward function."""
    if cfg.reward_fn is not None:
        return RewardScorer(load_reward_fn(cfg.reward_fn), cfg.reward, name=repr(cfg.reward_fn))
    if default_fn is None:
        raise ValueError("this task has no built-in reward; set reward_fn to 'package.module:function'")
    return RewardScorer(default_fn, cfg.reward)
