"""The probe check that makes every weight sync checked (DESIGN.md promise 3).

A fixed probe batch (random token sequences of mixed lengths, deterministic for a seed, with as many
distinct tokens as its size allows) is scored by the trainer before the refit and by the engine
after it. The max and mean absolute logprob difference are metrics; above `max_abs_diff` the sync
fails with `WeightSyncError`. Stale, corrupted or half-loaded weights move the engine's logprobs far
more than float noise (fp32: ~1e-6). The batch is small (4 x 16 tokens by default: one short forward
on each side) because in a dense model every weight except the embedding rows of tokens it lacks
shapes every logprob.

What it does not see: an MoE expert that none of the probe's tokens is routed to (with 64 experts and
top-2, a 48-token probe left 16 of a layer's experts unrouted; corrupting them passed), and a change
smaller than `max_abs_diff` (weights one optimizer step stale at lr 1e-6 moved the tiny model's
logprobs by 1.3e-4). The weight version each load carries is what tells stale weights apart there;
more probe rows (`num_sequences`, `max_length`) route more experts.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from tensordict import TensorDict

from posttrain.config import Config
from posttrain.data.batch import make_batch


class WeightSyncError(RuntimeError):
    """The engine's weights after a sync do not reproduce the trainer's logprobs."""


class ProbeConfig(Config):
    """The probe batch and its threshold."""

    enabled: bool = Field(True, description="compare engine and trainer logprobs after every sync")
    recheck_shared: bool = Field(
        False,
        description="also probe syncs that find the engine already aliasing every trainer tensor "
        "(weight_sync.share): such a sync moves nothing, the optimizer updated the shared memory in "
        "place; off = probe the first sync after any tensor is re-pointed, then check the aliasing only",
    )
    num_sequences: int = Field(4, ge=1, description="probe rows (rounded up to a multiple of the DP size)")
    max_length: int = Field(16, ge=2, description="longest probe row; rows have lengths in [len/2, len]")
    seed: int = Field(1234, description="seed of the probe tokens")
    max_abs_diff: float = Field(
        1e-3,
        gt=0,
        description="fail the sync above this max |engine - trainer| logprob difference; fp32 engines "
        "agree to ~1e-6, raise to ~0.1 for a bf16 engine against an fp32 trainer",
    )


class ProbeBatch:
    """Fixed probe sequences, as token lists (for the engine) and as a batch (for the trainer)."""

    def __init__(self, cfg: ProbeConfig, vocab_size: int, multiple_of: int = 1, min_token: int = 3) -> None:
        n = math.ceil(cfg.num_sequences / multiple_of) * multiple_of
        g = torch.Generator().manual_seed(cfg.seed)
        lengths = torch.randint(max(2, cfg.max_length // 2), cfg.max_length + 1, (n,), generator=g)
        lengths[0] = cfg.max_length
        ids = _spread_tokens(n * cfg.max_length, min(min_token, vocab_size - 1), vocab_size, g)
        ids = ids.view(n, cfg.max_length)
        valid = torch.arange(cfg.max_length)[None, :] < lengths[:, None]
        self.batch: TensorDict = make_batch(
            input_ids=ids * valid,
            input_lengths=lengths,
            token_mask=valid.float(),
            sample_mask=torch.ones(n),
        )
        self.sequences: list[list[int]] = [row[:n_].tolist() for row, n_ in zip(ids, lengths.tolist())]
        self.mask = valid.clone()
        self.mask[:, 0] = False  # position 0 has no logprob


def _spread_tokens(count: int, low: int, high: int, g: torch.Generator) -> torch.Tensor:
    """`count` token ids in [low, high) in random order, as many distinct ones as `count` allows
    (shuffled passes over the range): a weight row of an embedding is checked only if its token
    occurs, so a small probe covers as many rows as it can."""
    passes = -(-count // (high - low))
    return torch.cat([torch.randperm(high - low, generator=g) for _ in range(passes)])[:count] + low


def probe_metrics(
    engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, probe: ProbeBatch
) -> dict[str, float]:
    """Max and mean |engine - trainer| over the probe's scored positions."""
    t = probe.mask.shape[1]
    diff = (engine_logprobs[:, :t].float().cpu() - trainer_logprobs[:, :t].float().cpu()).abs()[probe.mask]
    max_diff = float(diff.max()) if torch.isfinite(diff).all() else math.inf
    return {"probe_max_abs_diff": max_diff, "probe_mean_abs_diff": float(diff.mean())}


def check_probe(metrics: dict[str, float], cfg: ProbeConfig, version: int) -> None:
    """Raise `WeightSyncError` when the probe difference is above the threshold (or not finite)."""
    worst = metrics["probe_max_abs_diff"]
    if not worst <= cfg.max_abs_diff:
        raise WeightSyncError(
            f"weight sync to version {version} failed the probe check: max |engine - trainer| logprob "
            f"difference {worst:.3g} > {cfg.max_abs_diff:g} (mean {metrics['probe_mean_abs_diff']:.3g}). "
            "The engine does not hold the trainer's weights: a stale, corrupted or partial transfer, or "
            "a precision mismatch (raise weight_sync.probe.max_abs_diff for a bf16 engine)"
        )
