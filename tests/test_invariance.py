"""The normalization contract: one optimizer step does not depend on how the global batch is cut."""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import random_batch
from helpers import assert_only_adapters_moved, assert_params_close, full_params, params_of, policy_cfg
from posttrain.algorithms.losses import ClippedPGLoss, NLLLoss
from posttrain.data.normalization import LossType
from posttrain.policy.policy import Policy
from posttrain.policy.train_step import merge_step_metrics
from posttrain.policy.worker import PolicyWorker

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
    batch = random_batch(8, 16, rl=True)
    policy = Policy(policy_cfg(train_global_batch_size=4))
    metrics = policy.train(batch, NLLLoss())
    assert metrics["num_optimizer_steps"] == 2
    assert policy.get_states()[0]["trainer_version"] == 2
    # the same two steps one call each: the counts add up, the version is the last step's
    ref = Policy(policy_cfg(train_global_batch_size=4))
    first, second = ref.train(batch[:4], NLLLoss()), ref.train(batch[4:], NLLLoss())
    counts = ("global_valid_seqs", "global_valid_toks", "num_microbatches", "num_valid_samples")
    assert {k: metrics[k] for k in counts} == {k: first[k] + second[k] for k in counts}
    assert metrics["trainer_version"] == second["trainer_version"] == 2.0
    assert metrics["lr"] == pytest.approx((first["lr"] + second["lr"]) / 2)


def test_merging_steps_sums_counts_and_keeps_the_last_version():
    steps = [
        {"global_valid_seqs": 4.0, "global_valid_toks": 0.0, "num_microbatches": 1.0, "step_skipped": 1.0},
        {
            "global_valid_seqs": 3.0,
            "global_valid_toks": 30.0,
            "num_microbatches": 2.0,
            "inert_seqs_skipped": 1.0,
            "grad_norm": 2.0,
            "lr": 0.1,
            "trainer_version": 7.0,
        },
        {
            "global_valid_seqs": 1.0,
            "global_valid_toks": 10.0,
            "num_microbatches": 1.0,
            "inert_seqs_skipped": 0.0,
            "grad_norm": 4.0,
            "lr": 0.3,
            "trainer_version": 8.0,
        },
    ]
    merged = merge_step_metrics(steps, {}, LossType.TOKEN_LEVEL)
    assert merged == {
        "global_valid_seqs": 8.0,
        "global_valid_toks": 40.0,
        "num_microbatches": 4.0,
        "step_skipped": 1.0,
        "inert_seqs_skipped": 1.0,
        "grad_norm": 3.0,
        "lr": pytest.approx(0.2),
        "trainer_version": 8.0,
        "num_optimizer_steps": 3.0,
    }


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


LORA = {"rank": 4, "alpha": 8}


def lora_steps(split_step: bool = False, rebuild_comms: bool = False, **cfg_overrides):
    """Two SGD steps of a LoRA policy on one local rank (B starts at zero, so only the second moves A);
    checks that they moved every adapter and nothing else, and that the reference (adapters disabled) is
    still the model before the steps. Returns (metrics of the second step, merged weights)."""
    worker = PolicyWorker(policy_cfg(optimizer=SGD, lora=LORA, **cfg_overrides))
    if rebuild_comms:
        worker.teardown_comms()
        worker.rebuild_comms()
    batch = random_batch(8, 16, rl=True)
    before, logprobs_before = full_params(worker.model), worker.get_logprobs(batch)
    for _ in range(2):
        if not split_step:
            metrics = worker.train(batch, LOSSES["pg_token"]())
            continue
        worker.begin_train_step(LOSSES["pg_token"]())
        worker.train_microbatch(batch[:4])
        worker.train_microbatch(batch[4:])
        metrics = worker.finish_train_step()
    assert_only_adapters_moved(before, full_params(worker.model))
    torch.testing.assert_close(worker.get_reference_policy_logprobs(batch), logprobs_before)
    return metrics, worker.full_state_dict()


@functools.cache
def plain_lora_steps():
    return lora_steps()


@pytest.mark.parametrize(
    "feature",
    [
        {"microbatch": {"mode": "packed", "max_tokens": 40}},
        {"microbatch": {"mode": "dynamic", "max_tokens": 40}},
        {"parallel": {"activation_checkpointing": True}},
        {"parallel": {"fsdp_cpu_offload": True}},
        {"split_step": True},
        {"parallel": {"fsdp": "always"}, "rebuild_comms": True},
    ],
    ids=["packed", "dynamic", "activation_checkpointing", "fsdp_cpu_offload", "split_step", "rebuild_comms"],
)
def test_lora_features_do_not_change_the_step(feature):
    """A LoRA step with each feature is the plain one-rank LoRA step (the frozen embedding under
    activation checkpointing, frozen parameters under FSDP2 and its CPU offload)."""
    assert_same_step(plain_lora_steps(), lora_steps(**feature))
