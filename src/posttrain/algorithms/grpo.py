"""Synchronous GRPO: generate, score, advantages, logprobs, train, sync, in that order, every step.

Read `run_grpo` top to bottom; each phase is a short function below it. Departures from the textbook:
- failed rewards are never entered as 0: the sample is masked out and counted (tasks/rewards.py);
- dynamic sampling drops prompt groups whose rewards are all equal and refills up to a bound;
- generation seeds are derived from (seed, step, sample), so a resumed run draws exactly the samples
  an uninterrupted run would;
- after every weight sync the engine's logprobs on a probe batch are checked against the trainer's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from posttrain.algorithms.advantages import group_advantages, zero_variance_groups
from posttrain.algorithms.checkpointing import CheckpointingConfig, CheckpointManager, check_resume_config
from posttrain.algorithms.losses import ClippedPGConfig, ClippedPGLoss
from posttrain.algorithms.sft import LoggingConfig
from posttrain.config import Config, dump_config
from posttrain.data.batch import batch_from_sequences, completion_values
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig, GenerationResult, SamplingParams
from posttrain.generation.weight_sync import WeightSync, WeightSyncConfig, can_share
from posttrain.logging import MetricsLogger, StepProgress, get_logger, plot_metrics
from posttrain.parallel.mesh import default_device
from posttrain.policy.config import PolicyConfig
from posttrain.policy.model_init import build_tokenizer, load_full_model
from posttrain.policy.policy import Policy
from posttrain.tasks.arithmetic import ArithmeticTaskConfig
from posttrain.tasks.build import TaskConfig, build_task
from posttrain.tasks.datasets import PromptItem
from posttrain.tasks.task import Task

log = get_logger(__name__)


class GRPOLoopConfig(Config):
    """The loop's knobs (names follow NeMo-RL)."""

    num_prompts_per_step: int = Field(16, ge=1)
    num_generations_per_prompt: int = Field(8, ge=1)
    max_num_steps: int = Field(50, ge=0)
    max_num_epochs: int = Field(1000, ge=1, description="stop after this many passes over the prompts")
    normalize_rewards: bool = Field(True, description="divide advantages by the group's reward std")
    use_leave_one_out_baseline: bool = Field(False, description="RLOO baseline instead of the group mean")
    overlong_filtering: bool = Field(False, description="truncated completions do not contribute to the loss")
    dynamic_sampling: bool = Field(False, description="drop groups with zero reward variance, refill")
    dynamic_sampling_max_refills: int = Field(2, ge=0, description="extra prompt batches per step at most")
    overlong_reward_shaping: bool = Field(False, description="DAPO soft penalty near max_new_tokens")
    overlong_buffer_length: int = Field(4, ge=1)
    overlong_penalty: float = Field(1.0, ge=0)
    val_period: int = Field(10, ge=0, description="validate every N steps (0 = never during training)")
    val_at_start: bool = True
    val_num_generations: int = Field(1, ge=1, description="k of pass@k (k=1: greedy accuracy)")
    val_max_prompts: int | None = Field(None, ge=1)
    recompute_prev_logprobs: Literal["auto", "always"] = Field(
        "auto",
        description="auto: skip the extra trainer forward when the step's samples make one optimizer "
        "step (prev_logprobs then equal the training forward's own logprobs, detached: the loss uses "
        "force_on_policy_ratio for the PPO ratio and the importance-sampling weights, as TRL does with "
        "num_iterations=1); always: compute prev_logprobs in a separate forward",
    )
    seed: int = 0


class GRPORunSections(Config):
    """The sections every GRPO run has, synchronous or asynchronous (each means the same in both)."""

    policy: PolicyConfig = Field(
        default_factory=lambda: PolicyConfig(optimizer={"lr": 1e-3}, train_global_batch_size=128)
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(max_new_tokens=8))
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    grpo: GRPOLoopConfig = Field(default_factory=GRPOLoopConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)


class GRPOConfig(GRPORunSections):
    """A synchronous GRPO run."""

    loss: ClippedPGConfig = Field(default_factory=ClippedPGConfig)
    colocated: bool = Field(
        True,
        description="trainer offloaded while the engine generates, engine asleep while training (on an "
        "accelerator; on a CPU device both share host memory and neither is moved)",
    )
    output_dir: str = "runs/grpo"


