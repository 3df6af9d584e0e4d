"""Split train step (begin / train_microbatch / finish / abort) is exactly train()."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch
from helpers import params_of, policy_cfg
from posttrain.algorithms.losses import ClippedPGLoss, NLLLoss
from posttrain.policy.lifecycle import PhaseError
from posttrain.policy.policy import Policy

SGD = {"name": "torch.optim.SGD", "lr": 1.0}


def compare(m_ref, p_ref, m, p, rtol=1e-6):
    assert m_ref.keys() == m.keys()
    for k in m_ref:
        if k == "num_microbatches":  # how the data was cut, legitimately different
            continue
        assert m[k] == pytest.approx(m_ref[k], rel=rtol, abs=1e-9), k
    for k in p_ref:
        torch.testing.assert_close(p[k], p_ref[k], rtol=rtol, atol=1e-7)


def run_train(loss_fn, batch, **cfg):
    policy = Policy(policy_cfg(**cfg))
    try:
        return policy.train(batch, loss_fn), params_of(policy)
    finally:
        policy.shutdown()


def run_split(loss_fn, batch, cuts, **cfg):
    policy = Policy(policy_cfg(**cfg))
    try:
        policy.begin_train_step(loss_fn)
        for lo, hi in zip(cuts, cuts[1:]):
            policy.train_microbatch(batch[lo:hi])
        return policy.finish_train_step(), params_of(policy)
    finally:
        policy.shutdown()


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("mode", ["fixed", "packed"])
def test_split_equals_train(token_level, mode):
    batch = random_batch(8, 16, rl=True)
    loss = ClippedPGLoss(token_level_loss=token_level, reference_policy_kl_penalty=0.1)
    cfg = dict(optimizer=SGD, microbatch={"mode": mode, "max_tokens": 40, "train_micro_batch_size": 2})
    ref = run_train(loss, batch, **cfg)
    split = run_split(loss, batch, [0, 3, 4, 8], **cfg)  # uneven sizes 3, 1, 4
    compare(*ref, *split)
    assert split[0]["num_valid_samples"] == 7.0  # a raw count: summed, never divided


@pytest.mark.distributed
def test_split_on_two_ray_ranks_with_uneven_microbatch_counts(ray_session):
    batch = random_batch(8, 16, rl=True)
    loss = ClippedPGLoss(token_level_loss=False)
    ref = run_train(loss, batch, optimizer=SGD)
    cfg = dict(
        optimizer=SGD,
        microbatch={"mode": "dynamic", "max_tokens": 16},
        cluster={"backend": "ray", "num_workers": 2, "timeout_s": 120},
    )
    # calls of 3 rows (ranks get 2 and 1) and 5 rows (3 and 2): different micro-batch counts per rank
    split = run_split(loss, batch, [0, 3, 8], **cfg)
    compare(*ref, *split, rtol=1e-5)


class FailOnCall:
    """Wraps a loss and raises on its n-th call."""

    def __init__(self, loss, n):
        self.loss, self.n, self.calls = loss, n, 0
        self.loss_type, self.metric_kinds, self.required_keys = (
            loss.loss_type,
            loss.metric_kinds,
            loss.required_keys,
        )

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("injected failure")
        return self.loss(*args)


def test_failed_microbatch_then_abort_equals_run_without_it():
    batch = random_batch(8, 16, rl=True)
    cfg = dict(microbatch={"train_micro_batch_size": 2})
    clean = Policy(policy_cfg(**cfg))
    m_clean = clean.train(batch, ClippedPGLoss())
    faulty = Policy(policy_cfg(**cfg))
    faulty.begin_train_step(FailOnCall(ClippedPGLoss(), 2))
    with pytest.raises(RuntimeError, match="injected failure"):
        faulty.train_microbatch(batch)
    worker = faulty.group.workers[0]
    assert worker.model.training  # the mode it changed is restored
    faulty.abort_train_step()
    faulty.abort_train_step()  # idempotent
    assert faulty.get_states()[0]["trainer_version"] == 0
    assert worker.scheduler.last_epoch == 0 and not worker.optimizer.state
    m = faulty.train(batch, ClippedPGLoss())
    assert m["loss"] == pytest.approx(m_clean["loss"], rel=1e-6)
    a, b = params_of(clean), params_of(faulty)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_finish_that_fails_aborts_the_step_and_the_next_equals_a_clean_one():
    """finish_train_step failing after the gradients were scaled (here the optimizer's step: e.g. an
    out-of-memory error allocating its state) aborts the step on the worker as the driver marks it:
    nothing applied, no gradients kept (finishing again would scale them twice), and the next step
    equals a clean run's first."""
    batch = random_batch(8, 16, rl=True)
    clean = Policy(policy_cfg())
    m_clean = clean.train(batch, ClippedPGLoss())
    faulty = Policy(policy_cfg())
    worker = faulty.group.workers[0]
    real_step = worker.optimizer.step
    worker.optimizer.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected: no memory"))
    faulty.begin_train_step(ClippedPGLoss())
    faulty.train_microbatch(batch)
    with pytest.raises(RuntimeError, match="injected: no memory"):
        faulty.finish_train_step()
    state = faulty.get_states()[0]
    assert not faulty.lifecycle.step_open and not state["step_open"] and state["trainer_version"] == 0
    assert all(p.grad is None for p in worker.model.parameters())
    assert worker.scheduler.last_epoch == 0
    faulty.prepare_for_lp_inference()  # the driver's phase is the worker's
    faulty.prepare_for_training()
    worker.optimizer.step = real_step
    m = faulty.train(batch, ClippedPGLoss())
    assert m["loss"] == pytest.approx(m_clean["loss"], rel=1e-6)
    a, b = params_of(clean), params_of(faulty)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lifecycle_errors():
    policy = Policy(policy_cfg())
    batch = random_batch(8, 16)
    with pytest.raises(
        PhaseError, match=r"train_microbatch\(\) called without an open train step; call begin_train_step"
    ):
        policy.train_microbatch(batch)
    with pytest.raises(PhaseError, match=r"finish_train_step\(\) called without an open train step"):
        policy.finish_train_step()
    with pytest.raises(PhaseError, match=r"without an open train step"):
        policy.group.workers[0].finish_train_step()
    policy.begin_train_step(NLLLoss())
    with pytest.raises(PhaseError, match=r"already open; call finish_train_step\(\) or abort_train_step\(\)"):
        policy.begin_train_step(NLLLoss())
    with pytest.raises(PhaseError, match="already open"):
        policy.group.workers[0].begin_train_step(NLLLoss())
    policy.train_microbatch(batch)
    assert policy.get_states()[0]["trainer_version"] == 0
    m = policy.finish_train_step()
    assert m["trainer_version"] == 1.0 and policy.get_states()[0]["trainer_version"] == 1


def test_lr_recorded_before_scheduler_steps():
    cfg = policy_cfg(scheduler=[{"kind": "linear", "steps": 4, "start_factor": 0.25, "end_factor": 1.0}])
    policy = Policy(cfg)
    batch = random_batch(8, 16)
    lrs = []
    for _ in range(3):
        policy.begin_train_step(NLLLoss())
        policy.train_microbatch(batch)
        lrs.append(policy.finish_train_step()["lr"])
    assert lrs == pytest.approx([0.25e-2, 0.4375e-2, 0.625e-2])
