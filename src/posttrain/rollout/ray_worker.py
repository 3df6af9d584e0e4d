"""Rollout workers in Ray actors: `RayRolloutWorker` is the controller-facing side of any actor with the
rollout-worker methods, `EngineRolloutActor` the body of one engine actor, `start_ray_workers` starts
them. Ray is imported only when a Ray worker is used.

`RayRolloutWorker` awaits its object refs with asyncio (not `ray.wait`, which does not reliably see
cross-process readiness from inside a running event loop); the caller bounds every await. A dead actor
becomes `WorkerLostError` (the worker is retired, its groups retried elsewhere); a `RolloutFailure`
raised inside the actor stays one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from posttrain.generation.payload import WeightsPayload
from posttrain.logging import get_logger
from posttrain.rollout.config import RolloutConfig, RolloutWorkerConfig
from posttrain.rollout.contracts import GroupResult, RolloutFailure, RolloutWorker, WorkerLostError
from posttrain.rollout.engine_worker import EngineRolloutWorker, only_group
from posttrain.tasks.datasets import PromptItem

log = get_logger(__name__)


class RayRolloutWorker(RolloutWorker):
    """A `RolloutWorker` over a Ray actor that has `generate_group(prompt, weight_version)` and
    `set_weights(version, weights)` methods (sync or async) with the same meaning, and
    `generate_groups(prompts, weight_version)` when `batches_groups` (the actor has it).

    Under Ray, `weights` should be an ObjectRef (one `ray.put` for all workers), which Ray resolves
    before the actor's method runs.
    """

    def __init__(
        self,
        actor: Any,
        name: str = "",
        loads_between_requests: bool = False,
        serial_calls: bool = False,
        batches_groups: bool = False,
    ) -> None:
        self.actor = actor
        self.name = name or repr(actor)
        self.loads_between_requests = loads_between_requests  # true of the actor's set_weights
        self.serial_calls = serial_calls  # a synchronous actor: a call waits for those sent before it
        self.batches_groups = batches_groups  # the actor has generate_groups

    async def generate_group(self, prompt: Any, weight_version: int) -> GroupResult:
        return await self._await(self.actor.generate_group.remote(prompt, weight_version), "generate_group")

    async def generate_groups(self, prompts: list[Any], weight_version: int) -> list[GroupResult]:
        ref = self.actor.generate_groups.remote(prompts, weight_version)
        return await self._await(ref, "generate_groups")

    async def set_weights(self, version: int, weights: Any) -> None:
        await self._await(self.actor.set_weights.remote(version, weights), "set_weights")

    async def _await(self, ref: Any, what: str) -> Any:
        import ray

        try:
            return await ref
        except asyncio.CancelledError:
            try:
                ray.cancel(ref)
            except Exception as e:  # best effort: the controller has already moved on
                log.debug("ray.cancel(%s) failed: %s", what, e)
            raise
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, (RolloutFailure, WorkerLostError)):
                raise cause from e
            raise
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.WorkerCrashedError,
            ray.exceptions.NodeDiedError,
            ray.exceptions.ObjectLostError,
        ) as e:
            raise WorkerLostError(f"{self.name}.{what}: the Ray actor is gone ({type(e).__name__})") from e


class EngineRolloutActor:
    """The body of a Ray rollout actor: one `EngineRolloutWorker` (one engine) per actor process.

    A synchronous actor: Ray runs its calls one at a time in the order the controller sent them (one
    submitter, no task retries), on the actor's main thread, where the engine steps. So a
    `set_weights` sent while a call generates runs right after it, and the calls sent after it run
    on the new weights, without a round trip in between (`loads_between_requests`); and no event
    loop or thread hand-off costs the actor CPU per call. Weights arrive as an ObjectRef of a
    `WeightsPayload` (Ray resolves it before `set_weights` runs)."""

    def __init__(self, cfg: RolloutWorkerConfig, name: str, torch_threads: int | None = None) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.worker = EngineRolloutWorker.build(cfg, name)

    def ready(self) -> str:
        return self.worker.name

    def generate_group(self, prompt: PromptItem, weight_version: int) -> GroupResult:
        return only_group(self.worker.generate_groups_blocking([prompt], weight_version))

    def generate_groups(self, prompts: list[PromptItem], weight_version: int) -> list[GroupResult]:
        return self.worker.generate_groups_blocking(prompts, weight_version)

    def set_weights(self, version: int, weights: WeightsPayload) -> None:
        self.worker.set_weights_blocking(version, weights)


def start_ray_workers(
    cfg: RolloutWorkerConfig, rollout: RolloutConfig
) -> tuple[list[RayRolloutWorker], list[Any]]:
    """Start `rollout.num_workers` actors; wait (bounded) until each has built its engine.

    Returns the controller-facing workers and the actor handles (to kill them at the end)."""
    from posttrain.parallel.cluster import ensure_ray

    ray = ensure_ray(rollout.ray_address)
    # no task retries: they would void Ray's in-order execution of a synchronous actor's calls
    opts = {
        "num_cpus": rollout.num_cpus_per_worker,
        "num_gpus": rollout.num_gpus_per_worker,
        "max_task_retries": 0,
    }
    actor_cls = ray.remote(**opts)(EngineRolloutActor)
    names = [f"rollout-{i}" for i in range(rollout.num_workers)]
    actors = [actor_cls.remote(cfg, name, rollout.torch_threads) for name in names]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=rollout.timeout_s)
    except BaseException as e:  # one actor died building its engine, the wait timed out, Ctrl-C...
        for a in actors:  # the caller gets no handles: the actors that did start die here
            ray.kill(a)
        if not isinstance(e, ray.exceptions.GetTimeoutError):
            raise
        raise TimeoutError(
            f"the rollout actors did not start within rollout.timeout_s={rollout.timeout_s}s "
            "(not enough free CPUs/GPUs in the Ray cluster for rollout.num_cpus_per_worker?)"
        ) from None
    workers = [
        RayRolloutWorker(a, n, loads_between_requests=True, serial_calls=True, batches_groups=True)
        for a, n in zip(actors, names)
    ]
    return workers, actors
