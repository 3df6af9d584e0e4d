"""On-policy distillation in the asynchronous loop (`distill:` of `posttrain grpo-async`): each trained
chunk's advantages are the reverse-KL advantages of distill_core.py, from the teacher's and the student's
logprobs at the open step's weights (equal to full forwards, 1e-5); a run trains the student, never the
teacher, and logs the distillation metrics every step; bad settings are refused."""

from __future__ import annotations

import pytest
import torch

from helpers import params_of, small_async_grpo_cfg
from posttrain.algorithms import grpo
from posttrain.algorithms.async_grpo.run import distill_shape, run_async_grpo
from posttrain.algorithms.distill_teacher import TeacherPolicy, teacher_config
from posttrain.config import ConfigError
from posttrain.logging import read_metrics
from posttrain.policy.policy import Policy
from test_distill import TEACHER_TINY, direct_logits, distill_cfg, sampled_logprobs

TEACHER = [f"distill.teacher.model.tiny.{k}={v}" for k, v in TEACHER_TINY.items()]


def async_distill_cfg(out, *overrides: str):
    return small_async_grpo_cfg(
        out,
        *TEACHER,
        "distill.teacher.model.seed=1",
        "distill.kl_coef=0.7",
        "async_grpo.max_staleness=0",
        "checkpointing.enabled=false",
        "checkpointing.resume=never",
        *overrides,
    )


@pytest.mark.parametrize("skip_prev", [True, False])
def test_a_chunks_advantages_equal_full_forwards(tmp_path, skip_prev):
    """distill_shape on a batch: A_t = -kl_coef (log pi_s(y_t) - log pi_t(y_t)) on the trained tokens."""
    cfg = distill_cfg(tmp_path)
    run = grpo.setup(cfg, None)
    batch, _ = grpo.build_batch(run, grpo.generate(run))
    if not skip_prev:
        batch["prev_logprobs"] = run.policy.get_logprobs(batch)
    teacher = TeacherPolicy(teacher_config(cfg.distill.teacher))
    settings = cfg.distill.model_copy(update={"reward_weight": 0.0})
    metrics = distill_shape(run.policy, teacher, settings, skip_prev)(batch)
    student = sampled_logprobs(direct_logits(cfg, cfg.policy.model, batch), batch)
    teacher_lp = sampled_logprobs(direct_logits(cfg, cfg.distill.teacher.model, batch), batch)
    mask = batch["token_mask"]
    assert mask.sum() > 0
    torch.testing.assert_close(batch["advantages"], -0.7 * (student - teacher_lp) * mask, rtol=0, atol=1e-5)
    assert metrics["distill/reverse_kl"] != 0
    teacher.shutdown()
    run.policy.shutdown()


def test_an_async_distillation_run_trains_the_student_and_logs_the_kl(tmp_path):
    cfg = async_distill_cfg(tmp_path)
    policy = Policy(cfg.policy)
    before = params_of(policy)
    run_async_grpo(cfg, policy)
    after = params_of(policy)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 4
    for r in steps:  # every step's chunks were distilled: the student's and teacher's logprobs differ
        assert r["distill/reverse_kl"] != 0 and r["distill/teacher_logprob"] < 0
    policy.shutdown()


def test_async_distillation_takes_groups_of_one_unless_the_task_reward_is_on(tmp_path):
    assert (
        async_distill_cfg(tmp_path, "grpo.num_generations_per_prompt=1").grpo.num_generations_per_prompt == 1
    )
    with pytest.raises(ConfigError, match="a group of 1 cannot train"):
        async_distill_cfg(tmp_path, "grpo.num_generations_per_prompt=1", "distill.reward_weight=0.5")
    with pytest.raises(ConfigError, match="a group of 1 cannot train"):
        small_async_grpo_cfg(tmp_path, "grpo.num_generations_per_prompt=1")


def test_async_distillation_refuses_dynamic_sampling_and_a_foreign_teacher(tmp_path):
    with pytest.raises(ConfigError, match="grpo.dynamic_sampling=false"):
        async_distill_cfg(tmp_path, "grpo.dynamic_sampling=true")
    cfg = async_distill_cfg(tmp_path / "run", "distill.teacher.model.tokenizer=tiny-chat")
    with pytest.raises(ValueError, match="distillation needs one vocabulary"):
        run_async_grpo(cfg)
