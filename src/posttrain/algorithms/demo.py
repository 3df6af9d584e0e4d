"""The built-in demo: warm-start a tiny model with SFT on arithmetic, then improve it with GRPO.

Held-out accuracy is measured after the warm start (GRPO's step-0 validation) and after GRPO, greedily
on the same held-out problems (never trained on, in either stage).

Why these defaults: two-operand addition up to 19+19 (400 problems, 80 held out) is too many problems
for the tiny model to memorize, so what it learns on the training problems carries over to the held-out
ones; a short SFT leaves it at roughly 10-35% held-out accuracy, and GRPO (32 prompts x 8 samples, two
optimizer steps per GRPO step) takes it well past that within a few hundred steps. On CPU the GRPO stage
runs non-colocated: offloading the trainer buys nothing on a host and costs a `gc.collect()` per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from pydantic import Field, ValidationError, model_validator

from posttrain.algorithms.grpo import GRPOConfig, run_grpo
from posttrain.algorithms.sft import SFTConfig, run_sft
from posttrain.config import Config, validation_problems
from posttrain.logging import get_logger, read_metrics

log = get_logger(__name__)

TINY = {"family": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TASK = {"name": "arithmetic", "operations": ["+"], "max_operand": 19}


def _default_sft() -> SFTConfig:
    return SFTConfig.model_validate(
        {
            "policy": {
                "model": {"name": "tiny", "tiny": TINY},
                "train_global_batch_size": 32,
                "microbatch": {"train_micro_batch_size": 32},
                "optimizer": {"lr": 3e-3},
                "init_reference_model": False,
            },
            "task": TASK,
            "max_num_steps": 150,
            "val_period": 0,
        }
    )


def _default_grpo() -> GRPOConfig:
    return GRPOConfig.model_validate(
        {
            "policy": {
                "train_global_batch_size": 128,
                "microbatch": {"train_micro_batch_size": 128, "logprob_micro_batch_size": 256},
                "optimizer": {"lr": 1e-3},
                # in optimizer steps (two per GRPO step): warm up, hold, decay to 0.1x by GRPO step 400
                "scheduler": [
                    {"kind": "linear", "steps": 20, "start_factor": 0.05},
                    {"kind": "constant", "steps": 280},
                    {"kind": "linear", "steps": 500, "end_factor": 0.1},
                ],
                "init_reference_model": False,
            },
            "generation": {"max_num_seqs": 256},
            "sampling": {"max_new_tokens": 4, "temperature": 1.0},
            "grpo": {
                "num_prompts_per_step": 32,
                "num_generations_per_prompt": 8,
                "max_num_steps": 400,
                "val_period": 50,
            },
            "colocated": False,
            "checkpointing": {"enabled": False, "resume": "never", "overwrite": True},
        }
    )


class DemoConfig(Config):
    """The demo's two stages (the GRPO stage starts from the SFT stage's saved model)."""

    refused_keys: ClassVar[dict[str, str]] = {
        "sft.output_dir": "the demo writes its SFT stage to <output_dir>/sft; set output_dir instead",
        "sft.save_final_model": "the demo always saves the SFT stage's model (the GRPO stage starts from "
        "<output_dir>/sft/hf); remove it",
        "sft.overwrite": "the demo always starts its SFT stage over (replacing <output_dir>/sft); remove it",
        "grpo.output_dir": "the demo writes its GRPO stage to <output_dir>/grpo; set output_dir instead",
        "grpo.policy.model.name": "the demo's GRPO stage starts from the SFT stage's model "
        "(<output_dir>/sft/hf); set sft.policy.model.name to start both stages from another model",
    }

    sft: SFTConfig = Field(default_factory=_default_sft)
    grpo: GRPOConfig = Field(default_factory=_default_grpo)
    output_dir: str = Field(
        "runs/demo",
        description="the SFT stage writes to <output_dir>/sft, the GRPO stage to <output_dir>/grpo",
    )
    torch_threads: int | None = Field(
        1,
        ge=1,
        description="torch intra-op threads (None: torch's default, one per core). The demo's tiny model "
        "gains nothing from more than one; on a 2-core machine with other work running, two threads made "
        "the demo 3x slower (benchmarks/RESULTS.md)",
    )

    @model_validator(mode="after")
    def _grpo_stage_as_it_runs(self) -> DemoConfig:
        """The GRPO stage's checks on the task and environment it runs (sft's): e.g. MoE routing replay
        with an environment is refused at load, not after the SFT stage."""
        try:
            self.grpo_stage()
        except ValidationError as err:
            problems = validation_problems(err)
            raise ValueError(f"the GRPO stage (grpo.*, on sft.task and sft.env): {problems}") from None
        return self

    def grpo_stage(self, **update) -> GRPOConfig:
        """The GRPO stage as it runs: validated (not copied) on sft's task and environment, with `update`."""
        stage = {**dict(self.grpo), "task": self.sft.task, "env": self.sft.env, **update}
        return type(self.grpo).model_validate(stage)


def run_demo(cfg: DemoConfig) -> dict[str, float]:
    """Returns accuracy after SFT, after GRPO, and the gain in points. With `sft.env` set, both stages
    use that environment (SFT on its demonstrations, GRPO on its episodes; configs/demo_*.yaml)."""
    out = Path(cfg.output_dir)
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    if cfg.grpo.task != _default_grpo().task and cfg.grpo.task != cfg.sft.task:
        log.warning("demo: grpo.task is ignored; both stages use sft.task (set the task there)")
    if cfg.grpo.env is not None and cfg.grpo.env != cfg.sft.env:
        log.warning("demo: grpo.env is ignored; both stages use sft.env (set the environment there)")
    update = {"output_dir": str(out / "sft"), "save_final_model": True, "overwrite": True}
    sft = cfg.sft.model_copy(update=update)
    run_sft(sft)
    model = cfg.grpo.policy.model.model_copy(update={"name": str((out / "sft" / "hf").absolute())})
    policy = cfg.grpo.policy.model_copy(update={"model": model})
    grpo = cfg.grpo_stage(policy=policy, output_dir=str(out / "grpo"))
    run_grpo(grpo)
    records = [r for r in read_metrics(out / "grpo" / "metrics.jsonl") if "val/accuracy" in r]
    before, after = records[0]["val/accuracy"], records[-1]["val/accuracy"]
    return {"accuracy_after_sft": before, "accuracy_after_grpo": after, "gain_points": 100 * (after - before)}
