"""Reward-model training on (prompt, chosen, rejected) pairs with the Bradley-Terry loss.

Reads top to bottom: build the scorer (`policy.model.head=score`: a causal LM, e.g. an SFT run's hf/
directory, with a new score head, or a sequence-classification model with one output) and the pairs
(tasks/preferences.py, as DPO); then per step train on the next global batch of pairs, rows 2i and 2i+1
being pair i's chosen and rejected completion, and log; every `val_period` steps, the held-out pairs'
accuracy (the share scored chosen > rejected, with `Policy.score`, as GRPO will call it) and loss; save
a Hugging Face directory at the end, loadable by `AutoModelForSequenceClassification.from_pretrained`.

The loss is `BradleyTerryLoss` (algorithms/losses.py), -log sigmoid(r_chosen - r_rejected), where a
row's reward is the head's value at its last real token, under the normalization contract: each pair's
loss is divided by the global number of pairs of the step. Micro-batches keep pairs whole (fixed-size ones
of an even number of rows; dynamic batching and packing cut whole pairs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import Field, model_validator

from posttrain.algorithms.dpo import check_pairs_stay_whole, pair_rows
from posttrain.algorithms.losses import BradleyTerryConfig, BradleyTerryLoss
from posttrain.algorithms.runs import (
    check_fresh_output,
    overwrite_field,
    run_policy,
    shuffled_batches,
    start_output,
    train_steps,
)
from posttrain.config import Config
from posttrain.logging import LoggingConfig, get_logger
from posttrain.models.scalar_head import warn_if_pad_is_eos
from posttrain.models.tokenizer import pad_token_id
from posttrain.policy.config import PolicyConfig
from posttrain.policy.model_init import build_tokenizer
from posttrain.policy.policy import Policy
from posttrain.tasks.preferences import PreferenceDataConfig, PreferencePair, build_pairs, pairs_prompt_format

log = get_logger(__name__)


def _default_policy() -> PolicyConfig:
    return PolicyConfig(
        model={"head": "score"},
        optimizer={"lr": 1e-4},
        train_global_batch_size=32,
        microbatch={"train_micro_batch_size": 32, "logprob_micro_batch_size": 64},
        init_reference_model=False,
    )


class RMRunConfig(Config):
    """A reward-model run. `policy.train_global_batch_size` counts rows: two per pair."""

    policy: PolicyConfig = Field(default_factory=_default_policy)
    data: PreferenceDataConfig = Field(default_factory=PreferenceDataConfig)
    loss: BradleyTerryConfig = Field(default_factory=BradleyTerryConfig)
    max_num_steps: int = Field(100, ge=0, description="optimizer steps")
    val_period: int = Field(25, ge=0, description="held-out pair accuracy every N steps (0: at the end)")
    seed: int = Field(0, description="seed of the run: torch's global seed and the order of the pairs")
    output_dir: str = Field(
        "runs/rm", description="metrics.jsonl, config.yaml and the final HF model go here"
    )
    save_final_model: bool = Field(
        True,
        description="save the reward model as an HF directory, <output_dir>/hf "
        "(AutoModelForSequenceClassification; what grpo's reward_model.path takes)",
    )
    overwrite: bool = overwrite_field()
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="before")
    @classmethod
    def _score_head_by_default(cls, data: Any) -> Any:
        """`policy.model.head` is `score` unless written, also in a `policy.model` section validated
        without the command's defaults (a library's `RMRunConfig.model_validate`)."""
        policy = data.get("policy") if isinstance(data, dict) else None
        model = policy.get("model") if isinstance(policy, dict) else None
        if isinstance(model, dict) and "head" not in model:
            data = {**data, "policy": {**data["policy"], "model": {**model, "head": "score"}}}
        return data

    @model_validator(mode="after")
    def _check(self) -> RMRunConfig:
        if self.policy.model.head != "score":
            raise ValueError(
                "policy.model.head=lm: a reward model is a scalar-head model; set policy.model.head=score "
                "(policy.model.name may still be a causal LM: its head is replaced by a new score head)"
            )
        check_pairs_stay_whole(self.policy, "reward-model training")
        return self


def held_out(policy: Policy, pairs: list[PreferencePair], pad_id: int) -> dict[str, float]:
    """Accuracy (share of pairs scored chosen > rejected), mean margin and Bradley-Terry loss of `pairs`,
    scored with `Policy.score` in chunks."""
    chunk = max(policy.cfg.microbatch.logprob_micro_batch_size, 2) * policy.cfg.dp_size
    margins = []
    for start in range(0, len(pairs), chunk // 2):
        part = pairs[start : start + chunk // 2]
        scores = policy.score(pair_rows(part, pad_id, 2 * policy.cfg.dp_size))[: 2 * len(part)]
        margins.append(scores[0::2] - scores[1::2])
    m = torch.cat(margins)
    loss = -torch.nn.functional.logsigmoid(m).mean()
    return {"accuracy": float((m > 0).float().mean()), "reward_margin": float(m.mean()), "loss": float(loss)}


def run_rm(cfg: RMRunConfig, policy: Policy | None = None) -> dict[str, float]:
    """Train; returns the last step's metrics plus the held-out ones (`val_accuracy`, `val_loss`,
    `val_reward_margin`, and `val_accuracy_at_start`). Ctrl-C stops after the current step
    (`RunInterrupted`; nothing is saved). A previous run in output_dir is refused unless `overwrite`."""
    check_fresh_output(cfg.output_dir, "rm", cfg.overwrite)
    with run_policy(cfg.output_dir, cfg.seed, cfg.policy, policy) as (out, policy):
        return _train(cfg, policy, out)


def _train(cfg: RMRunConfig, policy: Policy, out: Path) -> dict[str, float]:
    tokenizer = build_tokenizer(cfg.policy.model)
    warn_if_pad_is_eos(tokenizer, "reward model training")
    pad_id = pad_token_id(tokenizer)
    train, heldout = build_pairs(cfg.data, tokenizer)
    log.info("reward model on %d pairs (%d held out)", len(train), len(heldout))
    start_output(out, cfg, cfg.overwrite)
    loss = BradleyTerryLoss(cfg.loss)
    gbs = cfg.policy.train_global_batch_size
    batches = shuffled_batches(len(train), gbs // 2, cfg.seed)

    def validate(step: int) -> dict[str, float]:
        policy.prepare_for_lp_inference()
        val = held_out(policy, heldout, pad_id)
        policy.prepare_for_training()
        return val

    def next_batch():
        return pair_rows([train[i] for i in next(batches)], pad_id, gbs)

    returned = ("accuracy", "reward_margin", "loss")
    recorded = pairs_prompt_format(cfg.data).model_dump(mode="json")
    return train_steps(
        "rm",
        policy,
        loss,
        next_batch,
        out,
        cfg,
        validate if heldout else None,
        returned,
        "accuracy",
        recorded,
    )
