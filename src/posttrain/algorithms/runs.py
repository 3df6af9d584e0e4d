"""What every training run does before and around its loop, written once for SFT, sync and async GRPO:
the output directory, the seed, the policy, tokenizer and task (`start_run`), finding and loading the
checkpoint to continue from with its config check (`resume`), and the run's history: one run per
output directory (`check_fresh_start` refuses to start a new run over an old one without consent,
`start_history` clears it with consent; for the runs without checkpoints, SFT, DPO and reward models,
`check_fresh_output` and `start_output`), config.yaml written after the resume check (a refused resume
leaves the run's config as it was) and a metrics log holding each step once (rows after the resumed
step are dropped). `StopOnInterrupt` turns Ctrl-C into a stop at the next step boundary; `train_steps`
is the step loop of the preference runs (DPO, reward models).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from posttrain.algorithms.checkpointing import CheckpointingConfig, CheckpointManager, check_resume_config
from posttrain.checkpoint import EXTRA_STATE_FILE
from posttrain.checkpoint_verify import read_json
from posttrain.config import Config, dump_config
from posttrain.envs.build import EnvConfig, EnvSuite, build_env
from posttrain.logging import LoggingConfig, MetricsLogger, StepProgress, get_logger
from posttrain.models.prompt_record import EXTRA_STATE_KEY, write_prompt_format
from posttrain.policy.config import PolicyConfig
from posttrain.policy.identity import check_lora_matches, saved_identity
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
    `env_cfg` when given), in that order. The task's seed fixes its problems and splits; the training
    prompts' order depends on the run's `seed` too, so runs that differ in seed also differ in data order
    (as SFT's batches and TRL's or NeMo-RL's data loaders do)."""
    out, policy, own_policy = _open(output_dir, seed, policy_cfg, policy)
    tokenizer = build_tokenizer(policy_cfg.model)
    task = build_env(env_cfg) if env_cfg is not None else build_task(task_cfg, tokenizer)
    task.train.order_by_run(seed)
    return RunParts(out, policy, tokenizer, task, own_policy)


def prompt_format_record(task_cfg: TaskConfig, env_cfg: EnvConfig | None = None) -> dict[str, Any] | None:
    """The prompt format a run records with the models it writes (models/prompt_record.py): its task's
    `prompt_format` as JSON; None for a run on an environment, which renders its own episodes."""
    return None if env_cfg is not None else task_cfg.prompt_format.model_dump(mode="json")


def prompt_format_state(cfg: Any) -> dict[str, Any]:
    """The entry of a checkpoint's extra state that records the prompt format of the run `cfg` (a config
    with `task` and `env`); `posttrain export` writes it into the directory it exports."""
    return {EXTRA_STATE_KEY: prompt_format_record(cfg.task, cfg.env)}


def save_hf_dir(policy: Policy, out_dir: Path, prompt_format: dict[str, Any] | None) -> None:
    """The policy's model as the Hugging Face directory `out_dir`, with the run's prompt format record
    (`prompt_format`; None: none)."""
    policy.save_hf(str(out_dir))
    write_prompt_format(out_dir, prompt_format)


def _open(output_dir: str, seed: int, policy_cfg: PolicyConfig, policy: Policy | None):
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    return out, policy or Policy(policy_cfg, seed=seed), policy is None


