"""Prompt datasets (tasks/datasets.py): numeric gold answers as positional text, held-out prompts kept
whole (duplicates never straddle train and eval; without duplicates the split is the seeded permutation's
first rows, as before), eval_split read from train_path's DatasetDict, settings that conflict or would
overwrite the gold refused, and a system prompt no chat template can carry warned about."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from pydantic import ValidationError

from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.tasks import DatasetConfig, MathTaskConfig, PromptFormatConfig, build_splits, build_task
from posttrain.tasks import datasets as datasets_module
from posttrain.tasks.datasets import SourcePrompt, build_prompt_dataset, split_holdout


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


PLAIN = PromptFormatConfig(chat_template="never")


def test_numeric_gold_answers_are_written_positionally_and_score(tmp_path, tok):
    """JSON numbers 5e-05 and 1e16 were str()'d to '5e-05' / '1e+16', which math-verify reads as
    5*E - 5: a right answer scored 0."""
    pytest.importorskip("math_verify")
    rows = [
        {"problem": "rate?", "answer": 0.00005},
        {"problem": "big?", "answer": 1e16},
        {"problem": "whole?", "answer": 72.0},
        {"problem": "half?", "answer": 0.5},
        {"problem": "int?", "answer": 3},
        {"problem": "neg?", "answer": -2.5e-7},
    ]
    task = build_task(MathTaskConfig(dataset={"train_path": write_jsonl(tmp_path / "m.jsonl", rows)}), tok)
    golds = {it.metadata["problem"]: it.metadata["answer"] for it in task.train}
    assert golds == {
        "rate?": "0.00005",
        "big?": "10000000000000000",
        "whole?": "72",
        "half?": "0.5",
        "int?": "3",
        "neg?": "-0.00000025",
    }
    items = sorted(task.train, key=lambda it: it.prompt_id)
    completions = [
        "\\boxed{0.00005}",
        "\\boxed{10000000000000000}",
        "\\boxed{72}",
        "\\boxed{0.5}",
        "\\boxed{3}",
        "\\boxed{-0.00000025}",
    ]
    out = task.reward([it.prompt for it in items], completions, [it.metadata for it in items])
    assert out.rewards == [1.0] * 6 and not any(out.failed)
    # a reward called with the number itself (library use) reads it the same way
    direct = task.reward(["p", "p"], ["\\boxed{0.00005}", "\\boxed{0.0001}"], [{"answer": 5e-05}] * 2)
    assert direct.rewards == [1.0, 0.0]


def duplicated_rows(n: int = 20, copies: int = 2) -> list[dict]:
    return [{"problem": f"q{i % n}", "answer": str(i % n)} for i in range(n * copies)]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_a_held_out_prompt_is_held_out_with_all_its_repeats(tmp_path, tok, seed):
    cfg = DatasetConfig(train_path=write_jsonl(tmp_path / "d.jsonl", duplicated_rows()), eval_fraction=0.25)
    train, evals = build_splits(cfg, PLAIN, tok, seed=seed)
    train_prompts, eval_prompts = {it.prompt for it in train}, {it.prompt for it in evals}
    assert not train_prompts & eval_prompts
    assert len(train) + len(evals) == 40 and len(evals) == 10  # 5 prompts x 2 rows: the fraction, whole
    again, _ = build_splits(cfg, PLAIN, tok, seed=seed)
    assert [it.prompt_id for it in again] == [it.prompt_id for it in train]


@pytest.mark.parametrize(("n", "fraction", "seed"), [(20, 0.25, 1), (37, 0.1, 0), (101, 0.3, 5), (5, 0.5, 3)])
def test_without_repeated_prompts_the_split_is_the_seeded_permutations_first_rows(n, fraction, seed):
    """The split every recorded run used: rows order[:k] of numpy's permutation seeded by the task seed."""
    src = [SourcePrompt(i, f"q{i}", {}) for i in range(n)]
    train, held = split_holdout(src, fraction, seed)
    k = max(1, round(n * fraction))
    want = sorted(np.random.default_rng(seed).permutation(n)[:k].tolist())
    assert [s.prompt_id for s in held] == want
    assert [s.prompt_id for s in train] == [i for i in range(n) if i not in set(want)]


