"""The one weight packer: many tensors into one flat uint8 buffer, and back out as views.

Each tensor starts at a 64-byte aligned offset, so its view has the alignment its dtype wants. One
buffer crosses a process boundary (a broadcast, a CUDA IPC handle, a pickle) with much less per-tensor
overhead than one message or one pickled tensor per tensor, and the output buffer is reused across
weight versions (or buckets) when it is large enough. Two users:

- weight_sync.py's buckets: a bucket of the trainer's weights packed into a device buffer, broadcast
  over a process group or shared over CUDA IPC, unpacked by the engine (`PackEntry` is its header's
  index).
- `WeightsPayload`: one weight version for a rollout worker (state dict + the trainer's probe
  logprobs), pickled as one packed buffer (one `ray.put` per version).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

ALIGN = 64  # byte alignment of each tensor inside a packed buffer

Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class PackEntry(NamedTuple):
    """Where one tensor lies in a packed buffer (a tuple: it pickles small)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the buffer, a multiple of ALIGN
    nbytes: int  # bytes of the tensor itself (the next one starts at the next aligned offset)


PackIndex = list[PackEntry]


def aligned(n: int) -> int:
    """`n` bytes rounded up to the alignment of a packed tensor."""
    return -(-n // ALIGN) * ALIGN


def _pairs(tensors: Tensors) -> list[tuple[str, torch.Tensor]]:
    return list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)


def pack_index(tensors: Tensors) -> tuple[PackIndex, int]:
    """The index of `tensors` in a packed buffer, and the buffer's size in bytes."""
    index, size = [], 0
    for name, t in _pairs(tensors):
        n = t.numel() * t.element_size()
        index.append(PackEntry(name, t.dtype, tuple(t.shape), size, n))
        size += aligned(n)
    return index, size


def packed_nbytes(tensors: Tensors) -> int:
    """Bytes `pack_tensors` needs for `tensors`."""
    return pack_index(tensors)[1]


def pack_tensors(
    tensors: Tensors, out: torch.Tensor | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, PackIndex]:
    """Copy `tensors` (any dtype, device, layout) into one flat uint8 buffer; returns it, exactly as
    many bytes as it holds, and its index. The buffer is a view of `out` when `out` is large enough
    (reuse it across versions or buckets), else a new one on `device` (default: the CPU)."""
    pairs = _pairs(tensors)
    index, size = pack_index(pairs)
    if out is None or out.numel() < size:
        out = torch.empty(size, dtype=torch.uint8, device=device or "cpu")
    buf = out[:size]
    for (_, t), e in zip(pairs, index):
        buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(t.detach())
    return buf, index


def unpack_tensors(buffer: torch.Tensor | np.ndarray, index: PackIndex) -> dict[str, torch.Tensor]:
    """Views of the tensors of a packed buffer (no copy: valid while the buffer is neither freed nor
    refilled). A numpy buffer may be read-only (Ray hands those out): a load copies out of it."""
    if isinstance(buffer, np.ndarray):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            buffer = torch.from_numpy(buffer)
    return {e.name: buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in index}


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
        out = None if self.buffer is None else torch.from_numpy(self.buffer)
        packed, index = pack_tensors(self.state, out)
        probe = None if self.probe_logprobs is None else _to_bytes(self.probe_logprobs)
        return _rebuild_payload, (self.version, packed.numpy(), index, probe, self.temperature)


def _rebuild_payload(
    version: int, packed: np.ndarray, index: PackIndex, probe: Any, temperature: float
) -> WeightsPayload:
    probe_logprobs = None if probe is None else _from_bytes(*probe)
    return WeightsPayload(version, unpack_tensors(packed, index), probe_logprobs, temperature)


def _to_bytes(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype, tuple[int, ...]]:
    """A tensor as a flat uint8 numpy array (any dtype, bf16 included) with its dtype and shape."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy(), t.dtype, tuple(t.shape)


def _from_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # Ray hands out read-only buffers; loading copies them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data).view(dtype).reshape(shape)
