"""Batched next-token sampling with per-request parameters and per-request random streams.

Every row of a decode batch may have its own temperature, top-k, top-p, greedy flag and seed, so
everything is vectorized over rows.

Randomness is counter-based instead of a `torch.Generator` per request: token i of a request uses
the uniform number `SplitMix64(key + (i + 1) * gamma)`, where `key` is derived from the request's
(seed, stream). A request's draws therefore depend only on its seed, stream and position, not on the
batch it shares or the slot it sits in, and one uniform per row replaces `torch.multinomial`
(which draws one exponential per vocabulary entry). A token is drawn by inverting the cumulative
distribution with that uniform.

Departures from the textbook: top-k and top-p use `torch.topk` on a candidate set (grown until the
nucleus fits) instead of sorting the whole vocabulary; top-p is applied to the top-k-renormalized
distribution (the order transformers and vLLM use). Logprobs are always taken under the full
`softmax(logits / temperature)` (see generation/params.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.generation.params import SamplingParams

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_NUCLEUS_START = 64  # first candidate-set size for top-p without top-k
_BLOCK = 256  # block width of the two-level inverse-CDF search


def _signed(x: int) -> int:
    """An unsigned 64-bit value as the signed int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def mix64(x: int) -> int:
    """The SplitMix64 finalizer on Python ints (reference for `mix64_tensor`)."""
    z = x & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def derive_seed(*parts: int) -> int:
    """One seed (31 bits, non-negative) from several integers (a base seed, a purpose tag, indices):
    each part is folded in through the SplitMix64 finalizer, so nearby inputs give unrelated seeds.
    Every seed a loop derives (a step's prompt batch, a group, a validation row) comes from here."""
    h = mix64(_GAMMA)
    for part in parts:
        h = mix64((h ^ (part & _MASK64)) + _GAMMA)
    return h >> 33


def request_key(seed: int, stream: int) -> int:
    """The stream key (signed int64) of a request with this seed and stream index."""
    return _signed(mix64(mix64((seed + _GAMMA) & _MASK64) + (stream + 1) * _GAMMA))


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer on an int64 tensor (multiplications wrap modulo 2^64)."""
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniform float64 numbers in [0, 1), one per (key, counter) pair."""
    z = mix64_tensor(keys + (counters + 1) * _signed(_GAMMA))
    return _shr(z, 11).double() * (2.0**-53)


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A small tensor of Python values on `device`. On CUDA it is copied from pinned memory without
    waiting: a copy from pageable memory waits for every kernel queued before it, which would stall
    the host behind a decode step in flight (generation/decode.py)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


