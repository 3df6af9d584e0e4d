"""Checkpoints: exact resume, resharding between 1 and 2 ranks, atomic saves, refusal of a foreign
checkpoint, and export to a Hugging Face directory (policy/export.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import random_batch
from helpers import assert_params_close, params_of, policy_cfg
from posttrain import checkpoint
from posttrain.algorithms.losses import NLLLoss
from posttrain.policy.export import export_hf
from posttrain.policy.lifecycle import PhaseError
from posttrain.policy.policy import Policy

# Two schedule stages (SequentialLR), so a scheduler that is not restored changes the lr.
SCHEDULE = [
    {"kind": "linear", "steps": 4, "start_factor": 0.3, "end_factor": 1.0},
    {"kind": "cosine", "steps": 6, "min_factor": 0.1},
]
BATCHES = [random_batch(seed=i) for i in range(9)]


def cfg(**overrides):
    return policy_cfg(scheduler=SCHEDULE, **overrides)


def train(policy: Policy, steps: range) -> list[float]:
    return [policy.train(BATCHES[i], NLLLoss())["loss"] for i in steps]


def assert_params_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def rng_draws() -> tuple:
    return torch.rand(4), random.random(), np.random.rand()


def test_resume_reproduces_losses_and_parameters_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = Policy(cfg())
    train(first, range(3))
    first.save_checkpoint(ckpt, extra_state={"step": 3, "data": {"epoch": 0, "offset": 24}})
    draws = rng_draws()
    losses = train(first, range(3, 6))
    params = params_of(first)
    ref_lp = first.get_reference_policy_logprobs(BATCHES[0])

    # Another init seed: the weights and the reference model must both come from the checkpoint.
    resumed = Policy(cfg(model={"seed": 1}))
    assert resumed.load_checkpoint(ckpt) == {"step": 3, "data": {"epoch": 0, "offset": 24}}
    assert resumed.get_states()[0]["trainer_version"] == 3
    resumed_draws = rng_draws()
    assert torch.equal(draws[0], resumed_draws[0]) and draws[1:] == resumed_draws[1:]
    assert train(resumed, range(3, 6)) == losses
    assert_params_equal(params_of(resumed), params)
    assert torch.equal(resumed.get_reference_policy_logprobs(BATCHES[0]), ref_lp)
    first.shutdown()
    resumed.shutdown()


def test_fsdp_checkpoint_with_tied_embeddings_loads_into_a_plain_model(tmp_path, monkeypatch):
    """One in-process FSDP2 rank (DTensor parameters and optimizer state, tied embeddings) -> plain module."""
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)  # restored after the test; the process group is destroyed
    tied = {"tiny": {"tie_word_embeddings": True}}
    try:
        sharded = Policy(cfg(model=tied, parallel={"fsdp": "always"}))
        train(sharded, range(2))
        sharded.save_checkpoint(tmp_path / "ckpt")
        saved = params_of(sharded)
        losses = train(sharded, range(2, 4))
        plain = Policy(cfg(model={**tied, "seed": 1}))
        plain.load_checkpoint(tmp_path / "ckpt")
        assert_params_equal(params_of(plain), saved)
        torch.testing.assert_close(train(plain, range(2, 4)), losses, rtol=1e-6, atol=1e-7)
        worker = plain.group.workers[0]
        assert worker.model.lm_head.weight is worker.model.get_input_embeddings().weight
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_saving_before_the_first_step_leaves_the_optimizer_untouched(tmp_path):
    saved = Policy(cfg())
    saved.save_checkpoint(tmp_path / "step0")
    plain = Policy(cfg())
    assert train(saved, range(2)) == train(plain, range(2))
    assert_params_equal(params_of(saved), params_of(plain))
    saved.load_checkpoint(tmp_path / "step0")
    assert train(saved, range(2)) == train(Policy(cfg()), range(2))


@pytest.mark.parametrize("where", ["dcp_writer", "rng_files", "commit"])
def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, where):
    ckpt = tmp_path / "ckpt"
    policy = Policy(cfg())
    train(policy, range(1))
    policy.save_checkpoint(ckpt, extra_state={"step": 1})
    saved_params = params_of(policy)
    train(policy, range(1, 2))

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    real_replace = checkpoint.os.replace

    def crash_moving_new_in(src, dst):
        if ".tmp-" in str(src):
            crash()
        real_replace(src, dst)

    target = {
        "dcp_writer": (checkpoint.dcp.HuggingFaceStorageWriter, "write_data", crash),
        "rng_files": (checkpoint, "save_rng", crash),
        "commit": (checkpoint.os, "replace", crash_moving_new_in),  # after the old one was moved aside
    }[where]
    monkeypatch.setattr(*target)
    with pytest.raises(
        checkpoint.CheckpointError, match="disk full.*previous checkpoint there, if any, is intact"
    ):
        policy.save_checkpoint(ckpt, extra_state={"step": 2})
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left
    fresh = Policy(cfg())
    assert fresh.load_checkpoint(ckpt) == {"step": 1}
    assert_params_equal(params_of(fresh), saved_params)


def test_a_checkpoint_of_another_model_or_config_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    Policy(cfg()).save_checkpoint(ckpt)

    smaller = Policy(cfg(model={"tiny": {"hidden_size": 32}}))
    with pytest.raises(ValueError, match="does not match") as err:
        smaller.load_checkpoint(ckpt)
    assert "model.tiny.hidden_size: checkpoint 64, current 32" in str(err.value)
    assert "model.embed_tokens.weight: checkpoint [" in str(err.value)

    sgd = Policy(cfg(optimizer={"name": "torch.optim.SGD", "lr": 0.1}))
    with pytest.raises(ValueError, match="optimizer.name: checkpoint 'torch.optim.AdamW'"):
        sgd.load_checkpoint(ckpt)

    with pytest.raises(ValueError, match="not a complete posttrain checkpoint"):
        sgd.load_checkpoint(tmp_path / "nowhere")


def test_phases_save_anywhere_load_on_device(tmp_path):
    policy = Policy(cfg())
    train(policy, range(1))
    policy.offload_after_refit()
    policy.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(PhaseError, match=r"load_checkpoint\(\) needs phase .*prepare_for_lp_inference\(\)"):
        policy.load_checkpoint(tmp_path / "ckpt")
    policy.prepare_for_lp_inference()
    policy.load_checkpoint(tmp_path / "ckpt")
    policy.prepare_for_training()
    policy.begin_train_step(NLLLoss())
    with pytest.raises(PhaseError, match="split train step is open"):
        policy.save_checkpoint(tmp_path / "other")
    policy.abort_train_step()


def test_bad_extra_state_or_target_is_refused(tmp_path):
    policy = Policy(cfg())
    with pytest.raises(ValueError, match="extra_state must be JSON-serializable"):
        policy.save_checkpoint(tmp_path / "ckpt", extra_state={"t": torch.zeros(2)})
    assert not any(tmp_path.iterdir())
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not a posttrain checkpoint; saving would replace it"):
        policy.save_checkpoint(tmp_path / "run")


def test_a_torch_without_the_safetensors_dcp_storage_gets_a_clear_error(tmp_path, monkeypatch):
    """posttrain imports on torch >= 2.6; checkpoints need DCP's safetensors storage (torch >= 2.8).
    An older torch is told so at save time, and nothing is left behind."""
    policy = Policy(cfg())
    monkeypatch.delattr(checkpoint.dcp, "HuggingFaceStorageWriter")
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints need torch >= 2.8"):
        policy.save_checkpoint(tmp_path / "ckpt")
    assert not any(tmp_path.iterdir())
    monkeypatch.undo()
    train(policy, range(1))
    policy.save_checkpoint(tmp_path / "ckpt")
    fresh = Policy(cfg())
    monkeypatch.delattr(checkpoint.dcp, "HuggingFaceStorageReader")
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints need torch >= 2.8"):
        fresh.load_checkpoint(tmp_path / "ckpt")
    assert not fresh.group.workers[0].optimizer.state  # refused before anything was read or set up


@pytest.mark.parametrize("tied", [False, True])
def test_export_gives_identical_logits(tmp_path, tied):
    policy = Policy(cfg(model={"tiny": {"tie_word_embeddings": tied}}))
    train(policy, range(2))
    policy.save_checkpoint(tmp_path / "ckpt")
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")

    worker = policy.group.workers[0]
    exported = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    exported.to(worker.device).eval()
    worker.model.eval()
    ids = BATCHES[0]["input_ids"][:, :12].clamp(min=4).to(worker.device)
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, worker.model(input_ids=ids).logits)
    assert exported.config.tie_word_embeddings == tied
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("12+3=15").input_ids == worker.tokenizer("12+3=15").input_ids
    with pytest.raises(ValueError, match="not empty"):
        export_hf(tmp_path / "ckpt", out)
    half = export_hf(tmp_path / "ckpt", tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(half / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_across_world_sizes(tmp_path, ray_session):
    """2 Ray ranks (FSDP2) -> 1 local rank and back; the restored state is bitwise the saved one."""
    ray_policy = Policy(cfg(cluster={"backend": "ray", "num_workers": 2}))
    local = Policy(cfg(model={"seed": 1}))
    try:
        train(ray_policy, range(3))
        ray_policy.save_checkpoint(tmp_path / "two_ranks", extra_state={"step": 3})
        saved = params_of(ray_policy)
        ray_losses = train(ray_policy, range(3, 6))
        files = sorted(p.name for p in (tmp_path / "two_ranks").rglob("*.safetensors"))
        assert len([f for f in files if f.startswith("shard-")]) == 2, files  # one shard file per rank
        assert {"rank-0.safetensors", "rank-1.safetensors"} <= set(files)
        exported = AutoModelForCausalLM.from_pretrained(export_hf(tmp_path / "two_ranks", tmp_path / "hf"))
        assert_params_equal(exported.state_dict(), saved)

        assert local.load_checkpoint(tmp_path / "two_ranks") == {"step": 3}
        assert_params_equal(params_of(local), saved)
        torch.testing.assert_close(train(local, range(3, 6)), ray_losses, rtol=1e-5, atol=1e-6)
        assert_params_close(params_of(local), params_of(ray_policy))

        local.save_checkpoint(tmp_path / "one_rank", extra_state={"step": 6})
        saved = params_of(local)
        local_losses = train(local, range(6, 9))
        assert ray_policy.load_checkpoint(tmp_path / "one_rank") == {"step": 6}
        assert_params_equal(params_of(ray_policy), saved)
        assert [s["trainer_version"] for s in ray_policy.get_states()] == [6, 6]
        torch.testing.assert_close(train(ray_policy, range(6, 9)), local_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            ray_policy.get_reference_policy_logprobs(BATCHES[0]),
            local.get_reference_policy_logprobs(BATCHES[0]),
        )
    finally:
        ray_policy.shutdown()
        local.shutdown()


class _IntStepSGD(torch.optim.Optimizer):
    """An optimizer whose per-parameter state holds a plain int step count (as bitsandbytes' do)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1
                    p.add_(p.grad, alpha=-group["lr"] / state["step"] ** 0.5)


def test_optimizer_state_that_is_not_a_tensor_survives_a_checkpoint(tmp_path):
    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3)
        optimizer = _IntStepSGD(model.parameters())
        return checkpoint.TrainState(
            model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        )

    state = fresh()
    for _ in range(5):
        state.model(torch.randn(2, 3)).sum().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
    checkpoint.save_checkpoint(tmp_path / "ck", state, trainer_version=5)
    loaded = fresh()
    checkpoint.load_checkpoint(tmp_path / "ck", loaded)
    assert loaded.optimizer.state[loaded.model.weight]["step"] == 5
    assert torch.equal(loaded.model.weight, state.model.weight)
