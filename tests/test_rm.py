"""`posttrain rm` end to end on the built-in arithmetic pairs, then GRPO with that reward model as the only
reward. What it took for the tiny model to pass 95% held-out pair accuracy: a warm start from an SFT'd
model of the same task (addition up to 19+19: 400 problems, so that the reward model generalizes rather
than memorizes 80), 8 wrong answers per problem, 32 pairs a step, lr 5e-4 with a cosine decay over
1000 steps. A random-init tiny model stays near 55%; one wrong answer per problem, about 80%."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoModelForSequenceClassification

from posttrain.algorithms.grpo import GRPOConfig, run_grpo
from posttrain.algorithms.rm import RMRunConfig, run_rm
from posttrain.algorithms.sft import SFTConfig, run_sft
from posttrain.config import ConfigError, build_config, load_config
from posttrain.logging import read_metrics
from posttrain.rollout.reward_model import RewardModel
from posttrain.tasks.datasets import PromptItem

ADDITION = {"name": "arithmetic", "operations": ["+"], "max_operand": 19}
QUIET = {"logging": {"progress_bar": False}}


def sft(out, steps: int) -> str:
    cfg = load_config(
        SFTConfig,
        "configs/sft_arithmetic.yaml",
        [f"max_num_steps={steps}", f"val_period={steps}", f"output_dir={out}", "logging.progress_bar=false"],
    )
    run_sft(cfg.model_copy(update={"task": cfg.task.model_copy(update=ADDITION)}))
    return str(out / "hf")


def rm_cfg(out, start: str, steps: int = 1000) -> RMRunConfig:
    policy = {
        "model": {"name": start},
        "optimizer": {"lr": 5e-4},
        "scheduler": [{"kind": "cosine", "steps": steps}],
        "train_global_batch_size": 64,
        "microbatch": {"train_micro_batch_size": 64, "logprob_micro_batch_size": 64},
    }
    data = {"arithmetic": {"operations": ["+"], "max_operand": 19}, "wrong_per_problem": 8}
    base = {"policy": policy, "data": data, "max_num_steps": steps, "val_period": 250, "output_dir": str(out)}
    return build_config(RMRunConfig, {**base, **QUIET})


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    result = run_rm(rm_cfg(root / "rm", sft(root / "sft", 700)))
    return root, result


def test_the_reward_model_reaches_95_percent_held_out_pair_accuracy(reward_model):
    root, result = reward_model
    assert result["val_accuracy_at_start"] < 0.6  # a new head knows nothing
    assert result["val_accuracy"] >= 0.95, result
    val = [r for r in read_metrics(root / "rm" / "metrics.jsonl") if "val/accuracy" in r]
    assert [r["step"] for r in val] == [0, 250, 500, 750, 1000]
    model = AutoModelForSequenceClassification.from_pretrained(root / "rm" / "hf")
    assert model.config.num_labels == 1


def test_grpo_with_the_reward_model_alone_raises_the_task_reward_it_never_sees(reward_model):
    """GRPO optimizes the RM's score, and the task's own reward (logged, weight 0) rises with it.

    Held-out greedy accuracy over 80 problems moves by whole problems (1.25 points) and, with the run seed
    also ordering the prompts, swung from -1.25 to +11.25 points over seeds 0-5 (measured), so the test
    reads the task reward of every training sample instead (~2500 per 20-step window; measured +0.065 to
    +0.10 over seeds 0, 2 and 5) and asks the held-out accuracy only not to fall by more than noise."""
    root, _ = reward_model
    start = sft(root / "sft_short", 200)  # a weaker policy, with room to improve
    overrides = [
        f"policy.model.name={start}",
        "task.operations=[+]",
        "task.max_operand=19",
        "task.max_eval_prompts=80",
        "grpo.max_num_steps=80",
        "grpo.val_period=40",
        f"reward_model.path={root / 'rm' / 'hf'}",
        "reward_model.task_weight=0",
        f"output_dir={root / 'grpo'}",
        "checkpointing.enabled=false",
        "logging.progress_bar=false",
    ]
    cfg = load_config(GRPOConfig, "configs/grpo_arithmetic.yaml", overrides)
    run_grpo(cfg)
    rows = read_metrics(root / "grpo" / "metrics.jsonl")
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    steps = [r for r in rows if "reward/model" in r]
    assert len(steps) == 80 and all(r["reward"] == pytest.approx(r["reward/model"]) for r in steps)
    assert all(0.0 <= r["reward/rule"] <= 1.0 for r in steps)  # the task's reward, logged only

    def mean(key, window):
        return sum(r[key] for r in window) / len(window)

    first, last = steps[:20], steps[-20:]
    assert mean("reward/model", last) >= mean("reward/model", first) + 0.5  # measured 0.11 -> 0.92
    assert mean("reward/rule", last) >= mean("reward/rule", first) + 0.04  # measured 0.352 -> 0.455
    assert val[-1] >= val[0] - 0.05, val  # measured 0.4375 -> 0.425 (seed 0)


def test_a_language_model_head_is_refused_for_a_reward_model():
    with pytest.raises(ConfigError, match="set policy.model.head=score"):
        build_config(RMRunConfig, {"policy": {"model": {"head": "lm"}}})
    cfg = build_config(RMRunConfig, {"policy": {"model": {"name": "runs/sft/hf"}}})
    assert cfg.policy.model.head == "score"  # a section naming another model keeps the reward-model head
    packed = build_config(RMRunConfig, {"policy": {"microbatch": {"mode": "packed"}}})
    assert packed.policy.microbatch.mode == "packed"  # packing keeps pairs whole (the loss's row_group)


@pytest.mark.parametrize("mode", ["dynamic", "packed"])
def test_a_bradley_terry_step_is_the_same_with_dynamic_batching_and_packing(mode):
    from conftest import random_batch
    from helpers import assert_params_close, policy_cfg
    from posttrain.algorithms.losses import BradleyTerryLoss
    from posttrain.policy.worker import PolicyWorker

    def step(microbatch):
        over = {"model": {"head": "score"}, "init_reference_model": False, "microbatch": microbatch}
        over["optimizer"] = {"name": "torch.optim.SGD", "lr": 1.0}  # Adam would magnify float-order noise
        worker = PolicyWorker(policy_cfg(**over))
        return worker.train(random_batch(8, 16), BradleyTerryLoss()), worker.full_state_dict()

    ref_metrics, ref_params = step({"train_micro_batch_size": 8})
    metrics, params = step({"mode": mode, "max_tokens": 40})  # several micro-batches of whole pairs
    for k in ("loss", "accuracy", "reward_margin", "grad_norm"):
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-7), k
    assert_params_close(ref_params, params)


def test_a_reward_model_of_another_vocabulary_scores_the_rows_it_was_trained_on():
    """Policy tokenizer without a BOS (Qwen-like), reward model with one: the re-tokenized row must be
    the one `posttrain rm` trains that reward model on, its BOS first, the policy's special tokens out."""
    from types import SimpleNamespace

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from posttrain.generation.params import GenerationResult
    from posttrain.models.tokenizer import build_char_tokenizer
    from posttrain.rollout.reward_model import RewardModel
    from posttrain.tasks.datasets import PromptFormatConfig, PromptItem, tokenize_prompts

    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate("0123456789+= ")}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    policy_tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    rm_tok = build_char_tokenizer()
    fmt = PromptFormatConfig()
    prompt = tokenize_prompts(["2+3="], policy_tok, fmt, False)[0]
    completion = policy_tok("5", add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id]
    result = GenerationResult(0, 0, prompt, completion, [0.0] * len(completion), "stop")
    scorer = SimpleNamespace(same_vocab=False, policy_tokenizer=policy_tok, tokenizer=rm_tok)
    prompts, completions = RewardModel._rows(scorer, [PromptItem(0, "2+3=", prompt)], [result])
    trained = (
        tokenize_prompts(["2+3="], rm_tok, fmt, False)[0] + rm_tok("5", add_special_tokens=False)["input_ids"]
    )
    assert prompts[0] + completions[0] == trained + [rm_tok.eos_token_id]
    assert prompts[0][0] == rm_tok.bos_token_id
    # stopped on a stop string: no EOS was drawn, so none is scored (the same-vocabulary rows have none)
    text = policy_tok("5", add_special_tokens=False)["input_ids"]
    on_string = GenerationResult(0, 0, prompt, text, [0.0] * len(text), "stop", stop_reason="5")
    _, completions = RewardModel._rows(scorer, [PromptItem(0, "2+3=", prompt)], [on_string])
    assert completions[0] == rm_tok("5", add_special_tokens=False)["input_ids"]


