"""Reward functions: the interface, a safe caller that never turns a failure into a zero, and loading by path.

A reward function takes a batch of prompts, completions and per-sample metadata and returns one reward per
completion, either as a plain list of numbers or as a `RewardResult` that also marks samples it could not
score. Reward functions are user code, so `RewardScorer` calls them defensively: an exception, a `None`, a
non-numeric or a non-finite value marks that sample *failed* (its reward is NaN and `failed[i]` is True), and
the failure is counted. Unlike the usual "except: reward = 0" this keeps a broken verifier from teaching the
policy that a correct answer is worth nothing. `RewardConfig.on_reward_error` decides whether the run skips
failed samples or stops.

A reward function (or an environment class, a tool-call parser) named by file, 'path/to/file.py:name', is
loaded as a module registered in sys.modules under one name per file, as an import would register it, so
dataclasses and pickling find it; cloudpickle (Ray, loky) still ships its code by value.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import re
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import Field

from posttrain.config import Config
from posttrain.logging import get_logger

logger = get_logger(__name__)


class RewardError(RuntimeError):
    """A reward function failed and the configuration says to stop (or too many samples failed)."""


class RewardConfig(Config):
    """How reward-function failures are handled."""

    on_reward_error: Literal["skip_sample", "raise"] = Field(
        "skip_sample",
        description="skip_sample: a sample whose reward cannot be computed is marked failed (reward NaN, "
        "excluded from advantages and counted in the metrics) and the run continues. raise: the first "
        "failure stops the run with a RewardError.",
    )
    isolate_failures: bool = Field(
        True,
        description="When the reward function raises on a whole batch, call it again one sample at a time so "
        "that only the samples that really fail are marked failed.",
    )
    max_failed_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="With skip_sample, raise a RewardError when more than this fraction of one batch failed "
        "(a broken reward function should stop the run, not silently train on nothing). 1.0 never stops.",
    )


@dataclass
class RewardResult:
    """Rewards for one batch. `failed[i]` marks a sample that could not be scored; its reward is NaN.

    `errors[i]` says why sample i failed (None when it did not). `metrics` holds optional batch-level
    numbers a reward function wants logged (e.g. the fraction of well-formatted answers).
    """

    rewards: list[float]
    failed: list[bool] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.rewards)
        if not self.failed:
            self.failed = [False] * n
        if not self.errors:
            self.errors = [None] * n
        if len(self.failed) != n or len(self.errors) != n:
            raise ValueError(
                f"RewardResult needs one entry per sample in rewards, failed and errors; got "
                f"{n}, {len(self.failed)} and {len(self.errors)}"
            )

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def num_failed(self) -> int:
        return sum(self.failed)

    def summary(self) -> dict[str, float]:
        """Batch metrics: mean reward over scored samples, failure count and fraction, plus `metrics`."""
        ok = [r for r, f in zip(self.rewards, self.failed) if not f]
        n = max(len(self.rewards), 1)
        out = {
            "reward_mean": sum(ok) / len(ok) if ok else float("nan"),
            "reward_failed": float(self.num_failed),
            "reward_failed_fraction": self.num_failed / n,
        }
        out.update(self.metrics)
        return out


@runtime_checkable
class RewardFn(Protocol):
    """`fn(prompts, completions, metadata) -> list[float] | RewardResult`, one reward per completion.

    Return `None` for a sample (or mark it failed in a `RewardResult`) when it cannot be scored; raising works
    too. Never return 0 for "could not check": 0 means "checked and wrong".
    """

    def __call__(
        self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
    ) -> Sequence[float | None] | RewardResult: ...


def _describe(exc: BaseException) -> str:
    text = exc.msg if isinstance(exc, SyntaxError) else exc  # its str repeats the file and line
    return f"{type(exc).__name__}: {text}"


def _to_reward(value: Any) -> tuple[float, str | None]:
    """One returned value -> (reward, error). Non-numeric, None and non-finite values are errors."""
    if value is None:
        return math.nan, "reward function returned None"
    if hasattr(value, "item") and not isinstance(value, numbers.Real):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    if not isinstance(value, numbers.Real):
        return math.nan, f"non-numeric reward of type {type(value).__name__}: {value!r:.80}"
    reward = float(value)
    if not math.isfinite(reward):
        return math.nan, f"non-finite reward {reward}"
    return reward, None


def _normalize_output(out: Any, n: int, fn_name: str) -> RewardResult:
    """Turn whatever a reward function returned into a checked RewardResult of length n."""
    if isinstance(out, RewardResult):
        values, failed, errors, metrics = out.rewards, out.failed, out.errors, dict(out.metrics)
    elif (
        isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__")
    ):
        raise TypeError(
            f"reward function {fn_name} returned {type(out).__name__}; it must return a list of floats "
            "(one per completion) or a RewardResult"
        )
    else:
        values = list(out)
        failed, errors, metrics = [False] * len(values), [None] * len(values), {}
    if len(values) != n:
        raise ValueError(f"reward function {fn_name} returned {len(values)} rewards for {n} completions")
    result = RewardResult(rewards=[], failed=[], errors=[], metrics=metrics)
    for value, was_failed, error in zip(values, failed, errors):
        if was_failed:
            reward, error = math.nan, error or "marked failed by the reward function"
        else:
            reward, error = _to_reward(value)
        result.rewards.append(reward)
        result.failed.append(error is not None)
        result.errors.append(error)
    return result


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class RewardScorer:
    """Calls a reward function safely and keeps running failure counts.

    `scorer(prompts, completions, metadata)` always returns a `RewardResult` of the right length, or raises
    `RewardError` when `cfg.on_reward_error == "raise"` and anything failed (or when too many failed).
    """

    def __init__(
        self, fn: RewardFn | Callable[..., Any], cfg: RewardConfig | None = None, name: str | None = None
    ) -> None:
        if not callable(fn):
            raise ValueError(f"reward function must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.cfg = cfg or RewardConfig()
        self.name = name or _fn_name(fn)  # messages name it: its import path when it has one
        self.total_scored = 0
        self.total_failed = 0

    def __call__(
        self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        n = len(completions)
        if len(prompts) != n or len(metadata) != n:
            raise ValueError(
                f"scoring needs one prompt and one metadata dict per completion; got {len(prompts)} prompts, "
                f"{n} completions and {len(metadata)} metadata dicts"
            )
        result = self._score_batch(prompts, completions, metadata) if n else RewardResult(rewards=[])
        self._account(result)
        return result

    def _call(
        self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        return _normalize_output(self.fn(prompts, completions, metadata), len(completions), self.name)

    def _score_batch(
        self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        try:
            return self._call(prompts, completions, metadata)
        except Exception as exc:
            if self.cfg.on_reward_error == "raise":
                raise RewardError(
                    f"reward function {self.name} failed on a batch of {len(completions)}: {_describe(exc)}"
                    f"{_raised_at(exc)}. Fix the reward function, or set task.reward.on_reward_error="
                    "skip_sample to mark such samples failed and continue."
                ) from exc
            logger.debug("reward function %s raised on a whole batch", self.name, exc_info=True)
            if not self.cfg.isolate_failures or len(completions) == 1:
                error = _describe(exc) + _raised_at(exc)
                return RewardResult(
                    [math.nan] * len(completions), [True] * len(completions), [error] * len(completions)
                )
            return self._score_one_by_one(prompts, completions, metadata)

    def _score_one_by_one(
        self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        merged = RewardResult(rewards=[], failed=[], errors=[])
        for p, c, m in zip(prompts, completions, metadata):
            try:
                one = self._call([p], [c], [m])
            except Exception as exc:
                one = RewardResult([math.nan], [True], [_describe(exc) + _raised_at(exc)])
            merged.rewards += one.rewards
            merged.failed += one.failed
            merged.errors += one.errors
        return merged

    def _account(self, result: RewardResult) -> None:
        n, bad = len(result), result.num_failed
        self.total_scored += n
        self.total_failed += bad
        if not bad:
            return
        first = next(e for e, f in zip(result.errors, result.failed) if f)
        if self.cfg.on_reward_error == "raise":
            raise RewardError(
                f"reward function {self.name} could not score {bad} of {n} samples (first: {first}). Fix the "
                "reward function, or set task.reward.on_reward_error=skip_sample to skip such samples and "
                "continue."
            )
        logger.warning("reward function %s: %d of %d samples failed (first: %s)", self.name, bad, n, first)
        if bad / n > self.cfg.max_failed_fraction:
            raise RewardError(
                f"reward function {self.name} failed on {bad} of {n} samples, more than "
                f"task.reward.max_failed_fraction={self.cfg.max_failed_fraction} (first error: {first}). Fix "
                "the reward function, or raise "
                "task.reward.max_failed_fraction (1.0 never stops)."
            )


def _split_path(path: str) -> tuple[str, list[str]]:
    """'pkg.mod:obj.attr' -> ('pkg.mod', ['obj', 'attr']); 'pkg.mod.fn' -> ('pkg.mod', ['fn'])."""
    if ":" in path:
        module, _, attrs = path.rpartition(":")
        return module, attrs.split(".")
    module, _, attr = path.rpartition(".")
    return module, [attr]


_OWN_CODE = str(Path(__file__).resolve().parents[1])  # posttrain's own files


def _raised_at(exc: BaseException) -> str:
    """' (file, line N)' of the innermost frame of `exc` in the user's code (not posttrain's or the
    import machinery's), or of a SyntaxError's text; '' when there is none."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}, line {exc.lineno})"
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(("<frozen", _OWN_CODE))
    ]
    return f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def file_module_name(file: Path) -> str:
    """The name a file loaded by path is registered under in sys.modules: its stem, made an identifier,
    and a hash of its resolved path (two files of one name stay apart; one file keeps one name)."""
    resolved = str(file.resolve())
    stem = re.sub(r"\W", "_", file.stem)
    return f"posttrain_user_{stem}_{hashlib.sha256(resolved.encode()).hexdigest()[:12]}"


