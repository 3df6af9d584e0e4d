"""Asynchronous GRPO, the real run: engine-backed rollout workers, the Policy as trainer, and the
metrics, validation and checkpoints around `AsyncGRPOController` (async_grpo.py).

`run_async_grpo(cfg)` reads top to bottom like the synchronous `run_grpo`: build the policy, the task
and the rollout workers (`rollout.backend: local` runs engines in this process, `ray` one engine per
Ray actor), resume from a checkpoint if there is one, then let the controller stream prompt groups
into split train steps; every step is logged, validated every `grpo.val_period` steps and
checkpointed (the controller's state goes into the checkpoint's extra state).

Departures from the synchronous loop:
- a group's G completions are drawn with seeds derived from (seed, prompt id, weight version), so a
  group retried after a worker died is drawn again identically, whatever worker takes it;
- the reward runs on a thread of the rollout worker, right after the group is generated; failed
  rewards are masked exactly as in grpo.py (never 0), a reward error that stops the synchronous run
  (`RewardError`) makes the group fail and be retried (then reported, `max_retries`);
- weights travel as one `WeightsPayload` (full state dict plus the trainer's probe logprobs, one
  `ray.put` per version under Ray); each worker loads it and checks its own logprobs on the probe
  batch (generation/probe.py) before generating; a failed check retires the worker;
- steps are sized by `async_grpo.target_prompt_groups_per_step` (not `grpo.num_prompts_per_step`),
  and `grpo.dynamic_sampling` filters zero-variance groups as they arrive (the step is filled with
  other groups, no refill bound);
- the loss is `async_grpo.loss`: truncated importance sampling against the generation logprobs is on
  by default, since samples may come from weights up to `max_staleness` versions old.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from posttrain.algorithms.advantages import zero_variance_groups
from posttrain.algorithms.async_grpo import AsyncGRPOConfig, AsyncGRPOController, RunSummary
from posttrain.algorithms.async_types import GroupResult, RolloutFailure, RolloutWorker, SamplesCodec
from posttrain.algorithms.async_workers import PolicyTrainer, RayRolloutWorker, policy_prepare_group
from posttrain.algorithms.checkpointing import CheckpointingConfig, CheckpointManager, check_resume_config
from posttrain.algorithms.grpo import GRPOConfig, GRPOLoopConfig, Run, samples_to_batch, score, validate
from posttrain.algorithms.losses import ClippedPGLoss
from posttrain.algorithms.sft import LoggingConfig
from posttrain.algorithms.staleness import BufferedGroup, GroupState
from posttrain.config import Config, dump_config
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig, GenerationResult, SamplingParams
from posttrain.generation.weight_sync import WeightSync, WeightSyncConfig
from posttrain.logging import MetricsLogger, StepProgress, get_logger, plot_metrics
from posttrain.policy.config import PolicyConfig
from posttrain.policy.model_init import build_tokenizer, load_full_model, model_config
from posttrain.policy.policy import Policy
from posttrain.tasks.arithmetic import ArithmeticTaskConfig
from posttrain.tasks.build import TaskConfig, build_task
from posttrain.tasks.datasets import PromptItem
from posttrain.tasks.rewards import RewardError
from posttrain.tasks.task import Task

log = get_logger(__name__)


# --------------------------------------------------------------------------- config


class RolloutConfig(Config):
    """Where the rollout workers (one generation engine each) run."""

    backend: Literal["local", "ray"] = Field(
        "local", description="local: engines in this process; ray: one engine per Ray actor process"
    )
    num_workers: int = Field(1, ge=1, description="rollout workers (engines)")
    num_cpus_per_worker: float = Field(1.0, gt=0, description="Ray CPUs reserved per rollout actor")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="Ray GPUs reserved per rollout actor")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per rollout actor (None: Ray's default)"
    )
    ray_address: str | None = Field(None, description="existing Ray cluster; default starts one on loopback")
    start_timeout_s: float = Field(300.0, gt=0, description="bound on starting the rollout actors")


def _default_async() -> AsyncGRPOConfig:
    return AsyncGRPOConfig(num_steps=50, num_epochs=None, target_prompt_groups_per_step=16)


# GRPOLoopConfig fields the asynchronous run takes from `async_grpo` instead (name there).
_MOVED = {
    "num_prompts_per_step": "target_prompt_groups_per_step",
    "max_num_steps": "num_steps",
    "max_num_epochs": "num_epochs",
    "dynamic_sampling_max_refills": None,
}


class AsyncGRPORunConfig(Config):
    """An asynchronous GRPO run (the sections shared with GRPOConfig mean the same there)."""

    policy: PolicyConfig = Field(
        default_factory=lambda: PolicyConfig(optimizer={"lr": 1e-3}, train_global_batch_size=128)
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(max_new_tokens=8))
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    grpo: GRPOLoopConfig = Field(
        default_factory=GRPOLoopConfig,
        description="group size, advantages, overlong handling, validation and seed; the step size and "
        "count come from async_grpo",
    )
    async_grpo: AsyncGRPOConfig = Field(
        default_factory=_default_async, description="steps, staleness, scheduling, bounds and the loss"
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
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

    Used for validation and scoring here, and to compare the two loops on equal samples."""
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


