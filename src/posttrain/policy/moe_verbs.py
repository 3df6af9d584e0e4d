"""The mixture-of-experts side of `PolicyWorker`: routing replay around its model calls
(`policy.moe.routing_replay`, models/moe.py), the router losses added to a step's loss
(`RouterLosses`), and the verb that reports how often replay overrode the trainer's own routing."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from posttrain.data.normalization import LossType, MetricKind
from posttrain.models.moe import (
    ReplayStats,
    capture_router_outputs,
    microbatch_routing,
    replay_routing,
    router_losses,
    routers,
)
from posttrain.policy.lifecycle import ON_DEVICE, verb


class RoutingVerbs:
    """Mixed into `PolicyWorker`; expects its `cfg` and `model`."""

    def _replays(self, data: Any) -> bool:
        """Whether model calls on `data` replay its recorded routing, or feed a router loss: plain rows
        then (no shared-prefix plans)."""
        moe = self.cfg.moe
        replays = moe.routing_replay == "rollout" and "routing" in data.keys()
        return replays or moe.aux_loss_coef > 0 or moe.z_loss_coef > 0

    def _replay(self, mb: Any, count: bool = False):
        """The context of one micro-batch's model calls: its routing replayed when it has a record. Keep
        it open through the backward (activation checkpointing recomputes the forward there, which must
        route alike). `count`: add the forward's decisions to the step's `ReplayStats` (training
        forwards of real micro-batches; `_counted` stops the count before the backward)."""
        if not (self.cfg.moe.routing_replay == "rollout" and "routing" in mb.data.keys()):
            return contextlib.nullcontext(ReplayStats(active=False))
        if not hasattr(self, "_routing_stats"):
            self._routing_stats = ReplayStats()
        stats = self._routing_stats if count and not mb.is_dummy else ReplayStats(active=False)
        stats.active = stats is self._routing_stats
        multiple = self.split.multiple  # sequence parallelism pads each call's rows (no cp: config)
        return replay_routing(self.model, microbatch_routing(mb.data, mb.packed, multiple), stats)

    def _capture(self, mb: Any, loss_fn: Any):
        """The context of a training forward: the routers' outputs captured for `loss_fn` when it is
        `RouterLosses`, else nothing."""
        if not isinstance(loss_fn, RouterLosses):
            return contextlib.nullcontext()
        loss_fn.layout = mb
        loss_fn.outputs = []

        @contextlib.contextmanager
        def capture():
            with capture_router_outputs(self.model) as outputs:
                yield
            loss_fn.outputs = outputs

        return capture()

    def _with_router_losses(self, loss_fn: Any) -> Any:
        """`loss_fn`, plus the router losses when `policy.moe` asks for them on an MoE model."""
        moe = self.cfg.moe
        if (moe.aux_loss_coef or moe.z_loss_coef) and routers(self.model):
            return RouterLosses(loss_fn, moe.aux_loss_coef, moe.z_loss_coef)
        return loss_fn

    @verb(*ON_DEVICE)
    def pop_routing_stats(self) -> dict[str, int]:
        """Router decisions replayed by the training forwards since the last call (`total`; logprob and
        reference passes and dummy micro-batches are not counted) and how many of them the trainer's own
        router would have made differently (`differ`); resets both."""
        stats = getattr(self, "_routing_stats", ReplayStats())
        self._routing_stats = ReplayStats()
        return {"differ": stats.differ, "total": stats.total}


class RouterLosses:
    """A loss plus the MoE router losses of the same micro-batch (models/moe.py `router_losses`), per
    sequence, weighted like the loss so the global contract holds: each sequence's value times its
    trained tokens (token-level loss) or once (sequence-level); sequences with sample_mask 0 count nothing.
    The worker captures the routers' outputs of each micro-batch's forward into `outputs`."""

    def __init__(self, base: Any, aux_coef: float, z_coef: float) -> None:
        self.base, self.aux_coef, self.z_coef = base, aux_coef, z_coef
        self.metric_kinds: dict[str, MetricKind] = {
            **base.metric_kinds,
            "moe_aux_loss": "loss_type",
            "moe_z_loss": "loss_type",
        }
        self.layout: Any = None
        self.outputs: list = []

    inert_rows = None  # the router losses take every row: none is inert, whatever the base loss says

    def __getattr__(self, name: str) -> Any:  # loss_type, required_keys, head, row_group: the base's
        return getattr(self.base, name)

    def __call__(self, outputs, batch, global_valid_seqs, global_valid_toks):
        loss, metrics = self.base(outputs, batch, global_valid_seqs, global_valid_toks)
        mb, lengths = self.layout, batch["input_lengths"]
        b = batch["input_ids"].shape[0]
        calls = self.outputs[0][0].shape[0] if self.outputs else 0  # tokens of the call, padding included
        if mb.packed is None:
            t = calls // b
            segment = torch.arange(b, device=lengths.device).repeat_interleave(t)
            keep = (torch.arange(t, device=lengths.device)[None, :] < lengths[:, None]).reshape(-1)
        else:
            real = torch.repeat_interleave(torch.arange(b, device=lengths.device), lengths)
            segment = torch.nn.functional.pad(real, (0, calls - real.numel()))
            keep = torch.arange(calls, device=lengths.device) < real.numel()
        aux, z = router_losses(self.outputs, segment, keep, b)
        trained = (batch["token_mask"][:, 1:].float()).sum(-1) * batch["sample_mask"].float()
        weight = trained if self.base.loss_type == LossType.TOKEN_LEVEL else batch["sample_mask"].float()
        denom = global_valid_toks if self.base.loss_type == LossType.TOKEN_LEVEL else global_valid_seqs
        aux_sum, z_sum = (aux * weight).sum() / denom, (z * weight).sum() / denom
        self.outputs = []
        total = loss + self.aux_coef * aux_sum + self.z_coef * z_sum
        metrics = {**metrics, "moe_aux_loss": aux_sum.detach(), "moe_z_loss": z_sum.detach()}
        if "loss" in metrics:  # the objective the step optimizes
            metrics["loss"] = total.detach()
        return total, metrics
