"""Asynchronous GRPO, the real run: the Policy as trainer, engine-backed rollout workers
(rollout/engine_worker.py, rollout/ray_worker.py), and the metrics, validation and checkpoints around
`AsyncGRPOController`.

`run_async_grpo(cfg)` reads like the synchronous `run_grpo`: build the policy and the task, resume
from a checkpoint if there is one, start the rollout workers (`rollout.backend: local` runs engines
in this process, `ray` one engine per Ray actor), then let the controller stream prompt groups into
split train steps. Every step is logged (metrics.jsonl), validated every `grpo.val_period` steps and
checkpointed; the controller's state (data position, buffered groups, counters) goes into the
checkpoint's extra state, so `checkpointing.resume` continues a run.

Departures from the synchronous loop (besides streaming, see controller.py):
- steps are sized by `async_grpo.target_prompt_groups_per_step` and counted by `async_grpo.num_steps`
  (the `grpo` section keeps the group size, advantages, validation and seed);
- `grpo.dynamic_sampling` filters zero-variance groups as they arrive; the step fills up with others;
  more than (1 + `grpo.dynamic_sampling_max_refills`) x target groups filtered in one step, or failed
  rewards (filtered groups' counted) over `task.reward.max_failed_fraction`, stop the run;
- the loss is `async_grpo.loss`: truncated importance sampling against the generation logprobs is on
  by default, since samples may come from weights up to `max_staleness` versions old;
- groups of a step are trained in chunks of at least `train_chunk_rows` rows: a chunk's groups become
  one batch (the rows each rollout worker laid out, stacked: equal to rollout.rows.samples_to_batch over the
  chunk, advantages per group), get their reference logprobs, and go to the Policy in one
  `train_microbatch` call. The step's gradient is the same as with one call per group (exact global
  normalization); the calls are fewer and larger;
- a step is one optimizer step (begin_train_step ... finish_train_step), so every chunk is trained at
  the weights the step opened with: the trainer's prev logprobs are the training forward's own, and
  with `grpo.recompute_prev_logprobs: auto` the loss takes them from there (force_on_policy_ratio, IS
  weights included) instead of a separate forward per chunk.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig, worker_config
from posttrain.algorithms.async_grpo.contracts import AsyncGRPOError, PrepareGroup
from posttrain.algorithms.async_grpo.controller import AsyncGRPOController, RunSummary, check_state
from posttrain.algorithms.async_grpo.ledger import BufferedGroup
from posttrain.algorithms.async_grpo.trainer import ChunkedTrainer, PolicyTrainer
from posttrain.algorithms.checkpointing import CheckpointManager
from posttrain.algorithms.distill_core import DistillSettings, teacher_advantages
from posttrain.algorithms.distill_teacher import TeacherPolicy, check_same_vocabulary, teacher_config
from posttrain.algorithms.losses import ClippedPGLoss, with_completion_length
from posttrain.algorithms.runs import (
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
from posttrain.data.normalization import LossFn
from posttrain.envs.build import EnvSuite
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.payload import WeightsPayload, packed_nbytes
from posttrain.generation.weight_sync import WeightSync
from posttrain.logging import MetricsLogger, StepProgress, get_logger, plot_metrics
from posttrain.models.tokenizer import pad_token_id
from posttrain.policy.model_init import engine_model, model_config
from posttrain.policy.policy import Policy
from posttrain.rollout.advantages import zero_variance_groups
from posttrain.rollout.contracts import RolloutWorker
from posttrain.rollout.engine_worker import start_local_workers
from posttrain.rollout.episodes import CURVES, mean_episode_metrics, validate_env
from posttrain.rollout.groups import check_context, engine_config, probe_sync
from posttrain.rollout.rows import SAMPLES_CODEC, GroupSamples
from posttrain.rollout.validation import validate
from posttrain.tasks.rewards import RewardError
from posttrain.tasks.task import Task

log = get_logger(__name__)


# --------------------------------------------------------------------------- trainer side


def prepare_samples(cfg: AsyncGRPORunConfig, trainer: PolicyTrainer, stats: StepStats) -> PrepareGroup:
    """The controller's `prepare_group`: the group's samples, or None when dynamic sampling filters it."""

    async def prepare(group: BufferedGroup, trainer_version: int) -> GroupSamples | None:
        if trainer.version != trainer_version:
            raise RuntimeError(
                f"group {group.group_id} prepared for {trainer_version}, policy at {trainer.version}"
            )
        s: GroupSamples = group.samples
        flat = cfg.grpo.dynamic_sampling and _zero_variance(s)
        stats.add(s, flat)
        if flat:  # the step does not fill: a broken reward, or every group flat, stops it here
            _check_filtered(cfg, stats, trainer_version + 1)  # one step, one version
        return None if flat else s

    return prepare


def _check_filtered(cfg: AsyncGRPORunConfig, stats: StepStats, step: int) -> None:
    """With dynamic sampling, once a step has seen a step's worth of groups: their failed rewards,
    filtered groups' included, against task.reward.max_failed_fraction (a reward failing on every
    sample leaves every group flat, and no step would ever be trained to check it); and a step that
    filtered more than (1 + grpo.dynamic_sampling_max_refills) x target groups without keeping one
    stops the run (the synchronous loop draws at most that many batches and trains what it kept; a
    step that keeps some groups here goes on filling, however slowly: mostly flat steps are common
    early on hard tasks)."""
    target = cfg.async_grpo.target_prompt_groups_per_step
    if len(stats.groups) >= target:
        check_failed_rewards(cfg, step, stats.failed_fraction(), FailedRewardsError)
    filtered = sum(flat for _, flat in stats.groups)
    most = (1 + cfg.grpo.dynamic_sampling_max_refills) * target
    if filtered > most and filtered == len(stats.groups):
        raise AsyncGRPOError(
            f"step {step}: grpo.dynamic_sampling filtered {filtered} prompt groups with equal rewards, more "
            f"than (1 + grpo.dynamic_sampling_max_refills={cfg.grpo.dynamic_sampling_max_refills}) x "
            f"async_grpo.target_prompt_groups_per_step={target}, and kept none: the task is too easy or "
            "too hard for the policy (or the reward gives every sample the same value). Raise "
            "grpo.dynamic_sampling_max_refills, or set grpo.dynamic_sampling=false"
        )


class FailedRewardsError(RewardError, AsyncGRPOError):
    """Too many failed rewards, found while a step fills (the controller stops the run with it)."""


def _zero_variance(s: GroupSamples) -> bool:
    rewards = torch.tensor(s.rewards)
    valid = ~torch.tensor(s.failed, dtype=torch.bool)
    return bool(zero_variance_groups(rewards, torch.zeros(len(s.rewards), dtype=torch.long), valid))


def export_fn(cfg: AsyncGRPORunConfig, trainer: PolicyTrainer, tokenizer: Any) -> Callable[[], Any]:
    """Runs on the policy thread after every step: the weights payload (a Ray ObjectRef under Ray,
    packed into one byte buffer that every version reuses)."""
    vocab_size = model_config(cfg.policy.model, tokenizer).vocab_size
    sync = probe_sync(cfg.weight_sync, vocab_size, cfg.policy.dp_size)
    policy = trainer.policy
    buffer: list[np.ndarray] = []

    def export() -> Any:
        probe = sync.trainer_probe(policy) if cfg.weight_sync.probe.enabled else None
        state = policy.engine_state_dict()
        temperature = cfg.policy.scoring_temperature
        if cfg.rollout.backend != "ray":
            return WeightsPayload(trainer.version, state, probe, temperature)
        import ray

        size = packed_nbytes(state)
        if not buffer or buffer[0].nbytes < size:
            buffer[:] = [np.empty(size, dtype=np.uint8)]
        return ray.put(WeightsPayload(trainer.version, state, probe, temperature, buffer[0]))

    return export


class StepStats:
    """Rollout metrics of the groups prepared for the current step (rewards, lengths, probe checks)."""

    def __init__(self) -> None:
        self.groups: list[tuple[GroupSamples, bool]] = []  # this step's only: emptied by `pop`

    def add(self, samples: GroupSamples, filtered: bool) -> None:
        self.groups.append((samples, filtered))

    def failed_fraction(self) -> float:
        """The failed rewards' share of the step's samples, filtered groups' included."""
        return sum(sum(s.failed) for s, _ in self.groups) / max(sum(len(s.failed) for s, _ in self.groups), 1)

    def pop(self) -> dict[str, float]:
        failed, fraction = float(sum(sum(s.failed) for s, _ in self.groups)), self.failed_fraction()
        groups, self.groups = self.groups, []
        kept = [s for s, filtered in groups if not filtered]
        rewards = [r for s in kept for r, f in zip(s.rewards, s.failed) if not f]
        results = [r for s in kept for r in s.results]
        n = max(len(results), 1)
        out = {
            "reward": sum(rewards) / len(rewards) if rewards else math.nan,
            "reward_failed": failed,  # of every sample the step drew, filtered groups' included
            "reward_failed_fraction": fraction,
            "groups_dropped_zero_variance": float(len(groups) - len(kept)),
            "completion_length": sum(len(r.token_ids) for r in results) / n,
            "truncated_fraction": sum(r.finish_reason == "length" for r in results) / n,
        }
        for key in ("generation_s", "reward_s"):
            values = [s.metrics[key] for s in kept if key in s.metrics]
            if values:
                out[f"rollout/{key}_mean"] = sum(values) / len(values)
        out.update(mean_episode_metrics([s.metrics for s in kept]))  # environments
        key = "weight_sync/probe_max_abs_diff"
        diffs = [s.metrics[key] for s, _ in groups if key in s.metrics]
        if diffs:
            out[key] = max(diffs)
        return out


