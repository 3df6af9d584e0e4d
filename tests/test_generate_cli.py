"""`posttrain generate`: prompts are tokenized as the training run tokenized them (the prompt format a
run's hf/ or an export records: an SFT or GRPO run on the arithmetic task with a chat tokenizer gives
generate the ids it trained on), else as PromptFormatConfig's defaults do (the tokenizer's chat template
when it has one, BOS first); --chat-template and --bos/--no-bos override either. The model's generation
config gives the sampling flags left unset, and a directory that is not a causal LM (a reward model's
export, a peft adapter directory, a posttrain checkpoint) is refused with the way to one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForSequenceClassification, GenerationConfig

from helpers import small_grpo_cfg
from model_zoo import family_config, save_family_model
from posttrain.algorithms.grpo import run_grpo
from posttrain.algorithms.sft import SFTConfig, run_sft
from posttrain.cli import main
from posttrain.config import apply_overrides, build_config
from posttrain.generation import engine as engine_module
from posttrain.models.prompt_record import PROMPT_FORMAT_FILE, write_prompt_format
from posttrain.models.tokenizer import build_char_tokenizer, build_chat_tokenizer
from posttrain.tasks.arithmetic import ArithmeticTaskConfig, split_problems
from posttrain.tasks.build import build_task
from posttrain.tasks.datasets import PromptFormatConfig, format_prompt, prompt_token_ids, tokenize_prompts

SHORT = ["--max-new-tokens", "2"]


@pytest.fixture
def calls(monkeypatch) -> list[tuple[list[list[int]], object]]:
    """The (prompt ids, sampling params) of each engine.generate call the command makes."""
    seen = []
    original = engine_module.GenerationEngine.generate

    def spy(self, prompts, params, *args, **kwargs):
        seen.append((prompts, params))
        return original(self, prompts, params, *args, **kwargs)

    monkeypatch.setattr(engine_module.GenerationEngine, "generate", spy)
    return seen


def model_dir(tmp_path: Path, tokenizer, generation: GenerationConfig | None = None) -> Path:
    out = save_family_model("llama", tokenizer, tmp_path / "model")
    if generation is not None:
        generation.save_pretrained(out)
    return out


def message(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def test_prompts_start_with_bos_as_in_training_and_an_empty_prompt_is_bos_alone(tmp_path, calls, capsys):
    tok = build_char_tokenizer()
    d = str(model_dir(tmp_path, tok))
    trained = tokenize_prompts(["7+5=", ""], tok, PromptFormatConfig(chat_template="never"), False)
    assert trained == [[tok.bos_token_id, *tok("7+5=", add_special_tokens=False)["input_ids"]], [1]]
    assert main(["generate", d, "7+5=", "", "--greedy", *SHORT]) == 0
    assert calls[-1][0] == trained
    assert main(["generate", d, "7+5=", "--greedy", "--no-bos", *SHORT]) == 0
    assert calls[-1][0] == [trained[0][1:]]
    assert main(["generate", d, "", "--no-bos", *SHORT]) == 2
    assert "prompt 1 ('') has no tokens: drop --no-bos" in message(capsys)
    assert main(["generate", d, "7+5=", "--chat-template", "always", *SHORT]) == 2
    assert "the tokenizer of" in message(capsys)


def test_a_chat_tokenizers_prompts_go_through_its_chat_template(tmp_path, calls):
    tok = build_chat_tokenizer()
    d = str(model_dir(tmp_path, tok))
    assert main(["generate", d, "7+5=", "--greedy", *SHORT]) == 0
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "7+5="}], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(calls[-1][0][0]) == "<s>" + chat
    fmt = PromptFormatConfig()
    assert calls[-1][0] == tokenize_prompts([format_prompt("7+5=", tok, fmt, True)], tok, fmt, True)
    assert main(["generate", d, "7+5=", "--greedy", "--chat-template", "never", "--no-bos", *SHORT]) == 0
    assert tok.decode(calls[-1][0][0]) == "7+5="


def test_unset_sampling_flags_come_from_the_models_generation_config(tmp_path, calls):
    tok = build_char_tokenizer()
    sampled = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, eos_token_id=2)
    d = str(model_dir(tmp_path, tok, sampled))
    assert main(["generate", d, "1+2=", *SHORT]) == 0
    p = calls[-1][1]
    assert (p.temperature, p.top_p, p.top_k, p.greedy) == (0.6, 0.9, 20, False)
    assert main(["generate", d, "1+2=", "--top-k", "5", "--top-p", "0.5", *SHORT]) == 0
    p = calls[-1][1]
    assert (p.temperature, p.top_p, p.top_k, p.greedy) == (0.6, 0.5, 5, False)
    assert main(["generate", d, "1+2=", "--greedy", *SHORT]) == 0
    assert calls[-1][1].greedy

    GenerationConfig(do_sample=False, eos_token_id=2).save_pretrained(d)
    assert main(["generate", d, "1+2=", *SHORT]) == 0
    assert calls[-1][1].greedy
    assert main(["generate", d, "1+2=", "--temperature", "0.7", *SHORT]) == 0  # a sampling flag samples
    p = calls[-1][1]
    assert (p.temperature, p.top_p, p.top_k, p.greedy) == (0.7, 1.0, 0, False)

    (Path(d) / "generation_config.json").unlink()  # derived from the model config: posttrain's defaults
    assert main(["generate", d, "1+2=", *SHORT]) == 0
    p = calls[-1][1]
    assert (p.temperature, p.top_p, p.top_k, p.greedy) == (1.0, 1.0, 0, False)


def test_a_reward_model_export_is_refused_not_given_a_random_lm_head(tmp_path, capsys):
    tok = build_char_tokenizer()
    config = family_config("llama", len(tok), num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    assert main(["generate", str(tmp_path / "rm"), "1+2=", "--greedy", *SHORT]) == 1
    said = message(capsys)
    assert "is a LlamaForSequenceClassification: a reward model or critic" in said
    assert "does not generate" in said and "AutoModelForSequenceClassification" in said


def test_an_adapter_directory_and_a_checkpoint_are_refused_with_the_way_to_a_model(tmp_path, capsys):
    tok = build_char_tokenizer()
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    tok.save_pretrained(adapter)
    assert main(["generate", str(adapter), "1+2=", *SHORT]) == 1
    said = message(capsys)
    assert f"'{adapter}' is a peft adapter directory" in said
    assert "without --adapter" in said and "peft.PeftModel.from_pretrained" in said
    assert "'/models/base'" in said and "model_type" not in said

    ckpt = tmp_path / "ckpt"
    (ckpt / "hf").mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    assert main(["generate", str(ckpt), "1+2=", *SHORT]) == 1
    said = message(capsys)
    assert f"'{ckpt}' is a posttrain checkpoint directory" in said
    assert f"`posttrain export {ckpt} OUT_DIR`" in said and "policy.model" not in said

    d = model_dir(tmp_path, tok)  # a model directory that also holds a file of that name is a model
    (d / "metadata.json").write_text("{}")
    assert main(["generate", str(d), "1+2=", "--greedy", *SHORT]) == 0


def test_a_model_without_tokenizer_files_takes_one_from_the_tokenizer_flag(tmp_path, calls, capsys):
    tok = build_char_tokenizer()
    d = model_dir(tmp_path, tok)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    assert main(["generate", str(d), "1+2=", *SHORT]) == 1
    assert "(generate --tokenizer DIR_OR_HUB_NAME)" in message(capsys)
    tok.save_pretrained(tmp_path / "tok")
    assert main(["generate", str(d), "1+2=", "--tokenizer", str(tmp_path / "tok"), *SHORT]) == 0
    assert calls[-1][0][0][0] == tok.bos_token_id


@pytest.mark.parametrize(
    ("written", "greedy"),
    [
        ({"do_sample": True, "temperature": 0.0}, True),
        ({"do_sample": True, "top_p": 0.0, "top_k": -1}, False),
    ],
)
def test_a_generation_config_outside_the_flags_range_is_read_as_transformers_reads_it(
    tmp_path, calls, written, greedy
):
    """Temperature 0 is greedy decoding; a top_p of 0 or a negative top_k (which transformers refuses or
    ignores) falls back to the defaults instead of failing the command; --greedy drops the model's
    sampling settings whatever they are."""
    d = model_dir(tmp_path, build_char_tokenizer())
    (d / "generation_config.json").write_text(json.dumps({**written, "eos_token_id": 2}))
    assert main(["generate", str(d), "1+2=", *SHORT]) == 0
    p = calls[-1][1]
    assert (p.greedy, p.top_p, p.top_k) == (greedy, 1.0, 0)
    assert main(["generate", str(d), "1+2=", "--greedy", *SHORT]) == 0
    assert calls[-1][1].greedy and calls[-1][1].temperature == 1.0


CHAT = "policy.model.tokenizer=tiny-chat"  # the char tokenizer with a chat template


def trained_prompts(task_cfg, n: int = 3) -> tuple[list[str], list[list[int]]]:
    """The raw texts of `n` of a task's training prompts and the token ids its training run gives them."""
    sources = split_problems(task_cfg)[0]
    items = build_task(task_cfg, build_chat_tokenizer()).train.items[:n]
    texts = {src.prompt_id: src.text for src in sources}
    return [texts[it.prompt_id] for it in items], [it.prompt_token_ids for it in items]


