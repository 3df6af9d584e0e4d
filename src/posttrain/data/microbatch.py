"""Cutting a batch into micro-batches: fixed size, token-budget dynamic batching, and sequence packing.

Whatever the cut, every micro-batch remembers which rows of the batch it holds (`indices`), so
results can be put back in batch order. Packed micro-batches hold one row of several sequences with
reset position ids and a 4-D block-diagonal causal mask, so no token attends across a boundary
(reset position ids alone do not do that with sdpa/eager attention; see DESIGN.md).

Shared prefixes: the rows of a GRPO prompt group start with the same prompt. A padded micro-batch
may carry a plan that runs each distinct prompt once (models/logprobs.py): `GroupedRows` lays each
group out as one row (prompt, then every completion, block mask; one model call), `SharedPrefix`
runs the prompts, then every completion on its prompt's keys and values (two calls; for groups too
long for one row). The logprobs and gradients are those of the plain forward (the same math,
float-order differences only); the tokens through the model drop from the sum of all row lengths
to the distinct prompts plus the completions. A model whose rotary frequencies follow the sequence
length (models/rope.py) passes a `length_key`: rows share a prompt's tokens only where their lengths
give the same frequencies, and each plan records the length its shared tokens take them from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import TensorDict

from posttrain.data.batch import trim_to_longest

MicroBatchMode = Literal["fixed", "dynamic", "packed"]
# row lengths [b] -> keys [b], equal where the model computes a prompt's tokens alike (models/rope.py)
LengthKey = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class PackedRow:
    """Several sequences laid end to end in one row."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    attention_mask: torch.Tensor  # [1, 1, L, L] bool, True where attention is allowed
    offsets: list[int]  # start of each sequence in the row
    lengths: list[int]  # length of each sequence


