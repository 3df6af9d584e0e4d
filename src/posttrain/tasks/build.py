"""`TaskConfig` (one config type for every task, told apart by `name`) and `build_task`.

Tasks: `arithmetic` (built-in demo), `chain` (built-in, long shown-work completions), `math` (a dataset
scored by math-verify) and `custom` (a dataset scored by any reward function given by import path).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from posttrain.tasks.arithmetic import ArithmeticTaskConfig, build_arithmetic_task
from posttrain.tasks.chain import ChainTaskConfig, build_chain_task
from posttrain.tasks.datasets import DatasetConfig, build_splits
from posttrain.tasks.math import MathTaskConfig, build_math_task
from posttrain.tasks.task import Task, TaskConfigBase, make_scorer


class CustomTaskConfig(TaskConfigBase):
    """A local dataset scored by your own reward function."""

    name: Literal["custom"] = "custom"
    dataset: DatasetConfig = Field(description="Where the prompts (and any gold answers) are.")
    reward_fn: str = Field(
        description="The reward function: 'package.module:function' or 'path/to/file.py:function', called as "
        "fn(prompts, completions, metadata) -> list[float] (or a RewardResult)."
    )


def _task_kind(value: Any) -> str | None:
    """The union tag: a config's `name`, defaulting to the arithmetic demo task when not given."""
    if isinstance(value, dict):
        return value.get("name", "arithmetic")
    return getattr(value, "name", None)


TaskConfig = Annotated[
    Annotated[ArithmeticTaskConfig, Tag("arithmetic")]
    | Annotated[ChainTaskConfig, Tag("chain")]
    | Annotated[MathTaskConfig, Tag("math")]
    | Annotated[CustomTaskConfig, Tag("custom")],
    Discriminator(_task_kind),
]
"""Any task's config; `name` picks the kind (default 'arithmetic'). Use as a field type: `task: TaskConfig`."""


def build_custom_task(cfg: CustomTaskConfig, tokenizer: Any) -> Task:
    """Load the dataset and the reward function named by `cfg.reward_fn`."""
    reward = make_scorer(cfg, None)
    train, evals = build_splits(cfg.dataset, cfg.prompt_format, tokenizer, seed=cfg.seed)
    return Task(name="custom", train=train, eval=evals, reward=reward)


def build_task(
    cfg: ArithmeticTaskConfig | ChainTaskConfig | MathTaskConfig | CustomTaskConfig, tokenizer: Any
) -> Task:
    """Build the task `cfg` describes: datasets tokenized with `tokenizer`, and its reward scorer."""
    if isinstance(cfg, ArithmeticTaskConfig):
        return build_arithmetic_task(cfg, tokenizer)
    if isinstance(cfg, ChainTaskConfig):
        return build_chain_task(cfg, tokenizer)
    if isinstance(cfg, MathTaskConfig):
        return build_math_task(cfg, tokenizer)
    if isinstance(cfg, CustomTaskConfig):
        return build_custom_task(cfg, tokenizer)
    raise ValueError(f"unknown task config {type(cfg).__name__}; use one of the TaskConfig classes")
