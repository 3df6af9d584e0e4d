"""A reward model as a reward source of the RL loops: it scores prompt + completion, alone or summed with
the task's rule reward (`reward = weight * rm_score + task_weight * rule_reward`).

The reward model is a scalar-head `Policy` (policy/policy.py with `model.head=score`, e.g. the hf/
directory of `posttrain rm`): its own small worker group, in the driver's process (cluster.backend=local)
or as Ray actors (cluster.backend=ray), sharded like any policy (FSDP2, tensor parallelism) and on the
same lifecycle. With `offload` it holds the device only while it scores (`prepare_for_lp_inference`,
then `offload_after_refit`), so on an accelerator generation and training get the memory back.

Tokens: when the reward model's tokenizer has the policy's vocabulary, the sampled ids are scored as
they are (the prompt's ids, then the completion's, EOS included when the sample stopped on it): the
rows `posttrain rm` trains on. Otherwise prompt and completion are decoded (without the policy's special
tokens) and re-tokenized with the reward model's tokenizer as `posttrain rm` tokenizes with its default
prompt format (its BOS first; EOS appended to completions that stopped).

A failed rule reward counts only where the rule reward counts: with `task_weight=0` it is a metric,
and the sample keeps its reward-model score.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, ValidationError, model_validator

from posttrain.config import Config
from posttrain.data.batch import batch_from_sequences
from posttrain.generation.params import GenerationResult
from posttrain.models.scalar_head import warn_if_pad_is_eos
from posttrain.models.tokenizer import pad_token_id
from posttrain.parallel.cluster import ClusterConfig
from posttrain.policy.config import ParallelConfig, PolicyConfig
from posttrain.policy.model_init import build_tokenizer
from posttrain.policy.policy import Policy
from posttrain.tasks.datasets import PromptFormatConfig, PromptItem, tokenize_prompts


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
            problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in err.errors())
            raise ValueError(f"reward_model (its cluster and parallel keys): {problems}") from None
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
        # the prompt text without the policy's special tokens, tokenized as `posttrain rm` tokenizes its
        # prompts (the reward model's own BOS first, by the default prompt format)
        texts = [dec(it.prompt_token_ids, skip_special_tokens=True) for it in items]
        prompts = tokenize_prompts(texts, self.tokenizer, PromptFormatConfig(), use_chat=False)
        completions = [
            enc(dec(r.token_ids, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
            + ([eos] if r.finish_reason == "stop" and eos is not None else [])
            for r in results
        ]
        return prompts, [c or [self.pad_id] for c in completions]

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


def combine_rewards(
    rule: torch.Tensor, rule_failed: torch.Tensor, model_scores: torch.Tensor, cfg: RewardModelConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(rewards, failed, metrics): `weight * model_scores + task_weight * rule` (a failed rule reward
    fails the sample only when task_weight is not 0); metrics reward/model and reward/rule (means over
    the samples each could score)."""
    rewards = cfg.weight * model_scores
    failed = torch.zeros_like(rule_failed)
    if cfg.task_weight != 0:
        rewards = rewards + cfg.task_weight * rule
        failed = rule_failed
    ok_rule = rule[~rule_failed]
    metrics = {
        "reward/model": float(model_scores.mean()) if len(model_scores) else float("nan"),
        "reward/rule": float(ok_rule.mean()) if len(ok_rule) else float("nan"),
    }
    return rewards, failed, metrics
