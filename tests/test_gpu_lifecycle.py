"""GPU tier of the lifecycle: offload really frees device memory and onload restores it bit-exactly."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch
from helpers import params_of, policy_cfg
from posttrain.algorithms.losses import NLLLoss
from posttrain.policy.policy import Policy

SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8}


@pytest.mark.gpu
def test_offload_after_refit_frees_95_percent_of_device_memory():
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    policy = Policy(policy_cfg(model={"tiny": SHAPE}, precision="bfloat16"))
    batch = random_batch(8, 64)
    policy.train(batch, NLLLoss())  # creates optimizer state on the device
    training = torch.cuda.memory_allocated() - base
    before = params_of(policy)
    policy.offload_after_refit()
    offloaded = torch.cuda.memory_allocated() - base
    print(f"worker device memory: TRAINING {training} B, OFFLOADED {offloaded} B")
    assert offloaded <= 0.05 * training
    policy.prepare_for_training()
    after = params_of(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    policy.train(batch, NLLLoss())