# --------------------------------------------------------------------------- samples and weights


@dataclass
class GroupSamples:
    """A scored prompt group: what a rollout worker returns inside its GroupResult."""

    prompt_id: int
    results: list[GenerationResult]
    rewards: list[float]  # NaN where the reward failed
    failed: list[bool]
    metrics: dict[str, float] = field(default_factory=dict)  # reward summary, timings, probe check


def _encode(s: GroupSamples) -> dict[str, Any]:
    out = asdict(s)
    out["rewards"] = [None if f else r for r, f in zip(s.rewards, s.failed)]
    out["metrics"] = {k: v for k, v in s.metrics.items() if math.isfinite(v)}
    return out


def _decode(d: dict[str, Any]) -> GroupSamples:
    rewards = [math.nan if r is None else float(r) for r in d["rewards"]]
    results = [GenerationResult(**r) for r in d["results"]]
    return GroupSamples(d["prompt_id"], results, rewards, list(d["failed"]), dict(d["metrics"]))


SAMPLES_CODEC = SamplesCodec(_encode, _decode)  # buffered groups survive a checkpoint


@dataclass
class WeightsPayload:
    """One weight version for the rollout workers: the full state dict and the trainer's logprobs on
    the probe batch (None when the probe check is off), taken at the same time."""

    version: int
    state: dict[str, torch.Tensor]
    probe_logprobs: torch.Tensor | None
    temperature: float


def sample_seed(seed: int, prompt_id: int, weight_version: int, k: int) -> int:
    """Seed of sample k of a group: the same prompt at the same weights draws the same completions."""
    return (seed * 1_000_003 + prompt_id * 10_007 + weight_version * 7_919 + k * 101 + 17) % (2**31)


def probe_sync(cfg: AsyncGRPORunConfig, vocab_size: int) -> WeightSync:
    """The probe batch and check, built identically on the trainer side and in every rollout worker."""
    return WeightSync(cfg.weight_sync, vocab_size, dp_size=cfg.policy.cluster.num_workers)


@dataclass
class _ScoreView:
    """What grpo.score reads of a `Run`: cfg.grpo, cfg.sampling, tokenizer and task."""

    cfg: GRPOConfig
    tokenizer: Any
    task: Task


# --------------------------------------------------------------------------- rollout workers


