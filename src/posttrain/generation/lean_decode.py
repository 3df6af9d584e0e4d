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

On CPU with fp32 weights (and no LoRA) a layer runs fused: q/k/v as one oneDNN-packed projection, the
rotary embedding of q and k in one pass, and oneDNN epilogues for the residual adds (into o and down),
the SiLU (into gate) and the gate-up product (into up): about half the ops of the plain path, which
matters at decode batch sizes where a step is a few hundred small ops. The epilogues' SiLU is oneDNN's,
within rounding of torch's (greedy decoding still equals `generate`; tests/test_generation.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from posttrain.generation.kv_cache import SlotKVCache
from posttrain.generation.lm_head import PackedWeights
from posttrain.generation.windows import layer_windows
from posttrain.models.cpu_gemm import mkldnn_linear

_FAMILIES = ("llama", "qwen2", "mistral")
COMPILE_RECOMPILE_LIMIT = 64  # dynamo's per-code limit of compiled variants, raised to at least this
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
        out = mkldnn_linear(x, packed, layer.bias)
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


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, bit for bit, with `signed_sin = _signed_sin(sin)`."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _attend(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, mask) -> torch.Tensor:
    """Attention of one token per row over the cache: `qg` [n, kv_heads, group, head_dim] against
    `keys`/`values` [n, kv_heads, L, head_dim], softmax in fp32, additive `mask` [n, 1, 1, L]."""
    scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scaling).add_(mask)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(qg.dtype), values)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """`sin` with its first half negated: `x.roll(half, -1) * _signed_sin(sin)` is HF's
    `rotate_half(x) * sin` bit for bit (a sign moved between the factors of a product), in two ops."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _fusable(layer_modules: tuple) -> bool:
    """A layer the fused path runs: no LoRA wrappers, and q/k/v with all or none of their biases."""
    _, q, k, v, o, _, gate, up, down = layer_modules
    if any(hasattr(m, "base_layer") for m in (q, k, v, o, gate, up, down)):
        return False
    return len({q.bias is None, k.bias is None, v.bias is None}) == 1


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
        self.fusable = packs is not None and all(_fusable(mods) for mods in self.layers)

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
        sin = _signed_sin(sin)
        fused = self._fused_weights() if self.fusable else None
        if fused is not None:
            for i, weights in enumerate(fused):
                h = self._fused_layer(i, weights, h, cos, sin, rows, positions, mask, cache)
            return _rms_norm(h, body.norm)
        for i, (norm1, q_proj, k_proj, v_proj, o_proj, norm2, gate_proj, up_proj, down_proj) in enumerate(
            self.layers
        ):
            x = _rms_norm(h, norm1)
            q = _linear(x, q_proj, packs).view(n, self.heads, self.head_dim)
            k = _linear(x, k_proj, packs).view(n, self.kv_heads, self.head_dim)
            v = _linear(x, v_proj, packs).view(n, self.kv_heads, self.head_dim)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys, values = cache.write_decode(i, rows, positions, k, v, length)
            out = _attend(q.view(n, self.kv_heads, group, self.head_dim), keys, values, self.scaling[i], mask)
            h = h + _linear(out.reshape(n, -1), o_proj, packs)
            x = _rms_norm(h, norm2)
            gate = _linear(x, gate_proj, packs)
            up = _linear(x, up_proj, packs)
            h = h + _linear(F.silu(gate) * up, down_proj, packs)
        return _rms_norm(h, body.norm)

    def _fused_weights(self) -> list[tuple] | None:
        """Per layer the packed (q|k|v, o, gate, up, down) weights and their biases, or None where the
        weights cannot be packed (not fp32 on CPU, no oneDNN): then the plain path runs."""
        packs, out = self.packs, []
        for _, q, k, v, o, _, gate, up, down in self.layers:
            qkv = packs.get((q.weight, k.weight, v.weight), 0)
            if qkv is None:
                return None
            qkv_bias = None if q.bias is None else packs.joined((q.bias, k.bias, v.bias))
            rest = [(packs.get(m.weight, 0), m.bias) for m in (o, gate, up, down)]
            if any(w is None for w, _ in rest):
                return None
            out.append(((qkv, qkv_bias), *rest))
        return out

    def _fused_layer(self, i: int, weights: tuple, h, cos, sin, rows, positions, mask, cache):
        """One layer on packed weights with oneDNN's fused epilogues: q/k/v in one matmul, rotary on q
        and k together, the residual adds fused into o and down, SiLU into gate and the product into
        up. `sin` is `_signed_sin`'s. About half the ops of the plain path per layer."""
        (qkv_w, qkv_b), (o_w, o_b), (gate_w, gate_b), (up_w, up_b), (down_w, down_b) = weights
        norm1, norm2 = self.layers[i][0], self.layers[i][5]
        linear = torch.ops.mkldnn._linear_pointwise
        n, heads, kv_heads, head_dim = h.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = mkldnn_linear(_rms_norm(h, norm1), qkv_w, qkv_b)
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
        qk = _rotate(qk, cos, sin)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(n, kv_heads, head_dim)
        keys, values = cache.write_decode(i, rows, positions, qk[:, heads:], v, mask.shape[-1])
        qg = qk[:, :heads].view(n, kv_heads, heads // kv_heads, head_dim)
        out = _attend(qg, keys, values, self.scaling[i], mask)
        h = linear.binary(out.reshape(n, -1), h, o_w, o_b, "add")
        x = _rms_norm(h, norm2)
        act = linear.binary(x, linear(x, gate_w, gate_b, "swish", [], ""), up_w, up_b, "mul")
        return linear.binary(act, h, down_w, down_b, "add")


def compiled(decoder: LeanDecoder) -> Callable[..., torch.Tensor]:
    """`decoder`'s step compiled by torch.compile (inductor; `generation.compile_decode`): the norms, the
    rotary embedding, the attention's scale-mask-softmax and the activation become a few fused kernels
    per layer around the matmuls, where the plain path launches about forty. The first call of a shape
    compiles (seconds to a minute); later shapes compile variants (a dynamic attended length, dynamic
    rows, one row alone: about four for a mixed workload), which every engine of the same model class
    in the process shares. Dynamo's recompile limit (8 by default, past which it silently runs eagerly)
    is raised, for the whole process, to at least COMPILE_RECOMPILE_LIMIT. Parameters are inputs of the
    compiled graph, not constants: weight loads, in place or re-pointed, are seen as the eager step
    sees them."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILE_RECOMPILE_LIMIT)
    return torch.compile(decoder.__call__, dynamic=None)
