"""The phase state machine: every verb in every phase works or raises PhaseError with the right fix,
and a refused call leaves the worker exactly as it was."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import random_batch
from helpers import params_of, policy_cfg
from posttrain.algorithms.losses import ClippedPGLoss, NLLLoss
from posttrain.policy.lifecycle import Phase, PhaseError
from posttrain.policy.policy import Policy

BATCH = random_batch(8, 16, rl=True)

# verb -> callable(target) ; the phases it must accept
VERBS = {
    "train": (lambda p: p.train(BATCH, NLLLoss()), {Phase.TRAINING}),
    "begin_train_step": (lambda p: p.begin_train_step(NLLLoss()), {Phase.TRAINING}),
    "get_logprobs": (lambda p: p.get_logprobs(BATCH), {Phase.TRAINING, Phase.INFERENCE}),
    "get_reference_policy_logprobs": (
        lambda p: p.get_reference_policy_logprobs(BATCH),
        {Phase.TRAINING, Phase.INFERENCE},
    ),
    "get_topk_logits": (lambda p: p.get_topk_logits(BATCH, 2), {Phase.TRAINING, Phase.INFERENCE}),
    "full_state_dict": (lambda p: p.full_state_dict(), {Phase.TRAINING, Phase.INFERENCE}),
}
ENTER = {
    Phase.TRAINING: lambda p: p.prepare_for_training(),
    Phase.INFERENCE: lambda p: p.prepare_for_lp_inference(),
    Phase.OFFLOADED: lambda p: p.offload_after_refit(),
}


def snapshot(policy: Policy, worker) -> tuple:
    return policy.get_states(), policy.lifecycle.snapshot(), params_of_state(worker)


def params_of_state(worker):
    return {n: p.detach().clone() for n, p in worker.model.named_parameters()}


@pytest.fixture(scope="module")
def policy():
    return Policy(policy_cfg())


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("verb_name", list(VERBS))
def test_phase_matrix_local(policy, phase, verb_name):
    call, allowed = VERBS[verb_name]
    policy.abort_train_step()
    ENTER[phase](policy)
    worker = policy.group.workers[0]
    assert worker.lifecycle.phase == phase == policy.lifecycle.phase
    if phase in allowed:
        call(policy)
        policy.abort_train_step()
        return
    before = snapshot(policy, worker)
    fix = "prepare_for_training()" if allowed == {Phase.TRAINING} else "prepare_for_lp_inference()"
    pattern = rf"{verb_name}\(\) needs phase .* but the worker is {phase.value}; call {re.escape(fix)}"
    with pytest.raises(PhaseError, match=pattern):
        call(policy)
    # the worker refuses too when called directly (driver bypassed)
    with pytest.raises(PhaseError, match=phase.value):
        call(worker)
    after = snapshot(policy, worker)
    assert before[0] == after[0] and before[1] == after[1]
    assert all(torch.equal(before[2][k], after[2][k]) for k in before[2])


def test_transitions_are_idempotent_and_round_trip_is_exact():
    policy = Policy(policy_cfg())
    reference = Policy(policy_cfg())
    for p in (policy, reference):
        p.train(BATCH, ClippedPGLoss())
    for _ in range(2):
        policy.offload_before_refit()
    for _ in range(2):
        policy.offload_after_refit()
    assert policy.lifecycle.phase == Phase.OFFLOADED
    for _ in range(2):
        policy.prepare_for_lp_inference()
    for _ in range(2):
        policy.prepare_for_training()
    m1 = policy.train(BATCH, ClippedPGLoss())
    m2 = reference.train(BATCH, ClippedPGLoss())
    assert m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]
    a, b = params_of(policy), params_of(reference)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = policy.group.workers[0].optimizer.state_dict()["state"]
    sb = reference.group.workers[0].optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_open_step_pins_the_phase():
    policy = Policy(policy_cfg())
    policy.begin_train_step(NLLLoss())
    for name in (
        "prepare_for_lp_inference",
        "offload_after_refit",
        "offload_before_refit",
        "prepare_for_training",
    ):
        with pytest.raises(
            PhaseError, match=rf"{name}\(\) called while a split train step is open.*abort_train_step"
        ):
            getattr(policy, name)()
    assert policy.get_states()[0]["phase"] == "TRAINING"
    policy.abort_train_step()
    policy.offload_after_refit()


@pytest.mark.distributed
def test_phase_errors_on_two_ray_ranks(ray_session):
    policy = Policy(policy_cfg(cluster={"backend": "ray", "num_workers": 2}))
    try:
        policy.offload_after_refit()
        assert [s["phase"] for s in policy.get_states()] == ["OFFLOADED", "OFFLOADED"]
        with pytest.raises(
            PhaseError, match=r"train\(\) needs phase TRAINING.*call prepare_for_training\(\)"
        ):
            policy.train(BATCH, NLLLoss())
        with pytest.raises(PhaseError, match=r"call prepare_for_lp_inference\(\)"):
            policy.get_logprobs(BATCH)
        # workers called directly refuse as well (the error crosses the Ray boundary as a PhaseError)
        with pytest.raises(PhaseError, match="OFFLOADED"):
            policy.group.run("get_logprobs", per_rank=[(BATCH[:4],), (BATCH[4:],)])
        policy.prepare_for_lp_inference()
        lp = policy.get_logprobs(BATCH)
        with pytest.raises(PhaseError, match="prepare_for_training"):
            policy.begin_train_step(NLLLoss())
        policy.prepare_for_training()
        policy.train(BATCH, NLLLoss())
        assert [s["trainer_version"] for s in policy.get_states()] == [1, 1]
        assert lp.shape == (8, 16)
    finally:
        policy.shutdown()
