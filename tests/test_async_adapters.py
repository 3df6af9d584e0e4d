"""The adapters of the asynchronous controller: the real `Policy` as its trainer, and Ray rollout actors.

The Policy tests train a tiny model on CPU through the split step (a few seconds). The Ray test starts
rollout actors, kills one mid-run and checks its groups are retried on the others (`distributed`).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest
import torch

import doubles
from doubles import (
    FAKE_LOSS,
    FakeRolloutWorker,
    FakeTrainer,
    fake_dataset,
    make_fake_prepare,
    policy_prepare_group,
)
from posttrain.algorithms.async_grpo import trainer as trainer_module
from posttrain.algorithms.async_grpo.config import AsyncGRPOConfig
from posttrain.algorithms.async_grpo.contracts import TrainerError
from posttrain.algorithms.async_grpo.controller import AsyncGRPOController
from posttrain.algorithms.async_grpo.ledger import BufferedGroup, GroupState
from posttrain.algorithms.async_grpo.trainer import PolicyTrainer, SerialThread
from posttrain.algorithms.losses import ClippedPGLoss
from posttrain.data.batch import make_batch
from posttrain.rollout.ray_worker import RayRolloutWorker

HARD_TIMEOUT_S = 60.0


def bounded_run(coro, timeout: float = HARD_TIMEOUT_S):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def cfg(**overrides) -> AsyncGRPOConfig:
    base = dict(
        target_prompt_groups_per_step=2,
        max_staleness=1,
        shuffle=False,
        request_timeout_s=20.0,
        weight_sync_timeout_s=20.0,
        trainer_timeout_s=30.0,
        admission_timeout_s=40.0,
        shutdown_timeout_s=5.0,
    )
    return AsyncGRPOConfig(**(base | overrides))


def test_serial_thread_runs_calls_in_order_and_survives_a_hung_call():
    thread = SerialThread("test-serial")
    release = threading.Event()
    order = []

    async def body():
        assert await thread.call(lambda: order.append(1) or threading.current_thread().name) == "test-serial"
        with pytest.raises(ZeroDivisionError):
            await thread.call(lambda: 1 / 0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(thread.call(release.wait), 0.05)
        queued = asyncio.ensure_future(thread.call(order.append, 2))
        await asyncio.sleep(0.05)
        assert order == [1]  # serialized behind the hung call
        release.set()
        await queued
        assert order == [1, 2]

    bounded_run(body(), 5.0)
    thread.close()


def test_a_closed_serial_thread_hands_its_thread_to_the_next_one(monkeypatch):
    """The OS thread outlives its SerialThread (a fresh thread starts cold) but never serves two at
    once: a closed one refuses calls, and one still stuck in a call keeps its thread."""
    monkeypatch.setattr(trainer_module, "_MAX_PARKED", 100)  # threads parked by earlier tests stay

    async def ident(thread: SerialThread) -> tuple[int, str]:
        return await thread.call(lambda: (threading.get_ident(), threading.current_thread().name))

    first = SerialThread("first")
    tid, _ = bounded_run(ident(first), 5.0)
    arg = threading.Event()  # the last call's argument: a parked thread must not keep it alive
    alive = weakref.ref(arg)
    bounded_run(first.call(arg.set), 5.0)
    del arg
    first.close()
    with pytest.raises(RuntimeError, match="closed"):
        bounded_run(ident(first), 5.0)
    deadline = time.monotonic() + 5.0
    while first._server not in trainer_module._PARKED and time.monotonic() < deadline:
        time.sleep(0.005)  # the thread parks once it has taken the close
    gc.collect()
    assert alive() is None
    second = SerialThread("second")
    got = bounded_run(ident(second), 5.0)
    assert got == (tid, "second")  # the same thread, under its new owner's name
    release = threading.Event()

    async def hang() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(second.call(release.wait), 0.05)

    bounded_run(hang(), 5.0)
    second.close()  # stuck in release.wait: not parked
    third = SerialThread("third")
    assert bounded_run(ident(third), 5.0)[0] != tid
    release.set()
    third.close()


# --------------------------------------------------------------------------- the real Policy


@pytest.fixture(scope="module")
def policy():
    from posttrain.policy.config import PolicyConfig
    from posttrain.policy.policy import Policy

    p = Policy(PolicyConfig(optimizer={"lr": 1e-3}))
    yield p
    p.shutdown()


def to_batch(group: BufferedGroup) -> object:
    """A stand-in for the sync loop's helpers: the group's samples as a batch with advantages."""
    g = torch.Generator().manual_seed(group.group_id)
    b, t = group.num_samples, 12
    ids = torch.randint(4, 60, (b, t), generator=g)
    token_mask = torch.ones(b, t)
    token_mask[:, :3] = 0
    rewards = torch.tensor([s["reward"] for s in group.samples])
    adv = (rewards - rewards.mean())[:, None].expand(b, t).clone()
    if adv.abs().sum() == 0:
        return None
    return make_batch(
        input_ids=ids,
        input_lengths=torch.full((b,), t),
        token_mask=token_mask,
        sample_mask=torch.ones(b),
        advantages=adv,
        generation_logprobs=-torch.rand(b, t, generator=g) - 2.0,
    )


def test_policy_trainer_trains_streamed_groups(policy):
    trainer = PolicyTrainer(policy)
    start = trainer.version
    before = {k: v.clone() for k, v in policy.full_state_dict().items()}
    workers = [FakeRolloutWorker("w0", latency=0.01), FakeRolloutWorker("w1", latency=0.02)]
    run_cfg = cfg(num_steps=2)
    loss = ClippedPGLoss(run_cfg.loss)  # the async default: truncated importance sampling
    ctrl = AsyncGRPOController(
        run_cfg, fake_dataset(8), workers, trainer, policy_prepare_group(trainer, to_batch), loss
    )
    metrics = []
    summary = bounded_run(ctrl.run(on_step=lambda step, m: metrics.append(m)))
    assert summary.steps == 2 and trainer.version == start + 2
    assert policy.get_states()[0] == {
        "phase": "TRAINING",
        "step_open": False,
        "comms_up": True,
        "trainer_version": start + 2,
    }
    assert all(m["train/importance_weight"] > 0 for m in metrics)  # IS correction is on
    after = policy.full_state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    trainer.close()


def test_policy_trainer_error_aborts_the_policy_step(policy):
    trainer = PolicyTrainer(policy)
    start = trainer.version
    calls = []

    def failing_to_batch(group: BufferedGroup):
        calls.append(group.group_id)
        if len(calls) == 2:  # the step is open: the first group is in
            raise ValueError("advantage computation blew up")
        return to_batch(group)

    run_cfg = cfg(num_steps=2)
    ctrl = AsyncGRPOController(
        run_cfg,
        fake_dataset(8),
        [FakeRolloutWorker("w0")],
        trainer,
        policy_prepare_group(trainer, failing_to_batch),
        ClippedPGLoss(run_cfg.loss),
    )
    with pytest.raises(TrainerError, match="prepare_group\\(\\) failed: ValueError: advantage computation"):
        bounded_run(ctrl.run())
    state = policy.get_states()[0]
    assert not state["step_open"] and state["trainer_version"] == start == trainer.version
    assert len(ctrl.sampler) >= 2 and not ctrl.ledger.ids(GroupState.TRAINING)
    bounded_run(trainer.abort())  # idempotent on the real Policy too
    bounded_run(trainer.abort())
    assert policy.get_states()[0]["trainer_version"] == start
    trainer.close()


# --------------------------------------------------------------------------- Ray rollout actors


@pytest.fixture
def doubles_by_value(ray_session):
    """Ray, with tests/doubles.py pickled by value: tests/ is not on the actors' path."""
    ray_session.cloudpickle.register_pickle_by_value(doubles)
    yield ray_session
    ray_session.cloudpickle.unregister_pickle_by_value(doubles)