# Loop settings a resumed run must share with the checkpoint (they shape the trajectory).
RESUME_KEYS = ("grpo", "sampling", "task", "loss")
# ... except these, which a resumed run may change.
RESUME_MAY_CHANGE = ("grpo.max_num_steps", "grpo.max_num_epochs", "grpo.val_period", "grpo.val_at_start")


@dataclass
class Rollouts:
    """One step's samples: prompts x generations, flattened in group order."""

    items: list[PromptItem]
    results: list[GenerationResult]
    rewards: torch.Tensor
    failed: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Run:
    """Everything a step needs."""

    cfg: GRPOConfig
    policy: Policy
    engine: GenerationEngine
    task: Task
    tokenizer: Any
    loss_fn: ClippedPGLoss
    weight_sync: WeightSync
    share_weights: bool = False  # the engine aliases the trainer's tensors (see sync_weights)
    step: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, name: str):
        t0 = time.perf_counter()
        yield
        self.timings[f"timing/{name}_s"] = time.perf_counter() - t0


# --------------------------------------------------------------------------- the loop


def run_grpo(cfg: GRPOConfig, policy: Policy | None = None) -> dict[str, float]:
    """Train with GRPO; returns the final metrics (including the last validation)."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    run = setup(cfg, policy)
    ckpt = CheckpointManager(cfg.checkpointing, out)
    resume_from(run, ckpt)
    metrics_log = MetricsLogger(out, cfg.logging.tensorboard, cfg.logging.wandb_project, append=run.step > 0)
    progress = StepProgress(
        cfg.grpo.max_num_steps, "grpo", ("reward", "val/accuracy", "step_time_s"), cfg.logging.progress_bar
    )
    last: dict[str, float] = {}
    try:
        if cfg.grpo.val_at_start and run.step == 0 and run.task.eval is not None:
            last.update(validate(run))
            metrics_log.log(last, 0)
        while run.step < cfg.grpo.max_num_steps and run.task.train.epoch < cfg.grpo.max_num_epochs:
            run.step += 1
            metrics = grpo_step(run)
            if cfg.grpo.val_period and run.step % cfg.grpo.val_period == 0 and run.task.eval is not None:
                metrics.update(validate(run))
            metrics_log.log(metrics, run.step)
            progress.update(run.step, metrics)
            last.update(metrics)
            if ckpt.should_save(run.step, cfg.grpo.max_num_steps):
                ckpt.save(run.policy, run.step, loop_state(run), metrics)
    finally:
        progress.close()
        metrics_log.close()
    plot_metrics(metrics_log.path, out / "curves.png", ("reward", "val/accuracy"))
    return last


def grpo_step(run: Run) -> dict[str, float]:
    """One step: generate -> score -> advantages -> logprobs -> train -> sync."""
    t0 = time.perf_counter()
    run.timings = {}
    with run.timed("generation"):
        rollouts = generate(run)
    batch, adv_metrics = build_batch(run, rollouts)
    with run.timed("logprobs"):
        add_logprobs(run, batch)
    with run.timed("training"):
        run.policy.prepare_for_training()
        train_metrics = run.policy.train(batch, run.loss_fn)
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


def engine_config(cfg: GRPOConfig, task: Task) -> GenerationConfig:
    """The engine's config as the loops use it: on the default device unless set, and a KV cache
    no longer than the longest prompt plus `max_new_tokens` unless `max_model_len` is set."""
    gen = cfg.generation
    if gen.device is None:
        gen = gen.model_copy(update={"device": str(default_device())})
    if gen.max_model_len is None:
        splits = [ds for ds in (task.train, task.eval) if ds is not None]
        longest = max(len(it.prompt_token_ids) for ds in splits for it in ds)
        gen = gen.model_copy(update={"max_model_len": longest + cfg.sampling.max_new_tokens})
    return gen


def setup(cfg: GRPOConfig, policy: Policy | None) -> Run:
    """Policy, tokenizer, task, engine (with the policy's weights) and the probe batch."""
    if (
        cfg.policy.train_global_batch_size
        > cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    ):
        raise ValueError(
            f"policy.train_global_batch_size={cfg.policy.train_global_batch_size} exceeds the samples per step "
            f"({cfg.grpo.num_prompts_per_step} x {cfg.grpo.num_generations_per_prompt}); lower it"
        )
    torch.manual_seed(cfg.grpo.seed)
    policy = policy or Policy(cfg.policy)
    tokenizer = build_tokenizer(cfg.policy.model)
    task = build_task(cfg.task, tokenizer)
    gen_cfg = engine_config(cfg, task)
    engine = GenerationEngine(load_full_model(cfg.policy.model, tokenizer), tokenizer, gen_cfg)
    sync = WeightSync(cfg.weight_sync, engine.vocab_size, dp_size=cfg.policy.dp_size)
    run = Run(cfg, policy, engine, task, tokenizer, ClippedPGLoss(cfg.loss), sync)
    if skips_prev_logprobs(cfg):
        run.loss_fn = ClippedPGLoss(cfg.loss.model_copy(update={"force_on_policy_ratio": True}))
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


def _seed(run: Run, salt: int) -> int:
    return (run.cfg.grpo.seed * 1_000_003 + run.step * 10_007 + salt * 101) % (2**31)


def sample_groups(run: Run, items: list[PromptItem], salt: int) -> list[GenerationResult]:
    """num_generations_per_prompt completions for each prompt. One seed per call: the engine gives
    sample i its own random stream (seed, i), so every sample's draws are reproducible and distinct."""
    g = run.cfg.grpo.num_generations_per_prompt
    prompts = [list(it.prompt_token_ids) for it in items for _ in range(g)]
    return run.engine.generate(prompts, run.cfg.sampling.model_copy(update={"seed": _seed(run, salt)}))


def score(
    run: Run, items: list[PromptItem], results: list[GenerationResult]
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Rewards and failure flags (failed rewards are marked, never zeroed), with overlong shaping."""
    g = run.cfg.grpo.num_generations_per_prompt
    flat = [it for it in items for _ in range(g)]
    texts = decode_completions(run.tokenizer, results)
    res = run.task.reward([it.prompt for it in flat], texts, [it.metadata for it in flat])
    rewards = torch.tensor(
        [float("nan") if f else r for r, f in zip(res.rewards, res.failed)], dtype=torch.float32
    )
    failed = torch.tensor(res.failed, dtype=torch.bool)
    loop = run.cfg.grpo
    if loop.overlong_reward_shaping:
        limit = run.cfg.sampling.max_new_tokens
        lengths = torch.tensor([len(r.token_ids) for r in results], dtype=torch.float32)
        over = (lengths - (limit - loop.overlong_buffer_length)).clamp(min=0) / loop.overlong_buffer_length
        rewards = rewards - loop.overlong_penalty * over.clamp(max=1.0)
    return rewards, failed, res.summary()


def decode_completions(tokenizer, results: list[GenerationResult]) -> list[str]:
    """Completion texts; identical completions (frequent in a group of short answers) decoded once."""
    seen: dict[tuple[int, ...], str] = {}
    out = []
    for r in results:
        key = tuple(r.token_ids)
        if key not in seen:
            seen[key] = tokenizer.decode(r.token_ids, skip_special_tokens=True)
        out.append(seen[key])
    return out


def generate(run: Run) -> Rollouts:
    """Generate and score prompt groups; with dynamic sampling, refill zero-variance groups."""
    loop = run.cfg.grpo
    g = loop.num_generations_per_prompt
    colocated_generation_start(run)
    kept_items, kept_results, kept_rewards, kept_failed = [], [], [], []
    dropped, summaries, drawn = 0, [], []
    t_reward = 0.0
    for attempt in range(1 + (loop.dynamic_sampling_max_refills if loop.dynamic_sampling else 0)):
        need = loop.num_prompts_per_step - len(kept_items)
        if need <= 0:
            break
        items = run.task.train.next_batch(need if attempt else loop.num_prompts_per_step)
        results = sample_groups(run, items, salt=attempt)
        t1 = time.perf_counter()
        rewards, failed, summary = score(run, items, results)
        t_reward += time.perf_counter() - t1
        summaries.append(summary)
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
    return Rollouts(kept_items, kept_results, rewards, failed, metrics)


def build_batch(run: Run, ro: Rollouts):
    """The step's training batch (padded with masked rows to whole global batches) and its metrics."""
    g = run.cfg.grpo.num_generations_per_prompt
    group_ids = torch.tensor([it.prompt_id for it in ro.items for _ in range(g)], dtype=torch.long)
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
        run.tokenizer.pad_token_id or 0,
        run.cfg.policy.train_global_batch_size,
    )


def samples_to_batch(
    results: list[GenerationResult],
    rewards: torch.Tensor,
    failed: torch.Tensor,
    group_ids: torch.Tensor,
    loop: GRPOLoopConfig,
    pad_id: int,
    multiple_of: int = 1,
):
    """Advantages per prompt group, then a batch of prompt+completion rows (failed or filtered samples
    masked out), right-padded with masked rows to a multiple of `multiple_of` rows."""
    adv = group_advantages(
        rewards,
        group_ids,
        ~failed,
        leave_one_out=loop.use_leave_one_out_baseline,
        std_scaling="group" if loop.normalize_rewards else "none",
    )
    mask = (~failed).float()
    if loop.overlong_filtering:
        mask = mask * torch.tensor([r.finish_reason != "length" for r in results], dtype=torch.float32)
    pad = -len(results) % multiple_of
    results = list(results) + [results[i % len(results)] for i in range(pad)]
    adv = torch.cat([adv, torch.zeros(pad)])
    mask = torch.cat([mask, torch.zeros(pad)])
    batch = batch_from_sequences(
        [r.prompt_token_ids for r in results], [r.token_ids for r in results], pad_id, mask.tolist()
    )
    batch["generation_logprobs"] = completion_values(batch, (r.logprobs for r in results))
    batch["advantages"] = adv[:, None] * batch["token_mask"]
    metrics = {"advantage_abs_mean": float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))}
    return batch, metrics


