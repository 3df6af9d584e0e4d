"""Preference pairs for DPO: a prompt with a chosen and a rejected completion, as token ids.

Sources: a local file or saved dataset (`.jsonl`, `.json`, `.parquet`, a `datasets.save_to_disk`
directory; tasks/sources.py `load_rows`) with a prompt, a chosen and a rejected text per row, or the
built-in arithmetic pairs (the correct answer against a wrong one), which need no file. Prompts are
formatted and length-limited like every task's (chat template when the tokenizer has one;
`prompt_format.max_prompt_tokens` and `overlong_prompts`); completions are the texts as written plus EOS.
Every row is checked up front: a bad row is a ValueError naming its index and field. Held-out pairs
(`eval_fraction`) are whole prompts: a prompt's pairs are all trained on or all held out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from posttrain.config import Config
from posttrain.tasks.arithmetic import ArithmeticTaskConfig, build_arithmetic_task
from posttrain.tasks.datasets import (
    PromptFormatConfig,
    fitting_prompts,
    format_prompt,
    hold_out_groups,
    tokenize_prompts,
    uses_chat_template,
)
from posttrain.tasks.sources import load_rows


@dataclass
class PreferencePair:
    prompt_token_ids: list[int]
    chosen_token_ids: list[int]  # ends with EOS
    rejected_token_ids: list[int]  # ends with EOS


class PreferenceDataConfig(Config):
    """Where the pairs come from."""

    path: str | None = Field(
        None, description="pairs file or saved dataset (.jsonl/.json/.parquet/dir); None: built-in arithmetic"
    )
    eval_path: str | None = Field(None, description="held-out pairs (default: eval_fraction of `path`)")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="share of `path` held out when no eval_path")
    split: str | None = Field(None, description="split of a saved DatasetDict")
    prompt_key: str = Field("prompt", description="column of the prompt text")
    chosen_key: str = Field("chosen", description="column of the preferred completion")
    rejected_key: str = Field("rejected", description="column of the dispreferred completion")
    prompt_format: PromptFormatConfig = Field(default_factory=PromptFormatConfig)
    arithmetic: ArithmeticTaskConfig = Field(
        default_factory=ArithmeticTaskConfig,
        description="the built-in pairs (path: None): a problem's correct answer is chosen, a wrong one rejected",
    )
    wrong_per_problem: int = Field(
        1,
        ge=1,
        le=10,
        description="built-in pairs: pairs per problem (train and held out), each drawing a wrong answer",
    )
    seed: int = Field(0, description="seed of the held-out split and of the built-in wrong answers")


def pairs_prompt_format(cfg: PreferenceDataConfig) -> PromptFormatConfig:
    """The prompt format the pairs' prompts are given: the built-in arithmetic task's without `path`,
    else `prompt_format`."""
    return cfg.arithmetic.prompt_format if cfg.path is None else cfg.prompt_format


def _text(row: Any, index: int, cfg: PreferenceDataConfig, field: str, source: str) -> str:
    key = getattr(cfg, field)
    if not isinstance(row, dict) or key not in row:
        raise ValueError(
            f"{source}: row {index} has no '{key}' field; name the column with data.{field}=COLUMN"
        )
    value = row[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{source}: row {index} field '{key}' must be a non-empty string, got {value!r}")
    return value


def _columns(rows: list[Any], cfg: PreferenceDataConfig, source: str) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) of every row, each checked."""
    keys = ("prompt_key", "chosen_key", "rejected_key")
    return [tuple(_text(row, i, cfg, key, source) for key in keys) for i, row in enumerate(rows)]


def _pairs(
    rows: list[tuple[str, str, str]], ids: list[int], cfg: PreferenceDataConfig, tokenizer: Any, name: str
) -> list[PreferencePair]:
    """Tokenized pairs of `rows` (file rows `ids`), prompts formatted and length-limited as a prompt
    dataset's are (prompt_format.max_prompt_tokens, overlong_prompts)."""
    fmt = cfg.prompt_format
    use_chat = uses_chat_template(tokenizer, fmt)
    texts = [format_prompt(prompt, tokenizer, fmt, use_chat) for prompt, _, _ in rows]
    prompt_ids = tokenize_prompts(texts, tokenizer, fmt, use_chat)
    keep = fitting_prompts([len(x) for x in prompt_ids], ids, fmt, name)
    return _tokenized(
        [prompt_ids[i] for i in keep], [rows[i][1] for i in keep], [rows[i][2] for i in keep], tokenizer
    )


def _tokenized(prompt_ids: list[list[int]], chosen: list[str], rejected: list[str], tokenizer: Any):
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("DPO needs a tokenizer with an EOS token (completions end with EOS)")
    enc = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []  # noqa: E731
    return [
        PreferencePair(list(p), [*c, eos], [*r, eos])
        for p, c, r in zip(prompt_ids, enc(chosen), enc(rejected))
    ]


def arithmetic_pairs(cfg: PreferenceDataConfig, tokenizer: Any):
    """(train, eval) pairs of the arithmetic task: the correct answer against a wrong one, off by 1-5
    (`wrong_per_problem` of them per problem)."""
    task = build_arithmetic_task(cfg.arithmetic, tokenizer)
    rng = random.Random(cfg.seed)

    def pairs(items, k: int) -> list[PreferencePair]:
        items = [it for it in items for _ in range(k)]  # k pairs per problem, each drawing its wrong answer
        answers = [int(it.metadata["answer"]) for it in items]
        wrong = [a + rng.choice([-5, -4, -3, -2, -1, 1, 2, 3, 4, 5]) for a in answers]
        return _tokenized(
            [it.prompt_token_ids for it in items], list(map(str, answers)), list(map(str, wrong)), tokenizer
        )

    held = task.eval.items if task.eval is not None else []
    return pairs(task.train.items, cfg.wrong_per_problem), pairs(held, cfg.wrong_per_problem)


def build_pairs(
    cfg: PreferenceDataConfig, tokenizer: Any
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) pairs. Without eval_path, eval_fraction of the rows is held out whole prompts at
    a time (every pair of a prompt lands on one side), by a seeded shuffle."""
    if cfg.path is None:
        return arithmetic_pairs(cfg, tokenizer)
    rows = _columns(load_rows(cfg.path, cfg.split), cfg, cfg.path)
    if not rows:
        raise ValueError(f"{cfg.path} holds no preference pairs")
    if cfg.eval_path is not None:
        held_rows = _columns(load_rows(cfg.eval_path, cfg.split), cfg, cfg.eval_path)
        train = _pairs(rows, list(range(len(rows))), cfg, tokenizer, "train pair")
        return train, _pairs(held_rows, list(range(len(held_rows))), cfg, tokenizer, "held-out pair")
    order = list(range(len(rows)))
    random.Random(cfg.seed).shuffle(order)
    held = hold_out_groups([prompt for prompt, _, _ in rows], order, int(len(rows) * cfg.eval_fraction))
    if len(held) == len(rows):
        raise ValueError(
            f"data.eval_fraction={cfg.eval_fraction} holds out every prompt of {cfg.path} (each prompt's "
            "pairs stay on one side); lower it, add prompts, or set data.eval_path"
        )
    train_ids = [i for i in range(len(rows)) if i not in held]
    held_ids = sorted(held)
    return (
        _pairs([rows[i] for i in train_ids], train_ids, cfg, tokenizer, "train pair"),
        _pairs([rows[i] for i in held_ids], held_ids, cfg, tokenizer, "held-out pair"),
    )
