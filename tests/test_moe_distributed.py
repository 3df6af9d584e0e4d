"""One MoE optimizer step (Qwen3-MoE, tiny) on dp=2 (FSDP2, the fused expert tensors sharded like any
parameter), on ep=2 (expert parallelism: each rank holds half the experts, tokens reach them by
all-to-all), under tensor parallelism (with sequence parallelism, and beside ep) and context parallelism
equals one rank, with and without routing replay, and with the per-sequence router losses: logprobs
before the step, metrics and weights after it (1e-5 fp32, gloo ranks in spawned processes). An ep=2
and a tp x ep checkpoint resume on one rank with the same weights."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch
from helpers import assert_params_close, policy_cfg
from model_zoo import save_family_model
from posttrain.algorithms.losses import ClippedPGLoss
from posttrain.data.batch import shard_batch
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.parallel.processes import run_ranks
from posttrain.policy.worker import PolicyWorker

SGD = {"name": "torch.optim.SGD", "lr": 1.0}


ROUTER_LOSSES = {"aux_loss_coef": 0.1, "z_loss_coef": 0.01}


def _cfg(path: str, replay: str, **over):
    moe = ROUTER_LOSSES if replay == "router_losses" else {"routing_replay": replay}
    if replay == "rank0_experts":
        moe = {"routing_replay": "rollout"}
    over.setdefault("microbatch", {"train_micro_batch_size": 2, "logprob_micro_batch_size": 2})
    return policy_cfg(model={"name": path}, optimizer=SGD, init_reference_model=False, moe=moe, **over)


def _batch(replay: str, t: int = 16):
    batch = random_batch(8, t, rl=True, masked=())
    if replay == "rank0_experts":  # every token to experts 0 and 1: rank 1 of ep=2 receives none
        routing = torch.tensor([0, 1], dtype=torch.int16).expand(8, t, 2, 2).clone()
        routing[:, -1] = -1
        batch["routing"] = routing
    if replay == "rollout":  # a recorded routing (2 MoE layers, 2 of 4 experts), none on the last token
        g = torch.Generator().manual_seed(7)
        first = torch.randint(0, 4, (8, t, 2, 1), generator=g)
        routing = torch.cat([first, (first + 1 + torch.randint(0, 3, first.shape, generator=g)) % 4], -1)
        routing[:, -1] = -1
        batch["routing"] = routing.to(torch.int16)
    return batch


def _outcome(worker: PolicyWorker, batch) -> dict:
    logprobs = worker.get_logprobs(batch)
    metrics = worker.train(batch, ClippedPGLoss())
    routing = worker.pop_routing_stats()
    return {"metrics": metrics, "params": worker.full_state_dict(), "routing": routing, "logprobs": logprobs}


def _on_ranks(
    rank: int,
    world: int,
    port: int,
    path: str,
    replay: str,
    ep: int,
    ckpt: str | None,
    ac: bool = False,
    layout: dict | None = None,
    microbatch: dict | None = None,
    t: int = 16,
):
    cfg = _cfg(path, replay, cluster={"backend": "ray", "num_workers": world}, **(microbatch or {}))
    layout = {"expert_parallel_size": ep, "activation_checkpointing": ac, **(layout or {})}
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update=layout)})
    worker = PolicyWorker(cfg, rank=rank, world_size=world, master_port=port)
    shard = shard_batch(_batch(replay, t), worker.dims.dp)[worker.dims.dp_index(rank)]
    result = _outcome(worker, shard)
    experts = worker.model.model.layers[0].mlp.experts.gate_up_proj
    result["local_experts"] = experts.to_local().shape[0] if ep > 1 else None
    result["dp_leader"] = rank in worker.dims.dp_leaders()
    if ckpt is not None:
        worker.save_checkpoint(ckpt)
    worker.teardown_comms()
    return result


LAYOUTS = [  # (replay, ep): FSDP2 alone once, every MoE option under expert parallelism
    ("off", 1),
    ("router_losses", 2),
    ("rollout", 2),
]


@pytest.mark.distributed
@pytest.mark.parametrize("replay,ep", LAYOUTS, ids=[f"{r}-{'ep2' if e == 2 else 'dp2'}" for r, e in LAYOUTS])
def test_a_moe_step_is_the_same_on_one_rank_dp2_and_ep2(tmp_path, replay, ep):
    path = str(save_family_model("qwen3_moe", build_char_tokenizer(), tmp_path / "moe", seed=3))
    ref = _outcome(PolicyWorker(_cfg(path, replay)), _batch(replay))
    ckpt = str(tmp_path / "ckpt") if ep == 2 and replay == "router_losses" else None
    # with activation checkpointing there: recomputing a layer in backward runs its all-to-alls again,
    # in the same order on every rank
    results = run_ranks(2, _on_ranks, path, replay, ep, ckpt, ckpt is not None)
    if ep == 2:  # each rank holds 2 of the 4 experts whole
        assert [r["local_experts"] for r in results] == [2, 2]
    got_lp = torch.cat([r["logprobs"] for r in results])
    torch.testing.assert_close(got_lp, ref["logprobs"], rtol=0, atol=1e-5)
    keys = ("loss", "pg_loss", "grad_norm", "global_valid_toks")
    if replay == "router_losses":
        keys += ("moe_aux_loss", "moe_z_loss")
        assert ref["metrics"]["moe_aux_loss"] > 0.5
    for k in keys:
        assert results[0]["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-7), k
    assert_params_close(ref["params"], results[0]["params"], rtol=1e-5, atol=1e-6)
    if replay == "rollout":  # every rank replayed its half of the recorded decisions
        assert ref["routing"]["total"] == sum(r["routing"]["total"] for r in results) > 0
    if ckpt is not None:  # the ep=2 checkpoint (experts sharded over the ranks) resumes on one rank
        one = PolicyWorker(_cfg(path, replay))
        one.load_checkpoint(ckpt)
        assert_params_close(results[0]["params"], one.full_state_dict(), rtol=0, atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("replay", ["rollout"])
def test_a_dp4_ep2_step_equals_one_rank(tmp_path, replay):
    """Four ranks as two expert groups of two: each group holds all experts between its ranks, and the
    two copies' gradients are summed before the step."""
    path = str(save_family_model("qwen3_moe", build_char_tokenizer(), tmp_path / "moe", seed=3))
    ref = _outcome(PolicyWorker(_cfg(path, replay)), _batch(replay))
    results = run_ranks(4, _on_ranks, path, replay, 2, None)
    assert [r["local_experts"] for r in results] == [2, 2, 2, 2]
    torch.testing.assert_close(
        torch.cat([r["logprobs"] for r in results]), ref["logprobs"], rtol=0, atol=1e-5
    )
    for k in ("loss", "grad_norm"):
        assert results[0]["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-7), k
    for r in results:
        assert_params_close(ref["params"], r["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_an_ep2_rank_that_receives_no_tokens_still_takes_the_same_step(tmp_path):
    """All tokens routed (by replay) to rank 0's experts: rank 1's experts get nothing, its backward
    all-to-alls still run (no hang), and the step equals one rank."""
    path = str(save_family_model("qwen3_moe", build_char_tokenizer(), tmp_path / "moe", seed=3))
    ref = _outcome(PolicyWorker(_cfg(path, "rank0_experts")), _batch("rank0_experts"))
    results = run_ranks(2, _on_ranks, path, "rank0_experts", 2, None)
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    assert_params_close(ref["params"], results[0]["params"], rtol=1e-5, atol=1e-6)


SPLIT_LAYOUTS = [  # (family, replay, world, layout, packed); rows of 15 tokens: padded to 16 under sp
    ("qwen3_moe", "rollout", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}, True),
    ("mixtral", "router_losses", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}, False),
    ("qwen3_moe", "rollout", 4, {"tensor_parallel_size": 2, "expert_parallel_size": 2}, False),
    ("olmoe", "off", 2, {"context_parallel_size": 2}, True),
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "family,replay,world,layout,packed",
    SPLIT_LAYOUTS,
    ids=["tp2-sp-packed", "mixtral-tp2-sp", "tp2xep2", "olmoe-cp2-packed"],
)
def test_a_moe_step_under_tensor_and_context_parallelism_equals_one_rank(
    tmp_path, family, replay, world, layout, packed
):
    """Tensor parallelism splits attention and leaves each MoE block whole on every rank of the group
    (its input gathered first under sequence parallelism, rows padded to a multiple of tp, packed or
    not); with expert parallelism beside it, each tensor-parallel index has its own expert groups;
    context parallelism splits the sequence, each rank routing its tokens. The step, the replayed
    decisions and the router losses equal one rank's, and a tp x ep checkpoint resumes on one rank."""
    path = str(save_family_model(family, build_char_tokenizer(), tmp_path / "moe", seed=3))
    microbatch = {"microbatch": {"mode": "packed", "max_tokens": 40}} if packed else {}
    ref = _outcome(PolicyWorker(_cfg(path, replay, **microbatch)), _batch(replay, 15))
    layout = dict(layout)  # the parametrized dict is shared between runs
    ep = layout.pop("expert_parallel_size", 1)
    ckpt = str(tmp_path / "ckpt") if ep > 1 else None
    results = run_ranks(world, _on_ranks, path, replay, ep, ckpt, False, layout, microbatch, 15)
    leaders = [r for r in results if r["dp_leader"]]
    assert len(leaders) == world // (
        layout.get("tensor_parallel_size", 1) * layout.get("context_parallel_size", 1)
    )
    got_lp = torch.cat([r["logprobs"] for r in leaders])
    torch.testing.assert_close(got_lp, ref["logprobs"], rtol=0, atol=1e-5)
    keys = ("loss", "grad_norm") + (("moe_aux_loss", "moe_z_loss") if replay == "router_losses" else ())
    if replay == "router_losses":
        assert ref["metrics"]["moe_aux_loss"] > 0.5
    for r in results:
        for k in keys:
            assert r["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-7), k
        assert_params_close(ref["params"], r["params"], rtol=1e-5, atol=1e-6)
    if replay == "rollout":  # each tensor-parallel rank replays its data shard's decisions whole
        assert ref["routing"]["total"] == sum(r["routing"]["total"] for r in leaders) > 0
        assert ref["routing"]["differ"] == sum(r["routing"]["differ"] for r in leaders) > 0
    if ep > 1:
        assert [r["local_experts"] for r in results] == [2, 2, 2, 2]
        one = PolicyWorker(_cfg(path, replay))
        one.load_checkpoint(ckpt)
        assert_params_close(results[0]["params"], one.full_state_dict(), rtol=0, atol=0)


def _bf16_on_ranks(rank: int, world: int, port: int, path: str) -> float:
    cfg = _cfg(path, "off", precision="bfloat16", cluster={"backend": "ray", "num_workers": world})
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"expert_parallel_size": 2})})
    worker = PolicyWorker(cfg, rank=rank, world_size=world, master_port=port)
    metrics = worker.train(shard_batch(_batch("off"), 2)[rank], ClippedPGLoss())
    worker.teardown_comms()
    return metrics["grad_norm"]


@pytest.mark.distributed
def test_an_ep2_step_runs_in_bfloat16(tmp_path):
    """FSDP2 computes in bf16 while the expert-parallel experts stay fp32: they run in the activations'
    dtype; the step's gradient norm is finite and near fp32's."""
    path = str(save_family_model("qwen3_moe", build_char_tokenizer(), tmp_path / "moe", seed=3))
    ref = _outcome(PolicyWorker(_cfg(path, "off")), _batch("off"))["metrics"]["grad_norm"]
    norms = run_ranks(2, _bf16_on_ranks, path)
    assert norms[0] == norms[1] and norms[0] == pytest.approx(ref, rel=0.05)
