"""Loading weights into a `GenerationEngine`: every tensor checked by name and shape on the way in,
completeness checked at the end, so half-loaded weights can never be used for generation.

`EngineWeights` holds the engine's weight verbs (`begin_load`, `load_weights`, `share_weights`) and the
parameter release/restore behind `sleep()`/`wake()`; `GenerationEngine` mixes it in. `WeightLoad` knows
only the model and a callback, so this module does not import the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from posttrain.generation.graphs import DecodeGraphs
from posttrain.generation.kv_cache import SlotKVCache
from posttrain.generation.lm_head import LMHead
from posttrain.generation.params import EngineStateError
from posttrain.models.lora import is_adapter_key

WeightsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_tensors(weights: WeightsLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a state dict or an iterable of pairs."""
    return iter(weights.items()) if isinstance(weights, Mapping) else iter(weights)


class WeightLoad:
    """One weight load into an engine: every tensor checked by name and shape, completeness checked at
    the end (tied aliases count once). Made by `GenerationEngine.begin_load()`; `finish` hands the
    version to `on_finish` (the engine's `_mark_loaded`)."""

    def __init__(
        self, model: torch.nn.Module, on_finish: Callable[[int], None], on_repoint: Callable[[], None]
    ) -> None:
        self.on_finish = on_finish
        self.on_repoint = on_repoint  # a parameter now views other memory (graphs hold the old address)
        state = model.state_dict(keep_vars=True)
        self.targets = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
        if any(is_adapter_key(k) for k in self.targets):  # the engine keeps its base; loads bring adapters
            self.targets = {k: v for k, v in self.targets.items() if is_adapter_key(k)}
        self.seen: set[int] = set()
        self.nbytes = 0
        self.repointed = 0  # shared tensors that were not already aliased by the engine

    def add(self, name: str, tensor: torch.Tensor, share: bool = False) -> None:
        """Copy (or, with `share`, alias) one tensor into the engine's tensor of that name."""
        target = self._target(name, tensor)
        with torch.no_grad():
            if share:
                if tensor.dtype != target.dtype or tensor.device != target.device:
                    raise ValueError(
                        f"cannot share '{name}': the engine wants {target.dtype} on {target.device}, got "
                        f"{tensor.dtype} on {tensor.device}; use load_weights() (copy) instead"
                    )
                if not _aliases(target, tensor):
                    self.repointed += 1
                    self.on_repoint()
                target.data = tensor.detach()
            else:
                target.data.copy_(tensor)
                self.nbytes += tensor.numel() * tensor.element_size()
        self.seen.add(id(target))

    def _target(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        target = self.targets.get(name.removeprefix("_orig_mod."))
        if target is None:
            if self.targets and all(is_adapter_key(k) for k in self.targets):
                raise ValueError(
                    f"unexpected weight '{name}': this engine carries LoRA adapters and loads only them; "
                    "send the adapter tensors (Policy.engine_state_dict() with policy.lora.engine=adapters)"
                )
            if is_adapter_key(name):
                raise ValueError(
                    f"unexpected weight '{name}': a LoRA adapter tensor, and this engine has no adapters; "
                    "build the engine with policy.model_init.engine_model(model, lora) to load adapters, "
                    "or send merged weights (policy.lora.engine=merged)"
                )
            raise ValueError(
                f"unexpected weight '{name}': the engine model has no such tensor; sync between the "
                "same model architecture (trainer and engine model configs differ?)"
            )
        if type(tensor).__name__ == "DTensor":
            raise ValueError(
                f"weight '{name}' is a sharded DTensor; gather it first (parallel.mesh.iter_full_weights)"
            )
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight '{name}' has shape {tuple(tensor.shape)} but the engine expects "
                f"{tuple(target.shape)}; trainer and engine models differ"
            )
        return target

    def finish(self, version: int) -> dict[str, float]:
        """Check that every tensor arrived, then let the engine generate with `version`."""
        missing = [n for n, t in self.targets.items() if id(t) not in self.seen]
        if missing:
            raise ValueError(
                f"incomplete weights: {len(missing)} tensors were not sent (e.g. {missing[:3]}); the "
                "engine refuses to generate until a load delivers the full state dict"
            )
        self.on_finish(version)
        return {
            "bytes": float(self.nbytes),
            "tensors": float(len(self.seen)),
            "tensors_repointed": float(self.repointed),
        }