# --------------------------------------------------------------------------- the run


@dataclass
class AsyncRun:
    """Everything an asynchronous run holds (see `setup`)."""

    cfg: AsyncGRPORunConfig
    policy: Policy
    trainer: ChunkedTrainer
    task: Task | EnvSuite
    workers: list[RolloutWorker]
    controller: AsyncGRPOController
    ckpt: CheckpointManager
    stats: StepStats
    validator: Validator | None
    actors: list[Any] = field(default_factory=list)  # Ray actor handles (ray backend)
    resumed_step: int = 0
    resumed_metrics: dict[str, float] = field(default_factory=dict)  # the checkpoint's
    own_policy: bool = True
    teacher: TeacherPolicy | None = None  # on-policy distillation's (cfg.distill)


def distill_shape(policy: Policy, teacher: TeacherPolicy, settings: DistillSettings, skip_prev: bool):
    """The trainer's `shape_fn` for on-policy distillation: each chunk's advantages from the teacher's
    logprobs and the student's at the open step's weights (prev, or one more forward when the loss
    takes prev from its own)."""

    def shape(batch: Any) -> dict[str, float]:
        student = policy.get_logprobs(batch) if skip_prev else batch["prev_logprobs"]
        return teacher_advantages(policy, teacher, settings, batch, student, offload=False)

    return shape


