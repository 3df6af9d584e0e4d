"""The tensor/sequence/context-parallel invariance tests on GPUs (NCCL, one GPU per rank): the same
scenarios as tests/test_tensor_parallel.py, against one rank on the first GPU. fp32; tolerances allow
for the different reduction orders of GPU kernels (no TF32: torch's default for matmul)."""

from __future__ import annotations

import pytest
import torch

from test_tensor_parallel import LAYOUTS_2, LORA, PACKED, PADDED, _run_matrix

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one GPU per rank)"),
]


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_two_gpus_match_one_gpu(layout):
    scenarios = [
        {"parallel": LAYOUTS_2[layout], "microbatch": mb, "loss": loss}
        for loss in ("pg_token", "pg_seq", "nll")
        for mb in (PADDED, PACKED)
    ]
    scenarios.append({**LORA, "parallel": LAYOUTS_2[layout], "microbatch": PACKED})
    _run_matrix(2, scenarios, tol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_four_gpus_dp2_tp2_match_one_gpu():
    scenarios = [{"parallel": {"tensor_parallel_size": 2}, "microbatch": mb} for mb in (PADDED, PACKED)]
    scenarios.append({**LORA, "parallel": {"tensor_parallel_size": 2}, "microbatch": PACKED})
    _run_matrix(4, scenarios, tol=1e-4)