def shuffled_batches(n: int, size: int, seed: int) -> Iterator[list[int]]:
    """Endless lists of `size` indices into `n` items, reshuffled every epoch (seeded)."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        batch = []
        while len(batch) < size:
            if not order:
                order = list(range(n))
                rng.shuffle(order)
            batch.append(order.pop())
        yield batch


@contextmanager
def run_policy(
    output_dir: str, seed: int, policy_cfg: PolicyConfig, policy: Policy | None
) -> Iterator[tuple[Path, Policy]]:
    """`start_run` for runs without a task (preference pairs): output directory, global seed, then the
    policy (unless given); a policy built here is shut down on exit."""
    out, policy, own = _open(output_dir, seed, policy_cfg, policy)
    try:
        yield out, policy
    finally:
        if own:
            policy.shutdown()


def resume(
    policy: Policy,
    ckpt: CheckpointManager,
    view: dict[str, Any],
    may_change: tuple[str, ...] = (),
    requires: str | None = None,
    hint: str = "",
    config: Config | None = None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any] | None:
    """Load the checkpoint the manager picks (model, optimizer, RNG) and return its loop state, or None
    when the run starts fresh. Refuses a checkpoint whose loop config (`view`, dotted keys that name
    fields of `config`) differs outside `may_change` (sections the checkpoint did not record are not
    compared; a setting added since it was written is accepted at its default), or whose loop state
    lacks the key `requires` (`hint` says what to do instead); logs each key in `may_change` that
    differs; `check(loop state)` may refuse more (e.g. a data position of another dataset). Every check
    runs before anything loads. The policy's learning rate is the config's (policy/worker.py), whatever
    the checkpoint's was."""
    path = ckpt.resume_path()
    if path is None:
        return None
    # every check before anything loads: a refused resume leaves the policy as it was
    extra = read_json(path / EXTRA_STATE_FILE)
    if requires is not None and requires not in extra:
        raise ValueError(f"checkpoint {path} has no {requires} state; {hint}")
    # a full checkpoint in a LoRA run (or the reverse) is refused naming the way across, before its
    # policy.lora settings are compared
    check_lora_matches(policy.cfg, str(path), saved_identity(str(path)))
    saved = extra.get("config", {})

    def at_default(key: str) -> bool:
        recorded_later = any(key == k or key.startswith(k + ".") for k in _RECORDED_SINCE)
        return recorded_later or (config is not None and field_at_default(config, key))

    changed = check_resume_config(
        saved, {k: v for k, v in view.items() if k in saved}, may_change, at_default
    )
    if check is not None:
        check(extra)
    policy.prepare_for_training()
    extra = policy.load_checkpoint(str(path))
    log.warning("resumed from %s at step %d", path, int(extra["step"]))
    for key, old, new in changed:
        log.warning("resuming with %s changed %r -> %r", key, old, new)
    return extra


_MISSING = object()
# policy settings the resume check compares since 2026-11-27: a checkpoint written before lacks them,
# and its run's values are unknown, so they are accepted whatever they are now
_RECORDED_SINCE = (
    "policy.precision",
    "policy.max_grad_norm",
    "policy.logprob_temperature",
    "policy.moe",
    "policy.train_global_batch_size",
    "policy.model.disable_dropout",
    "policy.lora.dropout",
)


def field_at_default(config: Config, key: str) -> bool:
    """Whether the dotted `key` names a field of `config` (through nested sections) holding its default:
    the value a config built with no arguments holds there (a section's own default may differ from its
    class's, e.g. a run's learning rate), or where that config has no such field (another kind of task),
    the default of the field's class."""
    *path, name = key.split(".")
    section: Any = config
    try:
        default: Any = type(config)()
    except ValueError:  # a config with required fields (pydantic's ValidationError is a ValueError)
        default = _MISSING
    for part in path:
        section = getattr(section, part, None)
        default = getattr(default, part, _MISSING)
        if not isinstance(section, Config):
            return False
    field = type(section).model_fields.get(name)
    if field is None:
        return False
    if isinstance(default, type(section)):
        return getattr(section, name) == getattr(default, name)
    return getattr(section, name) == field.get_default(call_default_factory=True)


def resume_dump(config: Config) -> dict[str, Any]:
    """`config` as JSON for a resume check, every policy config's `logprob_temperature` as the value it
    scores at (`scoring_temperature`): an unset one dumps as None and follows the sampling temperature,
    and checkpoints written before the tie recorded the value in use (1.0 by default)."""
    dumped = config.model_dump(mode="json")
    _record_scoring(config, dumped)
    return dumped


def _record_scoring(config: Any, dumped: Any) -> None:
    if isinstance(config, PolicyConfig) and isinstance(dumped, dict):
        dumped["logprob_temperature"] = config.scoring_temperature
    if isinstance(config, Config) and isinstance(dumped, dict):
        for name in type(config).model_fields:
            if name in dumped:
                _record_scoring(getattr(config, name), dumped[name])


