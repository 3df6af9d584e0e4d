"""What the asynchronous GRPO controller needs from its parts: protocols, the group result, errors,
and the bounded wait every call to a part goes through.

The controller never looks inside a group's samples: a rollout worker returns them, the caller's
`prepare_group` hook turns them into a training batch. So the generation engine, the tasks and the
synchronous loop's helpers plug in without the controller importing them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from posttrain.algorithms.staleness import BufferedGroup
from posttrain.data.normalization import LossFn


class AsyncGRPOError(RuntimeError):
    """The asynchronous loop cannot continue; the message says why and what to change."""


class TrainerError(AsyncGRPOError):
    """A trainer call failed or timed out; the open step was aborted and its groups kept."""


class RetryBudgetExhausted(AsyncGRPOError):
    """A prompt group failed more than `max_retries` times (with `on_retries_exhausted='raise'`)."""


class NoRolloutWorkersError(AsyncGRPOError):
    """Fewer than `min_alive_workers` rollout workers are left while prompts still need generating."""


class RolloutFailure(RuntimeError):
    """One group's generation or reward failed; the group is retried, the worker is kept."""


class WorkerLostError(RuntimeError):
    """The rollout worker is gone (process died, actor killed); its in-flight groups are retried elsewhere."""


class WaitTimeout(TimeoutError):
    """A bounded wait of the controller expired (distinct from a TimeoutError raised by a worker itself)."""


async def bounded(aw: Awaitable[Any], timeout: float, what: str) -> Any:
    """Await `aw` for at most `timeout` seconds; raise WaitTimeout naming `what` (the work is cancelled)."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise WaitTimeout(f"{what} did not answer within {timeout}s")
    return task.result()


@dataclass
class GroupResult:
    """What a rollout worker returns for one prompt: all its completions, scored."""

    samples: Any  # opaque to the controller; handed to `prepare_group`
    weight_version: int  # the version the worker generated with (must equal the one it was sent)
    num_samples: int
    error: str | None = None  # a generation or reward failed: the group is retried, never trained


@runtime_checkable
class RolloutWorker(Protocol):
    """A generator of prompt groups. The controller never calls `set_weights` while a request is in flight,
    unless the worker has `loads_between_requests = True`: its `set_weights`, called while requests are
    in flight, waits for them to finish (they keep the version they were sent with), then loads. The
    controller sends it no request for the old version meanwhile, but may send requests for the new
    one: such a request must wait until that version is loaded (it may even arrive before the
    `set_weights` call) and fail (`RolloutFailure`) if the load fails. The new weights then travel
    while the last requests of the old version still run, and the next requests while they load.
    A worker with `serial_calls = True` runs its calls one after another (a synchronous Ray actor): the
    bound on a call then includes the calls sent to it before.

    A worker may also have `async generate_groups(prompts, weight_version) -> list[GroupResult]` (one
    result per prompt, in order; a group that fails alone is a result with `error` set, an exception
    fails the whole call). The controller then sends every group that fits in one call, so they can
    start generating together."""

    async def generate_group(self, prompt: Any, weight_version: int) -> GroupResult:
        """Generate and score all completions of `prompt` with the weights of `weight_version`."""
        ...

    async def set_weights(self, version: int, weights: Any) -> None:
        """Load weights `version` (`weights` is whatever the trainer's `export_weights` returned)."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """The split train step, as async calls; `version` counts finished optimizer steps."""

    @property
    def version(self) -> int: ...

    async def begin(self, loss_fn: LossFn) -> None:
        """Open a train step (Policy.begin_train_step)."""
        ...

    async def train_group(self, batch: Any) -> None:
        """Forward/backward one prepared group into the open step (Policy.train_microbatch)."""
        ...

    async def finish(self) -> dict[str, float]:
        """One optimizer step; `version` advances unless the trainer skipped the step (no valid tokens)."""
        ...

    async def abort(self) -> None:
        """Drop the open step; idempotent, `version` unchanged."""
        ...

    async def export_weights(self) -> Any:
        """A handle to the current weights for `RolloutWorker.set_weights` (None if workers pull them)."""
        ...


# (group, trainer_version) -> training batch, or None to filter the group out (e.g. zero advantages).
# Runs between trainer calls, so it may use the trainer (prev/reference logprobs).
PrepareGroup = Callable[[BufferedGroup, int], Awaitable[Any | None]]

# Called after every finished step with (step, metrics); may be async (e.g. to save a checkpoint).
OnStep = Callable[[int, dict[str, float]], Awaitable[None] | None]


@dataclass
class SamplesCodec:
    """Turns buffered samples into JSON values and back, so buffered groups survive a checkpoint.

    Without a codec, buffered groups are saved as prompts to regenerate.
    """

    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
