"""Reading a dataset's rows from local sources: a `.jsonl` file (one JSON object per line), a `.json` file
holding a list of objects, a `.parquet` file (needs `pyarrow`), or a directory written by
`datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` (needs `datasets`; a DatasetDict is read
one split at a time). Rows come back as they are stored; tasks/datasets.py checks them.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any


def _require(module: str, purpose: str) -> Any:
    """Import an optional dependency, or say which package to install for `purpose`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        raise ValueError(f"{purpose} needs the '{package}' package: pip install {package}") from exc


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}: row {len(rows)} (line {line_no}) is not valid JSON ({exc.msg}); each line must "
                    "hold one JSON object"
                ) from exc
    return rows


def _read_json(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg}); use a list of objects or .jsonl") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list of objects, got {type(data).__name__}")
    return data


def _read_parquet(path: Path) -> list[Any]:
    pq = _require("pyarrow.parquet", "reading .parquet files")
    return pq.read_table(path).to_pylist()


def _read_saved_dataset(path: Path, split: str | None) -> list[Any]:
    hf = _require("datasets", "reading a save_to_disk directory")
    ds = hf.load_from_disk(str(path))
    if isinstance(ds, hf.DatasetDict):
        if split is None or split not in ds:
            raise ValueError(
                f"{path} holds the splits {sorted(ds)}; choose one with the train_split / eval_split setting "
                f"(got {split!r})"
            )
        ds = ds[split]
    return ds.to_list()


def load_rows(path: str | Path, split: str | None = None) -> list[Any]:
    """Read all rows of a local .jsonl / .json / .parquet file or a `save_to_disk` directory."""
    p = Path(path)
    if p.is_dir():
        if not any((p / name).exists() for name in ("dataset_dict.json", "state.json", "dataset_info.json")):
            raise ValueError(f"directory {p} is not a dataset saved by datasets.save_to_disk")
        return _read_saved_dataset(p, split)
    if not p.is_file():
        raise ValueError(f"dataset path {p} does not exist")
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    reader = readers.get(p.suffix.lower())
    if reader is None:
        raise ValueError(
            f"unsupported dataset file {p}: use .jsonl, .json, .parquet or a save_to_disk directory"
        )
    return reader(p)


def saved_splits(path: str | Path) -> list[str] | None:
    """The split names of a DatasetDict saved with `save_to_disk` at `path`; None for any other source."""
    index = Path(path) / "dataset_dict.json"
    if not index.is_file():
        return None
    return list(json.loads(index.read_text(encoding="utf-8")).get("splits", []))
