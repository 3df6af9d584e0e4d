"""Shared bits of the benchmarks: timing with repeats, medians, and the RESULT line format."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_repeats(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of `fn` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)


def result_line(name: str, value: float, target: str) -> str:
    """The benchmark protocol's last lines: `RESULT <name> <value> target <op><number>`."""
    return f"RESULT {name} {value:.4g} target {target}"