def test_a_reward_model_of_another_vocabulary_scores_a_dataset_prompt_as_posttrain_rm_formats_it(tmp_path):
    """`posttrain rm` trains on the raw prompt in the reward model's own chat template (its default
    prompt format, chat_template=auto); scoring decoded the policy's templated prompt, plain."""
    import json

    from posttrain.generation.params import GenerationResult
    from posttrain.models.tokenizer import build_char_tokenizer
    from posttrain.rollout.reward_model import rm_prompts
    from posttrain.tasks import DatasetConfig, PromptFormatConfig, build_splits
    from posttrain.tasks.preferences import PreferenceDataConfig, build_pairs

    policy_tok = build_char_tokenizer()
    rm_tok = build_char_tokenizer()
    rm_tok.add_tokens(["<extra>"])  # another vocabulary
    rm_tok.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a: {% endif %}"
    )
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "7+5=", "chosen": "12", "rejected": "13"}))
    trained = build_pairs(PreferenceDataConfig(path=str(tmp_path / "pairs.jsonl"), eval_fraction=0.0), rm_tok)
    (tmp_path / "d.jsonl").write_text(json.dumps({"problem": "7+5=", "answer": "12"}))
    policy_fmt = PromptFormatConfig(template="Q: {prompt}\nA:")  # the policy's own template
    train, _ = build_splits(DatasetConfig(train_path=str(tmp_path / "d.jsonl")), policy_fmt, policy_tok)
    item = train[0]
    assert item.prompt == "Q: 7+5=\nA:"
    completion = policy_tok("12", add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id]
    result = GenerationResult(0, 0, item.prompt_token_ids, completion, [0.0] * len(completion), "stop")
    scorer = SimpleNamespace(same_vocab=False, policy_tokenizer=policy_tok, tokenizer=rm_tok, pad_id=0)
    prompts, completions = RewardModel._rows(scorer, [item, item], [result, result])
    assert rm_tok.decode(prompts[0]) == "<s>u: 7+5=\na: "
    assert prompts == [trained[0][0].prompt_token_ids] * 2
    assert completions == [trained[0][0].chosen_token_ids] * 2
    # an item without a raw problem (the built-in tasks, whose pairs are their formatted prompts): plain
    bare = PromptItem(0, "7+5=", [policy_tok.bos_token_id, *policy_tok("7+5=")["input_ids"]])
    assert rm_tok.decode(rm_prompts([bare], rm_tok, policy_tok)[0]) == "<s>7+5="


