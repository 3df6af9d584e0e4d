"""Tasks: arithmetic generation and reward, math-verify reward, dataset loading and checks, the safe reward
scorer, reward functions by import path, prompt formatting and length limits, resumable prompt order."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading

import pytest
from pydantic import ValidationError

from helpers import subprocess_env
from posttrain.config import Config
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.tasks import (
    ArithmeticReward,
    ArithmeticTaskConfig,
    ChainTaskConfig,
    CustomTaskConfig,
    DatasetConfig,
    MathTaskConfig,
    PromptFormatConfig,
    RewardConfig,
    RewardError,
    RewardResult,
    RewardScorer,
    TaskConfig,
    build_prompt_dataset,
    build_splits,
    build_task,
    load_reward_fn,
    load_rows,
)
from posttrain.tasks.arithmetic import enumerate_problems, parse_answer
from posttrain.tasks.datasets import SourcePrompt

ROWS = [
    {"problem": "What is 1/2 as a decimal", "answer": "0.5", "level": 1},
    {"problem": "Compute 2+2", "answer": 4, "level": 2},
    {"problem": "Simplify 6/12", "answer": "\\frac{1}{2}", "level": 3},
]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a: {% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def plain(**kw) -> PromptFormatConfig:
    return PromptFormatConfig(chat_template="never", **kw)


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_is_deterministic_and_splits_are_disjoint(tok):
    cfg = ArithmeticTaskConfig(seed=3)
    a, b = build_task(cfg, tok), build_task(cfg, tok)
    assert [it.prompt for it in a.train] == [it.prompt for it in b.train]
    assert [it.prompt_token_ids for it in a.eval] == [it.prompt_token_ids for it in b.eval]
    train_ids = {it.prompt_id for it in a.train}
    eval_ids = {it.prompt_id for it in a.eval}
    assert not train_ids & eval_ids
    assert not {it.prompt for it in a.train} & {it.prompt for it in a.eval}
    assert len(train_ids | eval_ids) == len(enumerate_problems(cfg)) == 100 + 55
    other = build_task(ArithmeticTaskConfig(seed=4), tok)
    assert {it.prompt_id for it in other.eval} != eval_ids


def test_arithmetic_knobs(tok):
    cfg = ArithmeticTaskConfig(operations=["-"], min_operand=10, max_operand=19, allow_negative=False)
    problems = enumerate_problems(cfg)
    assert len(problems) == 55 and all(int(p.metadata["answer"]) >= 0 for p in problems)
    assert problems[0].text == "10-10="
    neg = enumerate_problems(ArithmeticTaskConfig(operations=["-"], allow_negative=True))
    assert any(p.metadata["answer"].startswith("-") for p in neg)
    capped = build_task(ArithmeticTaskConfig(max_train_prompts=10, max_eval_prompts=5), tok)
    assert (len(capped.train), len(capped.eval)) == (10, 5)
    with pytest.raises(ValidationError, match="swap them"):
        ArithmeticTaskConfig(min_operand=5, max_operand=2)
    with pytest.raises(ValidationError):
        ArithmeticTaskConfig(operations=["/"])


def test_arithmetic_prompt_tokens_and_sft_examples(tok):
    task = build_task(ArithmeticTaskConfig(num_sft_examples=7), tok)
    item = task.train[0]
    assert item.prompt_token_ids[0] == tok.bos_token_id
    assert tok.decode(item.prompt_token_ids[1:]) == item.prompt
    assert len(task.sft_examples) == 7
    for ex in task.sft_examples:
        problem = next(it for it in task.train if it.prompt_id == ex.prompt_id)
        assert ex.prompt_token_ids == problem.prompt_token_ids
        assert ex.completion == problem.metadata["answer"] + "</s>"
        assert ex.completion_token_ids[-1] == tok.eos_token_id
        assert tok.decode(ex.completion_token_ids) == ex.completion
        a, op, b = problem.metadata["a"], problem.metadata["op"], problem.metadata["b"]
        assert int(problem.metadata["answer"]) == {"+": a + b, "-": a - b}[op]


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("12</s>", 1.0),
        ("12", 1.0),
        ("12\nmore", 1.0),
        ("12 and more", 1.0),
        ("12</s><pad><pad>", 1.0),
        ("12</s>99", 1.0),
        ("123</s>", 0.0),
        ("1</s>2", 0.0),
        (" 12", 0.0),
        ("012", 0.0),
        ("+12", 0.0),
        ("12.0", 0.0),
        ("", 0.0),
        ("</s>", 0.0),
    ],
)
def test_arithmetic_reward(completion, reward):
    fn = ArithmeticReward(["</s>", "<pad>"])
    out = fn(["7+5="], [completion], [{"answer": "12"}])
    assert out.rewards == [reward] and out.failed == [False]


def test_arithmetic_reward_negative_and_missing_gold_fails(tok):
    assert parse_answer("-3</s>", ["</s>"]) == "-3"
    assert ArithmeticReward(["</s>"])(["1-4="], ["-3</s>"], [{"answer": "-3"}]).rewards == [1.0]
    scorer = build_task(ArithmeticTaskConfig(), tok).reward
    out = scorer(["1+1=", "1+2="], ["2</s>", "3</s>"], [{"answer": "2"}, {}])
    assert out.rewards[0] == 1.0 and out.failed == [False, True]
    assert math.isnan(out.rewards[1]) and "KeyError" in out.errors[1]


# ---------------------------------------------------------------- safe reward scorer


def raises_on_bad(prompts, completions, metadata):
    if any(c == "bad" for c in completions):
        raise RuntimeError("cannot score 'bad'")
    return [1.0 for _ in completions]


def test_reward_raising_is_marked_failed_and_counted_with_skip(caplog):
    scorer = RewardScorer(raises_on_bad, RewardConfig(on_reward_error="skip_sample"))
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        out = scorer(["p"] * 4, ["ok", "bad", "ok", "ok"], [{}] * 4)
    assert out.failed == [False, True, False, False]
    assert out.rewards[0] == 1.0 and math.isnan(out.rewards[1])
    assert "cannot score 'bad'" in out.errors[1]
    assert scorer.total_failed == 1 and scorer.total_scored == 4
    assert out.summary()["reward_failed"] == 1.0 and out.summary()["reward_mean"] == 1.0
    assert "1 of 4 samples failed" in caplog.text
    no_isolation = RewardScorer(raises_on_bad, RewardConfig(isolate_failures=False, max_failed_fraction=1.0))
    assert no_isolation(["p"] * 2, ["ok", "bad"], [{}] * 2).failed == [True, True]


def test_reward_raising_stops_the_run_with_raise():
    scorer = RewardScorer(raises_on_bad, RewardConfig(on_reward_error="raise"))
    with pytest.raises(RewardError, match="raises_on_bad.*cannot score 'bad'.*on_reward_error=skip_sample"):
        scorer(["p"] * 2, ["ok", "bad"], [{}] * 2)
    nan_scorer = RewardScorer(lambda p, c, m: [float("nan")] * len(c), RewardConfig(on_reward_error="raise"))
    with pytest.raises(RewardError, match="non-finite"):
        nan_scorer(["p"], ["c"], [{}])


def test_reward_bad_values_are_failures_never_zero():
    values = [0.5, None, float("nan"), "1.0", float("inf"), True]
    scorer = RewardScorer(lambda p, c, m: values, RewardConfig(max_failed_fraction=1.0))
    out = scorer(["p"] * 6, ["c"] * 6, [{}] * 6)
    assert out.failed == [False, True, True, True, True, False]
    assert out.rewards[0] == 0.5 and out.rewards[5] == 1.0
    assert all(math.isnan(r) for r, f in zip(out.rewards, out.failed) if f)
    assert "None" in out.errors[1] and "non-numeric" in out.errors[3] and "non-finite" in out.errors[4]


def test_reward_result_from_fn_and_failure_threshold():
    def marks_failed(p, c, m):
        return RewardResult(rewards=[1.0, 0.0], failed=[False, True], errors=[None, None], metrics={"x": 2.0})

    out = RewardScorer(marks_failed, RewardConfig(max_failed_fraction=0.5))(["p"] * 2, ["a", "b"], [{}] * 2)
    assert out.failed == [False, True] and math.isnan(out.rewards[1]) and out.errors[1]
    assert out.summary()["x"] == 2.0
    strict = RewardScorer(marks_failed, RewardConfig(max_failed_fraction=0.25))
    with pytest.raises(RewardError, match="max_failed_fraction"):
        strict(["p"] * 2, ["a", "b"], [{}] * 2)
    wrong_len = RewardScorer(lambda p, c, m: [1.0], RewardConfig(on_reward_error="raise"))
    with pytest.raises(RewardError, match="returned 1 rewards for 2 completions"):
        wrong_len(["p"] * 2, ["a", "b"], [{}] * 2)


# ---------------------------------------------------------------- reward functions by import path


def test_load_reward_fn_by_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, metadata):\n    return [float(len(c)) for c in completions]\n"
        "class Holder:\n    @staticmethod\n    def one(p, c, m):\n        return [1.0] * len(c)\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    assert load_reward_fn("my_rewards:length")([], ["abc"], [{}]) == [3.0]
    assert load_reward_fn("my_rewards.length")([], ["ab"], [{}]) == [2.0]
    assert load_reward_fn("my_rewards:Holder.one")([], ["ab"], [{}]) == [1.0]
    assert load_reward_fn(f"{tmp_path / 'my_rewards.py'}:length")([], ["a"], [{}]) == [1.0]
    with pytest.raises(ValueError, match="'my_rewards:NOT_CALLABLE'.*not callable"):
        load_reward_fn("my_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match="'my_rewards:nope'.*no attribute 'nope'.*length"):
        load_reward_fn("my_rewards:nope")


TYPED_REWARD = (
    "from __future__ import annotations\nfrom dataclasses import dataclass\n\n@dataclass\n"
    "class Parsed:\n    value: str\n\n"
    "def reward(prompts, completions, metadata):\n"
    "    return [float(Parsed(c).value.strip() == m['answer']) for c, m in zip(completions, metadata)]\n"
)


def test_a_reward_file_is_a_registered_module(tmp_path):
    """A file loaded by path is in sys.modules under one name per file, as an import would put it: a
    dataclass under `from __future__ import annotations` works and its functions pickle (process pools);
    a file that raises leaves no module behind."""
    import pickle

    (tmp_path / "typed.py").write_text(TYPED_REWARD)
    fn = load_reward_fn(f"{tmp_path / 'typed.py'}:reward")
    assert fn(["p", "p"], ["4", "5"], [{"answer": "4"}] * 2) == [1.0, 0.0]
    assert sys.modules[fn.__module__].reward is fn
    assert load_reward_fn(f"{tmp_path}/../{tmp_path.name}/typed.py:reward") is fn  # one file, one module
    assert pickle.loads(pickle.dumps(fn)) is fn
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="raised RuntimeError: boom"):
        load_reward_fn(f"{tmp_path / 'broken.py'}:f")
    assert not [name for name in sys.modules if name.startswith("posttrain_user_broken_")]


def test_cloudpickle_ships_a_reward_file_by_value(tmp_path):
    """Ray and loky pickle with cloudpickle, which ships code by reference once its module is in
    sys.modules; a fresh worker process has no module of that name, so the file's code goes by value."""
    import subprocess

    pytest.importorskip("cloudpickle")
    (tmp_path / "typed.py").write_text(TYPED_REWARD)
    dump = (  # cloudpickle imported after the load, as a run that starts Ray later would
        "import sys; from posttrain.tasks.rewards import load_reward_fn; "
        f"fn = load_reward_fn({str(tmp_path / 'typed.py')!r} + ':reward'); import cloudpickle; "
        "sys.stdout.buffer.write(cloudpickle.dumps(fn))"
    )
    data = subprocess.run(
        [sys.executable, "-c", dump], capture_output=True, timeout=120, env=subprocess_env(), check=True
    )
    load = (
        "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); "
        "print(f(['p'], ['4'], [{'answer': '4'}]))"
    )
    out = subprocess.run([sys.executable, "-c", load], input=data.stdout, capture_output=True, timeout=120)
    assert out.stdout.decode().strip() == "[1.0]", out.stderr.decode()[-500:]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "no_such_pkg_xyz.rewards:score",
            "'no_such_pkg_xyz.rewards:score'.*cannot import module 'no_such_pkg_xyz'",
        ),
        ("no_such_module_xyz", "not of the form 'package.module:name'"),
        ("missing_file_xyz.py:score", "file 'missing_file_xyz.py' does not exist"),
    ],
)
def test_unknown_reward_import_path(path, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(path)


def test_unknown_reward_path_in_task_config_fails_before_loading_data(tmp_path, tok):
    cfg = CustomTaskConfig(
        dataset=DatasetConfig(train_path=str(tmp_path / "absent.jsonl")), reward_fn="no_such_pkg_xyz:f"
    )
    with pytest.raises(ValueError, match="no_such_pkg_xyz"):
        build_task(cfg, tok)


# ---------------------------------------------------------------- dataset loading and checks


def test_jsonl_parquet_and_saved_dataset_load_the_same(tmp_path, tok):
    paths = [write_jsonl(tmp_path / "d.jsonl", ROWS)]
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(
        pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in ROWS]), tmp_path / "d.parquet"
    )
    paths.append(str(tmp_path / "d.parquet"))
    hf = pytest.importorskip("datasets")
    hf.Dataset.from_list([{**r, "answer": str(r["answer"])} for r in ROWS]).save_to_disk(str(tmp_path / "hf"))
    paths.append(str(tmp_path / "hf"))
    loaded = []
    for path in paths:
        cfg = DatasetConfig(train_path=path, metadata_fields=["level"])
        train, evals = build_splits(cfg, plain(), tok, seed=0)
        assert evals is None
        loaded.append([(it.prompt_id, it.prompt, it.metadata) for it in train])
    assert loaded[0] == loaded[1] == loaded[2]
    assert loaded[0][1][2] == {"problem": "Compute 2+2", "answer": "4", "level": 2}


