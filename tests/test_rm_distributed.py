"""A reward-model step (Bradley-Terry on the score head) is the same on one rank, on dp=2 (FSDP2), on tp=2
(the head replicated) and on tp=2 with sequence parallelism (the head reads the gathered sequence):
metrics, weights after the step and scores after it, 1e-5 in fp32 (gloo ranks in spawned processes)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch
from helpers import assert_params_close, policy_cfg
from posttrain.algorithms.losses import BradleyTerryLoss
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


def _outcome(worker: PolicyWorker, batch) -> dict:
    metrics = worker.train(batch, BradleyTerryLoss())
    return {"metrics": metrics, "params": worker.full_state_dict(), "scores": worker.score(batch)}


def _layouts_on_ranks(rank: int, world: int, port: int, layouts: list[dict]) -> list[dict | None]:
    out = []
    for par in layouts:
        cfg = _cfg(parallel=par, cluster={"backend": "ray", "num_workers": world})
        worker = PolicyWorker(cfg, rank=rank, world_size=world, master_port=port)
        shard = shard_batch(random_batch(8, 16), worker.dims.dp)[worker.dims.dp_index(rank)]
        result = _outcome(worker, shard)
        worker.teardown_comms()
        out.append(result if rank == 0 else None)
    return out


@pytest.mark.distributed
def test_a_reward_model_step_is_the_same_on_one_rank_dp2_tp2_and_tp2_sp():
    ref = _outcome(PolicyWorker(_cfg()), random_batch(8, 16))
    results = run_ranks(2, _layouts_on_ranks, list(LAYOUTS.values()))[0]
    for name, got in zip(LAYOUTS, results):
        for k in ("loss", "accuracy", "reward_margin", "grad_norm", "global_valid_seqs"):
            assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-7), (name, k)
        assert_params_close(ref["params"], got["params"], rtol=1e-5, atol=1e-6)
        rows = got["scores"].shape[0]  # dp=2: rank 0 holds the first half of the rows
        torch.testing.assert_close(got["scores"], ref["scores"][:rows], rtol=1e-5, atol=1e-5, msg=name)
