"""Sharded, reshardable, atomic checkpoints of a training state.

A checkpoint holds the model, the optimizer, the scheduler, every rank's RNG states, the reference
weights and a JSON `extra_state` that the training loops fill with their own state (data position,
controller, buffers). Tensors go through torch.distributed.checkpoint (DCP) in safetensors files, one
per rank, with the shard offsets in the file header: a checkpoint saved on N ranks loads on M ranks,
FSDP2 or plain. Nothing is unpickled on load: tensors are safetensors, everything else is JSON.

Layout of a checkpoint directory::

    metadata.json           format version, model fingerprint, trainer version, world size and mesh,
                            the size and SHA-256 of every other file; written last, so its presence
                            marks a complete checkpoint
    train_state.json        scheduler state and optimizer hyperparameters (JSON, not pickle)
    extra_state.json        the training loop's state
    config.yaml             the posttrain config it was saved with (for people; not read back)
    state/                  DCP shards: model.*, optim.*, reference.*
    rng/rank-<r>.safetensors
    hf/                     model config, generation config and tokenizer files, used by the export
                            (policy/export.py)

Departures from plain DCP: writes are atomic (every rank writes into `<dir>.tmp-<id>`, rank 0 renames
it into place once all ranks succeeded; a failure anywhere removes the temporary directory and leaves
the previous checkpoint intact); every file is checked against the checksum of its save before
anything is loaded (checkpoint_verify.py), so a damaged checkpoint is refused naming the file; and a
checkpoint of another model or of an incompatible config is refused with a message listing what
differs. The directory must be on a filesystem all ranks see.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from posttrain.checkpoint_verify import (
    METADATA_FILE,
    CorruptCheckpointError,
    check_compatible,
    fault_point,
    model_fingerprint,
    read_json,
    record_digests,
    verify_files,
)
from posttrain.logging import get_logger
from posttrain.rng_state import load_rng, save_rng
from posttrain.tokenizer_files import save_tokenizer

log = get_logger(__name__)


def _hf_storage(kind: str):
    """DCP's safetensors storage reader or writer (public since torch 2.8; the package itself imports
    on torch >= 2.6, so an older torch learns here what checkpointing needs)."""
    name = f"HuggingFaceStorage{kind}"
    cls = getattr(dcp, name, None)
    if cls is None:
        raise RuntimeError(
            f"checkpoints need torch >= 2.8 (torch.distributed.checkpoint.{name}); this is torch "
            f"{torch.__version__}. Upgrade torch, or run without checkpoints (checkpointing.enabled=false)"
        )
    return cls


FORMAT = "posttrain-checkpoint"
FORMAT_VERSION = 1
HF_FILES_DIR = "hf"
EXTRA_STATE_FILE = "extra_state.json"  # the training loop's own state (JSON)


@dataclass
class TrainState:
    """The objects a checkpoint saves and restores in place (plain or FSDP2-sharded)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: dict[str, torch.Tensor] | None = None
    """This rank's local shards of the reference weights, keyed like `model.named_parameters()`."""
    trainable_only: bool = False
    """Save and restore only the parameters that require gradients (LoRA adapters); the frozen rest
    is rebuilt from the model's source by whoever loads the checkpoint."""


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed; the message says on which rank and why."""


def _describe(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {exc!r}" for r, (exc, _) in e.failures.items())
    return repr(e)


@dataclass
class CheckpointInfo:
    """What `load_checkpoint` read besides the tensors it restored in place."""

    trainer_version: int
    world_size: int
    extra_state: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------- ranks


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _on_all_ranks(fn: Callable[[], None]) -> None:
    """Run `fn` on every rank; if it raised on any rank, raise on every rank (no rank is left waiting)."""
    error: BaseException | None = None
    try:
        fn()
    except Exception as e:
        error = e
    if _distributed():
        errors: list[str | None] = [None] * _world_size()
        dist.all_gather_object(errors, None if error is None else f"rank {_rank()}: {error!r}")
        failed = [e for e in errors if e is not None]
        if failed and error is None:
            raise RuntimeError("checkpoint I/O failed on another rank: " + "; ".join(failed))
    if error is not None:
        raise error


@contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns on every single-process (no_dist) call; that is the intended use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if _distributed():
        dist.barrier()


# ---------------------------------------------------------------------- files


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, indent=1)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{what} must be JSON-serializable (dicts, lists, strings, numbers, bools, None): {e}. "
            "Convert tensors with .tolist() and other objects to plain values first"
        ) from e


def _shared_tmp_dir(final: Path) -> Path:
    """`<final>.tmp-<id>` next to the target (same filesystem, so the final rename is atomic)."""
    token = [uuid.uuid4().hex[:12]]
    if _distributed():
        dist.broadcast_object_list(token, src=0)
    return final.with_name(f"{final.name}.tmp-{token[0]}")


def _commit(tmp: Path, final: Path) -> None:
    """Move `tmp` into place; an existing checkpoint is renamed aside first and deleted last."""
    old = final.with_name(f"{final.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
    replacing = final.exists()
    if replacing:
        os.replace(final, old)
        fault_point("aside", final)
    try:
        os.replace(tmp, final)
    except BaseException:
        if replacing:
            os.replace(old, final)
        raise
    fault_point("committed", final)
    if replacing:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- metadata


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a complete checkpoint; a clear error for a missing, partial or foreign directory."""
    root = Path(path)
    if not (root / METADATA_FILE).is_file():
        aside = sorted(root.parent.glob(f"{root.name}.old-*")) if root.parent.is_dir() else []
        hint = (
            f" A save was interrupted while replacing it: rename '{aside[-1]}' back to '{root}'."
            if aside and not root.exists()
            else " Pass a directory written by save_checkpoint (it contains metadata.json)."
        )
        raise ValueError(f"'{root}' is not a complete posttrain checkpoint.{hint}")
    meta = read_json(root / METADATA_FILE)
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"'{root / METADATA_FILE}' is damaged: not a JSON object")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"'{root}' has checkpoint format {meta.get('format')!r} version {meta.get('format_version')!r}; "
            f"this posttrain reads {FORMAT!r} version {FORMAT_VERSION}. Use the posttrain version that wrote it"
        )
    return meta


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The metadata of a complete checkpoint after checking every file against the checksums of its save,
    on this process alone; a ValueError (CorruptCheckpointError for damage) says what is wrong."""
    root = Path(path).absolute()
    meta = read_metadata(root)
    verify_files(root, meta, collective=False)
    return meta


# ---------------------------------------------------------------------- tensors


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{second name: first name} of parameters that appear twice (tied embeddings); stored once."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        first.setdefault(id(p), name)
    return aliases


def _model_state(state: TrainState) -> dict[str, torch.Tensor]:
    """The model's state dict, or only its trainable parameters with `trainable_only`."""
    sd = get_model_state_dict(state.model)
    if not state.trainable_only:
        return sd
    trainable = {n for n, p in state.model.named_parameters() if p.requires_grad}
    return {k: v for k, v in sd.items() if k in trainable}


