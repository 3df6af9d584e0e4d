"""Statistics of the learning benchmarks (async_vs_sync_learning.py, grpo_time_to_acc.py): held-out
accuracy of weight copies (`HeldoutScorer`), accuracy curves over evaluated steps, time to a target
accuracy, and 95% Student-t intervals over seeds.

A result here is a dict with `accuracy` and `clock`, each {evaluated step: value}: held-out accuracy
and seconds of training up to that step."""

from __future__ import annotations

import math
import statistics

from _common import median


def curve(result: dict, window: int) -> list[tuple[int, float, float]]:
    """(step, clock, accuracy averaged over this and the `window`-1 evaluations before it) at each
    evaluated step that has `window` evaluations behind it."""
    steps = sorted(result["accuracy"])
    accs = [result["accuracy"][k] for k in steps]
    return [
        (k, result["clock"][k], statistics.mean(accs[i + 1 - window : i + 1]))
        for i, k in enumerate(steps)
        if i + 1 >= window
    ]


def time_to(result: dict, target: float, window: int) -> tuple[float, int] | None:
    """(clock, step) at the first evaluated step whose window-averaged accuracy reaches `target`."""
    for step, clock, acc in curve(result, window):
        if acc >= target - 1e-9:
            return clock, step
    return None


def final_accuracy(result: dict, window: int) -> float:
    """The mean held-out accuracy of the last `window` evaluations (the last one at the last step)."""
    return curve(result, window)[-1][2]


def t_interval(values: list[float]) -> tuple[float, float]:
    """95% Student-t interval on the mean (nan for fewer than two values)."""
    from scipy.stats import t

    n = len(values)
    if n < 2:
        return math.nan, math.nan
    mean, half = statistics.mean(values), t.ppf(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean - half, mean + half


def summary(name: str, values: list[float], scale: float = 1.0, unit: str = "") -> str:
    """`name`: median, mean and the 95% t-interval of `values` (times `scale`)."""
    if not values:
        return f"{name}: no values"
    lo, hi = t_interval(values)
    mean, med = statistics.mean(values), median(values)
    return (
        f"{name}: median {scale * med:.3g}{unit}  mean {scale * mean:.3g}{unit}  "
        f"95% t-CI [{scale * lo:.3g}, {scale * hi:.3g}]{unit}  (n={len(values)})"
    )


class HeldoutScorer:
    """Greedy held-out accuracy (rollout.validation.validate, as both GRPO loops validate) of weights
    loaded into one engine built from a GRPO config's model, task, generation and sampling sections."""

    def __init__(self, cfg) -> None:
        from posttrain.generation.engine import GenerationEngine
        from posttrain.policy.model_init import build_tokenizer, engine_model
        from posttrain.rollout.groups import engine_config
        from posttrain.tasks.build import build_task

        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg.policy.model)
        self.task = build_task(cfg.task, self.tokenizer)
        model = engine_model(cfg.policy.model, cfg.policy.lora, self.tokenizer)
        self.engine = GenerationEngine(
            model, self.tokenizer, engine_config(cfg.generation, cfg.sampling, self.task)
        )

    def __call__(self, state: dict | None = None, version: int = 0) -> float:
        """The accuracy of `state` (None: the weights as loaded)."""
        from posttrain.rollout.validation import validate

        if state is not None:
            self.engine.load_weights(state, version)
        return validate(self.engine, self.task, self.tokenizer, self.cfg.sampling, self.cfg.grpo)[
            "val/accuracy"
        ]