def _aliases(target: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether `target` already views exactly `tensor`'s memory (same storage, offset and strides)."""
    return (
        target.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        and target.storage_offset() == tensor.storage_offset()
        and target.stride() == tensor.stride()
    )


class EngineWeights:
    """The weight verbs of `GenerationEngine`, mixed into it: they use the engine's model, lock, LM head,
    its `_check_idle` and its state flags (declared below, set by the engine's constructor)."""

    model: torch.nn.Module
    device: torch.device
    weight_version: int
    _lock: threading.Lock
    _head: LMHead
    _weights_valid: bool  # False from the start of a load until a complete one finishes
    _shared: bool  # parameters alias the trainer's tensors (share_weights)
    _sleeping: bool
    _released: dict[str, tuple[torch.Size, torch.dtype, torch.Tensor | None]]  # by sleep(), for wake()
    _adapters: bool  # the model carries LoRA adapters: loads bring only them, the base stays
    clear_sessions: Callable[[], None]  # stored keys/values were computed with the old weights
    cache: SlotKVCache
    _sessions: Any  # the session store (generation/sessions.py): nbytes()
    _graphs: DecodeGraphs | None  # CUDA graphs of the decode step (hold parameter and cache addresses)
    _check_idle: Callable[[str], None]

    def _drop_compiled(self) -> None:
        """Forget what was derived from the parameters' current memory: packed copies, decode graphs."""
        self._head.drop_packed()
        if self._graphs is not None:
            self._graphs.drop()

    def begin_load(self, share: bool = False) -> WeightLoad:
        """Start loading weights piece by piece (e.g. one received bucket at a time); the engine refuses
        to generate until `WeightLoad.finish(version)` has checked that every tensor arrived. With
        `share` the tensors will be aliased, not copied (see share_weights)."""
        self._check_idle("load_weights")
        if self._sleeping:
            raise EngineStateError("load_weights() while asleep; call wake() first")
        load = WeightLoad(self.model, self._mark_loaded, self._drop_compiled)
        if self._shared and not share:  # stop aliasing the trainer's tensors before writing into them
            self._drop_compiled()  # the load's targets move
            # only the tensors this load brings: an adapters engine keeps its base, which no load sends
            for t in {id(t): t for t in load.targets.values()}.values():
                t.data = torch.empty_like(t.data)
            self._shared = False
        self._weights_valid = False
        self.clear_sessions()  # every load goes through here: kept keys/values belong to the old weights
        return load

    def load_weights(self, weights: WeightsLike, version: int) -> dict[str, float]:
        """Copy a full state dict (or a stream of (name, tensor)) into the engine and set its version.

        Names, shapes and completeness are checked; until a complete load succeeds the engine refuses
        to generate (so half-loaded weights cannot be used). Dtype and device are converted."""
        with self._lock, torch.no_grad():
            load = self.begin_load()
            for name, tensor in named_tensors(weights):
                load.add(name, tensor)
            return load.finish(version)

    def share_weights(self, weights: WeightsLike, version: int) -> dict[str, float]:
        """Point the engine's parameters at the given tensors (no copy): same shape, dtype and device
        required. In-place updates of those tensors (an optimizer step) are then seen by the engine."""
        with self._lock, torch.no_grad():
            load = self.begin_load(share=True)
            # sharing from the first aliased tensor on: should an add fail part-way, the next copy-load
            # must not write into the trainer's tensors, and idle engines must still drop their packs
            self._shared = True
            for name, tensor in named_tensors(weights):
                load.add(name, tensor, share=True)
            return load.finish(version)

    def _mark_loaded(self, version: int) -> None:
        self._head.drop_packed()  # loads write through .data, which bumps no version counter
        self._weights_valid = True
        self.weight_version = int(version)

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def sleep(self, keep_weights: bool = True) -> dict[str, float]:
        """Release device memory: the KV cache always; parameters too (moved to host memory when
        `keep_weights`, dropped otherwise; shared weights are dropped and come back with the next sync).
        On a CPU engine with `keep_weights` the parameters stay where they are. Idempotent."""
        with self._lock:
            self._check_idle("sleep")
            if self._sleeping:
                return {"bytes_released": 0.0}
            released = self.cache.nbytes() + self._sessions.nbytes()
            self.cache.free()
            self.clear_sessions()  # their keys/values live on the device
            self._drop_compiled()
            keep_host = keep_weights and not self._shared
            if not (keep_host and self.device.type == "cpu"):
                released += self._release_params(keep_host)
                self._weights_valid = self._weights_valid and keep_host  # a failed load stays failed
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._sleeping = True
            return {"bytes_released": float(released)}

    def wake(self) -> None:
        """Restore what `sleep()` released (parameters from host memory, or empty ones awaiting
        load_weights()); the KV cache is allocated again on the next forward. Idempotent."""
        with self._lock:
            if not self._sleeping:
                return
            self._restore_params()
            self._drop_compiled()
            self._sleeping = False

    def _release_params(self, to_host: bool) -> int:
        """Free the parameters' device memory (copied to host memory first with `to_host`); bytes freed."""
        released = 0
        pin = self.device.type == "cuda"
        for name, p in self.model.named_parameters():
            host = None
            if to_host or (self._adapters and not is_adapter_key(name)):  # no load brings the base back
                host = p.data.to("cpu", copy=True)
                host = host.pin_memory() if pin else host
            self._released[name] = (p.shape, p.dtype, host)
            released += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._shared = False
        return released

    def _restore_params(self) -> None:
        """Undo `_release_params`: parameters from host memory, or empty ones awaiting a load."""
        params = dict(self.model.named_parameters())
        for name, (shape, dtype, host) in self._released.items():
            if host is not None:
                params[name].data = host.to(self.device)
            else:
                params[name].data = torch.empty(shape, dtype=dtype, device=self.device)
        self._released = {}