def test_saved_dataset_dict_needs_a_split(tmp_path, tok):
    hf = pytest.importorskip("datasets")
    rows = [{**r, "answer": str(r["answer"])} for r in ROWS]
    hf.DatasetDict(
        {"train": hf.Dataset.from_list(rows), "test": hf.Dataset.from_list(rows[:1])}
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\].*train_split"):
        load_rows(tmp_path / "dd")
    cfg = DatasetConfig(
        train_path=str(tmp_path / "dd"),
        train_split="train",
        eval_path=str(tmp_path / "dd"),
        eval_split="test",
    )
    train, evals = build_splits(cfg, plain(), tok)
    assert (len(train), len(evals)) == (3, 1)


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"answer": "1"}, "row 2 has no field 'problem'"),
        ({"problem": "x", "answer": ""}, "row 2 field 'answer' is empty"),
        ({"problem": "x", "answer": None}, "row 2 field 'answer' is null"),
        ({"problem": 5, "answer": "1"}, "row 2 field 'problem' must be a string"),
        ({"problem": "x", "answer": [1]}, "row 2 field 'answer' must be a string or a number"),
        ({"problem": "x", "answer": True}, "row 2 field 'answer' must be a string or a number"),
        (["x", "1"], "row 2 is a list"),
    ],
)
def test_malformed_row_is_named_by_index(tmp_path, tok, bad_row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [*ROWS[:2], bad_row, ROWS[2]])
    with pytest.raises(ValueError, match=message):
        build_splits(DatasetConfig(train_path=path), plain(), tok)


