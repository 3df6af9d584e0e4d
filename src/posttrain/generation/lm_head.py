"""The LM head as the generation engine applies it, and the engine's logprobs of whole sequences.

For plain-head families (Llama, Qwen2/3, Mistral: logits are exactly `lm_head(body(...))`, no bias,
scaling or soft-capping) the engine runs the decoder body itself and applies the LM head here, only at
the positions it samples from. On CPU the head's weight (and the lean decoder's projections) are
packed once for oneDNN's matmul (re-packed after every load, `PackedWeights`); elsewhere it is a plain
`F.linear`. `sequence_logprobs` scores sequences through the same head module with plain matmuls
(the body is transformers' forward), so the probe check after a weight sync covers the weights
generation reads but not the packed copies: those are held equal to the plain path by
tests/test_generation.py and dropped whenever the weights change.
"""

from __future__ import annotations

import torch

from posttrain.logging import get_logger
from posttrain.models.cpu_gemm import mkldnn_linear, onednn_available
from posttrain.models.logprobs import token_logprobs
from posttrain.models.rope import per_sequence_rope

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


class PackedWeights:
    """oneDNN copies of fp32 CPU weights, packed for matmuls of up to `max_rows` rows (about 1.6-1.9x
    the GFLOP/s of `F.linear` on decode-sized inputs, e.g. [32, 768] x [768, 2816]: ~180 against ~105
    GFLOP/s on two threads, the fp32 matmul peak being ~200; benchmarks/RESULTS.md), made on first use
    and kept by the weight's storage. Loads write through `.data` and bump no version counter, so the
    engine drops every copy on each load, sleep and wake (`drop`). Weights shared with a trainer are
    packed only while requests run (the engine drops the copies whenever it falls idle: an in-place
    optimizer step between two generate() calls would not reach them), and never for scoring."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._packs: dict[tuple, torch.Tensor] = {}  # ((storage pointer, shape), ...) -> packed copy
        self._joined: dict[tuple, torch.Tensor] = {}  # the same keys of biases -> their concatenation
        self.failed = not onednn_available()

    def __len__(self) -> int:
        return len(self._packs)

    def get(self, weight: torch.Tensor | tuple[torch.Tensor, ...], min_numel: int) -> torch.Tensor | None:
        """The packed copy of `weight` (a tuple: of the weights concatenated along their output rows,
        e.g. q/k/v as one projection), or None (fewer than `min_numel` elements, not fp32 CPU tensors,
        or a torch build without oneDNN)."""
        weights = weight if isinstance(weight, tuple) else (weight,)
        if self.failed or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in weights):
            return None
        if sum(w.numel() for w in weights) < min_numel:
            return None
        key = tuple((w.data_ptr(), tuple(w.shape)) for w in weights)
        packed = self._packs.get(key)
        if packed is None:
            whole = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(whole, self.max_rows)
            except (AttributeError, RuntimeError) as e:  # no oneDNN in this build
                log.info("oneDNN-packed weights unavailable (%s); using plain matmuls", e)
                self.failed = True
                return None
            self._packs[key] = packed
        return packed

    def joined(self, biases: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The biases of projections packed together, concatenated; kept beside the packs (a load
        drops them too)."""
        key = tuple((b.data_ptr(), tuple(b.shape)) for b in biases)
        joined = self._joined.get(key)
        if joined is None:
            joined = self._joined[key] = torch.cat([b.detach() for b in biases])
        return joined

    def drop(self) -> None:
        """Forget every packed copy (the weights changed in place, moved or were released)."""
        self._packs.clear()
        self._joined.clear()


class LMHead:
    """A model's output embedding applied to hidden states [n, H] -> logits [n, V].

    On CPU it uses a oneDNN copy of the weight packed for matmul (`packs`, shared with the engine's
    lean decoder; 11 ms against 18 ms for `F.linear` on [64, 256] x [256, 32000], one thread); with
    `shared` (scoring with a trainer's tensors) never. Otherwise (and where oneDNN is missing)
    vocabulary blocks into one output buffer."""

    def __init__(self, module: torch.nn.Module | None, max_rows: int) -> None:
        self.module = module  # None for a model without output embeddings
        self.packs = PackedWeights(max_rows)

    def __call__(self, hidden: torch.Tensor, shared: bool = False) -> torch.Tensor:
        """Logits of `hidden`; `shared`: the weight aliases a trainer's tensor and this call is outside
        generation (not packed: nothing drops the copy after it)."""
        weight = self.module.weight
        if hidden.device.type != "cpu" or hidden.shape[0] == 0:
            return torch.nn.functional.linear(hidden, weight)
        packed = None if shared else self.packs.get(weight, _PACK_MIN_NUMEL)
        if packed is not None:
            return mkldnn_linear(hidden, packed)
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
        for start in range(0, weight.shape[0], _HEAD_CHUNK):
            end = start + _HEAD_CHUNK
            torch.mm(hidden, weight[start:end].t(), out=out[:, start:end])
        return out

    def drop_packed(self) -> None:
        """Forget the packed copies (this head's and the lean decoder's): the weights changed in place
        (a load), moved or were released."""
        self.packs.drop()


def sequence_logprobs(
    model, body, head: LMHead, ids: torch.Tensor, valid: torch.Tensor, temperature: float, shared: bool
) -> torch.Tensor:
    """[B, T] logprobs of right-padded `ids` (`valid` marks real tokens) under `logits / temperature`,
    in the trainer's convention (position 0 and padding hold 0), on the host in fp32. With a plain-head
    `body` the logits come from `head`, the generation path's LM head. A rotary embedding whose
    frequencies follow the sequence length gives each row those of its own length, as the trainer's
    (models/rope.py), not those of the batch's width."""
    lengths = valid.sum(dim=1)
    with per_sequence_rope(model, lambda: lengths[:, None].expand_as(ids)):
        if body is not None:
            hidden = body(input_ids=ids, attention_mask=valid.long(), use_cache=False).last_hidden_state
            logits = head(hidden.reshape(-1, hidden.shape[-1]), shared).view(*ids.shape, -1)
        else:
            logits = model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits
    lp = token_logprobs(logits[:, :-1].float() / temperature, ids[:, 1:])
    return (torch.nn.functional.pad(lp, (1, 0)) * valid).cpu()
