"""The mixture-of-experts side of `PolicyWorker`: routing replay around its model calls
(`policy.moe.routing_replay`, models/moe.py) and the verb that reports how often replay overrode the
trainer's own routing."""

from __future__ import annotations

import contextlib
from typing import Any

from posttrain.models.moe import ReplayStats, microbatch_routing, replay_routing
from posttrain.policy.lifecycle import ON_DEVICE, verb


class RoutingVerbs:
    """Mixed into `PolicyWorker`; expects its `cfg` and `model`."""

    def _replays(self, data: Any) -> bool:
        """Whether model calls on `data` replay its recorded routing."""
        return self.cfg.moe.routing_replay == "rollout" and "routing" in data.keys()

    def _replay(self, mb: Any):
        """The context of one micro-batch's model call: its routing replayed, or nothing."""
        if not self._replays(mb.data):
            return contextlib.nullcontext()
        if not hasattr(self, "_routing_stats"):
            self._routing_stats = ReplayStats()
        return replay_routing(self.model, microbatch_routing(mb.data, mb.packed), self._routing_stats)

    @verb(*ON_DEVICE)
    def pop_routing_stats(self) -> dict[str, int]:
        """Router decisions replayed since the last call (`total`) and how many of them the trainer's own
        router would have made differently (`differ`); resets both."""
        stats = getattr(self, "_routing_stats", ReplayStats())
        self._routing_stats = ReplayStats()
        return {"differ": stats.differ, "total": stats.total}
