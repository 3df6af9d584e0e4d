"""Direct preference optimization on (prompt, chosen, rejected) pairs: DPO, IPO, and RPO's NLL term.

Reads top to bottom: build the policy and the pairs; compute every pair's reference logprobs once, with
the starting weights (so no second model is kept: the reference is the policy before its first step);
then per step train on the next global batch of pairs, rows 2i and 2i+1 being pair i's chosen and
rejected completion, and log; every `val_period` steps, the held-out pairs' preference accuracy (the
share whose implicit reward margin is positive) and loss; save a Hugging Face model at the end.

The loss is `DPOLoss` (algorithms/losses.py), under the normalization contract: each pair's loss is
divided by the global number of pairs of the step, so micro-batch size and DP size do not change the
step. Micro-batches keep pairs whole: fixed-size ones of an even number of rows, dynamic batching and
packing by cutting whole pairs (the loss's `row_group`).
"""

from __future__ import annotations

import time

import torch
from pydantic import Field, model_validator

from posttrain.algorithms.losses import DPOConfig, DPOLoss
from posttrain.algorithms.runs import (
    check_fresh_output,
    overwrite_field,
    run_policy,
    shuffled_batches,
    start_output,
    train_steps,
)
from posttrain.config import Config
from posttrain.data.batch import batch_from_sequences
from posttrain.logging import LoggingConfig, get_logger
from posttrain.models.tokenizer import pad_token_id
from posttrain.policy.config import PolicyConfig
from posttrain.policy.model_init import build_tokenizer
from posttrain.policy.policy import Policy
from posttrain.tasks.preferences import PreferenceDataConfig, PreferencePair, build_pairs, pairs_prompt_format

log = get_logger(__name__)


def _default_policy() -> PolicyConfig:
    return PolicyConfig(
        optimizer={"lr": 1e-4},
        train_global_batch_size=32,
        microbatch={"train_micro_batch_size": 32, "logprob_micro_batch_size": 64},
        init_reference_model=False,
    )


