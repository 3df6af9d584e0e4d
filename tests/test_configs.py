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