def optimizer_view(policy: PolicyConfig, batch_size: bool = True) -> dict[str, Any]:
    """The policy settings a resumed run shares with its checkpoint: the optimizer's and the schedule's
    (the checkpoint restores their state; list `policy.optimizer.lr` in `may_change`: the worker applies
    a new one) and the others that shape each update: precision, gradient clipping, the logprobs'
    temperature, the MoE losses and routing, dropout (the model's, LoRA's), and (`batch_size`) the samples
    per optimizer step."""
    view = {
        "optimizer": policy.optimizer.model_dump(mode="json"),
        "scheduler": [s.model_dump(mode="json") for s in policy.scheduler],
        "precision": policy.precision,
        "max_grad_norm": policy.max_grad_norm,
        "logprob_temperature": policy.scoring_temperature,
        "moe": policy.moe.model_dump(mode="json"),
        "model": {"disable_dropout": policy.model.disable_dropout},
    }
    if policy.lora is not None:
        view["lora"] = {"dropout": policy.lora.dropout}
    if batch_size:
        view["train_global_batch_size"] = policy.train_global_batch_size
    return view


# --------------------------------------------------------------------------- one run, one history

RUN_FILES = ("metrics.jsonl", "config.yaml", "curves.png", "tb", "wandb", "wandb_run_id")


def previous_run(out: Path, ckpt: CheckpointManager) -> list[Path]:
    """What a run left in `out` and in its checkpoint directory."""
    found = [out / name for name in RUN_FILES if (out / name).exists()]
    return found + (sorted(ckpt.root.glob("step_*")) if ckpt.root.is_dir() else [])


def check_fresh_start(output_dir: str | Path, ckpt: CheckpointManager) -> None:
    """`checkpointing.resume=never` over a previous run: refused unless `checkpointing.overwrite` consents
    (the clearing itself waits for `start_history`, once the new run is built). Call it first."""
    cfg, out = ckpt.cfg, Path(output_dir).absolute()
    if cfg.overwrite and cfg.resume != "never":
        log.warning("checkpointing.overwrite=true is ignored: it applies with checkpointing.resume=never")
    found = previous_run(out, ckpt)
    if cfg.resume != "never" or cfg.overwrite or not found:
        return
    raise ValueError(
        f"{out} already holds a run ({_listed(out, found)}); checkpointing.resume=never would start another "
        "one over it. To delete it and start over, pass --overwrite (or set checkpointing.overwrite=true); "
        "to continue it, use checkpointing.resume=auto; or choose another output_dir"
    )


def _listed(out: Path, found: list[Path]) -> str:
    shown = [str(p.relative_to(out)) if p.is_relative_to(out) else str(p) for p in found[:4]]
    return ", ".join(shown) + (f" and {len(found) - 4} more" if len(found) > 4 else "")


OUTPUT_FILES = (*RUN_FILES, "hf")  # a run without checkpoints: its history and its final model


def overwrite_field() -> Any:
    """The `overwrite` key of the runs that write one model directory (sft, dpo, rm)."""
    return Field(
        False,
        description="start over in an output_dir that holds a run: delete it first (metrics.jsonl, "
        "config.yaml, hf/ and the other files a run writes) instead of refusing (CLI: --overwrite)",
    )


def check_fresh_output(output_dir: str | Path, what: str, overwrite: bool) -> None:
    """A run without checkpoints (`what`: sft, dpo, rm) into an output directory that holds a run: refused
    unless `overwrite` consents (the clearing waits for `start_output`, once the new run is built). Call
    it first."""
    out = Path(output_dir).absolute()
    found = [out / name for name in OUTPUT_FILES if (out / name).exists()]
    if overwrite or not found:
        return
    raise ValueError(
        f"{out} already holds a run ({_listed(out, found)}); a new {what} run would replace it ({what} "
        "writes no checkpoints to continue from). To delete it and start over, pass --overwrite (or set "
        "overwrite=true); or choose another output_dir"
    )


