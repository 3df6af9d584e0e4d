"""Dry-run tests of the asynchronous GRPO controller: fake trainer, fake rollout workers, no Ray.

Each test runs its coroutine under a hard `asyncio.wait_for` bound (`bounded_run`), so a scheduling
bug shows up as a failure in seconds, never as a hung test run.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import json
import re
import types

import pytest

from doubles import (
    FAKE_LOSS,
    FakeRolloutWorker,
    FakeTrainer,
    fake_dataset,
    jittered,
    make_fake_prepare,
)
from posttrain.algorithms.async_grpo.config import AsyncGRPOConfig
from posttrain.algorithms.async_grpo.contracts import (
    AsyncGRPOError,
    NoRolloutWorkersError,
    RetryBudgetExhausted,
    TrainerError,
)
from posttrain.algorithms.async_grpo.controller import AsyncGRPOController
from posttrain.algorithms.async_grpo.ledger import GroupState
from posttrain.algorithms.async_grpo.meters import COUNTERS, GROUP_COUNTERS
from posttrain.algorithms.async_grpo.pool import Request
from posttrain.rollout.contracts import SamplesCodec
from posttrain.tasks.datasets import PromptItem

HARD_TIMEOUT_S = 10.0


def bounded_run(coro, timeout: float = HARD_TIMEOUT_S):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make(
    n_prompts: int = 16,
    workers: list[FakeRolloutWorker] | None = None,
    trainer: FakeTrainer | None = None,
    prepare=None,
    codec: SamplesCodec | None = None,
    batched: bool = False,
    dataset: list | None = None,
    **overrides,
) -> tuple[AsyncGRPOController, FakeTrainer, list[FakeRolloutWorker]]:
    cfg = dict(
        target_prompt_groups_per_step=4,
        max_staleness=1,
        max_in_flight_per_worker=2,
        shuffle=False,
        request_timeout_s=2.0,
        weight_sync_timeout_s=2.0,
        trainer_timeout_s=2.0,
        admission_timeout_s=5.0,
        shutdown_timeout_s=1.0,
    )
    cfg.update(overrides)
    workers = (
        workers if workers is not None else [FakeRolloutWorker(f"w{i}", batched=batched) for i in range(2)]
    )
    trainer = trainer if trainer is not None else FakeTrainer()
    ctrl = AsyncGRPOController(
        AsyncGRPOConfig(**cfg),
        fake_dataset(n_prompts) if dataset is None else dataset,
        workers,
        trainer,
        prepare or make_fake_prepare(),
        FAKE_LOSS,
        samples_codec=codec,
    )
    return ctrl, trainer, workers


def check_ledger(ctrl: AsyncGRPOController, trainer: FakeTrainer) -> None:
    """Every group trained at most once, and the trainer trained exactly the ledger's TRAINED groups (the
    ledger counts ended groups and keeps their ids only as ended: the ids come from the trainer)."""
    ctrl.ledger.check_settled()
    trained = trainer.trained_group_ids
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert ctrl.ledger.counts()["trained"] == len(trained)
    assert all(ctrl.ledger.ended(g) and ctrl.ledger.state(g) is None for g in trained)


def check_workers(workers: list[FakeRolloutWorker]) -> None:
    for w in workers:
        assert w.violations == [], (w.name, w.violations)
        assert w.weight_updates == sorted(w.weight_updates)


def trained_prompts(trainer: FakeTrainer) -> list[int]:
    return [b.prompt_id for step in trainer.steps for b in step]


# --------------------------------------------------------------------------- scheduling


def test_arrival_order():
    """Among equally fresh groups the trainer takes them in the order they finished, not sent."""
    worker = FakeRolloutWorker("w0", latency=jittered(0.005, 0.03, seed=1))
    ctrl, trainer, _ = make(16, [worker], max_staleness=0, max_in_flight_per_worker=4)
    summary = bounded_run(ctrl.run())
    assert summary.steps == 4 and summary.data_exhausted
    assert trained_prompts(trainer) == worker.completed
    assert worker.completed != sorted(worker.completed), "latencies should reorder completions"
    check_ledger(ctrl, trainer)


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("early", [False, True], ids=["push_when_idle", "loads_between_requests"])
def test_staleness_bound_never_exceeded(max_staleness, batched, early):
    workers = [
        FakeRolloutWorker(
            f"w{i}", latency=jittered(0.002, 0.02, seed=i), batched=batched, loads_between_requests=early
        )
        for i in range(3)
    ]
    trainer = FakeTrainer(train_latency=0.002, finish_latency=0.01)
    ctrl, trainer, _ = make(
        48,
        workers,
        trainer,
        max_staleness=max_staleness,
        max_outstanding_groups=12,
        max_in_flight_per_worker=3,
    )
    steps: list[dict] = []
    summary = bounded_run(ctrl.run(on_step=lambda step, m: steps.append(m)))
    lags = [
        version - weight_version
        for kind, _, weight_version, version in (e for e in trainer.events if e[0] == "train")
    ]
    assert lags and max(lags) <= max_staleness and min(lags) >= 0
    assert all(m["staleness/max"] <= max_staleness for m in steps)
    hist = sum(m[f"staleness/lag_{k}"] for m in steps for k in range(max_staleness + 1))
    assert hist == len(trainer.trained_group_ids) == summary.totals["admitted"]
    assert trainer.violations == []
    check_workers(workers)
    check_ledger(ctrl, trainer)
    counts = summary.groups
    assert counts["trained"] + counts["dropped_stale"] == 48
    assert summary.totals["dropped_stale"] == counts["dropped_stale"]


def test_trainer_version_advances_only_on_finish():
    ctrl, trainer, workers = make(12, max_staleness=2)
    seen = []
    bounded_run(ctrl.run(on_step=lambda step, m: seen.append((step, m["trainer_version"]))))
    assert seen == [(1, 1.0), (2, 2.0), (3, 3.0)]
    version = 0
    for event in trainer.events:
        if event[0] == "finish":
            assert event[1] == version + 1
            version = event[1]
        elif event[0] in ("begin", "train"):
            assert event[-1] == version
    assert ctrl.trainer_version == trainer.version == 3
    check_workers(workers)


def test_end_of_dataset_partial_final_step_and_epochs():
    ctrl, trainer, _ = make(10, num_epochs=2)
    summary = bounded_run(ctrl.run())
    assert [len(s) for s in trainer.steps] == [4, 4, 4, 4, 4]
    assert sorted(trained_prompts(trainer)) == sorted(list(range(10)) * 2)
    assert summary.data_exhausted and summary.groups["pending"] == 0
    ctrl, trainer, _ = make(10, max_staleness=5)
    summary = bounded_run(ctrl.run())
    assert [len(s) for s in trainer.steps] == [4, 4, 2]
    assert summary.steps == 3 and summary.data_exhausted
    check_ledger(ctrl, trainer)


class ItemWorker(FakeRolloutWorker):
    """A fake worker fed PromptItems (the engine workers' prompts): records (version, prompt id, repeat)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drawn: list[tuple[int, int, int]] = []

    async def generate_group(self, prompt, weight_version):
        self.drawn.append((weight_version, prompt.prompt_id, prompt.repeat))
        return await super().generate_group({"id": prompt.prompt_id}, weight_version)


@pytest.mark.parametrize("batched", [False, True])
def test_a_prompt_sent_twice_at_the_same_weights_is_told_its_repeat(batched):
    """Three prompts, eight groups out at once: each prompt goes out two or three times at version 0.
    Each of those draws carries its own `repeat` (so the engine workers seed it apart), and a prompt's
    first draw at each version has repeat 0 (the seeds of runs that never repeat a prompt are as
    before)."""
    items = [PromptItem(i, f"p{i}", [3, i], {}) for i in range(3)]
    workers = [ItemWorker("w0", batched=batched, latency=0.005)]
    ctrl, trainer, _ = make(
        dataset=items,
        workers=workers,
        num_steps=3,
        num_epochs=20,
        max_in_flight_per_worker=8,
        max_outstanding_groups=8,
    )
    bounded_run(ctrl.run())
    drawn = workers[0].drawn
    assert len(drawn) == len(set(drawn)), "two draws of one prompt at one version share a seed"
    at_v0 = collections.Counter(pid for v, pid, _ in drawn if v == 0)
    assert max(at_v0.values()) >= 2  # the case under test happened
    for (v, pid), n in collections.Counter((v, pid) for v, pid, _ in drawn).items():
        assert sorted(r for w, q, r in drawn if (w, q) == (v, pid)) == list(range(n))
    check_workers(workers)
    check_ledger(ctrl, trainer)


def test_a_retried_group_keeps_its_repeat_at_the_same_version():
    ctrl, _, _ = make(dataset=[PromptItem(i, f"p{i}", [3, i], {}) for i in range(2)])
    pool = ctrl.pool
    first, second = Request(0, 1), Request(1, 1)
    assert pool._prompt(first, 5).repeat == 0 and pool._prompt(second, 5).repeat == 1
    assert pool._prompt(second, 5).repeat == 1  # retried at version 5: drawn again identically
    assert pool._prompt(second, 6).repeat == 0  # at version 6 it is that version's first draw
    assert pool._prompt(first, 6).repeat == 1


def test_a_resumed_run_never_draws_a_saved_group_again_with_its_seed():
    """A checkpoint seals groups drawn at its own version (a prompt drawn twice there has repeats 0 and
    1); the resumed run publishes that version again, so its draws of those prompts must count on from
    the saved draws (the controller saves its repeat counter), or it would draw a saved group's seed
    again and train that group twice."""
    codec = SamplesCodec(encode=lambda s: s, decode=lambda s: s)
    items = [PromptItem(i, f"p{i}", [3, i], {}) for i in range(3)]
    setting = dict(
        dataset=items, codec=codec, num_epochs=40, max_in_flight_per_worker=8, max_outstanding_groups=8
    )
    first = [ItemWorker("w0", latency=0.005)]
    ctrl, _, _ = make(workers=first, trainer=FakeTrainer(train_latency=0.002), num_steps=12, **setting)
    saved: dict = {}

    def kept_groups(state: dict, drawn: list) -> set:
        """Draws made before the save and kept (trained, or saved with samples): not requeued."""
        prompt_of = {g: p for g, p, _ in state["requeue"]}
        return set(drawn) - {(v, prompt_of[g], n) for g, v, n in state["requeue_repeats"]}

    async def on_step(step, metrics):
        # the first checkpoint from step 2 on that holds a kept group of its own version (which step
        # that is depends on how the worker's and the trainer's latencies interleave on a loaded host)
        if step >= 2 and "state" not in saved:
            state = json.loads(json.dumps(await ctrl.checkpoint_state()))
            kept = kept_groups(state, first[0].drawn)
            if any(v == state["trainer_version"] for v, _, _ in kept):
                saved.update(state=state, kept=kept)

    bounded_run(ctrl.run(on_step))
    assert "state" in saved, "no checkpoint held a kept group of its own version: nothing checked"
    state, kept = saved["state"], saved["kept"]
    version = state["trainer_version"]
    again = [ItemWorker("w0", latency=0.005)]
    resumed, _, _ = make(
        workers=again, trainer=FakeTrainer(start_version=version), num_steps=state["step"] + 2, **setting
    )
    resumed.load_state_dict(state)
    bounded_run(resumed.run())
    assert not kept & set(again[0].drawn), "a resumed run drew a kept group's seed again"
    check_workers(again)


def test_a_request_waiting_for_a_load_is_bounded_for_the_requests_the_load_waits_for():
    """A worker that loads between requests takes a request for the version it is being pushed: the
    request waits for the load, which waits for the requests in flight there. Its bound adds the load's
    (weight_sync_timeout_s) and theirs (request_timeout_s each), else a healthy worker is timed out."""
    worker = FakeRolloutWorker("w0", loads_between_requests=True)
    ctrl, _, _ = make(workers=[worker], request_timeout_s=0.3, weight_sync_timeout_s=0.1)
    ctrl.pool.start()
    slot = ctrl.pool.slots[0]
    assert ctrl.pool._waits_s(slot) == 0.0  # nothing to wait for
    slot.in_flight = {1, 2}
    assert ctrl.pool._waits_s(slot) == 0.0  # requests run side by side on this worker
    slot.update = asyncio.Future(loop=asyncio.new_event_loop())  # a push in progress
    assert ctrl.pool._waits_s(slot) == pytest.approx(0.1 + 2 * 0.3)


def test_num_steps_stops_with_work_in_flight():
    ctrl, trainer, _ = make(40, num_steps=2, max_staleness=3)
    summary = bounded_run(ctrl.run())
    assert summary.steps == 2 and not summary.data_exhausted
    assert summary.groups["in_flight"] == summary.groups["training"] == 0
    assert summary.groups["pending"] + summary.groups["buffered"] > 0
    check_ledger(ctrl, trainer)


def test_empty_steps_never_open_a_step():
    ctrl, trainer, _ = make(6, prepare=make_fake_prepare(filter_prompts=set(range(6))))
    summary = bounded_run(ctrl.run())
    assert summary.steps == 0 and trainer.version == 0
    assert "begin" not in trainer.calls and summary.groups["filtered"] == 6
    ctrl, trainer, _ = make(0)
    summary = bounded_run(ctrl.run())
    assert summary.steps == 0 and summary.data_exhausted and trainer.calls == {"export_weights": 1}


def test_filtered_groups_do_not_count_toward_the_target():
    ctrl, trainer, _ = make(12, max_staleness=5, prepare=make_fake_prepare(filter_prompts={0, 5, 6}))
    summary = bounded_run(ctrl.run())
    assert [len(s) for s in trainer.steps] == [4, 4, 1]
    assert 0 not in trained_prompts(trainer) and summary.totals["filtered"] == 3
    check_ledger(ctrl, trainer)


def test_straggler_does_not_hold_back_steps():
    """The straggler (prompt 0) returns only once the trainer has finished 3 steps: were the controller
    waiting for it, the run would stall (its worker is then retired, and the run fails) instead of
    training. It then comes back too stale and is dropped."""
    journal: list[tuple] = []

    class Straggler(FakeRolloutWorker):
        async def _generate(self, call, prompt_id, weight_version):
            while prompt_id == 0 and sum(e[0] == "finish" for e in journal) < 3:
                await asyncio.sleep(0.001)
            return await super()._generate(call, prompt_id, weight_version)

    workers = [Straggler(f"w{i}", latency=0.001, journal=journal) for i in range(2)]
    trainer = FakeTrainer(journal=journal)
    ctrl, trainer, _ = make(32, workers, trainer, max_staleness=0, max_outstanding_groups=8)
    summary = bounded_run(ctrl.run())
    back = journal.index(next(e for e in journal if e[0] == "generated" and e[2] == 0))
    assert journal[back][3] == 0  # generated with version 0, back after 3 optimizer steps
    assert [e[1] for e in journal[:back] if e[0] == "finish"] == [1, 2, 3]
    # the others went on meanwhile: three whole steps of 4 groups (the straggler polls every ms, so
    # the next step's first groups may also be trained before it notices; counted, not timed)
    assert sum(e[0] == "train" for e in journal[:back]) >= 12
    # group 0 is prompt 0 (no shuffle): dropped as stale, never trained
    assert 0 not in trained_prompts(trainer) and ctrl.ledger.ended(0)
    assert summary.totals["dropped_stale"] == summary.groups["dropped_stale"] >= 1
    assert summary.data_exhausted and summary.groups["trained"] + summary.groups["dropped_stale"] == 32
    check_ledger(ctrl, trainer)
    check_workers(workers)


def test_straggler_within_staleness_is_trained_late():
    latency = lambda prompt, call: 0.15 if prompt == 0 else 0.002  # noqa: E731
    trainer = FakeTrainer(finish_latency=0.1)
    ctrl, trainer, workers = make(
        12,
        [FakeRolloutWorker("w0", latency=latency), FakeRolloutWorker("w1", latency=latency)],
        trainer,
        max_staleness=3,
    )
    bounded_run(ctrl.run())
    steps = [[b.prompt_id for b in s] for s in trainer.steps]
    assert 0 not in steps[0] and 0 in trained_prompts(trainer)
    lag = next(v - wv for kind, gid, wv, v in (e for e in trainer.events if e[0] == "train") if gid == 0)
    assert 1 <= lag <= 3
    check_ledger(ctrl, trainer)


def test_a_batched_worker_gets_every_group_that_fits_in_one_call():
    """Groups that fit (worker room, outstanding cap) go out in one generate_groups call."""
    worker = FakeRolloutWorker("w0", batched=True)
    ctrl, trainer, _ = make(16, [worker], max_staleness=1, max_in_flight_per_worker=4)
    summary = bounded_run(ctrl.run())
    assert summary.steps == 4 and summary.data_exhausted
    assert worker.batch_sizes[0] == 4 and max(worker.batch_sizes) == 4
    assert sum(worker.batch_sizes) == 16 and len(worker.batch_sizes) < 16
    assert sorted(trained_prompts(trainer)) == list(range(16))
    assert worker.max_active <= 4
    check_workers([worker])
    check_ledger(ctrl, trainer)


def test_max_groups_per_call_splits_a_workers_room_into_calls_that_run_together():
    """With max_groups_per_call below max_in_flight_per_worker a worker gets several calls at once:
    the next call is already there when one returns (a Ray actor then never idles for a round trip)."""
    worker = FakeRolloutWorker("w0", batched=True, latency=0.02)
    ctrl, trainer, _ = make(16, [worker], max_staleness=1, max_in_flight_per_worker=4, max_groups_per_call=2)
    summary = bounded_run(ctrl.run())
    assert summary.steps == 4 and summary.data_exhausted
    assert set(worker.batch_sizes) == {2} and sum(worker.batch_sizes) == 16
    assert worker.max_active == 4  # two calls of two groups in flight together
    assert sorted(trained_prompts(trainer)) == list(range(16))
    check_workers([worker])
    check_ledger(ctrl, trainer)


def test_a_failing_batched_call_counts_as_one_worker_error():
    """An unexplained error fails the call's groups (retried) but is one error of the worker, not one
    per group: with max_consecutive_worker_errors=2 one failed call of 4 groups keeps the worker."""

    class FlakyOnce(FakeRolloutWorker):
        async def generate_groups(self, prompts, weight_version):
            if not self.batch_sizes:
                self.batch_sizes.append(len(prompts))
                raise ValueError("transient")
            return await super().generate_groups(prompts, weight_version)

    worker = FlakyOnce("w0", batched=True)
    ctrl, trainer, _ = make(8, [worker], max_in_flight_per_worker=4, max_consecutive_worker_errors=2)
    summary = bounded_run(ctrl.run())
    assert summary.dead_workers == {} and summary.totals["retried"] == 4
    assert worker.batch_sizes[0] == 4
    assert sorted(trained_prompts(trainer)) == list(range(8))
    check_ledger(ctrl, trainer)


def test_a_batched_answer_of_the_wrong_length_stops_the_run():
    class Short(FakeRolloutWorker):
        async def generate_groups(self, prompts, weight_version):
            return (await super().generate_groups(prompts, weight_version))[:-1]

    ctrl, trainer, _ = make(8, [Short("w0", batched=True)], max_in_flight_per_worker=4)
    with pytest.raises(AsyncGRPOError, match="for 4 prompts with list .*one GroupResult per prompt") as e:
        bounded_run(ctrl.run())
    assert not isinstance(e.value, NoRolloutWorkersError)  # a broken contract stops at once
    assert not trainer.open and ctrl.pool.dead_workers() == {}
    check_ledger(ctrl, trainer)


def test_weights_are_exported_once_per_version_and_not_after_the_last_step():
    ctrl, trainer, workers = make(16, num_steps=3)
    summary = bounded_run(ctrl.run())
    assert summary.steps == 3
    assert [e[1] for e in trainer.events if e[0] == "export"] == [0, 1, 2]  # version 3 is never used
    assert all(w.weight_updates == [0, 1, 2][: len(w.weight_updates)] for w in workers)


def test_preloaded_weights_start_the_run_without_a_push():
    """Workers that already hold the trainer's weights (pushed at set-up) generate at once."""
    workers = [FakeRolloutWorker(f"w{i}") for i in range(2)]
    for w in workers:
        bounded_run(w.set_weights(0, {"version": 0}))
    ctrl, trainer, _ = make(16, workers, num_steps=2)
    ctrl.weights_preloaded(0, {"version": 0})
    summary = bounded_run(ctrl.run())
    assert summary.steps == 2
    assert [e[1] for e in trainer.events if e[0] == "export"] == [1]
    assert all(w.weight_updates[0] == 0 and w.weight_updates.count(0) == 1 for w in workers)
    assert summary.totals["weight_pushes"] == sum(len(w.weight_updates) - 1 for w in workers)
    check_workers(workers)
    check_ledger(ctrl, trainer)
    with pytest.raises(ValueError, match="preloaded weights are version 5"):
        make(8)[0].weights_preloaded(5, {"version": 5})


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("batched", [False, True])
def test_worker_death_with_retry(batched):
    workers = [
        FakeRolloutWorker("w0", die_on_call=2, batched=batched),
        FakeRolloutWorker("w1", latency=0.02, batched=batched),
        FakeRolloutWorker("w2", latency=0.01, batched=batched),
    ]
    ctrl, trainer, _ = make(24, workers, max_staleness=6, max_outstanding_groups=12)
    summary = bounded_run(ctrl.run())
    assert list(summary.dead_workers) == [0]
    assert sorted(trained_prompts(trainer)) == list(range(24))
    assert summary.totals["retried"] >= 1 and summary.totals["failed"] == 0
    assert all(call <= 3 for call, _, _ in workers[0].calls)  # no work sent after the death was seen
    check_ledger(ctrl, trainer)


@pytest.mark.parametrize("batched", [False, True])
def test_worker_timeout_is_retired_and_its_groups_retried(batched):
    workers = [
        FakeRolloutWorker("w0", hang_on_calls={1}, batched=batched),
        FakeRolloutWorker("w1", batched=batched),
    ]
    ctrl, trainer, _ = make(12, workers, max_staleness=6, request_timeout_s=0.3)
    summary = bounded_run(ctrl.run())
    # the short bound fired (bounded_run's hard timeout guards a hang): request_timeout_s per group the
    # hung call carried
    match = re.search(r"\(groups? ([\d, ]+)\) did not answer within ([\d.]+)s", summary.dead_workers[0])
    assert match and float(match[2]) == pytest.approx(0.3 * len(match[1].split(",")))
    assert sorted(trained_prompts(trainer)) == list(range(12))
    check_ledger(ctrl, trainer)


@pytest.mark.parametrize("batched", [False, True])
def test_weights_reach_a_worker_that_loads_between_requests_while_it_still_generates(batched):
    """A worker with loads_between_requests gets each version as soon as it is published; its set_weights
    waits for the requests in flight (which keep their version). Meanwhile it gets requests for the
    new version only, which wait for the load."""
    workers = [
        FakeRolloutWorker(
            f"w{i}", latency=jittered(0.02, 0.5, i), loads_between_requests=True, batched=batched
        )
        for i in range(2)
    ]
    ctrl, trainer, _ = make(24, workers, max_staleness=1, max_in_flight_per_worker=3)
    summary = bounded_run(ctrl.run())
    assert summary.steps >= 5 and not summary.dead_workers
    assert sum(w.pushed_while_busy for w in workers) > 0
    assert sum(w.waited_for_load for w in workers) > 0
    for w in workers:
        assert w.weight_updates == sorted(w.weight_updates)
    lags = [
        version - weight_version
        for kind, _, weight_version, version in (e for e in trainer.events if e[0] == "train")
    ]
    assert lags and 0 <= min(lags) and max(lags) <= 1
    trained = trained_prompts(trainer)
    assert len(set(trained)) == len(trained) == 24 - summary.totals["dropped_stale"]
    check_workers(workers)  # no request saw two versions or came during a pending set_weights
    check_ledger(ctrl, trainer)


def test_weight_push_failure_retires_the_worker():
    workers = [FakeRolloutWorker("w0"), FakeRolloutWorker("w1", fail_set_weights=True)]
    ctrl, trainer, _ = make(8, workers)
    summary = bounded_run(ctrl.run())
    assert list(summary.dead_workers) == [1] and "set_weights" in summary.dead_workers[1]
    assert sorted(trained_prompts(trainer)) == list(range(8))


@pytest.mark.parametrize("raise_failures", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_failed_generations_are_retried_never_trained(raise_failures, batched):
    workers = [
        FakeRolloutWorker("w0", fail_prompts={1: 1, 2: 2}, raise_failures=raise_failures, batched=batched)
    ]
    ctrl, trainer, _ = make(8, workers, max_staleness=4)
    summary = bounded_run(ctrl.run())
    assert sorted(trained_prompts(trainer)) == list(range(8))
    assert summary.totals["retried"] == 3 and summary.dead_workers == {}
    assert all(b.num_samples == 4 for s in trainer.steps for b in s)
    check_ledger(ctrl, trainer)


@pytest.mark.parametrize("batched", [False, True])
def test_retry_budget_exhausted_is_a_clear_error(batched):
    workers = [
        FakeRolloutWorker("w0", fail_prompts={3: 10}, batched=batched),
        FakeRolloutWorker("w1", fail_prompts={3: 10}, batched=batched),
    ]
    ctrl, trainer, _ = make(8, workers, max_retries=2)
    with pytest.raises(RetryBudgetExhausted, match=r"prompt 3\) failed 3 times, more than max_retries=2"):
        bounded_run(ctrl.run())
    assert not trainer.open and 3 not in trained_prompts(trainer)
    assert ctrl.ledger.counts()["failed"] == 1
    check_ledger(ctrl, trainer)


def test_retry_budget_exhausted_in_the_last_step_still_raises():
    workers = [FakeRolloutWorker("w0", fail_prompts={1: 10}), FakeRolloutWorker("w1", fail_prompts={1: 10})]
    ctrl, trainer, _ = make(16, workers, num_steps=1, max_retries=0, max_outstanding_groups=8)
    with pytest.raises(RetryBudgetExhausted, match="prompt 1"):
        bounded_run(ctrl.run())
    assert not trainer.open
    check_ledger(ctrl, trainer)


def test_retry_budget_exhausted_drop_mode_goes_on():
    workers = [FakeRolloutWorker("w0", fail_prompts={3: 10})]
    ctrl, trainer, _ = make(8, workers, max_retries=1, on_retries_exhausted="drop", max_staleness=3)
    summary = bounded_run(ctrl.run())
    assert sorted(trained_prompts(trainer)) == [0, 1, 2, 4, 5, 6, 7]
    assert summary.totals["failed"] == 1 and summary.groups["failed"] == 1


@pytest.mark.parametrize("batched", [False, True])
def test_all_workers_dead_is_a_clear_error(batched):
    workers = [
        FakeRolloutWorker("w0", die_on_call=1, batched=batched),
        FakeRolloutWorker("w1", die_on_call=2, batched=batched),
    ]
    ctrl, trainer, _ = make(16, workers, max_retries=10)
    with pytest.raises(NoRolloutWorkersError, match="0 rollout worker.*worker 0: .*died"):
        bounded_run(ctrl.run())
    assert not trainer.open
    check_ledger(ctrl, trainer)


def test_a_group_stamped_with_another_version_stops_the_run():
    class Liar(FakeRolloutWorker):
        async def generate_group(self, prompt, weight_version):
            result = await super().generate_group(prompt, weight_version)
            result.weight_version += 1
            return result

    ctrl, trainer, _ = make(8, [Liar("liar")])
    with pytest.raises(AsyncGRPOError, match="weights changed during the request"):
        bounded_run(ctrl.run())
    assert ctrl.ledger.counts()["pending"] >= 1  # the group is kept, not lost
    check_ledger(ctrl, trainer)


@pytest.mark.parametrize("verb", ["begin", "train_group", "finish", "export_weights"])
def test_trainer_error_aborts_the_step_and_keeps_its_groups(verb):
    index = {"begin": 1, "train_group": 5, "finish": 1, "export_weights": 2}[verb]
    trainer = FakeTrainer(fail_on={verb: index})
    ctrl, trainer, _ = make(16, trainer=trainer, max_staleness=3)
    with pytest.raises(TrainerError, match=f"trainer {verb}\\(\\) failed: RuntimeError: injected failure"):
        bounded_run(ctrl.run())
    assert not trainer.open and trainer.version == ctrl.trainer_version
    if verb != "export_weights":  # export fails after the step closed
        assert trainer.version == 1 and trainer.events[-1] == ("abort", 1)
        assert len(ctrl.sampler) >= (1 if verb == "begin" else 2)  # the step's groups are back
    ctrl.ledger.check_settled()
    bounded_run(trainer.abort())  # abort stays idempotent
    bounded_run(trainer.abort())
    assert trainer.version == ctrl.trainer_version and not trainer.open


def test_trainer_hang_surfaces_within_the_timeout():
    trainer = FakeTrainer(hang_on={"train_group": 2})
    ctrl, trainer, _ = make(16, trainer=trainer, trainer_timeout_s=0.3)
    # the message names the short bound: trainer_timeout_s fired, not bounded_run's hard timeout
    with pytest.raises(TrainerError, match="trainer train_group\\(\\) did not answer within 0.3s"):
        bounded_run(ctrl.run())
    assert trainer.events[-1] == ("abort", 0) and trainer.version == 0


def test_a_finish_behind_queued_calls_gets_a_bound_for_each():
    """A trainer that trains groups while the controller goes on (`queued_calls`) has its finish
    bounded by trainer_timeout_s per queued call plus its own: 0.5 s of finish behind 2 queued calls
    passes with a 0.3 s timeout; without them it does not."""
    for queued, ok in ((2, True), (0, False)):
        trainer = FakeTrainer(finish_latency=0.5)
        trainer.queued_calls = queued
        ctrl, trainer, _ = make(8, trainer=trainer, trainer_timeout_s=0.3, num_steps=1)
        assert ctrl._trainer_bound() == pytest.approx(0.3 * (1 + queued))
        if ok:
            assert bounded_run(ctrl.run()).steps == 1
        else:
            with pytest.raises(TrainerError, match="finish\\(\\) did not answer within 0.3s"):
                bounded_run(ctrl.run())


def test_abort_that_fails_too_says_state_is_unknown():
    trainer = FakeTrainer(fail_on={"train_group": 1, "abort": 0})
    ctrl, trainer, _ = make(8, trainer=trainer)
    with pytest.raises(TrainerError, match="state is unknown"):
        bounded_run(ctrl.run())


def test_fake_trainer_abort_is_idempotent_and_keeps_version():
    async def body():
        t = FakeTrainer()
        await t.abort()
        await t.begin(object())
        await t.abort()
        await t.abort()
        assert t.version == 0 and not t.open
        await t.begin(object())
        assert await t.finish() == {"step_skipped": 1.0} and t.version == 0
        with pytest.raises(RuntimeError, match="without an open train step"):
            await t.finish()

    bounded_run(body())


# --------------------------------------------------------------------------- checkpoint and metrics


@pytest.mark.parametrize("with_codec", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_state_dict_resume_trains_every_prompt_once(with_codec, batched):
    """Every group created before the save is trained, saved buffered (with a codec: its samples) or saved
    to regenerate, exactly one of the three; the resumed run trains every other prompt once and never
    regenerates a group whose samples were saved."""
    codec = SamplesCodec(encode=lambda s: s, decode=lambda s: s) if with_codec else None
    workers = [FakeRolloutWorker(f"w{i}", latency=0.0, batched=batched) for i in range(2)]
    # generation far outpaces training: groups wait in the buffer when the run stops
    trainer = FakeTrainer(train_latency=0.02)
    ctrl, trainer, _ = make(
        24, workers, trainer, codec=codec, num_steps=2, max_staleness=8, max_outstanding_groups=12
    )
    bounded_run(ctrl.run())
    buffered = {g.group_id: g.prompt_id for g in ctrl.sampler.groups()}
    pending = set(ctrl.ledger.ids(GroupState.PENDING))
    state = json.loads(json.dumps(ctrl.state_dict()))
    assert state["step"] == 2 and state["trainer_version"] == 2
    saved_buffer = {item["group_id"] for item in state["buffer"]}
    requeue = {gid for gid, _, _ in state["requeue"]}
    trained = set(trainer.trained_group_ids)
    assert buffered, "no group was buffered at the save: the test checks nothing"
    assert len(trained) == 8 and ctrl.ledger.counts()["trained"] == 8
    if with_codec:
        assert saved_buffer == set(buffered) and requeue == pending
    else:
        assert saved_buffer == set() and requeue == pending | set(buffered)
    assert not (trained & saved_buffer) and not (trained & requeue) and not (saved_buffer & requeue)
    assert trained | saved_buffer | requeue == set(range(state["next_group_id"]))
    first = trained_prompts(trainer)

    workers2 = [FakeRolloutWorker(f"w{i}", batched=batched) for i in range(2)]
    resumed, trainer2, _ = make(
        24,
        workers2,
        trainer=FakeTrainer(start_version=2),
        codec=codec,
        max_staleness=8,
        max_outstanding_groups=12,
    )
    resumed.load_state_dict(state)
    summary = bounded_run(resumed.run())
    assert summary.data_exhausted and summary.steps == 6
    assert sorted(first + trained_prompts(trainer2)) == list(range(24))
    assert not trained & set(trainer2.trained_group_ids)
    regenerated = {prompt for w in workers2 for _, prompt, _ in w.calls}
    assert regenerated.isdisjoint(buffered.values()) if with_codec else set(buffered.values()) <= regenerated
    check_workers(workers2)


def test_a_settled_checkpoint_decides_the_next_step_whatever_the_timing_after_it():
    """checkpoint_state() finishes the groups in flight (saved with their samples, never redrawn) and
    seals the buffer: a run resumed from it trains the very next batch of the run that saved it, even
    with rollout workers of another speed (fresh version-2 groups then arrive first)."""
    codec = SamplesCodec(encode=lambda s: s, decode=lambda s: s)
    workers = [FakeRolloutWorker(f"w{i}", latency=jittered(0.03, 0.03, seed=i)) for i in range(2)]
    ctrl, trainer, _ = make(
        24, workers, FakeTrainer(train_latency=0.002), codec=codec, num_steps=4, max_in_flight_per_worker=3
    )
    saved: dict[str, dict] = {}

    async def on_step(step: int, metrics: dict) -> None:
        if step == 2:
            saved["plain"] = ctrl.state_dict()
            saved["settled"] = json.loads(json.dumps(await ctrl.checkpoint_state()))

    bounded_run(ctrl.run(on_step))
    plain, state = saved["plain"], saved["settled"]
    assert plain["requeue"], "no group was in flight at the checkpoint: the test checks nothing"
    assert state["requeue"] == [] and len(state["buffer"]) >= 4
    assert sorted(state["sampler"]["sealed"]) == sorted(item["group_id"] for item in state["buffer"])
    in_flight = {gid for gid, _, _ in plain["requeue"]}
    assert in_flight <= {item["group_id"] for item in state["buffer"]}  # finished, not redrawn

    def key(batches):
        return [(b.group_id, b.prompt_id, b.weight_version) for b in batches]

    fast = [FakeRolloutWorker(f"w{i}", latency=0.0) for i in range(2)]
    resumed, trainer2, _ = make(
        24, fast, FakeTrainer(start_version=2, train_latency=0.01), codec=codec, num_steps=4
    )
    resumed.load_state_dict(state)
    bounded_run(resumed.run())
    assert key(trainer2.steps[0]) == key(trainer.steps[2])
    assert any(b.weight_version < 2 for b in trainer.steps[2])  # sealed stale groups before fresh ones
    check_ledger(resumed, trainer2)
    check_workers(fast)


def test_load_state_dict_checks_the_trainer_version():
    ctrl, _, _ = make(8, num_steps=1)
    bounded_run(ctrl.run())
    state = ctrl.state_dict()
    other, _, _ = make(8)  # trainer at version 0, state at version 1
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="trainer_version 1 but the trainer is at 0"):
        bounded_run(other.run())
    with pytest.raises(ValueError, match="saved with num_items=8 but this dataset has num_items=9"):
        make(9)[0].load_state_dict(state)


def test_metrics():
    workers = [FakeRolloutWorker(f"w{i}", latency=0.01) for i in range(2)]
    ctrl, _, _ = make(16, workers, trainer=FakeTrainer(train_latency=0.005))
    metrics: list[dict] = []
    summary = bounded_run(ctrl.run(on_step=lambda step, m: metrics.append(m)))
    assert summary.data_exhausted and len(metrics) == summary.steps >= 3
    for m in metrics:
        assert 0.0 <= m["trainer_idle_fraction"] <= 1.0
        assert 0.0 <= m["generation_idle_fraction"] <= 1.0
        assert m["samples_per_s"] > 0 and 1 <= m["groups_admitted"] <= 4
        for key in (
            "groups_dropped_stale",
            "groups_retried",
            "total/admitted",
            "staleness/lag_0",
            "train/loss",
        ):
            assert key in m
    last = metrics[-1]
    assert sum(m["groups_admitted"] for m in metrics) == last["total/admitted"]
    assert last["total/admitted"] + last["total/dropped_stale"] == 16 and last["total/weight_pushes"] >= 2
    json.dumps(metrics)


def test_per_step_counts_add_up_to_the_totals_with_work_between_steps():
    """The steps' windows are back to back: groups that finish while `on_step` runs (here a checkpoint
    settling the groups in flight) count in the next step, so no count falls between two steps."""
    workers = [FakeRolloutWorker(f"w{i}", latency=0.01) for i in range(2)]
    ctrl, _, _ = make(32, workers, trainer=FakeTrainer(train_latency=0.002), num_steps=4)
    metrics: list[dict] = []
    between = []

    async def on_step(step, m):
        metrics.append(m)
        before = ctrl.meter.totals["generated_samples"]
        await ctrl.checkpoint_state()
        between.append(ctrl.meter.totals["generated_samples"] - before)

    bounded_run(ctrl.run(on_step=on_step))
    assert sum(between[:-1]) > 0, "nothing finished between two steps: the test checks nothing"
    last = metrics[-1]
    for k in COUNTERS:
        per_step = sum(m[f"groups_{k}" if k in GROUP_COUNTERS else k] for m in metrics)
        assert per_step == last[f"total/{k}"], k


def test_async_on_step_callback_is_awaited():
    ctrl, _, _ = make(8)
    seen = []

    async def on_step(step, metrics):
        await asyncio.sleep(0.01)
        seen.append(ctrl.state_dict()["step"])

    bounded_run(ctrl.run(on_step=on_step))
    assert seen == [1, 2]


# --------------------------------------------------------------------------- retained state


def container_sizes(root: object, exclude: list[object]) -> int:
    """The summed lengths of every list, tuple, dict, set and deque reachable from `root` through object
    attributes and container items, not entering the objects in `exclude` (nor functions, methods,
    classes, modules or the event loop, whose timer heap is asyncio's: they hold no run state here)."""
    skip = {id(x) for x in exclude}
    seen: set[int] = set()
    todo = [root]
    total = 0
    opaque = (str, bytes, int, float, bool, type(None), type, types.ModuleType, types.FunctionType)
    opaque += (types.MethodType, types.BuiltinFunctionType, enum.Enum, asyncio.AbstractEventLoop)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or id(obj) in skip or isinstance(obj, opaque):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            total += len(obj)
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            total += len(obj)
            todo.extend(obj)
        else:
            todo.extend(getattr(obj, "__dict__", {}).values())
            todo.extend(getattr(obj, name) for name in getattr(obj, "__slots__", ()) if hasattr(obj, name))
    return total


def test_retained_state_does_not_grow_with_the_number_of_groups():
    """2,000 dry-run groups: what the controller holds after 2,000 trained groups is what it held after
    200 (the ledger keeps live groups and intervals of ended ids, the sampler and the pool only what is
    outstanding). The dataset, the workers and the trainer double (which records every call) are left
    out: they are the caller's."""
    dataset = fake_dataset(2000)
    workers = [FakeRolloutWorker(f"w{i}", latency=0.0) for i in range(2)]
    trainer = FakeTrainer()
    cfg = AsyncGRPOConfig(
        target_prompt_groups_per_step=4, max_staleness=1, num_steps=501, num_epochs=2, trainer_timeout_s=5.0
    )
    ctrl = AsyncGRPOController(cfg, dataset, workers, trainer, make_fake_prepare(), FAKE_LOSS)
    cap = cfg.outstanding_cap
    seen: dict[int, dict[str, int]] = {}

    def measure(step: int, metrics: dict) -> None:
        if step not in (50, 500):
            return
        seen[step] = {
            "trained": ctrl.ledger.counts()["trained"],
            "ledger": ctrl.ledger.retained(),
            "live": len(ctrl.ledger.states),
            "sampler": len(ctrl.sampler),
            "retry": len(ctrl.pool.retry),
            "in_flight": len(ctrl.pool.in_flight),
            "meter": container_sizes(ctrl.meter, []),
            "everything": container_sizes(ctrl, [dataset, trainer, *workers]),
        }

    summary = bounded_run(ctrl.run(on_step=measure), timeout=60.0)
    assert summary.steps == 501
    early, late = seen[50], seen[500]
    assert early["trained"] == 200 and late["trained"] == 2000
    assert late.pop("trained") - early.pop("trained") == 1800
    assert late == early, (early, late)
    assert late["live"] <= cap and late["ledger"] <= 2 * cap + 1
    assert late["sampler"] + late["retry"] + late["in_flight"] <= cap