def skips_prev_logprobs(cfg: GRPOConfig) -> bool:
    """Whether prev_logprobs equal the training-time logprobs by construction (see recompute_prev_logprobs):
    the step's samples make one optimizer step, so the loss takes prev from its own forward
    (force_on_policy_ratio), for the ratio and the importance-sampling weights alike."""
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    one_step = samples <= cfg.policy.train_global_batch_size
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
    """Colocated: the trainer gives the device to the engine (and frees its communicators if asked)."""
    if not run.cfg.colocated:
        return
    if time_shares_device(run):
        run.policy.offload_after_refit()
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
    """Held-out accuracy (greedy when k=1) and pass@k over the eval prompts."""
    loop = run.cfg.grpo
    items = run.task.eval.items[: loop.val_max_prompts]
    k = loop.val_num_generations
    colocated_generation_start(run)
    prompts = [list(it.prompt_token_ids) for it in items for _ in range(k)]
    params = [
        run.cfg.sampling.model_copy(update={"greedy": k == 1, "seed": loop.seed * 7919 + i})
        for i in range(len(prompts))
    ]
    results = run.engine.generate(prompts, params)
    colocated_generation_end(run)
    texts = decode_completions(run.tokenizer, results)
    flat = [it for it in items for _ in range(k)]
    res = run.task.reward([it.prompt for it in flat], texts, [it.metadata for it in flat])
    correct = torch.tensor([(r if not f else 0.0) >= 1.0 for r, f in zip(res.rewards, res.failed)]).view(
        len(items), k
    )
    out = {"val/accuracy": float(correct.float().mean()), "val/reward_failed": float(res.num_failed)}
    if k > 1:
        out[f"val/pass@{k}"] = float(correct.any(dim=1).float().mean())
    return out


# --------------------------------------------------------------------------- checkpoint state


def _resume_view(cfg: GRPOConfig) -> dict[str, Any]:
    dumped = cfg.model_dump(mode="json")
    return {k: dumped[k] for k in RESUME_KEYS}


def loop_state(run: Run) -> dict[str, Any]:
    return {"step": run.step, "train_data": run.task.train.state_dict(), "config": _resume_view(run.cfg)}


def resume_from(run: Run, ckpt: CheckpointManager) -> None:
    """Continue from the checkpoint the manager picks (model, optimizer, RNG, data position, step)."""
    path = ckpt.resume_path()
    if path is None:
        return
    run.policy.prepare_for_training()
    extra = run.policy.load_checkpoint(str(path))
    check_resume_config(extra.get("config", {}), _resume_view(run.cfg), RESUME_MAY_CHANGE)
    run.step = int(extra["step"])
    run.task.train.load_state_dict(extra["train_data"])
    sync_weights(run)
    log.warning("resumed from %s at step %d", path, run.step)
