"""What the asynchronous GRPO controller needs from its trainer and its caller: the trainer protocol,
the hooks, the errors, and the bounded wait every call to a part goes through.

The rollout-worker side of the contract (GroupResult, RolloutWorker, RolloutFailure, WorkerLostError)
lives in rollout/contracts.py, shared with the synchronous loop. The controller never looks inside a
group's samples: a rollout worker returns them, the caller's `prepare_group` hook turns them into a
training batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from posttrain.algorithms.async_grpo.ledger import BufferedGroup
from posttrain.data.normalization import LossFn


class AsyncGRPOError(RuntimeError):
    """The asynchronous loop cannot continue; the message says why and what to change."""


class TrainerError(AsyncGRPOError):
    """A trainer call failed or timed out; the open step was aborted and its groups kept."""


class RetryBudgetExhausted(AsyncGRPOError):
    """A prompt group failed more than `max_retries` times (with `on_retries_exhausted='raise'`)."""


class NoRolloutWorkersError(AsyncGRPOError):
    """Fewer than `min_alive_workers` rollout workers are left while prompts still need generating."""


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


@runtime_checkable
class Trainer(Protocol):
    """The split train step, as async calls; `version` counts finished optimizer steps.

    Optional capabilities, declared with defaults here (subclass to inherit them):
    - `queued_calls`: calls a finish or abort waits for first (a trainer that trains groups while the
      controller goes on); the bound on a trainer call grows by trainer_timeout_s for each;
    - `busy_seconds()`: seconds spent working so far (monotonic clock), or None when unknown; the
      trainer-idle metric is then the rest of the step's time, else the time spent waiting for groups.
    """

    queued_calls: int = 0

    def busy_seconds(self) -> float | None:
        return None

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
        """Drop the open step; idempotent. A finish that outlived its bound but completed before the abort
        ran is not undone: `version` then counts its step (the controller marks its groups trained)."""
        ...

    async def export_weights(self) -> Any:
        """A handle to the current weights for `RolloutWorker.set_weights` (None if workers pull them)."""
        ...


# (group, trainer_version) -> training batch, or None to filter the group out (e.g. zero advantages).
# Runs between trainer calls, so it may use the trainer (prev/reference logprobs).
PrepareGroup = Callable[[BufferedGroup, int], Awaitable[Any | None]]

# Called after every finished step with (step, metrics); may be async (e.g. to save a checkpoint).
OnStep = Callable[[int, dict[str, float]], Awaitable[None] | None]
