"""Rotary embeddings whose frequencies depend on the sequence length, given each sequence's own.

transformers' `dynamic` (NTK-aware, Llama family) and `longrope` (Phi-3-mini-128k, Phi-3.5) rotary
embeddings pick their frequencies from `max(position_ids) + 1` of the call they see
(`transformers.modeling_rope_utils.dynamic_rope_update`): longrope the long factors past
`original_max_position_embeddings` and the short ones up to it; dynamic a base stretched for that length
past `max_position_embeddings`. A sequence run alone gets the frequencies of its own length. A trainer's
call sees another length: the width of a padded micro-batch, a packed row, one context-parallel rank's
chunk, one call of a shared-prefix plan; so a row's logprobs followed the micro-batch size, packing and
the parallel layout. transformers' dynamic scaling is also stateful (the cached length only grows, until
a call no longer than the original resets it): a row's logprobs followed the calls before it as well.

`per_sequence_rope(model, lengths)` makes every such rotary module of `model`, for the calls made inside
it, give each token the cos/sin that a fresh model's forward of the token's sequence alone gives it;
`lengths` holds, per token of the call, the length of the sequence the token belongs to. Tokens are
grouped by the frequencies their lengths select (`LengthRope.key`: two groups for longrope, one per
length past the limit for dynamic) and each group runs the module's own (undecorated) forward on its
positions with that group's inverse frequencies, computed by transformers' rope init functions as the
decorator computes them. The module is as it was after the call. For a model without such a module the
context manager does nothing (the model's usual code path).

Tokens computed once for several sequences (a prompt shared by a group of rows) carry one set of
frequencies: `frequency_key` says which lengths share one, and the shared-prefix plans
(data/microbatch.py) group only rows whose keys agree.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["LengthRope", "frequency_key", "length_rotaries", "per_sequence_rope", "segment_lengths"]


def _is_length_dependent(rope_type) -> bool:
    # transformers' own test (dynamic_rope_update): a substring for dynamic, equality for longrope
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def length_dependent(config) -> bool:
    """Whether `config` names a rotary embedding whose frequencies follow the sequence length."""
    return any(_is_length_dependent(t) for t in _config_rope_types(config))


def _config_rope_types(config) -> set:
    """Every rope type a config names (`rope_parameters` in transformers 5, `rope_scaling` before; per
    layer type where the config nests them)."""
    types = set()
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(params, dict):
            for p in (params, *(v for v in params.values() if isinstance(v, dict))):
                types.add(p.get("rope_type", p.get("type")))
    return types


@functools.cache
def _decorated_code():
    """The code object of every forward that `dynamic_rope_update` wraps (one closure, one code)."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _original_max(config) -> int:
    """longrope's switch-over length, read where transformers' decorator reads it."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    value = params.get("original_max_position_embeddings")
    value = value or getattr(config, "original_max_position_embeddings", None)
    return int(value or config.max_position_embeddings)


@dataclass(frozen=True)
class LengthRope:
    """One rotary module whose frequencies follow the sequence length: sequences longer than `limit`
    take other frequencies than the module's original ones."""

    module: torch.nn.Module
    limit: int

    @staticmethod
    def of(module: torch.nn.Module) -> LengthRope:
        if module.rope_type == "longrope":
            return LengthRope(module, _original_max(module.config))
        return LengthRope(module, int(module.original_max_seq_len))

    @property
    def longrope(self) -> bool:
        return self.module.rope_type == "longrope"

    def key(self, lengths: torch.Tensor) -> torch.Tensor:
        """Per length, a number that is equal for lengths given the same frequencies: 0 for the
        original ones; longrope 1 for the long ones, dynamic the length itself."""
        if self.longrope:
            return (lengths > self.limit).long()
        return torch.where(lengths > self.limit, lengths, 0)

    def frequencies(self, key: int, device: torch.device) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention scaling) of the sequences of `key`, as transformers' decorator sets them
        in a fresh module called on one such sequence."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        m = self.module
        if key == 0:
            return m.original_inv_freq.to(device), m.attention_scaling
        init = ROPE_INIT_FUNCTIONS[m.rope_type]
        if self.longrope:
            return init(m.config, device, seq_len=self.limit + 1)[0].to(device), m.attention_scaling
        # a tensor, as the decorator passes max(position_ids) + 1 (the same arithmetic, the same floats)
        inv_freq, scaling = init(m.config, device, seq_len=torch.tensor(key, device=device))
        return inv_freq, scaling


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def length_rotaries(model: torch.nn.Module) -> tuple[LengthRope, ...]:
    """The rotary modules of `model` whose frequencies follow the sequence length (none for most
    models: their config names no such rope type, and no module is visited). A config that names one
    whose module posttrain cannot drive is refused (ValueError)."""
    config = getattr(model, "config", None)
    if not length_dependent(config):
        return ()
    found = _FOUND.get(model)
    if found is None:
        found = _FOUND[model] = _find(model)
    return found


