"""Tasks: prompt datasets and the reward functions that score completions on them.

`build_task(cfg, tokenizer)` turns a `TaskConfig` (arithmetic, chain, math or custom) into a `Task` with
`train` and `eval` prompt datasets, a failure-safe `reward` scorer and, for the built-in arithmetic and
chain tasks, SFT examples.
"""

from posttrain.tasks.arithmetic import ArithmeticReward, ArithmeticTaskConfig, build_arithmetic_task
from posttrain.tasks.build import CustomTaskConfig, TaskConfig, build_custom_task, build_task
from posttrain.tasks.chain import ChainReward, ChainTaskConfig, build_chain_task
from posttrain.tasks.datasets import (
    DatasetConfig,
    PromptDataset,
    PromptFormatConfig,
    PromptItem,
    SourcePrompt,
    build_prompt_dataset,
    build_splits,
    load_rows,
)
from posttrain.tasks.math import MathTaskConfig, MathVerifyReward, build_math_task
from posttrain.tasks.rewards import (
    RewardConfig,
    RewardError,
    RewardFn,
    RewardResult,
    RewardScorer,
    load_reward_fn,
)
from posttrain.tasks.task import SFTExample, Task, TaskConfigBase

__all__ = [
    "ArithmeticReward",
    "ArithmeticTaskConfig",
    "ChainReward",
    "ChainTaskConfig",
    "CustomTaskConfig",
    "DatasetConfig",
    "MathTaskConfig",
    "MathVerifyReward",
    "PromptDataset",
    "PromptFormatConfig",
    "PromptItem",
    "RewardConfig",
    "RewardError",
    "RewardFn",
    "RewardResult",
    "RewardScorer",
    "SFTExample",
    "SourcePrompt",
    "Task",
    "TaskConfig",
    "TaskConfigBase",
    "build_arithmetic_task",
    "build_chain_task",
    "build_custom_task",
    "build_math_task",
    "build_prompt_dataset",
    "build_splits",
    "build_task",
    "load_reward_fn",
    "load_rows",
]
