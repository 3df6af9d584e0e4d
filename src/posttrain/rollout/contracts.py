"""The rollout-worker contract: what a worker returns for a prompt group, how it fails, and the typed
protocol both loops (and any user-written worker) follow.

A rollout worker generates and scores prompt groups with the weights of one version. The synchronous
loop drives an engine directly through the same helpers (rollout/groups.py); the asynchronous loop
talks to workers only through this protocol, in this process (`EngineRolloutWorker`) or in a Ray actor
(`RayRolloutWorker`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class RolloutFailure(RuntimeError):
    """One group's generation or reward failed; the group is retried, the worker is kept."""


class WorkerLostError(RuntimeError):
    """The rollout worker is gone (process died, actor killed); its in-flight groups are retried elsewhere."""


@dataclass
class GroupResult:
    """What a rollout worker returns for one prompt: all its completions, scored."""

    samples: Any  # opaque to the controller; handed to its `prepare_group` hook
    weight_version: int  # the version the worker generated with (must equal the one it was sent)
    num_samples: int
    error: str | None = None  # a generation or reward failed: the group is retried, never trained


@runtime_checkable
class RolloutWorker(Protocol):
    """A generator of prompt groups. Subclass it (the capability flags have defaults here) or provide
    the same attributes and methods.

    Capabilities, declared rather than probed:
    - `batches_groups`: `generate_groups` takes several prompts in one call (they then share the
      engine's batch); without it the caller sends one prompt per call.
    - `loads_between_requests`: `set_weights` may be called while requests are in flight; it waits
      for them (they keep the version they were sent with), then loads. Requests for the new version
      may arrive before the load and must wait for it (and fail with `RolloutFailure` if it fails).
      Without it, the caller never calls `set_weights` while a request is in flight.
    - `serial_calls`: the worker runs its calls one after another (a synchronous Ray actor), so the
      bound on a call includes the calls sent to it before.
    """

    batches_groups: bool = False
    loads_between_requests: bool = False
    serial_calls: bool = False

    async def generate_group(self, prompt: Any, weight_version: int) -> GroupResult:
        """Generate and score all completions of `prompt` with the weights of `weight_version`."""
        ...

    async def generate_groups(self, prompts: list[Any], weight_version: int) -> list[GroupResult]:
        """One result per prompt, in order (only called when `batches_groups`); a group that fails
        alone is a result with `error` set, an exception fails the whole call."""
        ...

    async def set_weights(self, version: int, weights: Any) -> None:
        """Load weights `version` (`weights` is whatever the trainer's `export_weights` returned)."""
        ...


@dataclass
class SamplesCodec:
    """Turns buffered samples into JSON values and back, so buffered groups survive a checkpoint.

    Without a codec, buffered groups are saved as prompts to regenerate.
    """

    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
