"""The asyncio side of the generation engine: one background stepping thread and the futures it resolves.

`agenerate()` / `agenerate_all()` / `astream()` queue requests and await futures; a stepping thread runs
the engine's steps while there is work, so the event loop stays free to submit more, and hands finished
results back to the loop. The thread is started on demand (never at construction, so an engine can be
built inside a Ray actor), idles a moment when the work runs out (the next burst reuses it) and then
exits. Results of `submit()`/`generate()` requests that the thread finishes are parked for `step()`;
results of asyncio requests that a `step()`/`generate()` caller's step finishes go to their waiters.

A cancelled waiter's request keeps decoding (its slot is freed when it finishes) and its result is
dropped. A step that fails fails every asyncio waiter and takes their requests out of the engine (the
submit()/generate() requests stay for step()); an engine that cannot run (asleep, weights incomplete)
refuses asyncio requests before queueing any, as `submit_all` does.

`AsyncStepping` is mixed into `GenerationEngine`; it uses the engine's queues, lock and `_step_once`.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable

import torch

from posttrain.generation.params import GenerationResult, SamplingParams
from posttrain.generation.requests import Request
from posttrain.generation.weights import WeightsLike
from posttrain.logging import get_logger

log = get_logger(__name__)

_STEPPER_IDLE_S = 0.5  # an idle stepping thread waits this long for more work before it exits


def _post(loop: asyncio.AbstractEventLoop | None, fn, *args) -> None:
    """Run fn(*args) on the event loop; dropped when the loop has closed (nobody is waiting)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except (RuntimeError, AttributeError):
        pass


_STEPPERS: weakref.WeakKeyDictionary[threading.Thread, AsyncStepping] = weakref.WeakKeyDictionary()


@atexit.register
def _stop_steppers() -> None:
    """Stop and join running stepping threads before the interpreter tears torch down (a daemon
    thread still inside a torch op at that point aborts the process)."""
    for thread, engine in list(_STEPPERS.items()):
        with engine._work:
            engine._closing = True
            engine._work.notify_all()
        thread.join(timeout=10)


