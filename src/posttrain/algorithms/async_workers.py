"""Adapters that plug the real parts into the asynchronous GRPO controller (async_grpo.py).

- `RayRolloutWorker`: a rollout worker living in a Ray actor. Its object refs are awaited with
  asyncio (not `ray.wait`, which does not reliably see cross-process readiness from inside a running
  event loop); the controller bounds every await. A dead actor becomes `WorkerLostError` (the worker
  is retired, its groups retried elsewhere); a `RolloutFailure` raised inside the actor stays one.
- `PolicyTrainer`: the driver-side `Policy` as the controller's `Trainer`. Policy verbs block, so they
  run one at a time on a daemon thread (`SerialThread`): the event loop stays free to stream rollouts,
  calls never interleave on the Policy, and a hung call cannot block interpreter exit. The version is
  read back from the ranks after every finish (the Policy is the source of truth; a skipped step
  leaves it unchanged).
- `policy_prepare_group`: the `prepare_group` hook for a real run: the caller's `to_batch` (rewards ->
  advantages -> batch, from the synchronous loop's helpers), then prev and reference logprobs from the
  Policy, on the same thread and at the version the group is trained at.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from posttrain.algorithms.async_types import GroupResult, PrepareGroup, RolloutFailure, WorkerLostError
from posttrain.algorithms.staleness import BufferedGroup
from posttrain.data.normalization import LossFn
from posttrain.logging import get_logger

log = get_logger(__name__)


def _deliver(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.cancelled():
        return  # the caller gave up (timeout); the result is dropped
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class _Server:
    """A daemon thread that runs the calls of one `SerialThread` at a time. When that closes, the
    thread parks (`_PARKED`) and the next `SerialThread` reuses it: a fresh thread starts cold (on the
    2-core benchmark machine its first training step took 50-100 ms more CPU, mostly page faults while
    its malloc arena grew), which a process that trains more than once (tests, sweeps, benchmarks)
    then pays once."""

    def __init__(self, name: str) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is not None:
                self._run(*item)
                item = None  # a parked thread must not keep the last call's arguments alive
                continue
            with _PARKED_LOCK:  # its SerialThread closed; every call before that has run
                if len(_PARKED) >= _MAX_PARKED:
                    return
                _PARKED.append(self)

    @staticmethod
    def _run(
        fn: Callable[..., Any], args: tuple, fut: asyncio.Future, loop: asyncio.AbstractEventLoop
    ) -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(_deliver, fut, ok, value)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


_PARKED: list[_Server] = []  # idle server threads, most recently parked last
_PARKED_LOCK = threading.Lock()
_MAX_PARKED = 2


class SerialThread:
    """Runs blocking calls one at a time on one daemon thread and awaits them from asyncio (the thread
    is reused after `close`, see `_Server`)."""

    def __init__(self, name: str) -> None:
        with _PARKED_LOCK:
            server = _PARKED.pop() if _PARKED else None
        if server is None:
            server = _Server(name)
        server.thread.name = name
        self._server = server
        self._closed = False
        self._busy = 0.0  # seconds spent in finished calls (time.monotonic)
        self._since: float | None = None  # start of the call running now
        self._busy_lock = threading.Lock()

    def busy_seconds(self) -> float:
        """Seconds the thread has spent running this SerialThread's calls so far."""
        with self._busy_lock:
            running = time.monotonic() - self._since if self._since is not None else 0.0
            return self._busy + running

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._busy_lock:
            self._since = time.monotonic()
        try:
            return fn(*args)
        finally:
            with self._busy_lock:
                assert self._since is not None
                self._busy += time.monotonic() - self._since
                self._since = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Queue `fn(*args)` to run on the thread after every call submitted before it; the returned
        future (of the running event loop) gets its result or exception. Cancelling the future does
        not stop the call, it only drops the result."""
        if self._closed or not self._server.thread.is_alive():
            raise RuntimeError("SerialThread is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._server.queue.put((self._timed, (fn, *args), fut, loop))
        return fut

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the thread, after every call submitted before it."""
        return await self.submit(fn, *args)

    def close(self) -> None:
        """Stop taking calls; the thread parks after the calls already queued (not waited for)."""
        if not self._closed:
            self._closed = True
            self._server.queue.put(None)


