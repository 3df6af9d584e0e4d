"""`posttrain config show COMMAND [PREFIX]` (issue 21, item 5): every key of a command's config with its
type, default (or, given --config / overrides, value) and description.

The listing is checked against what the config accepts: each shown value, passed back as `key=value`
(with the override that selects its alternative), builds a config that holds exactly that value.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from posttrain.cli import CONFIG_COMMANDS, config_class, main
from posttrain.config import apply_overrides, load_config
from posttrain.config_keys import config_keys, render, select, yaml_text


def show(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `posttrain config show ARGV...`, run in this process."""
    code = main(["config", "show", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows(out: str) -> dict[str, list[str]]:
    """KEY -> [TYPE, VALUE] of each key line of a listing (columns are 2+ spaces apart; a key shown under
    several alternatives keeps its first line)."""
    found: dict[str, list[str]] = {}
    for line in out.splitlines()[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if line.startswith(" " * 4) or line.lstrip().startswith("(") or len(cells) < 2:
            continue  # a description, a note or a blank line
        found.setdefault(cells[0], cells[1:])
    return found


def description_after(out: str, key: str) -> str:
    """The description under the first line of `key`: the lines indented 4 more than it."""
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.strip().startswith(key + " "))
    indent = " " * (len(lines[i]) - len(lines[i].lstrip()) + 4)
    text = []
    for line in lines[i + 1 :]:
        if not line.startswith(indent) or line.startswith(indent + " "):
            break
        text.append(line.strip())
    return " ".join(text)


def value_at(cfg, path: str):
    """The JSON value of dotted `path` in a built config."""
    node = cfg.model_dump(mode="json")
    for part in path.split("."):
        node = node[part]
    return node


def test_a_key_shows_its_type_built_default_and_description(capsys):
    code, out, _ = show(capsys, "grpo", "policy.optimizer")
    assert code == 0
    assert out.splitlines()[0].split() == ["KEY", "TYPE", "DEFAULT"]
    # a GRPO run's policy is built by a default_factory with lr=1e-3 (OptimizerConfig's own is 1e-5)
    assert rows(out)["policy.optimizer.lr"] == ["float", "0.001"]
    assert "learning rate" in description_after(out, "policy.optimizer.lr")
    assert rows(out)["policy.optimizer.kwargs"] == ["dict[str, Any]", "{}"]
    assert "extra constructor arguments" in description_after(out, "policy.optimizer.kwargs")


def test_types_are_shown_as_written():
    from posttrain.algorithms.grpo import GRPOConfig

    types = {}
    for k in config_keys(GRPOConfig):
        types.setdefault(k.path, k.type)
    assert types["sampling.stop_token_ids"] == "list[int]"
    assert types["policy.max_grad_norm"] == "float | None"
    assert types["policy.precision"] == "'float32' | 'bfloat16' | 'float16'"
    assert types["task.operations"] == "list['+' | '-' | '*']"
    assert types["loss.truncated_importance_sampling_type"] == "'tis' | 'icepop' | None"
    assert types["policy.scheduler"] == "list[SchedulerStage]"
    assert types["env"] == "EnvConfig | None"  # the union's name, as the field declares it
    assert types["task"] == "TaskConfig"


def test_a_config_file_and_an_override_change_the_shown_value(capsys, tmp_path: Path):
    (tmp_path / "run.yaml").write_text("policy:\n  optimizer: {lr: 3.0e-4}\n")
    code, out, _ = show(capsys, "grpo", "--config", str(tmp_path / "run.yaml"), "grpo.max_num_steps=7")
    assert code == 0
    assert out.splitlines()[0].split() == ["KEY", "TYPE", "VALUE"]
    shown = rows(out)
    assert shown["policy.optimizer.lr"] == ["float", "0.0003"]
    assert shown["grpo.max_num_steps"] == ["int", "7"]
    assert shown["grpo.num_prompts_per_step"] == ["int", "16"]  # untouched keys keep their default


def test_a_prefix_shows_only_the_keys_under_it(capsys):
    code, out, _ = show(capsys, "grpo", "policy.optimizer")
    assert code == 0
    assert list(rows(out)) == [
        "policy.optimizer.name",
        "policy.optimizer.lr",
        "policy.optimizer.weight_decay",
        "policy.optimizer.kwargs",
    ]
    code, out, _ = show(capsys, "grpo", "policy.optimizer.lr")  # a key is its own prefix
    assert list(rows(out)) == ["policy.optimizer.lr"]
    code, out, _ = show(capsys, "grpo", "policy.optimizer.lr=2e-3", "policy.optimizer.lr")  # either order
    assert rows(out) == {"policy.optimizer.lr": ["float", "0.002"]}


@pytest.mark.parametrize(
    "prefix, nearest",
    [
        ("policy.optimiser", "policy.optimizer"),
        ("policy.optimiser.lr", "policy.optimizer.lr"),
        ("optimizer.lr", "policy.optimizer.lr"),  # the section in front left out
        ("env.limits.max_turn", "env.limits.max_turns"),
        ("policy.scheduler.knd", "policy.scheduler[].kind"),
    ],
)
def test_an_unknown_prefix_exits_2_naming_the_nearest_key(capsys, prefix: str, nearest: str):
    code, out, err = show(capsys, "grpo", prefix)
    assert code == 2
    assert out == ""
    assert f"unknown config key '{prefix}'" in err
    assert f"Did you mean '{nearest}'?" in err
    assert "Traceback" not in err


def test_a_prefix_below_a_key_and_two_prefixes_are_refused(capsys):
    code, _, err = show(capsys, "grpo", "policy.optimizer.lr.x")
    assert code == 2 and "'policy.optimizer.lr' is a key, not a section" in err
    code, _, err = show(capsys, "grpo", "policy", "grpo")
    assert code == 2 and "one key prefix" in err


def test_a_bad_override_or_file_is_one_config_error(capsys, tmp_path: Path):
    code, _, err = show(capsys, "grpo", "policy.optimizer.lr=abc")
    assert code == 2 and "bad value for 'policy.optimizer.lr'" in err and "Traceback" not in err
    code, _, err = show(capsys, "grpo", "--config", str(tmp_path / "missing.yaml"))
    assert code == 2 and "does not exist" in err


@pytest.mark.parametrize("command", list(CONFIG_COMMANDS))
def test_every_shown_value_passed_back_as_an_override_builds_that_value(command: str):
    """Each key (but a list's items, set through their list) with the overrides that select its
    alternative, and a stand-in for the keys without default there (custom tasks and environments: all
    strings), builds a config holding the shown value."""
    cls = config_class(command)
    keys = config_keys(cls)
    stand_ins: dict[tuple, list[str]] = {}
    for k in keys:
        if k.required:
            stand_ins.setdefault(k.when, []).append(f"{k.path}=pkg.module:name")
    checked = set()  # the alternatives (conditions) whose keys were checked
    for k in keys:
        if k.item or k.required or (k.section and k.value is not None):
            continue  # a section that is set shows '(section)': its own keys are checked
        overrides = [*k.selects, *stand_ins.get(k.when, []), f"{k.path}={k.value_text}"]
        cfg = load_config(cls, None, overrides)
        assert value_at(cfg, k.path) == k.value, (k.path, k.value_text)
        checked.add(k.when)
    assert checked == {k.when for k in keys if not k.item}  # every alternative, custom ones included


def test_alternatives_are_listed_under_the_name_that_selects_them(capsys):
    code, out, _ = show(capsys, "grpo", "env")
    assert code == 0
    lines = out.splitlines()
    assert rows(out)["env"] == ["EnvConfig | None", "null"]
    for kind in ("calculator", "guess", "code", "custom"):
        assert f"(when env.name={kind})" in lines  # none is in effect: env is null
    at = lines.index("(when env.name=guess)")
    assert lines[at + 1].split()[:3] == ["env.name", "'guess'", "guess"]  # indented under its note
    code, out, _ = show(capsys, "grpo", "env", "env.name=guess", "env.max_number=40")
    assert "(when env.name=guess; in effect)" in out.splitlines()
    guess = out.split("(when env.name=guess; in effect)")[1].split("(when")[0]
    assert rows("\n" + guess)["env.max_number"] == ["int", "40"]
    code, out, _ = show(capsys, "grpo", "task")
    assert "(when task.name=arithmetic; in effect)" in out.splitlines()
    assert "(when task.name=math)" in out.splitlines()
    code, out, _ = show(capsys, "grpo", "policy.lora")
    assert "(when policy.lora is set)" in out.splitlines()


def test_a_list_of_sections_is_one_key_with_its_items_keys_below(capsys):
    code, out, _ = show(capsys, "grpo", "policy.scheduler", "policy.scheduler=[{kind: linear, steps: 5}]")
    assert code == 0
    shown = rows(out)
    assert shown["policy.scheduler"] == ["list[SchedulerStage]"]  # the value is too long for the line
    assert "    value: [{kind: linear, steps: 5, start_factor: 1.0, end_factor: 1.0, min_factor: 0.0}]" in out
    assert "(each item of policy.scheduler)" in out.splitlines()
    assert shown["policy.scheduler[].kind"] == ["'constant' | 'linear' | 'cosine'", "constant"]


@pytest.mark.parametrize("command", list(CONFIG_COMMANDS))
def test_each_command_lists_all_its_keys_within_100_columns(capsys, command: str):
    code, out, _ = show(capsys, command)
    assert code == 0
    keys = config_keys(config_class(command))
    top = set(config_class(command).model_fields)

    def is_key(line: str) -> bool:  # a path, then the type column or nothing (a long type goes below)
        first = line.split()[0] if line.strip() else ""
        path = re.fullmatch(r"[a-z_][\w.\[\]]*", first) and ("." in first or first in top)
        return bool(path) and (len(re.split(r"\s{2,}", line.strip())) >= 2 or line.strip() == first)

    key_lines = [line for line in out.splitlines()[1:] if is_key(line)]
    assert [line.split()[0] for line in key_lines] == [k.path for k in keys]
    assert max(len(line) for line in out.splitlines()) <= 100
    assert out == render(keys) + "\n"


def test_each_command_shows_the_config_class_it_trains_with():
    from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
    from posttrain.algorithms.demo import DemoConfig
    from posttrain.algorithms.grpo import GRPOConfig
    from posttrain.algorithms.sft import SFTConfig

    assert [config_class(c) for c in ("demo", "sft", "grpo", "grpo-async")] == [
        DemoConfig,
        SFTConfig,
        GRPOConfig,
        AsyncGRPORunConfig,
    ]


@pytest.mark.parametrize(
    "value",
    ["{prompt}\nPut your final answer within \\boxed{}.", "true", "null", "a: b", None, 1e-5, [1, 2], {}],
)
def test_a_shown_value_is_one_line_that_reads_back_as_an_override(value):
    assert "\n" not in yaml_text(value)
    assert apply_overrides({}, [f"x={yaml_text(value)}"])["x"] == value


def test_select_without_the_cli():
    from posttrain.algorithms.sft import SFTConfig

    keys = select(config_keys(SFTConfig), "policy.optimizer")
    assert [k.path for k in keys] == [
        "policy.optimizer.name",
        "policy.optimizer.lr",
        "policy.optimizer.weight_decay",
        "policy.optimizer.kwargs",
    ]
    assert keys[1].value == 3e-3 and keys[1].type == "float"  # SFT's built default


REPO = Path(__file__).resolve().parents[1]


def help_examples() -> list[list[str]]:
    """The `posttrain config show ...` command lines in every help text of the CLI (its parsers'
    descriptions, usages and subcommand helps), as argv lists."""
    import argparse

    from posttrain.cli import build_parser

    texts, parsers = [], [build_parser()]
    while parsers:
        parser = parsers.pop()
        texts.append(parser.format_help())
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    lines = {m for text in texts for m in re.findall(r"posttrain (config show(?: [a-z0-9_./=-]+)+)", text)}
    return [line.split() for line in sorted(lines)]


def test_every_config_show_example_in_the_help_runs(capsys, monkeypatch):
    """The help's example with --config and an override used to refuse its own batch size."""
    examples = help_examples()
    assert ["config", "show", "grpo", "policy.optimizer"] in examples
    assert any("--config" in argv and any("=" in a for a in argv) for argv in examples), examples
    monkeypatch.chdir(REPO)  # the examples name configs/ relative to the repository
    for argv in examples:
        code = main(argv)
        out = capsys.readouterr()
        assert code == 0, (argv, out.err)
        assert out.out.startswith("KEY"), argv


def test_overrides_may_stand_on_both_sides_of_the_options(capsys):
    config = str(REPO / "configs" / "grpo_arithmetic.yaml")
    code, out, err = show(capsys, "grpo", "grpo.seed=3", "--config", config, "grpo.val_period=5", "grpo")
    assert code == 0, err
    shown = rows(out)
    assert shown["grpo.seed"][1] == "3" and shown["grpo.val_period"][1] == "5"
    assert shown["grpo.num_prompts_per_step"][1] == "16"  # the file's
    from posttrain.cli import build_parser

    argv = ["grpo", "grpo.seed=3", "--config", "c.yaml", "--overwrite", "grpo.val_period=5", "--debug"]
    args = build_parser().parse_args(argv)
    assert args.overrides == ["grpo.seed=3", "grpo.val_period=5"]
    assert (args.config, args.overwrite, args.debug) == ("c.yaml", True, True)
