"""Command line: posttrain demo | sft | grpo | grpo-async | dpo | rm | ppo | distill | export | generate |
config show.

Training commands take `--config FILE.yaml` and dotted overrides (`policy.optimizer.lr=1e-4`);
`posttrain config show COMMAND [PREFIX]` lists the keys they accept. A user's
mistake (a bad config, a missing file, a failing reward function) ends with one message on stderr that
names the file, key or path and the fix; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from posttrain.config import Config, ConfigError, format_validation_error, load_config
from posttrain.models.prompt_record import PROMPT_FORMAT_FILE

console = Console(soft_wrap=True)  # a path at the end of a line is never broken
errors = Console(stderr=True)


CONFIG_COMMANDS = (
    "demo",
    "sft",
    "dpo",
    "rm",
    "grpo",
    "grpo-async",
    "distill",
    "ppo",
)  # what `config show` knows


def config_class(command: str) -> type[Config]:
    """The config class that `posttrain COMMAND` loads its --config file and overrides into (imported on
    use: the training stack is slow to import)."""
    from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
    from posttrain.algorithms.demo import DemoConfig
    from posttrain.algorithms.distill import DistillConfig
    from posttrain.algorithms.dpo import DPORunConfig
    from posttrain.algorithms.grpo import GRPOConfig
    from posttrain.algorithms.ppo import PPOConfig
    from posttrain.algorithms.rm import RMRunConfig
    from posttrain.algorithms.sft import SFTConfig

    classes = {
        "demo": DemoConfig,
        "sft": SFTConfig,
        "dpo": DPORunConfig,
        "rm": RMRunConfig,
        "grpo": GRPOConfig,
        "grpo-async": AsyncGRPORunConfig,
        "distill": DistillConfig,
        "ppo": PPOConfig,
    }
    return classes[command]


def _shown(result: dict[str, float], names: dict[str, str]) -> str:
    """`label value` for each metric the run returned (a run resumed with nothing left to train has
    only its checkpoint's)."""
    return "".join(f"{label} {result[k]:.3f}, " for k, label in names.items() if k in result)


def _sft(args: argparse.Namespace) -> int:
    from posttrain.algorithms.sft import run_sft

    cfg = _loaded(args, "sft")
    result = run_sft(cfg)
    console.print(
        f"[bold green]SFT done[/]: train loss {result.get('loss', float('nan')):.4f}, "
        f"held-out loss {result.get('val_loss', float('nan')):.4f}; outputs in {escape(cfg.output_dir)}"
    )
    return 0


def _loaded(args: argparse.Namespace, command: str):
    """The command's config from --config and the overrides (with --overwrite's where it has one), its
    output directory checked."""
    overrides = args.overrides + (_overwrite(args, command) if hasattr(args, "overwrite") else [])
    cfg = load_config(config_class(command), args.config, overrides)
    check_output_dir(cfg.output_dir)
    return cfg


def _trained(args: argparse.Namespace, command: str, run, title: str, names: dict[str, str]) -> int:
    """Run `command` with `run` and print `title done` with the metrics `names` labels."""
    cfg = _loaded(args, command)
    result = run(cfg)
    console.print(f"[bold green]{title} done[/]: {_shown(result, names)}outputs in {escape(cfg.output_dir)}")
    return 0


def _dpo(args: argparse.Namespace) -> int:
    from posttrain.algorithms.dpo import run_dpo

    names = {"loss": "train loss", "val_accuracy": "held-out preference accuracy"}
    return _trained(args, "dpo", run_dpo, "DPO", names)


def _rm(args: argparse.Namespace) -> int:
    from posttrain.algorithms.rm import run_rm

    names = {"loss": "train loss", "val_accuracy": "held-out pair accuracy"}
    return _trained(args, "rm", run_rm, "reward model", names)


def _grpo(args: argparse.Namespace) -> int:
    from posttrain.algorithms.grpo import run_grpo

    return _trained(args, "grpo", run_grpo, "GRPO", {"reward": "reward", "val/accuracy": "held-out accuracy"})


def _distill(args: argparse.Namespace) -> int:
    from posttrain.algorithms.distill import run_distill

    names = {"distill/reverse_kl": "reverse KL per token", "val/accuracy": "held-out accuracy"}
    return _trained(args, "distill", run_distill, "distillation", names)


def _ppo(args: argparse.Namespace) -> int:
    from posttrain.algorithms.ppo import run_ppo

    names = {
        "reward": "reward",
        "ppo/explained_variance": "critic explained variance",
        "val/accuracy": "held-out accuracy",
    }
    return _trained(args, "ppo", run_ppo, "PPO", names)


def _grpo_async(args: argparse.Namespace) -> int:
    from posttrain.algorithms.async_grpo.run import run_async_grpo

    cfg = _loaded(args, "grpo-async")
    result = run_async_grpo(cfg)
    shown = _shown(result, {"reward": "reward", "val/accuracy": "held-out accuracy"})
    if "summary/steps" in result:
        shown = (
            f"{result['summary/steps']:.0f} steps, {shown}{result['summary/groups_trained']:.0f} groups "
            f"trained, {result['summary/dead_workers']:.0f} rollout worker(s) lost, "
        )
    console.print(f"[bold green]asynchronous GRPO done[/]: {shown}outputs in {escape(cfg.output_dir)}")
    return 0


def _overwrite(args: argparse.Namespace, command: str) -> list[str]:
    """--overwrite as overrides: a fresh start that may delete the previous run (runs without checkpoints
    have `overwrite` alone)."""
    if not args.overwrite:
        return []
    if "checkpointing" not in config_class(command).model_fields:
        return ["overwrite=true"]
    return ["checkpointing.resume=never", "checkpointing.overwrite=true"]


def _demo(args: argparse.Namespace) -> int:
    from posttrain.algorithms.demo import run_demo

    cfg = _loaded(args, "demo")
    t0 = time.perf_counter()
    res = run_demo(cfg)
    what = cfg.sft.env.name if cfg.sft.env is not None else cfg.sft.task.name
    table = Table(title=f"posttrain demo: {what}, tiny model, SFT warm start then GRPO")
    for col in ("stage", "held-out accuracy"):
        table.add_column(col)
    table.add_row("after SFT warm start", f"{100 * res['accuracy_after_sft']:.1f}%")
    table.add_row("after GRPO", f"{100 * res['accuracy_after_grpo']:.1f}%")
    console.print(table)
    console.print(
        f"gain: [bold]{res['gain_points']:+.1f} points[/] in {time.perf_counter() - t0:.0f} s; "
        f"metrics and curves.png in {escape(cfg.output_dir)}/grpo"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from posttrain.policy.export import export_hf, how_to_load

    out = export_hf(args.checkpoint, args.out, args.dtype, adapter=args.adapter, base=args.base)
    how = how_to_load(args.checkpoint, args.adapter)
    console.print(f"[bold green]exported[/] {args.checkpoint} -> {out} (load with {how})")
    return 0


SAMPLING_FLAGS = ("temperature", "top_p", "top_k")  # unset: the model's generation config decides


def _flag_checked(cls: type[BaseModel], flags: dict, **fields):
    """`cls(**flags, **fields)`; a bad value is a ConfigError that names the flag (--max-new-tokens), not
    the pydantic field."""
    try:
        return cls(**flags, **fields)
    except ValidationError as err:
        text = format_validation_error(cls, err, heading="invalid option")
        for name in flags:
            text = text.replace(f"'{name}'", f"--{name.replace('_', '-')}")
        text = text.replace("set greedy=True", "pass --greedy")  # SamplingParams' fix, as a flag
        raise ConfigError(text) from None


def _sampling(args: argparse.Namespace, model):
    """The flags given, over the sampling defaults of the model's generation config (do_sample false:
    greedy). A sampling flag asks for sampling; --greedy for greedy decoding whatever the model's."""
    from posttrain.generation.params import SamplingParams, model_sampling_defaults

    given = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    fields = model_sampling_defaults(getattr(model, "generation_config", None))
    if given:
        fields.pop("greedy", None)
    fields |= given
    if args.greedy:  # the model's sampling settings do not apply to greedy decoding
        fields = {**given, "greedy": True}
    return _flag_checked(SamplingParams, {"max_new_tokens": args.max_new_tokens, "seed": args.seed}, **fields)


def _generate(args: argparse.Namespace) -> int:
    from posttrain.generation.engine import GenerationEngine
    from posttrain.generation.params import SamplingParams
    from posttrain.models.hf import load_model, load_tokenizer
    from posttrain.tasks.generate_prompts import generate_prompt_ids

    flags = {k: getattr(args, k) for k in ("max_new_tokens", "seed", *SAMPLING_FLAGS)}
    _flag_checked(SamplingParams, {k: v for k, v in flags.items() if v is not None}, greedy=args.greedy)
    tok = load_tokenizer(args.tokenizer or args.model, elsewhere="generate --tokenizer DIR_OR_HUB_NAME")
    prompts = generate_prompt_ids(
        args.prompts, tok, args.model, args.tokenizer or args.model, args.chat_template, args.bos
    )
    model = load_model(args.model)
    params = _sampling(args, model)
    engine = GenerationEngine(model, tok)
    for prompt, res in zip(args.prompts, engine.generate(prompts, params)):
        text = tok.decode(res.token_ids, skip_special_tokens=True)
        console.print(f"[bold]{escape(prompt)}[/]{escape(text)}  [dim]({res.finish_reason})[/]")
    return 0


def _config_show(args: argparse.Namespace) -> int:
    from posttrain.config_keys import config_keys, render, select

    overrides = [item for item in args.items if "=" in item]
    prefixes = [item for item in args.items if "=" not in item]
    if len(prefixes) > 1:
        raise ConfigError(
            f"config show takes one key prefix, got {len(prefixes)}: {', '.join(prefixes)}. An override "
            "is written key=value"
        )
    cls = config_class(args.target)
    given = args.config is not None or bool(overrides)
    keys = config_keys(cls, load_config(cls, args.config, overrides) if given else None)
    if prefixes:
        keys = select(keys, prefixes[0], f"posttrain {args.target}")
    try:
        print(render(keys, "value" if given else "default"), flush=True)
    except BrokenPipeError:  # the reader stopped early (`| head`): not an error; nothing more to write
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


CONFIG_SHOW_HELP = """\
Lists every key of COMMAND's config, one line each: KEY (dotted, as an override writes it), TYPE (as the
code declares it: list[float], int | None, Literal values as 'a' | 'b') and DEFAULT, with the key's
description below it. With --config or overrides the column is VALUE instead: the value that config
gives the key (a shown value can be passed back as KEY=VALUE).

A section that is one of several kinds (task, env: picked by its `name`) or optional (policy.lora) has
its own line, then the keys of each kind, indented, under a note such as `(when env.name=calculator)`;
`; in effect` marks the kind the config has, and the other kinds show their own defaults. The items of a
list of sections (policy.scheduler) are set as a whole list; their keys are shown as
`policy.scheduler[].kind` under `(each item of policy.scheduler)`. (required) marks a key that has no
default.

examples:
  posttrain config show grpo                      every key of a GRPO run
  posttrain config show grpo policy.optimizer     only the keys under policy.optimizer
  posttrain config show grpo --config configs/grpo_arithmetic.yaml grpo.num_prompts_per_step=32
"""


def check_output_dir(path: str, key: str = "output_dir") -> None:
    """Refuse an output directory that cannot be created or written, before anything is built."""
    target = Path(path).expanduser().absolute()
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        problem = f"'{probe}' is a file, not a directory"
    elif not os.access(probe, os.W_OK | os.X_OK):
        problem = f"'{probe}' is not writable by this user"
    else:
        return
    raise ValueError(f"{key}='{path}' cannot be used: {problem}. Set {key}=... to a directory you can write")


class _IntermixedParser(argparse.ArgumentParser):
    """A parser whose positionals (a command's overrides) may stand on both sides of its options
    (`grpo.seed=3 --config FILE grpo.val_period=5`): argparse's intermixed parsing, also when reached
    as a subcommand. A parser with subcommands of its own parses as argparse does."""

    _intermixed = False

    def parse_known_args(self, args=None, namespace=None):
        nested = any(a.nargs == argparse.PARSER for a in self._get_positional_actions())
        if self._intermixed or nested:  # (parse_known_intermixed_args's own passes, Python < 3.12)
            return super().parse_known_args(args, namespace)
        self._intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixed = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_IntermixedParser)
    for name, fn, text in [
        ("demo", _demo, "built-in demo: SFT warm start then GRPO on arithmetic (CPU, minutes)"),
        ("grpo", _grpo, "GRPO training"),
        (
            "grpo-async",
            _grpo_async,
            "asynchronous GRPO: rollouts stream while the trainer trains (bounded staleness)",
        ),
        ("sft", _sft, "supervised fine-tuning (warm start)"),
        ("dpo", _dpo, "direct preference optimization on (prompt, chosen, rejected) pairs (DPO, IPO, RPO)"),
        (
            "distill",
            _distill,
            "on-policy distillation: the student samples, a teacher's per-token reverse KL trains it",
        ),
        ("rm", _rm, "train a reward model (Bradley-Terry) on (prompt, chosen, rejected) pairs"),
        ("ppo", _ppo, "PPO with a critic: GAE advantages from a value model, clipped value loss, epochs"),
    ]:
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default=None, help="YAML config file")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.optimizer.lr=1e-4")
        if name != "demo":
            p.add_argument(
                "--overwrite",
                action="store_true",
                help="start over: delete the run in output_dir (checkpoints, metrics, curves, config, hf/) "
                "first",
            )
        p.set_defaults(func=fn)
    p = sub.add_parser(
        "export", help="consolidate a checkpoint into a Hugging Face directory (LoRA: merged, or --adapter)"
    )
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA checkpoints: write a peft adapter directory (adapter_config.json, "
        "adapter_model.safetensors) instead of the weights merged into the base model",
    )
    p.add_argument(
        "--base",
        default=None,
        metavar="DIR_OR_HUB_NAME",
        help="LoRA checkpoints: the base model, instead of the model.name its training config recorded "
        "(a relative path there is relative to the training run's working directory)",
    )
    p.set_defaults(func=_export)
    p = sub.add_parser("generate", help="sample completions from a Hugging Face model directory")
    p.add_argument("model")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--temperature", type=float, default=None, help="default: the model's generation config, else 1.0"
    )
    p.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling; default: the model's generation config"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="0: no top-k; default: the model's generation config"
    )
    p.add_argument(
        "--greedy",
        action="store_true",
        help="argmax decoding (the default when the model's generation config sets do_sample false and "
        "no sampling flag is given)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chat-template",
        choices=["auto", "always", "never"],
        default=None,
        help="auto: wrap each prompt in the tokenizer's chat template (a user message) when it has one; "
        "always: require one; never: the prompt text alone. Default: the training run's "
        f"task.prompt_format, which posttrain records in the model directory ({PROMPT_FORMAT_FILE}, with "
        "its template and system prompt, which apply too); auto for a directory without it",
    )
    p.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start each prompt with the tokenizer's BOS token, or not (--no-bos). Default: as the training "
        f"run did (task.prompt_format.prepend_bos, recorded in {PROMPT_FORMAT_FILE}); BOS for a directory "
        "without it",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or hub name; default: the model's")
    p.set_defaults(func=_generate)
    p = sub.add_parser("config", help="inspect the config keys of a command: posttrain config show grpo")
    show = p.add_subparsers(dest="action", required=True).add_parser(
        "show",
        help="list every config key of a command with its type, default and description",
        description=CONFIG_SHOW_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shows = show.add_subparsers(
        dest="target", required=True, metavar="COMMAND", parser_class=_IntermixedParser
    )
    for name in CONFIG_COMMANDS:
        p = shows.add_parser(
            name,
            help=f"the keys of `posttrain {name}`",
            description=CONFIG_SHOW_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--config", default=None, help="YAML config file: show the values it gives")
        p.add_argument(
            "items",
            nargs="*",
            metavar="PREFIX | KEY=VALUE",
            help="show only the keys at or under PREFIX (e.g. policy.optimizer); KEY=VALUE: dotted "
            f"overrides, as for posttrain {name}",
        )
        p.set_defaults(func=_config_show)
    for p in [*sub.choices.values(), show, *shows.choices.values()]:
        p.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error"
        )
    return parser


def _os_error_text(e: OSError) -> str:
    if e.filename is None:
        return str(e)
    where = f"'{e.filename}'" + (f" -> '{e.filename2}'" if e.filename2 is not None else "")
    return f"{where}: {e.strerror or e}. Check that the path exists and that you may read or write it"


def user_error(e: BaseException) -> tuple[str, int, str] | None:
    """(label, exit code, message) for an error a user can fix; None for anything else (a bug: the
    traceback is shown)."""
    from posttrain.tasks.rewards import RewardError

    if isinstance(e, ConfigError):
        return "config error", 2, str(e)
    if isinstance(e, RewardError):
        return "reward function error", 1, str(e)
    if isinstance(e, ValidationError):  # a value checked by a library config built from arguments
        return "error", 1, format_validation_error(BaseModel, e, heading=f"invalid {e.title}")
    if isinstance(e, ValueError):  # a user's mistake: the message says how to fix it
        return "error", 1, str(e)
    if isinstance(e, OSError):
        return "error", 1, _os_error_text(e)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per weights load/save: noise in a run's own progress
    try:
        return args.func(args)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the training loop
        errors.print(
            "[bold yellow]aborted[/] (Ctrl-C): the step in progress is lost; checkpointing.resume=auto "
            "continues from the run's newest checkpoint, if it has one"
        )
        return 130
    except Exception as e:
        from posttrain.algorithms.runs import RunInterrupted

        if isinstance(e, RunInterrupted):  # Ctrl-C, at a step: says how to go on
            console.print(f"[bold yellow]stopped[/]: {escape(str(e))}")
            return 130
        found = None if args.debug else user_error(e)
        if found is None:
            raise
        label, code, text = found
        errors.print(f"[bold red]{label}[/]: {escape(text)}", soft_wrap=True)
        if code != 2:
            errors.print("[dim](run again with --debug to see the traceback)[/]")
        return code


if __name__ == "__main__":
    sys.exit(main())
