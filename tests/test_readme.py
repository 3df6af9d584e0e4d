"""Every command of the README runs as written, in README order, in a fresh directory holding a copy of
configs/ (a command that needs a GPU or the hub is checked as far as this machine can: its config
validates). Commands that take minutes as written get a few step-limit overrides appended (SHORT); a
placeholder path is replaced by a model an earlier command made, and a checkpoint path by the step a
shortened run saved (PLACEHOLDERS). The error example's
output is checked against what the README shows."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import logging_packages_found, subprocess_env
from posttrain.cli import build_parser

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

SKIP = {  # command prefix -> why it is not run here (its config is still validated where it has one)
    "make test": "this suite is what it runs",
    "make demo": "`posttrain demo` after set-up: run below (its time and accuracy: benchmarks/RESULTS.md)",
    "posttrain grpo --config configs/grpo_qwen2.5_math_gpu.yaml": "a GPU and the hub",
    "posttrain demo --config configs/grpo_arithmetic_moe.yaml": "run in full by tests/test_moe.py's learning test",
    "posttrain ppo --config configs/ppo_arithmetic.yaml": "run by tests/test_ppo.py's learning test",
}
SHORT = {  # command prefix -> overrides appended: as written these take minutes on a CPU (their learning
    # is tested by tests/test_demo.py, test_dpo.py, test_lora.py, test_async_run.py; this test is about
    # the commands running as written)
    "posttrain demo": ["sft.max_num_steps=10", "grpo.grpo.max_num_steps=2", "grpo.grpo.val_period=2"],
    "posttrain sft --config configs/sft_arithmetic.yaml": ["max_num_steps=20", "val_period=10"],
    "posttrain grpo --config configs/grpo_arithmetic.yaml": ["grpo.max_num_steps=20"],
    "posttrain dpo": ["max_num_steps=20", "val_period=10"],
    "posttrain grpo --config configs/grpo_arithmetic_lora.yaml": ["grpo.max_num_steps=20"],
    "posttrain grpo-async --config configs/grpo_async_arithmetic.yaml": ["async_grpo.num_steps=10"],
    "posttrain grpo-async env.name=calculator": ["async_grpo.num_steps=2", "grpo.val_period=0"],
    "posttrain rm": ["max_num_steps=20", "val_period=10"],
    "posttrain grpo env.name=custom": [
        "grpo.max_num_steps=1",
        "grpo.num_prompts_per_step=2",
        "policy.train_global_batch_size=16",
        "env.limits.max_tokens=512",  # the stand-in chat model has 512 positions
    ],
}
PLACEHOLDERS = {  # a placeholder path, or a checkpoint a shortened run (SHORT) saves under another step
    "/path/to/chat_model": "runs/demo_calculator/sft/hf",
    "runs/grpo_arithmetic/checkpoints/step_50": "runs/grpo_arithmetic/checkpoints/step_20",
    "runs/grpo_arithmetic_lora/checkpoints/step_100": "runs/grpo_arithmetic_lora/checkpoints/step_20",
}


def commands() -> list[str]:
    """The command lines of the README's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(shlex.join(words))
    return out


def fill(word: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        word = word.replace(placeholder, value)
    return word


def matching(table: dict, command: str):
    hits = [v for k, v in table.items() if command.startswith(k)]
    assert len(hits) <= 1, command
    return hits[0] if hits else None


def test_the_tables_name_only_commands_of_the_readme():
    cmds = commands()
    for prefix in [*SKIP, *SHORT]:
        assert any(c.startswith(prefix) for c in cmds), f"{prefix!r} is no longer in the README"
    assert len(cmds) >= 15


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *argv],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )


def validate(words: list[str], cwd: Path) -> None:
    """A command not run here: its arguments parse and its config builds (as its command's config)."""
    from posttrain.cli import config_class
    from posttrain.config import load_config

    args = build_parser().parse_args(words[1:])
    with logging_packages_found():  # the GPU example logs to TensorBoard, not installed here
        load_config(config_class(args.command), cwd / args.config, args.overrides)


def test_every_readme_command_runs_as_written(tmp_path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    my_env = README.split("```python\n# my_env.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_env.py").write_text(my_env)
    (tmp_path / "cities.jsonl").write_text(
        '{"city": "Paris", "answer": "18"}\n{"city": "Oslo", "answer": "4"}\n'
    )
    ran = []
    for command in commands():
        words = shlex.split(command)
        if matching(SKIP, command) is not None:  # the reason is in SKIP
            if words[0] == "posttrain":
                validate(words, tmp_path)
            continue
        assert words[0] == "posttrain", f"{command!r}: add it to SKIP with the reason, or make it run here"
        words = [fill(w) for w in words]
        started = time.monotonic()
        done = run(words[1:] + (matching(SHORT, command) or []), tmp_path)
        print(f"{time.monotonic() - started:5.1f} s  {command}")  # shown with -s: what the test costs
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        noise = [w for w in ("Traceback", "Warning", " WARNING]") if w in done.stdout + done.stderr]
        assert not noise, (command, noise, done.stderr[-3000:])  # a README command runs clean
        ran.append(words[1])
    assert ran.count("demo") == 4 and {"sft", "grpo", "grpo-async", "export", "generate"} <= set(ran)
    assert (tmp_path / "out_hf" / "config.json").is_file()
    assert (tmp_path / "out_adapter" / "adapter_config.json").is_file()


def test_the_error_example_prints_what_the_readme_shows(tmp_path):
    shown = README.split("```\n$ posttrain grpo policy.optimizer.lrr=1\n", 1)[1].split("```", 1)[0]
    done = run(["grpo", "policy.optimizer.lrr=1"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == shown.strip()
