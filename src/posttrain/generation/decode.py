"""The engine's decode step, and its overlap with the host (`generation.overlap_decode`).

A decode step feeds every active slot its last drawn token, draws the next one on the device and hands
tokens and logprobs to the host, which appends them to their requests, checks the stop rules and frees
the slots that finished. Read at once, the device waits while the host does its part and the host waits
while the device does its: on a GPU, where a step of a small model takes a millisecond or less on the
device, the host's part is a large share of it.

With `overlap_decode` the engine launches step t+1 before it reads step t: the inputs of t+1 (the drawn
tokens, the positions, the draw counters) are the device's own buffers, so nothing of t has to reach
the host first, and the host then reads t (its copy went to pinned memory behind an event) and does its
bookkeeping while t+1 runs. What the host learns one step late:

- a request that finished at step t (a stop token, a stop string, its length) was fed once more at t+1:
  its slot wrote the keys/values of its last token, at a position inside its context, and drew a token
  nobody reads (the draw is dropped when t+1 is read: the request is no longer in its slot);
- slots freed at step t are filled one step later, and admission first reads the step in flight, so
  prefills never run beside a step whose tokens are unread.

Each request draws the same tokens either way (its draws depend on its own stream and counter, not on
the rows beside it; tests/test_generation_overlap.py). Engines that record MoE routing read it per step
and do not overlap, nor do models whose rotary embedding follows the longest position a step feeds
(`dynamic`, `longrope`): there a finished request's extra step would change the other rows' frequencies.
What still makes the host wait for the device: a top-k / top-p row (the candidate set grows until the
nucleus fits, a host check per round), and admission (it reads the step in flight first). Small host
values sent to the device (row parameters after the active set changes, slot moves) go from pinned
memory, so they do not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.generation.requests import Request
from posttrain.generation.sampler import RowParams, sample
from posttrain.logging import get_logger
from posttrain.models.rope import length_dependent

log = get_logger(__name__)


@dataclass
class Drawn:
    """Tokens and logprobs drawn for `requests` (row i for requests[i]), on their way to the host."""

    requests: list[Request]
    values: torch.Tensor  # [n, 2] float64 on the host: (token, logprob) per row
    ready: torch.cuda.Event | None  # set when the copy runs behind the device's queue

    def read(self) -> list[list[float]]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.values.tolist()


class DecodeSteps:
    """The decode step of `GenerationEngine` (a mixin: it uses the engine's buffers and forwards,
    declared below)."""

    _active: list[Request]
    _rows: RowParams | None
    _last: torch.Tensor
    _pos: torch.Tensor
    _count: torch.Tensor
    _arange: torch.Tensor
    _release: Callable[[list[int]], None]
    _save_sessions: Callable[[list[int]], None]

    def _build_decode(self) -> None:
        self._pending: Drawn | None = None  # the launched step whose draws the host has not read
        # not with MoE routing (read per step) or a rotary embedding that follows the longest position a
        # step feeds (a finished request's extra step would change the other rows' frequencies)
        self._overlap = (
            bool(self.cfg.overlap_decode)
            and self._routing is None
            and not length_dependent(self.model.config)
        )
        # pinned, alternating (CUDA overlap only); [slots, 2] so that the first n rows are contiguous:
        # a copy into a strided view goes through a pageable temporary and waits for the device
        self._host_buffers: list[torch.Tensor] = []
        if self._overlap and self.device.type == "cuda":
            self._host_buffers = [
                torch.empty(self.cfg.max_num_seqs, 2, dtype=torch.float64, pin_memory=True) for _ in range(2)
            ]

    def _decode(self) -> list[Request]:
        """One decode step over every active slot; the requests that finished (with overlap, at the step
        before: this step's draws are read at the next one)."""
        launched = self._launch_decode()
        if not self._overlap:
            return self._record(launched)
        previous, self._pending = self._pending, launched
        finished = self._record(previous) if previous is not None else []
        if not self._active:  # every request of the step in flight has finished: nothing to read there
            self._pending = None
        return finished

    def _settle(self) -> list[Request]:
        """Read the step in flight, if any (before admission, and when a step fails: its requests then
        continue from what it drew); the requests that finished there."""
        pending, self._pending = self._pending, None
        return self._record(pending) if pending is not None else []

    def _settle_after_failure(self) -> list[Request]:
        """`_settle` when a step failed: its requests continue from what the step in flight drew (the
        device's buffers already hold it). Where that read fails too, its error is logged (the step's
        error is the one raised)."""
        try:
            return self._settle()
        except BaseException as e:  # `_record` took the unread step's requests out
            log.error("could not read the decode step in flight after a failed step: %r", e)
            return []

    def _launch_decode(self) -> Drawn:
        n = len(self._active)
        if self._rows is None:
            reqs = self._active
            self._rows = RowParams.build(
                [r.params for r in reqs], [r.key for r in reqs], self.vocab_size, self.device
            )
        # the host's positions lag the device's by the step in flight
        length = max(r.position for r in self._active) + 1 + (self._pending is not None)
        pos = self._pos[:n]
        if self._graphs is not None and self.cache.keys[0] is not None:
            logits = self._head(self._graphs.run(n, length))  # the mask is built in the graph
            return self._sampled(logits)
        visible = self._arange[:length][None, :] <= pos[:, None]
        if self._lean is not None and self.cache.keys[0] is not None:
            logits = self._head(self._decoder(self._last[:n], pos, self._masks.decode(visible), self.cache))
        else:
            mask = self._masks.decode(visible)
            self.cache.plan_decode(n, pos, length)  # transformers' attention writes through cache.update
            with self._routing.decode(self._active) if self._routing else contextlib.nullcontext():
                logits = self._decode_logits(n, pos, mask)
        return self._sampled(logits)

    def _sampled(self, logits: torch.Tensor) -> Drawn:
        """Draw every active slot's next token from `logits`, advance the slots, send the draws home."""
        n = len(self._active)
        tokens, logprobs = sample(logits, self._rows, self._count[:n])
        self._last[:n] = tokens
        self._pos[:n] += 1
        self._count[:n] += 1
        return self._drawn(list(self._active), tokens, logprobs, to_pinned=True)

    def _decode_logits(self, n: int, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self._body is not None:
            return self._head(self._hidden(self._last[:n, None], pos[:, None], mask)[:, -1])
        return self._forward(self._last[:n, None], pos[:, None], mask)[:, -1]

    def _drawn(
        self, requests: list[Request], tokens: torch.Tensor, logprobs: torch.Tensor, to_pinned: bool = False
    ) -> Drawn:
        """The draws of `requests` on their way to the host: with overlap on a GPU (`to_pinned`), copied
        into the next pinned buffer behind an event; otherwise read at once (one device->host copy)."""
        values = torch.stack([tokens.double(), logprobs.double()], dim=1)
        if not (to_pinned and self._host_buffers):
            return Drawn(requests, values.cpu(), None)
        self._host_buffers.reverse()  # the other one may still be read by the step before
        host = self._host_buffers[0][: len(requests)]
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return Drawn(requests, host, ready)

    def _record(self, drawn: Drawn) -> list[Request]:
        """Append drawn tokens to their requests (a request that left its slot since the launch, finished
        or dropped, takes none); release the slots that finished; the requests that finished. Draws that
        cannot be read take their requests out of their slots, and the error is raised."""
        try:
            host = drawn.read()
        except BaseException:
            # the device's buffers are a token ahead of what these requests hold: continuing would skip
            # a token, so they leave their slots (lost: the error is raised to their callers)
            gone = {id(r) for r in drawn.requests}
            self._release([i for i, r in enumerate(self._active) if id(r) in gone])
            raise
        slot_of = {id(r): i for i, r in enumerate(self._active)}
        ended = []
        for req, (tok, lp) in zip(drawn.requests, host):
            slot = slot_of.get(id(req))
            if slot is None:
                continue
            self.num_generated_tokens += 1
            if req.append(int(tok), lp, self.tokenizer):
                ended.append(slot)
        finished = [self._active[s] for s in ended]
        if ended:
            try:
                self._save_sessions(ended)
            except Exception as e:  # a cache: the sessions' next turns prefill whole; their requests finish
                log.warning(
                    "could not keep the finished sessions' keys/values (%r); their next turns prefill whole",
                    e,
                )
            self._release(ended)
        return finished