class EngineRolloutWorker:
    """A `RolloutWorker` over an in-process `GenerationEngine`: G seeded completions per prompt,
    scored with the task's reward on a thread, stamped with the weight version that generated them.

    Several groups may be in flight at once (they share the engine's continuous batch)."""

    def __init__(self, cfg: AsyncGRPORunConfig, engine: GenerationEngine, task: Task, name: str = "") -> None:
        self.cfg = cfg
        self.engine = engine
        self.name = name or "engine-worker"
        self._score_view = _ScoreView(sync_equivalent(cfg), engine.tokenizer, task)
        self._sync = probe_sync(cfg, engine.vocab_size) if cfg.weight_sync.probe.enabled else None
        self._sync_metrics: dict[str, float] = {}

    @classmethod
    def build(cls, cfg: AsyncGRPORunConfig, name: str = "") -> EngineRolloutWorker:
        """Tokenizer, task (for its reward) and an engine of the policy's model; the weights it starts
        with are replaced by the first `set_weights`."""
        tokenizer = build_tokenizer(cfg.policy.model)
        task = build_task(cfg.task, tokenizer)
        engine = GenerationEngine(load_full_model(cfg.policy.model, tokenizer), tokenizer, cfg.generation)
        return cls(cfg, engine, task, name)

    async def generate_group(self, prompt: PromptItem, weight_version: int) -> GroupResult:
        """Generate and score the group of `prompt` (see the class docstring)."""
        g = self.cfg.grpo.num_generations_per_prompt
        seed = self.cfg.grpo.seed
        params = [
            self.cfg.sampling.model_copy(
                update={"seed": sample_seed(seed, prompt.prompt_id, weight_version, k)}
            )
            for k in range(g)
        ]
        ids = list(prompt.prompt_token_ids)
        t0 = time.perf_counter()
        results = list(await asyncio.gather(*(self.engine.agenerate(ids, p) for p in params)))
        t1 = time.perf_counter()
        try:
            rewards, failed, summary = await asyncio.to_thread(score, self._score_view, [prompt], results)
        except RewardError as e:
            raise RolloutFailure(f"{self.name}: reward of prompt {prompt.prompt_id} failed: {e}") from e
        versions = {r.weight_version for r in results}
        stamp = versions.pop() if len(versions) == 1 else -1  # mixed versions: the controller refuses it
        metrics = {
            **summary,
            "generation_s": t1 - t0,
            "reward_s": time.perf_counter() - t1,
            **self._sync_metrics,
        }
        samples = GroupSamples(prompt.prompt_id, results, rewards.tolist(), failed.tolist(), metrics)
        return GroupResult(samples, stamp, g)

    async def set_weights(self, version: int, weights: WeightsPayload) -> None:
        """Load `weights` between requests, then check the engine's logprobs on the probe batch."""
        if weights.version != version:
            raise ValueError(
                f"{self.name}: asked to load version {version}, got a payload of {weights.version}"
            )
        t0 = time.perf_counter()
        await self.engine.load_weights_async(weights.state, version)
        metrics = {"weight_sync/seconds": time.perf_counter() - t0}
        if self._sync is not None and weights.probe_logprobs is not None:
            seqs = self._sync.probe.sequences
            lp = await asyncio.to_thread(self.engine.compute_logprobs, seqs, weights.temperature)
            checked = self._sync.check(lp, weights.probe_logprobs, version)  # raises WeightSyncError
            metrics |= {f"weight_sync/{k}": v for k, v in checked.items()}
        self._sync_metrics = metrics


class EngineRolloutActor:
    """The body of a Ray rollout actor: one `EngineRolloutWorker` (one engine) per actor process.

    Weights arrive as an ObjectRef of a `WeightsPayload` (Ray resolves it before `set_weights` runs)."""

    def __init__(self, cfg: AsyncGRPORunConfig, name: str) -> None:
        if cfg.rollout.torch_threads is not None:
            torch.set_num_threads(cfg.rollout.torch_threads)
        self.worker = EngineRolloutWorker.build(cfg, name)

    def ready(self) -> str:
        return self.worker.name

    async def generate_group(self, prompt: PromptItem, weight_version: int) -> GroupResult:
        return await self.worker.generate_group(prompt, weight_version)

    async def set_weights(self, version: int, weights: WeightsPayload) -> None:
        await self.worker.set_weights(version, weights)


def start_ray_workers(cfg: AsyncGRPORunConfig) -> tuple[list[RayRolloutWorker], list[Any]]:
    """Start `rollout.num_workers` actors and wait (bounded) until each has built its engine."""
    from posttrain.parallel.cluster import ensure_ray

    ray = ensure_ray(cfg.rollout.ray_address)
    r = cfg.rollout
    actor_cls = ray.remote(num_cpus=r.num_cpus_per_worker, num_gpus=r.num_gpus_per_worker)(EngineRolloutActor)
    actors = [actor_cls.remote(cfg, f"rollout-{i}") for i in range(r.num_workers)]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=r.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        for a in actors:
            ray.kill(a)
        raise TimeoutError(
            f"the rollout actors did not start within rollout.start_timeout_s={r.start_timeout_s}s "
            "(not enough free CPUs/GPUs in the Ray cluster for rollout.num_cpus_per_worker?)"
        ) from None
    return [RayRolloutWorker(a, name=f"rollout-{i}") for i, a in enumerate(actors)], actors


# --------------------------------------------------------------------------- the run


class StepStats:
    """Rollout metrics of the groups prepared for the current step (rewards, lengths, probe checks)."""

    def __init__(self) -> None:
        self.groups: list[tuple[GroupSamples, bool]] = []
        self.prepared: dict[int, int] = {}  # group id -> prompt id, over the whole run

    def add(self, group: BufferedGroup, samples: GroupSamples, filtered: bool) -> None:
        self.groups.append((samples, filtered))
        self.prepared[group.group_id] = group.prompt_id

    def pop(self) -> dict[str, float]:
        groups, self.groups = self.groups, []
        kept = [s for s, filtered in groups if not filtered]
        rewards = [r for s in kept for r, f in zip(s.rewards, s.failed) if not f]
        results = [r for s in kept for r in s.results]
        out = {
            "reward": sum(rewards) / len(rewards) if rewards else math.nan,
            "reward_failed": float(sum(sum(s.failed) for s in kept)),
            "groups_dropped_zero_variance": float(len(groups) - len(kept)),
            "completion_length": sum(len(r.token_ids) for r in results) / max(len(results), 1),
            "truncated_fraction": sum(r.finish_reason == "length" for r in results) / max(len(results), 1),
        }
        for key in ("generation_s", "reward_s"):
            values = [s.metrics[key] for s in kept if key in s.metrics]
            if values:
                out[f"rollout/{key}_mean"] = sum(values) / len(values)
        diffs = [
            s.metrics["weight_sync/probe_max_abs_diff"]
            for s, _ in groups
            if "weight_sync/probe_max_abs_diff" in s.metrics
        ]
        if diffs:
            out["weight_sync/probe_max_abs_diff"] = max(diffs)
        return out