def _resume_view(cfg: AsyncGRPORunConfig) -> dict[str, Any]:
    dumped = resume_dump(cfg)
    a = dumped["async_grpo"]
    keys = (
        "max_staleness",
        "target_prompt_groups_per_step",
        "selection",
        "seed",
        "shuffle",
        "loss",
        "num_steps",
    )
    view = {k: dumped[k] for k in ("grpo", "sampling", "task", "env", "distill")}
    # policy.train_global_batch_size is not read by this loop (a step is its groups' samples)
    return view | {
        "async_grpo": {k: a[k] for k in keys},
        "policy": optimizer_view(cfg.policy, batch_size=False),
    }


RESUME_MAY_CHANGE = (  # each change is logged
    "async_grpo.num_steps",
    "policy.optimizer.lr",
    "grpo.val_period",
    "grpo.val_at_start",
    "grpo.val_max_prompts",
    "grpo.val_num_generations",
    "task.max_eval_prompts",
)


@dataclass
class Validator:
    """A validation engine in this process and its probe check (validation runs on the policy thread)."""

    engine: GenerationEngine
    sync: WeightSync
    tokenizer: Any


def build_loss(cfg: AsyncGRPORunConfig, skip_prev: bool) -> LossFn:
    """`async_grpo.loss`, taking prev logprobs from its training forward when the trainer skips their
    separate pass (see the module docstring); warns when stale samples are trained without importance
    sampling."""
    loss_cfg = with_completion_length(cfg.async_grpo.loss, cfg.sampling.max_new_tokens)
    if skip_prev:
        loss_cfg = loss_cfg.model_copy(update={"force_on_policy_ratio": True})
    if cfg.async_grpo.max_staleness > 0 and not loss_cfg.use_importance_sampling_correction:
        log.warning(
            "max_staleness=%d trains on samples from older weights but importance-sampling correction is "
            "off; set async_grpo.loss.use_importance_sampling_correction=true",
            cfg.async_grpo.max_staleness,
        )
    return ClippedPGLoss(loss_cfg)


RESUME_HINT = (
    "resume it with `posttrain grpo`, choose another output_dir, or start over here with --overwrite"
)


