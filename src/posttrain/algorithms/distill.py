"""On-policy distillation, synchronous: the GRPO step (grpo.py: generate, score, batch, logprobs, train,
sync) with the logprob phase extended by the teacher's logprobs and the distillation advantages
(distill_core.py has the method, and the asynchronous loop's use of it)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator
from tensordict import TensorDict

from posttrain.algorithms import grpo
from posttrain.algorithms.distill_core import DistillSettings, teacher_advantages, topk_reverse_kl
from posttrain.algorithms.distill_teacher import TeacherPolicy, check_same_vocabulary, teacher_config
from posttrain.algorithms.grpo_config import DISTILLATION_LEARNS_FROM_EVERY_GROUP, refuse_dynamic_sampling
from posttrain.logging import get_logger
from posttrain.policy.policy import Policy

__all__ = ["DistillConfig", "DistillSettings", "add_distill_logprobs", "run_distill", "topk_reverse_kl"]

log = get_logger(__name__)


class DistillConfig(grpo.GRPOConfig):
    """An on-policy distillation run: a synchronous GRPO run whose advantages come from a teacher."""

    algorithm: ClassVar[str] = "distill"

    distill: DistillSettings = Field(default_factory=DistillSettings)
    output_dir: str = Field(
        "runs/distill", description="metrics.jsonl, curves.png, config.yaml and checkpoints/ go here"
    )

    def group_baseline_weight(self) -> float:
        return self.distill.reward_weight  # the teacher's KL needs no group; the task's advantage does

    @model_validator(mode="after")
    def _check_distill(self) -> DistillConfig:
        refuse_dynamic_sampling(self.grpo, DISTILLATION_LEARNS_FROM_EVERY_GROUP)
        distill = self.distill.for_student(self.policy, self.sampling.temperature)
        if distill is not self.distill:
            self.distill = distill
        return self


# --------------------------------------------------------------------------- the loop


def run_distill(cfg: DistillConfig, policy: Policy | None = None, teacher: TeacherPolicy | None = None):
    """Distil the teacher into the student (`cfg.policy`); returns the final metrics (with the last
    held-out validation). The GRPO loop runs it, with `distill_step` as its step."""
    if teacher is None:
        check_same_vocabulary(cfg.policy, cfg.distill.teacher, cfg.distill.top_k)
    own = teacher is None
    teacher = teacher or TeacherPolicy(teacher_config(cfg.distill.teacher))
    try:
        return grpo.run_grpo(cfg, policy, step_fn=lambda run: distill_step(run, teacher, cfg.distill))
    finally:
        if own:
            teacher.shutdown()


def distill_step(run: grpo.Run, teacher: TeacherPolicy, settings: DistillSettings) -> dict[str, float]:
    """One step: generate -> score -> batch -> student and teacher logprobs -> advantages -> train -> sync."""
    metrics: dict[str, float] = {}

    def logprobs(r: grpo.Run, batch: TensorDict) -> None:
        metrics.update(add_distill_logprobs(r, teacher, settings, batch))

    return {**grpo.grpo_step(run, logprobs_fn=logprobs), **metrics}


def add_distill_logprobs(
    run: grpo.Run, teacher: TeacherPolicy, settings: DistillSettings, batch: TensorDict
) -> dict[str, float]:
    """The GRPO logprobs (prev, reference), then the teacher's, then the distillation advantages."""
    grpo.add_logprobs(run, batch)  # prev (unless on-policy by construction) and reference logprobs
    on_policy = grpo.skips_prev_logprobs(run.cfg)
    student = run.policy.get_logprobs(batch) if on_policy else batch["prev_logprobs"]
    return teacher_advantages(run.policy, teacher, settings, batch, student, grpo.time_shares_device(run))
