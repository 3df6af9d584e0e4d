"""Multi-turn trajectories: an environment and the engine taking turns, recorded token-exactly.

One trajectory: `env.reset()` gives the opening messages (rendered once, rollout/chat.py), then per
turn the engine samples a reply (continuing the trajectory's KV cache: only the new tokens are
prefilled, generation/sessions), the reply's tool calls are parsed, `env.step(reply)` answers with new
messages (appended as the ids of those messages only) or ends the episode with its reward. The
trainer then trains exactly the sampled ids with the engine's logprobs: the trajectory is one row,
`mask` is 1 on sampled tokens only, observation tokens are context.

Limits (`EnvLimits`): a trajectory past `max_turns` replies or `max_tokens` tokens is cut (finish
reason "length", reward `truncated_reward`); an environment call that raises or runs past
`step_timeout_s` fails the trajectory: it is counted and excluded from advantages, never rewarded 0.
So does an environment that answers wrongly (a step neither done nor with messages, messages that are
not dicts with a role or that the chat template cannot render) and an opening that already fills
`max_tokens` (no reply could be sampled: that one is logged too, as a sign `max_tokens` is too low).
A plain (non-async) environment method runs on a daemon thread (as plain tools do), so one that never
returns cannot hold up the step, the event loop's shutdown or the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.envs.base import AssistantMessage, EnvReset, EnvSample, EnvStep
from posttrain.envs.build import EnvSuite
from posttrain.envs.sandbox import SandboxUnavailableError
from posttrain.envs.tools import as_tools, daemon_call
from posttrain.generation.params import GenerationResult, SamplingParams
from posttrain.generation.sampler import derive_seed
from posttrain.logging import get_logger
from posttrain.rollout.chat import ChatRenderer

log = get_logger(__name__)

_TURN = 4  # seed purpose tag (rollout/groups.py uses 1-3)
_sessions = itertools.count()
_TOO_LONG = (
    "the opening messages take {} tokens and env.limits.max_tokens={} leaves no room for a reply; raise "
    "env.limits.max_tokens (or shorten the environment's opening)"
)


@dataclass
class Turn:
    """One reply: where it sits in the trajectory's `token_ids`, and the weights that sampled it."""

    start: int
    end: int
    weight_version: int
    num_tool_calls: int = 0


@dataclass
class Trajectory:
    """A finished multi-turn episode as one training row: `prompt_token_ids` (the opening) then
    `token_ids` (replies and observations, in order), `logprobs` and `mask` aligned with `token_ids`
    (the engine's logprob and 1 on sampled tokens; 0 and 0 on observation tokens)."""

    sample_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float = math.nan
    failed: bool = False
    error: str | None = None
    success: bool | None = None
    finish_reason: Literal["stop", "length"] = "stop"
    info: dict[str, float] = field(default_factory=dict)

    @property
    def weight_version(self) -> int:
        """The version of the oldest weights that sampled a reply (staleness counts from it)."""
        return min((t.weight_version for t in self.turns), default=-1)

    @property
    def num_tool_calls(self) -> int:
        return sum(t.num_tool_calls for t in self.turns)

    def _extend(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.token_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)

    def solved(self) -> bool:
        """Whether the episode solved its task: the environment's `success`, else reward >= 1."""
        if self.failed:
            return False
        return bool(self.success) if self.success is not None else self.reward >= 1.0


class EnvFailure(RuntimeError):
    """The environment raised or timed out: the trajectory is failed (never rewarded 0)."""