def setup(cfg: AsyncGRPORunConfig, policy: Policy | None = None) -> AsyncRun:
    """Policy (restored from a checkpoint if one is found), task, rollout workers holding the policy's
    weights, controller. The run's files (config, metrics) are `run_async_grpo`'s."""
    cfg.check_scoring(policy.cfg if policy is not None else None)
    parts = start_run(cfg.output_dir, cfg.grpo.seed, cfg.policy, cfg.task, policy, cfg.env)
    policy, tokenizer, task, own_policy = parts.policy, parts.tokenizer, parts.task, parts.own_policy
    samples = cfg.async_grpo.target_prompt_groups_per_step * cfg.grpo.num_generations_per_prompt
    if cfg.policy.train_global_batch_size != samples:
        log.warning(
            "policy.train_global_batch_size=%d is ignored by the asynchronous loop: a step is one optimizer "
            "step over its async_grpo.target_prompt_groups_per_step x grpo.num_generations_per_prompt = %d "
            "samples (set it to %d to silence this)",
            cfg.policy.train_global_batch_size,
            samples,
            samples,
        )
    mb = cfg.policy.microbatch
    chunk = cfg.train_chunk_rows or max(mb.train_micro_batch_size, mb.logprob_micro_batch_size)
    reference = cfg.async_grpo.loss.reference_policy_kl_penalty > 0
    skip_prev = cfg.grpo.recompute_prev_logprobs == "auto"
    pad_id = pad_token_id(tokenizer)
    teacher: TeacherPolicy | None = None
    trainer: ChunkedTrainer | None = None
    actors: list[Any] = []
    try:  # whatever fails from here releases what was started (and the policy, when this run built it)
        check_context(cfg.generation, cfg.sampling, task, cfg.policy.model, tokenizer)
        ckpt = CheckpointManager(cfg.checkpointing, parts.out)
        cursor = task.train.new_cursor(cfg.async_grpo.num_epochs)
        extra = resume(
            policy,
            ckpt,
            _resume_view(cfg),
            RESUME_MAY_CHANGE,
            requires="controller",
            hint=RESUME_HINT,
            config=cfg,
            # another dataset's position: refused before the checkpoint loads into the policy
            check=lambda extra: check_state(extra["controller"], cursor),
        )
        if cfg.distill is not None:
            check_same_vocabulary(cfg.policy, cfg.distill.teacher, cfg.distill.top_k)
            teacher = TeacherPolicy(teacher_config(cfg.distill.teacher))
        shape = distill_shape(policy, teacher, cfg.distill, skip_prev) if teacher is not None else None
        trainer = ChunkedTrainer(
            policy, cfg.grpo, pad_id, chunk, reference, prev=not skip_prev, shape_fn=shape
        )
        trainer.export_fn = export_fn(cfg, trainer, tokenizer)
        if cfg.rollout.backend == "ray":
            from posttrain.rollout.ray_worker import start_ray_workers

            workers, actors = start_ray_workers(worker_config(cfg), cfg.rollout)
        else:
            workers = start_local_workers(worker_config(cfg), cfg.rollout.num_workers)
        stats = StepStats()
        controller = AsyncGRPOController(
            cfg.async_grpo,
            task.train.items,
            workers,
            trainer,
            prepare_samples(cfg, trainer, stats),
            build_loss(cfg, skip_prev),
            samples_codec=SAMPLES_CODEC,
            cursor=cursor,
        )
        if extra is not None:
            controller.load_state_dict(extra["controller"])
        validator = _build_validator(cfg, task, tokenizer)
    except BaseException:
        _release(trainer, teacher, actors, policy if own_policy else None)
        raise
    step = int(extra["step"]) if extra is not None else 0
    metrics = dict(extra.get("metrics", {})) if extra is not None else {}
    parts = (cfg, policy, trainer, task, workers, controller, ckpt, stats, validator)
    run = AsyncRun(*parts, actors=actors, resumed_step=step, resumed_metrics=metrics, own_policy=own_policy)
    run.teacher = teacher
    try:
        _push_initial_weights(run)
    except BaseException:
        close(run)
        raise
    return run