def _find(model: torch.nn.Module) -> tuple[LengthRope, ...]:
    found = []
    for name, m in model.named_modules():
        rope_type = getattr(m, "rope_type", None)
        if isinstance(rope_type, dict) and any(_is_length_dependent(t) for t in rope_type.values()):
            raise ValueError(
                f"{name} has per-layer-type rotary embeddings {rope_type}, one of which depends on the "
                "sequence length; posttrain gives each sequence its own frequencies only for a single "
                "rope type per module. Use a model whose rope_scaling is not dynamic/longrope"
            )
        if _is_length_dependent(rope_type) and _undecorated(type(m).forward) is not None:
            found.append(LengthRope.of(m))
    if not found:
        raise ValueError(
            f"model type '{model.config.model_type}' names a rotary embedding whose frequencies depend on "
            f"the sequence length ({sorted(map(str, _config_rope_types(model.config)))}), but none of its "
            "modules is transformers' (forward decorated with dynamic_rope_update): posttrain cannot give "
            "each sequence its own frequencies, and its logprobs would follow the micro-batch layout"
        )
    return tuple(found)


def _undecorated(forward: Callable) -> Callable | None:
    """The function under transformers' `dynamic_rope_update` in `forward`'s chain of wrappers (it is
    the outermost in transformers 5; transformers 4 puts `torch.no_grad()` around it), or None when the
    chain holds no such decorator."""
    f, seen = forward, 0
    while f is not None and seen < 8:
        if getattr(f, "__code__", None) is _decorated_code():
            return f.__wrapped__
        f, seen = getattr(f, "__wrapped__", None), seen + 1
    return None


def frequency_key(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For the shared-prefix plans: a map from sequence lengths [b] to keys [b] that agree only where
    every length-dependent rotary module of `model` gives the same frequencies; None when the model has
    none (any rows may share a prefix)."""
    ropes = length_rotaries(model)
    if not ropes:
        return None
    if len(ropes) == 1:
        return ropes[0].key
    limit = min(r.limit for r in ropes)
    return lambda lengths: torch.where(lengths > limit, lengths, 0)


def segment_lengths(lengths: list[int], width: int, device: torch.device) -> torch.Tensor:
    """[1, width]: per token of a row holding sequences of `lengths` end to end (then padding up to
    `width`), the length of its sequence; padding takes the last sequence's."""
    n = torch.tensor(lengths, dtype=torch.long, device=device)
    per_token = torch.repeat_interleave(n, n)
    return torch.nn.functional.pad(per_token, (0, width - per_token.numel()), value=lengths[-1])[None]


def _per_sequence_forward(rope: LengthRope, lengths: torch.Tensor):
    """A forward for `rope.module` that gives token j the cos/sin of a sequence of `lengths[.., j]`."""
    module = rope.module
    undecorated = _undecorated(type(module).forward)  # without transformers' frequency update

    def raw(*args):
        with torch.no_grad():  # as the decorated forward runs (cos/sin take no gradient)
            return undecorated(*args)

    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.shape[-1] != lengths.shape[-1]:
            raise RuntimeError(
                f"per_sequence_rope got lengths for {lengths.shape[-1]} tokens, the model call has "
                f"{position_ids.shape[-1]}"
            )
        keys = rope.key(lengths.to(position_ids.device))
        distinct = torch.unique(keys).tolist()
        saved = module.inv_freq, module.attention_scaling
        try:
            if len(distinct) == 1:
                module.inv_freq, module.attention_scaling = rope.frequencies(distinct[0], x.device)
                return raw(module, x, position_ids)
            positions, keys = torch.broadcast_tensors(position_ids, keys)
            cos = sin = None
            for key in distinct:
                picked = keys == key
                module.inv_freq, module.attention_scaling = rope.frequencies(key, x.device)
                c, s = raw(module, x, positions[picked][None])
                if cos is None:
                    cos, sin = (
                        c.new_empty((*keys.shape, c.shape[-1])),
                        s.new_empty((*keys.shape, s.shape[-1])),
                    )
                cos[picked], sin[picked] = c[0], s[0]
            return cos, sin
        finally:
            module.inv_freq, module.attention_scaling = saved

    return forward


@contextlib.contextmanager
def per_sequence_rope(model: torch.nn.Module, lengths: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Inside, the model's length-dependent rotary modules give each token the frequencies of its own
    sequence; `lengths()` gives, per token of every model call made inside ([b or 1, t], the call's
    `position_ids` shape), the length of the sequence it belongs to. It is called only for such a model;
    for any other model this does nothing."""
    ropes = length_rotaries(model)
    if not ropes:
        yield
        return
    per_token = lengths()
    for rope in ropes:
        assert "forward" not in vars(rope.module), "per_sequence_rope does not nest"
        rope.module.forward = _per_sequence_forward(rope, per_token)
    try:
        yield
    finally:
        for rope in ropes:
            del rope.module.forward
