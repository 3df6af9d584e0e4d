"""On-policy distillation: the student samples, a teacher scores the student's tokens, and the student is
trained with the per-token reverse KL as its advantage (Thinking Machines' on-policy distillation; GKD
with reverse KL, in its policy-gradient form).

In both loops (distill.py: synchronous; async_grpo/: the trainer's chunks) the student's and the teacher's
logprobs of the sampled tokens give each token the advantage

    A_t = -kl_coef * (log pi_student(y_t) - log pi_teacher(y_t)) + reward_weight * A_task

(A_task: the GRPO group advantage of the task reward; 0 weight by default), and the clipped
policy-gradient loss trains on it. Each token is credited with its own log-ratio only (no sum over
later tokens, "discount 0", as Thinking Machines do); its expectation under the student is the
per-token reverse KL KL(pi_student || pi_teacher) at that position.

Top-k variant (`distill.top_k`): at every position, the student's top-k token ids S_t (the student's
`get_topk_logits`) and both models' logits at those ids (the teacher's `get_logits_at`) give the
reverse KL between the two distributions renormalized over S_t,

    KL_k(t) = sum_{v in S_t} q_s(v) (log q_s(v) - log q_t(v)),   q = softmax of the logits over S_t,

exactly (no sampling). The loss sees only the sampled token's logprob, so a term that does not depend
on y_t can only enter the gradient as a baseline: KL_k(t) is the student's expected log-ratio at t
(exactly so as k reaches the vocabulary), the baseline that centres the sampled log-ratio, so
A_t = -kl_coef * (log-ratio_t - KL_k(t)) keeps the estimator unbiased and lowers its variance.
`distill/topk_kl` reports KL_k.

Teacher logprobs are computed on the trainer side, like reference logprobs; the teacher is never
trained (its own `Policy`, distill_teacher.py) and must share the student's vocabulary.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from tensordict import TensorDict

from posttrain.algorithms.losses import token_weights
from posttrain.config import Config
from posttrain.policy.config import PolicyConfig


class DistillSettings(Config):
    """The `distill:` section: the teacher and how its logprobs shape the advantages."""

    teacher: PolicyConfig = Field(
        default_factory=lambda: PolicyConfig(init_reference_model=False),
        description="the teacher's model, precision, micro-batching and parallel layout (cluster); "
        "inference only: its optimizer settings are unused. It must use the student's tokenizer",
    )
    kl_coef: float = Field(1.0, gt=0, description="weight of the per-token reverse KL advantage")
    reward_weight: float = Field(
        0.0, ge=0, description="weight of the task reward's GRPO group advantage added to it (0 = pure KL)"
    )
    top_k: int | None = Field(
        None,
        ge=1,
        description="also compute the exact reverse KL over the student's top-k tokens (both models "
        "renormalized over them) and use it as each token's baseline; None: sampled tokens only",
    )

    @model_validator(mode="after")
    def _teacher_routes_itself(self) -> DistillSettings:
        self.teacher.check_routes_itself("distill.teacher", "student")
        return self

    def for_student(self, student: PolicyConfig, temperature: float) -> DistillSettings:
        """These settings for a run of `student` sampling at `temperature` (self when nothing changes):
        a student of its own with the default teacher (a random tiny model: the section was most likely
        forgotten) is refused; the teacher scores at the sampling temperature (an unset
        distill.teacher.logprob_temperature takes it, another value is refused): the reverse KL compares
        the two models' distributions at one temperature, as TRL's GKD divides both models' logits by one."""
        if self.teacher.model.name == "tiny" and student.model.name != "tiny":
            raise ValueError(
                f"distill.teacher.model.name is unset: the student is {student.model.name!r} and the teacher "
                "would be a random tiny model. Set distill.teacher.model.name to the teacher's hub name or "
                "directory (it must share the student's tokenizer)"
            )
        if self.teacher.scoring_temperature == temperature:
            return self
        teacher = self.teacher.scoring_at(
            temperature, "distill.teacher.logprob_temperature", "sampling.temperature"
        )
        return self.model_copy(update={"teacher": teacher})


def teacher_advantages(
    student_policy,
    teacher,
    settings: DistillSettings,
    batch: TensorDict,
    student: torch.Tensor,
    offload: bool,
) -> dict[str, float]:
    """The teacher's logprobs of the batch (and, with top_k, both models' top-k logits), then the batch's
    advantages replaced by the distillation advantages; `student`: the student's logprobs at the weights
    being trained. `offload`: give the device back afterwards (trainer and engine take turns on it).
    Returns the step's distillation metrics."""
    teacher.prepare_for_lp_inference()
    teacher_lp = teacher.get_logprobs(batch)
    topk = None
    if settings.top_k is not None:
        s_vals, s_ids = student_policy.get_topk_logits(batch, settings.top_k)
        topk = topk_reverse_kl(s_vals, teacher.get_logits_at(batch, s_ids))
    if offload:
        teacher.offload_after_refit()  # the device goes back to the engine and the student
    task_adv = batch["advantages"]
    batch["advantages"] = distill_advantages(
        student, teacher_lp, batch, settings.kl_coef, settings.reward_weight, task_adv, topk
    )
    return distill_metrics(student, teacher_lp, batch, topk)


def reverse_kl_advantages(
    student: torch.Tensor,
    teacher: torch.Tensor,
    token_mask: torch.Tensor,
    baseline: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T] per-token advantage -(log pi_student(y_t) - log pi_teacher(y_t) - baseline_t) on the trained
    tokens (0 elsewhere)."""
    log_ratio = student.float() - teacher.float()
    if baseline is not None:
        log_ratio = log_ratio - baseline.float()
    return -log_ratio * token_mask.float()


def distill_advantages(
    student: torch.Tensor,
    teacher: torch.Tensor,
    batch: TensorDict,
    kl_coef: float,
    reward_weight: float,
    task_advantages: torch.Tensor,
    topk_kl: torch.Tensor | None = None,
) -> torch.Tensor:
    """kl_coef x the reverse-KL advantage (with the top-k KL as baseline when given) + reward_weight x the
    task's group advantage."""
    kl_adv = reverse_kl_advantages(student, teacher, batch["token_mask"], topk_kl)
    return kl_coef * kl_adv + reward_weight * task_advantages.float()


def topk_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """[B, T] KL(q_s || q_t) where q_s, q_t are the softmax of the student's and the teacher's logits
    [B, T, k] at the same k ids (the student's top-k): both distributions renormalized over those ids."""
    log_qs = torch.log_softmax(student_logits.double(), dim=-1)
    log_qt = torch.log_softmax(teacher_logits.double(), dim=-1)
    return (log_qs.exp() * (log_qs - log_qt)).sum(-1).float()


def distill_metrics(
    student: torch.Tensor, teacher: torch.Tensor, batch: TensorDict, topk_kl: torch.Tensor | None
) -> dict[str, float]:
    """Means over the step's trained tokens: the sampled reverse KL estimate, both logprobs, top-k KL."""
    mask = token_weights(batch)
    n = mask.sum().clamp(min=1)

    def mean(values: torch.Tensor) -> float:
        return float((values.float() * mask).sum() / n)

    out = {
        "distill/reverse_kl": mean(student - teacher),
        "distill/student_logprob": mean(student),
        "distill/teacher_logprob": mean(teacher),
    }
    if topk_kl is not None:
        out["distill/topk_kl"] = mean(topk_kl)
    return out
