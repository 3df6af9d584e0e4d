"""State of one open split train step: begin -> train_microbatch ... -> finish | abort.

Rule that keeps collectives matched across data-parallel ranks: every rank receives every
`train_microbatch` call (the driver-side Policy dispatches each call to all ranks with that rank's
shard). Inside one call, ranks agree on the maximum number of micro-batches (one all-reduce) and a
rank with fewer pads with dummy micro-batches (all masks zero; loss multiplied by 0), so FSDP's
per-layer all-gathers and reduce-scatters line up. `finish_train_step` then runs the only other
collectives of the step: one all-reduce of the counts and metric sums, and the grad-norm reduction.

Micro-batches run the loss with placeholder global counts of 1, so backward deposits raw sums;
`finish_train_step` divides the gradients by the true global N once and rescales each metric by
its declared kind (see data/normalization.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from posttrain.data.batch import valid_counts
from posttrain.data.normalization import (
    LossFn,
    LossType,
    MetricKind,
    combine,
    finalize_metrics,
    identity_of,
    loss_normalizer,
)


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm of a step was not finite; the step was refused, the optimizer untouched."""


@dataclass
class OpenStep:
    """Accumulators of one open step (all tensors live on the worker's device)."""

    loss_fn: LossFn
    eval_mode: bool
    device: torch.device
    seqs: torch.Tensor = field(init=False)
    toks: torch.Tensor = field(init=False)
    nonfinite: torch.Tensor = field(init=False)
    skipped_seqs: torch.Tensor = field(init=False)  # inert rows: counted in the normalizer, not run
    skipped_toks: torch.Tensor = field(init=False)
    raw: dict[str, torch.Tensor] = field(default_factory=dict)
    num_microbatches: int = 0

    def __post_init__(self) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.seqs, self.toks, self.nonfinite = zero.clone(), zero.clone(), zero.clone()
        self.skipped_seqs, self.skipped_toks = zero.clone(), zero.clone()
        kinds: dict[str, MetricKind] = self.loss_fn.metric_kinds
        self.raw = {
            k: torch.full((), identity_of(kind), dtype=torch.float64, device=self.device)
            for k, kind in kinds.items()
        }

    def add(
        self, seqs: torch.Tensor, toks: torch.Tensor, loss: torch.Tensor, metrics: dict[str, torch.Tensor]
    ) -> None:
        """Accumulate one real (non-dummy) micro-batch."""
        self.seqs += seqs.double()
        self.toks += toks.double()
        self.nonfinite += (~torch.isfinite(loss.detach())).double()
        kinds = self.loss_fn.metric_kinds
        for name, value in metrics.items():
            if name not in kinds:
                raise ValueError(
                    f"loss {type(self.loss_fn).__name__} returned metric '{name}' that is not declared in its "
                    "metric_kinds; declare its normalization kind (toks, seqs, loss_type, none, min, max)"
                )
            v = value.detach().double().reshape(())
            kind = kinds[name]
            if kind == "min":
                self.raw[name] = torch.minimum(self.raw[name], v)
            elif kind == "max":
                self.raw[name] = torch.maximum(self.raw[name], v)
            else:
                self.raw[name] = self.raw[name] + v
        self.num_microbatches += 1

    def skip(self, seqs: torch.Tensor, toks: torch.Tensor) -> None:
        """Count rows the loss declared inert (not run): they join the loss's normalizer only."""
        self.skipped_seqs += seqs.double()
        self.skipped_toks += toks.double()

    def packed_for_reduce(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str], list[str], list[str]]:
        """(sum vector [seqs, toks, nonfinite, microbatches, skipped seqs, skipped toks, *sum-metrics], min
        vector, max vector, and their names)."""
        kinds = self.loss_fn.metric_kinds
        names = sorted(kinds)
        sums = [n for n in names if kinds[n] not in ("min", "max")]
        mins = [n for n in names if kinds[n] == "min"]
        maxs = [n for n in names if kinds[n] == "max"]

        def stack(items: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(items) if items else torch.zeros(0, dtype=torch.float64, device=self.device)

        n_mb = torch.tensor(float(self.num_microbatches), dtype=torch.float64, device=self.device)
        counts = [self.seqs, self.toks, self.nonfinite, n_mb, self.skipped_seqs, self.skipped_toks]
        sum_vec = stack(counts + [self.raw[n] for n in sums])
        return (
            sum_vec,
            stack([self.raw[n] for n in mins]),
            stack([self.raw[n] for n in maxs]),
            sums,
            mins,
            maxs,
        )


def without_inert_rows(step: OpenStep, batch):
    """`batch` less the rows its loss declares inert (`inert_rows`: loss and gradient exactly 0), which
    are counted into the step's normalizer instead (policy.microbatch.skip_inert_rows). When every row
    is inert one is kept: each rank still makes its model calls, and the optimizer steps on zero
    gradients as it would have (Adam's moments move), not on none."""
    find = getattr(step.loss_fn, "inert_rows", None)
    inert = find(batch) if find is not None else None
    count = 0 if inert is None else int(inert.sum())
    if count == 0:
        return batch
    if count == inert.shape[0]:
        inert = inert.clone()
        inert[0] = False
    step.skip(*valid_counts(batch[inert]))
    return batch[~inert]


def reduce_step(step: OpenStep, all_reduce: Callable) -> tuple[dict[str, float], float, float, float]:
    """Counts and metric sums of the step reduced over ranks (`all_reduce(tensor, op)` in place):
    (final metrics, global sequences, global tokens (inert rows included: the gradient's normalizer
    counts every row), non-finite micro-batches)."""
    sum_vec, min_vec, max_vec, sums, mins, maxs = step.packed_for_reduce()
    all_reduce(sum_vec)
    all_reduce(min_vec, dist.ReduceOp.MIN)
    all_reduce(max_vec, dist.ReduceOp.MAX)
    seqs, toks, nonfinite, n_mb, skip_seqs, skip_toks = (float(x) for x in sum_vec[:6].tolist())
    raw = (
        dict(zip(sums, sum_vec[6:].tolist()))
        | dict(zip(mins, min_vec.tolist()))
        | dict(zip(maxs, max_vec.tolist()))
    )
    loss_fn = step.loss_fn
    metrics = finalize_metrics(
        raw, loss_fn.metric_kinds, loss_fn.loss_type, seqs, toks, skipped=(skip_seqs, skip_toks)
    )
    seqs, toks = seqs + skip_seqs, toks + skip_toks
    metrics.update(
        global_valid_seqs=seqs, global_valid_toks=toks, num_microbatches=n_mb, inert_seqs_skipped=skip_seqs
    )
    return metrics, seqs, toks, nonfinite


# how the values `reduce_step` and `finish_train_step` add to a step's metrics combine over steps: the
# counts summed, the trainer version the largest (the last step's: versions only increase)
STEP_KINDS: dict[str, MetricKind] = {
    **dict.fromkeys(
        ("global_valid_seqs", "global_valid_toks", "num_microbatches", "inert_seqs_skipped", "step_skipped"),
        "none",
    ),
    "trainer_version": "max",
}


def merge_step_metrics(
    results: list[dict[str, float]], kinds: dict[str, MetricKind], loss_type: LossType
) -> dict[str, float]:
    """Combine the metrics of several optimizer steps: a declared token / sequence / loss mean weighted
    by each step's valid tokens / sequences / loss normalizer (`loss_type`), so a last step of a few
    real samples (a held-out set padded to whole global batches) counts for those few; counts (declared
    `none` and the step's own, `STEP_KINDS`) summed; min/max; `trainer_version` the last step's; other
    values (gradient norm, learning rate) plain means."""
    if len(results) == 1:
        return dict(results[0])

    def weight(r: dict[str, float], kind: MetricKind) -> float:
        seqs, toks = r.get("global_valid_seqs", 1.0), r.get("global_valid_toks", 1.0)
        return {"toks": toks, "seqs": seqs, "loss_type": loss_normalizer(loss_type, seqs, toks)}[kind]

    out: dict[str, float] = {}
    for name in dict.fromkeys(k for r in results for k in r):  # a skipped step lacks some keys
        present = [r for r in results if name in r]
        values = [r[name] for r in present]
        kind = STEP_KINDS.get(name) or kinds.get(name)  # other undeclared ones: plain means
        if kind in ("none", "min", "max"):
            acc = identity_of(kind)
            for v in values:
                acc = combine(kind, acc, v)
            out[name] = acc
            continue
        weights = [weight(r, kind) for r in present] if kind is not None else [1.0] * len(present)
        total = sum(weights)
        out[name] = (
            sum(v * w for v, w in zip(values, weights)) / total if total > 0 else sum(values) / len(values)
        )
    out["num_optimizer_steps"] = float(len(results))
    return out


def check_loss_head(loss_fn: LossFn, head: str) -> None:
    """Refuse a loss written for the other model head: a loss reads per-token logprobs (`head=lm`, the
    default of a loss without a `head` attribute) or per-token values of a scalar head (`head=score`)."""
    wants = getattr(loss_fn, "head", "lm")
    if wants != head:
        raise ValueError(
            f"loss {type(loss_fn).__name__} reads the outputs of a model with model.head={wants}, but this "
            f"policy's model has model.head={head}; set policy.model.head={wants} or use a {head} loss"
        )