def _push_initial_weights(run: AsyncRun) -> None:
    """The rollout workers start with the policy's weights (as the synchronous loop's engine does at
    set-up), so the run starts generating at once. Bounded by async_grpo.weight_sync_timeout_s.
    Called from a running event loop, it leaves the push to the start of the run instead."""
    trainer, a = run.trainer, run.cfg.async_grpo
    try:
        asyncio.get_running_loop()
        return
    except RuntimeError:
        pass

    async def push() -> Any:
        weights = await trainer.export_weights()
        await asyncio.gather(*(w.set_weights(trainer.version, weights) for w in run.workers))
        return weights

    try:
        weights = asyncio.run(asyncio.wait_for(push(), a.weight_sync_timeout_s))
    except asyncio.TimeoutError:
        raise TimeoutError(
            f"the rollout workers did not load the initial weights within "
            f"async_grpo.weight_sync_timeout_s={a.weight_sync_timeout_s}s"
        ) from None
    run.controller.weights_preloaded(trainer.version, weights)


def _build_validator(cfg: AsyncGRPORunConfig, task: Task | EnvSuite, tokenizer: Any) -> Validator | None:
    """A validation engine in this process (None when the run never validates)."""
    loop = cfg.grpo
    if task.eval is None or not (loop.val_period or loop.val_at_start):
        return None
    model = engine_model(cfg.policy.model, cfg.policy.lora, tokenizer)
    engine = GenerationEngine(model, tokenizer, engine_config(cfg.generation, cfg.sampling, task))
    sync = probe_sync(cfg.weight_sync, engine.vocab_size, cfg.policy.dp_size)
    return Validator(engine, sync, tokenizer)


def validate_now(run: AsyncRun) -> dict[str, float]:
    """Blocking: the validation engine gets the current weights (probe-checked), then validates."""
    v = run.validator
    assert v is not None
    sync = v.sync.sync_local(run.policy, v.engine, run.trainer.version)
    if isinstance(run.task, EnvSuite):
        out = validate_env(v.engine, v.tokenizer, run.task, run.cfg.sampling, run.cfg.grpo)
    else:
        out = validate(v.engine, run.task, v.tokenizer, run.cfg.sampling, run.cfg.grpo)
    if "probe_max_abs_diff" in sync:
        out["val/weight_sync_probe_max_abs_diff"] = sync["probe_max_abs_diff"]
    return out


def check_failed_rewards(
    cfg: AsyncGRPORunConfig, step: int, frac: float, error: type[RewardError] = RewardError
) -> None:
    """`task.reward.max_failed_fraction` over the step's samples (the rollout workers score per group
    and do not check it): a broken reward function stops the run, as in the synchronous loop."""
    reward = cfg.task.reward
    if reward.on_reward_error == "skip_sample" and frac > reward.max_failed_fraction:
        fn = f"the reward function {cfg.task.reward_fn!r}" if cfg.task.reward_fn else "the task's reward"
        raise error(
            f"step {step}: {fn} failed on {frac:.0%} of the samples, more than "
            f"task.reward.max_failed_fraction={reward.max_failed_fraction} (the rollout workers' log "
            "names the first error). Fix the reward function, or raise task.reward.max_failed_fraction "
            "(1.0 never stops)"
        )


OnStepHook = Callable[[AsyncRun, int, dict[str, float]], Awaitable[None] | None]


async def train(
    run: AsyncRun,
    metrics_log: MetricsLogger,
    hook: OnStepHook | None = None,
    stop: StopOnInterrupt | None = None,
) -> RunSummary:
    """Validate at start, run the controller; after each step: log, validate, checkpoint, `hook`; when
    `stop` was requested (Ctrl-C), a checkpoint at that step (unless it has one), then `RunInterrupted`."""
    cfg, loop = run.cfg, run.cfg.grpo
    num_steps = cfg.async_grpo.num_steps
    fields = ("reward", "val/accuracy", "step_time_s")
    progress = StepProgress(num_steps or 0, "grpo-async", fields, cfg.logging.progress_bar)
    if run.validator is not None and loop.val_at_start and run.resumed_step == 0:
        metrics_log.log(await run.trainer.call(validate_now, run), 0)

    saved = [run.resumed_step]

    async def save(step: int, metrics: dict[str, float]) -> None:
        # settled while the controller runs (the last step too: a longer run may resume from it), so
        # in-flight groups are saved, not redrawn
        c = run.controller
        state = await c.checkpoint_state(last=step == num_steps) if c.running else c.state_dict()
        extra = {"step": step, "controller": state, "config": _resume_view(cfg), **prompt_format_state(cfg)}
        await run.trainer.call(run.ckpt.save, run.policy, step, extra, metrics)
        saved[0] = step

    async def on_step(step: int, metrics: dict[str, float]) -> None:
        metrics.pop("step", None)  # the log has its own
        metrics.update(run.stats.pop())
        metrics.update(run.trainer.pop_chunk_metrics())  # distillation's, averaged over the chunks
        if cfg.policy.moe.routing_replay != "off":
            routing = await run.trainer.call(run.policy.pop_routing_stats)
            metrics["train/moe/routing_disagreement"] = routing["differ"] / max(routing["total"], 1)
            metrics["train/moe/routing_replayed"] = float(routing["total"])
        if run.validator is not None and loop.val_period and step % loop.val_period == 0:
            metrics.update(await run.trainer.call(validate_now, run))
        metrics_log.log(metrics, step)
        progress.update(step, metrics)
        check_failed_rewards(cfg, step, metrics["reward_failed_fraction"])
        if run.ckpt.should_save(step, num_steps or -1):
            await save(step, metrics)
        if hook is not None:
            result = hook(run, step, metrics)
            if inspect.isawaitable(result):
                await result
        if stop is not None and stop.requested and step != num_steps:
            if cfg.checkpointing.enabled and saved[0] != step:
                await save(step, metrics)
            path = run.ckpt.root / f"step_{step}" if cfg.checkpointing.enabled else None
            raise interrupted("grpo-async", step, num_steps, cfg.checkpointing, path)

    try:
        summary = await run.controller.run(on_step)
        if cfg.checkpointing.enabled and summary.steps > saved[0]:  # ended at the data's end
            await save(summary.steps, {})
        return summary
    finally:
        progress.close()


