"""Typed configs of the rollout layer: how a prompt group is sampled, scored and laid out as training
rows (`GroupConfig`, the `grpo:` section's shared part), what an engine rollout worker is built from
(`RolloutWorkerConfig`), and where rollout workers run (`RolloutConfig`)."""

from __future__ import annotations

from pydantic import Field

from posttrain.config import Config
from posttrain.envs.build import EnvConfig
from posttrain.generation.params import GenerationConfig, SamplingParams
from posttrain.generation.weight_sync import WeightSyncConfig
from posttrain.models.lora import LoraSettings
from posttrain.parallel.cluster import ClusterConfig
from posttrain.policy.config import ModelConfig
from posttrain.tasks.arithmetic import ArithmeticTaskConfig
from posttrain.tasks.build import TaskConfig


class GroupConfig(Config):
    """A prompt group: its size, how its rewards become advantages, overlong handling, held-out
    validation and the seed its samples are drawn from (names follow NeMo-RL)."""

    num_generations_per_prompt: int = Field(
        8, ge=1, description="samples per prompt (the group); advantages compare a group's samples"
    )
    normalize_rewards: bool = Field(True, description="divide advantages by the group's reward std")
    use_leave_one_out_baseline: bool = Field(False, description="RLOO baseline instead of the group mean")
    overlong_filtering: bool = Field(False, description="truncated completions do not contribute to the loss")
    overlong_reward_shaping: bool = Field(False, description="DAPO soft penalty near max_new_tokens")
    overlong_buffer_length: int = Field(
        4,
        ge=1,
        description="reward shaping: the penalty grows over this many tokens before max_new_tokens (less "
        "than sampling.max_new_tokens: a buffer as long would penalise every sample)",
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="reward shaping: the reward taken off at max_new_tokens (less before it)"
    )
    val_num_generations: int = Field(1, ge=1, description="k of pass@k (k=1: greedy accuracy)")
    val_max_prompts: int | None = Field(None, ge=1, description="held-out prompts validated (None: all)")
    seed: int = Field(
        0, description="seed of the run: torch's global seed, the sampling streams and validation"
    )


def refuse_overlong_buffer(group: GroupConfig, max_new_tokens: int) -> None:
    """Refuse DAPO overlong shaping whose buffer covers every completion length: with
    `overlong_buffer_length >= max_new_tokens` the penalty zone starts at or before the first token, so
    even a short answer that stopped on EOS loses reward. The run configs' shared sections call this at load."""
    if group.overlong_reward_shaping and group.overlong_buffer_length >= max_new_tokens:
        raise ValueError(
            f"grpo.overlong_buffer_length={group.overlong_buffer_length} is not below "
            f"sampling.max_new_tokens={max_new_tokens}: the overlong penalty would start at the first token "
            "and lower every sample's reward. Set grpo.overlong_buffer_length to at most "
            f"{max_new_tokens - 1} (DAPO uses a fraction of max_new_tokens), raise sampling.max_new_tokens, "
            "or set grpo.overlong_reward_shaping=false"
        )


class RolloutWorkerConfig(Config):
    """What an engine rollout worker is built from: the policy's model, the engine and sampling
    settings, the task (for its prompts' reward), the group settings and the weight-sync probe."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraSettings | None = Field(
        None, description="the policy's LoRA settings (with lora.engine=adapters the engine carries them)"
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    env: EnvConfig | None = Field(None, description="a multi-turn environment in place of the task")
    group: GroupConfig = Field(default_factory=GroupConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    dp_size: int = Field(1, ge=1, description="the trainer's data-parallel size (probe rows are a multiple)")


class RolloutConfig(ClusterConfig):
    """Where the rollout workers (one generation engine each) run: `backend: local` runs the engines in
    this process, `ray` one engine per Ray actor (the cluster keys mean what they mean for the policy;
    `timeout_s` bounds starting the actors)."""

    timeout_s: float = Field(300.0, gt=0, description="bound on starting the rollout actors")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per rollout actor (None: Ray's default)"
    )
