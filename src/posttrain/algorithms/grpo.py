"""Synchronous GRPO: generate, score, advantages, logprobs, train, sync, in that order, every step.

Read `run_grpo` top to bottom; each phase is a short function below it. Departures from the textbook:
- failed rewards are never entered as 0: the sample is masked out and counted (tasks/rewards.py);
- dynamic sampling drops prompt groups whose rewards are all equal and refills up to a bound;
- generation seeds are derived from (seed, step, sample), or with `grpo.sample_seeds=group` from
  (seed, prompt, weight version, sample) as in the asynchronous loop, so a resumed run draws exactly
  the samples an uninterrupted run would;
- after every weight sync the engine's logprobs on a probe batch are checked against the trainer's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field, model_validator

from posttrain.algorithms.checkpointing import CheckpointManager
from posttrain.algorithms.grpo_config import GRPORunSections, refuse_kl_without_reference
from posttrain.algorithms.losses import ClippedPGConfig, ClippedPGLoss, with_completion_length
from posttrain.algorithms.runs import (
    RunInterrupted,
    StopOnInterrupt,
    check_fresh_start,
    closing_metrics,
    interrupted,
    optimizer_view,
    prompt_format_state,
    resume,
    resume_dump,
    start_history,
    start_run,
)
from posttrain.envs.build import EnvSuite
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationResult
from posttrain.generation.weight_sync import WeightSync, can_share
from posttrain.logging import StepProgress, get_logger, plot_metrics
from posttrain.models.tokenizer import pad_token_id
from posttrain.policy.model_init import engine_model
from posttrain.policy.policy import Policy
from posttrain.rollout import episodes
from posttrain.rollout import groups as rollout_groups
from posttrain.rollout import validation as rollout_validation
from posttrain.rollout.advantages import zero_variance_groups
from posttrain.rollout.groups import check_context, engine_config, group_seed, probe_sync, step_seed
from posttrain.rollout.reward_model import RewardModel, RewardModelConfig
from posttrain.rollout.rows import samples_to_batch
from posttrain.rollout.trajectory import Trajectory
from posttrain.tasks.datasets import PromptItem, RepeatCounter
from posttrain.tasks.task import Task

log = get_logger(__name__)


class GRPOConfig(GRPORunSections):
    """A synchronous GRPO run."""

    algorithm: ClassVar[str] = "grpo"  # its name in progress bars and messages (ppo.py, distill.py: theirs)

    loss: ClippedPGConfig = Field(default_factory=ClippedPGConfig)
    colocated: bool = Field(
        True,
        description="trainer offloaded while the engine generates, engine asleep while training (on an "
        "accelerator; on a CPU device both share host memory and neither is moved)",
    )
    output_dir: str = Field(
        "runs/grpo", description="metrics.jsonl, curves.png, config.yaml and checkpoints/ go here"
    )
    reward_model: RewardModelConfig | None = Field(
        None,
        description="score completions with a reward model (`posttrain rm`'s hf/ directory), alone or "
        "summed with the task's reward (reward_model.weight, reward_model.task_weight)",
    )

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        problem = batch_size_problem(self)
        if problem:
            raise ValueError(problem)
        kl = self.loss.reference_policy_kl_penalty
        refuse_kl_without_reference(self.policy, kl, "loss.reference_policy_kl_penalty")
        if self.reward_model is not None and self.env is not None:
            raise ValueError(
                "reward_model with env: a reward model scores single-turn completions of a task; unset env"
            )
        return self

    def passes_over_batch(self) -> int:
        """How many times a step trains on its batch (PPO's epochs; once for GRPO)."""
        return 1


def batch_size_problem(cfg: GRPOConfig) -> str | None:
    """Why `policy.train_global_batch_size` does not cut a step's samples into whole optimizer steps
    (a last step of a few real rows padded with empty ones), with the sizes that do; None when it does."""
    p, g = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    samples, gbs, dp = p * g, cfg.policy.train_global_batch_size, cfg.policy.dp_size
    if samples % gbs == 0:
        return None
    valid = [n for n in range(dp, samples + 1, dp) if samples % n == 0]
    what = (
        f"every step would train {samples} real rows padded to {gbs}"
        if gbs > samples
        else f"the last optimizer step of each GRPO step would hold {samples % gbs} real rows padded to {gbs}"
    )
    return (
        f"policy.train_global_batch_size={gbs} does not divide the {samples} samples of a step "
        f"(grpo.num_prompts_per_step={p} x grpo.num_generations_per_prompt={g}): {what}. Use one of "
        f"{', '.join(map(str, valid))}, or change grpo.num_prompts_per_step."
    )


# Loop settings a resumed run must share with the checkpoint (they shape the trajectory).
RESUME_KEYS = ("grpo", "sampling", "task", "env", "loss", "reward_model")
# ... except these, which a resumed run may change (each change is logged).
RESUME_MAY_CHANGE = (
    "grpo.max_num_steps",
    "grpo.max_num_epochs",
    "grpo.val_period",
    "grpo.val_at_start",
    "grpo.val_max_prompts",
    "grpo.val_num_generations",
    "task.max_eval_prompts",
    "policy.optimizer.lr",
)


@dataclass
class Rollouts:
    """One step's samples: prompts x generations, flattened in group order."""

    items: list[PromptItem]
    results: list[GenerationResult] | list[Trajectory]
    rewards: torch.Tensor
    failed: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Run:
    """Everything a step needs."""

    cfg: GRPOConfig
    out: Path
    policy: Policy
    engine: GenerationEngine
    task: Task | EnvSuite  # its train/eval prompts; an environment plays multi-turn episodes
    tokenizer: Any
    loss_fn: ClippedPGLoss
    weight_sync: WeightSync
    share_weights: bool = False  # the engine aliases the trainer's tensors (see sync_weights)
    reward_model: RewardModel | None = None  # scores completions with (or instead of) the task's reward
    companions: dict[str, Policy] = field(default_factory=dict)  # trained beside the policy (PPO's critic)
    step: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    # draws of each prompt at the engine's weight version: a prompt drawn again at the same weights (later
    # in the step, or in the next step when this one trained nothing) is seeded apart (sample_seeds=group)
    repeats: RepeatCounter = field(default_factory=RepeatCounter)

    @contextlib.contextmanager
    def timed(self, name: str):
        t0 = time.perf_counter()
        yield
        self.timings[f"timing/{name}_s"] = time.perf_counter() - t0


# --------------------------------------------------------------------------- the loop


def run_grpo(
    cfg: GRPOConfig,
    policy: Policy | None = None,
    step_fn: Callable[[Run], dict[str, float]] | None = None,
    companions: dict[str, Policy] | None = None,
) -> dict[str, float]:
    """Train with GRPO; returns the final metrics (including the last validation). Ctrl-C stops after
    the current step, with a checkpoint there, by raising `RunInterrupted`. `step_fn` replaces
    `grpo_step` (distill.py and ppo.py run their steps in this loop). `companions`: policies trained
    beside the policy (PPO's critic), saved in each checkpoint and restored on resume with it."""
    step_fn = step_fn or grpo_step
    companions = companions or {}
    ckpt = CheckpointManager(cfg.checkpointing, cfg.output_dir, tuple(companions))
    check_fresh_start(cfg.output_dir, ckpt)
    run = setup(cfg, policy)
    run.companions = companions
    try:
        last = resume_from(run, ckpt)  # the checkpoint's metrics: the result when nothing is left to train
        metrics_log = start_history(run.out, cfg, ckpt, cfg.logging, run.step)
    except BaseException:
        shut_down_reward_model(run)
        raise
    if run.step and run.step >= cfg.grpo.max_num_steps:
        log.warning("the run is at step %d already: nothing to train (raise grpo.max_num_steps)", run.step)
    progress = StepProgress(
        cfg.grpo.max_num_steps,
        cfg.algorithm,
        ("reward", "val/accuracy", "step_time_s"),
        cfg.logging.progress_bar,
    )
    saved = run.step  # the newest checkpoint's step
    metrics: dict[str, float] = {}  # the latest step's own (`last` also holds earlier validations)
    try:
        with closing_metrics(metrics_log), StopOnInterrupt(cfg.algorithm, cfg.checkpointing.enabled) as stop:
            if cfg.grpo.val_at_start and run.step == 0 and run.task.eval is not None:
                last.update(validate(run))
                metrics_log.log(last, 0)
            while keeps_going(run) and not stop.requested:
                run.step += 1
                metrics = step_fn(run)
                if cfg.grpo.val_period and run.step % cfg.grpo.val_period == 0 and run.task.eval is not None:
                    metrics.update(validate(run))
                metrics_log.log(metrics, run.step)
                progress.update(run.step, metrics)
                last.update(metrics)
                # the last step is saved, whether the step limit or the epoch limit ended the run
                last_step = cfg.grpo.max_num_steps if keeps_going(run) else run.step
                if ckpt.should_save(run.step, last_step):
                    ckpt.save(run.policy, run.step, loop_state(run), metrics, run.companions)
                    saved = run.step
            if stop.requested and keeps_going(run):
                raise stop_here(run, ckpt, saved, metrics)
    finally:
        progress.close()
        shut_down_reward_model(run)
    plot_metrics(metrics_log.path, run.out / "curves.png", episodes.CURVES)
    return last


def shut_down_reward_model(run: Run) -> None:
    if run.reward_model is not None:
        run.reward_model.shutdown()


def keeps_going(run: Run) -> bool:
    return run.step < run.cfg.grpo.max_num_steps and run.task.train.epoch < run.cfg.grpo.max_num_epochs


def stop_here(run: Run, ckpt: CheckpointManager, saved: int, metrics: dict[str, float]) -> RunInterrupted:
    """Ctrl-C: a checkpoint at the step the run stopped at (unless it has one) with that step's `metrics`,
    and the message."""
    path = ckpt.root / f"step_{run.step}"
    if not run.cfg.checkpointing.enabled or run.step == 0:
        path = None
    elif saved != run.step or not (path / "metadata.json").is_file():
        path = ckpt.save(run.policy, run.step, loop_state(run), metrics, run.companions)
    return interrupted(run.cfg.algorithm, run.step, run.cfg.grpo.max_num_steps, run.cfg.checkpointing, path)


def grpo_step(
    run: Run,
    logprobs_fn: Callable[[Run, Any], None] | None = None,
    train_fn: Callable[[Run, Any], dict[str, float]] | None = None,
) -> dict[str, float]:
    """One step: generate -> score -> advantages -> logprobs -> train -> sync. `logprobs_fn` replaces
    `add_logprobs` (distill.py adds the teacher's logprobs and its advantages there; ppo.py the
    critic's values and GAE advantages), `train_fn` replaces `train` (ppo.py: critic and epochs)."""
    t0 = time.perf_counter()
    run.timings = {}
    with run.timed("generation"):
        rollouts = generate(run)
    run.timings["timing/generation_s"] -= rollouts.metrics["timing/reward_s"]  # scoring: its own phase
    batch, adv_metrics = build_batch(run, rollouts)
    with run.timed("logprobs"):
        (logprobs_fn or add_logprobs)(run, batch)
    with run.timed("training"):
        train_metrics = (train_fn or train)(run, batch)
    if run.cfg.policy.moe.routing_replay == "rollout":
        routing = run.policy.pop_routing_stats()
        train_metrics["moe/routing_disagreement"] = routing["differ"] / max(routing["total"], 1)
        train_metrics["moe/routing_replayed"] = float(routing["total"])  # decisions replayed this step
    with run.timed("weight_sync"):
        sync_metrics = sync_weights(run)
    metrics = {
        **rollouts.metrics,
        **adv_metrics,
        **{f"train/{k}": v for k, v in train_metrics.items()},
        **sync_metrics,
        **run.timings,
        "step_time_s": time.perf_counter() - t0,
        "epoch": float(run.task.train.epoch),
    }
    return metrics


# --------------------------------------------------------------------------- phases


def setup(cfg: GRPOConfig, policy: Policy | None) -> Run:
    """Policy, tokenizer, task, engine (with the policy's weights) and the probe batch."""
    problem = batch_size_problem(cfg)  # also checked when the config is built; a model_copy skips that
    if problem:
        raise ValueError(problem)
    cfg.check_scoring(policy.cfg if policy is not None else None)
    parts = start_run(cfg.output_dir, cfg.grpo.seed, cfg.policy, cfg.task, policy, cfg.env)
    policy, tokenizer, task = parts.policy, parts.tokenizer, parts.task
    check_context(cfg.generation, cfg.sampling, task, cfg.policy.model, tokenizer)
    gen_cfg = engine_config(cfg.generation, cfg.sampling, task)
    if cfg.policy.moe.routing_replay == "rollout":  # the trainer replays the engine's MoE routing
        gen_cfg = gen_cfg.model_copy(update={"record_routing": True})
    engine = GenerationEngine(engine_model(cfg.policy.model, cfg.policy.lora, tokenizer), tokenizer, gen_cfg)
    sync = probe_sync(cfg.weight_sync, engine.vocab_size, cfg.policy.dp_size)
    loss_cfg = with_completion_length(cfg.loss, cfg.sampling.max_new_tokens)
    run = Run(cfg, parts.out, policy, engine, task, tokenizer, ClippedPGLoss(loss_cfg), sync)
    if cfg.reward_model is not None:
        run.reward_model = RewardModel(cfg.reward_model, tokenizer)
    if skips_prev_logprobs(cfg):
        run.loss_fn = ClippedPGLoss(loss_cfg.model_copy(update={"force_on_policy_ratio": True}))
    run.share_weights = (
        cfg.weight_sync.share == "auto" and not time_shares_device(run) and can_share(policy, engine)
    )
    first = sync_weights(run)
    log.info(
        "engine %s the trainer's weights; probe max |engine - trainer| logprob difference %.3g",
        "aliases" if run.share_weights else "holds a copy of",
        first.get("weight_sync/probe_max_abs_diff", float("nan")),
    )
    return run


def sample_seeds(run: Run, items: list[PromptItem], salt: int) -> int | list[int]:
    """The seed of the step's draw of `items` (`salt`: the refill attempt): one of (seed, step, salt),
    or with `grpo.sample_seeds=group` one per group of (seed, prompt id, the engine's weight version),
    the asynchronous loop's."""
    loop = run.cfg.grpo
    if loop.sample_seeds == "group":
        return [group_seed(loop.seed, it.prompt_id, run.engine.weight_version, it.repeat) for it in items]
    return step_seed(loop.seed, run.step, salt)


def sample_groups(run: Run, items: list[PromptItem], salt: int) -> list[GenerationResult]:
    """The step's groups for `items` (`salt`: the refill attempt), seeded by `sample_seeds`."""
    g = run.cfg.grpo.num_generations_per_prompt
    return rollout_groups.sample_groups(
        run.engine, items, g, run.cfg.sampling, sample_seeds(run, items, salt)
    )


def score(run: Run, items: list[PromptItem], results: list[GenerationResult]):
    """Rewards and failure flags (failed rewards are marked, never zeroed), with overlong shaping."""
    max_new = run.cfg.sampling.max_new_tokens
    return rollout_groups.score(
        run.task, run.tokenizer, items, results, run.cfg.grpo, max_new, run.reward_model
    )


def play(run: Run, items: list[PromptItem], salt: int) -> tuple[list[Trajectory], Any, Any, dict]:
    """An environment's episodes for `items` (seeded as `sample_groups`) with their rewards."""
    seed = sample_seeds(run, items, salt)
    g = run.cfg.grpo.num_generations_per_prompt
    trajs = episodes.play_step(run.engine, run.tokenizer, run.task, items, g, run.cfg.sampling, seed)
    return (trajs, *episodes.trajectory_rewards(trajs))


def draw(run: Run, items: list[PromptItem], salt: int) -> tuple[list, Any, Any, dict, float]:
    """Samples of `items` (completions, or an environment's trajectories), rewards, failure flags,
    their summary and the seconds spent scoring."""
    if isinstance(run.task, EnvSuite):
        return (*play(run, items, salt), 0.0)
    results = sample_groups(run, items, salt)
    t1 = time.perf_counter()
    rewards, failed, summary = score(run, items, results)
    return results, rewards, failed, summary, time.perf_counter() - t1


def generate(run: Run) -> Rollouts:
    """Generate and score prompt groups; with dynamic sampling, refill zero-variance groups."""
    loop = run.cfg.grpo
    g = loop.num_generations_per_prompt
    colocated_generation_start(run)
    kept_items, kept_results, kept_rewards, kept_failed = [], [], [], []
    dropped, summaries, sizes, drawn = 0, [], [], []
    t_reward = 0.0
    for attempt in range(1 + (loop.dynamic_sampling_max_refills if loop.dynamic_sampling else 0)):
        need = loop.num_prompts_per_step - len(kept_items)
        if need <= 0:
            break
        items = run.task.train.next_batch(need if attempt else loop.num_prompts_per_step)
        items = [run.repeats.mark(it, run.engine.weight_version) for it in items]
        results, rewards, failed, summary, seconds = draw(run, items, salt=attempt)
        t_reward += seconds
        summaries.append(summary)
        sizes.append(len(rewards))
        drawn.append(rewards[~failed])
        group_ids = torch.arange(len(items)).repeat_interleave(g)
        flat = zero_variance_groups(rewards, group_ids, ~failed) if loop.dynamic_sampling else set()
        for i, item in enumerate(items):
            if i in flat:
                dropped += 1
                continue
            sl = slice(i * g, (i + 1) * g)
            kept_items.append(item)
            kept_results += results[sl]
            kept_rewards.append(rewards[sl])
            kept_failed.append(failed[sl])
    colocated_generation_end(run)
    rewards = torch.cat(kept_rewards) if kept_rewards else torch.zeros(0)
    failed = torch.cat(kept_failed) if kept_failed else torch.zeros(0, dtype=torch.bool)
    valid = rewards[~failed]
    lengths = [len(r.token_ids) for r in kept_results]
    metrics = {
        "reward": float(valid.mean()) if len(valid) else float("nan"),  # over the groups trained on
        "reward_all_samples": float(torch.cat(drawn).mean())
        if drawn and len(torch.cat(drawn))
        else float("nan"),
        "reward_failed": float(sum(s.get("reward_failed", 0) for s in summaries)),
        "groups_dropped_zero_variance": float(dropped),
        "groups_trained": float(len(kept_items)),
        "completion_length": sum(lengths) / max(len(lengths), 1),
        "truncated_fraction": sum(r.finish_reason == "length" for r in kept_results)
        / max(len(kept_results), 1),
        "timing/reward_s": t_reward,
    }
    # environments, a reward model's and the task's parts: the draws' means, weighted by their samples
    metrics.update(episodes.mean_episode_metrics(summaries, sizes))
    metrics.update(episodes.mean_metrics(summaries, "reward/", sizes))
    return Rollouts(kept_items, kept_results, rewards, failed, metrics)


def build_batch(run: Run, ro: Rollouts):
    """The step's training batch (padded with masked rows to whole global batches) and its metrics."""
    g = run.cfg.grpo.num_generations_per_prompt
    # one group per drawn prompt, by position: a prompt drawn twice in a step (an epoch ends inside it,
    # a refill draws it again) makes two groups with their own baselines, as in the asynchronous loop
    group_ids = torch.arange(len(ro.items)).repeat_interleave(g)
    if not ro.results:  # nothing to train on: one fully masked row keeps the step well-formed
        first = run.task.train.items[0]
        eos = run.engine.eos_token_id or 0
        ro = Rollouts(
            [first],
            [GenerationResult(-1, 0, list(first.prompt_token_ids), [eos], [0.0], "stop")],
            torch.zeros(1),
            torch.ones(1, dtype=torch.bool),
        )
        group_ids = torch.zeros(1, dtype=torch.long)
    return samples_to_batch(
        ro.results,
        ro.rewards,
        ro.failed,
        group_ids,
        run.cfg.grpo,
        pad_token_id(run.tokenizer),
        run.cfg.policy.train_global_batch_size,
    )


def skips_prev_logprobs(cfg: GRPOConfig) -> bool:
    """Whether prev_logprobs equal the training-time logprobs by construction (see recompute_prev_logprobs):
    the step's samples make one optimizer step, so the loss takes prev from its own forward
    (force_on_policy_ratio), for the ratio and the importance-sampling weights alike."""
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    one_step = samples <= cfg.policy.train_global_batch_size and cfg.passes_over_batch() == 1
    return cfg.grpo.recompute_prev_logprobs == "auto" and one_step


def add_logprobs(run: Run, batch) -> None:
    """prev_logprobs from the current weights (unless on-policy by construction, then the generation
    logprobs stand in for the metrics); reference logprobs when the KL term is on."""
    run.policy.prepare_for_lp_inference()
    if skips_prev_logprobs(run.cfg):
        batch["prev_logprobs"] = batch["generation_logprobs"].clone()
    else:
        batch["prev_logprobs"] = run.policy.get_logprobs(batch)
    if run.cfg.loss.reference_policy_kl_penalty > 0:
        batch["reference_logprobs"] = run.policy.get_reference_policy_logprobs(batch)
    else:
        batch["reference_logprobs"] = torch.zeros_like(batch["prev_logprobs"])


def train(run: Run, batch) -> dict[str, float]:
    """The step's optimizer steps over the batch (`policy.train_global_batch_size` rows each)."""
    run.policy.prepare_for_training()
    return run.policy.train(batch, run.loss_fn)


def sync_weights(run: Run) -> dict[str, float]:
    """Trainer weights -> engine, checked on the probe batch. When the engine shares the trainer's
    tensors (same process, device and dtype) a sync copies nothing: the optimizer updated them in
    place; the sync re-points the engine at them (cheap) and sets the version, and the probe checks."""
    run.policy.prepare_for_lp_inference()
    run.engine.wake()
    version = run.policy.get_states()[0]["trainer_version"]
    metrics = run.weight_sync.sync_local(run.policy, run.engine, version, share=run.share_weights)
    return {f"weight_sync/{k}": v for k, v in metrics.items()}


def time_shares_device(run: Run) -> bool:
    """Colocated on an accelerator: trainer and engine take turns holding the device's memory. On a
    CPU device both live in host memory, where offloading one frees nothing for the other, so the
    trainer stays put and the engine stays awake (keeping its KV cache and any shared weights)."""
    return run.cfg.colocated and run.engine.device.type != "cpu"


def colocated_generation_start(run: Run) -> None:
    """Colocated: the trainer (and its companions) give the device to the engine (and frees its
    communicators if asked)."""
    if not run.cfg.colocated:
        return
    if time_shares_device(run):
        run.policy.offload_after_refit()
        for other in run.companions.values():  # PPO's critic
            other.offload_after_refit()
    if run.cfg.policy.free_comms_during_generation:
        run.policy.teardown_comms()
    run.engine.wake()


def colocated_generation_end(run: Run) -> None:
    if not run.cfg.colocated:
        return
    if time_shares_device(run):
        run.engine.sleep(keep_weights=True)
    if run.cfg.policy.free_comms_during_generation:
        run.policy.rebuild_comms()


# --------------------------------------------------------------------------- validation


def validate(run: Run) -> dict[str, float]:
    """Held-out accuracy (greedy when k=1) and pass@k over the eval prompts (rollout/validation.py)."""
    colocated_generation_start(run)
    try:
        if isinstance(run.task, EnvSuite):
            return episodes.validate_env(run.engine, run.tokenizer, run.task, run.cfg.sampling, run.cfg.grpo)
        return rollout_validation.validate(
            run.engine, run.task, run.tokenizer, run.cfg.sampling, run.cfg.grpo
        )
    finally:
        colocated_generation_end(run)


# --------------------------------------------------------------------------- checkpoint state


def _resume_view(cfg: GRPOConfig) -> dict[str, Any]:
    """The settings a resumed run must share: RESUME_KEYS, plus any section a subclass of the config adds
    (distill.py's teacher), plus the policy's optimizer view."""
    dumped = resume_dump(cfg)
    added = [k for k in type(cfg).model_fields if k not in GRPOConfig.model_fields]
    return {k: dumped[k] for k in (*RESUME_KEYS, *added)} | {"policy": optimizer_view(cfg.policy)}


def loop_state(run: Run) -> dict[str, Any]:
    """The loop's state for a checkpoint, with the run's prompt format record (read by export)."""
    return {
        "step": run.step,
        "train_data": run.task.train.state_dict(),
        "repeats": run.repeats.state_dict(),
        "config": _resume_view(run.cfg),
        **prompt_format_state(run.cfg),
    }


def resume_from(run: Run, ckpt: CheckpointManager) -> dict[str, float]:
    """Continue from the checkpoint the manager picks (model, optimizer, RNG, data position, step);
    returns the metrics it was saved with ({} for a fresh start)."""

    def data_check(extra: dict[str, Any]) -> None:  # another dataset's position: refused before loading
        run.task.train.check_state_dict(extra["train_data"])

    extra = resume(
        run.policy, ckpt, _resume_view(run.cfg), RESUME_MAY_CHANGE, config=run.cfg, check=data_check
    )
    if extra is None:
        return {}
    for name, other in run.companions.items():
        other.prepare_for_training()
        other.load_checkpoint(str(ckpt.companion_path(ckpt.resumed, name)))
    run.step = int(extra["step"])
    run.task.train.load_state_dict(extra["train_data"])
    if "repeats" in extra:  # absent from checkpoints written before it existed: nothing to count on
        run.repeats.load_state_dict(extra["repeats"])
    sync_weights(run)
    return dict(extra.get("metrics", {}))