def check_pairs_stay_whole(p: PolicyConfig, what: str) -> None:
    """Refuse batch sizes that would split a (chosen, rejected) pair over two micro-batches or ranks.
    Dynamic batching and packing keep pairs whole themselves (the losses' `row_group`); fixed-size
    micro-batches need even sizes."""
    sizes = [("train_global_batch_size", p.train_global_batch_size)]
    if p.microbatch.mode == "fixed":
        sizes += [
            ("microbatch.train_micro_batch_size", p.microbatch.train_micro_batch_size),
            ("microbatch.logprob_micro_batch_size", p.microbatch.logprob_micro_batch_size),
        ]
    for key, value in sizes:
        if value % 2:
            raise ValueError(
                f"policy.{key}={value} is odd: {what} rows come in (chosen, rejected) pairs; use an even number"
            )
    if (p.train_global_batch_size // p.dp_size) % 2:
        raise ValueError(
            f"policy.train_global_batch_size={p.train_global_batch_size} over dp={p.dp_size} ranks gives "
            "each rank an odd number of rows, which would split a pair; use a multiple of 2 x dp"
        )


class DPORunConfig(Config):
    """A DPO run. `policy.train_global_batch_size` counts rows: two per pair."""

    policy: PolicyConfig = Field(default_factory=_default_policy)
    data: PreferenceDataConfig = Field(default_factory=PreferenceDataConfig)
    loss: DPOConfig = Field(default_factory=DPOConfig)
    max_num_steps: int = Field(100, ge=0, description="optimizer steps")
    val_period: int = Field(
        25, ge=0, description="held-out preference accuracy every N steps (0: at the end)"
    )
    seed: int = Field(0, description="seed of the run: torch's global seed and the order of the pairs")
    output_dir: str = Field(
        "runs/dpo", description="metrics.jsonl, config.yaml and the final HF model go here"
    )
    save_final_model: bool = Field(
        True, description="save the trained model as an HF directory, <output_dir>/hf"
    )
    overwrite: bool = overwrite_field()
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _pairs_stay_whole(self) -> DPORunConfig:
        check_pairs_stay_whole(self.policy, "DPO")
        self.policy.check_untempered("DPO")
        return self


def pair_rows(pairs: list[PreferencePair], pad_id: int, multiple_of: int = 2):
    """Batch of 2 rows per pair (chosen, rejected), padded with masked-out copies of whole pairs up to a
    multiple of `multiple_of` rows."""
    n = len(pairs)
    pad_pairs = -(2 * n) % multiple_of // 2
    padded = pairs + [pairs[i % n] for i in range(pad_pairs)]
    prompts = [p.prompt_token_ids for p in padded for _ in range(2)]
    completions = [c for p in padded for c in (p.chosen_token_ids, p.rejected_token_ids)]
    mask = [1.0] * (2 * n) + [0.0] * (2 * pad_pairs)
    return batch_from_sequences(prompts, completions, pad_id, mask)


def with_reference(policy: Policy, pairs: list[PreferencePair], pad_id: int) -> list[list[torch.Tensor]]:
    """Each pair's [2, T] logprobs under the policy's current weights (the reference), computed once."""
    out: list[torch.Tensor] = []
    chunk = max(policy.cfg.train_global_batch_size // 2, 1) * 8
    for start in range(0, len(pairs), chunk):
        part = pairs[start : start + chunk]
        lps = policy.get_logprobs(pair_rows(part, pad_id, policy.cfg.dp_size * 2))
        lengths = [
            len(p.prompt_token_ids) + len(c) for p in part for c in (p.chosen_token_ids, p.rejected_token_ids)
        ]
        for i in range(len(part)):
            out.append([lps[2 * i, : lengths[2 * i]].clone(), lps[2 * i + 1, : lengths[2 * i + 1]].clone()])
    return out


def training_batch(pairs, refs, pad_id: int, multiple_of: int):
    """`pair_rows` with their reference logprobs aligned to the padded layout."""
    batch = pair_rows(pairs, pad_id, multiple_of)
    ref = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    rows = [r for pair in refs for r in pair]
    rows += [rows[i % len(rows)] for i in range(ref.shape[0] - len(rows))]  # masked padding pairs
    for i, r in enumerate(rows):
        ref[i, : r.shape[0]] = r
    batch["reference_logprobs"] = ref
    return batch


def evaluate(policy: Policy, loss: DPOLoss, pairs, refs, pad_id: int) -> dict[str, float]:
    """Held-out loss, preference accuracy and reward margin over all `pairs` (one eval-mode pass)."""
    batch = training_batch(pairs, refs, pad_id, policy.cfg.train_global_batch_size)
    m = policy.train(batch, loss, eval_mode=True)
    keys = ("loss", "accuracy", "policy_accuracy", "reward_margin")
    return {k: m[k] for k in keys}


def run_dpo(cfg: DPORunConfig, policy: Policy | None = None) -> dict[str, float]:
    """Train; returns the last step's metrics plus the held-out ones: `val_accuracy` (implicit reward
    margin > 0), `val_policy_accuracy` (the policy's own logprob prefers the chosen completion; also
    `val_policy_accuracy_at_start`), `val_loss`. Ctrl-C stops after the current step (`RunInterrupted`;
    nothing is saved). A previous run in output_dir is refused unless `overwrite`."""
    check_fresh_output(cfg.output_dir, "dpo", cfg.overwrite)
    with run_policy(cfg.output_dir, cfg.seed, cfg.policy, policy) as (out, policy):
        return _train(cfg, policy, out)


def _train(cfg: DPORunConfig, policy: Policy, out) -> dict[str, float]:
    tokenizer = build_tokenizer(cfg.policy.model)
    pad_id = pad_token_id(tokenizer)
    train, heldout = build_pairs(cfg.data, tokenizer)
    log.info(
        "DPO on %d pairs (%d held out); reference logprobs from the starting weights",
        len(train),
        len(heldout),
    )
    start_output(out, cfg, cfg.overwrite)
    t0 = time.perf_counter()
    refs, held_refs = with_reference(policy, train, pad_id), with_reference(policy, heldout, pad_id)
    log.info("reference logprobs of %d pairs in %.1fs", len(train) + len(heldout), time.perf_counter() - t0)
    loss = DPOLoss(cfg.loss)
    gbs = cfg.policy.train_global_batch_size
    batches = shuffled_batches(len(train), gbs // 2, cfg.seed)

    def next_batch():
        idx = next(batches)
        return training_batch([train[i] for i in idx], [refs[i] for i in idx], pad_id, gbs)

    validate = (lambda step: evaluate(policy, loss, heldout, held_refs, pad_id)) if heldout else None
    returned = ("accuracy", "loss", "policy_accuracy")
    recorded = pairs_prompt_format(cfg.data).model_dump(mode="json")
    return train_steps(
        "dpo", policy, loss, next_batch, out, cfg, validate, returned, "policy_accuracy", recorded
    )