def start_output(out: Path, cfg: Config, overwrite: bool) -> None:
    """After `check_fresh_output`, once the run is built: with `overwrite` the previous run in `out` is
    deleted; then config.yaml is written."""
    if overwrite:
        _delete(out, [out / name for name in OUTPUT_FILES if (out / name).exists()])
    write_config(out, cfg)


def start_history(
    out: Path, cfg: Config, ckpt: CheckpointManager, logging_cfg: LoggingConfig, resumed_step: int
) -> MetricsLogger:
    """After the resume check passed: a fresh start under `overwrite` deletes the previous run; then
    config.yaml is written and the metrics log opened (a resumed run's keeps the rows up to
    `resumed_step`)."""
    if resumed_step:
        if ckpt.cfg.resume not in ("auto", "never"):  # auto took the newest intact one
            _warn_later_checkpoints(ckpt, resumed_step)
    elif ckpt.cfg.resume == "never" and ckpt.cfg.overwrite:
        _delete(out, previous_run(out, ckpt))
    elif (out / "metrics.jsonl").is_file():
        log.warning("%s: no checkpoint to resume from; a fresh run replaces its metrics.jsonl", out)
    write_config(out, cfg)
    return open_metrics(out, logging_cfg, resumed_step or None)


def _delete(out: Path, old: list[Path]) -> None:
    for p in old:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    if old:
        log.warning("overwrite: deleted the previous run in %s (%d entries)", out, len(old))


def _warn_later_checkpoints(ckpt: CheckpointManager, resumed_step: int) -> None:
    """Checkpoints after the one resumed from (resume=<path>) are another history's."""
    steps = {p.name: int(p.name.split("_")[-1]) for p in ckpt.complete_checkpoints()}
    later = [name for name, step in steps.items() if step > resumed_step]
    if later:
        log.warning(
            "%s holds checkpoints after step %d, the step resumed from (%s): they belong to the run that went "
            "on from there, and resume=auto picks the newest; delete them unless this run overwrites them",
            ckpt.root,
            resumed_step,
            ", ".join(later),
        )


def write_config(out: Path, cfg: Config) -> None:
    (out / "config.yaml").write_text(dump_config(cfg))


def open_metrics(out: Path, cfg: LoggingConfig, resume_step: int | None) -> MetricsLogger:
    """The run's metrics log: started afresh, or (`resume_step`) kept up to that step and appended to."""
    return MetricsLogger(out, cfg.tensorboard, cfg.wandb_project, cfg.wandb_run_name, resume_step)


# --------------------------------------------------------------------------- Ctrl-C


class RunInterrupted(Exception):
    """A run stopped at a step boundary after Ctrl-C; the message says what was saved and how to go on."""

    def __init__(self, message: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


def failure(err: BaseException) -> bool:
    """Whether `err` ending a run is a failure (the metrics log's `close(failed=...)`): any error but
    `RunInterrupted`, Ctrl-C's stop at a step boundary."""
    return not isinstance(err, RunInterrupted)


@contextlib.contextmanager
def closing_metrics(metrics_log: MetricsLogger) -> Iterator[None]:
    """Close `metrics_log` when the block ends, marking the run failed where an error other than
    `RunInterrupted` ended it (`failure`)."""
    failed = False
    try:
        yield
    except BaseException as err:
        failed = failure(err)
        raise
    finally:
        metrics_log.close(failed=failed)


class StopOnInterrupt:
    """While active (in the main thread), the first Ctrl-C (SIGINT) only sets `requested`: the loop
    finishes its step, saves and raises `RunInterrupted`. A second Ctrl-C aborts at once
    (KeyboardInterrupt), without saving."""

    def __init__(self, what: str, saves: bool) -> None:
        self.what, self.saves = what, saves
        self.requested = False
        self._previous: Any = None
        self._active = False

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle) or signal.default_int_handler
            self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._active:
            signal.signal(signal.SIGINT, self._previous)
            self._active = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            self.__exit__()
            raise KeyboardInterrupt
        self.requested = True
        then = "saves a checkpoint and stops" if self.saves else "stops"
        log.warning(
            "Ctrl-C: %s finishes the current step, then %s (Ctrl-C again aborts now)", self.what, then
        )


