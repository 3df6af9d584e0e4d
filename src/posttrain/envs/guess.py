"""Built-in environment (b): guess the number, with "higher"/"lower" replies.

The user thinks of a number in [1, max_number]; each reply is a guess; the environment answers
`higher` or `lower` until the guess is right or the turns run out. Reward: 1.0 for a first-turn hit,
down by `1 / max_turns` per extra turn, 0 when the turns run out (binary search needs
ceil(log2(max_number + 1)) turns).
"""

from __future__ import annotations

import re
from typing import Literal

import numpy as np
from pydantic import Field

from posttrain.envs.base import (
    AssistantMessage,
    EnvConfigBase,
    Environment,
    EnvLimits,
    EnvSample,
    EnvStep,
    Message,
)


class GuessEnvConfig(EnvConfigBase):
    """Secret numbers in [1, max_number]."""

    name: Literal["guess"] = "guess"
    max_number: int = Field(15, ge=2, le=10_000, description="secrets are drawn from [1, max_number]")
    num_eval: int = Field(5, ge=1, description="held-out secrets (the rest train)")
    limits: EnvLimits = Field(default_factory=lambda: EnvLimits(max_turns=5, max_tokens=160))


def guess_samples(cfg: GuessEnvConfig) -> tuple[list[EnvSample], list[EnvSample]]:
    """(train, held-out): every secret once, split by a seeded permutation."""
    if cfg.num_eval >= cfg.max_number:
        raise ValueError(f"num_eval={cfg.num_eval} leaves no secret to train on; lower it below max_number")
    order = np.random.default_rng(cfg.seed).permutation(cfg.max_number) + 1
    samples = [EnvSample(i, {"secret": int(s), "max_number": cfg.max_number}) for i, s in enumerate(order)]
    return samples[cfg.num_eval :], samples[: cfg.num_eval]


def _opening(max_number: int) -> Message:
    return {"role": "user", "content": f"guess 1-{max_number}"}


class GuessEnvironment(Environment):
    """One secret number; see the module docstring."""

    def __init__(self, sample: EnvSample, max_turns: int) -> None:
        super().__init__(sample)
        self.max_turns = max_turns
        self.turns = 0

    def reset(self) -> list[Message]:
        return [_opening(self.sample.data["max_number"])]

    def step(self, message: AssistantMessage) -> EnvStep:
        self.turns += 1
        found = re.findall(r"\d+", message.content)
        secret = self.sample.data["secret"]
        if found and int(found[-1]) == secret:
            reward = 1.0 - (self.turns - 1) / self.max_turns
            return EnvStep(done=True, reward=reward, success=True, info={"guesses": float(self.turns)})
        if self.turns >= self.max_turns:
            return EnvStep(done=True, reward=0.0, success=False, info={"guesses": float(self.turns)})
        if not found:
            return EnvStep([{"role": "user", "content": "a number"}])
        return EnvStep([{"role": "user", "content": "higher" if int(found[-1]) < secret else "lower"}])


def guess_demonstration(sample: EnvSample, cfg: GuessEnvConfig) -> list[Message]:
    """Binary search to the secret, as an ideal episode for the warm start."""
    lo, hi, secret = 1, cfg.max_number, sample.data["secret"]
    messages = [_opening(cfg.max_number)]
    while True:
        guess = (lo + hi) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return messages
        if guess < secret:
            lo = guess + 1
            messages.append({"role": "user", "content": "higher"})
        else:
            hi = guess - 1
            messages.append({"role": "user", "content": "lower"})
