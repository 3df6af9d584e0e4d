"""`EnvConfig` (one config type for every environment, told apart by `name`) and `build_env`.

Environments: `calculator` (multi-digit products with a calculator tool), `guess` (guess the number
with higher/lower replies), `code` (Python in a sandbox, unit-test rewards) and `custom` (your class
by import path, built per trajectory from the rows of your dataset).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from posttrain.envs.base import EnvConfigBase, EnvLimits, EnvSample, Message, ToolCall
from posttrain.envs.calculator import (
    CalculatorEnvConfig,
    CalculatorEnvironment,
    calculator_demonstration,
    calculator_samples,
)
from posttrain.envs.code import CodeEnvConfig, CodeEnvironment, code_demonstration, code_samples
from posttrain.envs.guess import GuessEnvConfig, GuessEnvironment, guess_demonstration, guess_samples
from posttrain.envs.sandbox import check_sandbox
from posttrain.envs.tools import load_parser
from posttrain.tasks.datasets import PromptDataset, PromptItem, load_rows
from posttrain.tasks.rewards import load_callable


class CustomEnvConfig(EnvConfigBase):
    """Your environment class, built per trajectory as `env_class(EnvSample(row_index, row))` from the
    rows of a local dataset (.jsonl, .json, .parquet or a save_to_disk directory)."""

    name: Literal["custom"] = "custom"
    env_class: str = Field(description="'package.module:Class' or 'path/to/file.py:Class'")
    train_path: str = Field(description="rows the training episodes are built from")
    eval_path: str | None = Field(None, description="held-out rows (None: no held-out validation)")


def _env_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("name")
    return getattr(value, "name", None)


EnvConfig = Annotated[
    Annotated[CalculatorEnvConfig, Tag("calculator")]
    | Annotated[GuessEnvConfig, Tag("guess")]
    | Annotated[CodeEnvConfig, Tag("code")]
    | Annotated[CustomEnvConfig, Tag("custom")],
    Discriminator(_env_kind),
]
"""Any environment's config; `name` picks the kind. Use as a field type: `env: EnvConfig | None`."""


@dataclass
class EnvSuite:
    """A built environment: its samples as prompt datasets (the loops' cursors and checkpoints work on
    them; `metadata` holds the sample's fields), how to make the environment of a sample, the limits,
    the tool-call parser, and ideal episodes for the supervised warm start when the environment has them."""

    name: str
    train: PromptDataset
    eval: PromptDataset | None
    make_env: Callable[[EnvSample], Any]
    limits: EnvLimits
    parse_tool_calls: Callable[[str], list[ToolCall]]
    system_prompt: str | None = None
    demonstration: Callable[[EnvSample], list[Message]] | None = None

    @staticmethod
    def sample(item: PromptItem) -> EnvSample:
        """The environment sample behind a prompt item."""
        return EnvSample(item.prompt_id, item.metadata)


def _dataset(samples: list[EnvSample], seed: int, name: str) -> PromptDataset:
    items = [
        PromptItem(s.sample_id, json.dumps(s.data, sort_keys=True, default=str), [], dict(s.data))
        for s in samples
    ]
    return PromptDataset(items, seed=seed, shuffle=name == "train", name=name)


def _rows(path: str) -> list[EnvSample]:
    rows = load_rows(path)
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"{path}: row {bad} is not an object with fields; an environment sample is one")
    return [EnvSample(i, dict(r)) for i, r in enumerate(rows)]


def build_env(cfg: CalculatorEnvConfig | GuessEnvConfig | CodeEnvConfig | CustomEnvConfig) -> EnvSuite:
    """Build the environment `cfg` describes (samples, factory, limits, parser). The code environment
    checks here that the platform can run its sandbox (SandboxUnavailableError with the fix otherwise)."""
    demo = None
    if isinstance(cfg, CalculatorEnvConfig):
        train, held = calculator_samples(cfg)
        make, demo = CalculatorEnvironment, partial(calculator_demonstration, cfg=cfg)
    elif isinstance(cfg, GuessEnvConfig):
        train, held = guess_samples(cfg)
        make = partial(GuessEnvironment, max_turns=cfg.limits.max_turns)
        demo = partial(guess_demonstration, cfg=cfg)
    elif isinstance(cfg, CodeEnvConfig):
        check_sandbox(cfg.sandbox)
        train, held = code_samples(cfg)
        make, demo = partial(CodeEnvironment, cfg=cfg), partial(code_demonstration, cfg=cfg)
    elif isinstance(cfg, CustomEnvConfig):
        make = load_callable(cfg.env_class, "environment class", "a class constructed as Class(sample)")
        train, held = _rows(cfg.train_path), _rows(cfg.eval_path) if cfg.eval_path else []
    else:
        raise ValueError(f"unknown environment config {type(cfg).__name__}; use one of the EnvConfig classes")
    return EnvSuite(
        name=cfg.name,
        train=_dataset(train, cfg.seed, "train"),
        eval=_dataset(held, cfg.seed, "eval") if held else None,
        make_env=make,
        limits=cfg.limits,
        parse_tool_calls=load_parser(cfg.tool_parser),
        system_prompt=cfg.system_prompt,
        demonstration=demo,
    )
