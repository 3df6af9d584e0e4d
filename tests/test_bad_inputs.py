"""Every bad input gets one clear message: the table of issue 21.

Each row runs the CLI in this process (`posttrain.cli.main`) on one bad input and asserts a non-zero
exit, no traceback, and a message that names the file, key or path and the fix (whitespace is
normalised). `--debug` shows the traceback instead (last tests).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import subprocess_env
from posttrain.cli import main
from posttrain.config import ConfigError
from posttrain.logging import get_logger

get_logger(__name__)  # the log handler binds the session's stderr now, not one test's capsys stream

# A tiny, fast GRPO run: 2 prompts x 2 samples, one step, no validation or checkpoint.
SMALL = [
    "policy.model.tiny.hidden_size=32",
    "policy.model.tiny.intermediate_size=64",
    "grpo.num_generations_per_prompt=2",
    "policy.train_global_batch_size=4",
    "policy.microbatch.train_micro_batch_size=4",
    "grpo.val_at_start=false",
    "grpo.val_period=0",
    "checkpointing.enabled=false",
    "logging.progress_bar=false",
]
SYNC = ["grpo.num_prompts_per_step=2", "grpo.max_num_steps=1"]
ASYNC = ["async_grpo.target_prompt_groups_per_step=2", "async_grpo.num_steps=1"]
CHAT_ENV = ["env.name=guess", "policy.model.tokenizer=tiny-chat"]  # an environment and a chat template


def make_files(t: Path) -> None:
    """The bad (and the good) inputs the rows point at."""
    (t / "bad.yaml").write_text("policy:\n  optimizer: {lr: 1e-3\ngrpo: {max_num_steps: 2}\n")
    (t / "list.yaml").write_text("- policy\n- grpo\n")
    (t / "section.yaml").write_text("policy: 3\n")
    (t / "afile").write_text("not a directory\n")
    rows = [{"problem": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    (t / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    long = [{"problem": "1+" * 300 + f"{i}=", "answer": "1"} for i in range(4)]  # 603 tokens
    (t / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long))
    (t / "rw_raise.py").write_text("def reward(p, c, m):\n    raise RuntimeError('boom in reward')\n")
    (t / "rw_nameerr.py").write_text("x = undefined_name\n")
    (t / "rw_syntax.py").write_text("def reward(p, c, m)\n    return [1.0]\n")
    (t / "rw_imports.py").write_text("import nonexistent_mod_xyz\n")
    (t / "notok").mkdir()
    (t / "notok" / "config.json").write_text('{"model_type": "llama"}\n')


def custom(t: Path, data: str = "data.jsonl", reward: str = "rw_raise.py:reward") -> list[str]:
    return ["task.name=custom", f"task.dataset.train_path={t / data}", f"task.reward_fn={t / reward}"]


@dataclass
class Row:
    """`argv(tmp)`, the exit code, what the message must say and must not say."""

    name: str
    argv: Callable[[Path], list[str]]
    code: int
    says: Callable[[Path], list[str]]
    not_says: list[str] = field(default_factory=list)
    max_chars: int = 1200  # one message, not a dump
    env: dict[str, str] = field(default_factory=dict)

    def param(self, *marks):
        return pytest.param(self, id=self.name, marks=marks)


ROWS = [
    # ---- config files and overrides
    Row(
        "yaml-syntax-error",
        lambda t: ["grpo", "--config", str(t / "bad.yaml")],
        2,
        lambda t: [f"config file '{t / 'bad.yaml'}' is not valid YAML", "line 3", "starts at line 2"],
    ).param(),
    Row(
        "yaml-not-a-mapping",
        lambda t: ["sft", "--config", str(t / "list.yaml")],
        2,
        lambda t: [str(t / "list.yaml"), "must hold a mapping at the top level", "not a list"],
    ).param(),
    Row(
        "config-file-missing",
        lambda t: ["grpo", "--config", str(t / "nope.yaml")],
        2,
        lambda t: [f"config file '{t / 'nope.yaml'}' does not exist"],
    ).param(),
    Row(
        "section-wrong-type",
        lambda t: ["grpo", "--config", str(t / "section.yaml")],
        2,
        lambda t: ["bad value for 'policy'", "(got 3)"],
    ).param(),
    Row(  # a check of a whole section used to print the section's 1-4 KB of values
        "section-check-no-dump",
        lambda t: ["grpo", "policy.cluster.num_workers=2"],
        2,
        lambda t: ["bad value for 'policy'", "cluster.num_workers=2 needs cluster.backend='ray'"],
        not_says=["'optimizer'", "'microbatch'", "Value error"],
        max_chars=300,
    ).param(),
    Row(
        "long-value-cut",
        lambda t: ["grpo", "policy.optimizer.lr=" + "x" * 3000],
        2,
        lambda t: ["bad value for 'policy.optimizer.lr'", "(got 'xxxx", "xxx...)"],
        max_chars=400,
    ).param(),
    Row(  # rich markup used to eat "[float]"
        "missing-key-keeps-brackets",
        lambda t: ["grpo", "task.name=custom", f"task.dataset.train_path={t / 'data.jsonl'}"],
        2,
        lambda t: ["required key 'task.reward_fn' is missing", "-> list[float]"],
    ).param(),
    Row(
        "unknown-key",
        lambda t: ["grpo", "grpo.num_prompts_per_stepp=4"],
        2,
        lambda t: [
            "unknown config key 'grpo.num_prompts_per_stepp'",
            "Did you mean 'grpo.num_prompts_per_step'",
        ],
    ).param(),
    Row(
        "override-without-equals",
        lambda t: ["grpo", "policy.optimizer.lr"],
        2,
        lambda t: ["override 'policy.optimizer.lr' has no '='", "e.g. policy.optimizer.lr=1e-4"],
        not_says=["policy.lr="],  # not a key
    ).param(),
    Row(
        "env-without-name",
        lambda t: ["grpo", "env.limits.max_turns=3"],
        2,
        lambda t: ["set env.name (one of 'calculator', 'guess', 'code', 'custom')"],
        not_says=["discriminator"],
    ).param(),
    # ---- refused at load (exit 2), not when the run builds the policy or the reward model (exit 1)
    Row(
        "scheduler-stage-without-steps",
        lambda t: ["grpo", "policy.scheduler=[{kind: linear}]"],
        2,
        lambda t: ["bad value for 'policy.scheduler.0'", "'linear' scheduler stage needs steps > 0"],
    ).param(),
    Row(
        "optimizer-not-importable",
        lambda t: ["grpo", "policy.optimizer.name=torch.optim.AdamWW"],
        2,
        lambda t: ["bad value for 'policy.optimizer.name'", "cannot import 'torch.optim.AdamWW'"],
    ).param(),
    Row(
        "reward-model-workers-on-the-local-backend",
        lambda t: ["grpo", "reward_model.path=x", "reward_model.cluster.num_workers=2"],
        2,
        lambda t: ["reward_model.cluster.num_workers=2 needs reward_model.cluster.backend='ray'"],
    ).param(),
    Row(
        "reward-model-context-parallel",
        lambda t: [
            "grpo",
            "reward_model.path=x",
            "reward_model.cluster.backend=ray",
            "reward_model.cluster.num_workers=2",
            "reward_model.parallel.context_parallel_size=2",
        ],
        2,
        lambda t: ["reward_model.parallel.context_parallel_size=2: context parallelism is not implemented"],
        not_says=["policy.model.head"],  # a key of a section the user never wrote
    ).param(),
    # ---- silent nonsense refused
    Row(
        "group-of-one-sync",
        lambda t: ["grpo", "grpo.num_generations_per_prompt=1"],
        2,
        lambda t: ["grpo.num_generations_per_prompt=1", "every advantage is 0", "Use 2 or more"],
    ).param(),
    Row(
        "group-of-one-async",
        lambda t: ["grpo-async", "grpo.num_generations_per_prompt=1"],
        2,
        lambda t: ["grpo.num_generations_per_prompt=1", "every advantage is 0", "Use 2 or more"],
    ).param(),
    Row(
        "global-batch-does-not-divide-step",
        lambda t: ["grpo", "policy.train_global_batch_size=48"],
        2,
        lambda t: [
            "policy.train_global_batch_size=48 does not divide the 128 samples of a step",
            "grpo.num_prompts_per_step=16 x grpo.num_generations_per_prompt=8",
            "32 real rows padded to 48",
            "Use one of 1, 2, 4, 8, 16, 32, 64, 128",
        ],
    ).param(),
    Row(
        "global-batch-above-step",
        lambda t: ["grpo", "policy.train_global_batch_size=256"],
        2,
        lambda t: ["policy.train_global_batch_size=256", "128 real rows padded to 256", "Use one of"],
    ).param(),
    Row(
        "prompt-plus-completion-over-context-sync",
        lambda t: (
            ["grpo", f"output_dir={t / 'run'}", *SMALL, *SYNC, *custom(t, "long.jsonl")]
            + ["task.prompt_format.max_prompt_tokens=4000"]
        ),
        1,
        lambda t: [
            "the longest prompt has 603 tokens and sampling.max_new_tokens=8",
            "needs 611 positions, but the model 'tiny' has 512 (max_position_embeddings)",
            "task.prompt_format.max_prompt_tokens=504",
        ],
    ).param(),
    Row(
        "prompt-plus-completion-over-context-async",
        lambda t: (
            ["grpo-async", f"output_dir={t / 'run'}", *SMALL, *ASYNC]
            + ["policy.model.tiny.max_position_embeddings=8"]
        ),
        1,
        lambda t: ["sampling.max_new_tokens=8", "the model 'tiny' has 8 (max_position_embeddings)"],
    ).param(),
    Row(
        "max-model-len-over-context",
        lambda t: ["grpo", f"output_dir={t / 'run'}", *SMALL, *SYNC, "generation.max_model_len=1024"],
        1,
        lambda t: ["generation.max_model_len=1024 is more positions than the model 'tiny' has 512"],
    ).param(),
    Row(
        "max-model-len-below-env-max-tokens-sync",
        lambda t: [
            "grpo",
            f"output_dir={t / 'run'}",
            *SMALL,
            *SYNC,
            *CHAT_ENV,
            "generation.max_model_len=24",
        ],
        1,
        lambda t: [
            "generation.max_model_len=24 is below env.limits.max_tokens=160",
            "raise generation.max_model_len to at least 160",
            "or lower env.limits.max_tokens",
        ],
    ).param(),
    Row(
        "max-model-len-below-env-max-tokens-async",
        lambda t: (
            ["grpo-async", f"output_dir={t / 'run'}", *SMALL, *ASYNC, *CHAT_ENV]
            + ["generation.max_model_len=100", "env.limits.max_tokens=120"]
        ),
        1,
        lambda t: ["generation.max_model_len=100 is below env.limits.max_tokens=120"],
    ).param(),
    Row(
        "sft-example-over-context",
        lambda t: ["sft", f"output_dir={t / 'run'}", "policy.model.tiny.max_position_embeddings=6"],
        1,
        lambda t: ["the longest SFT example has", "has 6 positions (max_position_embeddings)"],
    ).param(),
    # ---- output directories
    Row(
        "output-dir-under-a-file",
        lambda t: ["sft", f"output_dir={t / 'afile' / 'run'}"],
        1,
        lambda t: [f"output_dir='{t / 'afile' / 'run'}' cannot be used", f"'{t / 'afile'}' is a file"],
    ).param(),
    Row(
        "output-dir-not-writable",
        lambda t: ["grpo", f"output_dir={t / 'locked' / 'run'}"],
        1,
        lambda t: [f"'{t / 'locked'}' is not writable", "Set output_dir="],
    ).param(pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")),
    # ---- reward functions
    Row(
        "reward-module-not-found",
        lambda t: (
            ["grpo", f"output_dir={t / 'run'}", *SMALL, *SYNC, *custom(t)]
            + ["task.reward_fn=no_such_pkg_xyz.rewards:score"]
        ),
        1,
        lambda t: [
            "reward function 'no_such_pkg_xyz.rewards:score'",
            "cannot import module 'no_such_pkg_xyz'",
        ],
    ).param(),
    Row(
        "reward-module-raises-on-import",
        lambda t: ["grpo", f"output_dir={t / 'run'}", *SMALL, *SYNC, *custom(t, reward="rw_nameerr.py:r")],
        1,
        lambda t: ["NameError: name 'undefined_name' is not defined", f"({t / 'rw_nameerr.py'}, line 1)"],
    ).param(),
    Row(
        "reward-module-syntax-error",
        lambda t: ["grpo", f"output_dir={t / 'run'}", *SMALL, *SYNC, *custom(t, reward="rw_syntax.py:r")],
        1,
        lambda t: ["SyntaxError: expected ':'", f"({t / 'rw_syntax.py'}, line 1)", "Fix the module"],
    ).param(),
    Row(
        "reward-module-imports-missing-package",
        lambda t: ["grpo", f"output_dir={t / 'run'}", *SMALL, *SYNC, *custom(t, reward="rw_imports.py:r")],
        1,
        lambda t: [
            "cannot import module 'nonexistent_mod_xyz'",
            f"imported at {t / 'rw_imports.py'}, line 1",
        ],
    ).param(),
    Row(
        "reward-name-not-in-module",
        lambda t: ["grpo", f"output_dir={t / 'run'}", *SMALL, *SYNC, *custom(t, reward="rw_raise.py:nope")],
        1,
        lambda t: ["has no attribute 'nope'", "Callables there: reward"],
    ).param(),
    Row(
        "reward-raises-sync",
        lambda t: ["grpo", f"output_dir={t / 'run'}", *SMALL, *SYNC, *custom(t)],
        1,
        lambda t: [
            f"reward function error: reward function '{t / 'rw_raise.py'}:reward' failed on 4 of 4",
            f"RuntimeError: boom in reward ({t / 'rw_raise.py'}, line 2)",
            "task.reward.max_failed_fraction",
        ],
    ).param(),
    Row(
        "reward-raises-sync-on-error-raise",
        lambda t: (
            ["grpo", f"output_dir={t / 'run'}", *SMALL, *SYNC, *custom(t)]
            + ["task.reward.on_reward_error=raise"]
        ),
        1,
        lambda t: ["RuntimeError: boom in reward", "task.reward.on_reward_error=skip_sample"],
    ).param(),
    Row(
        "reward-raises-async",
        lambda t: ["grpo-async", f"output_dir={t / 'run'}", *SMALL, *ASYNC, *custom(t)],
        1,
        lambda t: [f"the reward function '{t / 'rw_raise.py'}:reward' failed on 100%", "max_failed_fraction"],
    ).param(),
    # ---- `posttrain generate`: its options and its model path
    Row(
        "generate-bad-option",
        lambda t: ["generate", str(t / "nope"), "1+1=", "--max-new-tokens", "0", "--temperature", "0"],
        2,
        lambda t: [
            "bad value for --max-new-tokens: max_new_tokens must be >= 1",
            "bad value for --temperature",
            "for greedy decoding pass --greedy",
        ],
        not_says=["pydantic", "validation error for", "greedy=True"],
    ).param(),
    Row(
        "generate-model-path-missing",
        lambda t: ["generate", str(t / "nope"), "1+1="],
        1,
        lambda t: [f"model path '{t / 'nope'}' does not exist", "Pass an existing directory"],
        not_says=["Repo id", "repo_name"],
    ).param(),
    Row(
        "generate-relative-model-path-missing",
        lambda t: ["generate", "./no-such-model-dir", "1+1="],
        1,
        lambda t: ["model path './no-such-model-dir' does not exist", "Pass an existing directory"],
        not_says=["Repo id"],
    ).param(),
    Row(
        "generate-model-path-is-a-file",
        lambda t: ["generate", str(t / "data.jsonl"), "1+1="],
        1,
        lambda t: [f"model path '{t / 'data.jsonl'}' is a file"],
    ).param(),
    Row(
        "generate-model-dir-without-tokenizer",
        lambda t: ["generate", str(t / "notok"), "1+1="],
        1,
        lambda t: [f"model directory '{t / 'notok'}' has no tokenizer files", "generate --tokenizer"],
        not_says=["sentencepiece", "tiktoken", "policy.model.tokenizer"],
    ).param(),
    Row(  # no network here: one short request, no retries; with network: not on the hub
        "generate-hub-name-unreachable-or-unknown",
        lambda t: ["generate", "posttrain-no-such-org/no-such-model-h21", "1+1="],
        1,
        lambda t: ["'posttrain-no-such-org/no-such-model-h21' is not a local directory"],
    ).param(),
    Row(
        "generate-hub-name-offline",
        lambda t: ["generate", "posttrain-no-such-org/offline-model-h21", "1+1="],
        1,
        lambda t: ["is not a local directory", "HF_HUB_OFFLINE set", "it is not in the cache"],
        env={"HF_HUB_OFFLINE": "1"},
    ).param(),
]


@pytest.mark.parametrize("row", ROWS)
def test_bad_input_gets_one_clear_message(row: Row, tmp_path, capsys, monkeypatch):
    make_files(tmp_path)
    (tmp_path / "locked").mkdir(mode=0o500)
    monkeypatch.chdir(tmp_path)
    for key, value in row.env.items():
        monkeypatch.setenv(key, value)
    t0 = time.perf_counter()
    code = main(row.argv(tmp_path))
    seconds = time.perf_counter() - t0
    out = capsys.readouterr()
    assert code == row.code, out.err
    assert "Traceback" not in out.out + out.err
    lines = out.err.splitlines()  # log lines, then the message, then the hint about --debug
    first = max(
        i for i, line in enumerate(lines) if re.match(r"(config error|reward function error|error): ", line)
    )
    message = " ".join(" ".join(lines[first:]).split()).split(" (run again with --debug")[0]
    for text in row.says(tmp_path):
        assert text in message, message
    for text in row.not_says:
        assert text not in message, message
    assert len(message) <= row.max_chars, message
    assert seconds < 30, f"{row.name} took {seconds:.0f} s"  # an offline hub name used to take 52 s


def test_debug_shows_the_traceback(tmp_path):
    make_files(tmp_path)
    bad = ["--config", str(tmp_path / "bad.yaml")]
    with pytest.raises(ConfigError, match="not valid YAML"):
        main(["--debug", "grpo", *bad])
    with pytest.raises(ConfigError, match="not valid YAML"):
        main(["grpo", "--debug", *bad])


def test_the_command_exits_cleanly_without_debug_and_with_a_traceback_with_it(tmp_path):
    make_files(tmp_path)
    argv = [sys.executable, "-m", "posttrain.cli", "grpo", "--config", str(tmp_path / "bad.yaml")]
    env = subprocess_env()  # this checkout's package, not an installed one
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert "bad.yaml' is not valid YAML" in plain.stderr and not plain.stdout
    debug = subprocess.run([*argv, "--debug"], capture_output=True, text=True, timeout=120, env=env)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_a_library_config_error_is_one_message_naming_the_value():
    from pydantic import ValidationError

    from posttrain.cli import user_error
    from posttrain.generation.params import SamplingParams

    with pytest.raises(ValidationError) as info:
        SamplingParams(top_p=3.0)
    label, code, text = user_error(info.value)
    assert (label, code) == ("error", 1)
    assert (
        text.startswith("invalid SamplingParams:") and "bad value for 'top_p'" in text and "(got 3.0)" in text
    )


def test_the_asynchronous_loop_says_it_ignores_the_global_batch_size(tmp_path, caplog):
    argv = [
        "grpo-async",
        f"output_dir={tmp_path / 'run'}",
        *SMALL,
        *ASYNC,
        "policy.train_global_batch_size=8",
    ]
    argv.append("policy.model.tiny.max_position_embeddings=8")  # then stop before any rollout
    assert main(argv) == 1
    assert "policy.train_global_batch_size=8 is ignored by the asynchronous loop" in caplog.text
    assert "target_prompt_groups_per_step x grpo.num_generations_per_prompt = 4 samples" in caplog.text
