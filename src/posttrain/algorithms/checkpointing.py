"""CheckpointManager: periodic atomic saves of policy + loop state, keep-top-k by a metric, resume.

Checkpoints live in `<dir>/step_<N>/` (written atomically by `Policy.save_checkpoint`). The loop's own
state (step, data position, controller state, the loop config) goes into the checkpoint's extra
state. `resume: auto` continues from the newest checkpoint whose files match the checksums of its save
(skipping damaged ones, with the reason logged), `never` starts fresh (over a previous run only with
`overwrite`, which deletes it: algorithms/runs.py), and a path resumes from exactly that checkpoint.

Only committed `step_<N>` directories count. What a killed save leaves behind (`step_<N>.tmp-<id>`,
and `step_<N>.old-<id>` when it was replacing a checkpoint; see checkpoint.py) is cleaned up when the
run starts: a checkpoint that was moved aside and never replaced is moved back, the rest is removed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field

from posttrain.checkpoint import verify_checkpoint
from posttrain.checkpoint_verify import read_json
from posttrain.config import Config
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
LEFTOVER = re.compile(r"(step_\d+)\.(tmp|old)-\w+")


def _step_of(path: Path) -> int | None:
    """N for a committed `step_<N>` directory's name, None for anything else."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


class CheckpointManager:
    """Saves and finds checkpoints for a training loop."""

    def __init__(self, cfg: CheckpointingConfig, output_dir: str | Path) -> None:
        self.cfg = cfg
        self.root = Path(cfg.checkpoint_dir or Path(output_dir) / "checkpoints").absolute()

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

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from, or None for a fresh start (after `clean_leftovers`)."""
        self.clean_leftovers()
        mode = self.cfg.resume
        if mode == "never":
            return None
        if mode == "auto":
            return self._newest_intact()
        path = Path(mode)
        if not (path / "metadata.json").is_file():
            raise ValueError(
                f"checkpointing.resume='{mode}' is not a complete checkpoint (no metadata.json); "
                "use 'auto', 'never' or the path of a step_<N> directory"
            )
        return path

    def _newest_intact(self) -> Path | None:
        """The newest checkpoint that `verify_checkpoint` passes; each one skipped is logged with the reason.
        Raises if there are checkpoints and none passes."""
        skipped = []
        for path in reversed(self.complete_checkpoints()):
            try:
                verify_checkpoint(path)
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

    def save(self, policy: Any, step: int, extra_state: dict[str, Any], metrics: dict[str, float]) -> Path:
        """Save atomically, record the ranking metric, prune to keep_top_k."""
        path = self.root / f"step_{step}"
        policy.save_checkpoint(str(path), extra_state={**extra_state, "metrics": _finite(metrics)})
        self._prune()
        return path

    def _score(self, path: Path) -> float | None:
        name = self.cfg.metric_name
        extra = path / "extra_state.json"
        if name is None or not extra.is_file():
            return None
        try:
            value = read_json(extra).get("metrics", {}).get(name)
        except ValueError:  # damaged: ranked last, so pruned first
            return None
        return None if value is None else float(value)

    def _prune(self) -> None:
        k = self.cfg.keep_top_k
        found = self.complete_checkpoints()
        if k is None or len(found) <= k:
            return
        newest = found[-1]
        if self.cfg.metric_name is None:
            ranked = list(reversed(found))
        else:
            sign = 1.0 if self.cfg.higher_is_better else -1.0
            scored = [(p, self._score(p)) for p in found]
            ranked = [
                p
                for p, s in sorted(
                    scored, key=lambda ps: -sign * ps[1] if ps[1] is not None else float("inf")
                )
            ]
        keep = set(ranked[:k]) | {newest}
        for p in found:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)
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
    saved: dict[str, Any], current: dict[str, Any], may_change: tuple[str, ...] = ()
) -> list[tuple[str, Any, Any]]:
    """Refuse to resume when a setting that shapes the trajectory changed; list each differing key.

    `may_change`: dotted keys that a resumed run may set differently (e.g. the number of steps); returns
    those that differ as (key, checkpoint's value, current value)."""
    a, b = _flatten(saved), _flatten(current)
    differ = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    refused = [f"{k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in differ if k not in may_change]
    if refused:
        raise ValueError(
            "cannot resume: the run's config differs from the checkpoint's:\n  "
            + "\n  ".join(refused)
            + "\nuse the checkpoint's values, choose another output_dir, or start over in this one with "
            "--overwrite (checkpointing.resume=never checkpointing.overwrite=true: deletes this run)"
        )
    return [(k, a.get(k), b.get(k)) for k in differ if k in may_change]