def test_a_split_that_would_hold_out_every_prompt_is_refused():
    src = [SourcePrompt(i, "the same prompt", {}) for i in range(10)]
    with pytest.raises(ValueError, match="holds out every prompt: the 10 rows hold 1 distinct"):
        split_holdout(src, 0.2, 0)


def test_eval_split_without_eval_path_reads_train_paths_dataset_dict(tmp_path, tok):
    hf = pytest.importorskip("datasets")
    rows = duplicated_rows(20, 1)
    hf.DatasetDict(
        {"train": hf.Dataset.from_list(rows[:15]), "test": hf.Dataset.from_list(rows[15:])}
    ).save_to_disk(str(tmp_path / "dd"))
    cfg = DatasetConfig(train_path=str(tmp_path / "dd"), train_split="train", eval_split="test")
    train, evals = build_splits(cfg, PLAIN, tok)
    assert [it.prompt for it in train] == [f"q{i}" for i in range(15)]
    assert evals is not None and [it.prompt for it in evals] == [f"q{i}" for i in range(15, 20)]
    flat = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        ValueError, match="eval_split='test' without eval_path.*not a DatasetDict.*set eval_path"
    ):
        build_splits(DatasetConfig(train_path=flat, eval_split="test"), PLAIN, tok)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"eval_path": "e.jsonl", "eval_fraction": 0.1}, "eval_fraction=0.1 holds out.*eval_path='e.jsonl'"),
        ({"eval_split": "test", "eval_fraction": 0.2}, "eval_fraction=0.2 holds out.*eval_split='test'"),
        ({"train_split": "train", "eval_split": "train"}, "eval_split='train' is train_split"),
        ({"metadata_fields": ["answer"], "answer_field": "final"}, "'answer'.*answer_field='final'"),
        ({"metadata_fields": ["level", "problem"]}, "metadata_fields names 'problem'.*overwritten"),
    ],
)
def test_conflicting_dataset_settings_are_refused_at_load(settings, message):
    with pytest.raises(ValidationError, match=message):
        DatasetConfig(train_path="d.jsonl", **settings)


def test_metadata_fields_supply_the_answer_only_without_answer_field(tmp_path, tok):
    """metadata_fields=['answer'] overwrote the gold read from answer_field; with answer_field unset it is
    how a custom reward gets that column."""
    rows = [{"question": "48/2+48?", "answer": "48/2 = 24 ... #### 72", "final": "72"}]
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    with pytest.raises(ValidationError, match="set answer_field='answer' to make that column the gold"):
        DatasetConfig(
            train_path=path, prompt_field="question", answer_field="final", metadata_fields=["answer"]
        )
    cfg = DatasetConfig(
        train_path=path, prompt_field="question", answer_field=None, metadata_fields=["answer"]
    )
    train, _ = build_splits(cfg, PLAIN, tok)
    assert train[0].metadata == {"problem": "48/2+48?", "answer": "48/2 = 24 ... #### 72"}


def test_a_system_prompt_without_a_chat_template_is_warned_about_once(tok, caplog, monkeypatch):
    monkeypatch.setattr(datasets_module, "_WARNED", set())
    fmt = PromptFormatConfig(template="Q: {prompt}\nA:", system_prompt="Answer in French.")
    src = [SourcePrompt(0, "1+2=", {})]
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        ds = build_prompt_dataset(src, tok, fmt)
        build_prompt_dataset(src, tok, fmt, name="eval")
    assert ds[0].prompt == "Q: 1+2=\nA:"
    warned = [r.getMessage() for r in caplog.records if "system_prompt" in r.getMessage()]
    assert len(warned) == 1 and "prompt_format.system_prompt is not used" in warned[0]
    assert "no chat template" in warned[0] and "prompt_format.template" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        build_prompt_dataset(src, tok, PromptFormatConfig(template="Q: {prompt}\nA:"))
    assert "system_prompt" not in caplog.text
