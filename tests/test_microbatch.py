"""Micro-batch iterators: coverage of every row, budgets, and packed attention isolation."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import random_batch
from helpers import assert_params_close, params_of, policy_cfg
from posttrain.data.batch import batch_from_sequences, completion_values, trim_to_longest
from posttrain.data.microbatch import (
    GroupedRows,
    MicroBatch,
    SharedPrefix,
    block_causal_mask,
    make_microbatches,
    plan_shared_prefix,
)
from posttrain.models.hf import build_tiny_model
from posttrain.models.logprobs import microbatch_logprobs
from posttrain.policy.policy import Policy


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "packed"])
def test_every_row_exactly_once_within_budget(mode):
    batch = random_batch(16, 20, seed=3)
    mbs = make_microbatches(batch, mode, size=3, max_tokens=45)
    rows = sorted(int(i) for mb in mbs for i in mb.indices)
    assert rows == list(range(16))
    for mb in mbs:
        if mode == "dynamic":
            assert mb.data.batch_size[0] * mb.data["input_ids"].shape[1] <= 45
        if mode == "packed":
            assert sum(mb.packed.lengths) <= 45
            assert mb.packed.input_ids.shape == (1, sum(mb.packed.lengths))


def test_sequence_over_budget_is_refused():
    with pytest.raises(ValueError, match="does not fit the sequence packing budget of 10 tokens"):
        make_microbatches(random_batch(4, 16), "packed", max_tokens=10)


def test_block_causal_mask():
    m = block_causal_mask([2, 3], 6)[0, 0]
    assert m[1, 0] and not m[2, 1] and m[4, 2] and not m[0, 1]
    assert m[5, 5] and not m[5, 4]  # padding attends only to itself


def test_packed_logprobs_equal_unpacked():
    batch = random_batch(6, 14, seed=4)
    model = build_tiny_model(79, seed=0)
    padded = make_microbatches(batch, "fixed", size=6)[0]
    packed = make_microbatches(batch, "packed", max_tokens=200)
    assert len(packed) == 1
    with torch.no_grad():
        lp_pad = microbatch_logprobs(model, padded)
        lp_pack = microbatch_logprobs(model, packed[0])
    order = packed[0].indices
    t = lp_pack.shape[1]
    torch.testing.assert_close(lp_pack, lp_pad[order, :t], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_uneven_microbatch_counts_across_ranks_do_not_deadlock(ray_session):
    """Rank 0 gets long rows (many micro-batches), rank 1 short ones: dummies keep collectives matched."""
    batch = random_batch(8, 16, seed=5)
    batch["input_lengths"][:4] = 16
    batch["input_lengths"][4:] = 5
    policy = Policy(
        policy_cfg(
            microbatch={"mode": "dynamic", "max_tokens": 16},
            cluster={"backend": "ray", "num_workers": 2, "timeout_s": 60},
        )
    )
    from posttrain.algorithms.losses import NLLLoss

    metrics = policy.train(batch, NLLLoss())
    assert metrics["num_microbatches"] == 4 + 2  # 4 real on rank 0, 2 real on rank 1 (plus 2 dummies)
    lp = policy.get_logprobs(batch)
    local = Policy(policy_cfg(microbatch={"mode": "dynamic", "max_tokens": 16}))
    local.train(batch, NLLLoss())
    torch.testing.assert_close(lp, local.get_logprobs(batch), rtol=1e-5, atol=1e-5)
    policy.shutdown()


def grouped_batch(groups: int = 3, per_group: int = 4, seed: int = 7):
    """GRPO-shaped rows: prompts of different lengths, each followed by completions of uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for i in range(groups):
        prompt = torch.randint(4, 70, (3 + 2 * i,), generator=g).tolist()
        for _ in range(per_group):
            n = int(torch.randint(1, 6, (1,), generator=g))
            prompts.append(prompt)
            completions.append(torch.randint(4, 70, (n,), generator=g).tolist())
    batch = batch_from_sequences(prompts, completions)
    batch["sample_mask"][1] = 0.0
    return batch


def _plain_and_shared(batch, plan):
    plain = make_microbatches(batch, "fixed", size=len(batch))[0]
    shared = make_microbatches(batch, "fixed", size=len(batch))[0]
    shared.shared = plan
    return plain, shared


@pytest.mark.parametrize("kind", ["grouped", "two_calls"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_logprobs_and_gradients_equal_plain(kind, temperature):
    batch = grouped_batch()
    plan = plan_shared_prefix(batch, force=kind == "two_calls")
    assert isinstance(plan, GroupedRows if kind == "grouped" else SharedPrefix)
    plain, shared = _plain_and_shared(batch, plan)
    model = build_tiny_model(79, seed=0)
    weights = torch.randn(batch["input_ids"].shape)
    results = []
    for mb in (plain, shared):
        model.zero_grad()
        lp = microbatch_logprobs(model, mb, temperature)
        (lp * weights).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp_plain, g_plain), (lp_shared, g_shared) = results
    torch.testing.assert_close(lp_shared, lp_plain, rtol=1e-5, atol=1e-5)
    assert (lp_shared[batch["token_mask"] > 0] != 0).all()  # every completion token scored
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], rtol=1e-4, atol=1e-5, msg=name)


