"""The engine's record of MoE routing (`GenerationConfig.record_routing`): for every token the engine
feeds through the model, the expert ids each MoE layer chose (models/moe.py), kept per request and
returned with its result as `routing` [P + C - 1, L, k] int16: the prompt's P tokens, then each
generated token but the last (which the engine never feeds back). The trainer replays them
(policy.moe.routing_replay). A session prompt that reuses kept keys/values (multi-turn) records its new
tokens; the reused prefix holds NO_RECORD (the trainer's router decides there)."""

from __future__ import annotations

import contextlib

import torch

from posttrain.models.moe import NO_RECORD, record_routing


class RoutingLog:
    """Records the routing of the engine's model calls into its requests (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @contextlib.contextmanager
    def prefill(self, firsts: list, chunk: list, width: int):
        """Around a prefill of the distinct prompts `firsts` (rows of `width`); each request of `chunk`
        gets its prompt's routing (repeats: a copy of their first's)."""
        with record_routing(self.model) as calls:
            yield
        rows = calls[0].view(len(firsts), width, *calls[0].shape[1:]).cpu()
        index = {tuple(r.prompt): i for i, r in enumerate(firsts)}
        for r in chunk:
            recorded = rows[index[tuple(r.prompt)], : len(r.prompt)]
            start = len(r.prompt) - recorded.shape[0]
            full = torch.full((len(r.prompt), *recorded.shape[1:]), NO_RECORD, dtype=torch.int16)
            full[start:] = recorded
            r.routing = [full]

    @contextlib.contextmanager
    def continued(self, chunk: list, prefix_lengths: list[int], width: int):
        """Around the prefill of session prompts that extend kept keys/values: row i holds the new tokens
        of `chunk[i]`'s prompt (after its prefix of `prefix_lengths[i]` tokens), right-padded to `width`."""
        with record_routing(self.model) as calls:
            yield
        rows = calls[0].view(len(chunk), width, *calls[0].shape[1:]).cpu()
        for r, row, start in zip(chunk, rows, prefix_lengths):
            full = torch.full((len(r.prompt), *row.shape[1:]), NO_RECORD, dtype=torch.int16)
            full[start:] = row[: len(r.prompt) - start]
            r.routing = [full]

    @contextlib.contextmanager
    def decode(self, active: list):
        """Around a decode step feeding each active request's last token (slot i: one token)."""
        with record_routing(self.model) as calls:
            yield
        step = calls[0].cpu()
        for i, r in enumerate(active):
            if r.routing is None:  # prefilled without a record (a session's new tokens): the prompt has none
                r.routing = [torch.full((len(r.prompt), *step.shape[1:]), NO_RECORD, dtype=torch.int16)]
            r.routing.append(step[i : i + 1])
