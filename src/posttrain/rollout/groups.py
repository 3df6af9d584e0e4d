"""Sampling and scoring prompt groups, the same for the synchronous and the asynchronous loop.

A group is `num_generations_per_prompt` completions of one prompt. Sample k of a group draws from the
engine's random stream k of the group's seed, so every sample is reproducible and the samples of a
group are distinct (one seed per step: sample i of the step draws stream i of the step's seed). Scoring
marks failed rewards (NaN, `failed`): they are excluded from advantages and counted, never entered as 0.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.envs.build import EnvSuite
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig, GenerationResult, SamplingParams
from posttrain.generation.sampler import derive_seed
from posttrain.generation.weight_sync import WeightSync, WeightSyncConfig
from posttrain.logging import get_logger
from posttrain.parallel.mesh import default_device
from posttrain.policy.config import ModelConfig
from posttrain.policy.model_init import model_config
from posttrain.rollout.config import GroupConfig
from posttrain.rollout.reward_model import RewardModel, combine_rewards
from posttrain.tasks.datasets import PromptItem
from posttrain.tasks.task import Task

log = get_logger(__name__)

# purpose tags: seeds derived for different purposes never coincide
_STEP, _GROUP, _VALIDATION = 1, 2, 3


def step_seed(seed: int, step: int, salt: int) -> int:
    """The seed of one synchronous step's prompt batch (`salt`: the refill attempt)."""
    return derive_seed(seed, _STEP, step, salt)


def group_seed(seed: int, prompt_id: int, weight_version: int, repeat: int = 0) -> int:
    """The seed of one asynchronous group: the same prompt at the same weights draws the same
    completions, whatever worker generates it (a retried group is drawn again identically); a prompt
    drawn again at the same weights (`repeat` > 0: a dataset smaller than the groups out at once, an
    epoch ending inside a step) draws a seed of its own, not a copy of its first group."""
    if repeat:
        return derive_seed(seed, _GROUP, prompt_id, weight_version, repeat)
    return derive_seed(seed, _GROUP, prompt_id, weight_version)


def group_streams(seed: int | list[int], groups: int, group_size: int) -> list[tuple[int, int]]:
    """Each group's (seed, first stream): one seed for all, group j from stream j * G on (a synchronous
    step's draw), or one seed per group, each from stream 0 (the asynchronous workers' draw)."""
    if isinstance(seed, int):
        return [(seed, j * group_size) for j in range(groups)]
    if len(seed) != groups:
        raise ValueError(f"got {groups} prompts but {len(seed)} group seeds")
    return [(s, 0) for s in seed]


def validation_seed(seed: int, row: int) -> int:
    """The seed of held-out row `row` (pass@k with k > 1 samples)."""
    return derive_seed(seed, _VALIDATION, row)


def engine_config(
    generation: GenerationConfig, sampling: SamplingParams, task: Task | EnvSuite
) -> GenerationConfig:
    """The engine's config as the loops use it: on the default device unless set, and a KV cache no
    longer than the longest prompt plus `max_new_tokens` (an environment's `max_tokens` per
    trajectory) unless `max_model_len` is set."""
    gen = generation
    if gen.device is None:
        gen = gen.model_copy(update={"device": str(default_device())})
    if gen.max_model_len is None and isinstance(task, EnvSuite):
        gen = gen.model_copy(update={"max_model_len": task.limits.max_tokens})
    elif gen.max_model_len is None:
        splits = [ds for ds in (task.train, task.eval) if ds is not None]
        longest = max(len(it.prompt_token_ids) for ds in splits for it in ds)
        gen = gen.model_copy(update={"max_model_len": longest + sampling.max_new_tokens})
    return gen


