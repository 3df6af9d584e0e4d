"""What every training run does before and around its loop, written once for SFT, sync and async GRPO:
the output directory, the seed, the policy, tokenizer and task (`start_run`), finding and loading the
checkpoint to continue from with its config check (`resume`), the config file (`write_config`, after
the resume check, so a refused resume leaves the run's config as it was) and the metrics log
(`open_metrics`, appending when the run continues).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.algorithms.checkpointing import CheckpointManager, check_resume_config
from posttrain.config import Config, dump_config
from posttrain.envs.build import EnvConfig, EnvSuite, build_env
from posttrain.logging import LoggingConfig, MetricsLogger, get_logger
from posttrain.policy.config import PolicyConfig
from posttrain.policy.model_init import build_tokenizer
from posttrain.policy.policy import Policy
from posttrain.tasks.build import TaskConfig, build_task
from posttrain.tasks.task import Task

log = get_logger(__name__)


@dataclass
class RunParts:
    """What every run is built from."""

    out: Path
    policy: Policy
    tokenizer: Any
    task: Task | EnvSuite
    own_policy: bool  # built here (so the run shuts it down), not passed in


def start_run(
    output_dir: str,
    seed: int,
    policy_cfg: PolicyConfig,
    task_cfg: TaskConfig,
    policy: Policy | None,
    env_cfg: EnvConfig | None = None,
) -> RunParts:
    """Output directory, global seed, then policy (unless given), tokenizer and task (the environment
    `env_cfg` when given), in that order."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    own_policy = policy is None
    policy = policy or Policy(policy_cfg)
    tokenizer = build_tokenizer(policy_cfg.model)
    task = build_env(env_cfg) if env_cfg is not None else build_task(task_cfg, tokenizer)
    return RunParts(out, policy, tokenizer, task, own_policy)


def resume(
    policy: Policy,
    ckpt: CheckpointManager,
    view: dict[str, Any],
    may_change: tuple[str, ...] = (),
    requires: str | None = None,
    hint: str = "",
) -> dict[str, Any] | None:
    """Load the checkpoint the manager picks (model, optimizer, RNG) and return its loop state, or None
    when the run starts fresh. Refuses a checkpoint whose loop config (`view`) differs outside
    `may_change`, or whose loop state lacks the key `requires` (`hint` says what to do instead)."""
    path = ckpt.resume_path()
    if path is None:
        return None
    policy.prepare_for_training()
    extra = policy.load_checkpoint(str(path))
    if requires is not None and requires not in extra:
        raise ValueError(f"checkpoint {path} has no {requires} state; {hint}")
    check_resume_config(extra.get("config", {}), view, may_change)
    log.warning("resumed from %s at step %d", path, int(extra["step"]))
    return extra


def write_config(out: Path, cfg: Config) -> None:
    (out / "config.yaml").write_text(dump_config(cfg))


def open_metrics(out: Path, cfg: LoggingConfig, resumed: bool) -> MetricsLogger:
    return MetricsLogger(out, cfg.tensorboard, cfg.wandb_project, append=resumed)
