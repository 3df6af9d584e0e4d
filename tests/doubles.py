"""Test doubles for the asynchronous GRPO controller: a fake trainer, fake rollout workers, fake data, a
fake loss, and a `prepare_group` hook over a real Policy.

They follow the real contracts (the split train step of `Policy`, the `RolloutWorker` protocol) and
check them as they go, with configurable latencies and failures, so the scheduling logic of the
controller is tested in seconds without a model, an engine or Ray.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.algorithms.async_grpo.contracts import PrepareGroup, Trainer
from posttrain.algorithms.async_grpo.ledger import BufferedGroup
from posttrain.data.normalization import LossFn
from posttrain.rollout.contracts import GroupResult, RolloutFailure, RolloutWorker, WorkerLostError

# (prompt_id, call index on this worker) -> seconds
Latency = float | Callable[[int, int], float]


def fake_dataset(n: int) -> list[dict[str, Any]]:
    """`n` prompts; each is a dict with its dataset index under "id"."""
    return [{"id": i, "prompt": f"what is {i} + {i}?", "answer": str(2 * i)} for i in range(n)]


def _seconds(latency: Latency, prompt_id: int, call: int) -> float:
    return latency(prompt_id, call) if callable(latency) else float(latency)


def jittered(base: float, jitter: float, seed: int = 0) -> Callable[[int, int], float]:
    """Latency `base` plus uniform noise in [0, jitter), deterministic per (seed, prompt, call)."""

    def fn(prompt_id: int, call: int) -> float:
        return base + random.Random(hash((seed, prompt_id, call))).random() * jitter

    return fn


def _held(version: int | None) -> int:
    return -1 if version is None else version


class FakeRolloutWorker(RolloutWorker):
    """A rollout worker that sleeps instead of generating.

    Failure injection, by call index on this worker (0-based) or by prompt id:
    - `die_on_call`: that call raises WorkerLostError and so does every call after it (in flight too);
    - `hang_on_calls`: those calls never return (the controller's timeout must catch them);
    - `fail_prompts`: prompt id -> how many times its group fails (a GroupResult with `error` set, or a
      RolloutFailure when `raise_failures`) before it succeeds;
    - `fail_set_weights`: set_weights raises WorkerLostError.
    With `loads_between_requests`, set_weights waits for the requests in flight (the controller then
    sends weights as soon as they are published), and a request for a newer version than the worker
    holds waits for that version's load (`waited_for_load` counts them). With `batched`, it also has
    `generate_groups` (several groups per call; a group's failure comes back as its result's `error`, a
    lost worker fails the call); call indices count groups.
    It records every call and any contract violation (weights changed mid-request, wrong version), and
    appends ("generated", name, prompt id, weight version) to `journal` (a list shared with other
    doubles, e.g. a FakeTrainer's) for every group it completes, so tests check the order of events
    instead of wall-clock times.
    """

    def __init__(
        self,
        name: str = "worker",
        latency: Latency = 0.01,
        group_size: int = 4,
        die_on_call: int | None = None,
        hang_on_calls: frozenset[int] | set[int] = frozenset(),
        fail_prompts: dict[int, int] | None = None,
        raise_failures: bool = False,
        set_weights_latency: float = 0.0,
        fail_set_weights: bool = False,
        batched: bool = False,
        loads_between_requests: bool = False,
        journal: list[tuple] | None = None,
    ) -> None:
        self.name = name
        self.journal = journal
        self.loads_between_requests = loads_between_requests
        self.batches_groups = batched
        self.batch_sizes: list[int] = []  # groups per generate_groups call
        self.latency = latency
        self.group_size = group_size
        self.die_on_call = die_on_call
        self.hang_on_calls = set(hang_on_calls)
        self.fail_prompts = dict(fail_prompts or {})
        self.raise_failures = raise_failures
        self.set_weights_latency = set_weights_latency
        self.fail_set_weights = fail_set_weights
        self.version: int | None = None
        self.dead = False
        self.calls: list[tuple[int, int, int]] = []  # (call index, prompt id, weight version)
        self.completed: list[int] = []  # prompt ids, in completion order
        self.weight_updates: list[int] = []
        self.violations: list[str] = []
        self.active = 0
        self.max_active = 0
        self.loading: int | None = None  # the version a set_weights in progress loads
        self.pushed_while_busy = 0  # set_weights calls that came while requests were in flight
        self.waited_for_load = 0  # requests that waited for their version to load
        self.refused_stale = 0  # requests refused because a newer version was loading

    async def generate_group(self, prompt: dict[str, Any], weight_version: int) -> GroupResult:
        call = len(self.calls)  # taken before any await, so concurrent calls never share an index
        prompt_id = int(prompt["id"])
        self.calls.append((call, prompt_id, weight_version))
        if self.dead:
            raise WorkerLostError(f"{self.name} is dead")
        if self.loads_between_requests:  # as the real worker: wait for a newer version, refuse an older one
            waited = False
            while not (self.loading is None and weight_version == self.version):
                newest = max(_held(self.version), _held(self.loading))
                if weight_version < newest:
                    self.refused_stale += 1
                    raise RolloutFailure(
                        f"{self.name}: version {weight_version} asked, {newest} held or loading"
                    )
                self.waited_for_load += not waited
                waited = True
                await asyncio.sleep(0.001)  # a dry run: polling is fine
        if weight_version != self.version:
            self.violations.append(f"call {call}: asked for version {weight_version}, holds {self.version}")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._generate(call, prompt_id, weight_version)
        finally:
            self.active -= 1

    async def generate_groups(self, prompts: list[dict[str, Any]], weight_version: int) -> list[GroupResult]:
        self.batch_sizes.append(len(prompts))
        calls = [self.generate_group(p, weight_version) for p in prompts]
        out = await asyncio.gather(*calls, return_exceptions=True)
        for r in out:
            if isinstance(r, BaseException) and not isinstance(r, RolloutFailure):
                raise r
        return [
            GroupResult(None, weight_version, 0, error=str(r)) if isinstance(r, RolloutFailure) else r
            for r in out
        ]

    async def _generate(self, call: int, prompt_id: int, weight_version: int) -> GroupResult:
        if call in self.hang_on_calls:
            await asyncio.Event().wait()
        await asyncio.sleep(_seconds(self.latency, prompt_id, call))
        if call == self.die_on_call:
            self.dead = True
        if self.dead:
            raise WorkerLostError(f"{self.name} died during call {call}")
        if self.version != weight_version:
            self.violations.append(f"call {call}: weights changed from {weight_version} to {self.version}")
        if self.fail_prompts.get(prompt_id, 0) > 0:
            self.fail_prompts[prompt_id] -= 1
            if self.raise_failures:
                raise RolloutFailure(f"reward function crashed on prompt {prompt_id}")
            return GroupResult(None, weight_version, 0, error=f"generation failed on prompt {prompt_id}")
        self.completed.append(prompt_id)
        if self.journal is not None:
            self.journal.append(("generated", self.name, prompt_id, weight_version))
        samples = [
            {"prompt_id": prompt_id, "sample": k, "reward": float((prompt_id + k) % 2)}
            for k in range(self.group_size)
        ]
        return GroupResult(samples, weight_version, self.group_size)

    async def set_weights(self, version: int, weights: Any) -> None:
        if self.loads_between_requests:
            self.pushed_while_busy += bool(self.active)
            self.loading = version  # until loaded: calls for it wait, calls for older versions are refused
        try:
            while self.loads_between_requests and self.active:  # a dry run: polling is fine
                await asyncio.sleep(0.001)
            if self.active:
                self.violations.append(f"set_weights({version}) while {self.active} request(s) in flight")
            if self.dead or self.fail_set_weights:
                raise WorkerLostError(f"{self.name} could not load weights {version}")
            if isinstance(weights, dict) and weights.get("version") != version:
                self.violations.append(
                    f"set_weights({version}) got weights of version {weights.get('version')}"
                )
            await asyncio.sleep(self.set_weights_latency)
            self.version = version
            self.weight_updates.append(version)
        finally:
            self.loading = None


@dataclass
class FakeBatch:
    """What the dry-run `prepare_group` hands the fake trainer."""

    group_id: int
    prompt_id: int
    weight_version: int
    trainer_version: int  # version when it was prepared
    num_samples: int


def make_fake_prepare(
    filter_prompts: frozenset[int] | set[int] = frozenset(), latency: float = 0.0
) -> Callable[[BufferedGroup, int], Any]:
    """A `prepare_group` hook: filters `filter_prompts` (as zero-advantage groups would be), else a
    FakeBatch."""

    async def prepare(group: BufferedGroup, trainer_version: int) -> FakeBatch | None:
        await asyncio.sleep(latency)
        if group.prompt_id in filter_prompts:
            return None
        return FakeBatch(
            group.group_id, group.prompt_id, group.weight_version, trainer_version, group.num_samples
        )

    return prepare


@dataclass
class FakeTrainer(Trainer):
    """The split train step with the semantics of `Policy`, as async calls with latencies and failures.

    `fail_on` / `hang_on` map a verb ("begin", "train_group", "finish", "abort", "export_weights") to the
    call index (0-based, per verb) that raises / never returns. Every event goes to `events` and, when
    given, to `journal` (a list shared with FakeRolloutWorkers: one order of both sides' events).
    """

    start_version: int = 0
    train_latency: float = 0.0
    finish_latency: float = 0.0
    fail_on: dict[str, int] = field(default_factory=dict)
    hang_on: dict[str, int] = field(default_factory=dict)
    open: bool = False
    current: list[FakeBatch] = field(default_factory=list)
    steps: list[list[FakeBatch]] = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    journal: list[tuple] | None = None

    def __post_init__(self) -> None:
        self._version = self.start_version

    @property
    def version(self) -> int:
        return self._version

    @property
    def trained_group_ids(self) -> list[int]:
        return [b.group_id for step in self.steps for b in step]

    def _record(self, event: tuple) -> None:
        self.events.append(event)
        if self.journal is not None:
            self.journal.append(event)

    async def _enter(self, verb: str) -> None:
        n = self.calls.get(verb, 0)
        self.calls[verb] = n + 1
        if self.hang_on.get(verb) == n:
            await asyncio.Event().wait()
        if self.fail_on.get(verb) == n:
            raise RuntimeError(f"injected failure in {verb} call {n}")

    async def begin(self, loss_fn: LossFn) -> None:
        await self._enter("begin")
        if loss_fn is None:
            raise ValueError("begin_train_step needs a loss_fn")
        if self.open:
            raise RuntimeError("begin_train_step() called while a train step is already open")
        self.open, self.current = True, []
        self._record(("begin", self._version))

    async def train_group(self, batch: FakeBatch) -> None:
        await self._enter("train_group")
        if not self.open:
            raise RuntimeError("train_microbatch() called without an open train step")
        if batch.trainer_version != self._version:
            self.violations.append(f"group {batch.group_id} prepared at {batch.trainer_version}")
        await asyncio.sleep(self.train_latency)
        self.current.append(batch)
        self._record(("train", batch.group_id, batch.weight_version, self._version))

    async def finish(self) -> dict[str, float]:
        await self._enter("finish")
        if not self.open:
            raise RuntimeError("finish_train_step() called without an open train step")
        await asyncio.sleep(self.finish_latency)
        self.open = False
        samples = float(sum(b.num_samples for b in self.current))
        if not self.current:  # like the Policy: no valid tokens -> the step is skipped
            self._record(("skip", self._version))
            return {"step_skipped": 1.0}
        self.steps.append(self.current)
        self.current = []
        self._version += 1
        self._record(("finish", self._version))
        return {"loss": 0.0, "num_valid_samples": samples, "trainer_version": float(self._version)}

    async def abort(self) -> None:
        await self._enter("abort")
        self.open, self.current = False, []
        self._record(("abort", self._version))

    async def export_weights(self) -> dict[str, int]:
        await self._enter("export_weights")
        self._record(("export", self._version))
        return {"version": self._version}


FAKE_LOSS: LossFn = object()  # type: ignore[assignment]  # the fake trainer only checks it is passed


def policy_prepare_group(
    trainer: Any, to_batch: Callable[[BufferedGroup], Any], reference: bool = True
) -> PrepareGroup:
    """A `prepare_group` hook over a `PolicyTrainer`: `to_batch(group)` (None filters the group), then the
    Policy's logprobs. `reference=False` skips the reference model and copies prev_logprobs in its place."""

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


class ScriptedEngine:
    """An engine double for multi-turn episodes: `reply(prompt_text, turn)` says what the "model" writes
    (text, ending with the end-of-turn token when the turn is closed); the ids are its tokens, each
    with logprob -0.25 - 0.01 * position. It records every call (prompt ids, session) and the ended
    sessions."""

    def __init__(self, tokenizer, reply: Callable[[str, int], str], weight_version: int = 0) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.weight_version = weight_version
        self.calls: list[tuple[list[int], Any]] = []
        self.ended: list[Any] = []
        self._turns: dict[Any, int] = {}

    async def agenerate(self, prompt, params, *, stream_index=0, session=None):
        from posttrain.generation.params import GenerationResult

        self.calls.append((list(prompt), session))
        turn = self._turns.get(session, 0)
        self._turns[session] = turn + 1
        text = self.reply(self.tokenizer.decode(prompt, skip_special_tokens=False), turn)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: params.max_new_tokens]
        stop = bool(ids) and ids[-1] in set(params.stop_token_ids)
        await asyncio.sleep(0)
        return GenerationResult(
            request_id=len(self.calls),
            prompt_index=stream_index,
            prompt_token_ids=list(prompt),
            token_ids=ids,
            logprobs=[-0.25 - 0.01 * i for i in range(len(ids))],
            finish_reason="stop" if stop else "length",
            stop_reason=ids[-1] if stop else None,
            weight_version=self.weight_version,
        )

    def end_session(self, session) -> None:
        self.ended.append(session)
