"""The generation side of asynchronous GRPO: rollout workers, requests in flight, retries, weight pushes.

One request per prompt group. Requests go out as asyncio tasks bounded by `request_timeout_s`: one
call per group, or, to a worker with `generate_groups`, one call for all the groups that fit at that
moment, up to `max_groups_per_call` (they then enter the engine's batch together instead of one Ray
round trip apart; with room for more than one call, the next one is already queued at a worker that
runs its calls one at a time when the current one returns). A call's
completion callback hands the finished groups to the controller and sends out more work. Work goes
only to a worker that holds the latest published weights and has room (`max_in_flight_per_worker`
groups), and only while the groups in flight plus those held by the controller stay under the
outstanding cap. A worker gets new weights when it has no request in flight, so a request never sees
two versions; a worker with `loads_between_requests` gets them as soon as they are published and
loads them once its requests in flight finish. Meanwhile it may get requests for the new version,
which wait in the worker for the load: they are there when it is done, a round trip earlier.

Failures: a group that fails (an error result or `RolloutFailure`) is re-queued; a worker that times
out or is lost (`WorkerLostError`), or fails `max_consecutive_worker_errors` calls in a row, is
retired and all its in-flight groups are re-queued. Each re-queue spends one of the group's
`max_retries`. Fatal conditions (retry budget spent, too few workers) are stored in `fatal` for the
controller to raise.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.algorithms.async_grpo.config import AsyncGRPOConfig
from posttrain.algorithms.async_grpo.contracts import (
    AsyncGRPOError,
    NoRolloutWorkersError,
    RetryBudgetExhausted,
    WaitTimeout,
    bounded,
)
from posttrain.algorithms.async_grpo.ledger import BufferedGroup, GroupState, Ledger
from posttrain.algorithms.async_grpo.meters import BusyMeter, StepMeter
from posttrain.logging import get_logger
from posttrain.rollout.contracts import GroupResult, RolloutFailure, RolloutWorker, WorkerLostError
from posttrain.tasks.datasets import PromptCursor, PromptItem, RepeatCounter, as_repeat

log = get_logger(__name__)


@dataclass
class Request:
    """One prompt group to generate (kept across retries)."""

    group_id: int
    prompt_id: int
    retries: int = 0
    repeat: tuple[int, int] | None = None  # (weight version, earlier draws of the prompt at it)


@dataclass
class _Slot:
    """Controller-side state of one rollout worker."""

    index: int
    worker: RolloutWorker
    meter: BusyMeter
    started_at: float
    version: int | None = None  # weights it holds (None: not pushed yet)
    alive: bool = True
    reason: str = ""
    retired_at: float | None = None
    errors: int = 0
    in_flight: set[int] = field(default_factory=set)
    update: asyncio.Task | None = None
    updating_to: int | None = None  # the version `update` pushes

    @property
    def early(self) -> bool:
        """Whether the worker takes weights while requests run (`loads_between_requests`)."""
        return self.worker.loads_between_requests

    def request_version(self) -> int | None:
        """The weights a request sent to this worker now runs with (None: it takes none now). A worker
        that loads between requests takes requests for the version it is being pushed: they wait for
        the load."""
        if self.update is None:
            return self.version
        return self.updating_to if self.early else None


class RolloutPool:
    """Rollout workers and their requests; see the module docstring.

    `on_group(group)` receives every finished group; `held()` is how many groups the controller holds
    (buffered or in the open step), counted against the outstanding cap.
    """

    def __init__(
        self,
        cfg: AsyncGRPOConfig,
        dataset: Sequence[Any],
        cursor: PromptCursor,
        workers: Sequence[RolloutWorker],
        ledger: Ledger,
        meter: StepMeter,
        on_group: Callable[[BufferedGroup], None],
        held: Callable[[], int],
    ) -> None:
        if not workers:
            raise ValueError("asynchronous GRPO needs at least one rollout worker")
        for w in workers:
            if not isinstance(w, RolloutWorker):
                raise TypeError(
                    f"{type(w).__name__} is not a RolloutWorker: subclass posttrain.rollout.contracts."
                    "RolloutWorker (its capability flags have defaults there) or give it generate_group, "
                    "generate_groups, set_weights and the flags batches_groups, loads_between_requests, "
                    "serial_calls"
                )
        self.cfg = cfg
        self.dataset = dataset
        self.workers = list(workers)
        self.ledger = ledger
        self.meter = meter
        self.on_group = on_group
        self.held = held
        self.cursor = cursor
        self.repeats = RepeatCounter()  # a prompt drawn again at the same weights gets its own seed
        self.next_group_id = 0
        self.retry: deque[Request] = deque()
        self.in_flight: dict[int, tuple[_Slot, Request, asyncio.Task]] = {}
        self.slots: list[_Slot] = []
        self.published: tuple[int, Any] | None = None
        self.paused = True  # no dispatch until weights are published
        self.limit: int | None = None  # a lower outstanding cap while the controller settles
        self.stopping = False
        self.fatal: BaseException | None = None
        self.wake = asyncio.Event()

    # ------------------------------------------------------------------ controller-facing

    def start(self) -> None:
        self.stopping, self.fatal, self.paused = False, None, True
        self.wake = asyncio.Event()
        if not self.slots:
            now = self.meter.clock()
            self.slots = [_Slot(i, w, BusyMeter(self.meter.clock), now) for i, w in enumerate(self.workers)]
            for slot in self.slots:
                slot.version = self.published_version  # loaded before the run (`preloaded`), or None

    def preloaded(self, version: int, weights: Any) -> None:
        """Every worker already holds `weights` of `version` (loaded before the first `start`)."""
        if self.slots:
            raise RuntimeError("preloaded() must be called before the pool first starts")
        self.published = (version, weights)

    def publish(self, version: int, weights: Any) -> None:
        """New weights: idle workers load them; dispatch resumes."""
        self.published = (version, weights)
        self.paused = False
        self.changed()

    def pause(self) -> None:
        """No new requests until the next `publish` (between finish and the new weights going out)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.changed()

    @property
    def published_version(self) -> int | None:
        return self.published[0] if self.published is not None else None

    @property
    def cap(self) -> int:
        """Groups in flight plus those the controller holds stay under this."""
        cap = self.cfg.outstanding_cap
        return cap if self.limit is None else min(cap, self.limit)

    @property
    def has_work(self) -> bool:
        """Whether `fill` may still send requests (there are prompts to generate and it is not paused
        or stopped)."""
        live = not (self.paused or self.stopping) and self.fatal is None
        return live and bool(self.retry or not self.cursor.exhausted)

    @property
    def idle(self) -> bool:
        """Nothing in flight, nothing waiting for a retry, no data left."""
        return self.cursor.exhausted and not self.retry and not self.in_flight

    def alive(self) -> list[_Slot]:
        return [s for s in self.slots if s.alive]

    def dead_workers(self) -> dict[int, str]:
        return {s.index: s.reason for s in self.slots if not s.alive}

    def generation_time(self) -> tuple[float, float]:
        """(busy seconds, alive seconds) summed over all rollout workers so far."""
        now = self.meter.clock()
        busy = sum(s.meter.total(now) for s in self.slots)  # one clock reading: busy <= alive
        alive = sum((s.retired_at if s.retired_at is not None else now) - s.started_at for s in self.slots)
        return busy, alive

    def describe(self) -> str:
        return (
            f"in_flight={len(self.in_flight)}, retry_queue={len(self.retry)}, "
            f"alive workers={[s.index for s in self.alive()]}, "
            f"data epoch={self.cursor.epoch} position={self.cursor.position}"
        )

    def requests(self) -> list[Request]:
        """Every handed-out request not finished yet (waiting for a retry or in flight)."""
        return list(self.retry) + [req for _, req, _ in self.in_flight.values()]

    def restore(self, requests: list[Request]) -> None:
        for req in requests:
            self.ledger.move(req.group_id, GroupState.PENDING)
            self.retry.append(req)

    def changed(self) -> None:
        """Something finished: hand out more work and wake the trainer."""
        self.fill()
        self.wake.set()

    def set_fatal(self, err: BaseException) -> None:
        if self.fatal is None:
            log.error("async GRPO stops: %s", err)
            self.fatal = err
        self.wake.set()

    async def shutdown(self) -> None:
        """Cancel in-flight work (its groups go back to the queue, uncharged) within shutdown_timeout_s."""
        self.stopping = True
        tasks = []
        for group_id in sorted(self.in_flight):
            _, req, task = self._untrack(group_id)
            task.cancel()
            tasks.append(task)
            self.ledger.move(group_id, GroupState.PENDING)
            self.retry.append(req)
        for slot in self.slots:
            if slot.update is not None:
                slot.update.cancel()
                tasks.append(slot.update)
                slot.update, slot.updating_to = None, None
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.cfg.shutdown_timeout_s)
            if pending:
                log.warning("%d rollout call(s) ignored cancellation at shutdown", len(pending))
        self.retry = deque(sorted(self.retry, key=lambda r: r.group_id))

    # ------------------------------------------------------------------ dispatch

    def fill(self) -> None:
        """Send requests while there is work, room under the cap and a ready worker."""
        if self.stopping or self.fatal is not None:
            return
        for slot in self.alive():
            self._maybe_update(slot)
        while self.retry or not self.cursor.exhausted:
            alive = self.alive()
            if len(alive) < self.cfg.min_alive_workers:
                reasons = "; ".join(f"worker {i}: {r}" for i, r in self.dead_workers().items())
                self.set_fatal(
                    NoRolloutWorkersError(
                        f"{len(alive)} rollout worker(s) left (min_alive_workers={self.cfg.min_alive_workers}) "
                        f"with prompts still to generate. Lost: {reasons}"
                    )
                )
                return
            if self.paused or len(self.in_flight) + self.held() >= self.cap:
                return
            ready = [
                s
                for s in alive
                if s.request_version() == self.published_version
                and len(s.in_flight) < self.cfg.max_in_flight_per_worker
            ]
            if not ready:
                return
            slot = min(ready, key=lambda s: (len(s.in_flight), s.index))
            room = self.cap - len(self.in_flight) - self.held()
            room = -(-room // len(ready))  # an even share: one worker must not take all the work
            room = min(room, self.cfg.max_in_flight_per_worker - len(slot.in_flight))
            if self.cfg.max_groups_per_call is not None:
                room = min(room, self.cfg.max_groups_per_call)
            if not slot.worker.batches_groups:
                room = 1
            reqs = self._take_requests(room)
            if not reqs:
                return
            self._dispatch(slot, reqs)

    def _take_requests(self, n: int) -> list[Request]:
        """Up to `n` requests: retries first, then new prompts."""
        reqs: list[Request] = []
        while len(reqs) < n:
            req = self.retry.popleft() if self.retry else self._new_request()
            if req is None:
                break
            reqs.append(req)
        return reqs

    def _new_request(self) -> Request | None:
        index = self.cursor.next()
        if index is None:
            return None
        req = Request(self.next_group_id, index)
        self.next_group_id += 1
        return req

    def _dispatch(self, slot: _Slot, reqs: list[Request]) -> None:
        version = slot.request_version()
        assert version is not None
        prompts = [self._prompt(r, version) for r in reqs]
        task = asyncio.ensure_future(self._generate(slot, reqs, prompts, version, self._waits_s(slot)))
        for req in reqs:
            self.ledger.move(req.group_id, GroupState.IN_FLIGHT)
            self.in_flight[req.group_id] = (slot, req, task)
            slot.in_flight.add(req.group_id)
            slot.meter.start()
        ids = [r.group_id for r in reqs]
        task.add_done_callback(functools.partial(self._on_request_done, ids, version))

    def _waits_s(self, slot: _Slot) -> float:
        """The seconds a call sent to `slot` now may wait before its own work, added to its bound: for
        the weights loading there (weight_sync_timeout_s), and for the requests in flight there
        (request_timeout_s each) when it runs its calls one at a time or when that load waits for them."""
        waits = self.cfg.weight_sync_timeout_s if slot.update is not None else 0.0
        if slot.worker.serial_calls or slot.update is not None:
            waits += self.cfg.request_timeout_s * len(slot.in_flight)
        return waits

    def _prompt(self, req: Request, version: int) -> Any:
        """The prompt `req` sends at `version`: a PromptItem with its `repeat` at that version (kept
        by a retry at the same version, so it draws again identically); other prompts as they are."""
        item = self.dataset[req.prompt_id]
        if not isinstance(item, PromptItem):
            return item
        if req.repeat is None or req.repeat[0] != version:
            req.repeat = (version, self.repeats.next(item.prompt_id, version))
        return as_repeat(item, req.repeat[1])

    async def _generate(
        self, slot: _Slot, reqs: list[Request], prompts: list[Any], version: int, extra_s: float
    ) -> list[GroupResult]:
        # the worker's coroutine is made here, so a task cancelled before it starts leaves none unawaited
        groups = ", ".join(str(r.group_id) for r in reqs)
        what = f"rollout worker {slot.index} (group{'s' if len(reqs) > 1 else ''} {groups})"
        if len(reqs) == 1:
            call = slot.worker.generate_group(prompts[0], version)
            return [await bounded(call, self.cfg.request_timeout_s + extra_s, what)]
        call = slot.worker.generate_groups(prompts, version)
        # request_timeout_s bounds one group; a call carrying k groups may take up to k times as long
        return await bounded(call, self.cfg.request_timeout_s * len(reqs) + extra_s, what)

    def _untrack(self, group_id: int) -> tuple[_Slot, Request, asyncio.Task]:
        slot, req, task = self.in_flight.pop(group_id)
        slot.in_flight.discard(group_id)
        slot.meter.stop()
        return slot, req, task

    # ------------------------------------------------------------------ completions

    def _on_request_done(self, group_ids: list[int], version: int, task: asyncio.Task) -> None:
        live = []  # the call's groups still tracked (not abandoned since: worker retired, shutdown)
        for group_id in group_ids:
            entry = self.in_flight.get(group_id)
            if entry is not None and entry[2] is task:
                live.append(self._untrack(group_id))
        if not live:
            return
        slot = live[0][0]
        reqs = [req for _, req, _ in live]
        try:
            try:
                results = task.result()
            except asyncio.CancelledError:
                self._request_failed(slot, reqs, RolloutFailure("the request was cancelled"))
            except Exception as e:
                self._request_failed(slot, reqs, e)
            else:
                if not isinstance(results, list) or len(results) != len(group_ids):
                    raise AsyncGRPOError(
                        f"rollout worker {slot.index} answered generate_groups for {len(group_ids)} "
                        f"prompts with {type(results).__name__} {results!r:.80}; it must return a list "
                        "with one GroupResult per prompt, in order"
                    )
                by_id = dict(zip(group_ids, results))
                for req in reqs:
                    self._accept(slot, req, version, by_id[req.group_id])
        except Exception as e:  # a bug or a fatal condition: stop the run with it, keeping the groups
            for req in reqs:
                if self.ledger.states.get(req.group_id) == GroupState.IN_FLIGHT:
                    self.ledger.move(req.group_id, GroupState.PENDING)
                    self.retry.append(req)
            self.set_fatal(e)
        self.changed()

    def _accept(self, slot: _Slot, req: Request, version: int, result: GroupResult) -> None:
        if not isinstance(result, GroupResult):
            raise AsyncGRPOError(
                f"rollout worker {slot.index} returned {type(result).__name__}; generate_group must return "
                "a GroupResult"
            )
        slot.errors = 0
        if result.error is not None:
            self._requeue(req, f"worker {slot.index}: {result.error}")
            return
        if result.weight_version != version:
            raise AsyncGRPOError(
                f"rollout worker {slot.index} stamped group {req.group_id} with weight version "
                f"{result.weight_version} but was asked to generate it with {version}: its weights changed "
                "during the request"
            )
        self.meter.count("finished")
        self.meter.count("generated_samples", result.num_samples)
        self.on_group(
            BufferedGroup(
                req.group_id, req.prompt_id, version, 0, result.samples, result.num_samples, req.retries
            )
        )

    def _request_failed(self, slot: _Slot, reqs: list[Request], exc: BaseException) -> None:
        """A call failed as a whole: its groups are re-queued; the worker may be retired."""
        reason = f"worker {slot.index}: {type(exc).__name__}: {exc}"
        if isinstance(exc, (WaitTimeout, WorkerLostError)):
            self._retire(slot, reason)
        elif not isinstance(exc, RolloutFailure):
            slot.errors += 1
            if slot.errors >= self.cfg.max_consecutive_worker_errors:
                self._retire(slot, f"{slot.errors} request errors in a row, the last: {reason}")
        for req in reqs:
            self._requeue(req, reason)

    def _requeue(self, req: Request, reason: str) -> None:
        """Re-admit a group whose attempt failed, unless its retry budget is spent."""
        req.retries += 1
        if req.retries <= self.cfg.max_retries:
            log.warning("retrying group %d (attempt %d): %s", req.group_id, req.retries + 1, reason)
            self.meter.count("retried")
            self.ledger.move(req.group_id, GroupState.PENDING)
            self.retry.append(req)
            return
        self.ledger.move(req.group_id, GroupState.FAILED)
        self.meter.count("failed")
        msg = (
            f"group {req.group_id} (prompt {req.prompt_id}) failed {req.retries} times, more than "
            f"max_retries={self.cfg.max_retries}; last error: {reason}"
        )
        if self.cfg.on_retries_exhausted == "drop":
            log.warning("%s; dropped (on_retries_exhausted='drop')", msg)
            return
        self.set_fatal(
            RetryBudgetExhausted(
                f"{msg}. Fix the failing generation/reward, raise max_retries, or set "
                "on_retries_exhausted='drop' to skip such prompts"
            )
        )

    def _retire(self, slot: _Slot, reason: str) -> None:
        """Stop using a worker; its in-flight groups are re-queued."""
        if not slot.alive:
            return
        log.warning("rollout worker %d retired: %s", slot.index, reason)
        slot.alive, slot.reason, slot.retired_at = False, reason, self.meter.clock()
        for group_id in sorted(slot.in_flight):
            _, req, task = self._untrack(group_id)
            task.cancel()
            self._requeue(req, f"worker {slot.index} retired ({reason})")
        if slot.update is not None:
            slot.update.cancel()
            slot.update, slot.updating_to = None, None

    # ------------------------------------------------------------------ weight pushes

    def _maybe_update(self, slot: _Slot) -> None:
        """Push the published weights to a worker that lacks them: once it is idle, or at once to one
        that loads between requests (its wait for them counts against their own timeouts too)."""
        if self.published is None or slot.update is not None:
            return
        if slot.in_flight and not slot.early:
            return
        version, weights = self.published
        if slot.version == version:
            return
        timeout = self.cfg.weight_sync_timeout_s + self.cfg.request_timeout_s * len(slot.in_flight)
        slot.updating_to = version
        slot.update = asyncio.ensure_future(self._set_weights(slot, version, weights, timeout))
        slot.update.add_done_callback(functools.partial(self._on_update_done, slot, version))

    async def _set_weights(self, slot: _Slot, version: int, weights: Any, timeout: float) -> None:
        what = f"set_weights(version {version}) on rollout worker {slot.index}"
        await bounded(slot.worker.set_weights(version, weights), timeout, what)

    def _on_update_done(self, slot: _Slot, version: int, task: asyncio.Task) -> None:
        if slot.update is not task:
            return
        slot.update, slot.updating_to = None, None
        try:
            try:
                task.result()
            except (Exception, asyncio.CancelledError) as e:
                self._retire(slot, f"set_weights(version {version}) failed: {type(e).__name__}: {e}")
            else:
                slot.version = version
                self.meter.count("weight_pushes")
        except Exception as e:
            self.set_fatal(e)
        self.changed()
