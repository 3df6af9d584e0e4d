"""The LM head as the generation engine applies it, and the engine's logprobs of whole sequences.

For plain-head families (Llama, Qwen2/3, Mistral: logits are exactly `lm_head(body(...))`, no bias,
scaling or soft-capping) the engine runs the decoder body itself and applies the LM head here, only at
the positions it samples from. On CPU the head's weight is packed once for oneDNN's matmul (re-packed
after every load); elsewhere it is a plain `F.linear`. `sequence_logprobs` scores sequences through the
same head, so the probe check after a weight sync covers the path generation takes.
"""

from __future__ import annotations

import torch

from posttrain.logging import get_logger
from posttrain.models.logprobs import token_logprobs

log = get_logger(__name__)

_PLAIN_HEAD_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_HEAD_CHUNK = 4096  # vocabulary columns per LM-head matmul on CPU (the output block stays in cache)
_PACK_MIN_NUMEL = 1 << 20  # smaller LM heads: F.linear is as fast, and packing per sync is not free


def plain_head_body(model):
    """The decoder body of a model whose logits are exactly `lm_head(body(...).last_hidden_state)`
    (no bias, scaling or soft-capping), or None; for those the engine applies the LM head itself."""
    head = model.get_output_embeddings()
    config = model.config
    plain = (
        getattr(config, "model_type", None) in _PLAIN_HEAD_FAMILIES
        and isinstance(head, torch.nn.Linear)
        and head.bias is None
        and getattr(config, "final_logit_softcapping", None) is None
        and getattr(config, "logit_scale", None) is None
    )
    return getattr(model, "model", None) if plain else None


class LMHead:
    """A model's output embedding applied to hidden states [n, H] -> logits [n, V].

    On CPU it uses a oneDNN copy of the weight packed for matmul (11 ms against 18 ms for `F.linear`
    on [64, 256] x [256, 32000], one thread), packed again after every load (`drop_packed`); not for
    shared weights, whose in-place updates (a fused optimizer step bumps no version counter) a copy
    would miss. Otherwise (and where oneDNN is missing) vocabulary blocks into one output buffer."""

    def __init__(self, module: torch.nn.Module | None, max_rows: int) -> None:
        self.module = module  # None for a model without output embeddings
        self.max_rows = max_rows  # the batch size oneDNN packs the weight for
        self._packed: tuple[tuple, torch.Tensor] | None = None  # (storage key, packed weight)
        self._pack_failed = not torch.backends.mkldnn.is_available()

    def __call__(self, hidden: torch.Tensor, shared: bool = False) -> torch.Tensor:
        """Logits of `hidden`; `shared` says the weight aliases a trainer's tensor (never packed)."""
        weight = self.module.weight
        if hidden.device.type != "cpu" or hidden.shape[0] == 0:
            return torch.nn.functional.linear(hidden, weight)
        packed = None if shared else self._packed_weight(weight)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, packed, None, "none", [], "")
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
        for start in range(0, weight.shape[0], _HEAD_CHUNK):
            end = start + _HEAD_CHUNK
            torch.mm(hidden, weight[start:end].t(), out=out[:, start:end])
        return out

    def drop_packed(self) -> None:
        """Forget the packed copy: the weight changed in place (a load), moved or was released."""
        self._packed = None

    def _packed_weight(self, weight: torch.Tensor):
        """The oneDNN-packed weight (re-packed when its storage changed; loads, sleep and wake drop it);
        None for small heads, non-fp32 weights, or a torch build without oneDNN."""
        if self._pack_failed or weight.dtype != torch.float32:
            return None
        if weight.numel() < _PACK_MIN_NUMEL:
            return None
        key = (weight.data_ptr(), tuple(weight.shape))
        if self._packed is None or self._packed[0] != key:
            self._packed = None
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.max_rows)
            except (AttributeError, RuntimeError) as e:  # no oneDNN in this build
                log.info("oneDNN-packed LM head unavailable (%s); using blocked matmuls", e)
                self._pack_failed = True
                return None
            self._packed = (key, packed)
        return self._packed[1]


def sequence_logprobs(
    model, body, head: LMHead, ids: torch.Tensor, valid: torch.Tensor, temperature: float, shared: bool
) -> torch.Tensor:
    """[B, T] logprobs of right-padded `ids` (`valid` marks real tokens) under `logits / temperature`,
    in the trainer's convention (position 0 and padding hold 0), on the host in fp32. With a plain-head
    `body` the logits come from `head`, the generation path's LM head."""
    if body is not None:
        hidden = body(input_ids=ids, attention_mask=valid.long(), use_cache=False).last_hidden_state
        logits = head(hidden.reshape(-1, hidden.shape[-1]), shared).view(*ids.shape, -1)
    else:
        logits = model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits
    lp = token_logprobs(logits[:, :-1].float() / temperature, ids[:, 1:])
    return (torch.nn.functional.pad(lp, (1, 0)) * valid).cpu()