def test_unreadable_sources(tmp_path, tok):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(ValueError, match="row 1 \\(line 3\\) is not valid JSON"):
        load_rows(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="use .jsonl, .json, .parquet"):
        load_rows(tmp_path / "d.csv")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="not a dataset saved by datasets.save_to_disk"):
        load_rows(tmp_path / "empty_dir")
    cfg = DatasetConfig(train_path=write_jsonl(tmp_path / "d.jsonl", ROWS), metadata_fields=["missing"])
    with pytest.raises(ValueError, match="row 0 has no field 'missing'"):
        build_splits(cfg, plain(), tok)


def test_eval_fraction_holds_out_disjoint_rows(tmp_path, tok):
    rows = [{"problem": f"q{i}", "answer": str(i)} for i in range(20)]
    cfg = DatasetConfig(train_path=write_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.25)
    train, evals = build_splits(cfg, plain(), tok, seed=1)
    assert (len(train), len(evals)) == (15, 5)
    assert not {it.prompt_id for it in train} & {it.prompt_id for it in evals}
    again, _ = build_splits(cfg, plain(), tok, seed=1)
    assert [it.prompt_id for it in again] == [it.prompt_id for it in train]


# ---------------------------------------------------------------- prompt formatting and length limits


def sources(texts):
    return [SourcePrompt(prompt_id=i, text=t, metadata={"answer": "1"}) for i, t in enumerate(texts)]