def summary_metrics(summary: RunSummary) -> dict[str, float]:
    """How the run ended, as flat metrics: the ledger's group counts and the cumulative counters."""
    out = {f"summary/groups_{k}": float(v) for k, v in summary.groups.items()}
    out |= {f"summary/total_{k}": float(v) for k, v in summary.totals.items()}
    return out | {
        "summary/steps": float(summary.steps),
        "summary/trainer_version": float(summary.trainer_version),
        "summary/data_exhausted": float(summary.data_exhausted),
        "summary/dead_workers": float(len(summary.dead_workers)),
    }


def run_async_grpo(
    cfg: AsyncGRPORunConfig, policy: Policy | None = None, hook: OnStepHook | None = None
) -> dict[str, float]:
    """Train with asynchronous GRPO; returns the last step's metrics plus the run summary. Ctrl-C stops
    after the current step, with a checkpoint there, by raising `RunInterrupted`."""
    ckpt = CheckpointManager(cfg.checkpointing, cfg.output_dir)
    check_fresh_start(cfg.output_dir, ckpt)
    run = setup(cfg, policy)
    out = Path(cfg.output_dir)
    try:
        metrics_log = start_history(out, cfg, ckpt, cfg.logging, run.resumed_step)
    except BaseException:
        close(run)
        raise
    num_steps = cfg.async_grpo.num_steps
    if run.resumed_step and num_steps is not None and run.resumed_step >= num_steps:
        step = run.resumed_step
        log.warning("the run is at step %d already: nothing to train (raise async_grpo.num_steps)", step)
        metrics_log.close()
        close(run)
        return dict(run.resumed_metrics)
    last: dict[str, float] = {}

    def keep_last(r: AsyncRun, step: int, metrics: dict[str, float]) -> Awaitable[None] | None:
        last.update(metrics)
        return hook(r, step, metrics) if hook is not None else None

    try:
        with closing_metrics(metrics_log):
            with StopOnInterrupt("grpo-async", cfg.checkpointing.enabled) as stop:
                summary = asyncio.run(train(run, metrics_log, keep_last, stop))
            for index, reason in summary.dead_workers.items():
                log.warning("rollout worker %d was lost during the run: %s", index, reason)
            final = summary_metrics(summary)
            metrics_log.log(final, summary.steps)
            last.update(final)
    finally:
        close(run)
    plot_metrics(metrics_log.path, out / "curves.png", CURVES)
    return last


def close(run: AsyncRun) -> None:
    """Stop the policy thread and the rollout actors (and the policy, when the run built it)."""
    _release(run.trainer, run.teacher, run.actors, run.policy if run.own_policy else None)


def _release(
    trainer: ChunkedTrainer | None, teacher: TeacherPolicy | None, actors: list[Any], policy: Policy | None
) -> None:
    """Stop what a run started: the policy thread, the teacher, the Ray rollout actors, and `policy`."""
    if trainer is not None:
        trainer.close()
    if teacher is not None:
        teacher.shutdown()
    if actors:
        import ray

        for a in actors:
            ray.kill(a)
    if policy is not None:
        policy.shutdown()