def _exec_file(file: Path, path: str, what: str) -> Any:
    """Run `file` as a module registered in sys.modules (as an import would: dataclasses, pickling and
    process pools look a function's or class's module up there); loaded once per process."""
    if not file.is_file():
        raise ValueError(f"{what} '{path}': file '{file}' does not exist")
    name = file_module_name(file)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what} '{path}': cannot load '{file}' as a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _pickle_by_value(mod)
    return mod


def _pickle_by_value(mod: Any) -> None:
    """Have cloudpickle (loky) and Ray's copy of it ship `mod`'s functions and classes by value, as they
    did while it was in no sys.modules: by reference, a fresh worker process would import `mod` by its
    name and fail. Ray's copy is registered when Ray is already imported (importing it imports Ray)."""
    names = ["ray.cloudpickle"] if "ray" in sys.modules else []
    if importlib.util.find_spec("cloudpickle") is not None:
        names.append("cloudpickle")
    for name in names:
        register = getattr(importlib.import_module(name), "register_pickle_by_value", None)
        if register is not None:
            register(mod)


def _import_module(module: str, path: str, what: str = "reward function") -> Any:
    """The module of `path`; a ValueError naming `path` when it is missing or its code raises on import."""
    try:
        if module.endswith(".py"):
            return _exec_file(Path(module), path, what)
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or module
        if module.endswith(".py"):
            where = f" (imported at {_raised_at(exc)[2:-1]})"
        else:
            where = (
                "" if module == missing or module.startswith(missing + ".") else f" (imported by '{module}')"
            )
        raise ValueError(
            f"{what} '{path}': cannot import module '{missing}'{where}. Write the path as "
            "'package.module:name' (or 'path/to/file.py:name') and make sure the package is "
            "installed or on PYTHONPATH."
        ) from exc
    except ValueError:
        raise
    except Exception as exc:  # the user's module is broken: say where, not a traceback through importlib
        raise ValueError(
            f"{what} '{path}': importing '{module}' raised {_describe(exc)}{_raised_at(exc)}. Fix the module."
        ) from exc


