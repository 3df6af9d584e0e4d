"""Shared fixtures: deterministic tiny batches and a session-wide Ray instance on loopback."""

from __future__ import annotations

import os

import pytest
import torch

from posttrain.data.batch import make_batch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# One intra-op thread: tiny tensors on a shared 2-core machine otherwise stall on OpenMP barriers
# (several test files ran 5-20x slower with two threads).
torch.set_num_threads(1)


def random_batch(
    b: int = 8,
    t: int = 16,
    vocab: int = 70,
    seed: int = 0,
    prompt_len: int = 3,
    rl: bool = False,
    masked=(5,),
):
    """A right-padded batch with uneven lengths, completion-only token masks and some sample_mask zeros."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    lengths = torch.randint(prompt_len + 2, t + 1, (b,), generator=g)
    lengths[0] = t
    valid = torch.arange(t)[None, :] < lengths[:, None]
    ids = ids * valid
    token_mask = valid.float()
    token_mask[:, :prompt_len] = 0
    sample_mask = torch.ones(b)
    for i in masked:
        if i < b:
            sample_mask[i] = 0
    data = dict(input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=sample_mask)
    if rl:
        data["advantages"] = torch.randn(b, t, generator=g)[:, :1].expand(b, t).clone() * valid
        data["generation_logprobs"] = (-torch.rand(b, t, generator=g) * 3 - 1) * valid
        data["prev_logprobs"] = data["generation_logprobs"] + 0.05 * torch.randn(b, t, generator=g) * valid
        data["reference_logprobs"] = (
            data["generation_logprobs"] + 0.1 * torch.randn(b, t, generator=g) * valid
        )
    return make_batch(**data)


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole test session (bound to loopback)."""
    ray = pytest.importorskip("ray")
    from posttrain.parallel.cluster import ensure_ray

    ensure_ray(num_cpus=8)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped (with the reason) on machines without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
