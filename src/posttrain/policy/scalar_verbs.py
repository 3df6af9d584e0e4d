"""The verbs of a scalar-head model (`policy.model.head=score`, models/scalar_head.py), mixed into
`PolicyWorker`: per-token values (a PPO critic's) and one score per row (a reward model's).

They run like `get_logprobs`: the batch cut into inference micro-batches (padded, dynamic or packed;
never shared-prefix plans, which are logprob plans), matched over data-parallel ranks, results put back
in batch order. A verb meant for the other head raises a ValueError naming the head it needs.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from posttrain.models.scalar_head import Head, last_token_values, microbatch_values
from posttrain.policy.lifecycle import ON_DEVICE, verb


class ScalarHeadVerbs:
    """`get_values` and `score` of a worker whose model has a score head; `_require_head` for every verb
    that needs one head. Expects the worker's `cfg`, `model`, `split`, `_infer` and `_scatter`."""

    def _require_head(self, head: Head, verb_name: str) -> None:
        have = self.cfg.model.head
        if have != head:
            what = {"lm": "a causal LM (model.head=lm)", "score": "a scalar head (model.head=score)"}
            raise ValueError(f"{verb_name}() needs {what[head]}; this worker's model has model.head={have}")

    @verb(*ON_DEVICE, collective=True)
    def get_values(self, batch: TensorDict) -> torch.Tensor:
        """[B, T] the score head's output at every token (position i: after reading tokens <= i;
        padding: 0). A critic's values."""
        self._require_head("score", "get_values")
        parts = self._infer(batch, lambda mb: microbatch_values(self.model, mb, self.split).float(), False)
        return self._scatter(batch, parts)

    @verb(*ON_DEVICE, collective=True)
    def score(self, batch: TensorDict) -> torch.Tensor:
        """[B] each row's score: the head's output at its last real token (input_lengths - 1). A reward
        model's reward."""
        self._require_head("score", "score")
        return last_token_values(self.get_values(batch), batch["input_lengths"])