def test_overlong_prompts_dropped_with_count_or_refused(tok, caplog):
    src = sources(["1+1=", "1234567890+1=", "2+2=", "99999999999999="])
    fmt = plain(max_prompt_tokens=8)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        ds = build_prompt_dataset(src, tok, fmt)
    assert [it.prompt_id for it in ds] == [0, 2] and ds.num_dropped == 2
    assert "dropped 2 of 4 train prompts longer than max_prompt_tokens=8" in caplog.text
    with pytest.raises(
        ValueError, match="2 of 4 train prompts.*longest 16 tokens.*rows 1, 3.*overlong_prompts=drop"
    ):
        build_prompt_dataset(src, tok, plain(max_prompt_tokens=8, overlong_prompts="error"))
    with pytest.raises(ValueError, match="every train prompt is longer"):
        build_prompt_dataset(src[1:2], tok, fmt)


def test_plain_and_chat_template_paths(tok):
    src = sources(["1+2="])
    ds = build_prompt_dataset(src, tok, PromptFormatConfig(template="Q: {prompt}\nA:"))
    assert ds[0].prompt == "Q: 1+2=\nA:"
    assert ds[0].prompt_token_ids == [tok.bos_token_id, *tok("Q: 1+2=\nA:")["input_ids"]]
    chat_tok = build_char_tokenizer()
    chat_tok.chat_template = CHAT_TEMPLATE
    fmt = PromptFormatConfig(template="solve {prompt}", system_prompt="be brief")
    ds = build_prompt_dataset(src, chat_tok, fmt)
    assert ds[0].prompt == "s: be brief\nu: solve 1+2=\na: "
    assert chat_tok.decode(ds[0].prompt_token_ids, skip_special_tokens=True) == ds[0].prompt
    never = build_prompt_dataset(src, chat_tok, PromptFormatConfig(chat_template="never"))
    assert never[0].prompt == "1+2="
    with pytest.raises(ValueError, match="no chat_template"):
        build_prompt_dataset(src, tok, PromptFormatConfig(chat_template="always"))
    with pytest.raises(ValidationError, match="must contain '\\{prompt\\}'"):
        PromptFormatConfig(template="no placeholder")
    latex = build_prompt_dataset(src, tok, plain(template="{prompt} \\boxed{}"))
    assert latex[0].prompt == "1+2= \\boxed{}"


