"""Micro-batch iterators: coverage of every row, budgets, and packed attention isolation."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch
from helpers import policy_cfg
from posttrain.data.microbatch import block_causal_mask, make_microbatches
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
