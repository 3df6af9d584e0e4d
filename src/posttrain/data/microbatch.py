"""Cutting a batch into micro-batches: fixed size, token-budget dynamic batching, and sequence packing.

Whatever the cut, every micro-batch remembers which rows of the batch it holds (`indices`), so
results can be put back in batch order. Packed micro-batches hold one row of several sequences with
reset position ids and a 4-D block-diagonal causal mask, so no token attends across a boundary
(reset position ids alone do not do that with sdpa/eager attention; see DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import TensorDict

from posttrain.data.batch import trim_to_longest

MicroBatchMode = Literal["fixed", "dynamic", "packed"]


@dataclass
class PackedRow:
    """Several sequences laid end to end in one row."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    attention_mask: torch.Tensor  # [1, 1, L, L] bool, True where attention is allowed
    offsets: list[int]  # start of each sequence in the row
    lengths: list[int]  # length of each sequence


@dataclass
class MicroBatch:
    """Rows `indices` of a batch, trimmed to their longest row; `packed` set when sequence packing is on."""

    data: TensorDict
    indices: torch.Tensor
    packed: PackedRow | None = None
    is_dummy: bool = False

    def to(self, device: torch.device | str) -> MicroBatch:
        packed = self.packed
        if packed is not None:
            packed = PackedRow(
                packed.input_ids.to(device),
                packed.position_ids.to(device),
                packed.attention_mask.to(device),
                packed.offsets,
                packed.lengths,
            )
        return MicroBatch(self.data.to(device), self.indices, packed, self.is_dummy)


def _take(batch: TensorDict, idx: list[int]) -> MicroBatch:
    index = torch.tensor(idx, dtype=torch.long)
    return MicroBatch(trim_to_longest(batch[index]), index)


def fixed_microbatches(batch: TensorDict, size: int) -> list[MicroBatch]:
    """Consecutive chunks of `size` rows (the last one may be smaller)."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    b = batch.batch_size[0]
    return [_take(batch, list(range(s, min(s + size, b)))) for s in range(0, b, size)]


def _check_fits(lengths: list[int], budget: int, what: str) -> None:
    longest = max(lengths)
    if longest > budget:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit the {what} budget of {budget} tokens; "
            f"raise the budget to at least {longest}"
        )


def dynamic_microbatches(batch: TensorDict, max_tokens: int) -> list[MicroBatch]:
    """Rows sorted by length, grouped so that rows x longest-row stays within `max_tokens`."""
    lengths = batch["input_lengths"].tolist()
    _check_fits(lengths, max_tokens, "dynamic batching")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = [[]]
    for i in order:
        candidate = groups[-1] + [i]
        if groups[-1] and len(candidate) * lengths[i] > max_tokens:
            groups.append([i])
        else:
            groups[-1] = candidate
    return [_take(batch, g) for g in groups]


def block_causal_mask(lengths: list[int], total: int) -> torch.Tensor:
    """[1, 1, total, total] bool mask: causal within each sequence, nothing across sequences.

    Positions past the last sequence (padding) attend only to themselves so softmax stays finite.
    """
    seg = torch.full((total,), -1, dtype=torch.long)
    start = 0
    for s, n in enumerate(lengths):
        seg[start : start + n] = s
        start += n
    pad = seg < 0
    seg[pad] = -1 - torch.arange(int(pad.sum()))
    same = seg[:, None] == seg[None, :]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return (same & causal)[None, None]


def pack_rows(batch: TensorDict, idx: list[int], pad_id: int = 0) -> MicroBatch:
    """Pack rows `idx` of `batch` into a single row."""
    mb = _take(batch, idx)
    ids = mb.data["input_ids"]
    lengths = mb.data["input_lengths"].tolist()
    total = sum(lengths)
    row = torch.full((1, total), pad_id, dtype=ids.dtype)
    pos = torch.zeros((1, total), dtype=torch.long)
    offsets = []
    start = 0
    for r, n in enumerate(lengths):
        row[0, start : start + n] = ids[r, :n]
        pos[0, start : start + n] = torch.arange(n)
        offsets.append(start)
        start += n
    mb.packed = PackedRow(row, pos, block_causal_mask(lengths, total), offsets, lengths)
    return mb


def packed_microbatches(batch: TensorDict, max_tokens: int, pad_id: int = 0) -> list[MicroBatch]:
    """First-fit-decreasing packing of rows into single-row micro-batches of at most `max_tokens` tokens."""
    lengths = batch["input_lengths"].tolist()
    _check_fits(lengths, max_tokens, "sequence packing")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for b, u in enumerate(used):
            if u + lengths[i] <= max_tokens:
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return [pack_rows(batch, sorted(b), pad_id) for b in bins]


def make_microbatches(
    batch: TensorDict, mode: MicroBatchMode, size: int = 1, max_tokens: int = 0, pad_id: int = 0
) -> list[MicroBatch]:
    """Cut `batch` by `mode`: 'fixed' uses `size` rows, 'dynamic' and 'packed' use a `max_tokens` budget."""
    if mode == "fixed":
        return fixed_microbatches(batch, size)
    if mode == "dynamic":
        return dynamic_microbatches(batch, max_tokens)
    return packed_microbatches(batch, max_tokens, pad_id)


def dummy_like(mb: MicroBatch) -> MicroBatch:
    """A copy of `mb` that contributes nothing (all masks zero): used to keep collectives matched."""
    data = mb.data.clone()
    data["sample_mask"] = torch.zeros_like(data["sample_mask"])
    data["token_mask"] = torch.zeros_like(data["token_mask"])
    return MicroBatch(data, mb.indices, mb.packed, is_dummy=True)
