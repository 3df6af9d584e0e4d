"""One weight version as one packed byte buffer: `pack_tensors` copies a state dict (any dtype, device,
layout) into one flat aligned uint8 buffer (reusable across versions) and `unpack_tensors` gives views
of it back; `WeightsPayload` is what a rollout worker loads: the state dict and the trainer's probe
logprobs, pickled as one buffer (one `ray.put` per version; Ray hands it to actors without a copy).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def _to_bytes(t: torch.Tensor) -> tuple[Any, torch.dtype, tuple[int, ...]]:
    """A tensor as a flat uint8 numpy array (any dtype, bf16 included) with its dtype and shape."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy(), t.dtype, tuple(t.shape)


def _from_bytes(data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # Ray hands out read-only buffers; loading copies them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data).view(dtype).reshape(shape)


_ALIGN = 64  # byte alignment of each tensor inside a packed buffer

# (name, dtype, shape, byte offset, byte size) of each tensor in a packed buffer
PackIndex = list[tuple[str, torch.dtype, tuple[int, ...], int, int]]


def _pack_index(tensors: dict[str, torch.Tensor]) -> tuple[PackIndex, int]:
    index, size = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        index.append((name, t.dtype, tuple(t.shape), size, n))
        size += -(-n // _ALIGN) * _ALIGN
    return index, size


def packed_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes `pack_tensors` needs for `tensors`."""
    return _pack_index(tensors)[1]


def pack_tensors(
    tensors: dict[str, torch.Tensor], out: np.ndarray | None = None
) -> tuple[np.ndarray, PackIndex]:
    """Copy `tensors` (any dtype, device, layout) into one flat uint8 buffer, `out` when it is large
    enough (reused across weight versions), else a new one. One buffer pickles, and crosses to a Ray
    actor, with much less per-tensor overhead than one array per tensor."""
    index, size = _pack_index(tensors)
    buf = out if out is not None and out.nbytes >= size else np.empty(size, dtype=np.uint8)
    buf = buf[:size]
    base = torch.from_numpy(buf)
    for (_, dtype, shape, offset, n), t in zip(index, tensors.values()):
        base[offset : offset + n].view(dtype).view(shape).copy_(t.detach())
    return buf, index


def unpack_tensors(buf: np.ndarray, index: PackIndex) -> dict[str, torch.Tensor]:
    """Views of the tensors of a `pack_tensors` buffer (no copy)."""
    with warnings.catch_warnings():  # Ray hands out read-only buffers; loading copies them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        base = torch.from_numpy(buf)
    return {name: base[o : o + n].view(dtype).view(shape) for name, dtype, shape, o, n in index}


def _rebuild_payload(
    version: int, packed: tuple[np.ndarray, PackIndex], probe: Any, temperature: float
) -> WeightsPayload:
    probe_logprobs = None if probe is None else _from_bytes(*probe)
    return WeightsPayload(version, unpack_tensors(*packed), probe_logprobs, temperature)


@dataclass
class WeightsPayload:
    """One weight version for the rollout workers: the full state dict and the trainer's logprobs on
    the probe batch (None when the probe check is off), taken together.

    Pickled (one `ray.put` per version) as one flat byte buffer (`pack_tensors`), which Ray stores
    and hands to the actor without copying; torch tensors would be pickled, then unpickled by every
    reader. `buffer` (e.g. the previous version's) is filled instead of a new one when large enough:
    `ray.put` has copied it into the object store by the time it returns."""

    version: int
    state: dict[str, torch.Tensor]
    probe_logprobs: torch.Tensor | None
    temperature: float
    buffer: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        packed = pack_tensors(self.state, self.buffer)
        probe = None if self.probe_logprobs is None else _to_bytes(self.probe_logprobs)
        return _rebuild_payload, (self.version, packed, probe, self.temperature)
