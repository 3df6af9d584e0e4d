"""A reward model as a reward source of the RL loops: it scores prompt + completion, alone or summed with
the task's rule reward (`reward = weight * rm_score + task_weight * rule_reward`).

The reward model is a scalar-head `Policy` (policy/policy.py with `model.head=score`, e.g. the hf/
directory of `posttrain rm`): its own small worker group, in the driver's process (cluster.backend=local)
or as Ray actors (cluster.backend=ray), sharded like any policy (FSDP2, tensor parallelism) and on the
same lifecycle. With `offload` it holds the device only while it scores (`prepare_for_lp_inference`,
then `offload_after_refit`), so on an accelerator generation and training get the memory back.

Tokens: when the reward model's tokenizer has the policy's vocabulary, the sampled ids are scored as
they are (the prompt's ids, then the completion's, EOS included when the sample stopped on it): the
rows `posttrain rm` trains on. Otherwise the rows are built as `posttrain rm` builds them for the
reward model's tokenizer with its default prompt format: a dataset task's raw problem
(`metadata['problem']`, not the policy's templated prompt) in the reward model's own chat template when
it has one, its BOS first (`rm_prompts`); the completion decoded without the policy's special tokens and
re-tokenized, EOS appended when the sample stopped on a token (an EOS or a stop_token_ids id: sampled, as
in the same-vocabulary rows), not on a stop string or the length limit.

A failed rule reward counts only where the rule reward counts: with `task_weight=0` it is a metric,
and the sample keeps its reward-model score. A score that is not finite fails its sample (reward NaN,
counted in reward_failed), never a 0.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, ValidationError, model_validator

from posttrain.config import Config, validation_problems
from posttrain.data.batch import batch_from_sequences
from posttrain.generation.params import GenerationResult
from posttrain.logging import get_logger
from posttrain.models.scalar_head import warn_if_pad_is_eos
from posttrain.models.tokenizer import pad_token_id
from posttrain.parallel.cluster import ClusterConfig
from posttrain.policy.config import ParallelConfig, PolicyConfig
from posttrain.policy.model_init import build_tokenizer
from posttrain.policy.policy import Policy
from posttrain.tasks.datasets import (
    PromptFormatConfig,
    PromptItem,
    format_prompt,
    tokenize_prompts,
    uses_chat_template,
)

log = get_logger(__name__)


class RewardModelConfig(Config):
    """A reward model that scores each completion (see the module docstring)."""

    path: str = Field(
        description="a sequence-classification model with one output: an HF directory (`posttrain rm`'s "
        "<output_dir>/hf) or hub name"
    )
    tokenizer: str | None = Field(None, description="its tokenizer (default: the one in `path`)")
    weight: float = Field(1.0, description="weight of the reward model's score in the reward")
    task_weight: float = Field(
        0.0,
        description="weight of the task's rule reward in the reward (0: the reward model alone; the rule "
        "reward is still logged as reward/rule)",
    )
    batch_size: int = Field(64, ge=1, description="rows per forward of the reward model (per rank)")
    precision: Literal["float32", "bfloat16", "float16"] = Field("float32", description="compute dtype")
    offload: bool = Field(
        True, description="keep the reward model off the accelerator between scoring calls (on a CPU: no-op)"
    )
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _check(self) -> RewardModelConfig:
        """What the scalar-head policy that runs it would refuse (when the run builds it, after the
        trainer), refused at load naming this section's keys."""
        workers, cp = self.cluster.num_workers, self.parallel.context_parallel_size
        if self.cluster.backend == "local" and workers != 1:
            raise ValueError(
                f"reward_model.cluster.num_workers={workers} needs reward_model.cluster.backend='ray'; "
                "the local backend runs one rank"
            )
        if cp > 1:
            raise ValueError(
                f"reward_model.parallel.context_parallel_size={cp}: context parallelism is not implemented "
                "for scalar heads (a reward model) yet; use reward_model.parallel.context_parallel_size=1"
            )
        try:
            self.policy_config()
        except ValidationError as err:
            raise ValueError(
                f"reward_model (its cluster and parallel keys): {validation_problems(err)}"
            ) from None
        return self

    def policy_config(self) -> PolicyConfig:
        """The scalar-head policy that runs it (inference only: no reference weights)."""
        return PolicyConfig(
            model={"name": self.path, "tokenizer": self.tokenizer, "head": "score"},
            precision=self.precision,
            microbatch={"logprob_micro_batch_size": self.batch_size},
            train_global_batch_size=self.cluster.num_workers,
            init_reference_model=False,
            parallel=self.parallel,
            cluster=self.cluster,
        )