# ---------------------------------------------------------------- resumable order


def test_dataset_state_dict_resume_gives_the_same_order(tok):
    ds = build_task(ArithmeticTaskConfig(seed=5), tok).train
    n = len(ds)
    ds.next_batch(n - 3)
    state = ds.state_dict()
    expected = [it.prompt_id for it in ds.next_batch(10) + ds.next_batch(n)]
    assert ds.epoch == 2
    fresh = build_task(ArithmeticTaskConfig(seed=5), tok).train
    fresh.load_state_dict(state)
    assert [it.prompt_id for it in fresh.next_batch(10) + fresh.next_batch(n)] == expected
    first_epoch = [it.prompt_id for it in build_task(ArithmeticTaskConfig(seed=5), tok).train.next_batch(n)]
    assert sorted(first_epoch) == sorted(it.prompt_id for it in ds) and expected[3 : 3 + n] != first_epoch
    other = build_task(ArithmeticTaskConfig(seed=6), tok).train
    with pytest.raises(ValueError, match="seed=5.*seed=6.*same dataset"):
        other.load_state_dict(state)


def test_run_seed_orders_the_training_prompts(tok, tmp_path):
    from helpers import policy_cfg
    from posttrain.algorithms.runs import start_run

    def ids(ds, n):
        return [it.prompt_id for it in ds.next_batch(n)]

    def ordered(run_seed):
        ds = build_task(ArithmeticTaskConfig(seed=5), tok).train
        ds.order_by_run(run_seed)
        return ds

    n = len(ordered(0))
    a, b, plain = ordered(1), ordered(2), build_task(ArithmeticTaskConfig(seed=5), tok).train
    first = [ids(ds, n) for ds in (a, b, plain)]
    assert all(sorted(f) == sorted(first[2]) for f in first)  # the same prompts (the task seed's split)
    assert first[0] != first[1] and first[0] != first[2] and first[1] != first[2]
    assert ids(ordered(1), n) == first[0]  # a run seed always gives its order
    assert ids(a, n) != first[0]  # each epoch its own permutation
    state = a.state_dict()
    with pytest.raises(ValueError, match="run_seed=1.*run_seed=2.*run seed"):
        ordered(2).load_state_dict(state)
    resumed = ordered(1)
    resumed.load_state_dict(state)
    assert ids(resumed, 7) == ids(a, 7)
    with pytest.raises(RuntimeError, match="already served"):
        a.order_by_run(3)
    # every loop's start applies its seed (the policy is passed in, so none is built)
    cfg = policy_cfg()
    runs = [start_run(str(tmp_path / str(s)), s, cfg, ArithmeticTaskConfig(seed=5), object()) for s in (1, 2)]
    assert [ids(r.task.train, n) for r in runs] == first[:2]


