"""The normalization contract shared by losses (algorithms/) and the trainer (policy/).

A loss returns its micro-batch's masked sum divided by the global count of its `loss_type`; each
metric declares how it is normalized (`MetricKind`). The split train step runs micro-batches with
placeholder counts of 1 (raw sums) and calls `finalize_metrics` once the true global counts are
known. See DESIGN.md, "The normalization contract".
"""

from __future__ import annotations

import enum
from typing import Literal, Protocol

import torch
from tensordict import TensorDict

MetricKind = Literal["toks", "seqs", "loss_type", "none", "min", "max"]


class LossType(str, enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossFn(Protocol):
    """What the trainer calls per micro-batch: (outputs [B,T], batch, global seqs, global toks) -> (loss, metrics).

    `outputs` are the model's per-token outputs: logprobs for a causal LM (`policy.model.head=lm`), or
    the scalar head's values for `head=score` (reward models, critics). A loss for values declares
    `head = "score"`; one without the attribute reads logprobs, and the trainer refuses a mismatch."""

    loss_type: LossType
    metric_kinds: dict[str, MetricKind]
    required_keys: tuple[str, ...]

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: TensorDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def identity_of(kind: MetricKind) -> float:
    """The neutral element of a metric's reduction (sum kinds: 0, min: +inf, max: -inf)."""
    return {"min": float("inf"), "max": float("-inf")}.get(kind, 0.0)


def combine(kind: MetricKind, a: float, b: float) -> float:
    """Accumulate two raw metric values of one kind."""
    if kind == "min":
        return min(a, b)
    if kind == "max":
        return max(a, b)
    return a + b


def loss_normalizer(loss_type: LossType, seqs: float, toks: float) -> float:
    """The global N the gradients (and the loss's own metrics) are divided by."""
    return toks if loss_type == LossType.TOKEN_LEVEL else seqs


def finalize_metrics(
    raw: dict[str, float],
    kinds: dict[str, MetricKind],
    loss_type: LossType,
    seqs: float,
    toks: float,
    skipped: tuple[float, float] = (0.0, 0.0),
) -> dict[str, float]:
    """Turn raw (placeholder-normalized, globally reduced) metric sums into their declared means.
    `skipped`: (seqs, toks) of inert rows counted but not run: in the loss's normalizer (so the loss
    metrics equal a run over every row) and in the `num_valid_*` counts, not in the token and sequence
    means of the rows run."""
    loss_n = loss_normalizer(loss_type, seqs + skipped[0], toks + skipped[1])
    denom = {"toks": toks, "seqs": seqs, "loss_type": loss_n}
    out = {}
    for name, value in raw.items():
        kind = kinds[name]
        if kind in denom:
            out[name] = value / denom[kind] if denom[kind] > 0 else 0.0
        else:
            out[name] = value
    # the losses' own counts (num_valid_*) cover every row the step trained on, the inert ones included
    for name, extra in (("num_valid_samples", skipped[0]), ("num_valid_tokens", skipped[1])):
        if name in out:
            out[name] += extra
    return out
