"""Command line: posttrain demo | grpo | grpo-async | sft | export | generate.

Training commands take `--config FILE.yaml` and dotted overrides (`policy.optimizer.lr=1e-4`).
"""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from posttrain.config import ConfigError, load_config

console = Console()


def _shown(result: dict[str, float], names: dict[str, str]) -> str:
    """`label value` for each metric the run returned (a run resumed with nothing left to train has
    only its checkpoint's)."""
    return "".join(f"{label} {result[k]:.3f}, " for k, label in names.items() if k in result)


def _sft(args: argparse.Namespace) -> int:
    from posttrain.algorithms.sft import SFTConfig, run_sft

    cfg = load_config(SFTConfig, args.config, args.overrides)
    result = run_sft(cfg)
    console.print(
        f"[bold green]SFT done[/]: train loss {result.get('loss', float('nan')):.4f}, "
        f"held-out loss {result.get('val_loss', float('nan')):.4f}; outputs in {cfg.output_dir}"
    )
    return 0


def _grpo(args: argparse.Namespace) -> int:
    from posttrain.algorithms.grpo import GRPOConfig, run_grpo

    cfg = load_config(GRPOConfig, args.config, args.overrides + _overwrite(args))
    result = run_grpo(cfg)
    shown = _shown(result, {"reward": "reward", "val/accuracy": "held-out accuracy"})
    console.print(f"[bold green]GRPO done[/]: {shown}outputs in {cfg.output_dir}")
    return 0


def _grpo_async(args: argparse.Namespace) -> int:
    from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
    from posttrain.algorithms.async_grpo.run import run_async_grpo

    cfg = load_config(AsyncGRPORunConfig, args.config, args.overrides + _overwrite(args))
    result = run_async_grpo(cfg)
    shown = _shown(result, {"reward": "reward", "val/accuracy": "held-out accuracy"})
    if "summary/steps" in result:
        shown = (
            f"{result['summary/steps']:.0f} steps, {shown}{result['summary/groups_trained']:.0f} groups "
            f"trained, {result['summary/dead_workers']:.0f} rollout worker(s) lost, "
        )
    console.print(f"[bold green]asynchronous GRPO done[/]: {shown}outputs in {cfg.output_dir}")
    return 0


def _overwrite(args: argparse.Namespace) -> list[str]:
    return ["checkpointing.resume=never", "checkpointing.overwrite=true"] if args.overwrite else []


def _demo(args: argparse.Namespace) -> int:
    from posttrain.algorithms.demo import DemoConfig, run_demo

    cfg = load_config(DemoConfig, args.config, args.overrides)
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
        f"metrics and curves.png in {cfg.output_dir}/grpo"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from posttrain.policy.export import export_hf

    out = export_hf(args.checkpoint, args.out, args.dtype, adapter=args.adapter)
    how = (
        "peft.PeftModel.from_pretrained(base, out)"
        if args.adapter
        else "AutoModelForCausalLM.from_pretrained"
    )
    console.print(f"[bold green]exported[/] {args.checkpoint} -> {out} (load with {how})")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from posttrain.generation.engine import GenerationEngine
    from posttrain.generation.params import SamplingParams
    from posttrain.models.hf import load_model, load_tokenizer

    tok = load_tokenizer(args.model)
    engine = GenerationEngine(load_model(args.model), tok)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, greedy=args.greedy, seed=args.seed
    )
    prompts = [tok(p, add_special_tokens=True)["input_ids"] for p in args.prompts]
    for prompt, res in zip(args.prompts, engine.generate(prompts, params)):
        console.print(
            f"[bold]{prompt}[/]{tok.decode(res.token_ids, skip_special_tokens=True)}  [dim]({res.finish_reason})[/]"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in [
        ("demo", _demo, "built-in demo: SFT warm start then GRPO on arithmetic (CPU, minutes)"),
        ("grpo", _grpo, "GRPO training"),
        (
            "grpo-async",
            _grpo_async,
            "asynchronous GRPO: rollouts stream while the trainer trains (bounded staleness)",
        ),
        ("sft", _sft, "supervised fine-tuning (warm start)"),
    ]:
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default=None, help="YAML config file")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.optimizer.lr=1e-4")
        if name.startswith("grpo"):
            p.add_argument(
                "--overwrite",
                action="store_true",
                help="start over: delete the run in output_dir (checkpoints, metrics, curves, config) first",
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
    p.set_defaults(func=_export)
    p = sub.add_parser("generate", help="sample completions from a Hugging Face model directory")
    p.add_argument("model")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        console.print(f"[bold red]config error[/]: {e}")
        return 2
    except ValueError as e:  # a user's mistake: the message says how to fix it
        console.print(f"[bold red]error[/]: {e}")
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the training loop
        console.print(
            "[bold yellow]aborted[/] (Ctrl-C): the step in progress is lost; checkpointing.resume=auto "
            "continues from the run's newest checkpoint, if it has one"
        )
        return 130
    except Exception as e:
        from posttrain.algorithms.runs import RunInterrupted

        if not isinstance(e, RunInterrupted):
            raise
        console.print(f"[bold yellow]stopped[/]: {escape(str(e))}")  # Ctrl-C, at a step: says how to go on
        return 130


if __name__ == "__main__":
    sys.exit(main())
