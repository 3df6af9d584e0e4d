"""CheckpointManager: periodic atomic saves of policy + loop state, keep-top-k by a metric, resume.

Checkpoints live in `<dir>/step_<N>/` (written atomically by `Policy.save_checkpoint`). The loop's own
state (step, data position, controller state, the loop config) goes into the checkpoint's extra
state. `resume: auto` continues from the newest checkpoint whose files match the checksums of its save
(skipping damaged ones, with the reason logged), `never` starts fresh (over a previous run only with
`overwrite`, which deletes it: algorithms/runs.py), and a path resumes from exactly that checkpoint.

Only committed `step_<N>` directories count. What a killed save leaves behind (`step_<N>.tmp-<id>`,
and `step_<N>.old-<id>` when it was replacing a checkpoint; see checkpoint.py) is cleaned up when the
run starts: a checkpoint that was moved aside and never replaced is moved back, the rest is removed.

Companions: policies trained beside the policy (PPO's critic) are saved first, each as its own
checkpoint `step_<N>-<name>`, then the policy's `step_<N>`, whose commit commits the step. Every save
has an id, written into the companions' extra state and listed in the policy's, so a step whose
companion is missing, damaged or from another save (a save killed between the two) is not intact; a
companion whose step never committed is removed with the other leftovers.
"""

from __future__ import annotations

import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field

from posttrain.checkpoint import EXTRA_STATE_FILE, verify_checkpoint
from posttrain.checkpoint_verify import read_json
from posttrain.config import Config, nearest_key
from posttrain.logging import get_logger

log = get_logger(__name__)


class CheckpointingConfig(Config):
    """When and where checkpoints are written, which are kept, and how a run resumes."""

    enabled: bool = Field(True, description="write checkpoints")
    checkpoint_dir: str | None = Field(None, description="default: <output_dir>/checkpoints")
    save_period: int = Field(10, ge=1, description="save every N steps (and at the last step)")
    keep_top_k: int | None = Field(None, ge=1, description="keep the k best by `metric_name` (+ the newest)")
    metric_name: str | None = Field(None, description="metric ranking checkpoints, e.g. 'val/accuracy'")
    higher_is_better: bool = Field(True, description="keep_top_k: a higher `metric_name` is better")
    resume: str = Field("auto", description="'auto' (newest if any), 'never', or a checkpoint path")
    overwrite: bool = Field(
        False,
        description="with resume='never': delete a previous run in the output directory (checkpoints, "
        "metrics.jsonl, curves.png, config.yaml) and start over, instead of refusing (CLI: --overwrite)",
    )


STEP_DIR = re.compile(r"step_(\d+)")
LEFTOVER = re.compile(r"(step_\d+(?:-[A-Za-z]\w*)?)\.(tmp|old)-\w+")
COMPANION = re.compile(r"(step_\d+)-([A-Za-z]\w*)")


