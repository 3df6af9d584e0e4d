"""One decode step of a Llama-family decoder body (Llama, Qwen2, Mistral) as plain tensor ops.

At decode time every row feeds one token, and on small models the step is dominated by the cost of
the Hugging Face module tree (about 40 module calls and the mask/rotary plumbing per layer), not by
its matmuls. `LeanDecoder` runs the same computation straight from the model's own parameters (no
copies, so weight loads and shared weights are seen at once) and reads/writes the engine's
`SlotKVCache` directly. Prefill and scoring keep the Hugging Face forward. LoRA layers (peft) add
their low-rank update to the base layer's output, as peft's own forward does.

The math is the Hugging Face one, operation for operation where it matters for rounding (RMSNorm in
fp32, rotary embedding from the model's own `rotary_emb`, so every rope scaling type is covered);
grouped-query attention is computed per key/value head without repeating keys. Greedy decoding
equals `transformers.generate` token for token (tests/test_generation.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.generation.kv_cache import SlotKVCache
from posttrain.generation.lm_head import PackedWeights, packed_linear
from posttrain.generation.windows import layer_windows

_FAMILIES = ("llama", "qwen2", "mistral")
PACK_MIN_NUMEL = 1 << 16  # projections with fewer weights run as plain F.linear (packing gains little)


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _linear(x: torch.Tensor, mod, packs: PackedWeights | None = None) -> torch.Tensor:
    """A linear layer's output (from its oneDNN-packed weight where `packs` has one); for a peft LoRA
    layer, its base plus each active adapter's `B(A(x)) * scaling`, in peft's order of operations."""
    base = getattr(mod, "base_layer", None)
    layer = mod if base is None else base
    packed = packs.get(layer.weight, PACK_MIN_NUMEL) if packs is not None else None
    if packed is not None:
        out = packed_linear(x, packed, layer.bias)
    else:
        out = F.linear(x, layer.weight, layer.bias)
    if base is None or mod.disable_adapters:
        return out
    for name in mod.active_adapters:
        if name in mod.lora_A:
            out = (
                out
                + F.linear(F.linear(x, mod.lora_A[name].weight), mod.lora_B[name].weight) * mod.scaling[name]
            )
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanDecoder:
    """Decode-step forward for a supported model body; build with `LeanDecoder.for_model` (None when the
    model is not one it reproduces exactly)."""

    def __init__(self, body, config, packs: PackedWeights | None = None) -> None:
        self.body = body
        self.packs = packs  # oneDNN-packed projections on CPU (the engine drops them on every load)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        # the modules are fixed for the model's life (weight loads replace their tensors' data)
        self.layers = [
            (
                layer.input_layernorm,
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.self_attn.o_proj,
                layer.post_attention_layernorm,
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
                layer.mlp.down_proj,
            )
            for layer in body.layers
        ]
        self.scaling = [layer.self_attn.scaling for layer in body.layers]

    @classmethod
    def for_model(
        cls, model, max_len: int | None = None, packs: PackedWeights | None = None
    ) -> LeanDecoder | None:
        """The lean decoder of `model`, or None. It attends over every cached position, so a model
        with a sliding window that cuts anything at `max_len` (None: at any length) is not one."""
        config = model.config
        body = getattr(model, "model", None)
        if getattr(config, "model_type", None) not in _FAMILIES or body is None:
            return None
        if any(w is not None for w in layer_windows(config, max_len or config.max_position_embeddings + 1)):
            return None
        if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
            return None
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if not all(hasattr(body, name) for name in needed):
            return None
        for layer in body.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None or hasattr(attn, "q_norm") or not hasattr(attn, "scaling"):
                return None
            if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                return None
        return cls(body, config, packs)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: SlotKVCache
    ) -> torch.Tensor:
        """Hidden states [n, H] after the final norm, for one token per slot 0..n-1: `ids` [n] at
        `positions` [n]; `mask` [n, 1, 1, L] additive over the first L cached positions."""
        n = ids.shape[0]
        packs = self.packs
        body = self.body
        h = body.embed_tokens(ids)
        cos, sin = body.rotary_emb(h[:, None], positions[:, None])  # [n, 1, head_dim]
        rows = torch.arange(n, device=ids.device)
        length, group = mask.shape[-1], self.heads // self.kv_heads
        for i, (norm1, q_proj, k_proj, v_proj, o_proj, norm2, gate_proj, up_proj, down_proj) in enumerate(
            self.layers
        ):
            x = _rms_norm(h, norm1)
            q = _linear(x, q_proj, packs).view(n, self.heads, self.head_dim)
            k = _linear(x, k_proj, packs).view(n, self.kv_heads, self.head_dim)
            v = _linear(x, v_proj, packs).view(n, self.kv_heads, self.head_dim)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys, values = cache.write_decode(i, rows, positions, k, v, length)
            qg = q.view(n, self.kv_heads, group, self.head_dim)
            scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(self.scaling[i]).add_(mask)
            out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)
            h = h + _linear(out.reshape(n, -1), o_proj, packs)
            x = _rms_norm(h, norm2)
            gate = _linear(x, gate_proj, packs)
            up = _linear(x, up_proj, packs)
            h = h + _linear(F.silu(gate) * up, down_proj, packs)
        return _rms_norm(h, body.norm)