def test_a_grpo_runs_export_generates_from_the_prompt_ids_the_run_trained_on(tmp_path, calls):
    """The arithmetic task never uses a chat template: its export records that, so a tokenizer that has
    one does not wrap the prompts; without the record the defaults apply, and the flags override it."""
    cfg = small_grpo_cfg(tmp_path / "run", CHAT, "grpo.max_num_steps=1", "grpo.val_period=0")
    run_grpo(cfg)
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run" / "checkpoints" / "step_1"), str(out)]) == 0
    recorded = json.loads((out / PROMPT_FORMAT_FILE).read_text())
    assert recorded == cfg.task.prompt_format.model_dump(mode="json")
    assert recorded["chat_template"] == "never"
    texts, trained = trained_prompts(cfg.task)
    assert main(["generate", str(out), *texts, "--greedy", *SHORT]) == 0
    assert calls[-1][0] == trained

    tok = build_chat_tokenizer()
    assert main(["generate", str(out), texts[0], "--greedy", "--chat-template", "auto", *SHORT]) == 0
    assert calls[-1][0] == prompt_token_ids(texts[:1], tok, PromptFormatConfig())
    (out / PROMPT_FORMAT_FILE).unlink()  # no record: the tokenizer's chat template, BOS first
    assert main(["generate", str(out), texts[0], "--greedy", *SHORT]) == 0
    assert calls[-1][0] == prompt_token_ids(texts[:1], tok, PromptFormatConfig())
    assert tok.decode(calls[-1][0][0]).startswith("<s><|im_start|>user")


