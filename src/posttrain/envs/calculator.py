"""Built-in environment (a): multi-digit products with a calculator tool.

The user asks for a product like `347*28`; the model may call `calc(expr)` (Hermes-style tool call)
and then answers with the number. A tiny model cannot multiply three-digit numbers in its head, so the
reward (1 for the exact product, else 0) rewards using the tool. The supervised warm start mixes
demonstrations that use the tool with ones that answer at once (`direct_answer_fraction`): the warm
model calls the tool in some of its attempts, and RL has to learn that calling it pays.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Literal

import numpy as np
from pydantic import Field

from posttrain.envs.base import (
    AssistantMessage,
    EnvConfigBase,
    EnvLimits,
    EnvReset,
    EnvSample,
    EnvStep,
    Message,
)
from posttrain.envs.tools import ToolEnvironment

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def calc(expr: str) -> str:
    """Evaluate an integer arithmetic expression with + - * // and parentheses.

    Args:
        expr: the expression, e.g. 347*28
    """
    if len(expr) > 64:
        raise ValueError("expression too long (64 characters at most)")

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression {expr!r}: integers with + - * // and parentheses")

    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expr!r}") from e
    return str(ev(tree.body))


class CalculatorEnvConfig(EnvConfigBase):
    """Products of a `left_digits`-digit and a `right_digits`-digit number, with a calculator tool."""

    name: Literal["calculator"] = "calculator"
    left_digits: int = Field(3, ge=1, le=6, description="digits of the first factor")
    right_digits: int = Field(2, ge=1, le=6, description="digits of the second factor")
    num_train: int = Field(2000, ge=1, description="training problems")
    num_eval: int = Field(100, ge=1, description="held-out problems (never trained on)")
    direct_answer_fraction: float = Field(
        0.5, ge=0, le=1, description="share of warm-start demonstrations that answer without the tool"
    )
    limits: EnvLimits = Field(default_factory=lambda: EnvLimits(max_turns=3, max_tokens=192))


def _number(rng: np.random.Generator, digits: int) -> int:
    return int(rng.integers(10 ** (digits - 1), 10**digits))


def calculator_samples(cfg: CalculatorEnvConfig) -> tuple[list[EnvSample], list[EnvSample]]:
    """(train, held-out) problems, distinct, drawn with the config's seed."""
    rng = np.random.default_rng(cfg.seed)
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    want = cfg.num_train + cfg.num_eval
    space = 9 * 10 ** (cfg.left_digits - 1) * 9 * 10 ** (cfg.right_digits - 1)
    if want > space // 2:
        raise ValueError(f"{want} problems from a space of {space}: lower num_train/num_eval or add digits")
    while len(pairs) < want:
        pair = (_number(rng, cfg.left_digits), _number(rng, cfg.right_digits))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    samples = [EnvSample(i, {"a": a, "b": b, "answer": a * b}) for i, (a, b) in enumerate(pairs)]
    return samples[cfg.num_eval :], samples[: cfg.num_eval]


def _question(sample: EnvSample) -> Message:
    return {"role": "user", "content": f"{sample.data['a']}*{sample.data['b']}=?"}


def read_answer(text: str) -> str | None:
    """The integer the reply ends with (None if it ends with none)."""
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


class CalculatorEnvironment(ToolEnvironment):
    """One product; reward 1.0 for the exact answer (after any number of calculator calls)."""

    tools = [calc]

    def reset(self) -> EnvReset:
        return EnvReset([_question(self.sample)], tools=self.tools)

    def finish(self, message: AssistantMessage) -> EnvStep:
        correct = read_answer(message.content) == str(self.sample.data["answer"])
        return EnvStep(done=True, reward=float(correct), success=correct)


def calculator_demonstration(sample: EnvSample, cfg: CalculatorEnvConfig) -> list[Message]:
    """An ideal episode for the warm start: call the tool, then answer; or, for a seeded share of the
    samples (`direct_answer_fraction`), answer at once."""
    a, b, answer = sample.data["a"], sample.data["b"], str(sample.data["answer"])
    direct = np.random.default_rng([cfg.seed, sample.sample_id]).random() < cfg.direct_answer_fraction
    if direct:
        return [_question(sample), {"role": "assistant", "content": answer}]
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": f"{a}*{b}"}}}
    return [
        _question(sample),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calc", "content": answer},
        {"role": "assistant", "content": answer},
    ]
