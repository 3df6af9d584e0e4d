"""`posttrain export` (policy/export.py) of what the causal-LM tests (test_checkpoint.py,
test_lora_checkpoint.py) do not cover: reward-model and critic checkpoints (`model.head=score`; full,
LoRA merged, LoRA as a peft SEQ_CLS adapter with its trained score head) load in transformers and peft
and give the trained model's scores; a base model's generation config survives checkpoint and export;
checkpoints from before the head was recorded still resume and export; every export (full, LoRA merged,
LoRA adapter) of a training run's checkpoint holds the run's prompt format record, which the run kept in
the checkpoint's extra state (a checkpoint without it exports none)."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification, GenerationConfig

from conftest import random_batch
from helpers import policy_cfg, small_async_grpo_cfg, small_grpo_cfg
from model_zoo import save_family_model
from posttrain import checkpoint
from posttrain.algorithms.async_grpo.run import run_async_grpo
from posttrain.algorithms.grpo import run_grpo
from posttrain.algorithms.losses import BradleyTerryLoss, NLLLoss
from posttrain.cli import main
from posttrain.models.prompt_record import EXTRA_STATE_KEY, PROMPT_FORMAT_FILE
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy import export
from posttrain.policy.model_init import build_tokenizer, load_full_model
from posttrain.policy.policy import Policy

SCORE = {"head": "score"}
SGD = {"name": "torch.optim.SGD", "lr": 1.0}
LORA = {"rank": 4, "alpha": 8.0}
BATCH = random_batch(8, 16)


def scores(model, batch=BATCH) -> torch.Tensor:
    """A transformers sequence classifier's own forward: the logit at each row's last non-pad token."""
    mask = (torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None]).long()
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=mask).logits[:, 0]


def trained_scorer(lora: dict | None) -> Policy:
    policy = Policy(policy_cfg(model=SCORE, init_reference_model=False, optimizer=SGD, lora=lora))
    policy.train(BATCH, BradleyTerryLoss())
    return policy


def drop_head_from_identity(ckpt: Path) -> None:
    """Make `ckpt` look like a checkpoint saved before the head was recorded in its identity."""
    meta = json.loads((ckpt / checkpoint.METADATA_FILE).read_text())
    del meta["fingerprint"]["config"]["model.head"]
    (ckpt / checkpoint.METADATA_FILE).write_text(json.dumps(meta))


def test_a_full_reward_model_checkpoint_exports_a_sequence_classifier(tmp_path, capsys):
    policy = trained_scorer(lora=None)
    want = policy.score(BATCH)
    policy.save_checkpoint(tmp_path / "ckpt")
    meta = checkpoint.read_metadata(tmp_path / "ckpt")
    assert meta["fingerprint"]["config"]["model.head"] == "score"
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert "(load with AutoModelForSequenceClassification.from_pretrained)" in capsys.readouterr().out
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert loaded.config.architectures == ["LlamaForSequenceClassification"]
    assert loaded.config.num_labels == 1
    torch.testing.assert_close(scores(loaded), want, rtol=0, atol=1e-5)
    # a checkpoint saved before the head was recorded: its parameters (score.weight) tell
    drop_head_from_identity(tmp_path / "ckpt")
    export.export_hf(tmp_path / "ckpt", tmp_path / "old")
    old = AutoModelForSequenceClassification.from_pretrained(tmp_path / "old")
    torch.testing.assert_close(scores(old), want, rtol=0, atol=1e-5)


def test_a_lora_reward_model_exports_merged_and_as_a_peft_adapter_with_its_score_head(tmp_path, capsys):
    policy = trained_scorer(lora=LORA)
    want = policy.score(BATCH)
    policy.save_checkpoint(tmp_path / "ckpt")

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "merged")]) == 0
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    assert not any(".lora_" in n for n in merged.state_dict())
    full = policy.full_state_dict()
    assert merged.state_dict().keys() == full.keys()
    assert all(torch.equal(merged.state_dict()[k], full[k]) for k in full)
    torch.testing.assert_close(scores(merged), want, rtol=0, atol=1e-5)

    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert "AutoModelForSequenceClassification.from_pretrained(base), out)" in capsys.readouterr().out
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["task_type"], config["modules_to_save"]) == ("SEQ_CLS", ["score"])
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    with safe_open(str(tmp_path / "adapter" / export.ADAPTER_WEIGHTS), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert torch.equal(saved["base_model.model.score.weight"], full["score.weight"])
    # the base a user has: the untrained scorer (its score head new, seeded), saved as transformers saves it
    base = load_full_model(policy.cfg.model, build_tokenizer(policy.cfg.model))
    assert not torch.equal(base.score.weight, full["score.weight"])  # the score head trained
    base.save_pretrained(tmp_path / "base")
    adapted = peft.PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    )
    assert saved.keys() == peft.get_peft_model_state_dict(adapted, save_embedding_layers=False).keys()
    torch.testing.assert_close(scores(adapted), want, rtol=0, atol=1e-5)


def test_a_checkpoint_from_before_the_head_was_recorded_still_resumes(tmp_path):
    policy = Policy(policy_cfg())
    policy.train(BATCH, NLLLoss())
    policy.save_checkpoint(tmp_path / "ckpt", extra_state={"step": 1})
    drop_head_from_identity(tmp_path / "ckpt")
    resumed = Policy(policy_cfg())
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"step": 1}
    assert torch.equal(resumed.get_logprobs(BATCH), policy.get_logprobs(BATCH))
    scorer = Policy(policy_cfg(model=SCORE, init_reference_model=False))
    with pytest.raises(ValueError, match="lm_head.weight: only in the checkpoint"):  # the heads still differ
        scorer.load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("lora", [None, LORA])
def test_the_base_models_generation_config_survives_checkpoint_and_export(tmp_path, lora):
    base = save_family_model("llama", build_char_tokenizer(), tmp_path / "base")
    GenerationConfig(
        bos_token_id=1, eos_token_id=[2, 7], pad_token_id=0, do_sample=True, temperature=0.6, top_p=0.9
    ).save_pretrained(base)
    want = GenerationConfig.from_pretrained(base).to_diff_dict()
    policy = Policy(policy_cfg(model={"name": str(base)}, lora=lora))
    policy.train(BATCH, NLLLoss())
    policy.save_checkpoint(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    for where in (tmp_path / "ckpt" / checkpoint.HF_FILES_DIR, tmp_path / "out"):
        got = GenerationConfig.from_pretrained(where)
        assert got.to_diff_dict() == want, where
        assert (got.eos_token_id, got.temperature, got.top_p, got.do_sample) == ([2, 7], 0.6, 0.9, True)


def recorded(directory: Path) -> dict | None:
    path = directory / PROMPT_FORMAT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_exports_of_a_runs_checkpoint_hold_its_prompt_format(tmp_path, loop):
    """The arithmetic task's format (no chat template, BOS first; here with a template) with a tokenizer
    that has a chat template: every kind of export records it as the run used it."""
    fmt = ["policy.model.tokenizer=tiny-chat", "task.prompt_format.template=Q: {prompt} A:"]
    if loop == "sync":
        cfg = small_grpo_cfg(
            tmp_path / "run", *fmt, "grpo.max_num_steps=1", "grpo.val_period=0", "policy.lora.rank=4"
        )
        run_grpo(cfg)
    else:
        steps = ["async_grpo.num_steps=1", "grpo.val_period=0", "checkpointing.save_period=1"]
        cfg = small_async_grpo_cfg(tmp_path / "run", *fmt, *steps)
        run_async_grpo(cfg)
    want = cfg.task.prompt_format.model_dump(mode="json")
    assert (want["chat_template"], want["prepend_bos"], want["template"]) == ("never", True, "Q: {prompt} A:")
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    assert json.loads((ckpt / "extra_state.json").read_text())[EXTRA_STATE_KEY] == want
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 0
    assert recorded(tmp_path / "out") == want
    if loop == "sync":  # a LoRA checkpoint: merged above, its adapters here
        assert main(["export", str(ckpt), str(tmp_path / "adapter"), "--adapter"]) == 0
        assert recorded(tmp_path / "adapter") == want


def test_a_checkpoint_without_a_prompt_format_record_exports_none(tmp_path):
    """A checkpoint saved outside a training loop, or before the record existed, has no record to write."""
    policy = Policy(policy_cfg(optimizer=SGD))
    policy.save_checkpoint(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert recorded(tmp_path / "out") is None