class RewardModel:
    """Scores (prompt, completion) rows with a scalar-head Policy; see the module docstring."""

    def __init__(self, cfg: RewardModelConfig, policy_tokenizer: Any) -> None:
        self.cfg = cfg
        pcfg = cfg.policy_config()
        self.tokenizer = build_tokenizer(pcfg.model)
        self.policy_tokenizer = policy_tokenizer
        self.same_vocab = self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        self.pad_id = pad_token_id(self.tokenizer)
        warn_if_pad_is_eos(self.tokenizer, "reward model scoring")
        self.policy = Policy(pcfg)
        self._park()

    def _park(self) -> None:
        if self.cfg.offload:
            self.policy.offload_after_refit()

    def _rows(self, items: list[PromptItem], results: list[GenerationResult]):
        """(prompt ids, completion ids) in the reward model's vocabulary."""
        if self.same_vocab:
            return [list(it.prompt_token_ids) for it in items], [list(r.token_ids) for r in results]
        dec, enc = self.policy_tokenizer.decode, self.tokenizer
        eos = self.tokenizer.eos_token_id
        completions = [
            enc(dec(r.token_ids, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
            + ([eos] if _stopped_on_a_token(r) and eos is not None else [])
            for r in results
        ]
        return rm_prompts(items, self.tokenizer, self.policy_tokenizer), [
            c or [self.pad_id] for c in completions
        ]

    def score(self, items: list[PromptItem], results: list[GenerationResult]) -> torch.Tensor:
        """[N] the reward model's score of each (item, result) row, in order."""
        prompts, completions = self._rows(items, results)
        dp = self.policy.dims.dp
        chunk = self.cfg.batch_size * dp
        self.policy.prepare_for_lp_inference()
        out = []
        try:
            for start in range(0, len(prompts), chunk):
                p, c = prompts[start : start + chunk], completions[start : start + chunk]
                pad = -len(p) % dp  # whole shards: masked copies of the first row
                batch = batch_from_sequences(p + p[:1] * pad, c + c[:1] * pad, self.pad_id)
                out.append(self.policy.score(batch)[: len(p)])
        finally:
            self._park()
        return torch.cat(out) if out else torch.zeros(0)

    def shutdown(self) -> None:
        self.policy.shutdown()


def rm_prompts(items: list[PromptItem], tokenizer: Any, policy_tokenizer: Any) -> list[list[int]]:
    """Each item's prompt in the reward model's `tokenizer` (another vocabulary than the policy's), as
    `posttrain rm` formats a pair's prompt with its default prompt format: the raw problem
    (`metadata['problem']`, a dataset task's prompt before the policy's template) in the reward model's
    own chat template when it has one (chat_template=auto), its BOS first. An item without one (the
    built-in arithmetic task, whose pairs `posttrain rm` takes already formatted, plain) is the policy's
    prompt text without its special tokens, plain."""
    fmt = PromptFormatConfig()
    use_chat = uses_chat_template(tokenizer, fmt)
    texts, chat = [], []
    for it in items:
        problem = it.metadata.get("problem")
        if isinstance(problem, str):
            texts.append(format_prompt(problem, tokenizer, fmt, use_chat))
            chat.append(use_chat)
        else:
            texts.append(policy_tokenizer.decode(it.prompt_token_ids, skip_special_tokens=True))
            chat.append(False)
    out: list[list[int]] = [[] for _ in items]
    for flag in (True, False):
        rows = [i for i, c in enumerate(chat) if c == flag]
        for i, ids in zip(rows, tokenize_prompts([texts[i] for i in rows], tokenizer, fmt, flag)):
            out[i] = ids
    return out


def combine_rewards(
    rule: torch.Tensor, rule_failed: torch.Tensor, model_scores: torch.Tensor, cfg: RewardModelConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(rewards, failed, metrics): `weight * model_scores + task_weight * rule`. A failed rule reward
    fails the sample only when task_weight is not 0, a score that is not finite (NaN, inf) only when
    weight is not 0; a failed sample's reward is NaN, never a 0. Metrics: reward/model and reward/rule
    (means over the samples each could score) and reward/model_failed (scores not finite)."""
    model_bad = ~torch.isfinite(model_scores)
    rewards = cfg.weight * torch.where(model_bad, 0.0, model_scores)
    failed = model_bad if cfg.weight != 0 else torch.zeros_like(rule_failed)
    if cfg.task_weight != 0:
        rewards = rewards + cfg.task_weight * torch.where(rule_failed, 0.0, rule)
        failed = failed | rule_failed
    rewards = torch.where(failed, float("nan"), rewards)
    if model_bad.any():
        log.warning(
            "reward model: %d of %d scores are not finite (NaN or inf)%s",
            int(model_bad.sum()),
            len(model_scores),
            "; those samples are marked failed" if cfg.weight != 0 else " (reward_model.weight=0: unused)",
        )
    ok_rule, ok_model = rule[~rule_failed], model_scores[~model_bad]
    metrics = {
        "reward/model": float(ok_model.mean()) if len(ok_model) else float("nan"),
        "reward/rule": float(ok_rule.mean()) if len(ok_rule) else float("nan"),
        "reward/model_failed": float(model_bad.sum()),
    }
    return rewards, failed, metrics


def _stopped_on_a_token(result: GenerationResult) -> bool:
    """Whether the sample ended on a stop token it drew (an EOS or a stop_token_ids id), which the
    same-vocabulary rows keep as its last token; a stop string (`stop_reason` a str) ends a sample
    without one."""
    return result.finish_reason == "stop" and not isinstance(result.stop_reason, str)
