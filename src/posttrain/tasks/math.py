"""Math problems from a local dataset, with answers checked by the `math-verify` library.

Each row has a problem and a gold answer (field names configurable). The reward parses the completion with
`math_verify.parse` (LaTeX, \\boxed{...} first, or a plain expression) and compares it with the parsed gold
answer using `math_verify.verify`: 1.0 when equivalent, 0.0 when not, including when the completion holds no
answer at all. Where the checker itself breaks (an exception, a timeout, a gold answer it cannot parse) the
sample is marked failed instead of being scored 0.

math-verify bounds its work with `signal.alarm`, which only works in the main thread. Off the main thread
(the async rollout worker scores on a daemon thread) the reward runs in a watched child process instead,
where the timeouts work and a sample the signal cannot stop is killed and marked failed
(tasks/math_child.py): a completion like `\\boxed{9^{9^{9}}}` would otherwise freeze the whole process.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

from pydantic import Field

from posttrain.tasks.datasets import DatasetConfig, PromptFormatConfig, answer_text, build_splits
from posttrain.tasks.math_child import MathVerifyChild, MathVerifyScorer
from posttrain.tasks.rewards import RewardResult
from posttrain.tasks.task import Task, TaskConfigBase, make_scorer

DEFAULT_MATH_TEMPLATE = "{prompt}\nPut your final answer within \\boxed{}."


class MathTaskConfig(TaskConfigBase):
    """A math dataset scored by math-verify."""

    name: Literal["math"] = "math"
    dataset: DatasetConfig = Field(description="Where the problems and gold answers are.")
    timeout_seconds: int = Field(
        5,
        ge=1,
        description="Bound in seconds on each math-verify parse / compare (off the main thread: in a "
        "child process, killed past three of these plus 5 s, see tasks/math_child.py).",
    )
    float_rounding: int = Field(6, ge=0, description="Decimal places math-verify rounds floats to.")
    prompt_format: PromptFormatConfig = Field(
        default_factory=lambda: PromptFormatConfig(template=DEFAULT_MATH_TEMPLATE)
    )


class MathVerifyReward:
    """Reward 1.0 if math-verify finds the completion's answer equivalent to `metadata['answer']`, else 0.0."""

    def __init__(self, timeout_seconds: int = 5, float_rounding: int = 6) -> None:
        self._scorer = MathVerifyScorer(timeout_seconds, float_rounding)  # in this process (main thread)
        self._mv = self._scorer.mv
        self.timeout_seconds = timeout_seconds
        self.float_rounding = float_rounding
        # scores off the main thread; its process starts on first use
        self._child = MathVerifyChild(timeout_seconds, float_rounding)

    def _score_here(self, completion: str, meta: dict[str, Any]) -> tuple[float, str | None]:
        try:
            return self._scorer.score_one(completion, meta["answer"]), None
        except (Exception, self._scorer.timeout_exc) as exc:
            return float("nan"), f"{type(exc).__name__}: {exc}"

    def _score_in_child(
        self, completions: list[str], metadata: list[dict[str, Any]]
    ) -> list[tuple[float, str | None]]:
        """Scores from the child process (tasks/math_child.py); a row without a usable answer fails here."""
        scored: list[tuple[float, str | None] | None] = []
        pairs = []
        for completion, meta in zip(completions, metadata):
            try:
                pairs.append((completion, answer_text(meta["answer"])))
                scored.append(None)
            except Exception as exc:
                scored.append((float("nan"), f"{type(exc).__name__}: {exc}"))
        from_child = iter(self._child.score(pairs))
        return [s if s is not None else next(from_child) for s in scored]

    def __call__(
        self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        if threading.current_thread() is not threading.main_thread():
            scored = self._score_in_child(completions, metadata)  # signal timeouts need a main thread
        else:
            scored = [self._score_here(c, meta) for c, meta in zip(completions, metadata)]
        result = RewardResult(rewards=[], failed=[], errors=[])
        for reward, error in scored:
            result.rewards.append(reward)
            result.failed.append(error is not None)
            result.errors.append(error)
        return result


def build_math_task(cfg: MathTaskConfig, tokenizer: Any) -> Task:
    """Load and check the dataset, then pair it with the math-verify reward (or `cfg.reward_fn`)."""
    if cfg.dataset.answer_field is None:
        raise ValueError("the math task needs dataset.answer_field: the column holding the gold answers")
    default = None if cfg.reward_fn else MathVerifyReward(cfg.timeout_seconds, cfg.float_rounding)
    reward = make_scorer(cfg, default)
    train, evals = build_splits(cfg.dataset, cfg.prompt_format, tokenizer, seed=cfg.seed)
    return Task(name="math", train=train, eval=evals, reward=reward)