def test_reward_model_scores_that_are_not_finite_fail_their_samples():
    """A NaN or inf score was entered as a reward with the sample not failed (advantages NaN)."""
    import math

    import torch

    from posttrain.rollout.reward_model import RewardModelConfig, combine_rewards

    nan = float("nan")
    rule = torch.tensor([1.0, 0.0, nan, 1.0])
    rule_failed = torch.tensor([False, False, True, False])
    scores = torch.tensor([0.5, nan, 0.25, float("inf")])

    def combine(**weights):
        return combine_rewards(rule, rule_failed, scores, RewardModelConfig(path="rm", **weights))

    rewards, failed, metrics = combine(weight=1.0, task_weight=0.5)
    assert failed.tolist() == [False, True, True, True]
    assert rewards[0].item() == 1.0 and all(math.isnan(r) for r in rewards[1:].tolist())
    assert metrics["reward/model"] == pytest.approx(0.375) and metrics["reward/model_failed"] == 2
    rewards, failed, _ = combine(weight=2.0, task_weight=0.0)  # the rule reward a metric only
    assert failed.tolist() == [False, True, False, True] and rewards[[0, 2]].tolist() == [1.0, 0.5]
    rewards, failed, _ = combine(weight=0.0, task_weight=1.0)  # the model's score unused
    assert failed.tolist() == [False, False, True, False] and rewards[[0, 1, 3]].tolist() == [1.0, 0.0, 1.0]


def test_failed_reward_model_scores_are_counted_in_the_step():
    import torch

    from posttrain.generation.params import GenerationResult
    from posttrain.models.tokenizer import build_char_tokenizer
    from posttrain.rollout.config import GroupConfig
    from posttrain.rollout.groups import score
    from posttrain.rollout.reward_model import RewardModelConfig
    from posttrain.tasks import ArithmeticTaskConfig, build_task

    tok = build_char_tokenizer()
    task = build_task(ArithmeticTaskConfig(), tok)
    item = task.train[0]
    ids = tok(item.metadata["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    results = [GenerationResult(i, 0, item.prompt_token_ids, ids, [0.0] * len(ids), "stop") for i in range(4)]
    rm = SimpleNamespace(
        cfg=RewardModelConfig(path="rm"), score=lambda items, res: torch.tensor([1.0, float("nan"), 2.0, 3.0])
    )
    rewards, failed, summary = score(
        task, tok, [item], results, GroupConfig(num_generations_per_prompt=4), 8, rm
    )
    assert failed.tolist() == [False, True, False, False] and rewards[[0, 2, 3]].tolist() == [1.0, 2.0, 3.0]
    assert summary["reward_failed"] == 1 and summary["reward_failed_fraction"] == 0.25


def test_failed_reward_model_scores_are_summed_over_the_draws_of_a_step():
    """Dynamic sampling draws a step in several parts: the count of failed scores is their sum, the
    reward model's mean score a mean weighted by each draw's samples."""
    import torch

    from posttrain.rollout.episodes import mean_metrics
    from posttrain.rollout.reward_model import RewardModelConfig, combine_rewards

    nan, cfg = float("nan"), RewardModelConfig(path="rm")
    draws = [torch.tensor([nan, 1.0, 1.0, 1.0]), torch.tensor([nan, nan, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0])]
    summaries = [
        combine_rewards(torch.zeros(len(s)), torch.zeros(len(s), dtype=torch.bool), s, cfg)[2] for s in draws
    ]
    merged = mean_metrics(summaries, "reward/", [len(s) for s in draws])
    assert merged["reward/model_failed"] == 3.0
    assert merged["reward/model"] == pytest.approx((4 * 1.0 + 8 * 3.0) / 12)