class AsyncStepping:
    """The asyncio verbs of `GenerationEngine` and the stepping thread behind them (a mixin: it uses
    the engine's request queues, lock and steps, declared below)."""

    _waiting: deque[Request]
    _active: list[Request]
    _lock: threading.Lock
    _admit_paused: bool
    _make_request: Callable[..., Request]
    _make_requests: Callable[..., list[Request]]
    _parked: list[GenerationResult]
    _step_once: Callable[..., list[GenerationResult]]
    _check_can_run: Callable[[], None]
    _release: Callable[[list[int]], None]
    load_weights: Callable[[WeightsLike, int], dict[str, float]]

    def _build_stepper(self) -> None:
        self._futures: dict[int, asyncio.Future] = {}
        self._work = threading.Condition()  # guards _stepping; wakes an idle stepping thread
        self._stepping = False  # a stepping thread is running (see _ensure_driver)
        self._async_ids: set[int] = set()  # requests made by agenerate()/astream()
        self._closing = False  # set at interpreter exit: the stepping thread stops (see _stop_steppers)

    async def agenerate(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        *,
        stream_index: int = 0,
        prompt_index: int | None = None,
        session: Hashable | None = None,
    ) -> GenerationResult:
        """Submit one request (of `session`: see generation/sessions.py) and wait for its result (other
        coroutines may submit meanwhile)."""
        req = self._make_request(
            prompt, params or SamplingParams(), stream_index, prompt_index, session=session
        )
        (fut,) = self._queue([req])
        try:
            return await fut
        finally:
            self._futures.pop(req.request_id, None)  # also when cancelled: nobody waits any more

    async def astream(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        sessions: list[Hashable | None] | None = None,
    ) -> AsyncIterator[GenerationResult]:
        """Submit prompts (prompt k of session `sessions[k]`) and yield each result as soon as it
        finishes (completion order)."""
        futs = self._queue(self._make_requests(prompts, params, sessions=sessions))
        for fut in asyncio.as_completed(futs):
            yield await fut

    async def agenerate_all(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        sessions: list[Hashable | None] | None = None,
    ) -> list[GenerationResult]:
        """Submit prompts together and wait for all their results, in prompt order (request k draws
        from stream k, as in `generate`, and belongs to session `sessions[k]`). One wake-up of the
        caller for all of them, where `astream` has one per result."""
        reqs = self._make_requests(prompts, params, sessions=sessions)
        futs = self._queue(reqs)
        try:
            return list(await asyncio.gather(*futs))
        finally:
            for r in reqs:
                self._futures.pop(r.request_id, None)  # also when cancelled: nobody waits any more

    async def load_weights_async(self, weights: WeightsLike, version: int) -> dict[str, float]:
        """Load weights between requests: admission pauses, running sequences finish, weights load,
        admission resumes (waiting requests then run on the new weights).

        Idle is read under the stepping lock, between steps: a step that began before the pause may
        still be prefilling sequences it admitted. Once idle is seen with admission paused, no step
        admits any more (and load_weights takes the lock for the load itself)."""
        self._admit_paused = True
        try:
            while True:
                idle = False
                if self._lock.acquire(blocking=False):
                    idle = not self._active
                    self._lock.release()
                if idle:
                    return self.load_weights(weights, version)
                await asyncio.sleep(0.001)
        finally:
            self._admit_paused = False
            if self._waiting:
                self._ensure_driver()

    def _queue(self, reqs: list[Request]) -> list[asyncio.Future]:
        """Queue asyncio requests (none while the engine cannot run: EngineStateError) and make sure the
        stepping thread serves them; their futures, in order."""
        self._check_can_run()
        with self._work:  # not between a failed step's snapshot of the asyncio requests and their removal
            futs = [self._track(r) for r in reqs]
            self._waiting.extend(reqs)
        self._ensure_driver()
        return futs

    def _track(self, req: Request) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._futures[req.request_id] = fut
        self._async_ids.add(req.request_id)  # its result goes to the loop (or is dropped), never parked
        return fut

    def _ensure_driver(self) -> None:
        """Make sure the stepping thread runs. The thread steps while there is work, hands finished
        results to the loop each waiter awaits on (which stays free; an engine may outlive a loop), idles
        a moment when the work runs out (the next burst reuses it) and then exits."""
        loop = asyncio.get_running_loop()
        with self._work:
            start = not self._stepping
            self._stepping = True
        # from the loop's next turn, so that requests submitted by coroutines scheduled in this turn
        # (asyncio.gather over a group's completions) are admitted, and prefilled, together
        loop.call_soon(self._start_stepping if start else self._wake_stepper)

    def _start_stepping(self) -> None:
        thread = threading.Thread(target=self._step_loop, name="engine-steps", daemon=True)
        _STEPPERS[thread] = self
        thread.start()

    def _wake_stepper(self) -> None:
        with self._work:
            self._work.notify()

    def _has_async_work(self) -> bool:
        return bool(self._active or (self._waiting and not self._admit_paused))

    def _step_loop(self) -> None:
        try:
            while True:
                with self._work:
                    if not self._has_async_work() and not self._closing:
                        self._work.wait(_STEPPER_IDLE_S)
                    if self._closing or not self._has_async_work():
                        self._stepping = False
                        return
                self._step_once(park=True)  # submit()/generate() results wait for step()
        except BaseException as e:  # hand the error to every waiter, take their requests out
            log.error("generation step failed: %r", e)
            with self._work:
                failed = self._drop_async_requests()
                self._stepping = False
            for loop, ids in self._by_loop(failed, lambda rid: rid).items():
                _post(loop, self._fail, e, ids)

    def _by_loop(self, items: list, request_id: Callable) -> dict[asyncio.AbstractEventLoop, list]:
        """`items` grouped by the event loop that awaits their request (`request_id(item)`); those
        nobody awaits any more are left out."""
        out: dict[asyncio.AbstractEventLoop, list] = {}
        for item in items:
            if (fut := self._futures.get(request_id(item))) is not None:
                out.setdefault(fut.get_loop(), []).append(item)
        return out

    def _route(self, results: list[GenerationResult], park: bool) -> list[GenerationResult]:
        """Split one step's results (under the engine's lock): those of asyncio requests go to their
        waiters (dropped where the waiter has gone: a cancelled one's request decodes on, and its result
        is nobody's), whichever thread stepped, and never to a step() caller; the others are returned,
        or with `park` (the stepping thread) parked for step() in the same hold of the lock that
        finished them, so a caller never sees the engine idle with their results in neither place."""
        mine = [r for r in results if r.request_id not in self._async_ids]
        waited = [r for r in results if r.request_id in self._async_ids]
        self._async_ids.difference_update(r.request_id for r in waited)
        for loop, theirs in self._by_loop(waited, lambda r: r.request_id).items():
            _post(loop, self._deliver, theirs)
        if park:
            self._parked += mine
            return []
        return mine

    def _drop_async_requests(self) -> list[int]:
        """After a failed step: take every asyncio request out of the queue and its slot, so that none is
        left for a later step (a generate() caller's) to run, to block load_weights()/sleep() or to fail
        in; their ids (their waiters get the error)."""
        with self._lock, torch.inference_mode():  # the slot state is made of inference tensors
            ids = set(self._async_ids)
            dropped: set[int] = set()
            try:
                # a copy first: submit() appends to the queue from other threads without the lock
                for r in [r for r in list(self._waiting) if r.request_id in ids]:
                    self._waiting.remove(r)
                    dropped.add(r.request_id)
                slots = [i for i, r in enumerate(self._active) if r.request_id in ids]
                if slots:
                    taken = {self._active[i].request_id for i in slots}
                    self._release(slots)
                    dropped |= taken
            except BaseException as e:  # the waiters still get the step's error
                log.error("could not take the failed requests out of the engine: %r", e)
            # only what was taken out stops being an asyncio request: one left in the engine keeps its id,
            # so its result still goes to its (failed) waiter's side, never to a step() caller
            self._async_ids.difference_update(dropped)
        return sorted(ids)

    def _deliver(self, results: list[GenerationResult]) -> None:
        """Resolve the futures of finished requests (on the event loop); a cancelled waiter's result is
        dropped."""
        for res in results:
            fut = self._futures.pop(res.request_id, None)
            if fut is not None and not fut.done():
                try:
                    fut.set_result(res)
                except RuntimeError:  # its loop has closed (asyncio.run ended): nobody is waiting
                    pass

    def _fail(self, error: BaseException, ids: list[int]) -> None:
        """Fail the waiters of requests `ids` (on the event loop)."""
        for rid in ids:
            fut = self._futures.pop(rid, None)
            if fut is not None and not fut.done():
                try:
                    fut.set_exception(error)
                except RuntimeError:  # its loop has closed
                    pass
