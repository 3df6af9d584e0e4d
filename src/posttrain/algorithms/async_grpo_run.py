"""Asynchronous GRPO, the real run: the Policy as trainer, engine-backed rollout workers
(async_engine_worker.py), and the metrics, validation and checkpoints around `AsyncGRPOController`.

`run_async_grpo(cfg)` reads like the synchronous `run_grpo`: build the policy and the task, resume
from a checkpoint if there is one, start the rollout workers (`rollout.backend: local` runs engines
in this process, `ray` one engine per Ray actor), then let the controller stream prompt groups into
split train steps. Every step is logged (metrics.jsonl), validated every `grpo.val_period` steps and
checkpointed; the controller's state (data position, buffered groups, counters) goes into the
checkpoint's extra state, so `checkpointing.resume` continues a run.

Departures from the synchronous loop (besides streaming, see async_grpo.py):
- steps are sized by `async_grpo.target_prompt_groups_per_step` and counted by `async_grpo.num_steps`
  (the `grpo` section keeps the group size, advantages, validation and seed);
- `grpo.dynamic_sampling` filters zero-variance groups as they arrive; the step fills up with others;
- the loss is `async_grpo.loss`: truncated importance sampling against the generation logprobs is on
  by default, since samples may come from weights up to `max_staleness` versions old;
- groups of a step are trained in chunks of at least `train_chunk_rows` rows: a chunk's groups become
  one batch (the rows each rollout worker laid out, stacked: equal to grpo.samples_to_batch over the
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
from pydantic import Field, model_validator

from posttrain.algorithms.advantages import zero_variance_groups
from posttrain.algorithms.async_engine_worker import (
    SAMPLES_CODEC,
    GroupSamples,
    RolloutConfig,
    WeightsPayload,
    attach_rows,
    engine_config,
    packed_nbytes,
    pad_token_id,
    probe_sync,
    stack_rows,
    start_local_workers,
    start_ray_workers,
)
from posttrain.algorithms.async_grpo import AsyncGRPOConfig, AsyncGRPOController, RunSummary
from posttrain.algorithms.async_types import PrepareGroup, RolloutWorker
from posttrain.algorithms.async_workers import PolicyTrainer
from posttrain.algorithms.checkpointing import CheckpointManager, check_resume_config
from posttrain.algorithms.grpo import (
    GRPOConfig,
    GRPOLoopConfig,
    GRPORunSections,
    Run,
    validate,
)
from posttrain.algorithms.losses import ClippedPGLoss
from posttrain.algorithms.staleness import BufferedGroup, GroupState
from posttrain.config import dump_config
from posttrain.generation.engine import GenerationEngine
from posttrain.logging import MetricsLogger, StepProgress, get_logger, plot_metrics
from posttrain.policy.model_init import build_tokenizer, load_full_model, model_config
from posttrain.policy.policy import Policy
from posttrain.tasks.build import build_task
from posttrain.tasks.rewards import RewardError
from posttrain.tasks.task import Task

log = get_logger(__name__)


# --------------------------------------------------------------------------- config


def _default_async() -> AsyncGRPOConfig:
    return AsyncGRPOConfig(num_steps=50, num_epochs=None, target_prompt_groups_per_step=16)


# GRPOLoopConfig fields the asynchronous run takes from `async_grpo` instead (name there).
_MOVED = {
    "num_prompts_per_step": "target_prompt_groups_per_step",
    "max_num_steps": "num_steps",
    "max_num_epochs": "num_epochs",
    "dynamic_sampling_max_refills": None,
}


class AsyncGRPORunConfig(GRPORunSections):
    """An asynchronous GRPO run (the shared sections mean the same as in GRPOConfig)."""

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
    output_dir: str = "runs/grpo_async"

    @model_validator(mode="after")
    def _check(self) -> AsyncGRPORunConfig:
        defaults = GRPOLoopConfig()
        for name, moved_to in _MOVED.items():
            if getattr(self.grpo, name) != getattr(defaults, name):
                where = f"set async_grpo.{moved_to} instead" if moved_to else "remove it"
                raise ValueError(f"grpo.{name} is not used by the asynchronous loop; {where}")
        return self


def sync_equivalent(cfg: AsyncGRPORunConfig) -> GRPOConfig:
    """The synchronous GRPOConfig with the same model, task, groups, steps and loss (not colocated).

    It configures the rollout workers and validation here, and compares the two loops on equal samples."""
    a = cfg.async_grpo
    loop = cfg.grpo.model_copy(
        update={
            "num_prompts_per_step": a.target_prompt_groups_per_step,
            "max_num_steps": a.num_steps or cfg.grpo.max_num_steps,
            "max_num_epochs": a.num_epochs or cfg.grpo.max_num_epochs,
        }
    )
    return GRPOConfig(
        policy=cfg.policy,
        generation=cfg.generation,
        sampling=cfg.sampling,
        task=cfg.task,
        loss=a.loss,
        grpo=loop,
        weight_sync=cfg.weight_sync,
        colocated=False,
        checkpointing=cfg.checkpointing,
        logging=cfg.logging,
        output_dir=cfg.output_dir,
    )


# --------------------------------------------------------------------------- trainer side


def groups_to_batch(groups: list[GroupSamples], loop: GRPOLoopConfig, pad_id: int) -> Any:
    """One training batch of several groups, equal to grpo.samples_to_batch over them (advantages
    within each group, failed samples masked): the rows the rollout worker laid out, stacked; a group
    without them (restored from a checkpoint) gets them laid out here."""
    attach_rows(groups, loop, pad_id)
    return stack_rows([s.rows for s in groups], pad_id)


class ChunkedTrainer(PolicyTrainer):
    """The Policy as the controller's trainer, fed `GroupSamples` and training them in chunks.

    `train_group` collects groups until they hold `min_rows` rows, then queues the chunk on the
    policy thread, which turns it into one batch, adds reference (and, with `prev`, prev) logprobs at
    the open step's weights and calls `train_microbatch`. It does not wait for the chunk: the
    controller takes the next groups while it trains, and the thread runs the chunks in order, so it
    goes from one chunk to the next without waiting for the event loop. A chunk that failed surfaces at
    the next `train_group` or at `finish`, which queues what is left and waits for every chunk before
    the optimizer step: a step with a failed chunk is aborted, never applied. `abort` drops what is
    not trained yet (the abort runs on the thread after the chunks queued before it)."""

    def __init__(
        self,
        policy: Policy,
        loop: GRPOLoopConfig,
        pad_id: int,
        min_rows: int,
        reference: bool,
        prev: bool = True,
    ):
        super().__init__(policy)
        self.loop, self.pad_id, self.min_rows, self.reference = loop, pad_id, min_rows, reference
        self.prev = prev
        self._pending: list[GroupSamples] = []  # groups of the next chunk
        self._queued: list[asyncio.Future] = []  # chunks on the policy thread, not yet checked

    @property
    def queued_calls(self) -> int:
        """Chunks a finish or abort waits for first: those training or queued, and the pending one."""
        return sum(not f.done() for f in self._queued) + bool(self._pending)

    def _train_chunk(self, groups: list[GroupSamples]) -> None:
        batch = groups_to_batch(groups, self.loop, self.pad_id)
        self.policy.train_microbatch(self.add_logprobs(batch, self.reference, self.prev))

    def _queue_chunk(self) -> None:
        chunk, self._pending = self._pending, []
        if chunk:
            self._queued.append(self.submit(self._train_chunk, chunk))

    def _raise_failed(self) -> None:
        """Raise the error of a chunk that has failed; forget the chunks that have trained."""
        for fut in [f for f in self._queued if f.done()]:
            self._queued.remove(fut)
            fut.result()

    def _drop_queued(self) -> None:
        """Forget the queued chunks (the step is finishing or aborted): results are dropped, and an
        error not raised yet is logged (the step it belongs to is aborted anyway)."""
        for fut in self._queued:
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled() and fut.exception() is not None:
                log.warning("a chunk of the aborted train step failed too: %r", fut.exception())
        self._queued = []

    async def train_group(self, batch: GroupSamples) -> None:
        self._raise_failed()
        self._pending.append(batch)
        if sum(len(s.results) for s in self._pending) >= self.min_rows:
            self._queue_chunk()

    async def finish(self) -> dict[str, float]:
        self._queue_chunk()
        while self._queued:  # a failed chunk raises here; the controller then aborts the step
            fut = self._queued[0]
            try:
                await fut
            finally:
                self._queued.remove(fut)
        return await super().finish()

    async def abort(self) -> None:
        self._pending = []
        self._drop_queued()
        await super().abort()


def prepare_samples(cfg: AsyncGRPORunConfig, trainer: PolicyTrainer, stats: StepStats) -> PrepareGroup:
    """The controller's `prepare_group`: the group's samples, or None when dynamic sampling filters it."""

    async def prepare(group: BufferedGroup, trainer_version: int) -> GroupSamples | None:
        if trainer.version != trainer_version:
            raise RuntimeError(
                f"group {group.group_id} prepared for {trainer_version}, policy at {trainer.version}"
            )
        s: GroupSamples = group.samples
        flat = cfg.grpo.dynamic_sampling and _zero_variance(s)
        stats.add(group, s, flat)
        return None if flat else s

    return prepare


def _zero_variance(s: GroupSamples) -> bool:
    rewards = torch.tensor(s.rewards)
    valid = ~torch.tensor(s.failed, dtype=torch.bool)
    return bool(zero_variance_groups(rewards, torch.zeros(len(s.rewards), dtype=torch.long), valid))


def export_fn(cfg: AsyncGRPORunConfig, trainer: PolicyTrainer, tokenizer: Any) -> Callable[[], Any]:
    """Runs on the policy thread after every step: the weights payload (a Ray ObjectRef under Ray,
    packed into one byte buffer that every version reuses)."""
    sync_cfg = sync_equivalent(cfg)
    sync = probe_sync(sync_cfg, model_config(cfg.policy.model, tokenizer).vocab_size)
    policy = trainer.policy
    buffer: list[np.ndarray] = []

    def export() -> Any:
        probe = sync.trainer_probe(policy) if cfg.weight_sync.probe.enabled else None
        state = policy.full_state_dict()
        temperature = cfg.policy.logprob_temperature
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
        self.groups: list[tuple[GroupSamples, bool]] = []
        self.prepared: dict[int, int] = {}  # group id -> prompt (dataset index), over the whole run

    def add(self, group: BufferedGroup, samples: GroupSamples, filtered: bool) -> None:
        self.groups.append((samples, filtered))
        self.prepared[group.group_id] = group.prompt_id

    def pop(self) -> dict[str, float]:
        groups, self.groups = self.groups, []
        kept = [s for s, filtered in groups if not filtered]
        rewards = [r for s in kept for r, f in zip(s.rewards, s.failed) if not f]
        results = [r for s in kept for r in s.results]
        n = max(len(results), 1)
        out = {
            "reward": sum(rewards) / len(rewards) if rewards else math.nan,
            "reward_failed": float(sum(sum(s.failed) for s in kept)),
            "reward_failed_fraction": sum(sum(s.failed) for s in kept) / n,
            "groups_dropped_zero_variance": float(len(groups) - len(kept)),
            "completion_length": sum(len(r.token_ids) for r in results) / n,
            "truncated_fraction": sum(r.finish_reason == "length" for r in results) / n,
        }
        for key in ("generation_s", "reward_s"):
            values = [s.metrics[key] for s in kept if key in s.metrics]
            if values:
                out[f"rollout/{key}_mean"] = sum(values) / len(values)
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
    task: Task
    workers: list[RolloutWorker]
    controller: AsyncGRPOController
    ckpt: CheckpointManager
    stats: StepStats
    validator: Run | None  # a synchronous Run over a validation engine in this process (grpo.validate)
    actors: list[Any] = field(default_factory=list)  # Ray actor handles (ray backend)
    resumed_step: int = 0
    own_policy: bool = True


def _resume_view(cfg: AsyncGRPORunConfig) -> dict[str, Any]:
    dumped = cfg.model_dump(mode="json")
    a = dumped["async_grpo"]
    keys = ("max_staleness", "target_prompt_groups_per_step", "selection", "seed", "shuffle", "loss")
    view = {k: dumped[k] for k in ("grpo", "sampling", "task")}
    return view | {"async_grpo": {k: a[k] for k in keys}}


RESUME_MAY_CHANGE = (
    "grpo.val_period",
    "grpo.val_at_start",
    "grpo.val_max_prompts",
    "grpo.val_num_generations",
)


def setup(cfg: AsyncGRPORunConfig, policy: Policy | None = None) -> AsyncRun:
    """Policy (restored from a checkpoint if one is found), task, rollout workers holding the policy's
    weights, controller."""
    torch.manual_seed(cfg.grpo.seed)
    own_policy = policy is None
    policy = policy or Policy(cfg.policy)
    tokenizer = build_tokenizer(cfg.policy.model)
    task = build_task(cfg.task, tokenizer)
    ckpt = CheckpointManager(cfg.checkpointing, cfg.output_dir)
    extra = _load_checkpoint(cfg, policy, ckpt)
    mb = cfg.policy.microbatch
    chunk = cfg.train_chunk_rows or max(mb.train_micro_batch_size, mb.logprob_micro_batch_size)
    reference = cfg.async_grpo.loss.reference_policy_kl_penalty > 0
    skip_prev = cfg.grpo.recompute_prev_logprobs == "auto"
    pad_id = pad_token_id(tokenizer)
    trainer = ChunkedTrainer(policy, cfg.grpo, pad_id, chunk, reference, prev=not skip_prev)
    trainer.export_fn = export_fn(cfg, trainer, tokenizer)
    actors: list[Any] = []
    try:
        if cfg.rollout.backend == "ray":
            workers, actors = start_ray_workers(sync_equivalent(cfg), cfg.rollout)
        else:
            workers = start_local_workers(sync_equivalent(cfg), cfg.rollout)
    except BaseException:
        trainer.close()
        if own_policy:
            policy.shutdown()
        raise
    stats = StepStats()
    prepare = prepare_samples(cfg, trainer, stats)
    controller = AsyncGRPOController(
        _controller_cfg(cfg, skip_prev),
        task.train.items,
        workers,
        trainer,
        prepare,
        samples_codec=SAMPLES_CODEC,
    )
    if extra is not None:
        controller.load_state_dict(extra["controller"])
    validator = _build_validator(cfg, policy, task, tokenizer)
    step = int(extra["step"]) if extra is not None else 0
    parts = (cfg, policy, trainer, task, workers, controller, ckpt, stats, validator)
    run = AsyncRun(*parts, actors=actors, resumed_step=step, own_policy=own_policy)
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


def _controller_cfg(cfg: AsyncGRPORunConfig, skip_prev: bool) -> AsyncGRPOConfig:
    """`async_grpo`, with a loss that takes prev logprobs from its training forward when the trainer
    skips their separate pass (see the module docstring)."""
    if not skip_prev:
        return cfg.async_grpo
    loss = cfg.async_grpo.loss.model_copy(update={"force_on_policy_ratio": True})
    return cfg.async_grpo.model_copy(update={"loss": loss})


def _load_checkpoint(cfg: AsyncGRPORunConfig, policy: Policy, ckpt: CheckpointManager) -> dict | None:
    path = ckpt.resume_path()
    if path is None:
        return None
    policy.prepare_for_training()
    extra = policy.load_checkpoint(str(path))
    if "controller" not in extra:
        raise ValueError(
            f"checkpoint {path} has no asynchronous controller state (saved by the synchronous loop?); "
            "resume it with `posttrain grpo`, or set checkpointing.resume=never"
        )
    check_resume_config(extra.get("config", {}), _resume_view(cfg), RESUME_MAY_CHANGE)
    log.warning("resumed from %s at step %d", path, int(extra["step"]))
    return extra


def _build_validator(cfg: AsyncGRPORunConfig, policy: Policy, task: Task, tokenizer: Any) -> Run | None:
    """A validation engine in this process, wrapped as a synchronous `Run` for grpo.validate."""
    loop = cfg.grpo
    if task.eval is None or not (loop.val_period or loop.val_at_start):
        return None
    sync_cfg = sync_equivalent(cfg)
    model = load_full_model(cfg.policy.model, tokenizer)
    engine = GenerationEngine(model, tokenizer, engine_config(sync_cfg, task))
    sync = probe_sync(sync_cfg, engine.vocab_size)
    return Run(sync_cfg, policy, engine, task, tokenizer, ClippedPGLoss(cfg.async_grpo.loss), sync)


def validate_now(run: AsyncRun) -> dict[str, float]:
    """Blocking: the validation engine gets the current weights (probe-checked), then grpo.validate."""
    v = run.validator
    assert v is not None
    sync = v.weight_sync.sync_local(run.policy, v.engine, run.trainer.version)
    out = validate(v)
    if "probe_max_abs_diff" in sync:
        out["val/weight_sync_probe_max_abs_diff"] = sync["probe_max_abs_diff"]
    return out


def check_failed_rewards(cfg: AsyncGRPORunConfig, step: int, metrics: dict[str, float]) -> None:
    """`task.reward.max_failed_fraction` over the step's samples (the rollout workers score per group
    and do not check it): a broken reward function stops the run, as in the synchronous loop."""
    reward = cfg.task.reward
    frac = metrics["reward_failed_fraction"]
    if reward.on_reward_error == "skip_sample" and frac > reward.max_failed_fraction:
        raise RewardError(
            f"step {step}: the reward failed on {frac:.0%} of the samples, more than "
            f"task.reward.max_failed_fraction={reward.max_failed_fraction}. Fix the reward function, or "
            "raise max_failed_fraction (1.0 never stops)"
        )


OnStepHook = Callable[[AsyncRun, int, dict[str, float]], Awaitable[None] | None]


async def train(run: AsyncRun, metrics_log: MetricsLogger, hook: OnStepHook | None = None) -> RunSummary:
    """Validate at start, run the controller; after each step: log, validate, checkpoint, `hook`."""
    cfg, loop = run.cfg, run.cfg.grpo
    num_steps = cfg.async_grpo.num_steps
    fields = ("reward", "val/accuracy", "step_time_s")
    progress = StepProgress(num_steps or 0, "grpo-async", fields, cfg.logging.progress_bar)
    if run.validator is not None and loop.val_at_start and run.resumed_step == 0:
        metrics_log.log(await run.trainer.call(validate_now, run), 0)

    saved = [run.resumed_step]

    async def save(step: int, metrics: dict[str, float]) -> None:
        extra = {"step": step, "controller": run.controller.state_dict(), "config": _resume_view(cfg)}
        await run.trainer.call(run.ckpt.save, run.policy, step, extra, metrics)
        saved[0] = step

    async def on_step(step: int, metrics: dict[str, float]) -> None:
        metrics.pop("step", None)  # the log has its own
        metrics.update(run.stats.pop())
        if run.validator is not None and loop.val_period and step % loop.val_period == 0:
            metrics.update(await run.trainer.call(validate_now, run))
        metrics_log.log(metrics, step)
        progress.update(step, metrics)
        check_failed_rewards(cfg, step, metrics)
        if run.ckpt.should_save(step, num_steps or -1):
            await save(step, metrics)
        if hook is not None:
            result = hook(run, step, metrics)
            if inspect.isawaitable(result):
                await result

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
    """Train with asynchronous GRPO; returns the last step's metrics plus the run summary."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    run = setup(cfg, policy)
    metrics_log = MetricsLogger(
        out, cfg.logging.tensorboard, cfg.logging.wandb_project, append=run.resumed_step > 0
    )
    last: dict[str, float] = {}

    def keep_last(r: AsyncRun, step: int, metrics: dict[str, float]) -> Awaitable[None] | None:
        last.update(metrics)
        return hook(r, step, metrics) if hook is not None else None

    try:
        summary = asyncio.run(train(run, metrics_log, keep_last))
        for index, reason in summary.dead_workers.items():
            log.warning("rollout worker %d was lost during the run: %s", index, reason)
        final = summary_metrics(summary)
        metrics_log.log(final, summary.steps)
        last.update(final)
    finally:
        metrics_log.close()
        close(run)
    plot_metrics(metrics_log.path, out / "curves.png", ("reward", "val/accuracy"))
    return last


def close(run: AsyncRun) -> None:
    """Stop the policy thread and the rollout actors (and the policy, when the run built it)."""
    run.trainer.close()
    if run.actors:
        import ray

        for a in run.actors:
            ray.kill(a)
    if run.own_policy:
        run.policy.shutdown()


def trained_prompt_ids(run: AsyncRun) -> list[int]:
    """Dataset indices of the prompts of every trained group, in group-id order."""
    return [run.stats.prepared[g] for g in run.controller.ledger.ids(GroupState.TRAINED)]
