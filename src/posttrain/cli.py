"""Command line: posttrain demo | grpo | sft | export | generate.

Every training command takes `--config FILE.yaml` and dotted overrides (`policy.optimizer.lr=1e-4`).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from posttrain.config import ConfigError, load_config

console = Console()


def _sft(args: argparse.Namespace) -> int:
    from posttrain.algorithms.sft import SFTConfig, run_sft

    cfg = load_config(SFTConfig, args.config, args.overrides)
    result = run_sft(cfg)
    console.print(
        f"[bold green]SFT done[/]: train loss {result.get('loss', float('nan')):.4f}, "
        f"held-out loss {result.get('val_loss', float('nan')):.4f}; outputs in {cfg.output_dir}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in [("sft", _sft, "supervised fine-tuning (warm start)")]:
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default=None, help="YAML config file")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.optimizer.lr=1e-4")
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        console.print(f"[bold red]config error[/]: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
