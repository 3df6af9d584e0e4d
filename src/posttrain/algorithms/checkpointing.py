"""CheckpointManager: periodic atomic saves of policy + loop state, keep-top-k by a metric, resume.

Checkpoints live in `<dir>/step_<N>/` (written atomically by `Policy.save_checkpoint`). The loop's own
state (step, data position, controller state, the loop config) goes into the checkpoint's extra
state. `resume: auto` continues from the newest complete checkpoint if there is one, `never` starts
fresh (over a previous run only with `overwrite`, which deletes it: algorithms/runs.py), and a path
resumes from exactly that checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field

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
    higher_is_better: bool = True
    resume: str = Field("auto", description="'auto' (newest if any), 'never', or a checkpoint path")
    overwrite: bool = Field(
        False,
        description="with resume='never': delete a previous run in the output directory (checkpoints, "
        "metrics.jsonl, curves.png, config.yaml) and start over, instead of refusing (CLI: --overwrite)",
    )


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[-1])


class CheckpointManager:
    """Saves and finds checkpoints for a training loop."""

    def __init__(self, cfg: CheckpointingConfig, output_dir: str | Path) -> None:
        self.cfg = cfg
        self.root = Path(cfg.checkpoint_dir or Path(output_dir) / "checkpoints").absolute()

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints (metadata.json present), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.is_dir() and (p / "metadata.json").is_file()]
        return sorted(found, key=_step_of)

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from, or None for a fresh start."""
        mode = self.cfg.resume
        if mode == "never":
            return None
        if mode == "auto":
            found = self.complete_checkpoints()
            return found[-1] if found else None
        path = Path(mode)
        if not (path / "metadata.json").is_file():
            raise ValueError(
                f"checkpointing.resume='{mode}' is not a complete checkpoint (no metadata.json); "
                "use 'auto', 'never' or the path of a step_<N> directory"
            )
        return path

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
        value = json.loads(extra.read_text()).get("metrics", {}).get(name)
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
