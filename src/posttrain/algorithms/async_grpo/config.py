"""The configs of asynchronous GRPO: the controller's scheduling (`AsyncGRPOConfig`, the `async_grpo:`
section) and a whole run (`AsyncGRPORunConfig`: the sections of a synchronous run that mean the same
here, plus `async_grpo`, `rollout` and the trainer's chunking)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from posttrain.algorithms.async_grpo.ledger import Selection
from posttrain.algorithms.distill_core import DistillSettings
from posttrain.algorithms.grpo_config import (
    DISTILLATION_LEARNS_FROM_EVERY_GROUP,
    GRPOLoopConfig,
    GRPORunSections,
    refuse_dynamic_sampling,
    refuse_kl_without_reference,
)
from posttrain.algorithms.losses import ClippedPGConfig
from posttrain.config import Config
from posttrain.rollout.config import RolloutConfig, RolloutWorkerConfig


def _async_loss_defaults() -> ClippedPGConfig:
    return ClippedPGConfig(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis")


class AsyncGRPOConfig(Config):
    """Scheduling of the asynchronous GRPO loop."""

    num_steps: int | None = Field(None, ge=1, description="stop after this many steps (None: at data end)")
    num_epochs: int | None = Field(1, ge=1, description="passes over the prompts (None: loop forever)")
    shuffle: bool = Field(
        True,
        description="shuffle the prompt order of each epoch (a controller built without a cursor; "
        "grpo-async runs always shuffle, by task.seed and grpo.seed)",
    )
    seed: int = Field(
        0,
        description="seed of the per-epoch shuffle (a controller built without a cursor; grpo-async runs "
        "order the prompts by task.seed and grpo.seed, as grpo does)",
    )
    target_prompt_groups_per_step: int = Field(8, ge=1, description="groups trained per optimizer step")
    max_staleness: int = Field(
        1, ge=0, description="admit groups generated at most this many versions behind the trainer"
    )
    selection: Selection = Field(
        "fresh_first", description="among eligible groups: smallest lag first, or largest; then oldest"
    )
    max_in_flight_per_worker: int = Field(
        4,
        ge=1,
        description="groups in flight per rollout worker (the groups of one call share the engine's "
        "batch; a Ray rollout actor runs its calls one after another)",
    )
    max_groups_per_call: int | None = Field(
        None,
        ge=1,
        description="groups one generate call carries (default: all that fit in max_in_flight_per_worker); "
        "half of max_in_flight_per_worker keeps a second call queued on a Ray rollout actor, which then "
        "starts it as soon as the first returns instead of idling for a round trip",
    )
    max_outstanding_groups: int | None = Field(
        None,
        ge=1,
        description="cap on groups in flight, buffered or in the open step "
        "(default target_prompt_groups_per_step * (max_staleness + 1))",
    )
    max_retries: int = Field(2, ge=0, description="re-admissions of one group after failures")
    on_retries_exhausted: Literal["raise", "drop"] = Field(
        "raise", description="raise: stop with RetryBudgetExhausted; drop: count it failed and go on"
    )
    min_alive_workers: int = Field(1, ge=1, description="stop with an error when fewer workers are left")
    max_consecutive_worker_errors: int = Field(
        3, ge=1, description="retire a worker after this many unexplained request errors in a row"
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="bound on generating one group (a call carrying k groups gets k times this)"
    )
    weight_sync_timeout_s: float = Field(300.0, gt=0, description="bound on one set_weights call")
    trainer_timeout_s: float = Field(
        600.0,
        gt=0,
        description="bound on each trainer call (one that first waits for k calls the trainer has queued, "
        "e.g. finish after k chunks still training, gets k+1 times this)",
    )
    admission_timeout_s: float = Field(1800.0, gt=0, description="bound on waiting for the next group")
    shutdown_timeout_s: float = Field(30.0, gt=0, description="bound on cancelling requests at the end")
    loss: ClippedPGConfig = Field(
        default_factory=_async_loss_defaults,
        description="loss when none is passed; importance sampling (TIS) on by default",
    )

    @model_validator(mode="after")
    def _check(self) -> AsyncGRPOConfig:
        if self.num_steps is None and self.num_epochs is None:
            raise ValueError("set num_steps or num_epochs (or both); with neither the run never ends")
        cap = self.max_outstanding_groups
        if cap is not None and cap < self.target_prompt_groups_per_step:
            raise ValueError(
                f"max_outstanding_groups={cap} is below target_prompt_groups_per_step="
                f"{self.target_prompt_groups_per_step}, so a step could never fill; raise it or leave it unset"
            )
        per_call = self.max_groups_per_call
        if per_call is not None and per_call > self.max_in_flight_per_worker:
            raise ValueError(
                f"max_groups_per_call={per_call} is above max_in_flight_per_worker="
                f"{self.max_in_flight_per_worker}, so a call could never carry that many; lower it or raise "
                "max_in_flight_per_worker"
            )
        return self

    @property
    def outstanding_cap(self) -> int:
        return self.max_outstanding_groups or self.target_prompt_groups_per_step * (self.max_staleness + 1)


def _default_async() -> AsyncGRPOConfig:
    return AsyncGRPOConfig(num_steps=50, num_epochs=None, target_prompt_groups_per_step=16)


# fields a grpo-async run does not read, with what to do instead: grpo's step size and count (async_grpo
# has its own) and the prompt order of a controller built without a cursor (library use)
_ORDER = (
    "its prompts come from the task's cursor, shuffled each epoch by task.seed and grpo.seed as in grpo; "
)
_UNUSED = {
    ("grpo", "num_prompts_per_step"): "set async_grpo.target_prompt_groups_per_step instead",
    ("grpo", "max_num_steps"): "set async_grpo.num_steps instead",
    ("grpo", "max_num_epochs"): "set async_grpo.num_epochs instead",
    ("grpo", "sample_seeds"): "it always seeds each group by (grpo.seed, prompt, weight version), as "
    "grpo.sample_seeds=group does in grpo; remove it",
    ("async_grpo", "seed"): _ORDER + "set grpo.seed (or task.seed) instead",
    ("async_grpo", "shuffle"): _ORDER + "remove it (a run's prompts are always shuffled)",
}


class AsyncGRPORunConfig(GRPORunSections):
    """An asynchronous GRPO run (the shared sections mean the same as in GRPOConfig)."""

    # a file or override that writes one is refused (even at its default value: build_config); a
    # config built otherwise is refused when one differs from its default (_check)
    refused_keys: ClassVar[dict[str, str]] = {
        f"{section}.{name}": f"it is not used by the asynchronous loop; {fix}"
        for (section, name), fix in _UNUSED.items()
    }

    grpo: GRPOLoopConfig = Field(
        default_factory=GRPOLoopConfig,
        description="group size, advantages, overlong handling, validation and seed; the step size and "
        "count come from async_grpo",
    )
    async_grpo: AsyncGRPOConfig = Field(
        default_factory=_default_async, description="steps, staleness, scheduling, bounds and the loss"
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train_chunk_rows: int | None = Field(
        None,
        ge=1,
        description="train a step's groups in chunks of at least this many rows, one train_microbatch "
        "call each (None: the larger of policy.microbatch.train_micro_batch_size and "
        "logprob_micro_batch_size; 1: one call per group)",
    )
    output_dir: str = Field(
        "runs/grpo_async", description="metrics.jsonl, curves.png, config.yaml and checkpoints/ go here"
    )
    distill: DistillSettings | None = Field(
        None,
        description="on-policy distillation: a teacher's per-token reverse KL on the student's sampled "
        "tokens is the advantage (algorithms/distill_core.py), computed on the trainer for every chunk",
    )

    def group_baseline_weight(self) -> float:
        return 1.0 if self.distill is None else self.distill.reward_weight

    @model_validator(mode="after")
    def _check(self) -> AsyncGRPORunConfig:
        for (section, name), fix in _UNUSED.items():
            value = getattr(self, section)
            if getattr(value, name) != type(value).model_fields[name].default:
                raise ValueError(f"{section}.{name} is not used by the asynchronous loop; {fix}")
        kl = self.async_grpo.loss.reference_policy_kl_penalty
        refuse_kl_without_reference(self.policy, kl, "async_grpo.loss.reference_policy_kl_penalty")
        if self.distill is not None:
            refuse_dynamic_sampling(self.grpo, DISTILLATION_LEARNS_FROM_EVERY_GROUP)
            distill = self.distill.for_student(self.policy, self.sampling.temperature)
            if distill is not self.distill:
                self.distill = distill
        return self


def worker_config(cfg: AsyncGRPORunConfig) -> RolloutWorkerConfig:
    """What each engine rollout worker of the run is built from."""
    return RolloutWorkerConfig(
        model=cfg.policy.model,
        lora=cfg.policy.lora,
        # routing replay: the engines record each sample's MoE routing, which its rows carry to the trainer
        generation=cfg.generation.model_copy(
            update={"record_routing": cfg.policy.moe.routing_replay != "off"}
        ),
        sampling=cfg.sampling,
        task=cfg.task,
        env=cfg.env,
        group=cfg.grpo,
        weight_sync=cfg.weight_sync,
        dp_size=cfg.policy.dp_size,
    )
