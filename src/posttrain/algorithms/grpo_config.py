"""The configuration every GRPO run shares, synchronous (grpo.py) or asynchronous (async_grpo/): the
`grpo:` section (`GRPOLoopConfig`: the group settings of rollout.config.GroupConfig plus the loop's own)
and the sections of a run (`GRPORunSections`). Each loop imports it; neither loop imports the other."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.algorithms.checkpointing import CheckpointingConfig
from posttrain.config import Config
from posttrain.envs.build import EnvConfig
from posttrain.generation.params import GenerationConfig, SamplingParams
from posttrain.generation.weight_sync import WeightSyncConfig
from posttrain.logging import LoggingConfig
from posttrain.policy.config import PolicyConfig
from posttrain.rollout.config import GroupConfig, refuse_overlong_buffer
from posttrain.tasks.arithmetic import ArithmeticTaskConfig
from posttrain.tasks.build import TaskConfig


class GRPOLoopConfig(GroupConfig):
    """The loop's knobs (names follow NeMo-RL); the group settings are rollout.config.GroupConfig's."""

    num_prompts_per_step: int = Field(16, ge=1, description="prompts per step, each sampled as a group")
    max_num_steps: int = Field(50, ge=0, description="train until this step (a resumed run too)")
    max_num_epochs: int = Field(
        1000,
        ge=1,
        description="stop after this many passes over the prompts, checked between steps: a step is always "
        "whole, so the one that ends the last pass draws the rest of its batch (and any dynamic-sampling "
        "refill) from the next pass (grpo-async's async_grpo.num_epochs draws each prompt exactly that often)",
    )
    dynamic_sampling: bool = Field(False, description="drop groups with zero reward variance, refill")
    dynamic_sampling_max_refills: int = Field(
        2,
        ge=0,
        description="extra prompt batches per step at most (grpo-async: more than (1 + this) x "
        "async_grpo.target_prompt_groups_per_step groups filtered in a step that kept none stop the run)",
    )
    sample_seeds: Literal["step", "group"] = Field(
        "step",
        description="step: one seed per step's prompt batch (sample i of the step draws random stream i); "
        "group: each group draws streams 0..G-1 of a seed of (grpo.seed, prompt id, weight version), as "
        "grpo-async always does, so a synchronous run and an asynchronous one at max_staleness=0 draw the "
        "same samples (common random numbers for comparing the two loops); a prompt drawn again at the same "
        "weights (twice in one step, or a dynamic-sampling refill of it) adds its repeat count to the seed, "
        "so it draws a new group",
    )
    val_period: int = Field(10, ge=0, description="validate every N steps (0 = never during training)")
    val_at_start: bool = Field(True, description="validate before the first step")
    recompute_prev_logprobs: Literal["auto", "always"] = Field(
        "auto",
        description="auto: skip the extra trainer forward when the step's samples make one optimizer "
        "step (prev_logprobs then equal the training forward's own logprobs, detached: the loss uses "
        "force_on_policy_ratio for the PPO ratio and the importance-sampling weights, as TRL does with "
        "num_iterations=1); always: compute prev_logprobs in a separate forward",
    )


DISTILLATION_LEARNS_FROM_EVERY_GROUP = (
    "distillation learns from every group (its advantages come from the teacher)"
)


def refuse_dynamic_sampling(loop: GRPOLoopConfig, why: str) -> None:
    """Refuse `grpo.dynamic_sampling` in a run whose advantages do not come from the group (`why`)."""
    if loop.dynamic_sampling:
        raise ValueError(
            f"grpo.dynamic_sampling drops prompt groups whose rewards are all equal, but {why}: set "
            "grpo.dynamic_sampling=false"
        )


def refuse_kl_without_reference(policy: PolicyConfig, coef: float, key: str) -> None:
    """Refuse a KL-to-reference term (`key` = `coef` > 0) when the policy keeps no reference (with LoRA
    the reference is the base model, adapters off: no copy, but still policy.init_reference_model)."""
    if coef > 0 and not policy.init_reference_model:
        raise ValueError(
            f"{key}={coef} needs the reference policy's logprobs, but policy.init_reference_model=false "
            f"keeps no reference: set policy.init_reference_model=true (with LoRA it costs no copy: the "
            f"reference is the base model with its adapters off), or {key}=0"
        )


class GRPORunSections(Config):
    """The sections every GRPO run has, synchronous or asynchronous (each means the same in both)."""

    policy: PolicyConfig = Field(
        default_factory=lambda: PolicyConfig(optimizer={"lr": 1e-3}, train_global_batch_size=128)
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(max_new_tokens=8))
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    env: EnvConfig | None = Field(
        None,
        description="a multi-turn environment in place of the single-turn task (the task is then unused); "
        "groups are trajectories of the same sample",
    )
    grpo: GRPOLoopConfig = Field(default_factory=GRPOLoopConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    def group_baseline_weight(self) -> float:
        """How much of a sample's advantage is its reward minus its group's baseline (GRPO: all of it;
        a run whose advantages come from elsewhere overrides this)."""
        return 1.0

    @model_validator(mode="after")
    def _groups_of_two(self) -> GRPORunSections:
        g = self.grpo.num_generations_per_prompt
        if g < 2 and self.group_baseline_weight() > 0:
            raise ValueError(
                f"grpo.num_generations_per_prompt={g}: a group of {g} cannot train: a sample's advantage is "
                "its reward minus its group's mean (or the others' mean), so with one sample per prompt "
                "every advantage is 0. Use 2 or more (4 to 16 is usual)"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer(self) -> GRPORunSections:
        refuse_overlong_buffer(self.grpo, self.sampling.max_new_tokens)
        return self

    @model_validator(mode="after")
    def _logprob_temperature(self) -> GRPORunSections:
        """The trainer scores the samples at the temperature the engine drew them at (NeMo-RL and verl
        divide the trainer's logits by the sampling temperature too): an unset
        policy.logprob_temperature takes sampling.temperature, another value is refused."""
        if self.policy.scoring_temperature != self.sampling.temperature:
            self.policy = self.policy.scoring_at(
                self.sampling.temperature, "policy.logprob_temperature", "sampling.temperature"
            )
        return self

    def check_scoring(self, policy_cfg: PolicyConfig | None) -> None:
        """Before a run starts: the policy (and `policy_cfg`, that of a policy passed in) scores at the
        sampling temperature. The tie is made when the config is built; a field changed afterwards
        (`cfg.sampling.temperature = ...`, a `model_copy(update=...)`) is not validated again."""
        drawn = self.sampling.temperature
        for what, cfg in (("policy", self.policy), ("the policy passed in", policy_cfg)):
            if cfg is not None and cfg.scoring_temperature != drawn:
                raise ValueError(
                    f"{what} scores tokens at temperature {cfg.scoring_temperature} but sampling.temperature="
                    f"{drawn}: the run config was changed after it was built, or a policy built for another "
                    "temperature was passed in. Build the config again from its fields (model_validate) "
                    f"after changing sampling.temperature, or use a policy whose logprob_temperature is {drawn}"
                )

    @model_validator(mode="after")
    def _env_without_routing_replay(self) -> GRPORunSections:
        """A trajectory of an environment keeps no routing (its replies are sampled turn by turn): the
        trainer would route its own tokens while the config asks for replay, so the pair is refused."""
        if self.env is not None and self.policy.moe.routing_replay != "off":
            raise ValueError(
                f"env ({self.env.name}) with policy.moe.routing_replay={self.policy.moe.routing_replay}: "
                "multi-turn trajectories do not carry the engine's MoE routing, so the trainer could not "
                "replay it; set policy.moe.routing_replay=off, or unset env to train on a single-turn task"
            )
        return self
