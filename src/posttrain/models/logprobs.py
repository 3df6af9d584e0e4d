"""From a model and a micro-batch to per-token logprobs (and top-k logits), padded or packed.

Output convention: `[b, t]` aligned with the micro-batch's `input_ids`; position i holds the logprob
of token i given tokens < i under `logits / temperature`; position 0 and padding hold 0.

Shared-prefix plans (data/microbatch.py): `GroupedRows` is one model call over grouped rows with a
block mask. `SharedPrefix` is two calls: the distinct prefixes, recording each layer's keys and
values, then every row's suffix attending over its prefix's keys/values (picked per row, so
gradients from all rows of a group flow into their one prefix) and its own. Calls pass explicit
position ids and 4-D masks, so transformers builds no mask and reads no cache state; the two-call
plan needs the `past_key_values.update(...)` protocol (Llama, Qwen2, Mistral-style attention), as
the generation engine does.

Rotary embeddings whose frequencies follow the sequence length (`dynamic`, `longrope`): every call runs
under models/rope.py's `per_sequence_rope`, told each token's sequence length (its row's, its packed
segment's, its group's in a shared-prefix plan, the whole row's on a context-parallel rank), so a
sequence takes the frequencies of a forward of it alone, whatever the layout.

Model parallelism: logits from a tensor-parallel lm_head arrive as a DTensor sharded on the
vocabulary and go through models/vocab_parallel.py (no rank ever holds [.., V]). A `SequenceSplit`
(sequence or context parallelism) pads each call's sequence to the multiple the layout needs; under
context parallelism each rank runs its share of the tokens (models/context_parallel.py) and the
per-token results are all-gathered, which is all the loss needs ([b, t] floats). Shared-prefix plans
are not used under a sequence split (the worker turns them off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.microbatch import GroupedRows, MicroBatch, SharedPrefix, block_causal_mask, segment_ids
from posttrain.models.context_parallel import ContextParallel
from posttrain.models.hf import with_cache
from posttrain.models.rope import per_sequence_rope, segment_lengths
from posttrain.models.vocab_parallel import VocabShard, token_logprobs

__all__ = ["SequenceSplit", "microbatch_logprobs", "microbatch_topk", "token_logprobs"]


@dataclass(frozen=True)
class SequenceSplit:
    """How the sequence dim of a model call is laid out over ranks: padded to a multiple of `multiple`
    (sequence parallel: tp; context parallel: cp, times tp with sequence parallel) and, with `cp_mesh`,
    split over its ranks."""

    multiple: int = 1
    cp_mesh: Any = None  # a 1-D DeviceMesh; its group is read per call (communicators can be rebuilt)

    @property
    def active(self) -> bool:
        return self.multiple > 1  # context parallelism implies a multiple of cp


def _shifted(values: torch.Tensor) -> torch.Tensor:
    """Prepend a zero column so position i holds the value computed from position i-1."""
    return torch.nn.functional.pad(values, (1, 0))


def sliding_window(model) -> int | None:
    """The attention window of a model that has one in any layer (Mistral; Qwen2 with
    use_sliding_window), else None."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and "sliding_attention" not in types):
        return None
    return window


def _packed_mask(model, mask: torch.Tensor):
    """The block-causal mask of a packed row as the model's layers need it: narrowed to the model's
    sliding window (a packed row's token distance within a sequence is its position distance), a
    {layer type: mask} mapping when full and sliding layers alternate, and additive under eager
    attention (see `_additive_for_eager`)."""
    window = sliding_window(model)
    if window is None:
        return _additive_for_eager(model, mask)
    ar = torch.arange(mask.shape[-1], device=mask.device)
    windowed = _additive_for_eager(model, mask & (ar[:, None] - ar[None, :] < window))
    types = getattr(model.config, "layer_types", None)
    if types is not None and any(t != "sliding_attention" for t in types):
        return {"full_attention": _additive_for_eager(model, mask), "sliding_attention": windowed}
    return windowed


