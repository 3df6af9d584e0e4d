"""Every random generator a run draws from (torch CPU and CUDA, Python's `random`, NumPy's global
state), saved per rank into a safetensors file of a checkpoint and restored from it, so a resumed run
draws exactly what an uninterrupted one would."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from posttrain.logging import get_logger

log = get_logger(__name__)


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    version, mt, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {
        "torch_cpu": torch.get_rng_state(),
        "python_mt": torch.tensor(mt, dtype=torch.int64),
        "numpy_mt": torch.from_numpy(np_keys.astype(np.int64)),
    }
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    scalars = {
        "python_version": version,
        "python_gauss": gauss,
        "numpy_kind": np_kind,
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
    }
    return tensors, scalars


def save_rng(directory: Path, rank: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tensors, scalars = rng_state()
    save_file(tensors, str(directory / f"rank-{rank}.safetensors"), metadata={"scalars": json.dumps(scalars)})


def load_rng(directory: Path, rank: int) -> None:
    path = directory / f"rank-{rank}.safetensors"
    if not path.is_file():
        log.warning(
            "no RNG state for rank %d in %s (saved on fewer ranks); keeping this rank's RNG", rank, path
        )
        return
    with safe_open(str(path), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        s = json.loads(f.metadata()["scalars"])
    torch.set_rng_state(t["torch_cpu"])
    random.setstate((s["python_version"], tuple(t["python_mt"].tolist()), s["python_gauss"]))
    np.random.set_state(
        (
            s["numpy_kind"],
            t["numpy_mt"].numpy().astype(np.uint32),
            s["numpy_pos"],
            s["numpy_has_gauss"],
            s["numpy_gauss"],
        )
    )
    cuda = [t[f"torch_cuda_{i}"] for i in range(sum(k.startswith("torch_cuda_") for k in t))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
