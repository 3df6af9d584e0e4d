"""PPO with a critic: the policy samples, a value model (the critic) estimates each token's value, and GAE
over token rewards gives the advantages that the clipped policy-gradient loss trains on.

A step is the synchronous GRPO step (grpo.py: generate, score, batch, logprobs, train, sync) with two
phases replaced:
- logprobs: the policy's logprobs (prev, and reference when a KL term needs them), then the critic's
  values V_t of the state each completion token was sampled from; token rewards r_t (the sample's reward
  on its last trained token, minus `kl_coef` x the per-token KL(pi || pi_ref) on every trained token when
  `ppo.kl_coef` > 0); GAE (gamma, lam) gives advantages A_t and returns R_t = A_t + V_t; the advantages
  are whitened over the step's trained tokens (`ppo.whiten_advantages`);
- train: `ppo_epochs` passes over the batch, each cut into optimizer steps of
  `train_global_batch_size` rows (mini-batches; rows shuffled after the first pass): the critic with
  the clipped value loss (losses.ValueLoss) against R_t, then the policy with the clipped surrogate.
  For the first `critic_warmup_steps` steps only the critic trains.

The critic is a scalar-head `Policy` (`model.head=score`, models/scalar_head.py) on the same lifecycle
and layouts as the policy (FSDP2, TP/SP), initialised from the policy's model (a new score head) or from
a reward model (`ppo.critic.model.name`: `posttrain rm`'s hf/ directory). It is a checkpoint companion:
saved with every checkpoint and restored on resume (algorithms/checkpointing.py).

The loop section keeps its name, `grpo:` (prompts per step, steps, validation), with groups of one
sample allowed: the critic, not the group, is the baseline.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator
from tensordict import TensorDict

from posttrain.algorithms import grpo
from posttrain.algorithms.grpo_config import (
    GRPOLoopConfig,
    refuse_dynamic_sampling,
    refuse_kl_without_reference,
)
from posttrain.algorithms.losses import ValueLoss, kl_penalty, token_weights
from posttrain.config import Config
from posttrain.generation.sampler import derive_seed
from posttrain.logging import get_logger
from posttrain.models.scalar_head import action_values
from posttrain.policy.config import ModelConfig, PolicyConfig
from posttrain.policy.model_init import build_tokenizer
from posttrain.policy.policy import Policy
from posttrain.rollout.advantages import gae, masked_whiten, token_rewards

log = get_logger(__name__)

_SHUFFLE = 11  # derive_seed tag of the epochs' row orders (rollout/groups.py tags the sampling seeds)


class PPOLoopConfig(GRPOLoopConfig):
    """The loop section of a PPO run: GRPO's, with one sample per prompt by default and allowed."""

    num_prompts_per_step: int = Field(128, ge=1, description="prompts per step")
    num_generations_per_prompt: int = Field(
        1, ge=1, description="samples per prompt (the critic is the baseline, so one is enough)"
    )


class CriticConfig(PolicyConfig):
    """A critic's policy config: a PolicyConfig whose model has a score head unless written otherwise."""

    model: ModelConfig = Field(
        default_factory=lambda: ModelConfig(head="score"),
        description="the critic's model: a causal LM gets a new score head, a sequence-classification model "
        "(e.g. `posttrain rm`'s hf/) keeps its own",
    )


class PPOSettings(Config):
    """The `ppo:` section: the critic, GAE, the KL-in-reward term and the epochs."""

    critic: CriticConfig | None = Field(
        None,
        description="the critic's model (a causal LM gets a new score head; a sequence-classification "
        "model such as `posttrain rm`'s hf/ starts with its head), optimizer, micro-batching and layout, "
        "a config of its own (keys left out take PolicyConfig's defaults, not the policy's values); "
        "None: the policy's config with model.head=score (no reference copy, no LoRA, no MoE routing replay)",
    )
    critic_lr: float | None = Field(None, gt=0, description="the critic's learning rate (None: its config's)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of GAE")
    lam: float = Field(0.95, ge=0, le=1, description="lambda of GAE")
    kl_coef: float = Field(
        0.0, ge=0, description="per-token KL(pi || pi_ref) penalty in the reward (0 = off; needs a reference)"
    )
    kl_type: Literal["k1", "k2", "k3"] = Field(
        "k1", description="estimator of the per-token KL in the reward"
    )
    whiten_advantages: bool = Field(True, description="whiten advantages over the step's trained tokens")
    value_clip: float | None = Field(
        0.2, gt=0, description="clip of the value update around the old values (None = unclipped loss)"
    )
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's batch (policy and critic)")
    critic_warmup_steps: int = Field(0, ge=0, description="first steps that train only the critic")

    @model_validator(mode="before")
    @classmethod
    def _score_head_by_default(cls, data: Any) -> Any:
        """A written `critic` whose model names no `head` has a score head (a critic is a scalar-head model)."""
        critic = data.get("critic") if isinstance(data, dict) else None
        model = critic.get("model", {}) if isinstance(critic, dict) else None
        if isinstance(model, dict) and "head" not in model:
            data = {**data, "critic": {**critic, "model": {**model, "head": "score"}}}
        return data