class RayRolloutWorker:
    """A `RolloutWorker` over a Ray actor that has `generate_group(prompt, weight_version)` and
    `set_weights(version, weights)` methods (sync or async) with the same meaning, and
    `generate_groups(prompts, weight_version)` when the actor has it.

    Under Ray, `weights` should be an ObjectRef (one `ray.put` for all workers), which Ray resolves
    before the actor's method runs.
    """

    def __init__(
        self, actor: Any, name: str = "", loads_between_requests: bool = False, serial_calls: bool = False
    ) -> None:
        self.actor = actor
        self.name = name or repr(actor)
        self.loads_between_requests = loads_between_requests  # true of the actor's set_weights
        self.serial_calls = serial_calls  # a synchronous actor: a call waits for those sent before it
        if hasattr(actor, "generate_groups"):  # the controller batches only what the actor can take
            self.generate_groups = self._generate_groups

    async def generate_group(self, prompt: Any, weight_version: int) -> GroupResult:
        return await self._await(self.actor.generate_group.remote(prompt, weight_version), "generate_group")

    async def _generate_groups(self, prompts: list[Any], weight_version: int) -> list[GroupResult]:
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


class PolicyTrainer:
    """The driver-side `Policy` (split train step) as the controller's `Trainer`.

    `export_fn` returns the weights handle given to every rollout worker's `set_weights` after a step
    (e.g. `lambda: ray.put(policy.full_state_dict())`); None when the engine pulls weights itself.
    """

    def __init__(self, policy: Any, export_fn: Callable[[], Any] | None = None) -> None:
        self.policy = policy
        self.export_fn = export_fn
        self._thread = SerialThread("posttrain-policy")
        self._version = self._read_version()

    @property
    def version(self) -> int:
        return self._version

    def _read_version(self) -> int:
        versions = {int(s["trainer_version"]) for s in self.policy.get_states()}
        if len(versions) != 1:
            raise RuntimeError(f"the policy ranks disagree on trainer_version: {sorted(versions)}")
        return versions.pop()

    def busy_seconds(self) -> float:
        """Seconds the policy thread has spent working (the controller's trainer idle is the rest)."""
        return self._thread.busy_seconds()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Any blocking call, serialized with the Policy verbs."""
        return await self._thread.call(fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Queue a blocking call behind the Policy verbs already queued, without waiting for it."""
        return self._thread.submit(fn, *args)

    def _begin(self, loss_fn: LossFn) -> None:
        self.policy.prepare_for_training()  # idempotent; a weight export may have left it in INFERENCE
        self.policy.begin_train_step(loss_fn)

    async def begin(self, loss_fn: LossFn) -> None:
        await self.call(self._begin, loss_fn)

    async def train_group(self, batch: Any) -> None:
        await self.call(self.policy.train_microbatch, batch)

    async def finish(self) -> dict[str, float]:
        metrics = await self.call(self.policy.finish_train_step)
        self._version = await self.call(self._read_version)
        return metrics

    async def abort(self) -> None:
        await self.call(self.policy.abort_train_step)

    async def export_weights(self) -> Any:
        return await self.call(self.export_fn) if self.export_fn is not None else None

    def add_logprobs(self, batch: Any, reference: bool, prev: bool = True) -> Any:
        """Blocking: fill `prev_logprobs` (and `reference_logprobs`) of `batch` from the Policy.

        `prev=False` skips the prev-logprob forward, for a loss that takes them from its own training
        forward (ClippedPGConfig.force_on_policy_ratio: the open step is one optimizer step, so they
        are the same)."""
        if prev:
            batch["prev_logprobs"] = self.policy.get_logprobs(batch)
        if reference:
            batch["reference_logprobs"] = self.policy.get_reference_policy_logprobs(batch)
        elif "reference_logprobs" not in batch.keys():  # no reference model: prev stands in
            stand_in = batch["prev_logprobs"] if prev else batch["generation_logprobs"]
            batch["reference_logprobs"] = stand_in.clone()
        return batch

    def close(self) -> None:
        self._thread.close()


def policy_prepare_group(
    trainer: PolicyTrainer, to_batch: Callable[[BufferedGroup], Any], reference: bool = True
) -> PrepareGroup:
    """A `prepare_group` hook: `to_batch(group)` (None filters the group), then the Policy's logprobs.

    `reference=False` skips the reference model (no KL term) and copies prev_logprobs in its place.
    """

    def prepare_blocking(group: BufferedGroup, trainer_version: int) -> Any:
        if trainer.version != trainer_version:
            raise RuntimeError(
                f"group {group.group_id} is prepared for version {trainer_version} but the policy is at "
                f"{trainer.version}"
            )
        batch = to_batch(group)
        return None if batch is None else trainer.add_logprobs(batch, reference)

    async def prepare(group: BufferedGroup, trainer_version: int) -> Any:
        return await trainer.call(prepare_blocking, group, trainer_version)

    return prepare
