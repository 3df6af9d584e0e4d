"""PolicyWorker/Policy verbs: logprobs, reference logprobs, top-k, training effects and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_batch
from helpers import params_of, policy_cfg
from posttrain.algorithms.losses import ClippedPGLoss, NLLLoss
from posttrain.data.batch import make_batch
from posttrain.models.hf import build_tiny_model
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy.policy import Policy
from posttrain.policy.train_step import NonFiniteLossError


def hf_logprobs(model, batch, temperature=1.0):
    """Reference: plain HF forward per row (no padding), log-softmax, gather."""
    out = torch.zeros(batch["input_ids"].shape)
    for i in range(batch.batch_size[0]):
        n = int(batch["input_lengths"][i])
        ids = batch["input_ids"][i : i + 1, :n]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0] / temperature
        lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        out[i, 1:n] = lp
    return out


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "packed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_plain_hf_forward(mode, temperature, tok):
    policy = Policy(policy_cfg(logprob_temperature=temperature, microbatch={"mode": mode, "max_tokens": 48}))
    batch = random_batch(8, 16)
    ours = policy.get_logprobs(batch)
    ref = hf_logprobs(build_tiny_model(len(tok), seed=0), batch, temperature)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_reference_logprobs_stay_at_initial_model_after_training(tok):
    policy = Policy(policy_cfg())
    batch = random_batch(8, 16, rl=True)
    before = policy.get_logprobs(batch)
    for _ in range(2):
        policy.train(batch, ClippedPGLoss())
    after = policy.get_logprobs(batch)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(policy.get_reference_policy_logprobs(batch), before, rtol=0, atol=1e-6)
    torch.testing.assert_close(policy.get_logprobs(batch), after)  # weights swapped back


def test_topk_logits_match_hf(tok):
    policy = Policy(policy_cfg(microbatch={"mode": "packed", "max_tokens": 64}))
    batch = random_batch(4, 12)
    values, ids = policy.get_topk_logits(batch, k=3)
    model = build_tiny_model(len(tok), seed=0)
    n = int(batch["input_lengths"][1])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"][1:2, :n]).logits[0]
    v, i = torch.topk(logits[:-1], 3, dim=-1)
    torch.testing.assert_close(values[1, 1:n], v, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids[1, 1:n], i)
    assert values.shape == (4, 12, 3) and torch.all(values[:, 0] == 0)


def test_one_step_changes_every_parameter():
    policy = Policy(policy_cfg(optimizer={"lr": 1e-3}))
    before = params_of(policy)
    policy.train(random_batch(8, 16), NLLLoss())
    after = params_of(policy)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert unchanged == []


def test_tied_embeddings_stay_tied_and_train():
    policy = Policy(policy_cfg(model={"tiny": {"family": "qwen2", "tie_word_embeddings": True}}))
    worker = policy.group.workers[0]
    assert worker.model.lm_head.weight is worker.model.get_input_embeddings().weight
    before = worker.model.lm_head.weight.detach().clone()
    policy.train(random_batch(8, 16), NLLLoss())
    assert not torch.equal(before, worker.model.lm_head.weight)
    assert worker.model.lm_head.weight is worker.model.get_input_embeddings().weight


def test_sft_loss_falls():
    policy = Policy(policy_cfg(optimizer={"lr": 3e-3}))
    batch = random_batch(8, 16, masked=())
    losses = [policy.train(batch, NLLLoss())["loss"] for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5


def test_grad_clipping_and_lr_schedule_reported():
    cfg = policy_cfg(
        max_grad_norm=1e-3,
        optimizer={"lr": 1.0, "name": "torch.optim.SGD"},
        scheduler=[
            {"kind": "linear", "steps": 2, "start_factor": 0.5, "end_factor": 1.0},
            {"kind": "constant"},
        ],
    )
    policy = Policy(cfg)
    batch = random_batch(8, 16)
    before = params_of(policy)
    m1 = policy.train(batch, NLLLoss())
    after = params_of(policy)
    step = torch.sqrt(sum(((after[k] - before[k]) ** 2).sum() for k in before))
    assert m1["grad_norm"] > 1e-3
    assert float(step) == pytest.approx(0.5 * 1e-3, rel=1e-3)  # lr 0.5 at step 0, clipped to 1e-3
    lrs = [m1["lr"]] + [policy.train(batch, NLLLoss())["lr"] for _ in range(3)]
    assert lrs == pytest.approx([0.5, 0.75, 1.0, 1.0])


# --------------------------------------------------------------------------- bad input


def test_missing_key_is_named():
    batch = random_batch(8, 16)
    del batch["token_mask"]
    with pytest.raises(ValueError, match="missing key 'token_mask'.*\\[8, 16\\]"):
        Policy(policy_cfg()).train(batch, NLLLoss())


def test_missing_loss_key_is_named():
    with pytest.raises(ValueError, match="missing key 'advantages'"):
        Policy(policy_cfg()).train(random_batch(8, 16), ClippedPGLoss())


def test_sequence_dim_mismatch():
    data = dict(random_batch(8, 16).items())
    data["token_mask"] = torch.ones(8, 15)
    with pytest.raises(ValueError, match="sequence dimension does not match.*\\[8, 16\\].*\\[8, 15\\]"):
        Policy(policy_cfg()).train(make_batch(**data), NLLLoss())


def test_wrong_dtype():
    data = dict(random_batch(8, 16).items())
    data["input_ids"] = data["input_ids"].float()
    with pytest.raises(ValueError, match="'input_ids' has dtype torch.float32"):
        Policy(policy_cfg()).train(make_batch(**data), NLLLoss())


def test_empty_batch():
    data = {k: v[:0] for k, v in random_batch(8, 16).items()}
    with pytest.raises(ValueError, match="batch is empty"):
        Policy(policy_cfg()).get_logprobs(make_batch(**data))


def test_batch_not_multiple_of_global_batch():
    with pytest.raises(ValueError, match="not a multiple of train_global_batch_size=8"):
        Policy(policy_cfg()).train(random_batch(6, 16), NLLLoss())


def test_global_batch_not_divisible_over_ranks_is_a_config_error():
    with pytest.raises(
        ValueError, match=r"not divisible by the 3 data-parallel ranks \(cluster.num_workers=3"
    ):
        policy_cfg(cluster={"backend": "ray", "num_workers": 3})


def test_non_finite_loss_refuses_the_step_and_leaves_optimizer_untouched():
    policy = Policy(policy_cfg())
    batch = random_batch(8, 16, rl=True)
    policy.train(batch, ClippedPGLoss())
    worker = policy.group.workers[0]
    before = params_of(policy)
    opt_before = {k: v.clone() for k, v in worker.optimizer.state_dict()["state"][0].items()}
    bad = batch.clone()
    bad["advantages"][0, 5] = math.nan
    with pytest.raises(NonFiniteLossError, match="step was refused"):
        policy.train(bad, ClippedPGLoss())
    after = params_of(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for k, v in worker.optimizer.state_dict()["state"][0].items():
        assert torch.equal(v, opt_before[k])
    assert policy.get_states()[0]["trainer_version"] == 1
    policy.train(batch, ClippedPGLoss())  # the policy is usable afterwards
    assert policy.get_states()[0]["trainer_version"] == 2


def test_open_ended_decay_stage_is_refused():
    with pytest.raises(ValueError, match="'cosine' scheduler stage needs steps > 0"):
        Policy(policy_cfg(scheduler=[{"kind": "constant", "steps": 2}, {"kind": "cosine"}]))


def test_cosine_stage_decays_gradually():
    policy = Policy(
        policy_cfg(
            optimizer={"lr": 1.0, "name": "torch.optim.SGD"},
            scheduler=[{"kind": "cosine", "steps": 4, "min_factor": 0.0}],
        )
    )
    batch = random_batch(8, 16)
    lrs = [policy.train(batch, NLLLoss())["lr"] for _ in range(5)]
    assert lrs == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466, 0.0], abs=1e-6)