def _additive_for_eager(model, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean 4-D mask as the model's attention wants it: bool for sdpa, additive fp32 for eager,
    whose attention adds the mask to the scores as it is (a bool mask would add 1/0, not -inf: packed
    Gemma2 and gpt-oss rows, which run eager, attended across sequences)."""
    if getattr(model.config, "_attn_implementation", None) != "eager":
        return allowed
    zero = torch.zeros((), dtype=torch.float32, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(torch.float32).min)


def model_logits(model, mb: MicroBatch) -> torch.Tensor:
    """Raw logits of the model on a micro-batch: [b, t, V] padded, or [1, L, V] for a packed row (a
    vocab-sharded DTensor under tensor parallelism)."""
    width = (mb.packed.input_ids if mb.packed is not None else mb.data["input_ids"]).shape[1]
    with per_sequence_rope(model, lambda: _call_lengths(mb, width)):
        if mb.packed is not None:
            p = mb.packed
            out = model(
                input_ids=p.input_ids,
                position_ids=p.position_ids,
                attention_mask=_packed_mask(model, p.attention_mask),
                use_cache=False,
            )
            return out.logits
        # Rows are right-padded and attention is causal, so no real token ever sees padding: no mask is
        # needed, and without one transformers builds none and sdpa takes its causal fast path.
        return model(input_ids=mb.data["input_ids"], use_cache=False).logits


def _row_lengths(mb: MicroBatch, width: int) -> torch.Tensor:
    """[b, width]: per token of a padded micro-batch's call, its row's length (models/rope.py)."""
    lengths = mb.data["input_lengths"].to(mb.data["input_ids"].device)
    return lengths[:, None].expand(-1, width)


def _call_lengths(mb: MicroBatch, width: int) -> torch.Tensor:
    """Per token of a call over the micro-batch padded to `width`, its sequence's length: [b, width]
    padded, [1, width] packed."""
    if mb.packed is not None:
        return segment_lengths(mb.packed.lengths, width, mb.packed.input_ids.device)
    return _row_lengths(mb, width)


def _split_call(model, mb: MicroBatch, split: SequenceSplit) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The model on a micro-batch whose sequence is padded to `split.multiple` (and, under context
    parallelism, cut over the ranks). Returns (this rank's logits [b, q, V(/tp)], next-token targets
    [b, q] of those positions, the ContextParallel layout or None)."""
    ids = mb.packed.input_ids if mb.packed is not None else mb.data["input_ids"]
    b, t = ids.shape
    total = -(-t // split.multiple) * split.multiple
    ids = torch.nn.functional.pad(ids, (0, total - t))
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    if mb.packed is not None:
        positions = torch.nn.functional.pad(mb.packed.position_ids, (0, total - t))
    else:
        positions = torch.arange(total, device=ids.device)[None].expand(b, total)
    if split.cp_mesh is None:  # sequence parallel: the whole row, padded
        # transformers would size its own mask by the local (1/tp) length that reaches the layers,
        # while attention runs over the whole row: pass one for the whole row whenever a mask is
        # needed (packing, a sliding window); a plain causal row needs none (sdpa's causal path)
        mask = None
        if mb.packed is not None:
            mask = _packed_mask(model, block_causal_mask(mb.packed.lengths, total).to(ids.device))
        elif sliding_window(model) is not None:
            mask = _packed_mask(model, block_causal_mask([total], total).to(ids.device))
        with per_sequence_rope(model, lambda: _call_lengths(mb, total)):
            out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False)
        return out.logits, targets, None
    segments = segment_ids(mb.packed.lengths, total)[None] if mb.packed is not None else None
    cp = ContextParallel.build(split.cp_mesh.get_group(), total, segments, ids.device)
    local = cp.local
    # each rank's tokens take the frequencies of their whole sequence, not of the rank's chunk
    with per_sequence_rope(model, lambda: _call_lengths(mb, total)[:, local]):
        out = model(
            input_ids=ids[:, local], position_ids=positions[:, local], use_cache=False, posttrain_cp=cp
        )
    return out.logits, targets[:, local], cp


def _split_next_token(model, mb: MicroBatch, split: SequenceSplit, temperature: float) -> torch.Tensor:
    """[b or 1, t] logprob of token i+1 given tokens <= i, for every position i of the call."""
    logits, targets, cp = _split_call(model, mb, split)
    local, shard = VocabShard.of(logits)
    lp = shard.logprobs(_scaled(local, temperature), targets)
    if cp is not None:
        lp = cp.gather(lp)
    ids = mb.packed.input_ids if mb.packed is not None else mb.data["input_ids"]
    return lp[:, : ids.shape[1]]


def _unpack(mb: MicroBatch, packed_values: torch.Tensor, t: int) -> torch.Tensor:
    """Scatter a packed row's per-position values [L] back to [b, t] (zeros elsewhere)."""
    p = mb.packed
    assert p is not None
    rows = []
    for off, n in zip(p.offsets, p.lengths):
        seg = packed_values[off : off + n]
        rows.append(torch.nn.functional.pad(seg, (0, t - n)))
    return torch.stack(rows)


class _PrefixKV:
    """`past_key_values` of a shared-prefix forward: the prefix call records each layer's keys and
    values; the suffix call attends over its row's prefix (`rows` picks it) followed by its own."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.rows: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.rows is None:
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
            return key_states, value_states
        keys = torch.cat([self.keys[layer_idx].index_select(0, self.rows), key_states], dim=2)
        values = torch.cat([self.values[layer_idx].index_select(0, self.rows), value_states], dim=2)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # asked only when no position ids are passed; we always pass them


SHARED_PREFIX_ATTENTION = ("sdpa", "eager")  # attention implementations that take our 4-D masks


def supports_shared_prefix(model) -> bool:
    """Whether `model` can run shared-prefix micro-batches (its attention takes explicit 4-D masks, and
    has no sliding window, which those masks do not encode)."""
    attn = getattr(model.config, "_attn_implementation", None)
    return attn in SHARED_PREFIX_ATTENTION and sliding_window(model) is None


def _mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean [b, q, k] mask as the model's attention wants it: bool for sdpa (any query dtype),
    additive fp32 for eager (added to the scores, which promotes them; softmax then runs in fp32)."""
    return _additive_for_eager(model, allowed[:, None])


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature if temperature != 1.0 else logits


def _shared_prefix_logprobs(model, plan: SharedPrefix, temperature: float) -> torch.Tensor:
    """Logprobs [b, t] of a micro-batch run as distinct prefixes + per-row suffixes."""
    pre, suf = plan.prefix_ids, plan.suffix_ids
    (u, p), (b, s) = pre.shape, suf.shape
    ar_p, ar_s = torch.arange(p, device=pre.device), torch.arange(s, device=pre.device)
    kv = _PrefixKV()
    causal = (ar_p[:, None] >= ar_p[None, :])[None] & (
        ar_p[None, None, :] < plan.prefix_lengths[:, None, None]
    )
    # a prefix takes the rotary frequencies of its rows (models/rope.py: rows that share one agree)
    with per_sequence_rope(model, lambda: plan.prefix_row_lengths[:, None].expand(u, p)):
        logits_p = model(
            input_ids=pre,
            position_ids=ar_p[None, :].expand(u, p),
            attention_mask=_mask(model, causal),
            use_cache=True,
            **with_cache(model, kv),
        ).logits
    kv.rows = plan.row_prefix
    sees_prefix = (ar_p[None, None, :] < plan.split[:, None, None]).expand(b, s, p)
    causal = (ar_s[:, None] >= ar_s[None, :])[None].expand(b, s, s)
    with per_sequence_rope(model, lambda: plan.prefix_row_lengths[plan.row_prefix][:, None].expand(b, s)):
        logits_s = model(
            input_ids=suf,
            # padding after a short suffix would count past the batch's width t: clamp it to t - 1 (real
            # tokens are all below t), so absolute-position models stay in range
            position_ids=(plan.split[:, None] + ar_s[None, :]).clamp(max=plan.gather_index.shape[1] - 1),
            attention_mask=_mask(model, torch.cat([sees_prefix, causal], dim=2)),
            use_cache=True,
            **with_cache(model, kv),
        ).logits
    (logits_p, shard), (logits_s, _) = VocabShard.of(logits_p), VocabShard.of(logits_s)
    logits_p, logits_s = _scaled(logits_p, temperature), _scaled(logits_s, temperature)
    lp_prefix = shard.logprobs(logits_p[:, :-1], pre[:, 1:])  # [u, p-1]
    lp_boundary = shard.logprobs(logits_p[plan.row_prefix, plan.split - 1], suf[:, 0])  # [b]
    lp_suffix = shard.logprobs(logits_s[:, :-1], suf[:, 1:])  # [b, s-1]
    flat = torch.cat([lp_boundary.new_zeros(1), lp_prefix.reshape(-1), lp_boundary, lp_suffix.reshape(-1)])
    return flat[plan.gather_index]


def _grouped_logprobs(model, plan: GroupedRows, temperature: float) -> torch.Tensor:
    """Logprobs [b, t] of a micro-batch run as one row per distinct prefix (one model call)."""
    ids = plan.input_ids
    with per_sequence_rope(model, lambda: plan.row_lengths[:, None].expand_as(ids)):
        logits = model(
            input_ids=ids,
            position_ids=plan.position_ids,
            attention_mask=_mask(model, plan.attention_mask),
            use_cache=False,
        ).logits
    logits, shard = VocabShard.of(logits)
    logits = _scaled(logits, temperature).float()
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
    local_ids, owned = shard.localize(ids)
    picked = shard.owned_sum(logits[rows, plan.prev, local_ids], owned)  # [r, l]: token j at prev[j]
    lp = picked - shard.logsumexp(logits).gather(1, plan.prev)
    return torch.cat([lp.new_zeros(1), lp.reshape(-1)])[plan.gather_index]


def microbatch_logprobs(
    model, mb: MicroBatch, temperature: float = 1.0, split: SequenceSplit | None = None
) -> torch.Tensor:
    """Per-token logprobs [b, t] of a micro-batch (see module docstring for the convention)."""
    ids = mb.data["input_ids"]
    t = ids.shape[1]
    valid = torch.arange(t, device=ids.device)[None, :] < mb.data["input_lengths"][:, None]
    if split is not None and split.active:
        lp = _shifted(_split_next_token(model, mb, split, temperature)[:, :-1])
        if mb.packed is not None:
            lp = _unpack_sequences(mb, lp[0], t)
        return lp * valid
    if isinstance(mb.shared, GroupedRows):
        return _grouped_logprobs(model, mb.shared, temperature)
    if isinstance(mb.shared, SharedPrefix):
        return _shared_prefix_logprobs(model, mb.shared, temperature)
    logits, shard = VocabShard.of(model_logits(model, mb))
    logits = _scaled(logits, temperature)
    if mb.packed is not None:
        out = _unpack_sequences(mb, _shifted(_next_token_logprobs(shard, logits, mb.packed.input_ids))[0], t)
    else:
        out = _shifted(_next_token_logprobs(shard, logits, ids))
    return out * valid


def _next_token_logprobs(shard: VocabShard, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[b, t-1]: the logprob of `ids[:, i+1]` under `logits[:, i]`. Scored at every position (the
    last against a dummy target) and cut after: cutting the [b, t, V] logits first would make the
    backward zero-fill a buffer of their size and copy the gradient into it; the dropped position's
    gradient is zero either way (here possibly -0.0)."""
    return shard.logprobs(logits, torch.nn.functional.pad(ids[:, 1:], (0, 1)))[:, :-1]


def _unpack_sequences(mb: MicroBatch, lp: torch.Tensor, t: int) -> torch.Tensor:
    """A packed row's shifted logprobs [L] as [b, t]; the first token of each sequence gets 0 (it must
    not be scored by the previous sequence's last logit)."""
    lp = lp.clone()
    for off in mb.packed.offsets:
        lp[off] = 0.0
    return _unpack(mb, lp, t)


def _topk_rows(vals: torch.Tensor, idx: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the next token at every position [b or 1, L, k] -> shifted, unpacked [b, t, k]."""
    vals = torch.nn.functional.pad(vals, (0, 0, 1, 0))
    idx = torch.nn.functional.pad(idx, (0, 0, 1, 0))
    if mb.packed is None:
        return vals, idx
    t = mb.data["input_ids"].shape[1]
    out_v, out_i = [], []
    for off, n in zip(mb.packed.offsets, mb.packed.lengths):
        v, i = vals[0, off : off + n].clone(), idx[0, off : off + n].clone()
        v[0], i[0] = 0, 0
        out_v.append(torch.nn.functional.pad(v, (0, 0, 0, t - n)))
        out_i.append(torch.nn.functional.pad(i, (0, 0, 0, t - n)))
    return torch.stack(out_v), torch.stack(out_i)


def microbatch_topk(
    model, mb: MicroBatch, k: int, temperature: float = 1.0, split: SequenceSplit | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k logits and their token ids [b, t, k] of the distribution over token i (position 0 and
    padding: zeros)."""
    ids = mb.packed.input_ids if mb.packed is not None else mb.data["input_ids"]
    cp = None
    if split is not None and split.active:
        logits, _, cp = _split_call(model, mb, split)
    else:
        logits = model_logits(model, mb)
    logits, shard = VocabShard.of(logits)
    vals, idx = shard.topk(_scaled(logits.float(), temperature), k)
    if cp is not None:
        vals, idx = cp.gather(vals), cp.gather(idx)
    width = ids.shape[1]
    vals, idx = _topk_rows(vals[:, : width - 1], idx[:, : width - 1], mb)
    t = mb.data["input_ids"].shape[1]
    valid = (torch.arange(t, device=vals.device)[None, :] < mb.data["input_lengths"][:, None])[..., None]
    return vals * valid, idx * valid