# ---------------------------------------------------------------- math-verify reward


@pytest.fixture(scope="module")
def math_task(tmp_path_factory):
    pytest.importorskip("math_verify")
    path = tmp_path_factory.mktemp("math") / "m.jsonl"
    rows = [*ROWS, {"problem": "bad gold", "answer": "\\frac{"}]
    cfg = MathTaskConfig(dataset=DatasetConfig(train_path=write_jsonl(path, rows)))
    cfg.reward.max_failed_fraction = 1.0
    return build_task(cfg, build_char_tokenizer())


def test_math_verify_reward(math_task):
    assert math_task.train[0].prompt.endswith("Put your final answer within \\boxed{}.")
    completions = [
        "so \\boxed{1/2}",
        "the answer is \\boxed{0.5}",
        "\\boxed{1/3}",
        "I do not know",
        "\\boxed{4}",
    ]
    golds = ["0.5", "\\frac{1}{2}", "0.5", "0.5", "4"]
    out = math_task.reward(["p"] * 5, completions, [{"answer": g} for g in golds])
    assert out.rewards == [1.0, 1.0, 0.0, 0.0, 1.0] and not any(out.failed)


def test_a_gold_answer_with_an_escaped_dollar_sign_is_read(math_task):
    """'\\$18.90' held a '$', so the gold was not wrapped in $...$ and failed to parse: every sample of
    the prompt was marked failed."""
    golds = ["\\$18.90", "\\$18.90", "\\$5", "\\$5", "$18$", "$1,000"]
    completions = [
        "\\boxed{18.90}",
        "\\boxed{\\$18.90}",
        "\\boxed{5}",
        "\\boxed{7}",
        "\\boxed{18}",
        "\\boxed{1000}",
    ]
    out = math_task.reward(["p"] * 6, completions, [{"answer": g} for g in golds])
    assert out.failed == [False] * 6, out.errors
    assert out.rewards == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]


def test_math_verify_failures_are_not_zero(math_task, monkeypatch):
    out = math_task.reward(["p"], ["\\boxed{1}"], [{"answer": "\\frac{"}])
    assert out.failed == [True] and "cannot parse the gold answer" in out.errors[0]
    from math_verify.errors import TimeoutException

    reward_fn = math_task.reward.fn

    def timing_out(*args, **kwargs):
        raise TimeoutException("Operation timed out!")

    monkeypatch.setattr(reward_fn._mv, "verify", timing_out)
    out = math_task.reward(["p", "p"], ["\\boxed{1}", "\\boxed{2}"], [{"answer": "1"}] * 2)
    assert out.failed == [True, True] and "TimeoutException" in out.errors[0]


def off_main_thread(fn):
    results = []
    thread = threading.Thread(target=lambda: results.append(fn()))
    thread.start()
    thread.join(timeout=60)
    assert results, "the call did not return"
    return results[0]


def test_math_verify_off_the_main_thread(math_task):
    """Off the main thread math-verify runs in a child process, where its timeouts work: the same rewards
    and failures as in the main thread, and a completion whose comparison would compute a number of
    hundreds of millions of digits (unbounded in a thread, and holding the GIL: the whole process froze)
    fails with math-verify's timeout."""
    completions = ["so \\boxed{1/2}", "\\boxed{1/3}", "\\boxed{4}", "\\boxed{1}", "\\boxed{9^{9^{9}}}"]
    metadata = [{"answer": "0.5"}, {"answer": "0.5"}, {"answer": "4"}, {"answer": "\\frac{"}, {"answer": "5"}]
    here = math_task.reward(["p"] * 4, completions[:4], metadata[:4])
    child = off_main_thread(lambda: math_task.reward(["p"] * 5, completions, metadata))
    assert child.rewards[:3] == here.rewards[:3] == [1.0, 0.0, 1.0]
    assert child.failed == here.failed + [True] and child.errors[3] == here.errors[3]
    assert "cannot parse the gold answer" in child.errors[3] and "Timeout" in child.errors[4]
    missing = off_main_thread(lambda: math_task.reward(["p"] * 2, ["\\boxed{4}"] * 2, [{}, {"answer": "4"}]))
    assert missing.failed == [True, False] and missing.errors[0] == "KeyError: 'answer'"


