"""The floating-point dtypes a config may name (`precision`, an engine's `dtype`, an export's `dtype`),
mapped to torch dtypes: one map for every layer that turns such a name into a dtype."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