@dataclass
class AsyncRun:
    """Everything an asynchronous run holds (see `setup`)."""

    cfg: AsyncGRPORunConfig
    policy: Policy
    trainer: PolicyTrainer
    task: Task
    tokenizer: Any
    workers: list[RolloutWorker]
    controller: AsyncGRPOController
    ckpt: CheckpointManager
    stats: StepStats
    validator: Run | None  # a synchronous Run over a validation engine (grpo.validate)
    actors: list[Any] = field(default_factory=list)  # Ray actor handles (ray backend)
    resumed_step: int = 0
    own_policy: bool = True


def _resume_view(cfg: AsyncGRPORunConfig) -> dict[str, Any]:
    dumped = cfg.model_dump(mode="json")
    a = dumped["async_grpo"]
    keys = ("max_staleness", "target_prompt_groups_per_step", "selection", "seed", "shuffle", "loss")
    return {
        "grpo": dumped["grpo"],
        "sampling": dumped["sampling"],
        "task": dumped["task"],
        "async_grpo": {k: a[k] for k in keys},
    }


RESUME_MAY_CHANGE = (
    "grpo.val_period",
    "grpo.val_at_start",
    "grpo.val_max_prompts",
    "grpo.val_num_generations",
)


def setup(cfg: AsyncGRPORunConfig, policy: Policy | None = None) -> AsyncRun:
    """Policy (restored from a checkpoint if one is found), task, rollout workers, controller."""
    torch.manual_seed(cfg.grpo.seed)
    own_policy = policy is None
    policy = policy or Policy(cfg.policy)
    tokenizer = build_tokenizer(cfg.policy.model)
    task = build_task(cfg.task, tokenizer)
    ckpt = CheckpointManager(cfg.checkpointing, cfg.output_dir)
    extra = _load_checkpoint(cfg, policy, ckpt)
    trainer = PolicyTrainer(policy)
    trainer.export_fn = _export_fn(cfg, policy, tokenizer, lambda: trainer.version)
    actors: list[Any] = []
    if cfg.rollout.backend == "ray":
        workers, actors = start_ray_workers(cfg)
    else:
        workers = [EngineRolloutWorker.build(cfg, f"rollout-{i}") for i in range(cfg.rollout.num_workers)]
    stats = StepStats()
    controller = AsyncGRPOController(
        cfg.async_grpo,
        task.train.items,
        workers,
        trainer,
        policy_prepare_group(trainer, _group_to_batch(cfg, tokenizer, stats), _needs_reference(cfg)),
        samples_codec=SAMPLES_CODEC,
    )
    if extra is not None:
        controller.load_state_dict(extra["controller"])
    validator = _build_validator(cfg, policy, task, tokenizer)
    step = int(extra["step"]) if extra is not None else 0
    return AsyncRun(
        cfg,
        policy,
        trainer,
        task,
        tokenizer,
        workers,
        controller,
        ckpt,
        stats,
        validator,
        actors,
        step,
        own_policy,
    )


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


def _needs_reference(cfg: AsyncGRPORunConfig) -> bool:
    return cfg.async_grpo.loss.reference_policy_kl_penalty > 0


def _export_fn(
    cfg: AsyncGRPORunConfig, policy: Policy, tokenizer: Any, version: Callable[[], int]
) -> Callable[[], Any]:
    """Runs on the policy thread after every step: the weights payload (a Ray ObjectRef under Ray)."""
    sync = probe_sync(cfg, model_config(cfg.policy.model, tokenizer).vocab_size)

    def export() -> Any:
        probe = sync.trainer_probe(policy) if cfg.weight_sync.probe.enabled else None
        payload = WeightsPayload(version(), policy.full_state_dict(), probe, cfg.policy.logprob_temperature)
        if cfg.rollout.backend == "ray":
            import ray

            return ray.put(payload)
        return payload

    return export


