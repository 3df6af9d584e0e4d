"""Linear layers on oneDNN's GEMM on the CPU (`model.cpu_matmul: onednn`).

PyTorch's CPU wheels compute fp32 `F.linear` with MKL's SGEMM, which on AMD CPUs never takes its
AVX-512 path: on a Zen 5 core it reaches ~107 GFLOP/s where oneDNN's linear (in the same wheel, the
kernel the generation engine's packed projections use) reaches ~240 (benchmarks/RESULTS.md, "The
roofline probe on a Zen 5 VM"). `use_onednn_linears(model)` makes every `nn.Linear` of a model run its
forward and both backward products (input and weight gradients) on oneDNN's linear when the input and
weight are fp32 CPU tensors outside autocast; anything else (a GPU, bf16, autocast, DTensor shards of
tensor parallelism) takes `F.linear` as before. Same math, other rounding: results agree with
`F.linear` to fp32 rounding, not bit for bit (tests/test_cpu_gemm.py), so it is opt-in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

_ONEDNN = "onednn"


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op (CPU builds of the official wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def mkldnn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for 2-D `x` on oneDNN's GEMM: `weight` plain (strided operands are
    read in place) or packed by `torch.ops.mkldnn._reorder_linear_weight` (generation/lm_head.py)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _unflatten(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`out` [rows, out_features] of an input of `shape` as [*shape[:-1], out_features]; not a view, as
    F.linear's output is not (a module returning a view would have FSDP2 warn that an in-place op on it
    skips its pre-backward hook)."""
    return torch.ops.aten._unsafe_view(out, (*shape[:-1], out.shape[-1]))


class _OneDNNLinear(torch.autograd.Function):
    """`F.linear` with the forward and both gradient products on oneDNN's GEMM."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        # as F.linear: the input only for the weight's gradient, the weight only for the input's
        ctx.save_for_backward(
            flat if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None
        )
        ctx.has_bias = bias is not None
        ctx.in_features = weight.shape[1]
        return _unflatten(mkldnn_linear(flat, weight, bias), x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        flat, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = mkldnn_linear(g, weight.t()).view(*grad.shape[:-1], ctx.in_features)
        if ctx.needs_input_grad[1]:
            grad_w = mkldnn_linear(g.t(), flat.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def _plain(t: torch.Tensor | None) -> bool:
    """A plain tensor or parameter (not a DTensor shard or another subclass); None counts as plain."""
    return t is None or type(t) in (torch.Tensor, nn.Parameter)


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Non-empty fp32 CPU operands, plain tensors (`_plain`), no CPU autocast."""
    return (
        x.numel() > 0
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and type(x) is torch.Tensor
        and _plain(weight)
        and _plain(bias)
        and not torch.is_autocast_enabled("cpu")
    )


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, on oneDNN's GEMM where `_takes_onednn` allows."""
    if _takes_onednn(x, weight, bias):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose forward is `onednn_linear` (same parameters, state dict and repr)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Make every plain `nn.Linear` of `model` an `OneDNNLinear` in place (before any wrapping such as
    FSDP2's, which subclasses a module's class); returns how many. Subclasses of `nn.Linear` with their
    own forward are left alone. Raises when the build has no oneDNN linear."""
    if not onednn_available():
        raise RuntimeError(
            "model.cpu_matmul=onednn needs a torch build with oneDNN (mkldnn); this one has none: "
            "set model.cpu_matmul=torch"
        )
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            count += 1
    return count


class OneDNNInferenceLinears(TorchFunctionMode):
    """Inside it, every `F.linear` whose weight has at least `min_numel` elements and whose operands
    `_takes_onednn` allows, with nothing requiring a gradient, runs on oneDNN's GEMM; the modules stay as
    they are. For inference forwards of models whose modules are not this code's to change (the
    generation engine's prefill: its decode already runs on oneDNN-packed weights)."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (
                weight.numel() >= self.min_numel
                and _takes_onednn(x, weight, bias)
                and not (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
            ):
                return _unflatten(mkldnn_linear(x.reshape(-1, x.shape[-1]), weight, bias), x.shape)
        return func(*args, **kwargs)


def apply_cpu_matmul(model: nn.Module, cpu_matmul: str) -> nn.Module:
    """`model` with its linear layers on the CPU GEMM `cpu_matmul` names ("torch": unchanged)."""
    if cpu_matmul == _ONEDNN:
        use_onednn_linears(model)
    return model