class PPOConfig(grpo.GRPOConfig):
    """A PPO run: a synchronous GRPO run whose advantages come from a critic and GAE."""

    algorithm: ClassVar[str] = "ppo"

    grpo: PPOLoopConfig = Field(default_factory=PPOLoopConfig)
    ppo: PPOSettings = Field(default_factory=PPOSettings)
    output_dir: str = Field(
        "runs/ppo", description="metrics.jsonl, curves.png, config.yaml and checkpoints/ go here"
    )

    def passes_over_batch(self) -> int:
        return self.ppo.ppo_epochs

    def group_baseline_weight(self) -> float:
        return 0.0  # the critic is the baseline: groups of one sample train

    @model_validator(mode="after")
    def _check_ppo(self) -> PPOConfig:
        refuse_dynamic_sampling(
            self.grpo, "PPO's baseline is the critic, not the group (a group of one always looks flat)"
        )
        refuse_kl_without_reference(self.policy, self.ppo.kl_coef, "ppo.kl_coef")
        if self.ppo.critic is None and self.policy.parallel.context_parallel_size > 1:
            raise ValueError(
                f"the default critic (ppo.critic unset) copies the policy's layout, context_parallel_size="
                f"{self.policy.parallel.context_parallel_size}, and a scalar-head model does not run with "
                "context parallelism yet: write a ppo.critic section with parallel.context_parallel_size=1"
            )
        if self.ppo.critic is not None:
            self.ppo.critic.check_routes_itself("ppo.critic", "policy")
        critic = critic_config(self)
        if critic.model.head != "score":
            raise ValueError("ppo.critic.model.head=lm: a critic is a scalar-head model; set it to score")
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if samples % critic.train_global_batch_size:
            raise ValueError(
                f"ppo.critic.train_global_batch_size={critic.train_global_batch_size} does not divide the "
                f"{samples} samples of a step: use a divisor of {samples} (e.g. the policy's "
                f"{self.policy.train_global_batch_size})"
            )
        return self


def critic_config(cfg: PPOConfig) -> PolicyConfig:
    """The critic's PolicyConfig as it runs (see PPOSettings.critic), with `critic_lr` applied."""
    if cfg.ppo.critic is None:
        model = cfg.policy.model.model_copy(update={"head": "score"})
        # the critic routes its own tokens: the engine's routing record is the policy's
        moe = cfg.policy.moe.model_copy(update={"routing_replay": "off"})
        critic = cfg.policy.model_copy(
            update={"model": model, "moe": moe, "init_reference_model": False, "lora": None}
        )
    else:
        critic = cfg.ppo.critic.model_copy(update={"init_reference_model": False})
    if cfg.ppo.critic_lr is not None:
        optimizer = critic.optimizer.model_copy(update={"lr": cfg.ppo.critic_lr})
        critic = critic.model_copy(update={"optimizer": optimizer})
    return PolicyConfig.model_validate(critic.model_dump())


# --------------------------------------------------------------------------- the loop


def run_ppo(cfg: PPOConfig, policy: Policy | None = None, critic: Policy | None = None) -> dict[str, float]:
    """Train with PPO; returns the final metrics (with the last held-out validation). The GRPO loop runs
    it, with `ppo_step` as its step and the critic as a checkpoint companion."""
    own = critic is None
    if own:
        check_critic_vocabulary(cfg)
    critic = critic or Policy(critic_config(cfg), seed=cfg.grpo.seed)
    try:
        return grpo.run_grpo(
            cfg, policy, step_fn=lambda run: ppo_step(run, critic, cfg.ppo), companions={"critic": critic}
        )
    finally:
        if own:
            critic.shutdown()


def check_critic_vocabulary(cfg: PPOConfig) -> None:
    """Refuse, before weights load, a critic whose tokenizer maps tokens to other ids than the policy's:
    it reads the policy's token ids as they are."""
    critic = critic_config(cfg).model
    mine = cfg.policy.model
    if (critic.name, critic.tokenizer, critic.tiny) == (mine.name, mine.tokenizer, mine.tiny):
        return
    if build_tokenizer(critic).get_vocab() != build_tokenizer(mine).get_vocab():
        raise ValueError(
            f"the critic '{critic.name}' has another vocabulary than the policy '{mine.name}': it reads the "
            "policy's token ids as they are. Start it from the policy's model family (ppo.critic.model.name), "
            "or set ppo.critic.model.tokenizer to the policy's tokenizer if it was trained with it"
        )