def _group_to_batch(
    cfg: AsyncGRPORunConfig, tokenizer: Any, stats: StepStats
) -> Callable[[BufferedGroup], Any]:
    """The controller's per-group batch: grpo.samples_to_batch over one group (None filters it)."""
    pad_id = tokenizer.pad_token_id or 0

    def to_batch(group: BufferedGroup) -> Any:
        s: GroupSamples = group.samples
        rewards = torch.tensor(s.rewards, dtype=torch.float32)
        failed = torch.tensor(s.failed, dtype=torch.bool)
        group_ids = torch.zeros(len(s.results), dtype=torch.long)
        flat = cfg.grpo.dynamic_sampling and zero_variance_groups(rewards, group_ids, ~failed)
        stats.add(group, s, bool(flat))
        if flat:
            return None
        batch, _ = samples_to_batch(s.results, rewards, failed, group_ids, cfg.grpo, pad_id)
        return batch

    return to_batch


def _build_validator(cfg: AsyncGRPORunConfig, policy: Policy, task: Task, tokenizer: Any) -> Run | None:
    """A validation engine in this process, wrapped as a synchronous `Run` for grpo.validate."""
    loop = cfg.grpo
    if task.eval is None or not (loop.val_period or loop.val_at_start):
        return None
    sync_cfg = sync_equivalent(cfg)
    engine = GenerationEngine(load_full_model(cfg.policy.model, tokenizer), tokenizer, cfg.generation)
    return Run(
        sync_cfg,
        policy,
        engine,
        task,
        tokenizer,
        ClippedPGLoss(cfg.async_grpo.loss),
        probe_sync(cfg, engine.vocab_size),
    )


def validate_now(run: AsyncRun) -> dict[str, float]:
    """Blocking: the validation engine gets the current weights (probe-checked), then grpo.validate."""
    assert run.validator is not None
    v = run.validator
    sync = v.weight_sync.sync_local(run.policy, v.engine, run.trainer.version)
    out = validate(v)
    if "probe_max_abs_diff" in sync:
        out["val/weight_sync_probe_max_abs_diff"] = sync["probe_max_abs_diff"]
    return out


OnStepHook = Callable[[AsyncRun, int, dict[str, float]], Awaitable[None] | None]


async def train(run: AsyncRun, metrics_log: MetricsLogger, hook: OnStepHook | None = None) -> RunSummary:
    """Validate at start, run the controller; each step: log, validate, checkpoint, then `hook`."""
    cfg, loop = run.cfg, run.cfg.grpo
    num_steps = cfg.async_grpo.num_steps
    progress = StepProgress(
        num_steps or 0, "grpo-async", ("reward", "val/accuracy", "step_time_s"), cfg.logging.progress_bar
    )
    if run.validator is not None and loop.val_at_start and run.resumed_step == 0:
        metrics_log.log(await run.trainer.call(validate_now, run), 0)

    async def on_step(step: int, metrics: dict[str, float]) -> None:
        metrics.pop("step", None)  # the log's own `step` field
        metrics.update(run.stats.pop())
        if run.validator is not None and loop.val_period and step % loop.val_period == 0:
            metrics.update(await run.trainer.call(validate_now, run))
        metrics_log.log(metrics, step)
        progress.update(step, metrics)
        if run.ckpt.should_save(step, num_steps or -1):
            extra = {"step": step, "controller": run.controller.state_dict(), "config": _resume_view(cfg)}
            await run.trainer.call(run.ckpt.save, run.policy, step, extra, metrics)
        if hook is not None:
            result = hook(run, step, metrics)
            if inspect.isawaitable(result):
                await result

    try:
        return await run.controller.run(on_step)
    finally:
        progress.close()


def summary_metrics(summary: RunSummary) -> dict[str, float]:
    """How the run ended, as flat metrics (the ledger's group counts, the cumulative counters)."""
    out = {f"summary/groups_{k}": float(v) for k, v in summary.groups.items()}
    out |= {f"summary/total_{k}": float(v) for k, v in summary.totals.items()}
    out |= {
        "summary/steps": float(summary.steps),
        "summary/trainer_version": float(summary.trainer_version),
        "summary/data_exhausted": float(summary.data_exhausted),
        "summary/dead_workers": float(len(summary.dead_workers)),
    }
    return out


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
        for dead, reason in summary.dead_workers.items():
            log.warning("rollout worker %d was lost during the run: %s", dead, reason)
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
    """Prompt ids of every trained group, in group-id order (for checks that nothing was lost)."""
    return [run.stats.prepared[g] for g in run.controller.ledger.ids(GroupState.TRAINED)]
