"""A DPO step (sigmoid and IPO, with RPO's NLL term) is the same on one rank, on dp=2 (FSDP2), on tp=2 and
on tp=2 with sequence parallelism: metrics and weights after the step, 1e-5 in fp32 (gloo ranks in
spawned processes). Rows 2i and 2i+1 are a pair; dp=2 gives each rank two whole pairs."""

from __future__ import annotations

import pytest

from conftest import random_batch
from helpers import assert_params_close, policy_cfg
from posttrain.algorithms.losses import DPOLoss
from posttrain.data.batch import shard_batch
from posttrain.parallel.processes import run_ranks
from posttrain.policy.worker import PolicyWorker

SGD = {"name": "torch.optim.SGD", "lr": 1.0}
LAYOUTS = {
    "dp2": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
}
LOSSES = {"sigmoid": {"beta": 0.5, "sft_weight": 0.3}, "ipo": {"beta": 0.5, "loss_type": "ipo"}}


def _cfg(**over):
    base = {"optimizer": SGD, "init_reference_model": False}
    base["microbatch"] = {"train_micro_batch_size": 2, "logprob_micro_batch_size": 2}
    return policy_cfg(**base, **over)


def _pairs():
    return random_batch(8, 16, rl=True, masked=())  # reference_logprobs included


def _outcome(worker: PolicyWorker, batch, loss: dict) -> dict:
    metrics = worker.train(batch, DPOLoss(**loss))
    return {"metrics": metrics, "params": worker.full_state_dict()}


def _layouts_on_ranks(rank: int, world: int, port: int, layouts: list[dict], loss: dict) -> list[dict | None]:
    out = []
    for par in layouts:
        cfg = _cfg(parallel=par, cluster={"backend": "ray", "num_workers": world})
        worker = PolicyWorker(cfg, rank=rank, world_size=world, master_port=port)
        shard = shard_batch(_pairs(), worker.dims.dp)[worker.dims.dp_index(rank)]
        result = _outcome(worker, shard, loss)
        worker.teardown_comms()
        out.append(result if rank == 0 else None)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_dpo_step_is_the_same_on_one_rank_dp2_tp2_and_tp2_sp(loss):
    ref = _outcome(PolicyWorker(_cfg()), _pairs(), LOSSES[loss])
    assert ref["metrics"]["loss"] > 0
    results = run_ranks(2, _layouts_on_ranks, list(LAYOUTS.values()), LOSSES[loss])[0]
    for name, got in zip(LAYOUTS, results):
        for k in ("loss", "preference_loss", "sft_loss", "accuracy", "reward_margin", "grad_norm"):
            assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-7), (name, k)
        assert_params_close(ref["params"], got["params"], rtol=1e-5, atol=1e-6)
