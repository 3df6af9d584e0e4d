"""Sliding-window attention in the generation engine: which layers attend through a window, the 4-D
masks each layer type gets, where a windowed layer's ring buffer keeps each position, and the check
that refuses what the engine cannot run exactly.

A layer of type "sliding_attention" (config.layer_types; every layer of a Mistral with a
`sliding_window`) lets the query at position q see the key at position k when 0 <= q - k < window,
as transformers' `masking_utils.sliding_window_overlay` does. A window of `max_model_len` or more
never cuts anything, so such a layer is treated as a full one.

KV memory: a windowed layer keeps, per slot, a ring buffer of `window` positions (position p lives at
column p % window; generation/kv_cache.py) instead of `max_model_len`. At decode the ring holds
exactly the keys the new token may see, so its mask is the full layer's mask cut to the ring's width
(see `WindowMasks.decode`). A prefill attends over the chunk's own keys (all of them, so a prompt
longer than the window is right) and the ring keeps only the last `window`; a session continuation
attends over the ring as it was plus the chunk.

Mask form: a model with `config.layer_types` takes a {layer type: 4-D mask} mapping as
`attention_mask` (the form `transformers.generate` passes its layers); Mistral (no layer types, one
window for all layers) takes the sliding mask as a plain tensor. Models without an effective window
get exactly the masks they got before.

Soft-capping (Gemma2 `attn_logit_softcapping`) and attention sinks (gpt-oss) live inside
transformers' attention functions: sdpa has neither, so `prepare_attention` runs such models with
"eager". Final-logit soft-capping is applied by the model's own forward (the engine's own LM head is
used only for plain heads, generation/lm_head.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.logging import get_logger

log = get_logger(__name__)

FULL, SLIDING = "full_attention", "sliding_attention"


def layer_windows(config, max_len: int) -> list[int | None]:
    """Per layer: the window it attends through, or None for full attention (also for a window that
    cannot cut anything at `max_len`)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2 before it cleared the window itself
        window = None
    types = getattr(config, "layer_types", None)
    if types is None:
        types = [SLIDING if window else FULL] * config.num_hidden_layers
    if not window or window >= max_len:
        return [None] * len(types)
    return [window if t == SLIDING else None for t in types]


def check_supported(model, max_len: int) -> None:
    """Raise a ValueError naming what the engine cannot run (and what it can); nothing otherwise."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("GenerationEngine runs decoder-only causal LMs; this model is encoder-decoder")
    types = getattr(config, "layer_types", None) or []
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        raise ValueError(
            f"GenerationEngine does not support layer types {other} (model_type "
            f"{getattr(config, 'model_type', '?')!r}); it runs '{FULL}' and '{SLIDING}' layers whose "
            "attention uses the Cache.update protocol (Llama, Qwen2/3, Mistral, Gemma2/3, gpt-oss)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            "GenerationEngine generates causally; this model's config sets use_bidirectional_attention "
            "(an encoder-style variant); load it with use_bidirectional_attention=False"
        )
    windows = {w for w in layer_windows(config, max_len) if w is not None}
    if len(windows) > 1:  # not reachable through today's configs (one sliding_window per model)
        raise ValueError(f"GenerationEngine supports one sliding window per model, got {sorted(windows)}")


def _needs_eager(model) -> str | None:
    """Why `model` must run eager attention (what sdpa lacks), or None."""
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        return "attention sinks"
    return None


def prepare_attention(model) -> None:
    """Make `model` run an attention implementation that takes the engine's 4-D masks and applies
    everything the model's attention does: "eager" where sdpa lacks a feature (soft-capping, sinks) or
    the model has no sdpa path, else "sdpa"; kept as it is when it already qualifies."""
    current = getattr(model.config, "_attn_implementation", None)
    why = _needs_eager(model)
    if current == "eager" or (current == "sdpa" and why is None):
        return
    wanted = "eager" if why is not None or not getattr(model, "_supports_sdpa", False) else "sdpa"
    reason = why or "the engine passes its own 4-D masks and KV cache"
    log.warning(
        "GenerationEngine runs this model with %r attention instead of %r (%s)", wanted, current, reason
    )
    model.set_attn_implementation(wanted)


def ring_positions(last: torch.Tensor, capacity: int) -> torch.Tensor:
    """[rows, capacity]: the position held by each column of a ring buffer whose newest entry is
    position `last[i]` (column p % capacity holds p); negative where nothing was written yet."""
    cols = torch.arange(capacity, device=last.device)
    return last[:, None] - torch.remainder(last[:, None] - cols[None, :], capacity)


class WindowMasks:
    """The engine's attention masks per layer type, built from its boolean full-attention masks, and
    the KV capacity of each layer (see the module docstring)."""

    def __init__(self, config, max_len: int, additive: Callable[[torch.Tensor], torch.Tensor]) -> None:
        windows = layer_windows(config, max_len)
        self.window = next((w for w in windows if w is not None), None)
        self.typed = getattr(config, "layer_types", None) is not None
        self.capacities = [w or max_len for w in windows]
        self._additive = additive

    @property
    def active(self) -> bool:
        """Whether some layer attends through a window shorter than max_model_len."""
        return self.window is not None

    def _pack(self, full: torch.Tensor, sliding: torch.Tensor | None = None):
        """Additive 4-D masks (a heads dim added) as the model takes them."""
        full_mask = self._additive(full)[:, None]
        if sliding is None:
            return full_mask
        sliding_mask = self._additive(sliding)[:, None]
        return {FULL: full_mask, SLIDING: sliding_mask} if self.typed else sliding_mask

    def prefill(self, full: torch.Tensor):
        """Masks for a prefill from position 0: `full` [b, q, q] is causal and hides padding; windowed
        layers see the chunk's own keys too, narrowed to the window."""
        if not self.active:
            return self._pack(full)
        ar = torch.arange(full.shape[-1], device=full.device)
        return self._pack(full, full & (ar[:, None] - ar[None, :] < self.window))

    def decode(self, full: torch.Tensor):
        """Masks for a decode step: `full` [n, L] marks the visible positions 0..L-1 of each slot. A ring
        of capacity w holds exactly the last w positions written (the newest included), so its
        column j is visible iff j <= the query's position: `full` cut to w columns."""
        if not self.active:
            return self._pack(full[:, None])
        return self._pack(full[:, None], full[:, None, : self.window])

    def extend(
        self, full: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor
    ):
        """Masks for a continued prefill: row i writes positions offsets[i].. (`positions` [r, q]) of a
        prompt of lengths[i] tokens; `full` [r, q, L] is the full layers' mask. Windowed layers attend
        over their ring as it was (its w columns) followed by the chunk's q keys."""
        if not self.active:
            return self._pack(full)
        w, q = self.window, positions.shape[1]
        ring = ring_positions(offsets - 1, w)
        chunk = offsets[:, None] + torch.arange(q, device=offsets.device)[None, :]
        keys = torch.cat([ring, chunk], dim=1)[:, None, :]  # [r, 1, w + q] positions
        queries = positions[:, :, None]
        seen = (keys >= 0) & (keys < lengths[:, None, None]) & (keys <= queries) & (queries - keys < w)
        return self._pack(full, seen)