def ppo_step(run: grpo.Run, critic: Policy, settings: PPOSettings) -> dict[str, float]:
    """One step: generate -> score -> batch -> logprobs, values, GAE -> critic and policy epochs -> sync."""
    metrics: dict[str, float] = {}

    def logprobs(r: grpo.Run, batch: TensorDict) -> None:
        metrics.update(add_advantages(r, critic, settings, batch))

    def train(r: grpo.Run, batch: TensorDict) -> dict[str, float]:
        metrics.update({f"critic/{k}": v for k, v in train_critic(r, critic, settings, batch).items()})
        if r.step <= settings.critic_warmup_steps:
            return {}
        r.policy.prepare_for_training()
        return _epochs(r, batch, settings, lambda b: r.policy.train(b, r.loss_fn))

    return {**grpo.grpo_step(run, logprobs_fn=logprobs, train_fn=train), **metrics}


def add_advantages(
    run: grpo.Run, critic: Policy, settings: PPOSettings, batch: TensorDict
) -> dict[str, float]:
    """The GRPO logprobs (prev, reference), the critic's values, then GAE: `advantages`, `returns` and
    `old_values` in the batch; returns the step's PPO metrics."""
    grpo.add_logprobs(run, batch)
    mask = token_weights(batch)
    per_token = None
    kl = torch.zeros_like(mask)
    if settings.kl_coef > 0:
        on_policy = grpo.skips_prev_logprobs(run.cfg)
        current = run.policy.get_logprobs(batch) if on_policy else batch["prev_logprobs"]
        has_ref = run.cfg.loss.reference_policy_kl_penalty > 0
        ref = batch["reference_logprobs"] if has_ref else run.policy.get_reference_policy_logprobs(batch)
        kl = kl_penalty(current.float(), ref.float(), settings.kl_type) * mask
        per_token = -settings.kl_coef * kl
    critic.prepare_for_lp_inference()
    values = action_values(critic.get_values(batch).float()) * mask
    if grpo.time_shares_device(run):
        critic.offload_after_refit()
    rewards = token_rewards(batch["rewards"], mask, per_token)
    advantages, returns = gae(rewards, values, mask, settings.gamma, settings.lam)
    raw = advantages
    if settings.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    batch["advantages"], batch["returns"], batch["old_values"] = advantages, returns, values
    return ppo_metrics(mask, values, returns, raw, kl)


def ppo_metrics(
    mask: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    advantages: torch.Tensor,
    kl: torch.Tensor,
) -> dict[str, float]:
    """Means over the step's trained tokens, and the critic's explained variance of the returns."""
    m = mask.bool()
    if not m.any():
        return {}
    v, r = values[m].double(), returns[m].double()
    var = r.var(unbiased=False)
    explained = float(1 - (r - v).var(unbiased=False) / var) if var > 0 else float("nan")
    return {
        "ppo/value_mean": float(v.mean()),
        "ppo/return_mean": float(r.mean()),
        "ppo/explained_variance": explained,
        "ppo/kl": float(kl[m].double().mean()),
        "advantage_abs_mean": float(advantages[m].abs().double().mean()),  # before whitening
    }


def train_critic(run: grpo.Run, critic: Policy, settings: PPOSettings, batch: TensorDict) -> dict[str, float]:
    """`ppo_epochs` passes of the clipped value loss over the batch; the critic then leaves the device to
    the engine when they take turns."""
    critic.prepare_for_training()
    loss = ValueLoss(settings.value_clip)
    out = _epochs(run, batch, settings, lambda b: critic.train(b, loss))
    if grpo.time_shares_device(run):
        critic.offload_after_refit()
    return out


def _epochs(run: grpo.Run, batch: TensorDict, settings: PPOSettings, train) -> dict[str, float]:
    """`train` on the batch `ppo_epochs` times, its rows in order first, then shuffled (seeded by the run's
    seed, step and epoch, so policy and critic see the same mini-batches); the last pass's metrics."""
    out: dict[str, float] = {}
    for epoch in range(settings.ppo_epochs):
        rows = batch
        if epoch:
            gen = torch.Generator().manual_seed(derive_seed(run.cfg.grpo.seed, _SHUFFLE, run.step, epoch))
            rows = batch[torch.randperm(batch.batch_size[0], generator=gen)]
        out = train(rows)
    return out
