"""Rank-aware logging and the structured metrics log (JSON lines, optional TensorBoard / W&B)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from posttrain.config import Config


class LoggingConfig(Config):
    """Where and how metrics are written."""

    tensorboard: bool = Field(
        False, description="also write TensorBoard event files (pip install tensorboard)"
    )
    wandb_project: str | None = Field(
        None, description="also log to this Weights & Biases project (None: off)"
    )
    progress_bar: bool = Field(True, description="rich progress bar on the console")


def get_logger(name: str) -> logging.Logger:
    """A logger whose records carry the distributed rank (from RANK, default 0)."""
    logger = logging.getLogger(name)
    if not logging.getLogger("posttrain").handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK", "0")
        handler.setFormatter(logging.Formatter(f"[%(asctime)s r{rank} %(name)s %(levelname)s] %(message)s"))
        root = logging.getLogger("posttrain")
        root.addHandler(handler)
        root.setLevel(os.environ.get("POSTTRAIN_LOG_LEVEL", "WARNING"))
    return logger


log = get_logger(__name__)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def trim_metrics(path: Path, step: int) -> int:
    """Keep the rows of a metrics.jsonl up to `step` (and drop a line cut short by a kill), rewriting the
    file atomically; returns how many rows were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class MetricsLogger:
    """Writes one JSON object per `log()` call to `<run_dir>/metrics.jsonl`; mirrors scalars to
    TensorBoard / W&B when enabled. A fresh run starts the file afresh; a run resumed at `resume_step`
    keeps the rows up to that step, drops later ones (logged after the checkpoint it resumes from, by
    the run that went on from there) and appends, so each step appears once however often it resumes."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        run_name: str | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            dropped = trim_metrics(self.path, resume_step)
            if dropped:
                log.warning(
                    "%s: dropped %d row(s) after step %d, the step resumed from",
                    self.path,
                    dropped,
                    resume_step,
                )
        self._file = self.path.open("w" if resume_step is None else "a")
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - depends on optional package
                raise ValueError("logging.tensorboard=true needs `pip install tensorboard`") from e
            purge = None if resume_step is None else resume_step + 1  # TensorBoard drops later events too
            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge)
        if wandb_project:
            try:
                import wandb
            except ImportError as e:  # pragma: no cover - depends on optional package
                raise ValueError(
                    "logging.wandb_project is set but wandb is not installed: pip install wandb"
                ) from e
            self._wandb = wandb.init(project=wandb_project, name=run_name, dir=str(self.run_dir))

    def log(self, metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        flat = {(f"{prefix}/{k}" if prefix else k): _jsonable(v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **flat}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics.jsonl file back (tests and plots use this)."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


class StepProgress:
    """A rich progress bar over training steps showing a few named metrics (no-op when disabled)."""

    def __init__(self, total: int, description: str, fields: tuple[str, ...], enabled: bool = True) -> None:
        self.fields = fields
        self._progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._progress.start()
            self._task = self._progress.add_task(description, total=total, info="")

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if self._progress is None:
            return
        parts = []
        for f in self.fields:
            if isinstance(metrics.get(f), (int, float)):
                parts.append(f"{f.split('/')[-1]}={metrics[f]:.3g}")
        self._progress.update(self._task, completed=step, info=" ".join(parts))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def plot_metrics(jsonl: str | Path, out_png: str | Path, keys: tuple[str, ...]) -> Path | None:
    """A PNG with one panel per metric key (step on x); None when matplotlib is missing or no data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger("posttrain").warning(
            "matplotlib is not installed; no plot written (pip install matplotlib)"
        )
        return None
    records = read_metrics(jsonl)
    series = {k: [(r["step"], r[k]) for r in records if isinstance(r.get(k), (int, float))] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.5), squeeze=False)
    for ax, (k, pts) in zip(axes[0], series.items()):
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", markersize=3)
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