async def env_call(fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
    """Call an environment method (plain or async) within `timeout` seconds; EnvFailure otherwise,
    except for `SandboxUnavailableError` (this machine cannot run the environment's sandbox as
    configured: every trajectory would fail), which is raised as it is and stops the run."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args), timeout)
        result = await asyncio.wait_for(daemon_call(fn, *args), timeout)
        if inspect.isawaitable(result):
            result = await asyncio.wait_for(result, timeout)
        return result
    except TimeoutError as e:
        raise EnvFailure(f"{what} timed out after {timeout:g} s (EnvLimits.step_timeout_s)") from e
    except SandboxUnavailableError:
        raise
    except Exception as e:
        raise EnvFailure(f"{what} raised {type(e).__name__}: {e}") from e


def opening(reset: Any, system_prompt: str | None) -> tuple[list[dict], list[dict]]:
    """The opening messages and tool schemas of a reset() result."""
    if isinstance(reset, EnvReset):
        messages, tools = list(reset.messages), as_tools(reset.tools)
    elif isinstance(reset, list):
        messages, tools = list(reset), []
    else:
        raise EnvFailure(f"reset() must return a list of messages or an EnvReset, got {type(reset).__name__}")
    _check_messages(messages, "reset()")
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages, [t.schema for t in tools]


def _check_step(result: Any) -> EnvStep:
    if not isinstance(result, EnvStep):
        raise EnvFailure(f"step() must return an EnvStep, got {type(result).__name__}")
    if result.done:
        if result.reward is None or not math.isfinite(result.reward):
            raise EnvFailure(f"step() ended the episode with reward {result.reward!r}; give a finite number")
        return result
    if not result.messages:
        raise EnvFailure(
            "step() returned no messages and did not end the episode; return the messages the model sees "
            "next, or EnvStep(done=True, reward=...)"
        )
    _check_messages(result.messages, "step()")
    return result


def _check_messages(messages: Any, what: str) -> None:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise EnvFailure(
            f"{what} must give its messages as a list of dicts with a 'role' and a 'content', got {messages!r:.200}"
        )


def _render(render: Callable[[list[dict]], list[int]], messages: list[dict], what: str) -> list[int]:
    """`render(messages)` (the chat template), a failure of `what`'s messages failing the trajectory."""
    try:
        return render(messages)
    except Exception as e:
        raise EnvFailure(
            f"the chat template could not render the messages of {what}: {type(e).__name__}: {e}"
        ) from e


async def run_trajectory(
    engine: Any,
    tokenizer: Any,
    spec: EnvSuite,
    sample: EnvSample,
    sampling: SamplingParams,
    seed: int,
    stream: int = 0,
) -> Trajectory:
    """Play one episode of `spec`'s environment on `sample` (see the module docstring). Reply k of
    the episode draws from stream `stream` of a seed derived from (`seed`, k)."""
    limits = spec.limits
    env = None
    traj = Trajectory(sample.sample_id, [])
    session = ("trajectory", next(_sessions))
    try:
        env = spec.make_env(sample)
        reset = await env_call(env.reset, timeout=limits.step_timeout_s, what="reset()")
        messages, tools = opening(reset, spec.system_prompt)
        chat = ChatRenderer(tokenizer, tools)
        prompt = _render(chat.prompt, messages, "reset()")
        if len(prompt) >= limits.max_tokens:  # its row would be longer than the limit: not kept
            problem = _TOO_LONG.format(len(prompt), limits.max_tokens)
            log.warning("environment %r, sample %d: %s", spec.name, sample.sample_id, problem)
            raise EnvFailure(problem)
        traj.prompt_token_ids = prompt
        await _play(engine, tokenizer, spec, env, chat, traj, sampling, seed, stream, session)
    except EnvFailure as e:
        traj.failed, traj.error, traj.reward = True, str(e), math.nan
        if not traj.prompt_token_ids:  # failed before its opening: one masked token keeps its row valid
            traj.prompt_token_ids = [tokenizer.eos_token_id or 0]
    finally:
        engine.end_session(session)
        if env is not None and hasattr(env, "close"):
            try:
                await env_call(env.close, timeout=limits.step_timeout_s, what="close()")
            except EnvFailure as e:
                log.warning("environment of sample %d: %s", sample.sample_id, e)
    return traj


async def _play(
    engine: Any,
    tokenizer: Any,
    spec: EnvSuite,
    env: Any,
    chat: ChatRenderer,
    traj: Trajectory,
    sampling: SamplingParams,
    seed: int,
    stream: int,
    session: Any,
) -> None:
    limits = spec.limits
    per_turn = limits.max_tokens_per_turn or sampling.max_new_tokens
    stops = sorted({*sampling.stop_token_ids, chat.end_of_turn})
    for k in range(limits.max_turns):
        ids = traj.prompt_token_ids + traj.token_ids
        room = min(per_turn, limits.max_tokens - len(ids))
        if room <= 0:
            break
        params = sampling.model_copy(
            update={"max_new_tokens": room, "stop_token_ids": stops, "seed": derive_seed(seed, _TURN, k)}
        )
        res: GenerationResult = await engine.agenerate(ids, params, stream_index=stream, session=session)
        reply = _reply(tokenizer, spec, res, chat.end_of_turn)
        start = len(traj.token_ids)
        traj._extend(list(res.token_ids), list(res.logprobs))
        turn = Turn(start, len(traj.token_ids), res.weight_version, len(reply.tool_calls))
        traj.turns.append(turn)
        if reply.truncated:
            break  # the reply did not end: the episode is cut here
        out = _check_step(await env_call(env.step, reply, timeout=limits.step_timeout_s, what="step()"))
        if out.turn_reward is not None:
            traj.info[f"turn_reward_{k}"] = float(out.turn_reward)
        if out.done:
            traj.reward, traj.success, traj.finish_reason = float(out.reward), out.success, "stop"
            traj.info.update({k2: float(v) for k2, v in out.info.items()})
            return
        obs = _render(chat.observation, out.messages, "step()")
        if res.token_ids[-1] != chat.end_of_turn:  # ended by another stop (e.g. </tool_call>): close it
            obs = [chat.end_of_turn, *obs]
        if len(traj.prompt_token_ids) + len(traj.token_ids) + len(obs) >= limits.max_tokens:
            break
        traj._extend(obs, None)
    traj.reward, traj.finish_reason = limits.truncated_reward, "length"


def _reply(tokenizer: Any, spec: EnvSuite, res: GenerationResult, end_of_turn: int) -> AssistantMessage:
    """The sampled reply as a message: its text without the closing token, and its parsed calls. A
    reply ended by another stop token or string (`sampling.stop_token_ids`, e.g. `</tool_call>`) is
    complete too: the closing token is then appended as context (not trained) before the next
    messages. A reply cut by its token limit is `truncated`."""
    ids = list(res.token_ids)
    closed = res.finish_reason == "stop" and bool(ids) and ids[-1] == end_of_turn
    text = tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=False)
    return AssistantMessage(
        content=text,
        tool_calls=spec.parse_tool_calls(text),
        token_ids=ids,
        truncated=res.finish_reason != "stop" or not ids,
    )


async def run_group(
    engine: Any,
    tokenizer: Any,
    spec: EnvSuite,
    sample: EnvSample,
    group_size: int,
    sampling: SamplingParams,
    seed: int,
    first_stream: int = 0,
) -> list[Trajectory]:
    """`group_size` trajectories of one sample, played concurrently (they share the engine's batch);
    trajectory k draws from stream `first_stream + k` of `seed`."""
    runs = (
        run_trajectory(engine, tokenizer, spec, sample, sampling, seed, first_stream + k)
        for k in range(group_size)
    )
    return list(await asyncio.gather(*runs))
