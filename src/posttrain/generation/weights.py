"""Loading weights into a `GenerationEngine`: every tensor checked by name and shape on the way in,
completeness checked at the end, so half-loaded weights can never be used for generation."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from posttrain.generation.engine import GenerationEngine

WeightsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_tensors(weights: WeightsLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a state dict or an iterable of pairs."""
    return iter(weights.items()) if isinstance(weights, Mapping) else iter(weights)


class WeightLoad:
    """One weight load into an engine: every tensor checked by name and shape, completeness checked at
    the end (tied aliases count once). Made by `GenerationEngine.begin_load()`."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        state = engine.model.state_dict(keep_vars=True)
        self.targets = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
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
                target.data = tensor.detach()
            else:
                target.data.copy_(tensor)
                self.nbytes += tensor.numel() * tensor.element_size()
        self.seen.add(id(target))

    def _target(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        target = self.targets.get(name.removeprefix("_orig_mod."))
        if target is None:
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
        self.engine._mark_loaded(version)
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