def test_shared_prefix_plan_only_when_it_saves_tokens():
    assert isinstance(plan_shared_prefix(grouped_batch(groups=2, per_group=8)), GroupedRows)
    assert plan_shared_prefix(random_batch(8, 16)) is None  # every prompt differs
    # one group too long for a single row: the two-call plan
    long = batch_from_sequences([[5] * 300] * 4, [[6] * 300] * 4)
    assert isinstance(plan_shared_prefix(long), SharedPrefix)
    mbs = make_microbatches(grouped_batch(), "fixed", size=4, share_prefix=True)
    assert all(isinstance(mb.shared, GroupedRows) for mb in mbs)


def test_policy_step_with_shared_prefixes_equals_plain():
    from posttrain.algorithms.losses import ClippedPGLoss

    batch = grouped_batch(groups=2, per_group=4)
    g = torch.Generator().manual_seed(1)
    valid = batch["token_mask"]
    batch["advantages"] = torch.randn(8, 1, generator=g) * valid
    batch["generation_logprobs"] = -torch.rand(valid.shape, generator=g) * valid
    batch["prev_logprobs"] = batch["generation_logprobs"] + 0.05 * valid
    batch["reference_logprobs"] = batch["generation_logprobs"] - 0.05 * valid
    out = {}
    for share in (False, True):
        cfg = policy_cfg(
            optimizer={"name": "torch.optim.SGD", "lr": 1.0},
            microbatch={"train_micro_batch_size": 4, "share_prefix": share},
        )
        policy = Policy(cfg)
        metrics = policy.train(batch, ClippedPGLoss(reference_policy_kl_penalty=0.05))
        out[share] = metrics, params_of(policy), policy.get_logprobs(batch)
    assert out[True][0]["loss"] == pytest.approx(out[False][0]["loss"], rel=1e-5)
    assert_params_close(out[False][1], out[True][1])
    torch.testing.assert_close(out[True][2], out[False][2], rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_two_call_plan_on_one_rank_only_keeps_fsdp_ranks_matched(ray_session):
    """Rank 0's rows form one long group (two-call plan), rank 1's share nothing (no plan): rank 1
    switches to the two-call form too, so every model call's FSDP gathers line up."""
    from posttrain.algorithms.losses import NLLLoss

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, 70, (200,), generator=g).tolist()
    prompts = [prompt] * 4 + [torch.randint(4, 70, (5,), generator=g).tolist() for _ in range(4)]
    completions = [torch.randint(4, 70, (250 - 20 * i,), generator=g).tolist() for i in range(8)]
    batch = batch_from_sequences(prompts, completions)
    assert isinstance(plan_shared_prefix(batch[:4]), SharedPrefix)
    assert plan_shared_prefix(trim_to_longest(batch[4:])) is None
    sgd = {"name": "torch.optim.SGD", "lr": 1.0}
    one = Policy(policy_cfg(optimizer=sgd, microbatch={"train_micro_batch_size": 4, "share_prefix": False}))
    two = Policy(
        policy_cfg(
            optimizer=sgd,
            microbatch={"train_micro_batch_size": 4},
            cluster={"backend": "ray", "num_workers": 2, "timeout_s": 120},
        )
    )
    try:
        m_two, m_one = two.train(batch, NLLLoss()), one.train(batch, NLLLoss())
        assert m_two["loss"] == pytest.approx(m_one["loss"], rel=1e-5)
        assert_params_close(params_of(one), params_of(two), rtol=1e-4, atol=1e-5)
    finally:
        two.shutdown()


def test_two_call_shared_prefix_keeps_positions_in_range():
    """A long prompt next to a long completion: padding after the short suffix must not count past the
    batch width (an absolute-position model indexes its position table with them)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").eval()
    batch = batch_from_sequences([list(range(1, 13)), [1, 2]], [[3, 4], list(range(3, 15))], 0)
    assert batch["input_ids"].shape[1] == 14 <= config.n_positions
    plan = plan_shared_prefix(batch, 0, force=True)
    assert int((plan.split[:, None] + torch.arange(plan.suffix_ids.shape[1])).max()) >= config.n_positions
    plain = microbatch_logprobs(model, MicroBatch(batch, torch.arange(2)))
    shared = microbatch_logprobs(model, MicroBatch(batch, torch.arange(2), shared=plan))
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)


def test_batch_from_sequences_lays_out_rows_and_completion_values():
    """Right-padded rows, completion-only token mask, and per-token values at the completion positions,
    against the plain nested-list layout, over random shapes (empty completions included)."""
    rng = random.Random(1)
    for _ in range(30):
        n = rng.randrange(1, 12)
        prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))] for _ in range(n)]
        comps = [[rng.randrange(1, 50) for _ in range(rng.randrange(0, 7))] for _ in range(n)]
        values = [[rng.random() for _ in c] for c in comps]
        batch = batch_from_sequences(prompts, comps, pad_id=7)
        t = max(len(p) + len(c) for p, c in zip(prompts, comps))
        pad = [t - len(p) - len(c) for p, c in zip(prompts, comps)]
        assert batch["input_ids"].tolist() == [p + c + [7] * k for p, c, k in zip(prompts, comps, pad)]
        assert batch["token_mask"].tolist() == [
            [0.0] * len(p) + [1.0] * len(c) + [0.0] * k for p, c, k in zip(prompts, comps, pad)
        ]
        assert batch["input_lengths"].tolist() == [len(p) + len(c) for p, c in zip(prompts, comps)]
        want = torch.tensor([[0.0] * len(p) + v + [0.0] * k for p, v, k in zip(prompts, values, pad)])
        assert torch.equal(completion_values(batch, values), want)
