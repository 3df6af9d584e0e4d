"""Held-out validation: greedy accuracy (k=1) or pass@k over the task's eval prompts, for both loops."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import SamplingParams
from posttrain.rollout.config import GroupConfig
from posttrain.rollout.groups import decode_completions, validation_seed
from posttrain.tasks.task import Task


def validate(
    engine: GenerationEngine, task: Task, tokenizer: Any, sampling: SamplingParams, group: GroupConfig
) -> dict[str, float]:
    """Held-out accuracy (greedy when k=1) and pass@k over the eval prompts (a failed reward counts as
    wrong here, and is counted in `val/reward_failed`)."""
    items = task.eval.items[: group.val_max_prompts]
    k = group.val_num_generations
    prompts = [list(it.prompt_token_ids) for it in items for _ in range(k)]
    params = [
        sampling.model_copy(update={"greedy": k == 1, "seed": validation_seed(group.seed, i)})
        for i in range(len(prompts))
    ]
    results = engine.generate(prompts, params)
    texts = decode_completions(tokenizer, results)
    flat = [it for it in items for _ in range(k)]
    res = task.reward([it.prompt for it in flat], texts, [it.metadata for it in flat])
    correct = torch.tensor([(r if not f else 0.0) >= 1.0 for r, f in zip(res.rewards, res.failed)]).view(
        len(items), k
    )
    out = {"val/accuracy": float(correct.float().mean()), "val/reward_failed": float(res.num_failed)}
    if k > 1:
        out[f"val/pass@{k}"] = float(correct.any(dim=1).float().mean())
    return out