def _model_tensors(model: torch.nn.Module, model_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    skip = tied_aliases(model)
    return {f"model.{k}": v for k, v in model_sd.items() if k not in skip}


def _global_reference(state: TrainState) -> dict[str, torch.Tensor]:
    """The reference shards as tensors with the same sharding as the model's parameters (DTensors under FSDP)."""
    assert state.reference is not None
    out = {}
    for name, p in state.model.named_parameters():
        local = state.reference[name]
        if isinstance(p, DTensor):
            local = DTensor.from_local(
                local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        out[f"reference.{name}"] = local
    return out


def _optimizer_tensors(optim_sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        f"optim.{fqn}.{key}": value
        for fqn, per_param in optim_sd["state"].items()
        for key, value in per_param.items()
        if isinstance(value, torch.Tensor)
    }


def _optimizer_scalars(optim_sd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-parameter optimizer state that is not a tensor (e.g. an int step count, as bitsandbytes'
    optimizers keep), for train_state.json (whose writer refuses what JSON cannot hold, naming it)."""
    state = optim_sd["state"].items()
    return {str(k): s for k, per in state if (s := {n: v for n, v in per.items() if not torch.is_tensor(v)})}


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _apply_hyperparameters(groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    if len(groups) != len(saved):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved)} parameter groups, this one {len(groups)}; "
            "use the optimizer config the checkpoint was saved with"
        )
    for group, values in zip(groups, saved):
        for k, v in values.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


# ---------------------------------------------------------------------- save


def _sharded_state(state: TrainState, optim_sd: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """Flat DCP state dict: model.*, optim.* (`optim_sd`: None until the optimizer has state), reference.*."""
    flat = _model_tensors(state.model, _model_state(state))
    if optim_sd is not None:
        flat |= _optimizer_tensors(optim_sd)
    if state.reference is not None:
        flat |= _global_reference(state)
    return flat


def _write_rank0_files(
    root: Path,
    state: TrainState,
    extra_json: str,
    tokenizer: Any,
    config_yaml: str | None,
    scalars: dict[str, dict[str, Any]] | None,
) -> None:
    train_state = {
        "scheduler": state.scheduler.state_dict(),
        "optimizer_param_groups": _hyperparameters(state.optimizer),
        "optimizer_has_state": bool(state.optimizer.state),
    }
    if scalars is not None:
        train_state["optimizer_scalars"] = scalars
    _write_text(root / "train_state.json", _to_json(train_state, "the scheduler/optimizer state"))
    _write_text(root / EXTRA_STATE_FILE, extra_json)
    if config_yaml is not None:
        _write_text(root / "config.yaml", config_yaml)
    hf_dir = root / HF_FILES_DIR
    config = getattr(state.model, "config", None)
    if config is not None:
        config.save_pretrained(hf_dir)
    generation = getattr(state.model, "generation_config", None)  # EOS ids, sampling defaults
    if generation is not None:
        generation.save_pretrained(hf_dir)
    if tokenizer is not None:
        save_tokenizer(tokenizer, hf_dir)  # loads back as itself through AutoTokenizer


def _full_mesh(mesh: dict[str, int] | None, world: int) -> dict[str, int]:
    """(dp, cp, tp) sizes; a checkpoint saved without them was data-parallel over its world."""
    return {"dp": world, "cp": 1, "tp": 1} | (mesh or {})


def _metadata(
    state: TrainState, trainer_version: int, identity: dict[str, Any], mesh: dict[str, int] | None
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "trainer_version": trainer_version,
        "world_size": _world_size(),
        "mesh": _full_mesh(mesh, _world_size()),
        "has_reference": state.reference is not None,
        "trainable_only": state.trainable_only,
        "torch_version": torch.__version__,
        "fingerprint": {"model": model_fingerprint(state.model), "config": identity},
    }


def save_checkpoint(
    path: str | Path,
    state: TrainState,
    *,
    trainer_version: int,
    identity: dict[str, Any] | None = None,
    extra_state: dict[str, Any] | None = None,
    tokenizer: Any = None,
    config_yaml: str | None = None,
    mesh: dict[str, int] | None = None,
) -> Path:
    """Write `state` to `path` atomically (collective: every rank calls it with the same arguments).

    `identity` holds the config pieces a resume must match (checked on load with the model fingerprint);
    `extra_state` is any JSON-serializable dict, given back by `load_checkpoint`. `mesh` names the
    parallel layout's sizes (e.g. {"dp": 1, "cp": 1, "tp": 2}); recorded, any mesh can load it.
    """
    final = Path(path).absolute()
    if final.exists() and not (final / METADATA_FILE).is_file() and any(final.iterdir()):
        raise ValueError(
            f"'{final}' exists and is not a posttrain checkpoint; saving would replace it. "
            "Pass a new directory (or an earlier checkpoint to overwrite)"
        )
    extra_json = _to_json(extra_state or {}, "extra_state")
    meta = _metadata(state, trainer_version, identity or {}, mesh)
    _to_json(meta, "identity")  # refused before anything is written
    fault_point("start", final)
    tmp = _shared_tmp_dir(final)
    try:
        _write_checkpoint(tmp, final, state, extra_json, meta, tokenizer, config_yaml)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"saving checkpoint '{final}' failed ({_describe(e)}); nothing was replaced: "
            "the previous checkpoint there, if any, is intact"
        ) from e
    finally:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("saved checkpoint %s (trainer version %d)", final, trainer_version)
    return final


def _write_checkpoint(
    tmp: Path,
    final: Path,
    state: TrainState,
    extra_json: str,
    meta: dict[str, Any],
    tokenizer: Any,
    config_yaml: str | None,
) -> None:
    """Every rank writes its shards and RNG into `tmp`; rank 0 adds the JSON files, the ranks hash them
    all, and rank 0 writes metadata.json with the checksums and commits."""
    rank = _rank()
    # reading an empty optimizer's state would initialize it (one zero step): only once it has state
    optim_sd = get_optimizer_state_dict(state.model, state.optimizer) if state.optimizer.state else None
    scalars = _optimizer_scalars(optim_sd) if optim_sd is not None else None
    writer = _hf_storage("Writer")(str(tmp / "state"), save_distributed=True)
    with _single_process_ok():
        dcp.save(_sharded_state(state, optim_sd), storage_writer=writer, no_dist=not _distributed())
    fault_point("shards", final)
    _on_all_ranks(lambda: save_rng(tmp / "rng", rank))
    _on_all_ranks(
        lambda: (
            _write_rank0_files(tmp, state, extra_json, tokenizer, config_yaml, scalars) if rank == 0 else None
        )
    )
    meta = meta | {"files": record_digests(tmp)}
    _on_all_ranks(lambda: _finish(tmp, final, _to_json(meta, "identity")) if rank == 0 else None)


def _finish(tmp: Path, final: Path, meta_json: str) -> None:
    _write_text(tmp / METADATA_FILE, meta_json)
    fault_point("metadata", final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _commit(tmp, final)


# ---------------------------------------------------------------------- load


def _dcp_load(targets: dict[str, torch.Tensor], root: Path, no_dist: bool) -> None:
    try:
        with _single_process_ok():
            dcp.load(targets, storage_reader=_hf_storage("Reader")(str(root / "state")), no_dist=no_dist)
    except CheckpointException as e:
        raise CheckpointError(f"reading the tensors of checkpoint '{root}' failed: {_describe(e)}") from e


def _load_targets(state: TrainState, has_optimizer: bool, has_reference: bool):
    """Tensors to load into, with the current sharding (reference: fresh DTensors copied back after)."""
    model_sd = _model_state(state)
    optim_sd = get_optimizer_state_dict(state.model, state.optimizer) if has_optimizer else None
    flat = _model_tensors(state.model, model_sd)
    if optim_sd is not None:
        flat |= _optimizer_tensors(optim_sd)
    reference = _global_reference(state) if has_reference and state.reference is not None else {}
    return flat | reference, model_sd, optim_sd, reference


def _restore_reference(state: TrainState, loaded: dict[str, torch.Tensor]) -> None:
    assert state.reference is not None
    with torch.no_grad():
        for key, value in loaded.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            state.reference[key.removeprefix("reference.")].copy_(local)


def load_checkpoint(
    path: str | Path,
    state: TrainState,
    *,
    identity: dict[str, Any] | None = None,
    mesh: dict[str, int] | None = None,
) -> CheckpointInfo:
    """Restore `state` in place from `path` (collective), after checking the checkpoint matches it."""
    root = Path(path).absolute()
    try:
        _hf_storage("Reader")  # before anything touches the optimizer (reading its state initializes it)
    except RuntimeError as e:
        raise CheckpointError(f"loading checkpoint '{root}' failed: {e}") from None
    meta = read_metadata(root)
    verify_files(root, meta, collective=True)
    check_compatible(meta, {"model": model_fingerprint(state.model), "config": identity or {}}, root)
    if state.reference is not None and not meta["has_reference"]:
        raise ValueError(
            f"checkpoint '{root}' has no reference weights but this policy keeps one; "
            "set policy.init_reference_model=false to load it"
        )
    train_state = read_json(root / "train_state.json")
    has_optimizer = train_state["optimizer_has_state"]
    flat, model_sd, optim_sd, reference = _load_targets(state, has_optimizer, meta["has_reference"])
    _dcp_load(flat, root, no_dist=not _distributed())
    for alias, source in tied_aliases(state.model).items():
        if source in model_sd:
            model_sd[alias] = model_sd[source]
    set_model_state_dict(state.model, model_sd, options=StateDictOptions(strict=not state.trainable_only))
    if optim_sd is not None:
        _apply_hyperparameters(optim_sd["param_groups"], train_state["optimizer_param_groups"])
        for fqn, values in train_state.get("optimizer_scalars", {}).items():
            if fqn in optim_sd["state"]:
                optim_sd["state"][fqn].update(values)
        set_optimizer_state_dict(state.model, state.optimizer, optim_sd)
    else:
        state.optimizer.state.clear()
        _apply_hyperparameters(state.optimizer.param_groups, train_state["optimizer_param_groups"])
    if reference:
        _restore_reference(state, reference)
    state.scheduler.load_state_dict(train_state["scheduler"])
    load_rng(root / "rng", _rank())
    _barrier()
    mesh = _full_mesh(mesh, _world_size())
    saved_mesh = _full_mesh(meta.get("mesh"), meta["world_size"])
    if saved_mesh != mesh:
        log.info("resharded checkpoint %s from mesh %s to %s", root, saved_mesh, mesh)
    return CheckpointInfo(
        trainer_version=meta["trainer_version"],
        world_size=meta["world_size"],
        extra_state=read_json(root / EXTRA_STATE_FILE),
    )


# ---------------------------------------------------------------------- reading


def read_model_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model tensors of a checkpoint under the model's state-dict names, read on
    this process alone (a `trainable_only` checkpoint: the trainable parameters alone)."""
    root = Path(path).absolute()
    verify_checkpoint(root)
    reader = _hf_storage("Reader")(str(root / "state"))
    shapes = reader.read_metadata().state_dict_metadata
    full = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in shapes.items()
        if k.startswith("model.")
    }
    _dcp_load(full, root, no_dist=True)
    return {k.removeprefix("model."): v for k, v in full.items()}