@pytest.mark.distributed
def test_ray_rollout_worker_death_is_retried_elsewhere(doubles_by_value):
    ray = doubles_by_value
    actor_cls = ray.remote(num_cpus=0)(FakeRolloutWorker)
    fail = dict(fail_prompts={5: 1}, raise_failures=True)  # a RolloutFailure raised inside the actor
    actors = [
        actor_cls.remote("r0", latency=0.5),  # slow: it has groups in flight when it is killed
        actor_cls.remote("r1", latency=0.02, **fail),
        actor_cls.remote("r2", latency=0.03, **fail),
    ]
    ray.get([a.__ray_ready__.remote() for a in actors], timeout=180)  # actor start-up on a loaded 2-core box
    workers = [RayRolloutWorker(a, name=f"r{i}") for i, a in enumerate(actors)]
    trainer = FakeTrainer(finish_latency=0.05)

    killed_in_flight: list[int] = []

    async def on_step(step, metrics):
        """Kill r0 after step 1 while it has groups in flight (on a loaded machine it may be between
        calls at that moment: then wait for its next one, or the kill would go unnoticed)."""
        if step != 1:
            return
        slot = ctrl.pool.slots[0]
        for _ in range(1000):
            if slot.in_flight:
                break
            await asyncio.sleep(0.01)
        killed_in_flight.extend(slot.in_flight)
        ray.kill(actors[0])

    ctrl = AsyncGRPOController(
        # max_retries=3: prompt 5 may be lost with r0, then fail once on r1 and once on r2 (4 attempts)
        cfg(target_prompt_groups_per_step=3, max_staleness=8, max_in_flight_per_worker=2, max_retries=3),
        fake_dataset(18),
        workers,
        trainer,
        make_fake_prepare(),
        FAKE_LOSS,
    )
    summary = bounded_run(ctrl.run(on_step=on_step))  # a hang fails at bounded_run's bound
    assert sorted(b.prompt_id for s in trainer.steps for b in s) == list(range(18))
    assert killed_in_flight  # r0 died with work in flight
    assert list(summary.dead_workers) == [0] and "Ray actor is gone" in summary.dead_workers[0]
    assert summary.totals["retried"] >= 2  # prompt 5 once, and what r0 had in flight
    for a in actors[1:]:
        assert ray.get(a.__ray_call__.remote(lambda self: self.violations)) == []


