"""From a model and a micro-batch to per-token logprobs (and top-k logits), padded or packed.

Output convention: `[b, t]` aligned with the micro-batch's `input_ids`; position i holds the logprob
of token i given tokens < i under `logits / temperature`; position 0 and padding hold 0.
"""

from __future__ import annotations

import torch

from posttrain.data.microbatch import MicroBatch


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
    ids = mb.data["input_ids"]
    lengths = mb.data["input_lengths"]
    t = ids.shape[1]
    attn = (torch.arange(t, device=ids.device)[None, :] < lengths[:, None]).long()
    out = model(input_ids=ids, attention_mask=attn, use_cache=False)
    return out.logits


def _unpack(mb: MicroBatch, packed_values: torch.Tensor, t: int) -> torch.Tensor:
    """Scatter a packed row's per-position values [L] back to [b, t] (zeros elsewhere)."""
    p = mb.packed
    assert p is not None
    rows = []
    for off, n in zip(p.offsets, p.lengths):
        seg = packed_values[off : off + n]
        rows.append(torch.nn.functional.pad(seg, (0, t - n)))
    return torch.stack(rows)


def microbatch_logprobs(model, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """Per-token logprobs [b, t] of a micro-batch (see module docstring for the convention)."""
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
