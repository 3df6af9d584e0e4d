"""The trainer side of asynchronous GRPO: the driver-side `Policy` as the controller's `Trainer`.

- `PolicyTrainer`: the driver-side `Policy` as the controller's `Trainer`. Policy verbs block, so they
  run one at a time on a daemon thread (`SerialThread`): the event loop stays free to stream rollouts,
  calls never interleave on the Policy, and a hung call cannot block interpreter exit. The version is
  read back from the ranks after every finish (the Policy is the source of truth; a skipped step
  leaves it unchanged).
- `ChunkedTrainer`: a `PolicyTrainer` fed scored groups (rollout/rows.py `GroupSamples`), training
  them in chunks of at least `min_rows` rows, one `train_microbatch` call each.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from posttrain.algorithms.async_grpo.contracts import Trainer
from posttrain.data.normalization import LossFn
from posttrain.logging import get_logger
from posttrain.policy.policy import Policy
from posttrain.rollout.config import GroupConfig
from posttrain.rollout.rows import GroupSamples, groups_to_batch

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


class PolicyTrainer(Trainer):
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
        # a timed-out finish ran on before the abort (the calls are serial): its step may be applied
        self._version = await self.call(self._read_version)

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


class ChunkedTrainer(PolicyTrainer):
    """The Policy as the controller's trainer, fed `GroupSamples` and training them in chunks.

    `train_group` collects groups until they hold `min_rows` rows, then queues the chunk on the
    policy thread, which turns it into one batch, adds reference (and, with `prev`, prev) logprobs at
    the open step's weights and calls `train_microbatch`. It does not wait for the chunk: the
    controller takes the next groups while it trains, and the thread runs the chunks in order, so it
    goes from one chunk to the next without waiting for the event loop. A chunk that failed surfaces at
    the next `train_group` or at `finish`, which queues what is left and waits for every chunk before
    the optimizer step: a step with a failed chunk is aborted, never applied. `abort` drops what is
    not trained yet (the abort runs on the thread after the chunks queued before it)."""

    def __init__(
        self,
        policy: Policy,
        group: GroupConfig,
        pad_id: int,
        min_rows: int,
        reference: bool,
        prev: bool = True,
        shape_fn: Callable[[Any], dict[str, float]] | None = None,
    ):
        super().__init__(policy)
        self.group, self.pad_id, self.min_rows, self.reference = group, pad_id, min_rows, reference
        self.prev = prev
        # after the logprobs, rewrites a chunk's batch (its advantages; on-policy distillation) and returns
        # metrics, averaged over a step's chunks by their trained tokens (`pop_chunk_metrics`)
        self.shape_fn = shape_fn
        self._chunk_sums: dict[str, float] = {}
        self._chunk_weight = 0.0
        self._pending: list[GroupSamples] = []  # groups of the next chunk
        self._queued: list[asyncio.Future] = []  # chunks on the policy thread, not yet checked

    def _begin(self, loss_fn: LossFn) -> None:
        self._chunk_sums, self._chunk_weight = {}, 0.0  # an aborted step's chunks count for nothing
        super()._begin(loss_fn)

    @property
    def queued_calls(self) -> int:
        """Chunks a finish or abort waits for first: those training or queued, and the pending one."""
        return sum(not f.done() for f in self._queued) + bool(self._pending)

    def _train_chunk(self, groups: list[GroupSamples]) -> None:
        batch = self.add_logprobs(groups_to_batch(groups, self.group, self.pad_id), self.reference, self.prev)
        if self.shape_fn is not None:
            weight = float((batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum())
            for key, value in self.shape_fn(batch).items():
                self._chunk_sums[key] = self._chunk_sums.get(key, 0.0) + value * weight
            self._chunk_weight += weight
        self.policy.train_microbatch(batch)

    def pop_chunk_metrics(self) -> dict[str, float]:
        """The `shape_fn` metrics of the chunks trained since the last call, token-weighted means."""
        sums, weight = self._chunk_sums, self._chunk_weight
        self._chunk_sums, self._chunk_weight = {}, 0.0
        return {k: v / weight for k, v in sums.items()} if weight > 0 else {}

    def _queue_chunk(self) -> None:
        chunk, self._pending = self._pending, []
        if chunk:
            self._queued.append(self.submit(self._train_chunk, chunk))

    def _raise_failed(self) -> None:
        """Raise the error of a chunk that has failed; forget the chunks that have trained."""
        for fut in [f for f in self._queued if f.done()]:
            self._queued.remove(fut)
            fut.result()

    def _drop_queued(self) -> None:
        """Forget the queued chunks (the step is finishing or aborted): results are dropped, and an
        error not raised yet is logged (the step it belongs to is aborted anyway)."""
        for fut in self._queued:
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled() and fut.exception() is not None:
                log.warning("a chunk of the aborted train step failed too: %r", fut.exception())
        self._queued = []

    async def train_group(self, batch: GroupSamples) -> None:
        self._raise_failed()
        self._pending.append(batch)
        if sum(len(s.results) for s in self._pending) >= self.min_rows:
            self._queue_chunk()

    async def finish(self) -> dict[str, float]:
        self._queue_chunk()
        while self._queued:  # a failed chunk raises here; the controller then aborts the step
            fut = self._queued[0]
            try:
                await fut
            finally:
                self._queued.remove(fut)
        return await super().finish()

    async def abort(self) -> None:
        self._pending = []
        self._drop_queued()
        await super().abort()
