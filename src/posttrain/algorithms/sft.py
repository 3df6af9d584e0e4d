"""Supervised fine-tuning (the warm start before RL): NLL on completion tokens of a task's SFT examples.

Reads top to bottom: build policy and task, then per step take the next global batch of examples,
train, log; evaluate the held-out loss every `val_period` steps; save a Hugging Face checkpoint.
"""

from __future__ import annotations

import time

from pydantic import Field, model_validator

from posttrain.algorithms.losses import NLLLoss
from posttrain.algorithms.runs import (
    StopOnInterrupt,
    check_fresh_output,
    closing_metrics,
    interrupted,
    open_metrics,
    overwrite_field,
    prompt_format_record,
    save_hf_dir,
    shuffled_batches,
    start_output,
    start_run,
)
from posttrain.config import Config
from posttrain.data.batch import batch_from_sequences
from posttrain.envs.build import EnvConfig, EnvSuite
from posttrain.logging import LoggingConfig, StepProgress, get_logger
from posttrain.models.tokenizer import pad_token_id
from posttrain.policy.config import ModelConfig, PolicyConfig
from posttrain.policy.model_init import model_config
from posttrain.policy.policy import Policy
from posttrain.rollout.episodes import demonstration_examples
from posttrain.tasks.arithmetic import ArithmeticTaskConfig, sft_examples
from posttrain.tasks.build import TaskConfig
from posttrain.tasks.task import SFTExample

log = get_logger(__name__)


class SFTConfig(Config):
    """An SFT run."""

    policy: PolicyConfig = Field(
        default_factory=lambda: PolicyConfig(
            optimizer={"lr": 3e-3}, train_global_batch_size=32, microbatch={"train_micro_batch_size": 32}
        )
    )
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    env: EnvConfig | None = Field(
        None,
        description="warm-start on this environment's demonstrations (ideal episodes) instead of the task",
    )
    max_num_steps: int = Field(200, ge=0, description="optimizer steps")
    val_period: int = Field(50, ge=0, description="held-out loss every N steps (0 = only at the end)")
    seed: int = Field(0, description="seed of the run: torch's global seed and the order of the examples")
    output_dir: str = Field(
        "runs/sft", description="metrics.jsonl, config.yaml and the final HF model go here"
    )
    save_final_model: bool = Field(
        True, description="save the trained model as an HF directory, <output_dir>/hf"
    )
    overwrite: bool = overwrite_field()
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _untempered(self) -> SFTConfig:
        self.policy.check_untempered("SFT")
        return self


def example_batches(examples: list[SFTExample], batch_size: int, seed: int):
    """Endless batches of examples, reshuffled each epoch (seeded)."""
    if not examples:
        raise ValueError("the task has no SFT examples; SFT needs a task with prompts and reference answers")
    for indices in shuffled_batches(len(examples), batch_size, seed):
        yield [examples[i] for i in indices]


def to_batch(examples: list[SFTExample], pad_id: int, multiple_of: int = 1):
    """Batch of examples, padded with masked-out copies up to a multiple of `multiple_of` rows."""
    n = len(examples)
    padded = examples + [examples[i % n] for i in range(-n % multiple_of)]
    mask = [1.0] * n + [0.0] * (len(padded) - n)
    return batch_from_sequences(
        [e.prompt_token_ids for e in padded],
        [e.completion_token_ids for e in padded],
        pad_id,
        mask,
        [e.completion_mask for e in padded],
    )


def heldout_examples(task, tokenizer) -> list[SFTExample]:
    """Held-out SFT examples (eval prompts with their answers, an environment's held-out
    demonstrations) when the task has them."""
    if isinstance(task, EnvSuite):
        return demonstration_examples(task, tokenizer, task.eval) if task.eval is not None else []
    key = task.sft_completion_key
    if task.eval is None or not all(key in it.metadata for it in task.eval):
        return []
    return sft_examples(task.eval, tokenizer, answer_key=key)


def eval_loss(policy: Policy, examples: list[SFTExample], pad_id: int) -> float:
    """Token-mean NLL over all held-out examples (padded rows are masked out)."""
    batch = to_batch(examples, pad_id, multiple_of=policy.cfg.train_global_batch_size)
    return policy.train(batch, NLLLoss(), eval_mode=True)["loss"]


def check_lengths(examples: list[SFTExample], model: ModelConfig, tokenizer) -> None:
    """Refuse examples longer than the model's positions (they would train past its context)."""
    context = getattr(model_config(model, tokenizer), "max_position_embeddings", None)
    longest = max((len(e.prompt_token_ids) + len(e.completion_token_ids) for e in examples), default=0)
    if context is not None and longest > context:
        grow = ", or raise policy.model.tiny.max_position_embeddings" if model.name == "tiny" else ""
        raise ValueError(
            f"the longest SFT example has {longest} tokens (prompt and completion), but the model "
            f"'{model.name}' has {context} positions (max_position_embeddings). Shorten the examples "
            f"(task.prompt_format.max_prompt_tokens drops long prompts){grow}"
        )


def run_sft(cfg: SFTConfig, policy: Policy | None = None) -> dict[str, float]:
    """Train; returns the last step's metrics plus the final held-out loss. Ctrl-C stops after the current
    step by raising `RunInterrupted` (SFT writes no checkpoints: nothing is saved). A previous run in
    output_dir is refused unless `overwrite`."""
    check_fresh_output(cfg.output_dir, "sft", cfg.overwrite)
    parts = start_run(cfg.output_dir, cfg.seed, cfg.policy, cfg.task, policy, cfg.env)
    out, policy, tokenizer, task = parts.out, parts.policy, parts.tokenizer, parts.task
    if isinstance(task, EnvSuite):
        examples = demonstration_examples(task, tokenizer, task.train)
    else:
        examples = task.sft_examples
    check_lengths(examples, cfg.policy.model, tokenizer)
    start_output(out, cfg, cfg.overwrite)
    pad_id = pad_token_id(tokenizer)
    heldout = heldout_examples(task, tokenizer)
    metrics_log = open_metrics(out, cfg.logging, resume_step=None)
    progress = StepProgress(cfg.max_num_steps, "sft", ("train/loss", "val/loss"), cfg.logging.progress_bar)
    batches = example_batches(examples, cfg.policy.train_global_batch_size, cfg.seed)
    last: dict[str, float] = {}
    step, val, val_step = 0, 0.0, -1  # val: the held-out loss at val_step
    try:
        with closing_metrics(metrics_log), StopOnInterrupt("sft", saves=False) as stop:
            while step < cfg.max_num_steps and not stop.requested:
                step += 1
                t0 = time.perf_counter()
                last = policy.train(to_batch(next(batches), pad_id), NLLLoss())
                last["step_time_s"] = time.perf_counter() - t0
                metrics_log.log(last, step, prefix="train")
                shown = {f"train/{k}": v for k, v in last.items()}
                if heldout and cfg.val_period and step % cfg.val_period == 0:
                    val, val_step = eval_loss(policy, heldout, pad_id), step
                    metrics_log.log({"loss": val}, step, prefix="val")
                    shown["val/loss"] = val
                progress.update(step, shown)
            if step < cfg.max_num_steps:
                raise interrupted("sft", step, cfg.max_num_steps, None, None)
            if heldout:
                if val_step != step:  # the last step was not validated in the loop
                    val = eval_loss(policy, heldout, pad_id)
                    metrics_log.log({"loss": val}, step, prefix="val")
                last["val_loss"] = val
            if cfg.save_final_model:
                save_hf_dir(policy, out / "hf", prompt_format_record(cfg.task, cfg.env))
    finally:
        progress.close()
    return last
