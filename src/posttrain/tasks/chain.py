"""A built-in task with long, shown-work completions: iterate a fixed map from a start number and write
every step.

The map is x -> (multiplier * x + increment) mod modulus, by default x -> x + 137 mod 1000 (three-digit
addition with carries). A prompt gives the start number, e.g. `417:`; the correct completion writes each
of the `num_steps` steps as an equation, comma-separated, then `:` and the final value:
`417+137=554,554+137=691,...,971+137=108:108` then EOS (`3*x+7=y` for multiplier 3; numbers are
zero-padded to the modulus' width and results taken mod the modulus). With the defaults (11 steps) that
is 136 tokens (EOS included) of a character tokenizer, so a rollout is long while the problem stays
small for a tiny model: each step is a three-digit sum, and an answer is right only when every step is
(a step right 90% of the time gives 31% answers), which is where reinforcement learning has room to
improve a supervised warm start.

Problems are the start numbers 0..modulus-1; a seeded permutation splits them into training, validation
and test problems, which never overlap. `heldout` picks which of the two held-out splits is the task's
`eval` set: choose hyperparameters on `validation`, report on `test`. The reward is 1.0 when the number
after the last `:` is the final value, else 0.0; the metric `work_correct_fraction` is the fraction of
completions whose every written step is right.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from posttrain.tasks.arithmetic import cut_at_stops, sft_examples, stop_strings
from posttrain.tasks.datasets import PromptFormatConfig, SourcePrompt, build_prompt_dataset
from posttrain.tasks.rewards import RewardResult
from posttrain.tasks.task import Task, TaskConfigBase, make_scorer


class ChainTaskConfig(TaskConfigBase):
    """Iterate x -> (multiplier * x + increment) mod modulus for `num_steps` steps, showing each step."""

    name: Literal["chain"] = "chain"
    multiplier: int = Field(1, ge=1, description="a in x -> (a x + c) mod m.")
    increment: int = Field(
        137,
        ge=0,
        description="c in x -> (a x + c) mod m. The default (x + 137 mod 1000) visits all of 0..999 before "
        "repeating (c coprime to m), so no trajectory can copy an earlier stretch of itself.",
    )
    modulus: int = Field(1000, ge=2, le=100_000, description="m; numbers are written with its width.")
    num_steps: int = Field(11, ge=1, le=1000, description="Steps written per completion.")
    validation_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Share of problems for validation.")
    test_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Share of problems for the test split.")
    heldout: Literal["validation", "test"] = Field(
        "test",
        description="Which held-out split is the task's eval set (tune on validation, report on test).",
    )
    max_eval_prompts: int | None = Field(None, ge=1, description="Cap on the number of held-out problems.")
    reward_mode: Literal["answer", "steps"] = Field(
        "answer",
        description="answer: 1.0 for the right final value, else 0.0. steps: partial credit, the share of "
        "the num_steps equations and the final value that are right before the first wrong one (1.0 only "
        "when all are, so then held-out accuracy counts completions whose whole work is right).",
    )
    prompt_format: PromptFormatConfig = Field(
        default_factory=lambda: PromptFormatConfig(chat_template="never", max_prompt_tokens=32)
    )

    @model_validator(mode="after")
    def _check(self) -> ChainTaskConfig:
        n_val, n_test = self.heldout_sizes
        if min(n_val, n_test) < 1:
            raise ValueError(
                f"modulus={self.modulus} leaves an empty validation or test split at fractions "
                f"{self.validation_fraction}/{self.test_fraction}; raise the modulus or the fractions"
            )
        if n_val + n_test >= self.modulus:
            raise ValueError(
                f"validation_fraction + test_fraction hold out all {self.modulus} problems; lower them"
            )
        return self

    @property
    def heldout_sizes(self) -> tuple[int, int]:
        """(validation, test) problem counts."""
        return round(self.modulus * self.validation_fraction), round(self.modulus * self.test_fraction)

    @property
    def width(self) -> int:
        return len(str(self.modulus - 1))

    def step(self, x: int) -> int:
        return (self.multiplier * x + self.increment) % self.modulus

    def trajectory(self, start: int) -> list[int]:
        """The `num_steps` values after `start`."""
        out, x = [], start
        for _ in range(self.num_steps):
            x = self.step(x)
            out.append(x)
        return out

    def work(self, start: int) -> str:
        """The correct completion (without EOS)."""
        num = f"0{self.width}d"
        head = "" if self.multiplier == 1 else f"{self.multiplier}*"
        steps, x = [], start
        for y in self.trajectory(start):
            steps.append(f"{head}{x:{num}}+{self.increment}={y:{num}}")
            x = y
        return ",".join(steps) + f":{x:{num}}"


def split_starts(cfg: ChainTaskConfig) -> dict[str, list[SourcePrompt]]:
    """{train, validation, test} problems: a seeded permutation of the start numbers."""
    order = np.random.default_rng(cfg.seed).permutation(cfg.modulus).tolist()
    n_val, n_test = cfg.heldout_sizes
    parts = {
        "validation": order[:n_val],
        "test": order[n_val : n_val + n_test],
        "train": order[n_val + n_test :],
    }
    works = {x: cfg.work(x) for x in order}
    return {
        name: [
            SourcePrompt(
                prompt_id=x,
                text=f"{x:0{cfg.width}d}:",
                metadata={"answer": works[x].rsplit(":", 1)[1], "work": works[x]},
            )
            for x in starts
        ]
        for name, starts in parts.items()
    }


class ChainReward:
    """1.0 when the text after the completion's last ':' (up to EOS, cut at whitespace) is the final value,
    else 0.0; with `partial`, the share of leading parts (equations, then the final value) that are right."""

    def __init__(self, stop_strings: list[str], partial: bool = False) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self.partial = partial

    @staticmethod
    def _leading_share(text: str, work: str) -> float:
        """The share of `work`'s parts (its equations, then its final value) that `text` gets right, in
        order, before its first wrong one."""

        def parts(t: str) -> list[str]:
            body, sep, final = t.rpartition(":")
            return [*body.split(","), final] if sep else t.split(",")

        want, right = parts(work), 0
        for got, expected in zip(parts(text), want):
            if got != expected:
                break
            right += 1
        return right / len(want)

    def __call__(
        self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        texts = [cut_at_stops(c, self.stop_strings).strip() for c in completions]
        answers = [t.rsplit(":", 1)[1] if ":" in t else "" for t in texts]
        rewards = [1.0 if a == str(m["answer"]) else 0.0 for a, m in zip(answers, metadata)]
        if self.partial:
            rewards = [self._leading_share(t, m["work"]) for t, m in zip(texts, metadata)]
        work = sum(t == m["work"] for t, m in zip(texts, metadata)) / max(len(texts), 1)
        return RewardResult(rewards=rewards, metrics={"work_correct_fraction": work})


def build_chain_task(cfg: ChainTaskConfig, tokenizer: Any) -> Task:
    """The problems, tokenized, with the final-value reward and the shown-work SFT examples."""
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("the chain task needs a tokenizer with an EOS token (completions end with EOS)")
    splits = split_starts(cfg)
    fmt = cfg.prompt_format
    train = build_prompt_dataset(splits["train"], tokenizer, fmt, seed=cfg.seed, shuffle=True, name="train")
    held = splits[cfg.heldout][: cfg.max_eval_prompts]
    evals = build_prompt_dataset(held, tokenizer, fmt, seed=cfg.seed, shuffle=False, name=cfg.heldout)
    return Task(
        name="chain",
        train=train,
        eval=evals,
        reward=make_scorer(cfg, ChainReward(stop_strings(tokenizer), partial=cfg.reward_mode == "steps")),
        sft_examples=sft_examples(train, tokenizer, answer_key="work"),
        sft_completion_key="work",
    )
