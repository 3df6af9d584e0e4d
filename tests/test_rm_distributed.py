"""A scalar-head step, a reward model's (Bradley-Terry) and a PPO critic's (the clipped value loss), is the
same on one rank, on dp=2 (FSDP2), on tp=2 (the head replicated) and on tp=2 with sequence parallelism (the
head reads the gathered sequence): metrics, weights after the step and scores after it, 1e-5 in fp32
(gloo ranks in spawned processes)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch
from helpers import assert_params_close, policy_cfg
from posttrain.algorithms.losses import BradleyTerryLoss, ValueLoss
from posttrain.data.batch import shard_batch
from posttrain.parallel.processes import run_ranks
from posttrain.policy.worker import PolicyWorker

SGD = {"name": "torch.optim.SGD", "lr": 1.0}
LAYOUTS = {
    "dp2": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
}


def _cfg(**over):
    base = {"model": {"head": "score"}, "optimizer": SGD, "init_reference_model": False}
    base["microbatch"] = {"train_micro_batch_size": 2, "logprob_micro_batch_size": 2}
    return policy_cfg(**base, **over)


LOSSES = {
    "bradley_terry": (BradleyTerryLoss, ("loss", "accuracy", "reward_margin")),
    "value": (lambda: ValueLoss(clip=0.05), ("loss", "value_clip_fraction", "value_mean", "value_abs_error")),
}


def _batch(loss: str):
    batch = random_batch(8, 16)
    if loss == "value":  # GAE returns and the values they came from, on the completion tokens
        g = torch.Generator().manual_seed(3)
        mask = batch["token_mask"]
        batch["old_values"] = 0.1 * torch.randn(8, 16, generator=g) * mask
        batch["returns"] = (torch.rand(8, 16, generator=g) + batch["old_values"]) * mask
    return batch


def _outcome(worker: PolicyWorker, batch, loss: str) -> dict:
    metrics = worker.train(batch, LOSSES[loss][0]())
    return {"metrics": metrics, "params": worker.full_state_dict(), "scores": worker.score(batch)}


def _layouts_on_ranks(rank: int, world: int, port: int, layouts: list[dict], loss: str) -> list[dict | None]:
    out = []
    for par in layouts:
        cfg = _cfg(parallel=par, cluster={"backend": "ray", "num_workers": world})
        worker = PolicyWorker(cfg, rank=rank, world_size=world, master_port=port)
        shard = shard_batch(_batch(loss), worker.dims.dp)[worker.dims.dp_index(rank)]
        result = _outcome(worker, shard, loss)
        worker.teardown_comms()
        out.append(result if rank == 0 else None)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_scalar_head_step_is_the_same_on_one_rank_dp2_tp2_and_tp2_sp(loss):
    ref = _outcome(PolicyWorker(_cfg()), _batch(loss), loss)
    assert ref["metrics"]["loss"] > 0
    if loss == "value":  # the clip is active on some tokens, so both branches are compared
        assert 0 < ref["metrics"]["value_clip_fraction"] < 1
    results = run_ranks(2, _layouts_on_ranks, list(LAYOUTS.values()), loss)[0]
    for name, got in zip(LAYOUTS, results):
        for k in (*LOSSES[loss][1], "grad_norm", "global_valid_seqs"):
            assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-7), (name, k)
        assert_params_close(ref["params"], got["params"], rtol=1e-5, atol=1e-6)
        rows = got["scores"].shape[0]  # dp=2: rank 0 holds the first half of the rows
        torch.testing.assert_close(got["scores"], ref["scores"][:rows], rtol=1e-5, atol=1e-5, msg=name)