@dataclass
class SharedPrefix:
    """How the rows of a padded micro-batch [b, t] run as distinct prefixes + per-row suffixes.

    Row i splits at `split[i]` (its first trained token, so the prompt is the prefix): tokens before
    it are the prefix `row_prefix[i]` (one of `prefix_ids`), the rest its suffix. Logprobs come back
    as a flat vector [0, prefix logprobs (u, p-1), boundary logprobs (b), suffix logprobs (b, s-1)],
    and `gather_index` [b, t] picks each row's values from it (0 = the leading zero: position 0 and
    padding)."""

    prefix_ids: torch.Tensor  # [u, p] distinct prefixes, right-padded
    prefix_lengths: torch.Tensor  # [u]
    row_prefix: torch.Tensor  # [b] which prefix each row starts with
    split: torch.Tensor  # [b] where each row's suffix starts (= its prefix length)
    suffix_ids: torch.Tensor  # [b, s] right-padded
    gather_index: torch.Tensor  # [b, t]
    prefix_row_lengths: torch.Tensor  # [u] longest row starting with each prefix (models/rope.py)

    def to(self, device: torch.device | str) -> SharedPrefix:
        return SharedPrefix(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


@dataclass
class GroupedRows:
    """A padded micro-batch [b, t] run as one row per distinct prefix: the prefix once, then the
    suffix of every row that starts with it, each suffix attending to the prefix and itself only
    (block mask), with the position ids it has in its own row. Token j of a grouped row is scored
    by the logits at `prev[j]` (the prefix's last token for a suffix's first token); logprobs come
    back as a flat vector [0, lp of the grouped rows (r, l)] and `gather_index` [b, t] picks each
    row's values from it."""

    input_ids: torch.Tensor  # [r, l]
    position_ids: torch.Tensor  # [r, l]
    attention_mask: torch.Tensor  # [r, l, l] bool, True where attention is allowed
    prev: torch.Tensor  # [r, l] position whose logits score token j
    gather_index: torch.Tensor  # [b, t]
    row_lengths: torch.Tensor  # [r] longest of the rows in each grouped row (models/rope.py)

    def to(self, device: torch.device | str) -> GroupedRows:
        return GroupedRows(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


@dataclass
class MicroBatch:
    """Rows `indices` of a batch, trimmed to their longest row; `packed` set when sequence packing is on,
    `shared` when rows that start alike run their prefix once."""

    data: TensorDict
    indices: torch.Tensor
    packed: PackedRow | None = None
    is_dummy: bool = False
    shared: SharedPrefix | GroupedRows | None = None

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
        shared = self.shared.to(device) if self.shared is not None else None
        return MicroBatch(self.data.to(device), self.indices, packed, self.is_dummy, shared)


def _take(batch: TensorDict, idx: list[int]) -> MicroBatch:
    index = torch.tensor(idx, dtype=torch.long)
    return MicroBatch(trim_to_longest(batch[index]), index)


def fixed_microbatches(batch: TensorDict, size: int) -> list[MicroBatch]:
    """Consecutive chunks of `size` rows (the last one may be smaller), as views of the batch."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    b = batch.batch_size[0]
    return [
        MicroBatch(
            trim_to_longest(batch[s : s + size] if size < b else batch), torch.arange(s, min(s + size, b))
        )
        for s in range(0, b, size)
    ]


def _check_fits(lengths: list[int], budget: int, what: str) -> None:
    longest = max(lengths)
    if longest > budget:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit the {what} budget of {budget} tokens; "
            f"raise the budget to at least {longest}"
        )


def _units(batch: TensorDict, row_group: int) -> list[list[int]]:
    """The batch's rows as units of `row_group` consecutive rows that a cut keeps together, in order
    (DPO's and a reward model's (chosen, rejected) pairs: row_group=2)."""
    b = batch.batch_size[0]
    if b % row_group:
        raise ValueError(f"a batch of {b} rows does not split into groups of {row_group} rows")
    return [list(range(s, s + row_group)) for s in range(0, b, row_group)]


def dynamic_microbatches(batch: TensorDict, max_tokens: int, row_group: int = 1) -> list[MicroBatch]:
    """Rows sorted by length, grouped so that rows x longest-row stays within `max_tokens`; with
    `row_group` > 1, units of that many consecutive rows (sorted by their longest row) stay together and
    in order."""
    lengths = batch["input_lengths"].tolist()
    _check_fits(lengths, max_tokens, "dynamic batching")
    units = _units(batch, row_group)
    longest = [max(lengths[i] for i in u) for u in units]
    if row_group > 1 and max(longest) * row_group > max_tokens:
        raise ValueError(
            f"{row_group} rows of {max(longest)} tokens (rows that train together, e.g. a preference "
            f"pair) do not fit the dynamic batching budget of {max_tokens} tokens; raise it to at least "
            f"{max(longest) * row_group}"
        )
    order = sorted(range(len(units)), key=lambda u: (longest[u], u))
    groups: list[list[int]] = [[]]
    for u in order:
        candidate = groups[-1] + units[u]
        if groups[-1] and len(candidate) * longest[u] > max_tokens:
            groups.append(list(units[u]))
        else:
            groups[-1] = candidate
    return [_take(batch, g) for g in groups]


def segment_ids(lengths: list[int], total: int) -> torch.Tensor:
    """[total] sequence number of each position of a row holding sequences of `lengths` end to end;
    each padding position after them gets a negative number of its own."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    return torch.cat([seg, -1 - torch.arange(total - seg.numel())])


def block_causal_mask(lengths: list[int], total: int) -> torch.Tensor:
    """[1, 1, total, total] bool mask: causal within each sequence, nothing across sequences.

    Positions past the last sequence (padding) attend only to themselves so softmax stays finite.
    """
    seg = segment_ids(lengths, total)
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


def packed_microbatches(
    batch: TensorDict, max_tokens: int, pad_id: int = 0, row_group: int = 1
) -> list[MicroBatch]:
    """First-fit-decreasing packing of rows into single-row micro-batches of at most `max_tokens` tokens;
    with `row_group` > 1, units of that many consecutive rows are packed together and in order."""
    lengths = batch["input_lengths"].tolist()
    _check_fits(lengths, max_tokens, "sequence packing")
    units = _units(batch, row_group)
    sizes = [sum(lengths[i] for i in u) for u in units]
    if max(sizes) > max_tokens:
        raise ValueError(
            f"{row_group} rows of {max(sizes)} tokens together (rows that train together, e.g. a "
            f"preference pair) do not fit the sequence packing budget of {max_tokens} tokens; raise it to "
            f"at least {max(sizes)}"
        )
    order = sorted(range(len(units)), key=lambda u: (-sizes[u], u))
    bins: list[list[int]] = []
    used: list[int] = []
    for u in order:
        for b, filled in enumerate(used):
            if filled + sizes[u] <= max_tokens:
                bins[b].append(u)
                used[b] += sizes[u]
                break
        else:
            bins.append([u])
            used.append(sizes[u])
    return [pack_rows(batch, [i for u in sorted(b) for i in units[u]], pad_id) for b in bins]


def make_microbatches(
    batch: TensorDict,
    mode: MicroBatchMode,
    size: int = 1,
    max_tokens: int = 0,
    pad_id: int = 0,
    share_prefix: bool = False,
    row_group: int = 1,
    length_key: LengthKey | None = None,
) -> list[MicroBatch]:
    """Cut `batch` by `mode`: 'fixed' uses `size` rows, 'dynamic' and 'packed' use a `max_tokens` budget.
    With `share_prefix`, padded micro-batches whose rows share prompts get a shared-prefix plan when
    it saves enough tokens (see `plan_shared_prefix`; `length_key` as there). `row_group`: every
    `row_group` consecutive rows stay in one micro-batch, in order (a loss over row pairs; fixed sizes
    must be multiples of it)."""
    if mode == "packed":
        return packed_microbatches(batch, max_tokens, pad_id, row_group)
    if mode == "fixed":
        if size % row_group:
            raise ValueError(
                f"micro-batch size {size} would split groups of {row_group} rows; use a multiple"
            )
        mbs = fixed_microbatches(batch, size)
    else:
        mbs = dynamic_microbatches(batch, max_tokens, row_group)
    if share_prefix:
        for mb in mbs:
            mb.shared = plan_shared_prefix(mb.data, pad_id, length_key=length_key)
    return mbs


# Use a shared-prefix plan only when it drops at least this fraction of the padded tokens.
MIN_SHARED_SAVING = 0.25
# Longest row of a `GroupedRows` plan: its dense [L, L] mask and the attention it computes between
# completions (masked out) grow as L^2, so long groups take the two-call `SharedPrefix` plan instead.
GROUPED_ROW_MAX = 1024


@dataclass
class _Groups:
    """Rows of a padded micro-batch grouped by their prefix (everything before the first trained
    token: the prompt; at least one token, and at least one token left after it) and their length key."""

    split: torch.Tensor  # [b] prefix length of each row
    lengths: torch.Tensor  # [b]
    prefixes: list[tuple[int, ...]]  # distinct prefixes, in order of first appearance
    row_prefix: list[int]  # [b] index into prefixes
    rows: list[list[int]]  # [b] token lists (unpadded)
    group_lengths: torch.Tensor  # [len(prefixes)] longest row of each group


def _groups(data: TensorDict, length_key: LengthKey | None = None) -> _Groups:
    lengths = data["input_lengths"]
    trained = data["token_mask"] > 0
    first = torch.where(trained.any(dim=1), trained.float().argmax(dim=1), lengths)
    split = torch.minimum(first, lengths - 1).clamp(min=1)
    rows = [row[:n] for row, n in zip(data["input_ids"].tolist(), lengths.tolist())]
    kinds = length_key(lengths).tolist() if length_key is not None else [None] * len(rows)
    keys: dict[tuple, int] = {}
    row_prefix = [
        keys.setdefault((kind, tuple(row[:n])), len(keys))
        for kind, row, n in zip(kinds, rows, split.tolist())
    ]
    index = torch.tensor(row_prefix, dtype=torch.long)
    longest = torch.zeros(len(keys), dtype=lengths.dtype).scatter_reduce(0, index, lengths, "amax")
    return _Groups(split, lengths, [prefix for _, prefix in keys], row_prefix, rows, longest)


def plan_shared_prefix(
    data: TensorDict, pad_id: int = 0, force: bool = False, length_key: LengthKey | None = None
) -> SharedPrefix | GroupedRows | None:
    """The cheaper shared-prefix plan of a padded micro-batch (counting padded tokens): `GroupedRows`
    (one model call) when every group fits in `GROUPED_ROW_MAX` tokens, else `SharedPrefix` (two
    calls). None when the best drops less than `MIN_SHARED_SAVING` of the tokens. `force` returns a
    `SharedPrefix` plan for any batch, even one where no prefix repeats. With `length_key`, rows share
    a prefix only where their keys agree (a prompt then runs once per key)."""
    g = _groups(data, length_key)
    if force:
        return _two_call_plan(g, pad_id, data["input_ids"].shape[1])
    b, t = data["input_ids"].shape
    suffix = (g.lengths - g.split).tolist()
    group_len = [len(k) for k in g.prefixes]
    for u, n in zip(g.row_prefix, suffix):
        group_len[u] += n
    grouped = len(group_len) * max(group_len)
    two_call = len(g.prefixes) * max(len(k) for k in g.prefixes) + b * max(max(suffix), 1)
    if min(grouped, two_call) > (1 - MIN_SHARED_SAVING) * b * t:
        return None
    if grouped <= two_call and max(group_len) <= GROUPED_ROW_MAX:
        return _grouped_plan(g, data["input_ids"], pad_id, t)
    return _two_call_plan(g, pad_id, t)


def _two_call_plan(g: _Groups, pad_id: int, t: int) -> SharedPrefix:
    split, lengths = g.split, g.lengths
    b, u = len(g.rows), len(g.prefixes)
    prefix_lengths = torch.tensor([len(k) for k in g.prefixes], dtype=torch.long)
    p = int(prefix_lengths.max())
    prefix_ids = torch.tensor([list(k) + [pad_id] * (p - len(k)) for k in g.prefixes], dtype=torch.long)
    s = max(int((lengths - split).max()), 1)  # a row of one token has an empty suffix (one pad)
    suffixes = [row[n:] for row, n in zip(g.rows, split.tolist())]
    suffix_ids = torch.tensor([x + [pad_id] * (s - len(x)) for x in suffixes], dtype=torch.long)
    row_prefix = torch.tensor(g.row_prefix, dtype=torch.long)
    pos = torch.arange(t)[None, :]
    split_, len_ = split[:, None], lengths[:, None]
    index = torch.zeros(b, t, dtype=torch.long)  # 0: position 0 and padding
    index = torch.where((pos >= 1) & (pos < split_), 1 + row_prefix[:, None] * (p - 1) + pos - 1, index)
    boundary = 1 + u * (p - 1) + torch.arange(b)[:, None]
    index = torch.where((pos == split_) & (pos < len_), boundary, index)
    suffix_base = 1 + u * (p - 1) + b + torch.arange(b)[:, None] * (s - 1)
    index = torch.where((pos > split_) & (pos < len_), suffix_base + pos - split_ - 1, index)
    return SharedPrefix(prefix_ids, prefix_lengths, row_prefix, split, suffix_ids, index, g.group_lengths)


def _grouped_plan(g: _Groups, ids: torch.Tensor, pad_id: int, t: int) -> GroupedRows:
    """One row per prefix: the prefix, then the suffix of each of its rows (in row order), each suffix
    seeing only the prefix and itself."""
    b = ids.shape[0]
    group = torch.tensor(g.row_prefix, dtype=torch.long)  # [b]
    plen = torch.tensor([len(k) for k in g.prefixes], dtype=torch.long)  # [r]
    slen = g.lengths - g.split  # [b]
    # where each row's suffix starts in its group row: after the prefix and the earlier rows' suffixes
    order = torch.argsort(group, stable=True)
    before = torch.cumsum(slen[order], 0) - slen[order]
    starts = torch.cumsum(torch.bincount(group, minlength=len(plen)), 0) - torch.bincount(
        group, minlength=len(plen)
    )
    offset = torch.empty_like(slen)
    offset[order] = plen[group[order]] + before - before[starts[group[order]]]
    width = int((plen + torch.bincount(group, weights=slen.double(), minlength=len(plen)).long()).max())
    col = torch.arange(width)[None, :]
    in_prefix = col < plen[:, None]  # [r, width]
    prefix_ids = torch.tensor([list(k) + [pad_id] * (width - len(k)) for k in g.prefixes], dtype=torch.long)
    tokens = torch.where(in_prefix, prefix_ids, pad_id)
    positions = torch.where(in_prefix, col, 0)
    seg = torch.where(in_prefix, -1, -2 - col)  # padding: a segment of its own
    prev = torch.where(in_prefix, (col - 1).clamp(min=0), 0)
    k = torch.arange(max(int(slen.max()), 1))[None, :]  # [1, s]
    valid = k < slen[:, None]  # [b, s]
    rows = group[:, None].expand_as(valid)[valid]
    dst = (offset[:, None] + k)[valid]
    src = (g.split[:, None] + k).clamp(max=t - 1)
    tokens[rows, dst] = ids.gather(1, src)[valid]
    positions[rows, dst] = src[valid]
    seg[rows, dst] = torch.arange(b)[:, None].expand_as(valid)[valid]
    prev[rows, dst] = torch.where(k == 0, g.split[:, None] - 1, offset[:, None] + k - 1)[valid]
    causal = col[0][:, None] >= col[0][None, :]
    mask = causal[None] & ((seg[:, None, :] == -1) | (seg[:, None, :] == seg[:, :, None]))
    pos = torch.arange(t)[None, :]
    split_, len_ = g.split[:, None], g.lengths[:, None]
    base = 1 + group[:, None] * width
    index = torch.zeros(b, t, dtype=torch.long)
    index = torch.where((pos >= 1) & (pos < split_), base + pos, index)
    index = torch.where((pos >= split_) & (pos < len_), base + pos + offset[:, None] - split_, index)
    return GroupedRows(tokens, positions, mask, prev, index, g.group_lengths)


def dummy_like(mb: MicroBatch) -> MicroBatch:
    """A copy of `mb` that contributes nothing (all masks zero): used to keep collectives matched."""
    data = mb.data.clone()
    data["sample_mask"] = torch.zeros_like(data["sample_mask"])
    data["token_mask"] = torch.zeros_like(data["token_mask"])
    return MicroBatch(data, mb.indices, mb.packed, is_dummy=True, shared=mb.shared)
