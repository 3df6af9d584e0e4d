"""`model.cpu_matmul=onednn`: linear layers on oneDNN's GEMM on the CPU. The forward and both gradient
products must equal `F.linear`'s to fp32 rounding; anything the op does not cover (autocast, bf16,
tensor subclasses such as DTensor shards) must take `F.linear`; a policy trained with it must follow
the default one; and the engine's model gets it too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import random_batch
from helpers import assert_params_close, params_of, policy_cfg
from posttrain.algorithms.losses import ClippedPGLoss
from posttrain.models import cpu_gemm
from posttrain.models.cpu_gemm import OneDNNLinear, onednn_linear, use_onednn_linears
from posttrain.models.hf import build_tiny_model
from posttrain.policy.config import ModelConfig
from posttrain.policy.model_init import build_tokenizer, engine_model
from posttrain.policy.policy import Policy

pytestmark = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this torch build has no oneDNN")


def _grads(fn, x, w, b):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    b = None if b is None else b.clone().requires_grad_(True)
    out = fn(x, w, b)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_both_gradients_match_f_linear(bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 24, generator=g), torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    ours, ref = _grads(onednn_linear, x, w, b), _grads(F.linear, x, w, b)
    for name, a, r in zip(("out", "grad x", "grad w", "grad b"), ours, ref):
        if r is None:
            assert a is None
        else:
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


class _Sub(torch.Tensor):
    """A tensor subclass standing in for DTensor shards."""


def test_what_the_op_does_not_cover_takes_f_linear(monkeypatch):
    calls = []
    real = cpu_gemm._OneDNNLinear.apply
    monkeypatch.setattr(cpu_gemm._OneDNNLinear, "apply", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    onednn_linear(x, w)
    assert calls == [1]  # fp32 CPU: oneDNN
    with torch.autocast("cpu", torch.bfloat16):
        assert onednn_linear(x, w).dtype == torch.bfloat16
    onednn_linear(x.bfloat16(), w.bfloat16())
    onednn_linear(x, torch.Tensor._make_subclass(_Sub, w))
    assert calls == [1], "autocast, bf16 and tensor subclasses must run F.linear"


def test_a_model_keeps_its_parameters_and_outputs():
    model = build_tiny_model(64, seed=0)
    ref = build_tiny_model(64, seed=0)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert use_onednn_linears(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    after = model.state_dict()
    assert {k: v.data_ptr() for k, v in after.items()} == before  # the same tensors, not copies
    ids = torch.randint(4, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_without_onednn_the_error_names_the_fix(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
    with pytest.raises(RuntimeError, match="model.cpu_matmul=torch"):
        use_onednn_linears(build_tiny_model(64, seed=0))


def _train(cpu_matmul: str, **cfg):
    policy = Policy(policy_cfg(model={"cpu_matmul": cpu_matmul}, microbatch={"share_prefix": False}, **cfg))
    try:
        model = policy.group.workers[0].model
        kinds = {type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)}
        metrics = [policy.train(random_batch(8, 16, rl=True, seed=s), ClippedPGLoss()) for s in (0, 1)]
        return metrics, params_of(policy), kinds
    finally:
        policy.shutdown()


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"parallel": {"fsdp": "always", "activation_checkpointing": True}},
        {"lora": {"rank": 4, "alpha": 8}},
    ],
    ids=["plain", "fsdp2_checkpointing", "lora"],
)
def test_a_policy_trains_as_with_f_linear(cfg):
    ours, ours_params, ours_kinds = _train("onednn", **cfg)
    ref, ref_params, ref_kinds = _train("torch", **cfg)
    assert "OneDNNLinear" not in "".join(ref_kinds)
    assert all("OneDNNLinear" in k for k in ours_kinds), ours_kinds  # FSDP2 may subclass it
    for a, b in zip(ours, ref):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
    assert_params_close(ours_params, ref_params, rtol=1e-4, atol=1e-5)


def test_the_engine_model_uses_it():
    cfg = ModelConfig(cpu_matmul="onednn")
    model = engine_model(cfg, None, build_tokenizer(cfg))
    assert any(type(m) is OneDNNLinear for m in model.modules())
    assert not any(type(m) is nn.Linear for m in model.modules())


def test_broadcast_gradients_and_strided_inputs():
    """`.sum().backward()` hands the backward a stride-0 gradient; a transposed input is strided."""
    g = torch.Generator().manual_seed(2)
    base, w = torch.randn(8, 4, generator=g), torch.randn(6, 8, generator=g)
    grads = []
    for fn in (onednn_linear, F.linear):
        x = base.clone().requires_grad_(True)
        fn(x.t(), w).sum().backward()  # the gradient reaching the linear has strides (0, 0)
        fn(x.t(), w)[:, :3].sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_the_output_is_not_a_view():
    """F.linear's output is not a view; a view returned by an FSDP2 root module draws a warning that an
    in-place op on it would skip the pre-backward hook."""
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    out = onednn_linear(x, w)
    assert not out._is_view() and out.shape == (2, 3, 5)


def test_empty_and_one_dimensional_inputs():
    w, b = torch.randn(6, 8), torch.randn(6)
    for x in (torch.randn(0, 8), torch.randn(2, 0, 8), torch.randn(8)):
        torch.testing.assert_close(onednn_linear(x, w, b), F.linear(x, w, b))


def test_a_frozen_weight_keeps_only_what_its_backward_needs():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8)  # w frozen, as a LoRA base layer's
    out = onednn_linear(x, w)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert len(saved) == 1 and saved[0].shape == w.shape  # the weight, not the input
    out.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, 8))


# ------------------------------------------------------------------ inference linears (engine prefill)


def counting_gemm(monkeypatch) -> list[tuple]:
    """Record the weight shape of every oneDNN GEMM call made through cpu_gemm.mkldnn_linear."""
    calls: list[tuple] = []
    real = cpu_gemm.mkldnn_linear

    def counted(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(cpu_gemm, "mkldnn_linear", counted)
    return calls


def test_inference_linears_route_large_fp32_linears_only(monkeypatch):
    calls = counting_gemm(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(2, 7, 256)
    big, bias = torch.randn(300, 256), torch.randn(300)
    small = torch.randn(100, 256)  # 25600 weights, under the floor
    with cpu_gemm.OneDNNInferenceLinears(65536):
        out = F.linear(x, big, bias)
        assert calls == [(300, 256)]
        F.linear(x, small)
        F.linear(x.bfloat16(), big.bfloat16())
        F.linear(x, big.clone().requires_grad_())  # a trainable weight keeps autograd's F.linear
        F.linear(input=x, weight=big)
    assert calls == [(300, 256), (300, 256)]
    assert out.shape == (2, 7, 300)
    torch.testing.assert_close(out, F.linear(x, big, bias), rtol=1e-5, atol=1e-5)
    F.linear(x, big)  # outside the mode: F.linear
    assert len(calls) == 2


def test_engine_prefill_runs_large_linears_on_onednn_and_equals_generate(monkeypatch):
    from posttrain.generation.engine import GenerationEngine
    from posttrain.generation.params import GenerationConfig, SamplingParams
    from test_generation import TOK, VOCAB, hf_greedy, prompts_of

    # hidden 256: q/o 65536 weights, gate/up/down 131072, at the prefill floor (lean_decode.PACK_MIN_NUMEL)
    shape = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    prompts = prompts_of([5, 1, 12, 3, 9, 7, 2, 11])
    reference = build_tiny_model(VOCAB, seed=3, **shape).eval()
    engine = GenerationEngine(build_tiny_model(VOCAB, seed=3, **shape), TOK, GenerationConfig(max_num_seqs=3))
    calls = counting_gemm(monkeypatch)
    results = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=20))
    assert (256, 256) in calls and (512, 256) in calls and (256, 512) in calls  # q/o, gate/up, down
    assert [r.token_ids for r in results] == hf_greedy(reference, prompts, 20, eos=TOK.eos_token_id)
