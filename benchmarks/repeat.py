"""Run one benchmark command several times and give each of its RESULT lines with its noise band.

    python benchmarks/repeat.py --runs 5 [--keep DIR] -- python benchmarks/generation.py --quick

The command runs `--runs` times one after another (never two at once: on this 2-core machine a second
busy process halves the first one's speed). Every run must exit 0 and print the same RESULT names; the
first run that fails ends the repeat with a non-zero status, its exit code and the tail of its output.
Then, per RESULT name: every run's value and the min / median / max, and last, one line per target in
the benchmark protocol's format with the median as the value (`RESULT <name> <median> target <op><n>`).
`--keep DIR` writes each run's output to DIR/run<k>.txt.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line  # noqa: E402

_RESULT = re.compile(r"^RESULT (\S+) (\S+) target (\S+)\s*$")
TAIL_LINES = 20


class RepeatError(RuntimeError):
    """A run failed, printed no RESULT line, or printed a different set of results than the first."""


def parse_results(output: str) -> dict[str, tuple[float, str]]:
    """{name: (value, target)} of the `RESULT <name> <value> target <op><number>` lines in `output`."""
    found: dict[str, tuple[float, str]] = {}
    for line in output.splitlines():
        m = _RESULT.match(line.strip())
        if m:
            name, value, target = m.groups()
            if name in found:
                raise RepeatError(f"RESULT {name} is printed twice in one run; a benchmark prints each once")
            found[name] = (float(value), target)
    return found


def collect(runs: list[dict[str, tuple[float, str]]]) -> dict[str, tuple[list[float], str]]:
    """{name: (value of each run, target)}; every run must report the same names and targets."""
    if not runs or not runs[0]:
        raise RepeatError("the command printed no RESULT line; is it a benchmark of benchmarks/?")
    names = list(runs[0])
    for k, run in enumerate(runs[1:], start=1):
        if list(run) != names:
            raise RepeatError(f"run {k} reported {sorted(run)} but run 0 reported {sorted(names)}")
        for name in names:
            if run[name][1] != runs[0][name][1]:
                raise RepeatError(f"run {k} gave {name} target {run[name][1]}, run 0 {runs[0][name][1]}")
    return {name: ([run[name][0] for run in runs], runs[0][name][1]) for name in names}


def report(values: dict[str, tuple[list[float], str]]) -> list[str]:
    """The summary lines: a noise band per result, then one RESULT line (the median) per result."""
    lines = []
    for name, (vals, _) in values.items():
        each = " ".join(f"{v:.4g}" for v in vals)
        lines.append(
            f"{name}: min {min(vals):.4g}  median {median(vals):.4g}  max {max(vals):.4g}  "
            f"over {len(vals)} runs ({each})"
        )
    lines += [result_line(name, median(vals), target) for name, (vals, target) in values.items()]
    return lines


def run_once(command: list[str], k: int) -> str:
    """The output (stdout and stderr together) of run `k` of `command`; RepeatError when it fails."""
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-TAIL_LINES:])
        raise RepeatError(f"run {k} of {' '.join(command)} exited with code {proc.returncode}:\n{tail}")
    return proc.stdout


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="how many times to run the command (default 5)")
    ap.add_argument("--keep", type=Path, default=None, help="write each run's output to KEEP/run<k>.txt")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the benchmark command after --, e.g. -- python benchmarks/generation.py --quick")
    if args.runs < 1:
        ap.error(f"--runs must be >= 1 (got {args.runs})")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        for k in range(args.runs):
            output = run_once(command, k)
            if args.keep is not None:
                (args.keep / f"run{k}.txt").write_text(output)
            runs.append(parse_results(output))
            print(f"run {k}: " + "  ".join(f"{n} {v:.4g}" for n, (v, _) in runs[-1].items()), flush=True)
        lines = report(collect(runs))
    except RepeatError as e:
        sys.exit(f"repeat.py: {e}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
