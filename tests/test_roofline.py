"""benchmarks/_roofline.py: the matmul probe times every GEMM the build offers (each computes the same
product), and the FLOP counts follow the decoder's shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from _roofline import DecoderShape, kernel_peaks, matmul_kernels, matmul_peak  # noqa: E402


def test_every_probed_kernel_computes_the_product():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(48, 40, generator=g), torch.randn(40, 56, generator=g)
    kernels = matmul_kernels(a, b)
    assert "torch.mm" in kernels
    if torch.backends.mkldnn.is_available():
        # the CPU build has oneDNN: its linear (plain and packed) is probed too
        assert {"onednn linear", "onednn packed linear"} <= set(kernels)
    for name, run in kernels.items():
        torch.testing.assert_close(run(), a @ b, msg=name)


def test_peak_is_the_best_kernel():
    peaks = kernel_peaks(sizes=(64,), seconds=0.01)
    assert set(peaks) == set(matmul_kernels(torch.ones(2, 2), torch.ones(2, 2)))
    assert all(v > 0 for v in peaks.values())
    assert matmul_peak(sizes=(64,), seconds=0.01) > 0


def test_generate_flops_counts_prompt_decode_and_head():
    shape = DecoderShape(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10)
    # per layer: q 8x8, k and v 8x4 each, o 8x8, MLP 3 x 8x16
    assert shape.layer_params == 2 * (64 + 2 * 32 + 64 + 3 * 128)
    # a 3-token prompt and 2 new tokens: the layers see 4 positions (10 causal pairs), the head 2
    expected = 2 * shape.layer_params * 4 + shape.attention_flops(10) + 2 * 8 * 10 * 2
    assert shape.generate_flops([3], 2) == expected
