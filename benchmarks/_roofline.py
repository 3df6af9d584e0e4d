"""A measured roofline for the speed benchmarks: the machine's matmul peak, and model FLOPs counted from
a decoder's shapes.

`matmul_peak()` times fp32 (or the given dtype) square matmuls at the current intra-op thread count and
returns the best GFLOP/s seen: the ceiling any dense model op can reach on this machine in this run
(call it in the same run, at the same thread count, as what it is compared to). On the CPU it times
every GEMM this torch build offers, `torch.mm` (MKL's SGEMM) and oneDNN's linear (the kernel the
engine's packed projections use), and keeps the best: on AMD CPUs with full-width AVX-512 (Zen 5) MKL
runs a path without AVX-512 at less than half of oneDNN's GFLOP/s, and a probe of `torch.mm` alone
would credit the engine with fractions above 0.9 of a "peak" it beats (benchmarks/RESULTS.md,
"The roofline probe on a Zen 5 VM").

FLOPs are model FLOPs (as in MFU): 2 per multiply-add of every projection a token goes through (q, k,
v, o, the MLP, the LM head; the embedding lookup is free) plus attention, 2 x 2 x heads x head_dim per
(query, key) pair it scores (QK^T and PV), causal. Work a runtime wastes (padding, recomputation) is
not counted, so two runtimes of the same job are credited the same FLOPs. Training counts 3x the
forward (the backward computes gradients of inputs and weights).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch


def machine() -> str:
    """The CPU this run is on, as far as it matters for a roofline: model name, family/model (Zen 3 is
    family 25 model 1, Zen 4 family 25 model 17), cores, and whether AVX-512 is there. The VMs this
    project is measured on differ between sessions, so every result quotes it."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    flags = info.get("flags", "").split()
    return (
        f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}), "
        f"{os.cpu_count()} cores, AVX-512 {'yes' if 'avx512f' in flags else 'no'}, torch {torch.__version__}"
    )


def matmul_peak(
    dtype: torch.dtype = torch.float32, sizes=(1024, 2048), seconds: float = 0.5, report: bool = False
) -> float:
    """Best GFLOP/s of n x n matmuls (for each n in `sizes` and each GEMM of `matmul_kernels`, repeated
    for about `seconds`); `report`: print each GEMM's best."""
    peaks = kernel_peaks(dtype, sizes, seconds)
    if report:
        print(describe(peaks, dtype), flush=True)
    return max(peaks.values())


def describe(peaks: dict, dtype: torch.dtype = torch.float32) -> str:
    """One line with each GEMM's best GFLOP/s (`kernel_peaks`' result)."""
    each = ", ".join(f"{name} {gf:.0f}" for name, gf in peaks.items())
    return f"matmul probe ({dtype}, {torch.get_num_threads()} thread(s)), GFLOP/s: {each}"


def kernel_peaks(dtype: torch.dtype = torch.float32, sizes=(1024, 2048), seconds: float = 0.5) -> dict:
    """{GEMM name: best GFLOP/s of its n x n matmuls} for each kernel of `matmul_kernels`."""
    peaks = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for name, run in matmul_kernels(a, b).items():
            run()  # warm-up (and oneDNN's primitive creation)
            best = peaks.get(name, 0.0)
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                run()
                best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
            peaks[name] = best
    return peaks


def matmul_kernels(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Callables computing `a @ b` with each GEMM available for these tensors: `torch.mm` always; on
    the CPU in fp32 also oneDNN's linear on `b` as a weight, plain and packed (where this build has
    oneDNN)."""
    from posttrain.models.cpu_gemm import mkldnn_linear, onednn_available

    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    kernels = {"torch.mm": lambda: torch.mm(a, b, out=out)}
    if a.device.type != "cpu" or a.dtype != torch.float32 or not onednn_available():
        return kernels
    weight = b.t().contiguous()  # linear computes a @ weight^T
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, a.shape[0])
    kernels["onednn linear"] = lambda: mkldnn_linear(a, weight)
    kernels["onednn packed linear"] = lambda: mkldnn_linear(a, packed)
    return kernels


@dataclass(frozen=True)
class DecoderShape:
    """The shapes of a Llama-style decoder that its FLOPs depend on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> DecoderShape:
        heads = config.num_attention_heads
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
        )

    @property
    def layer_params(self) -> int:
        """Projection weights of the decoder layers, which every token multiplies by."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (h * q + 2 * h * kv + q * h + 3 * h * self.intermediate)

    @property
    def matmul_params(self) -> int:
        """Weights a token multiplies by when its logits are wanted (layers and LM head; the embedding
        lookup is free)."""
        return self.layer_params + self.hidden * self.vocab

    def attention_flops(self, pairs: int) -> int:
        """FLOPs of scoring `pairs` (query, key) pairs and mixing their values, over all layers."""
        return 4 * self.layers * self.heads * self.head_dim * pairs

    def forward_flops(self, lengths: list[int]) -> int:
        """FLOPs of one causal forward over sequences of these lengths, logits at every position."""
        tokens = sum(lengths)
        pairs = sum(n * (n + 1) // 2 for n in lengths)
        return 2 * self.matmul_params * tokens + self.attention_flops(pairs)

    def generate_flops(self, prompt_lengths: list[int], new_tokens: int) -> int:
        """FLOPs of generating `new_tokens` after each prompt: the layers run over the prompt and every
        new token but the last (P + C - 1 positions, each attending to those before it), the LM head
        at the C positions that produce a token."""
        total = 0
        for p in prompt_lengths:
            n = p + new_tokens - 1
            total += 2 * self.layer_params * n + self.attention_flops(n * (n + 1) // 2)
            total += 2 * self.hidden * self.vocab * new_tokens
        return total

    def train_flops(self, lengths: list[int]) -> int:
        """FLOPs of forward and backward over sequences of these lengths (3x the forward)."""
        return 3 * self.forward_flops(lengths)


def gflops(flops: float, seconds: float) -> float:
    """Achieved GFLOP/s of `flops` done in `seconds`."""
    return flops / seconds / 1e9
