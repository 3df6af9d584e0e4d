"""Every example config in configs/ validates (keys and values), so the README's commands work."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.algorithms.grpo import GRPOConfig
from posttrain.algorithms.sft import SFTConfig
from posttrain.config import load_config

CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_config_validates(path):
    cls = SFTConfig if path.name.startswith("sft") else GRPOConfig
    cfg = load_config(cls, path)
    assert cfg.output_dir


def test_readme_parallel_example_validates():
    """The README's tensor-parallel command line: 8 ranks as dp=4 x tp=2."""
    overrides = [
        "policy.cluster.backend=ray",
        "policy.cluster.num_workers=8",
        "policy.cluster.num_gpus_per_worker=1",
        "policy.parallel.tensor_parallel_size=2",
        "policy.parallel.sequence_parallel=true",
    ]
    cfg = load_config(GRPOConfig, CONFIGS / "grpo_qwen2.5_math_gpu.yaml", overrides)
    assert cfg.policy.dp_size == 4