def check_context(
    generation: GenerationConfig,
    sampling: SamplingParams,
    task: Task | EnvSuite,
    model: ModelConfig,
    tokenizer: Any,
) -> None:
    """Refuse a run whose samples need more positions than the model has (its max_position_embeddings):
    the longest prompt plus `sampling.max_new_tokens`, or an explicit `generation.max_model_len`. An
    environment's `limits.max_tokens` caps a trajectory rather than predicting it, so there a larger
    cap is only warned about; an explicit `generation.max_model_len` below it is refused (the engine
    could not hold a trajectory the environment's limits allow)."""
    context = getattr(model_config(model, tokenizer), "max_position_embeddings", None)
    if context is None:
        return
    where = f"the model '{model.name}' has {context} (max_position_embeddings)"
    grow = ", or raise policy.model.tiny.max_position_embeddings" if model.name == "tiny" else ""
    if generation.max_model_len is not None and generation.max_model_len > context:
        raise ValueError(
            f"generation.max_model_len={generation.max_model_len} is more positions than {where}; lower it "
            f"to at most {context} or leave it unset{grow}"
        )
    short = generation.max_model_len is not None and isinstance(task, EnvSuite)
    if short and generation.max_model_len < task.limits.max_tokens:
        raise ValueError(
            f"generation.max_model_len={generation.max_model_len} is below env.limits.max_tokens="
            f"{task.limits.max_tokens}: a trajectory may grow to env.limits.max_tokens tokens, which the engine "
            "could not hold (it would fail mid-episode); raise generation.max_model_len to at least "
            f"{task.limits.max_tokens} (or leave it unset: it then follows env.limits.max_tokens), or lower "
            "env.limits.max_tokens"
        )
    if generation.max_model_len is not None:
        return
    if isinstance(task, EnvSuite):
        if task.limits.max_tokens > context:
            log.warning(
                "env.limits.max_tokens=%d is more positions than %s; a trajectory that long would run past "
                "the model's positions. Set env.limits.max_tokens<=%d",
                task.limits.max_tokens,
                where,
                context,
            )
        return
    splits = [ds for ds in (task.train, task.eval) if ds is not None]
    longest = max(len(it.prompt_token_ids) for ds in splits for it in ds)
    need = longest + sampling.max_new_tokens
    if need <= context:
        return
    fix = (
        f"Lower sampling.max_new_tokens to at most {context - longest}, or shorten the prompts"
        if longest < context
        else "Shorten the prompts"
    )
    raise ValueError(
        f"the longest prompt has {longest} tokens and sampling.max_new_tokens={sampling.max_new_tokens}: a "
        f"sample needs {need} positions, but {where}. {fix} (task.prompt_format.max_prompt_tokens="
        f"{max(context - sampling.max_new_tokens, 1)} drops longer ones){grow}"
    )


def probe_sync(cfg: WeightSyncConfig, vocab_size: int, dp_size: int) -> WeightSync:
    """The probe batch and its check, built identically on the trainer side and in every worker."""
    return WeightSync(cfg, vocab_size, dp_size=dp_size)


def sample_groups(
    engine: GenerationEngine,
    items: list[PromptItem],
    group_size: int,
    sampling: SamplingParams,
    seed: int | list[int],
) -> list[GenerationResult]:
    """`group_size` completions for each prompt, flattened in group order. One seed for the call: the
    engine gives sample i its own random stream (seed, i); one seed per group: sample k of group j
    draws stream (seed[j], k), as the asynchronous loop's workers draw a group."""
    prompts = [list(it.prompt_token_ids) for it in items for _ in range(group_size)]
    starts = group_streams(seed, len(items), group_size)
    seeded = {s: sampling.model_copy(update={"seed": s}) for s, _ in starts}  # one for a step's seed
    params = [seeded[s] for s, _ in starts for _ in range(group_size)]
    streams = [first + k for _, first in starts for k in range(group_size)]
    return engine.generate(prompts, params, streams=streams)


def decode_completions(tokenizer: Any, results: list[GenerationResult]) -> list[str]:
    """Completion texts; identical completions (frequent in a group of short answers) decoded once."""
    seen: dict[tuple[int, ...], str] = {}
    out = []
    for r in results:
        key = tuple(r.token_ids)
        if key not in seen:
            seen[key] = tokenizer.decode(r.token_ids, skip_special_tokens=True)
        out.append(seen[key])
    return out


def score(
    task: Task,
    tokenizer: Any,
    items: list[PromptItem],
    results: list[GenerationResult],
    group: GroupConfig,
    max_new_tokens: int,
    reward_model: RewardModel | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Rewards and failure flags of `results` (`group.num_generations_per_prompt` per item, in group
    order): failed rewards are NaN and flagged, never zeroed; with a `reward_model`, its scores weighted
    and summed with the task's (rollout/reward_model.py); with DAPO overlong shaping."""
    g = group.num_generations_per_prompt
    flat = [it for it in items for _ in range(g)]
    texts = decode_completions(tokenizer, results)
    res = task.reward([it.prompt for it in flat], texts, [it.metadata for it in flat])
    rewards = torch.tensor(
        [float("nan") if f else r for r, f in zip(res.rewards, res.failed)], dtype=torch.float32
    )
    failed = torch.tensor(res.failed, dtype=torch.bool)
    summary = res.summary()
    if reward_model is not None:
        scores = reward_model.score(flat, results)
        rewards, failed, parts = combine_rewards(rewards, failed, scores, reward_model.cfg)
        summary.update(parts)
        counted = float((failed | torch.tensor(res.failed, dtype=torch.bool)).sum())  # rule failures too
        summary.update(reward_failed=counted, reward_failed_fraction=counted / max(len(failed), 1))
    if group.overlong_reward_shaping:
        lengths = torch.tensor([len(r.token_ids) for r in results], dtype=torch.float32)
        over = (lengths - (max_new_tokens - group.overlong_buffer_length)).clamp(min=0)
        over = over / group.overlong_buffer_length
        rewards = rewards - group.overlong_penalty * over.clamp(max=1.0)
    return rewards, failed, summary
