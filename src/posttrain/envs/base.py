"""The environment protocol: what a multi-turn episode is made of, seen from the environment's side.

An environment is created per trajectory from one dataset sample (`EnvSample`). `reset()` returns the
opening messages (system/user, in the OpenAI/Hugging Face chat form) and, optionally, the tools the
model may call; `step(message)` gets the model's reply as an `AssistantMessage` (its text and its
parsed tool calls) and returns the messages the model sees next (tool results, a user's reply), or the
end of the episode with its reward. Both may be plain or `async def` methods.

Environments know messages, never engines or token ids: the rollout layer (rollout/trajectory.py)
renders messages through the tokenizer's chat template, keeps the sampled tokens as they were
sampled, enforces the limits (`EnvLimits`) and marks a trajectory whose environment raised or timed
out as failed (excluded from advantages, never rewarded 0).

Writing one takes a class with `reset` and `step` (see the README, "Environments"); a user's class is
loaded by import path (`env: {name: custom, env_class: 'my_pkg.my_env:MyEnv', ...}`) and constructed
as `MyEnv(sample)` for every trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from posttrain.config import Config

Message = dict[str, Any]  # {"role": ..., "content": ...} (+ "tool_calls", "name", "tool_call_id")


@dataclass(frozen=True)
class EnvSample:
    """One dataset sample an environment is built from: its id (stable within its split) and its fields."""

    sample_id: int
    data: dict[str, Any]


@dataclass
class ToolCall:
    """One tool call the model made, parsed from its text. `error` is set when the call could not be
    parsed (malformed JSON, no name): the environment answers it with an error message."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    text: str = ""  # the call as the model wrote it

    def as_message_call(self) -> dict[str, Any]:
        """The call in the chat-template form ({"type": "function", "function": {...}})."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class AssistantMessage:
    """The model's reply in one turn: its text (tool-call markup included, end-of-turn token not), the
    tool calls parsed from it, and the token ids it was sampled as."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    truncated: bool = False  # the turn hit its token limit before the end-of-turn token

    def as_message(self) -> Message:
        """The reply as a chat message (for logging or an environment that keeps a transcript)."""
        out: Message = {"role": "assistant", "content": self.content}
        calls = [c.as_message_call() for c in self.tool_calls if c.error is None]
        if calls:
            out["tool_calls"] = calls
        return out


@dataclass
class EnvReset:
    """What `reset()` may return instead of a bare message list: the messages and the tools (typed
    callables or `Tool`s, rendered through the chat template's `tools=`)."""

    messages: list[Message]
    tools: list[Any] = field(default_factory=list)


@dataclass
class EnvStep:
    """What `step()` returns: the next messages, or `done` with the episode's reward.

    `turn_reward` (optional) is logged per turn; `success` (optional) says whether the episode solved
    its task (held-out accuracy; when None, a reward >= 1 counts as solved); `info` holds numeric
    metrics averaged over trajectories."""

    messages: list[Message] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    turn_reward: float | None = None
    success: bool | None = None
    info: dict[str, float] = field(default_factory=dict)


class Environment:
    """Base class of environments (subclassing is optional: any object with `reset` and `step` works).

    Override `reset` and `step` (plain or `async def`); `close` is called once the trajectory ends,
    however it ends."""

    def __init__(self, sample: EnvSample) -> None:
        self.sample = sample

    def reset(self) -> list[Message] | EnvReset:
        raise NotImplementedError("an Environment subclass implements reset()")

    def step(self, message: AssistantMessage) -> EnvStep:
        raise NotImplementedError("an Environment subclass implements step()")

    def close(self) -> None:
        """Release what the episode holds (processes, files); called once, also after a failure."""


class EnvLimits(Config):
    """Bounds on one trajectory, enforced by the rollout layer."""

    max_turns: int = Field(4, ge=1, description="assistant turns per trajectory; the episode is cut after it")
    max_tokens: int = Field(
        1024, ge=8, description="tokens per trajectory (prompt, replies and observations); cut after it"
    )
    max_tokens_per_turn: int | None = Field(
        None, ge=1, description="tokens per assistant turn (None: sampling.max_new_tokens)"
    )
    step_timeout_s: float = Field(
        30.0, gt=0, description="bound on one reset() or step() call; past it the trajectory is failed"
    )
    truncated_reward: float = Field(
        0.0, description="reward of an episode cut by max_turns or max_tokens (it did not finish: a real 0)"
    )


class EnvConfigBase(Config):
    """Fields every environment config shares."""

    seed: int = Field(0, description="seed of the sample generation and the train/eval split")
    limits: EnvLimits = Field(default_factory=EnvLimits)
    tool_parser: str = Field(
        "hermes",
        description="how tool calls are read from the model's text: hermes = <tool_call>{json}</tool_call> "
        "(Hermes, Qwen2.5/3), or your parser 'package.module:function' (text -> list[ToolCall])",
    )
    system_prompt: str | None = Field(None, description="system message prepended to every episode")
