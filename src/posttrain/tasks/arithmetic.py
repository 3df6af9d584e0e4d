"""The built-in demo task: small integer arithmetic, prompts like "7+5=", answers like "12" then EOS.

The problem space (every operand pair for every operation in range) is enumerated in a fixed order, so a
problem's `prompt_id` is its place in that order. A seeded permutation then splits it into training and
held-out problems, which therefore never overlap. The reward is 1.0 for exactly the right integer (the
completion read up to EOS, a newline or a space) and 0.0 otherwise; a sample is never scored 0 because of a
missing gold answer (that is a failure, not a wrong answer).

The defaults (single-digit addition and non-negative subtraction, about 120 training problems) are sized
for a tiny character-level model: a short SFT warm start on CPU gets part of them right and GRPO improves
from there. `max_operand` (up to 99), `operations` and `num_sft_examples` make it harder.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from posttrain.tasks.datasets import PromptDataset, PromptFormatConfig, SourcePrompt, build_prompt_dataset
from posttrain.tasks.rewards import RewardResult
from posttrain.tasks.task import SFTExample, Task, TaskConfigBase, make_scorer

Operation = Literal["+", "-", "*"]
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTaskConfig(TaskConfigBase):
    """The arithmetic demo task; the operand range and operations set its difficulty."""

    name: Literal["arithmetic"] = "arithmetic"
    operations: list[Operation] = Field(default_factory=lambda: ["+", "-"], description="Operations used.")
    min_operand: int = Field(0, ge=0, le=99, description="Smallest operand.")
    max_operand: int = Field(9, ge=0, le=99, description="Largest operand (9: single digit, 99: two digits).")
    allow_negative: bool = Field(False, description="Allow subtractions with a negative result.")
    eval_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Fraction of the problems held out for eval."
    )
    max_train_prompts: int | None = Field(None, ge=1, description="Cap on the number of training problems.")
    max_eval_prompts: int | None = Field(None, ge=1, description="Cap on the number of held-out problems.")
    num_sft_examples: int | None = Field(
        None,
        ge=1,
        description="SFT warm-start examples, taken from the training problems (None: all of them).",
    )
    prompt_format: PromptFormatConfig = Field(
        default_factory=lambda: PromptFormatConfig(chat_template="never", max_prompt_tokens=32)
    )

    @model_validator(mode="after")
    def _check(self) -> ArithmeticTaskConfig:
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"min_operand={self.min_operand} is above max_operand={self.max_operand}; swap them"
            )
        if not self.operations or len(set(self.operations)) != len(self.operations):
            raise ValueError(f"operations must be a non-empty list without repeats, got {self.operations}")
        return self


def enumerate_problems(cfg: ArithmeticTaskConfig) -> list[SourcePrompt]:
    """Every problem in range, in a fixed order; the index in this list is the problem's prompt_id."""
    problems = []
    operands = range(cfg.min_operand, cfg.max_operand + 1)
    for op in cfg.operations:
        for a in operands:
            for b in operands:
                if op == "-" and a < b and not cfg.allow_negative:
                    continue
                answer = str(_APPLY[op](a, b))
                meta = {"answer": answer, "a": a, "b": b, "op": op}
                problems.append(SourcePrompt(prompt_id=len(problems), text=f"{a}{op}{b}=", metadata=meta))
    return problems


def split_problems(cfg: ArithmeticTaskConfig) -> tuple[list[SourcePrompt], list[SourcePrompt]]:
    """(train, eval) problems: a seeded permutation of all problems, the first part held out."""
    problems = enumerate_problems(cfg)
    if len(problems) < 2:
        raise ValueError("the arithmetic problem space has fewer than 2 problems; widen the operand range")
    order = np.random.default_rng(cfg.seed).permutation(len(problems)).tolist()
    k = min(max(1, round(len(problems) * cfg.eval_fraction)), len(problems) - 1)
    held, train = [problems[i] for i in order[:k]], [problems[i] for i in order[k:]]
    return train[: cfg.max_train_prompts], held[: cfg.max_eval_prompts]


def cut_at_stops(completion: str, stop_strings: Sequence[str]) -> str:
    """The completion up to its first stop string (e.g. EOS)."""
    for stop in stop_strings:
        completion = completion.split(stop, 1)[0]
    return completion


def parse_answer(completion: str, stop_strings: Sequence[str] = ()) -> str:
    """The completion up to the first stop string (e.g. EOS), newline or whitespace."""
    return re.match(r"\S*", cut_at_stops(completion, stop_strings)).group(0)


class ArithmeticReward:
    """1.0 when the completion's answer is exactly the gold integer (no sign, spaces or leading zeros), else 0.0.

    A missing `metadata['answer']` raises, so the sample is marked failed rather than scored 0.
    """

    def __init__(self, stop_strings: Sequence[str] = ()) -> None:
        self.stop_strings = [s for s in stop_strings if s]

    def __call__(
        self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        answers = [parse_answer(c, self.stop_strings) for c in completions]
        rewards = [1.0 if got == str(m["answer"]) else 0.0 for got, m in zip(answers, metadata)]
        well_formed = sum(bool(re.fullmatch(r"-?\d+", a)) for a in answers) / max(len(answers), 1)
        return RewardResult(rewards=rewards, metrics={"answer_well_formed_fraction": well_formed})


def stop_strings(tokenizer: Any) -> list[str]:
    """The strings a completion is cut at before scoring: the tokenizer's EOS and pad tokens."""
    return [t for t in (tokenizer.eos_token, tokenizer.pad_token) if t]


def sft_examples(
    dataset: PromptDataset, tokenizer: Any, limit: int | None = None, answer_key: str = "answer"
) -> list[SFTExample]:
    """Prompt + correct completion (`metadata[answer_key]`) + EOS for the first `limit` prompts of
    `dataset` (all when None)."""
    eos = tokenizer.eos_token_id
    items = dataset.items[:limit]
    answers = [str(it.metadata[answer_key]) for it in items]
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"] if answers else []
    return [
        SFTExample(
            prompt_id=it.prompt_id,
            prompt=it.prompt,
            completion=answer + tokenizer.eos_token,
            prompt_token_ids=list(it.prompt_token_ids),
            completion_token_ids=[*ids, eos],
        )
        for it, answer, ids in zip(items, answers, answer_ids)
    ]


def build_arithmetic_task(cfg: ArithmeticTaskConfig, tokenizer: Any) -> Task:
    """Generate the problems, tokenize them and pair them with the exact-answer reward."""
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("the arithmetic task needs a tokenizer with an EOS token (answers end with EOS)")
    train_src, eval_src = split_problems(cfg)
    fmt = cfg.prompt_format
    train = build_prompt_dataset(train_src, tokenizer, fmt, seed=cfg.seed, shuffle=True, name="train")
    evals = build_prompt_dataset(eval_src, tokenizer, fmt, seed=cfg.seed, shuffle=False, name="eval")
    return Task(
        name="arithmetic",
        train=train,
        eval=evals,
        reward=make_scorer(cfg, ArithmeticReward(stop_strings(tokenizer))),
        sft_examples=sft_examples(train, tokenizer, cfg.num_sft_examples),
    )
