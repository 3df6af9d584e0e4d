"""Rank-aware logging and the structured metrics log (JSON lines, optional TensorBoard / W&B)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import IO, Any

from pydantic import Field, model_validator

from posttrain.config import Config


def installed(package: str) -> bool:
    """Whether `package` can be imported (found on the path, or imported already)."""
    return package in sys.modules or importlib.util.find_spec(package) is not None


class LoggingConfig(Config):
    """Where and how metrics are written."""

    tensorboard: bool = Field(
        False, description="also write TensorBoard event files (pip install tensorboard)"
    )
    wandb_project: str | None = Field(
        None, description="also log to this Weights & Biases project (None: off; pip install wandb)"
    )
    wandb_run_name: str | None = Field(
        None, description="the W&B run's name (None: the name of the run's output_dir)"
    )
    progress_bar: bool = Field(True, description="rich progress bar on the console")

    @model_validator(mode="after")
    def _sinks_installed(self) -> LoggingConfig:
        """A sink whose package is missing is refused here, before a run builds its model and engine."""
        if self.tensorboard and not installed("tensorboard"):
            raise ValueError(
                "logging.tensorboard=true needs the tensorboard package, which is not installed: "
                "pip install tensorboard, or set logging.tensorboard=false"
            )
        if self.wandb_project and not installed("wandb"):
            raise ValueError(
                f"logging.wandb_project={self.wandb_project} needs the wandb package, which is not "
                "installed: pip install wandb, or set logging.wandb_project=null (no W&B logging)"
            )
        return self


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


def _one_element(value: Any) -> bool:
    """Whether a tensor or array (or a numpy scalar) holds exactly one element."""
    numel = getattr(value, "numel", None)  # torch; numpy's `size` is an attribute, torch's a method
    return (numel() if callable(numel) else getattr(value, "size", None)) == 1


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and _one_element(value):  # tensors, arrays, numpy scalars: a Python number
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
    TensorBoard / W&B when enabled. A fresh run starts the file afresh (and removes the TensorBoard event
    files an earlier run left in `<run_dir>/tb`); a run resumed at `resume_step` keeps the rows up to that
    step, drops later ones (logged after the checkpoint it resumes from, by the run that went on from
    there) and appends, so each step appears once however often it resumes. TensorBoard purges its
    events after `resume_step`; W&B continues the run whose id `<run_dir>/wandb_run_id` holds, and is
    sent no step up to `resume_step` again (W&B takes steps in increasing order only)."""

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
        self.resume_step = resume_step
        self._file = None
        self._tb = None
        self._wandb = None
        try:  # the sinks first: one that cannot start leaves metrics.jsonl as it was
            if tensorboard:
                self._tb = _tensorboard_writer(self.run_dir / "tb", resume_step)
            if wandb_project:
                name = run_name or self.run_dir.absolute().name
                self._wandb = _wandb_run(self.run_dir, wandb_project, name, resume_step)
        except BaseException:
            self.close(failed=True)
            raise
        self._file = self._open_jsonl()

    def _open_jsonl(self) -> IO[str]:
        if self.resume_step is not None:
            dropped = trim_metrics(self.path, self.resume_step)
            if dropped:
                log.warning(
                    "%s: dropped %d row(s) after step %d, the step resumed from",
                    self.path,
                    dropped,
                    self.resume_step,
                )
        return self.path.open("w" if self.resume_step is None else "a")

    def log(self, metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        flat = {(f"{prefix}/{k}" if prefix else k): _jsonable(v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **flat}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None and (self.resume_step is None or step > self.resume_step):
            self._wandb.log(scalars, step=step)

    def close(self, failed: bool = False) -> None:
        """Close the sinks; `failed`: the run ended by an error (W&B marks the run failed, exit code 1)."""
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else None)  # None: finished as a success


def _tensorboard_writer(tb_dir: Path, resume_step: int | None) -> Any:
    """A SummaryWriter on `tb_dir`: a resumed run's drops the events after `resume_step`; a fresh run
    first removes the event files an earlier run left there (its own files only)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # pragma: no cover - depends on optional package
        raise ValueError("logging.tensorboard=true needs `pip install tensorboard`") from e
    if resume_step is None and tb_dir.is_dir():
        old = list(tb_dir.glob("events.out.tfevents.*"))
        for f in old:
            f.unlink()
        if old:
            log.warning(
                "%s: a fresh run removed %d TensorBoard event file(s) of an earlier run", tb_dir, len(old)
            )
    purge = None if resume_step is None else resume_step + 1  # TensorBoard drops later events too
    return SummaryWriter(str(tb_dir), purge_step=purge)


def _wandb_run(run_dir: Path, project: str, name: str, resume_step: int | None) -> Any:
    """A W&B run: a fresh run's gets a new id, saved in `<run_dir>/wandb_run_id`; a resumed run continues
    the run of the saved id (a new one when there is none)."""
    try:
        import wandb
    except ImportError as e:  # pragma: no cover - depends on optional package
        raise ValueError("logging.wandb_project is set but wandb is not installed: pip install wandb") from e
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else ""
    if not run_id:
        run_id = uuid.uuid4().hex[:16]
        id_file.write_text(run_id + "\n")
    return wandb.init(project=project, name=name, dir=str(run_dir), id=run_id, resume="allow")


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
