"""The normalization contract: one optimizer step does not depend on how the global batch is cut."""

from __future__ import annotations

import pytest

from conftest import random_batch
from helpers import assert_params_close, params_of, policy_cfg
from posttrain.algorithms.losses import ClippedPGLoss, NLLLoss
from posttrain.policy.policy import Policy

LOSSES = {
    "pg_token": lambda: ClippedPGLoss(reference_policy_kl_penalty=0.05),
    "pg_seq": lambda: ClippedPGLoss(token_level_loss=False, reference_policy_kl_penalty=0.05),
    "nll": lambda: NLLLoss(),
}


# SGD with lr=1 makes the parameter update equal to the (clipped) gradient, so comparing updated
# parameters compares gradients; Adam's first step g/|g| would amplify float noise of near-zero grads.
SGD = {"name": "torch.optim.SGD", "lr": 1.0}


def one_step(loss_name: str, **cfg_overrides):
    cfg_overrides.setdefault("optimizer", SGD)
    policy = Policy(policy_cfg(**cfg_overrides))
    try:
        batch = random_batch(8, 16, rl=True)
        metrics = policy.train(batch, LOSSES[loss_name]())
        return metrics, params_of(policy)
    finally:
        policy.shutdown()


def assert_same_step(ref, other, keys=("loss", "grad_norm", "global_valid_toks", "global_valid_seqs")):
    (m_ref, p_ref), (m, p) = ref, other
    for k in keys:
        assert m[k] == pytest.approx(m_ref[k], rel=1e-5, abs=1e-7), k
    assert_params_close(p_ref, p)


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_microbatch_size_does_not_change_the_step(loss_name):
    ref = one_step(loss_name, microbatch={"train_micro_batch_size": 8})
    for mbs in (1, 4):
        assert_same_step(ref, one_step(loss_name, microbatch={"train_micro_batch_size": mbs}))


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_dynamic_batching_and_packing_match_fixed(loss_name):
    ref = one_step(loss_name, microbatch={"train_micro_batch_size": 3})
    assert_same_step(ref, one_step(loss_name, microbatch={"mode": "dynamic", "max_tokens": 40}))
    assert_same_step(ref, one_step(loss_name, microbatch={"mode": "packed", "max_tokens": 40}))


def test_sample_mask_zero_rows_do_not_contribute():
    """Changing the tokens of a masked-out sample changes nothing."""
    policy_a = Policy(policy_cfg(optimizer=SGD))
    policy_b = Policy(policy_cfg(optimizer=SGD))
    batch = random_batch(8, 16, rl=True, masked=(5,))
    other = batch.clone()
    other["input_ids"][5] = (other["input_ids"][5] + 7) % 60 + 4
    other["advantages"][5] = 100.0
    m_a = policy_a.train(batch, ClippedPGLoss())
    m_b = policy_b.train(other, ClippedPGLoss())
    assert m_a["loss"] == pytest.approx(m_b["loss"], rel=1e-6)
    assert_params_close(params_of(policy_a), params_of(policy_b))


def test_two_global_batches_take_two_steps():
    policy = Policy(policy_cfg(train_global_batch_size=4))
    metrics = policy.train(random_batch(8, 16, rl=True), NLLLoss())
    assert metrics["num_optimizer_steps"] == 2
    assert policy.get_states()[0]["trainer_version"] == 2


@pytest.mark.distributed
@pytest.mark.parametrize("loss_name", ["pg_token", "pg_seq", "nll"])
def test_two_ray_ranks_fsdp2_match_one_local_rank(loss_name, ray_session):
    ref = one_step(loss_name, microbatch={"train_micro_batch_size": 2})
    two = one_step(
        loss_name,
        microbatch={"mode": "packed", "max_tokens": 40},
        cluster={"backend": "ray", "num_workers": 2},
    )
    assert_same_step(ref, two)


@pytest.mark.parametrize(
    "parallel",
    [{"activation_checkpointing": True}, {"fsdp": "always"}, {"fsdp": "always", "fsdp_cpu_offload": True}],
    ids=["activation_checkpointing", "fsdp_one_rank", "fsdp_cpu_offload"],
)
def test_parallel_options_do_not_change_the_step(parallel):
    ref = one_step("pg_token")
    assert_same_step(ref, one_step("pg_token", parallel=parallel))