def interrupted(
    what: str, step: int, last_step: int | None, cfg: CheckpointingConfig | None, saved: Path | None
) -> RunInterrupted:
    """The `RunInterrupted` of a run stopped after `step` (of `last_step`) with a checkpoint `saved` there,
    or none (`cfg` None: the run writes no checkpoints)."""
    where = f"{what} interrupted " + (f"at step {step}" if step else "before its first step")
    where += f" of {last_step}" if step and last_step else ""
    if saved is not None and cfg is not None:
        how = f"checkpoint saved: {saved}; to continue from it, run the same command again" + (
            " (checkpointing.resume=auto)"
            if cfg.resume == "auto"
            else " with checkpointing.resume=auto (and without --overwrite)"
        )
    elif cfg is None:
        how = "it writes no checkpoints, so nothing was saved; a new run starts over"
    elif not cfg.enabled:
        how = "no checkpoint saved (checkpointing.enabled=false); a new run starts over"
    else:
        how = "nothing to save yet; a new run starts over"
    return RunInterrupted(f"{where}: {how}", step, saved)


# --------------------------------------------------------------------------- a loop of optimizer steps


def train_steps(
    what: str,
    policy: Policy,
    loss: Any,
    next_batch: Callable[[], Any],
    out: Path,
    cfg: Any,
    validate: Callable[[int], dict[str, float]] | None = None,
    returned: tuple[str, ...] = (),
    at_start: str | None = None,
    prompt_format: dict[str, Any] | None = None,
) -> dict[str, float]:
    """The step loop of the preference runs (dpo.py, rm.py). `cfg.max_num_steps` optimizer steps, each on
    `next_batch()` (timed with it), its metrics logged under train/. With `validate` (None: nothing held
    out): at step 0, every `cfg.val_period` steps and at the last, `validate(step)` measures the held-out
    metrics, logged under val/ (the progress bar shows their `accuracy`); the `returned` ones come back as
    `val_<name>`, and `at_start`'s step-0 value as `val_<at_start>_at_start`. Ctrl-C stops after the
    current step (`RunInterrupted`; nothing is saved); at the end the model is saved as `<out>/hf` when
    `cfg.save_final_model`, with the `prompt_format` record (save_hf_dir). Returns the last step's metrics
    and those held-out ones."""
    metrics_log = open_metrics(out, cfg.logging, resume_step=None)
    progress = StepProgress(cfg.max_num_steps, what, ("train/loss", "val/accuracy"), cfg.logging.progress_bar)
    last: dict[str, float] = {}
    held: dict[str, float] = {}

    def check(step: int) -> float:
        val = validate(step)
        metrics_log.log(val, step, prefix="val")
        held.update({f"val_{k}": val[k] for k in returned})
        return val["accuracy"]

    step = 0
    try:
        with closing_metrics(metrics_log):
            if validate is not None:
                check(0)
                if at_start is not None:
                    held[f"val_{at_start}_at_start"] = held[f"val_{at_start}"]
            with StopOnInterrupt(what, saves=False) as stop:
                while step < cfg.max_num_steps and not stop.requested:
                    step += 1
                    t = time.perf_counter()
                    last.update(policy.train(next_batch(), loss))
                    last["step_time_s"] = time.perf_counter() - t
                    metrics_log.log(last, step, prefix="train")
                    shown = {"train/loss": last["loss"]}
                    if validate is not None and (
                        step == cfg.max_num_steps or (cfg.val_period and step % cfg.val_period == 0)
                    ):
                        shown["val/accuracy"] = check(step)
                    progress.update(step, shown)
                if step < cfg.max_num_steps:
                    raise interrupted(what, step, cfg.max_num_steps, None, None)
                if cfg.save_final_model:
                    save_hf_dir(policy, out / "hf", prompt_format)
    finally:
        progress.close()
    return {**last, **held}