@dataclass
class RowParams:
    """Sampling parameters of the rows of a batch, as tensors on the engine's device."""

    temperature: torch.Tensor  # [n, 1] float32
    unit_temperature: bool  # every row at temperature 1 (no division needed)
    top_k: torch.Tensor  # [n] long, V where top-k is off
    top_p: torch.Tensor  # [n] float32
    greedy: torch.Tensor  # [n] bool
    keys: torch.Tensor  # [n] int64
    all_greedy: bool
    any_greedy: bool
    filtered: torch.Tensor  # [n] bool: rows with top-k or top-p
    any_filtered: bool
    all_filtered: bool
    candidates: int  # first candidate-set size for the filtered rows

    @staticmethod
    def build(params: list[SamplingParams], keys: list[int], vocab: int, device) -> RowParams:
        """Gather per-row parameters into tensors (done once per change of the active set)."""
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        filt = [k < vocab or p.top_p < 1.0 for k, p in zip(top_k, params)]
        greedy = [p.greedy for p in params]
        cand = max([k for k, f in zip(top_k, filt) if f and k < vocab], default=0)
        if any(p.top_p < 1.0 and k == vocab for k, p in zip(top_k, params)):
            cand = max(cand, _NUCLEUS_START)
        return RowParams(
            temperature=to_device([[p.temperature] for p in params], torch.float32, device),
            unit_temperature=all(p.temperature == 1.0 for p in params),
            top_k=to_device(top_k, torch.long, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            greedy=to_device(greedy, torch.bool, device),
            keys=to_device(keys, torch.long, device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            filtered=to_device(filt, torch.bool, device),
            any_filtered=any(f and not g for f, g in zip(filt, greedy)),
            all_filtered=all(filt),
            candidates=min(max(cand, 1), vocab),
        )


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from unnormalized `weights` [n, m] with uniforms `u` [n]; never a zero-weight index.

    The first index whose cumulative weight exceeds `u * total`, with the target kept strictly below
    the total so rounding cannot step past the last positive weight. Wide rows go in two levels
    (block sums, then one block), which avoids a sequential cumsum over the whole vocabulary.
    """
    n, m = weights.shape
    if m <= 2 * _BLOCK:
        return _search(weights, u * weights.sum(-1, dtype=torch.float64))
    pad = (-m) % _BLOCK
    blocks = (torch.nn.functional.pad(weights, (0, pad)) if pad else weights).view(n, -1, _BLOCK)
    block_sums = blocks.sum(-1)
    b = _search(block_sums, u * block_sums.sum(-1, dtype=torch.float64))
    rows = torch.arange(n, device=weights.device)
    before = block_sums.cumsum(-1)[rows, b] - block_sums[rows, b]
    inner = blocks[rows, b]
    x = u * block_sums.sum(-1, dtype=torch.float64) - before.double()
    j = _search(inner, x.clamp_(min=0.0))
    return (b * _BLOCK + j).clamp_(max=m - 1)


def _search(weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative weight exceeds `target` [n] (float64), kept below the row total."""
    cdf = weights.cumsum(-1)
    total = cdf[:, -1]
    x = torch.minimum(target.to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x[:, None], right=True)[:, 0].clamp_(max=weights.shape[-1] - 1)


def _filtered_draw(probs: torch.Tensor, rows: RowParams, u: torch.Tensor) -> torch.Tensor:
    """Draw from the top-k / top-p restricted distribution of every row."""
    vocab = probs.shape[-1]
    k = rows.candidates
    nucleus_rows = rows.filtered & (rows.top_k >= vocab)
    while True:
        vals, idx = torch.topk(probs, k, dim=-1)
        in_k = torch.arange(k, device=probs.device)[None, :] < rows.top_k[:, None]
        pk = vals * in_k
        mass = pk.sum(-1)
        # top-p on the top-k-renormalized distribution; without top-k the whole vocabulary has mass 1
        norm = torch.where(rows.top_k >= vocab, torch.ones_like(mass), mass)
        nucleus = (pk.cumsum(-1) - pk) < (rows.top_p * norm)[:, None]
        keep = in_k & (nucleus | (rows.top_p >= 1.0)[:, None])
        covered = ~nucleus_rows | (mass >= rows.top_p)
        if k >= vocab or bool(covered.all()):
            break
        k = min(vocab, 4 * k)
    j = _inverse_cdf(vals * keep, u)
    return idx.gather(1, j[:, None])[:, 0]


def sample(
    logits: torch.Tensor, rows: RowParams, counters: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [n] and their logprobs [n] under `softmax(logits / temperature)`.

    One fused softmax per step; the drawn token's logprob is the log of its probability (within
    ~1e-7 of `logit - logsumexp` in fp32)."""
    scaled = logits.float()
    if not rows.unit_temperature:
        scaled = scaled * (1.0 / rows.temperature)
    probs = torch.softmax(scaled, dim=-1)
    if rows.all_greedy:
        tokens = logits.argmax(-1)
    else:
        u = uniforms(rows.keys, counters)
        if rows.all_filtered and rows.any_filtered:
            tokens = _filtered_draw(probs, rows, u)
        else:
            tokens = _inverse_cdf(probs, u)
            if rows.any_filtered:
                tokens = torch.where(rows.filtered, _filtered_draw(probs, rows, u), tokens)
        if rows.any_greedy:
            tokens = torch.where(rows.greedy, logits.argmax(-1), tokens)
    logprobs = probs.gather(1, tokens[:, None])[:, 0].log()
    return tokens, logprobs
