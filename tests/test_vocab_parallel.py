"""The trainer's token logprobs over a whole vocabulary (models/vocab_parallel.py): the fused backward
must give autograd's gradient of `gather - logsumexp` bit for bit (golden runs depend on it)."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.vocab_parallel import token_logprobs


def _autograd_reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@pytest.mark.parametrize("scale", [1.0, 0.7, 30.0])  # 30: logits far apart, many exp(...) underflow to 0
def test_values_and_gradient_equal_autograd_bit_for_bit(scale):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 9, 50, generator=g) * scale
    targets = torch.randint(0, 50, (3, 8), generator=g)
    weights = torch.randn(3, 8, generator=g)
    results = []
    for fn in (token_logprobs, _autograd_reference):
        x = base.clone().requires_grad_(True)
        # as the trainer calls it: the logits shifted by one (a strided view) and divided by a temperature
        lp = fn(x[:, :-1] / 0.9, targets)
        (lp * weights).sum().backward()
        results.append((lp.detach(), x.grad))
    (ours, ours_grad), (ref, ref_grad) = results
    bits = lambda t: (t + 0.0).view(torch.int32)  # noqa: E731  (+ 0.0: -0.0 and +0.0 read the same)
    assert torch.equal(bits(ours), bits(ref))
    assert torch.equal(bits(ours_grad), bits(ref_grad))
    assert ours_grad.abs().sum() > 0


def test_gradient_matches_a_full_log_softmax():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 30, generator=g, requires_grad=True)
    targets = torch.randint(0, 30, (4,), generator=g)
    token_logprobs(x, targets).sum().backward()
    expected = torch.nn.functional.one_hot(targets, 30) - torch.softmax(x.detach(), -1)
    torch.testing.assert_close(x.grad, expected)