FAKE_CHILD = """
import json, os, sys, time
print("ready", flush=True)
for line in sys.stdin:
    c = json.loads(line)["completion"]
    if c == "hang":
        time.sleep(600)
    if c == "die":
        os._exit(3)
    if c == "stray":
        print("a line that is not an answer", flush=True)
    print(json.dumps({"reward": 1.0, "error": None}), flush=True)
"""


def test_math_child_that_hangs_or_dies_fails_its_sample_alone(monkeypatch):
    """The watchdog of the scoring child: a sample it does not answer within the bound (a computation
    its signal timeout cannot interrupt) or that kills it is marked failed with the reason; the child is
    killed and a fresh one scores the rest. A child that cannot start is an error, not failed samples."""
    from posttrain.tasks import math_child

    monkeypatch.setattr(math_child, "SLACK_S", 0.0)
    child = math_child.MathVerifyChild(1, 6, argv=[sys.executable, "-c", FAKE_CHILD])
    pairs = [("a", "1"), ("hang", "1"), ("b", "1"), ("die", "1"), ("c", "1")]
    out = child.score(pairs[:1])
    first_pid = child._proc.pid
    out += child.score(pairs[1:])
    assert [r for r, _ in out][::2] == [1.0, 1.0, 1.0]
    assert "no answer within 3 s" in out[1][1] and "killed" in out[1][1]
    assert out[3][1] == "math-verify's process died (exit code 3)"
    assert child.kills == 1 and child._proc.pid != first_pid
    child.close()
    assert child._proc is None
    broken = math_child.MathVerifyChild(1, 6, argv=[sys.executable, "-c", "import sys; sys.exit(4)"])
    with pytest.raises(RuntimeError, match=r"scoring process exited \(code 4\).*posttrain\[math\]"):
        broken.score([("a", "1")])
    chatty = math_child.MathVerifyChild(1, 6, argv=[sys.executable, "-c", "print('hello'); input()"])
    with pytest.raises(RuntimeError, match=r"printed b'hello\\n' instead of 'ready'"):
        chatty.score([("a", "1")])
    assert chatty._proc is None  # a child that never said ready is not kept


def test_math_child_survives_what_its_parent_meets(monkeypatch):
    """The scoring child against its parent's circumstances: a stray line (not an answer) fails that
    sample and restarts it, never shifting the later answers by one; the child has a session of its
    own (a Ctrl-C at the terminal, a graceful stop of the run, does not kill it mid-sample); the
    parent's descriptors past 1023 (select.select refused them); and a scoring thread that blocks SIGALRM
    (math-verify's timeout signal) does not pass the block on."""
    import resource
    import signal

    from posttrain.tasks import math_child
    from posttrain.tasks.math import MathVerifyReward

    child = math_child.MathVerifyChild(1, 6, argv=[sys.executable, "-c", FAKE_CHILD])
    out = child.score([("a", "1"), ("stray", "1"), ("b", "1"), ("c", "1")])
    assert [r for r, _ in out] == [1.0, out[1][0], 1.0, 1.0] and "not a result; restarted" in out[1][1]
    assert os.getsid(child._proc.pid) != os.getsid(0)
    child.close()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard if hard != resource.RLIM_INFINITY else 4096) < 1200:
        pytest.skip("needs 1200 open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        child = math_child.MathVerifyChild(1, 6, argv=[sys.executable, "-c", FAKE_CHILD])
        assert child.score([("a", "1")]) == [(1.0, None)] and child._proc.stdout.fileno() > 1023
        child.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    reward = MathVerifyReward(timeout_seconds=1)

    def blocked():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        return reward(["p"], ["\\boxed{9^{9^{9}}}"], [{"answer": "5"}])

    result = off_main_thread(blocked)
    assert "TimeoutException" in result.errors[0] and reward._child.kills == 0


# ---------------------------------------------------------------- task config


class RunConfig(Config):
    task: TaskConfig = ArithmeticTaskConfig()


def test_task_config_is_discriminated_by_name(tmp_path, tok, monkeypatch):
    assert isinstance(RunConfig().task, ArithmeticTaskConfig)
    cfg = RunConfig.model_validate({"task": {"name": "math", "dataset": {"train_path": "x.jsonl"}}})
    assert isinstance(cfg.task, MathTaskConfig)
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"task": {"name": "chess"}})
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"task": {"name": "arithmetic", "max_operandd": 3}})
    (tmp_path / "len_reward.py").write_text("def score(p, c, m):\n    return [float(len(x)) for x in c]\n")
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    custom = RunConfig.model_validate(
        {
            "task": {
                "name": "custom",
                "dataset": {"train_path": path},
                "reward_fn": f"{tmp_path}/len_reward.py:score",
            }
        }
    )
    task = build_task(custom.task, tok)
    assert task.name == "custom" and len(task.train) == 3 and task.eval is None
    assert task.reward(["p"], ["abc"], [{}]).rewards == [3.0]