def _step_of(path: Path) -> int | None:
    """N for a committed `step_<N>` directory's name, None for anything else."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


class CheckpointManager:
    """Saves and finds checkpoints for a training loop."""

    def __init__(
        self, cfg: CheckpointingConfig, output_dir: str | Path, companions: tuple[str, ...] = ()
    ) -> None:
        self.cfg = cfg
        self.root = Path(cfg.checkpoint_dir or Path(output_dir) / "checkpoints").absolute()
        self.companions = companions  # names of the policies saved beside the policy (see the docstring)
        self.resumed: Path | None = None  # the checkpoint resume_path picked
        self._metric_checked = False  # whether a save has checked metric_name against its step's metrics

    @staticmethod
    def companion_path(path: Path, name: str) -> Path:
        """Where companion `name` of checkpoint `path` (a `step_<N>` directory) lives."""
        return path.parent / f"{path.name}-{name}"

    def check_companions(self, path: Path) -> None:
        """Raise ValueError unless each companion of `path` is intact and from the same save."""
        if not self.companions:
            return
        listed = read_json(path / EXTRA_STATE_FILE).get("companions", {})
        for name in self.companions:
            other = self.companion_path(path, name)
            if name not in listed:
                raise ValueError(
                    f"it has no {name} (written by a run without one); resume from a checkpoint of this "
                    "kind of run, or start over"
                )
            if not (other / "metadata.json").is_file():
                raise ValueError(f"its {name} checkpoint {other.name} is missing")
            verify_checkpoint(other)
            if read_json(other / EXTRA_STATE_FILE).get("save_id") != listed[name]:
                raise ValueError(f"its {name} checkpoint {other.name} is from another save")

    def complete_checkpoints(self) -> list[Path]:
        """Committed checkpoints (`step_<N>` with metadata.json), oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            p
            for p in self.root.iterdir()
            if _step_of(p) is not None and p.is_dir() and (p / "metadata.json").is_file()
        ]
        return sorted(found, key=_step_of)

    def clean_leftovers(self) -> None:
        """Undo what killed saves left: move back a checkpoint moved aside and never replaced, remove the
        other `.old-*` and every `.tmp-*` directory (a log line each; the command, if removal fails)."""
        if not self.root.is_dir():
            return
        found = [(m, p) for p in self.root.iterdir() if (m := LEFTOVER.fullmatch(p.name))]
        found.sort(key=lambda mp: (mp[0].group(2) != "old", mp[1].name))  # `.old-*` first, then `.tmp-*`
        for match, path in found:
            final = self.root / match.group(1)
            if match.group(2) == "old" and not final.exists():
                path.rename(final)
                log.warning("moved %s back to %s (its replacement was interrupted)", path, final)
                continue
            shutil.rmtree(path, ignore_errors=True)
            if path.exists():
                log.warning(
                    "could not remove %s, left by an interrupted save; remove it: rm -rf '%s'", path, path
                )
            else:
                log.warning("removed %s, left by an interrupted save", path)
        for path in self.root.iterdir():
            match = COMPANION.fullmatch(path.name)
            if match and not (self.root / match.group(1) / "metadata.json").is_file():
                shutil.rmtree(path, ignore_errors=True)
                log.warning("removed %s, a companion whose checkpoint was never committed", path)

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from, or None for a fresh start (after `clean_leftovers`)."""
        self.clean_leftovers()
        mode = self.cfg.resume
        if mode == "never":
            return None
        if mode == "auto":
            self.resumed = self._newest_intact()
            return self.resumed
        path = Path(mode)
        if not (path / "metadata.json").is_file():
            raise ValueError(
                f"checkpointing.resume='{mode}' is not a complete checkpoint (no metadata.json); "
                "use 'auto', 'never' or the path of a step_<N> directory"
            )
        try:
            self.check_companions(path)
        except ValueError as e:
            raise ValueError(f"checkpointing.resume='{mode}' cannot resume this run: {e}") from None
        self.resumed = path
        return path

    def _newest_intact(self) -> Path | None:
        """The newest checkpoint that `verify_checkpoint` passes; each one skipped is logged with the reason.
        Raises if there are checkpoints and none passes."""
        skipped = []
        for path in reversed(self.complete_checkpoints()):
            try:
                verify_checkpoint(path)
                self.check_companions(path)
            except ValueError as e:
                log.warning("skipping checkpoint %s: %s", path, e)
                skipped.append(f"{path.name}: {e}")
                continue
            if skipped:
                log.warning("resuming from %s, the newest intact checkpoint", path)
            return path
        if skipped:
            raise ValueError(
                f"checkpointing.resume=auto: no checkpoint in '{self.root}' is intact:\n  "
                + "\n  ".join(skipped)
                + f"\nRestore one from a copy, or move '{self.root}' away to start from scratch"
            )
        return None

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.save_period == 0 or step == last_step)

    def save(
        self,
        policy: Any,
        step: int,
        extra_state: dict[str, Any],
        metrics: dict[str, float],
        companions: dict[str, Any] | None = None,
    ) -> Path:
        """Save atomically (companions first, the policy's commit last), record the ranking metric, prune
        to keep_top_k."""
        companions = companions or {}
        if set(companions) != set(self.companions):
            raise ValueError(f"companions {sorted(companions)} != the manager's {sorted(self.companions)}")
        path = self.root / f"step_{step}"
        save_id = uuid.uuid4().hex
        for name, other in companions.items():
            other.save_checkpoint(str(self.companion_path(path, name)), {"save_id": save_id, "step": step})
        listed = {name: save_id for name in companions}
        self._check_metric(step, metrics)
        policy.save_checkpoint(
            str(path), extra_state={**extra_state, "metrics": _finite(metrics), "companions": listed}
        )
        self._prune(path)
        return path

    def _check_metric(self, step: int, metrics: dict[str, float]) -> None:
        """Warn (once) when `metric_name` is not among the metrics of the first save's step: a misspelled
        name scores every checkpoint None, and keep_top_k then keeps the oldest ones. A validation metric
        (val/...) at a step that did not validate (none of its metrics is one) is not misspelled: the
        steps that save are not the steps that validate."""
        name = self.cfg.metric_name
        if self._metric_checked or name is None or self.cfg.keep_top_k is None:
            return
        self._metric_checked = True
        if name in metrics:
            return
        if name.startswith("val/") and not any(k.startswith("val/") for k in metrics):
            log.warning(
                "checkpointing.metric_name=%r is a validation metric and step %d saved without validating: "
                "checkpointing.save_period=%d does not line up with the validation period (grpo.val_period), "
                "and a checkpoint without the metric ranks last for keep_top_k=%d (pruned first). Make "
                "save_period a multiple of the validation period",
                name,
                step,
                self.cfg.save_period,
                self.cfg.keep_top_k,
            )
            return
        near = nearest_key(name, sorted(metrics))
        log.warning(
            "checkpointing.metric_name=%r is not among the metrics of step %d%s: a checkpoint without "
            "it ranks last for keep_top_k=%d (pruned first). Name a metric logged at the steps that "
            "save (validation runs every grpo.val_period steps)%s",
            name,
            step,
            f" (did you mean {near!r}?)" if near else "",
            self.cfg.keep_top_k,
            "" if name == "val/accuracy" else ", e.g. val/accuracy",
        )

    def _score(self, path: Path) -> float | None:
        name = self.cfg.metric_name
        extra = path / EXTRA_STATE_FILE
        if name is None or not extra.is_file():
            return None
        try:
            value = read_json(extra).get("metrics", {}).get(name)
        except ValueError:  # damaged: ranked last, so pruned first
            return None
        return None if value is None else float(value)

    def _prune(self, saved: Path) -> None:
        """Keep `keep_top_k` checkpoints, always the one just `saved`. Checkpoints of later steps than it
        belong to a history the run left (it resumed from an earlier one, or skipped a damaged newest):
        they rank last, so they go first, and never count as the newest."""
        k = self.cfg.keep_top_k
        found = self.complete_checkpoints()
        if k is None or len(found) <= k:
            return
        step = _step_of(saved)
        ours = [p for p in found if _step_of(p) <= step]
        left = [p for p in found if _step_of(p) > step]
        if self.cfg.metric_name is None:
            ranked = list(reversed(ours))
        else:
            sign = 1.0 if self.cfg.higher_is_better else -1.0
            scored = [(p, self._score(p)) for p in ours]
            ranked = [
                p
                for p, s in sorted(
                    scored, key=lambda ps: -sign * ps[1] if ps[1] is not None else float("inf")
                )
            ]
        ranked += left
        keep = set(ranked[:k]) | {saved}
        for p in found:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)
                for name in self.companions:
                    shutil.rmtree(self.companion_path(p, name), ignore_errors=True)
                log.info("removed checkpoint %s (keep_top_k=%d)", p, k)


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and v == v and v not in (float("inf"), float("-inf")):
            out[k] = float(v)
    return out


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


def check_resume_config(
    saved: dict[str, Any],
    current: dict[str, Any],
    may_change: tuple[str, ...] = (),
    at_default: Callable[[str], bool] | None = None,
) -> list[tuple[str, Any, Any]]:
    """Refuse to resume when a setting that shapes the trajectory changed; list each differing key.

    `may_change`: dotted keys that a resumed run may set differently (e.g. the number of steps); returns
    those that differ as (key, checkpoint's value, current value). `at_default(key)`: whether the current
    config holds the default of a key; a key the checkpoint lacks (a setting added since it was written,
    whose default keeps the behaviour it was written with) is accepted at its default."""
    a, b = _flatten(saved), _flatten(current)
    added = {k for k in set(b) - set(a) if at_default is not None and at_default(k)}
    for k in sorted(added):
        log.info("resuming a checkpoint written before %s existed: its default %r applies", k, b[k])
    differ = [k for k in sorted((set(a) | set(b)) - added) if a.get(k) != b.get(k)]
    refused = [f"{k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in differ if k not in may_change]
    if refused:
        raise ValueError(
            "cannot resume: the run's config differs from the checkpoint's:\n  "
            + "\n  ".join(refused)
            + "\nuse the checkpoint's values, choose another output_dir, or start over in this one with "
            "--overwrite (checkpointing.resume=never checkpointing.overwrite=true: deletes this run)"
        )
    return [(k, a.get(k), b.get(k)) for k in differ if k in may_change]