def test_an_sft_runs_hf_directory_generates_with_its_template_and_system_prompt(tmp_path, calls):
    task = {
        "prompt_format": {
            "chat_template": "always",
            "system_prompt": "Reply with the number.",
            "template": "Compute {prompt}",
            "max_prompt_tokens": 128,
        }
    }
    sft = {
        "policy": {"model": {"tokenizer": "tiny-chat", "tiny": {"hidden_size": 32, "intermediate_size": 64}}},
        "task": task,
        "max_num_steps": 1,
        "val_period": 0,
        "output_dir": str(tmp_path / "run"),
        "logging": {"progress_bar": False},
    }
    cfg = build_config(SFTConfig, apply_overrides(sft, []))
    run_sft(cfg)
    hf = tmp_path / "run" / "hf"
    assert json.loads((hf / PROMPT_FORMAT_FILE).read_text()) == cfg.task.prompt_format.model_dump(mode="json")
    texts, trained = trained_prompts(cfg.task)
    assert main(["generate", str(hf), *texts, "--greedy", *SHORT]) == 0
    assert calls[-1][0] == trained
    shown = build_chat_tokenizer().decode(calls[-1][0][0])
    assert "Reply with the number." in shown and f"Compute {texts[0]}" in shown


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_a_preference_runs_hf_directory_records_its_pairs_prompt_format(tmp_path, calls, command):
    """The built-in pairs are the arithmetic task's prompts, in its format (no chat template)."""
    policy = {
        "model": {"tokenizer": "tiny-chat", "tiny": {"hidden_size": 32, "intermediate_size": 64}},
        "train_global_batch_size": 8,
        "microbatch": {"train_micro_batch_size": 8},
        "init_reference_model": False,
    }
    if command == "rm":
        policy["model"]["head"] = "score"
    run = {"policy": policy, "max_num_steps": 1, "val_period": 0, "output_dir": str(tmp_path / "run")}
    assert (
        main([command, *(f"{k}={json.dumps(v)}" for k, v in run.items()), "logging.progress_bar=false"]) == 0
    )
    hf = tmp_path / "run" / "hf"
    want = ArithmeticTaskConfig().prompt_format.model_dump(mode="json")
    assert want["chat_template"] == "never"
    assert json.loads((hf / PROMPT_FORMAT_FILE).read_text()) == want
    if command == "dpo":
        assert main(["generate", str(hf), "7+5=", "--greedy", *SHORT]) == 0
        assert calls[-1][0] == prompt_token_ids(["7+5="], build_chat_tokenizer(), PromptFormatConfig(**want))


