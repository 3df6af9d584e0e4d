"""Time and count accounting of the asynchronous GRPO loop: idle fractions, staleness histogram, throughput.

The controller calls `StepMeter.begin_window()` when a run starts and `StepMeter.step_metrics(...)` when
each step ends; everything is measured over the step's window with the event loop's clock. The windows
are back to back (the next starts where the last ended), so what happens between two steps (validation,
a checkpoint, the `on_step` hooks) falls in the next step's window, and the per-step counts and times
add up to the run's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

GROUP_COUNTERS = ("admitted", "dropped_stale", "retried", "failed", "filtered", "finished")
OTHER_COUNTERS = ("generated_samples", "weight_pushes")
COUNTERS = GROUP_COUNTERS + OTHER_COUNTERS


class BusyMeter:
    """Cumulative busy time of one resource (busy while at least one job runs)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._busy = 0.0
        self._since = 0.0
        self._depth = 0

    def start(self) -> None:
        if self._depth == 0:
            self._since = self._clock()
        self._depth += 1

    def stop(self) -> None:
        assert self._depth > 0, "BusyMeter.stop() without start()"
        self._depth -= 1
        if self._depth == 0:
            self._busy += self._clock() - self._since

    def total(self, now: float | None = None) -> float:
        """Busy seconds so far (up to `now`, a reading of the same clock, when given)."""
        extra = (self._clock() if now is None else now) - self._since if self._depth else 0.0
        return self._busy + extra


class StepMeter:
    """Per-step and cumulative counters plus the windows needed for idle fractions and rates."""

    def __init__(
        self,
        clock: Callable[[], float],
        max_staleness: int,
        trainer_busy: Callable[[], float | None] | None = None,
    ) -> None:
        self.clock = clock
        self.max_staleness = max_staleness
        self.totals: Counter[str] = Counter({k: 0 for k in COUNTERS})
        # Trainer idle: with `trainer_busy` (cumulative seconds the trainer spent working, on `clock`, or
        # None when it does not know), the time it was not working; else the time the controller waited
        # for groups.
        self.trainer_busy = trainer_busy
        self.trainer_idle = BusyMeter(clock)
        self._window_start = clock()
        self._window_totals: Counter[str] = Counter()
        self._window_idle = 0.0
        self._window_gen: tuple[float, float] = (0.0, 0.0)

    def count(self, name: str, n: int = 1) -> None:
        assert name in COUNTERS, name
        self.totals[name] += n

    def begin_window(self, gen_busy: float, gen_alive: float) -> None:
        """Start the first step's window (`gen_busy`, `gen_alive`: the rollout workers' readings now)."""
        now = self.clock()
        self._start_window(now, self._idle_total(now), gen_busy, gen_alive)

    def _start_window(self, now: float, idle: float, gen_busy: float, gen_alive: float) -> None:
        self._window_start = now
        self._window_totals = Counter(self.totals)
        self._window_idle = idle
        self._window_gen = (gen_busy, gen_alive)

    def step_metrics(
        self, lags: list[int], samples: int, gen_busy: float, gen_alive: float
    ) -> dict[str, float]:
        """Metrics of the window that ends now (`lags`: one per trained group, `samples`: trained samples);
        the next window starts from the same readings."""
        now = self.clock()
        idle = self._idle_total(now)
        elapsed = max(now - self._window_start, 1e-9)
        delta = {k: self.totals[k] - self._window_totals.get(k, 0) for k in COUNTERS}
        busy = gen_busy - self._window_gen[0]
        alive = gen_alive - self._window_gen[1]
        hist = Counter(lags)
        out: dict[str, float] = {
            "step_time_s": elapsed,
            "samples_per_s": samples / elapsed,
            "generated_samples_per_s": delta["generated_samples"] / elapsed,
            "trainer_idle_fraction": min(1.0, max(0.0, (idle - self._window_idle) / elapsed)),
            "generation_idle_fraction": min(1.0, max(0.0, 1.0 - busy / alive)) if alive > 0 else 1.0,
            "staleness/mean": sum(lags) / len(lags) if lags else 0.0,
            "staleness/max": float(max(lags)) if lags else 0.0,
        }
        for lag in range(self.max_staleness + 1):
            out[f"staleness/lag_{lag}"] = float(hist.get(lag, 0))
        for k in COUNTERS:
            out[f"groups_{k}" if k in GROUP_COUNTERS else k] = float(delta[k])
            out[f"total/{k}"] = float(self.totals[k])
        self._start_window(now, idle, gen_busy, gen_alive)
        return out

    def _idle_total(self, now: float) -> float:
        """Cumulative trainer idle seconds at `now` (only differences between two readings are meaningful)."""
        busy = self.trainer_busy() if self.trainer_busy is not None else None
        if busy is not None:
            return now - busy
        return self.trainer_idle.total(now)

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals = Counter({k: 0 for k in COUNTERS})
        self.totals.update({k: int(v) for k, v in state["totals"].items() if k in COUNTERS})
