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
"""

from __future__ import annotations

import torch

from posttrain.data.microbatch import GroupedRows, MicroBatch, SharedPrefix


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logprob of `targets[..., i]` under `logits[..., i, :]`, computed in fp32 without a full log-softmax copy."""
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _shifted(values: torch.Tensor) -> torch.Tensor:
    """Prepend a zero column so position i holds the value computed from position i-1."""
    return torch.nn.functional.pad(values, (1, 0))


def model_logits(model, mb: MicroBatch) -> torch.Tensor:
    """Raw logits of the model on a micro-batch: [b, t, V] padded, or [1, L, V] for a packed row."""
    if mb.packed is not None:
        p = mb.packed
        out = model(
            input_ids=p.input_ids,
            position_ids=p.position_ids,
            attention_mask=p.attention_mask,
            use_cache=False,
        )
        return out.logits
    # Rows are right-padded and attention is causal, so no real token ever sees padding: no mask is
    # needed, and without one transformers builds none and sdpa takes its causal fast path.
    return model(input_ids=mb.data["input_ids"], use_cache=False).logits


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
    """Whether `model` can run shared-prefix micro-batches (its attention takes explicit 4-D masks)."""
    return getattr(model.config, "_attn_implementation", None) in SHARED_PREFIX_ATTENTION


def _mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean [b, q, k] mask as the model's attention wants it: bool for sdpa (any query dtype),
    additive fp32 for eager (added to the scores, which promotes them; softmax then runs in fp32)."""
    allowed = allowed[:, None]
    if model.config._attn_implementation == "sdpa":
        return allowed
    zero = torch.zeros((), dtype=torch.float32, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(torch.float32).min)


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
    logits_p = model(
        input_ids=pre,
        position_ids=ar_p[None, :].expand(u, p),
        attention_mask=_mask(model, causal),
        past_key_values=kv,
        use_cache=True,
    ).logits
    kv.rows = plan.row_prefix
    sees_prefix = (ar_p[None, None, :] < plan.split[:, None, None]).expand(b, s, p)
    causal = (ar_s[:, None] >= ar_s[None, :])[None].expand(b, s, s)
    logits_s = model(
        input_ids=suf,
        # padding after a short suffix would count past the batch's width t: clamp it to t - 1 (real
        # tokens are all below t), so absolute-position models stay in range and no position exceeds
        # what the plain forward over the padded batch uses (dynamic rope scaling sees the same max)
        position_ids=(plan.split[:, None] + ar_s[None, :]).clamp(max=plan.gather_index.shape[1] - 1),
        attention_mask=_mask(model, torch.cat([sees_prefix, causal], dim=2)),
        past_key_values=kv,
        use_cache=True,
    ).logits
    logits_p, logits_s = _scaled(logits_p, temperature), _scaled(logits_s, temperature)
    lp_prefix = token_logprobs(logits_p[:, :-1], pre[:, 1:])  # [u, p-1]
    lp_boundary = token_logprobs(logits_p[plan.row_prefix, plan.split - 1], suf[:, 0])  # [b]
    lp_suffix = token_logprobs(logits_s[:, :-1], suf[:, 1:])  # [b, s-1]
    flat = torch.cat([lp_boundary.new_zeros(1), lp_prefix.reshape(-1), lp_boundary, lp_suffix.reshape(-1)])
    return flat[plan.gather_index]


def _grouped_logprobs(model, plan: GroupedRows, temperature: float) -> torch.Tensor:
    """Logprobs [b, t] of a micro-batch run as one row per distinct prefix (one model call)."""
    ids = plan.input_ids
    logits = model(
        input_ids=ids,
        position_ids=plan.position_ids,
        attention_mask=_mask(model, plan.attention_mask),
        use_cache=False,
    ).logits
    logits = _scaled(logits, temperature).float()
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
    picked = logits[rows, plan.prev, ids]  # [r, l]: token j under the logits at prev[j]
    lp = picked - torch.logsumexp(logits, dim=-1).gather(1, plan.prev)
    return torch.cat([lp.new_zeros(1), lp.reshape(-1)])[plan.gather_index]


def microbatch_logprobs(model, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """Per-token logprobs [b, t] of a micro-batch (see module docstring for the convention)."""
    if isinstance(mb.shared, GroupedRows):
        return _grouped_logprobs(model, mb.shared, temperature)
    if isinstance(mb.shared, SharedPrefix):
        return _shared_prefix_logprobs(model, mb.shared, temperature)
    logits = model_logits(model, mb)
    if temperature != 1.0:
        logits = logits / temperature
    ids = mb.data["input_ids"]
    t = ids.shape[1]
    if mb.packed is not None:
        row = mb.packed.input_ids
        lp = _shifted(token_logprobs(logits[:, :-1], row[:, 1:]))[0]
        # the first token of each sequence must not see the previous sequence's last logit
        lp = lp.clone()
        for off in mb.packed.offsets:
            lp[off] = 0.0
        out = _unpack(mb, lp, t)
    else:
        out = _shifted(token_logprobs(logits[:, :-1], ids[:, 1:]))
    valid = torch.arange(t, device=ids.device)[None, :] < mb.data["input_lengths"][:, None]
    return out * valid


def microbatch_topk(
    model, mb: MicroBatch, k: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k logits and their token ids [b, t, k] of the distribution over token i (position 0 zeros)."""
    logits = model_logits(model, mb).float()
    if temperature != 1.0:
        logits = logits / temperature
    vals, idx = torch.topk(logits[:, :-1], k, dim=-1)
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