def test_flags_override_the_recorded_prompt_format(tmp_path, calls, capsys):
    tok = build_chat_tokenizer()
    d = model_dir(tmp_path, tok)
    recorded = {"chat_template": "never", "prepend_bos": False, "template": "Q: {prompt}\nA:"}
    write_prompt_format(d, recorded)
    plain = tok("Q: 7+5=\nA:", add_special_tokens=False)["input_ids"]
    assert main(["generate", str(d), "7+5=", "--greedy", *SHORT]) == 0
    assert calls[-1][0] == [plain]
    assert main(["generate", str(d), "7+5=", "--greedy", "--bos", *SHORT]) == 0
    assert calls[-1][0] == [[tok.bos_token_id, *plain]]
    assert main(["generate", str(d), "7+5=", "--greedy", "--chat-template", "auto", *SHORT]) == 0
    chat = PromptFormatConfig(template="Q: {prompt}\nA:", prepend_bos=False)
    assert calls[-1][0] == prompt_token_ids(["7+5="], tok, chat)
    assert tok.decode(calls[-1][0][0]).startswith("<|im_start|>user\nQ: 7+5=")
    write_prompt_format(d, {"chat_template": "never", "prepend_bos": False})  # "" has no tokens then
    assert main(["generate", str(d), "", *SHORT]) == 2
    assert "prompt 1 ('') has no tokens: pass --bos" in message(capsys)
    assert main(["generate", str(d), "", "--bos", "--greedy", *SHORT]) == 0
    assert calls[-1][0] == [[tok.bos_token_id]]

    write_prompt_format(d, {"chat_template": "always"})  # a tokenizer without one is refused, with the fix
    plain_tok = build_char_tokenizer()
    plain_tok.save_pretrained(tmp_path / "plain")
    assert main(["generate", str(d), "1+2=", "--tokenizer", str(tmp_path / "plain"), *SHORT]) == 2
    said = message(capsys)
    assert f"recorded in '{d / PROMPT_FORMAT_FILE}'" in said and "--chat-template auto or never" in said
    assert (
        main(
            [
                "generate",
                str(d),
                "1+2=",
                "--tokenizer",
                str(tmp_path / "plain"),
                "--chat-template",
                "never",
                *SHORT,
            ]
        )
        == 0
    )
    write_prompt_format(d, {"chat_template": "sometimes"})  # a damaged record names the file
    assert main(["generate", str(d), "1+2=", *SHORT]) == 2
    assert f"the prompt format in '{d / PROMPT_FORMAT_FILE}'" in message(capsys)