def test_chain_task_splits_work_and_reward(tok):
    cfg = ChainTaskConfig(heldout="validation")
    task = build_task(cfg, tok)
    test = build_task(cfg.model_copy(update={"heldout": "test"}), tok)
    train_ids = {it.prompt_id for it in task.train.items}
    val_ids, test_ids = {it.prompt_id for it in task.eval.items}, {it.prompt_id for it in test.eval.items}
    assert (len(train_ids), len(val_ids), len(test_ids)) == (800, 100, 100)
    assert not (train_ids & val_ids) and not (train_ids & test_ids) and not (val_ids & test_ids)
    ex = next(e for e in task.sft_examples if e.prompt_id == 417)
    # x + 137 mod 1000, 11 steps shown as equations, then the final value
    assert ex.prompt == "417:" and ex.completion.startswith("417+137=554,554+137=691,691+137=828,")
    assert ",965+137=102," in ex.completion  # results taken mod 1000
    assert len(ex.completion_token_ids) == 136 and ex.completion_token_ids[-1] == tok.eos_token_id
    work = ex.completion.removesuffix(tok.eos_token)
    assert work.endswith("787+137=924:924")
    meta = [next(it for it in task.train.items if it.prompt_id == 417).metadata] * 4
    wrong_step = work.replace("=554,", "=555,", 1)  # a wrong step but the right final answer
    res = task.reward(["417:"] * 4, [work + tok.eos_token, wrong_step, work[:-1] + "0", "no answer"], meta)
    assert res.rewards == [1.0, 1.0, 0.0, 0.0]
    assert res.metrics["work_correct_fraction"] == 0.25


def test_chain_task_refuses_empty_splits_and_is_an_sft_source(tok):
    with pytest.raises(ValidationError, match="empty validation or test split"):
        ChainTaskConfig(modulus=5)
    with pytest.raises(ValidationError, match="hold out all"):
        ChainTaskConfig(validation_fraction=0.5, test_fraction=0.5)
    from posttrain.algorithms.sft import heldout_examples

    task = build_task(task_config({"name": "chain", "num_steps": 2, "heldout": "test"}), tok)
    held = heldout_examples(task, tok)
    assert len(held) == 100 and all(e.completion.count(",") == 1 and ":" in e.completion for e in held)


def task_config(section: dict):
    from pydantic import TypeAdapter

    return TypeAdapter(TaskConfig).validate_python(section)


def test_chain_partial_credit_counts_leading_right_parts(tok):
    cfg = ChainTaskConfig(num_steps=3, reward_mode="steps")
    task = build_task(cfg, tok)
    item = next(it for it in task.train.items if it.prompt_id == 417)
    work = item.metadata["work"]
    assert work == "417+137=554,554+137=691,691+137=828:828"
    wrong_second = "417+137=554,554+137=690,690+137=827:827"
    right_but_no_answer = "417+137=554,554+137=691,691+137=828"
    lucky_answer = "417+137=555,555+137=691,691+137=828:828"  # a wrong first step, the right answer
    res = task.reward(
        ["417:"] * 5, [work, wrong_second, right_but_no_answer, lucky_answer, ""], [item.metadata] * 5
    )
    assert res.rewards == [1.0, 0.25, 0.75, 0.0, 0.0]
    answer_only = build_task(cfg.model_copy(update={"reward_mode": "answer"}), tok)
    assert answer_only.reward(["417:"], [lucky_answer], [item.metadata]).rewards == [1.0]
