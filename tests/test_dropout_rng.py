"""Dropout on trainer ranks (`policy.model.disable_dropout=false`): each rank seeds its generators with the
run's seed plus its (dp, cp) coordinate, so ranks holding other rows (dp) or other query blocks (cp) draw
other masks, a run draws the same masks again with the same seed, and a checkpoint's RNG states still
win over the seeding. Tensor parallelism with the model's own dropout is refused (gloo ranks in
processes, a tiny Phi model whose residual dropout is an nn.Dropout)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch
from helpers import policy_cfg
from model_zoo import save_family_model
from posttrain.algorithms.losses import NLLLoss
from posttrain.data.batch import shard_batch
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.parallel.processes import run_ranks
from posttrain.policy.config import PolicyConfig
from posttrain.policy.model_init import check_dropout_support, model_config
from posttrain.policy.policy import Policy
from posttrain.policy.worker import PolicyWorker

SGD = {"name": "torch.optim.SGD", "lr": 1e-3}


@pytest.fixture(scope="module")
def phi_dir(tmp_path_factory) -> str:
    """A tiny Phi model saved with resid_pdrop=0.5 (a checkpoint that ships dropout)."""
    out = tmp_path_factory.mktemp("phi_dropout")
    return str(save_family_model("phi", build_char_tokenizer(), out, resid_pdrop=0.5))


def _cfg(world: int, model_dir: str, parallel: dict, disable_dropout: bool = False) -> PolicyConfig:
    return policy_cfg(
        cluster={"backend": "ray", "num_workers": world},
        model={"name": model_dir, "disable_dropout": disable_dropout},
        parallel=parallel,
        optimizer=SGD,
    )


def _full_rows():
    """Every row full length, so every rank's micro-batches (and their masks) have one shape."""
    batch = random_batch(8, 16, rl=True)
    batch["input_lengths"][:] = 16
    return batch


def _masks_of_a_step(rank: int, world: int, port: int, model_dir: str, parallel: dict, seed: int) -> list:
    """(kept, known) of every dropout call of one training step on this rank's share of the batch: where
    the input is non-zero (known), whether the output kept it."""
    cfg = _cfg(world, model_dir, parallel)
    worker = PolicyWorker(cfg, rank=rank, world_size=world, master_port=port, seed=seed)
    masks: list[tuple[torch.Tensor, torch.Tensor]] = []
    for module in worker.model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.register_forward_hook(lambda m, i, out: masks.append((out.detach() != 0, i[0] != 0)))
    shard = shard_batch(_full_rows(), worker.dims.dp)[worker.dims.dp_index(rank)]
    worker.train(shard, NLLLoss())
    worker.teardown_comms()
    assert masks and all(0.4 < (kept[known]).float().mean() < 0.6 for kept, known in masks)  # p = 0.5
    return masks


def _same(a: list, b: list) -> list[bool]:
    """Per dropout call: whether the two masks agree wherever both inputs were non-zero."""
    assert [k.shape for k, _ in a] == [k.shape for k, _ in b]
    return [torch.equal(ka[na & nb], kb[na & nb]) for (ka, na), (kb, nb) in zip(a, b)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{}, {"context_parallel_size": 2}], ids=["dp2", "cp2"])
def test_ranks_with_other_data_draw_other_masks_and_a_seed_draws_them_again(phi_dir, parallel):
    r0, r1 = run_ranks(2, _masks_of_a_step, phi_dir, parallel, 7)
    assert not any(_same(r0, r1))  # other rows / query blocks, other masks
    again = run_ranks(2, _masks_of_a_step, phi_dir, parallel, 7)
    assert all(_same(again[0], r0)) and all(_same(again[1], r1))
    other = run_ranks(2, _masks_of_a_step, phi_dir, parallel, 8)
    assert not any(_same(other[0], r0)) and not any(_same(other[1], r1))


def _draws_after_construction(rank: int, world: int, port: int, parallel: dict, seed: int) -> torch.Tensor:
    """What this rank's CPU generator draws first after the worker is built."""
    worker = PolicyWorker(
        _cfg(world, "tiny", parallel, True), rank=rank, world_size=world, master_port=port, seed=seed
    )
    worker.teardown_comms()
    return torch.rand(8)


@pytest.mark.distributed
def test_the_ranks_of_a_tensor_parallel_group_seed_alike():
    r0, r1 = run_ranks(2, _draws_after_construction, {"tensor_parallel_size": 2}, 3)
    assert torch.equal(r0, r1)


def _resumed_draws(rank: int, world: int, port: int, path: str, save: bool) -> torch.Tensor:
    """Save after a few draws and return the next ones; or seed, restore the save, and return the next."""
    worker = PolicyWorker(
        _cfg(world, "tiny", {}, True), rank=rank, world_size=world, master_port=port, seed=5
    )
    if save:
        torch.rand(100)
        worker.save_checkpoint(path)
    else:
        worker.load_checkpoint(path)
    draws = torch.rand(8)
    worker.teardown_comms()
    return draws


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoints_rng_states_win_over_the_seeding_at_construction(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(2, _resumed_draws, path, True)
    resumed = run_ranks(2, _resumed_draws, path, False)
    fresh = run_ranks(2, _draws_after_construction, {}, 5)  # the seeding alone
    for s, r, f in zip(saved, resumed, fresh):
        assert torch.equal(s, r) and not torch.equal(r, f)


def test_the_models_own_dropout_is_refused_under_tensor_parallelism(phi_dir):
    cfg = _cfg(2, phi_dir, {"tensor_parallel_size": 2})
    with pytest.raises(
        ValueError, match=r"disable_dropout=false with tensor_parallel_size=2.*resid_pdrop=0.5"
    ):
        Policy(cfg)  # refused before any rank starts (no Ray needed)
    check_dropout_support(_cfg(2, phi_dir, {"tensor_parallel_size": 2}, True), model_config(cfg.model))
    check_dropout_support(_cfg(2, phi_dir, {"context_parallel_size": 2}), model_config(cfg.model))
    tiny = _cfg(2, "tiny", {"tensor_parallel_size": 2})  # attention_dropout=0.0: nothing to drop
    check_dropout_support(tiny, model_config(tiny.model))


def test_a_run_hands_its_seed_to_the_policy(tmp_path, monkeypatch):
    from posttrain.algorithms import runs

    seen = {}
    monkeypatch.setattr(runs, "Policy", lambda cfg, seed: seen.setdefault("seed", seed))
    runs._open(str(tmp_path), 11, policy_cfg(), None)
    assert seen == {"seed": 11}