def load_reward_fn(path: str) -> Callable[..., Any]:
    """Import a reward function from 'package.module:function', 'package.module.function' or 'file.py:function'.

    Raises ValueError naming `path` when the module cannot be imported, the attribute does not exist, or
    the object is not callable.
    """
    return load_callable(
        path, "reward function", "a function (prompts, completions, metadata) -> list[float]"
    )


def load_callable(path: str, what: str, expected: str) -> Callable[..., Any]:
    """Import the callable `what` (a reward function, an environment class, a tool-call parser) from
    'package.module:name', 'package.module.name' or 'file.py:name'; a ValueError naming `path` and
    what it should point at (`expected`) otherwise."""
    module, attrs = _split_path(path.strip())
    if not module or not all(attrs):
        raise ValueError(
            f"{what} path '{path}' is not of the form 'package.module:name' (or 'package.module.name')"
        )
    obj = _import_module(module, path, what)
    for attr in attrs:
        if not hasattr(obj, attr):
            names = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n)))
            raise ValueError(
                f"{what} '{path}': '{module}' has no attribute '{attr}'. "
                f"Callables there: {', '.join(names[:20]) or 'none'}."
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ValueError(
            f"{what} '{path}' resolves to a {type(obj).__name__}, which is not callable; point it at {expected}"
        )
    return obj