class _FakeRay:
    """The few Ray calls `start_ray_workers` makes; `ready` fails (or times out) as `fail` says."""

    class exceptions:
        class GetTimeoutError(Exception):
            pass

        class ActorDiedError(Exception):
            pass

    def __init__(self, fail: Exception) -> None:
        self.fail, self.started, self.killed = fail, [], []
        ray = self

        class Handle:
            def __init__(self, name: str) -> None:
                self.name = name
                self.ready = type("Method", (), {"remote": staticmethod(lambda: name)})()

        class ActorClass:
            @staticmethod
            def remote(cfg, name, threads):
                ray.started.append(name)
                return Handle(name)

        self.actor_class = ActorClass

    def remote(self, **opts):
        return lambda cls: self.actor_class

    def get(self, refs, timeout):
        raise self.fail

    def kill(self, actor) -> None:
        self.killed.append(actor.name)


@pytest.mark.parametrize("why", ["died", "timeout", "interrupted"])
def test_ray_actors_that_started_are_killed_when_another_fails_to(monkeypatch, why):
    """One actor dies in its constructor (e.g. out of memory building its engine), the wait times out or
    is interrupted: every actor is killed (the caller gets no handles), and the error goes on."""
    from posttrain.parallel import cluster
    from posttrain.rollout import ray_worker
    from posttrain.rollout.config import RolloutConfig

    fail, expect, match = {
        "died": (_FakeRay.exceptions.ActorDiedError("rollout-1: CUDA out of memory"), None, "out of memory"),
        "timeout": (_FakeRay.exceptions.GetTimeoutError(), TimeoutError, "did not start within rollout"),
        "interrupted": (KeyboardInterrupt(), KeyboardInterrupt, None),
    }[why]
    expect = expect or type(fail)
    ray = _FakeRay(fail)
    monkeypatch.setattr(cluster, "ensure_ray", lambda address: ray)
    with pytest.raises(expect, match=match):
        ray_worker.start_ray_workers(None, RolloutConfig(backend="ray", num_workers=3, timeout_s=5))
    assert ray.killed == ray.started == ["rollout-0", "rollout-1", "rollout-2"]


class _HeldFinishPolicy:
    """The Policy verbs PolicyTrainer uses; the first `finish_train_step` is held until `release`."""

    def __init__(self) -> None:
        self.version, self.batch, self.applied = 0, [], []
        self.release = threading.Event()

    def get_states(self):
        return [{"trainer_version": self.version}]

    def prepare_for_training(self):
        pass

    def begin_train_step(self, loss_fn):
        self.batch = []

    def train_microbatch(self, batch):
        self.batch.append(batch)

    def finish_train_step(self):
        self.release.wait(HARD_TIMEOUT_S)
        self.applied.append(self.batch)
        self.version += 1
        return {"loss": 0.0}

    def abort_train_step(self):
        pass  # idempotent, as the Policy's: nothing open after a finish


def test_a_finish_that_outlives_its_bound_but_completes_counts_its_step_once():
    """finish_train_step outlives trainer_timeout_s, then completes on the policy thread before the abort
    queued behind it: the optimizer step is applied, so the error says so and its groups are trained
    (never trained again), the controller's trainer version and step follow the policy's."""
    policy = _HeldFinishPolicy()

    class ReleasingTrainer(PolicyTrainer):
        async def abort(self) -> None:
            policy.release.set()  # the controller gave up on the finish: let it complete, then abort
            await super().abort()

    trainer = ReleasingTrainer(policy)

    async def prepare(group, version):
        return group.prompt_id

    ctrl = AsyncGRPOController(
        cfg(num_steps=2, trainer_timeout_s=1.0),
        fake_dataset(8),
        [FakeRolloutWorker("w0")],
        trainer,
        prepare,
        FAKE_LOSS,
    )
    with pytest.raises(
        TrainerError, match="finish completed before the abort: its optimizer step is applied"
    ):
        bounded_run(ctrl.run())
    assert policy.applied == [[0, 1]]
    assert (ctrl.trainer_version, ctrl.step, trainer.version) == (1, 1, 1)
    assert not {0, 1} & {g.prompt_id for g in ctrl.sampler.groups()}
    bounded_run(ctrl.run())  # going on trains the next groups, not these again
    assert policy.applied == [[0, 1], [2, 3]] and ctrl.trainer_version == policy.version == 2
