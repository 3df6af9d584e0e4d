"""Moving a model (parameters, gradients and buffers) and optimizer state between host and device.

FSDP does not move buffers with its parameters, so buffers are moved explicitly. Host copies use
pinned memory when the device is a GPU; the device allocator cache is emptied after offload.
"""

from __future__ import annotations

import gc

import torch
from torch.distributed.tensor import DTensor


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device or (t.device.type == device.type == "cpu"):
        return t
    if isinstance(t, DTensor):  # a buffer replicated over tensor-parallel ranks: move its local part
        return t.to(device)
    if device.type == "cpu" and torch.cuda.is_available():
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
    return t.to(device, non_blocking=True)


def move_model(model: torch.nn.Module, device: torch.device, keep_params_on_host: bool = False) -> None:
    """Move parameters (unless FSDP CPU offload keeps them on the host) and buffers to `device`."""
    if not keep_params_on_host and any(p.device != device for p in model.parameters()):
        model.to(device)
    for mod in model.modules():
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.device != device:
                mod._buffers[name] = _move(buf, device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def move_optimizer_state(
    opt: torch.optim.Optimizer, device: torch.device, keep_on_host: bool = False
) -> None:
    """Move every tensor of the optimizer state to `device`."""
    if keep_on_host:
        device = torch.device("cpu")
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, (torch.Tensor, DTensor)) and v.dim() > 0 and v.device != device:
                state[k] = v.to(device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_device_cache(device: torch.device) -> None:
    """Return freed device memory to the driver, cuBLAS's workspaces included (torch keeps one per
    thread and stream, 32 MiB each on Hopper: the forward's and the backward's held 64 MiB after an
    offload on an H100; they are made again at the next matmul). A no-op on CPU: there is no device
    cache, and a full `gc.collect()` costs ~0.5 s per call once transformers is imported (measured,
    benchmarks/vs_trl.py)."""
    if device.type == "cuda":
        gc.collect()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            torch.cuda.synchronize(device)  # a workspace may still be in use by queued kernels
            clear_workspaces()
        torch.cuda.empty_cache()
