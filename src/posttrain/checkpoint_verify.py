"""Checksums of a checkpoint's files, their verification, the fingerprint a checkpoint must match to load,
and the fault points of a save.

`save_checkpoint` records the size and SHA-256 of every file of a checkpoint in its metadata.json,
which is written last; `load_checkpoint` and `verify_checkpoint` (checkpoint.py) recompute them, so
a file that was truncated, overwritten or left out is named before anything is loaded from it.
SHA-256 because, with the CPU's SHA instructions, it is the fastest strong hash in hashlib (1.7 GB/s
on one core where this was written, BLAKE2b 0.9 GB/s); the ranks hash a share of the files each.

Test hook: `POSTTRAIN_CHECKPOINT_FAULT=<stage>:<name>` SIGKILLs the process saving the checkpoint
directory called `<name>` when the save reaches `<stage>` (one of `STAGES`), as a kill -9 or a power
loss would (tests/test_faults.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DIGEST = "sha256"
METADATA_FILE = "metadata.json"
FAULT_ENV = "POSTTRAIN_CHECKPOINT_FAULT"
STAGES = (
    "start",  # nothing written yet
    "shards",  # the tensor shards are in <dir>.tmp-<id>, nothing else
    "metadata",  # <dir>.tmp-<id> is complete, metadata.json included, and not yet renamed
    "aside",  # replacing a checkpoint: the old one is at <dir>.old-<id>, the new one not yet in place
    "committed",  # renamed into place (the old one, if any, not yet removed)
)


class CorruptCheckpointError(ValueError):
    """A checkpoint's file is unreadable, or differs from what its save recorded; the message names it."""


def fault_point(stage: str, target: Path) -> None:
    """The test hook of the module docstring: a no-op unless FAULT_ENV names this stage and directory."""
    assert stage in STAGES, stage
    if os.environ.get(FAULT_ENV) == f"{stage}:{target.name}":
        os.kill(os.getpid(), signal.SIGKILL)


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; a damaged one is reported with its path."""
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"'{path}' is damaged: not valid JSON ({e})") from None


def checkpoint_files(root: Path) -> list[str]:
    """Every file of the checkpoint at `root` except metadata.json, as sorted relative paths."""
    files = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(f for f in files if f != METADATA_FILE)


def file_digest(path: Path) -> str:
    h = hashlib.new(DIGEST)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def digests(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {"bytes": size, "sha256": hex digest}} of the files `names` under `root`."""
    return {n: {"bytes": (root / n).stat().st_size, DIGEST: file_digest(root / n)} for n in names}


def damaged(root: Path, recorded: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    """What is wrong with each of the files `names` compared with the `recorded` digests (empty: intact)."""
    out = []
    for name in names:
        path, want = root / name, recorded[name]
        if not path.is_file():
            out.append(f"{name}: missing")
        elif (size := path.stat().st_size) != want["bytes"]:
            out.append(f"{name}: {size} bytes, saved with {want['bytes']} (truncated or overwritten)")
        elif file_digest(path) != want[DIGEST]:
            out.append(f"{name}: contents changed since the save ({DIGEST} differs)")
    return out


def _over_ranks(fn: Callable[[list[str]], list[Any]], names: list[str], collective: bool) -> list[Any]:
    """`fn` on this rank's share of `names` (every world-th one); with `collective`, every rank of the
    process group gets all ranks' results concatenated, or the same error."""
    on_group = collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if on_group else (0, 1)
    try:
        mine: tuple[bool, Any] = (True, fn(names[rank::world]))
    except Exception as e:
        mine = (False, f"rank {rank}: {e!r}")
    every = [mine]
    if on_group:
        every = [None] * world
        dist.all_gather_object(every, mine)
    errors = [value for ok, value in every if not ok]
    if errors:
        raise OSError("checksumming the checkpoint's files failed: " + "; ".join(errors))
    return [x for _, share in every for x in share]


def record_digests(root: Path) -> dict[str, dict[str, Any]]:
    """`digests` of every file under `root` but metadata.json, each rank hashing a share (collective)."""
    names = [checkpoint_files(root)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(names, src=0)  # rank 0's listing: a shared filesystem may lag elsewhere
    return dict(_over_ranks(lambda share: list(digests(root, share).items()), names[0], collective=True))


def verify_files(root: Path, meta: dict[str, Any], collective: bool) -> None:
    """Raise CorruptCheckpointError naming every file of `root` that differs from the digests recorded in
    its metadata (none recorded: a checkpoint from before checksums, accepted). With `collective`, the
    ranks check a share each and all raise or none."""
    recorded = meta.get("files", {})
    problems = _over_ranks(lambda names: damaged(root, recorded, names), sorted(recorded), collective)
    if problems:
        raise CorruptCheckpointError(
            f"checkpoint '{root}' is damaged: " + "; ".join(problems) + ". Resume from an earlier "
            "checkpoint (checkpointing.resume=auto picks the newest intact one) or restore it from a copy"
        )


# ---------------------------------------------------------------------- fingerprint


def model_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """What identifies a model's architecture: its HF model type and its parameter names and global shapes."""
    config = getattr(model, "config", None)
    return {
        "model_type": getattr(config, "model_type", type(model).__name__),
        "params": {n: list(p.shape) for n, p in model.named_parameters()},
    }


def _differences(saved: Any, current: Any, where: str) -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            sub = f"{where}.{key}" if where else str(key)
            if key not in current:
                out.append(f"{sub}: only in the checkpoint")
            elif key not in saved:
                out.append(f"{sub}: only in the current setup")
            else:
                out.extend(_differences(saved[key], current[key], sub))
        return out
    return [] if saved == current else [f"{where}: checkpoint {saved!r}, current {current!r}"]


def check_compatible(meta: dict[str, Any], fingerprint: dict[str, Any], path: Path) -> None:
    """Raise ValueError listing every difference between a checkpoint's fingerprint and the current one."""
    diffs = _differences(meta["fingerprint"], fingerprint, "")
    if diffs:
        shown = "\n  ".join(diffs[:10]) + (f"\n  ... and {len(diffs) - 10} more" if len(diffs) > 10 else "")
        raise ValueError(
            f"checkpoint '{path}' does not match this model/config:\n  {shown}\n"
            f"Load it with the config it was saved with (see {path / 'config.yaml'}) or start a new run"
        )
