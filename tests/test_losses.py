"""Each loss variant against a hand-written formula, and the metric normalization kinds."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_batch
from posttrain.algorithms.losses import ClippedPGLoss, DPOLoss, LossType, NLLLoss, kl_penalty
from posttrain.data.normalization import finalize_metrics


def setup():
    batch = random_batch(6, 10, rl=True, masked=(2,))
    g = torch.Generator().manual_seed(1)
    lp = batch["prev_logprobs"] + 0.3 * torch.randn(6, 10, generator=g)
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    mask[:, 0] = 0
    return batch, lp, mask


def call(loss, lp, batch):
    seqs = batch["sample_mask"].sum()
    toks = (batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum()
    return loss(lp, batch, seqs, toks)


def test_clipped_pg_token_level_formula():
    batch, lp, mask = setup()
    loss, metrics = call(ClippedPGLoss(ratio_clip_min=0.1, ratio_clip_max=0.3), lp, batch)
    ratio = (lp - batch["prev_logprobs"]).exp()
    adv = batch["advantages"]
    per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.9, 1.3))
    expected = (per_tok * mask).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert float(metrics["num_valid_samples"]) == 5
    assert float(metrics["probs_ratio_max"]) == pytest.approx(float(ratio[mask > 0].max()), rel=1e-6)


def test_clipped_pg_sequence_level_formula():
    batch, lp, mask = setup()
    loss, _ = call(ClippedPGLoss(token_level_loss=False), lp, batch)
    ratio = (lp - batch["prev_logprobs"]).exp()
    adv = batch["advantages"]
    per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    per_seq = (per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    expected = (per_seq * batch["sample_mask"]).sum() / batch["sample_mask"].sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_gspo_sequence_ratio_equals_the_papers_formula_in_value_and_gradient():
    """GSPO (Zheng et al. 2025, eq. 5-7): s_i = (pi(y_i)/pi_old(y_i))^(1/|y_i|), loss
    -1/G sum_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i), written out directly here."""
    batch, lp, mask = setup()
    adv = batch["advantages"][:, :1].expand_as(lp).contiguous()  # one advantage per sequence
    batch["advantages"] = adv
    prev = batch["prev_logprobs"]
    lo, hi = 0.05, 0.08  # narrow enough that some sequences are clipped and some are not
    ours_lp = lp.clone().requires_grad_(True)
    ours, metrics = call(
        ClippedPGLoss(ratio_level="sequence", token_level_loss=False, ratio_clip_min=lo, ratio_clip_max=hi),
        ours_lp,
        batch,
    )
    ours.backward()

    paper_lp = lp.clone().requires_grad_(True)
    rows = batch["sample_mask"] > 0  # the G sequences of the group (a masked row is not one)
    m = mask[rows]
    s = (((paper_lp[rows] - prev[rows]) * m).sum(-1) / m.sum(-1)).exp()
    a = adv[rows, 0]
    paper = -torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a).mean()
    paper.backward()
    clipped = s.clamp(1 - lo, 1 + hi) != s
    assert clipped.any() and not clipped.all(), s  # both regimes are exercised
    assert float(ours.detach()) == pytest.approx(float(paper.detach()), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(ours_lp.grad, paper_lp.grad, rtol=1e-6, atol=1e-7)
    assert float(metrics["probs_ratio_max"]) == pytest.approx(float(s.detach().max()), rel=1e-6)


def test_gspo_token_ratio_level_is_the_default_and_differs():
    batch, lp, _ = setup()
    token = call(ClippedPGLoss(token_level_loss=False), lp, batch)[0]
    sequence = call(ClippedPGLoss(token_level_loss=False, ratio_level="sequence"), lp, batch)[0]
    assert ClippedPGLoss().cfg.ratio_level == "token" and float(token) != pytest.approx(float(sequence))


def test_dual_clip_bounds_negative_advantage_loss():
    batch, lp, mask = setup()
    batch["advantages"] = -torch.ones_like(batch["advantages"])
    big = batch["prev_logprobs"] + 3.0  # ratio e^3 ~ 20
    loss_plain, _ = call(ClippedPGLoss(), big, batch)
    loss_dual, _ = call(ClippedPGLoss(ratio_clip_c=3.0), big, batch)
    assert float(loss_plain) == pytest.approx(math.exp(3.0), rel=1e-5)
    assert float(loss_dual) == pytest.approx(3.0, rel=1e-6)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_and_clamps(kind):
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = ref - lp
    expected = {"k1": -d, "k2": 0.5 * d**2, "k3": d.exp() - d - 1}[kind]
    torch.testing.assert_close(kl_penalty(lp, ref, kind), expected)
    clamped = kl_penalty(lp, ref, kind, input_clamp=0.2, output_clamp=0.01)
    assert clamped.abs().max() <= 0.01 + 1e-7


def test_reference_kl_term_added():
    batch, lp, mask = setup()
    base, _ = call(ClippedPGLoss(), lp, batch)
    with_kl, metrics = call(
        ClippedPGLoss(reference_policy_kl_penalty=0.5, kl_input_clamp_value=None), lp, batch
    )
    kl = kl_penalty(lp, batch["reference_logprobs"], "k3", None, 10.0)
    expected = float(base) + 0.5 * float((kl * mask).sum() / mask.sum())
    assert float(with_kl) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["kl_penalty"]) == pytest.approx(expected - float(base), rel=1e-5)


@pytest.mark.parametrize("tis", [None, "tis", "icepop"])
def test_importance_sampling_correction(tis):
    batch, lp, mask = setup()
    batch["generation_logprobs"] = batch["prev_logprobs"] - torch.linspace(
        -1.5, 1.5, 10
    )  # weights e^-1.5..e^1.5
    loss_fn = ClippedPGLoss(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type=tis,
        truncated_importance_sampling_ratio=2.0,
        truncated_importance_sampling_ratio_min=0.5,
    )
    loss, metrics = call(loss_fn, lp, batch)
    w = (batch["prev_logprobs"] - batch["generation_logprobs"]).exp()
    if tis == "tis":
        w = w.clamp(max=2.0)
    elif tis == "icepop":
        w = w * ((w <= 2.0) & (w >= 0.5)).float()
    ratio = (lp - batch["prev_logprobs"]).exp()
    adv = batch["advantages"]
    per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * w
    assert float(loss) == pytest.approx(float((per_tok * mask).sum() / mask.sum()), rel=1e-5)
    if tis is not None:
        assert float(metrics["is_oob_fraction"]) > 0


@pytest.mark.parametrize("level", ["sequence", "geometric"])
@pytest.mark.parametrize("tis", ["tis", "icepop"])
def test_importance_sampling_level_weighs_each_sequence_whole(level, tis):
    """importance_sampling_level: one weight per sequence from its trained tokens only (a masked
    token's mismatch does not count), the product of the token ratios (sequence) or their geometric
    mean, truncated or masked as a whole, against the formula written out per row."""
    batch, lp, mask = setup()
    g = torch.Generator().manual_seed(2)
    shift = torch.tensor([1.2, -0.9, 0.1, 0.9, -0.2, 0.0])[:, None]  # per row: in and out of [0.5, 2]
    batch["generation_logprobs"] = batch["prev_logprobs"] - shift - 0.05 * torch.randn(6, 10, generator=g)
    batch["generation_logprobs"][:, 0] += 50.0  # an untrained position: would swamp any weight it entered
    opts = {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": tis}
    loss, metrics = call(ClippedPGLoss(importance_sampling_level=level, **opts), lp, batch)
    token_loss, _ = call(ClippedPGLoss(**opts), lp, batch)
    ratio = (lp - batch["prev_logprobs"]).exp()
    adv = batch["advantages"]
    per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    expected, oob = torch.zeros(()), []
    for i in range(6):
        on = mask[i] > 0
        if not on.any():
            continue
        d = (batch["prev_logprobs"][i] - batch["generation_logprobs"][i])[on]
        w = math.exp(float(d.sum()) if level == "sequence" else float(d.mean()))
        out = w > 2.0 if tis == "tis" else not 0.5 <= w <= 2.0
        oob.append(out)
        w = (2.0 if tis == "tis" else 0.0) if out else w
        expected = expected + (per_tok[i][on] * w).sum()
    expected = expected / mask.sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(loss) != pytest.approx(float(token_loss), rel=1e-3)  # not the per-token weights
    assert any(oob) and not all(oob), oob  # both regimes of the truncation are exercised
    tokens = [int((mask[i] > 0).sum()) for i in range(6) if (mask[i] > 0).any()]
    assert float(metrics["is_oob_fraction"]) == pytest.approx(
        sum(n for n, o in zip(tokens, oob) if o) / sum(tokens), rel=1e-6
    )


def test_disable_ppo_ratio_and_force_on_policy():
    batch, lp, mask = setup()
    lp = lp.clone().requires_grad_(True)
    loss, _ = call(ClippedPGLoss(disable_ppo_ratio=True), lp, batch)
    expected = (-batch["advantages"] * lp * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss_on, _ = call(ClippedPGLoss(force_on_policy_ratio=True), lp, batch)
    (grad,) = torch.autograd.grad(loss_on, lp)
    # ratio is 1 in value, its gradient is d lp: the on-policy policy gradient -A / N
    torch.testing.assert_close(grad, -batch["advantages"] * mask / mask.sum())
    assert loss_on.item() == pytest.approx(float((-batch["advantages"] * mask).sum() / mask.sum()), rel=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis"},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop"},
        {"use_importance_sampling_correction": True, "reference_policy_kl_penalty": 0.3},
        {"use_importance_sampling_correction": True, "token_level_loss": False, "ratio_clip_c": 3.0},
    ],
)
def test_force_on_policy_equals_explicit_prev_logprobs_of_the_same_weights(options):
    """One optimizer step at the weights that made prev_logprobs: prev == the training logprobs. The
    forced ratio takes them from the training forward (no prev_logprobs in the batch) and must give
    the same loss, gradient and metrics, bit for bit, IS weights and mismatch metrics included."""
    batch, lp, _ = setup()
    # the generation logprobs lie far enough from lp that TIS caps and icepop zeroes some weights
    batch["generation_logprobs"] = lp - torch.linspace(-1.5, 1.5, 10)
    explicit = batch.clone()
    explicit["prev_logprobs"] = lp.clone()
    forced = batch.clone()
    del forced["prev_logprobs"]
    lp_a, lp_b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    loss_a, metrics_a = call(ClippedPGLoss(**options), lp_a, explicit)
    forced_fn = ClippedPGLoss(**options, force_on_policy_ratio=True)
    assert "prev_logprobs" not in forced_fn.required_keys
    assert "prev_logprobs" in ClippedPGLoss(**options).required_keys
    loss_b, metrics_b = call(forced_fn, lp_b, forced)
    (grad_a,) = torch.autograd.grad(loss_a, lp_a)
    (grad_b,) = torch.autograd.grad(loss_b, lp_b)
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    torch.testing.assert_close(grad_b, grad_a, rtol=0, atol=0)
    assert metrics_b.keys() == metrics_a.keys()
    for k in metrics_a:
        torch.testing.assert_close(metrics_b[k], metrics_a[k], rtol=0, atol=0, msg=k)
    assert float(grad_a.abs().sum()) > 0
    if options.get("use_importance_sampling_correction"):
        # the weights are exp(lp - gen), not 1: the gradient differs from the uncorrected one
        assert float(metrics_b["importance_weight"]) != pytest.approx(1.0, abs=1e-3)
        assert float(metrics_b["token_mult_prob_error"]) > 1.1
        plain = ClippedPGLoss(**(options | {"use_importance_sampling_correction": False}))
        lp_c = lp.clone().requires_grad_(True)
        (grad_c,) = torch.autograd.grad(call(plain, lp_c, explicit)[0], lp_c)
        assert not torch.allclose(grad_c, grad_b)


def test_nll_token_and_sequence_level():
    batch, lp, mask = setup()
    loss, _ = call(NLLLoss(), lp, batch)
    assert float(loss) == pytest.approx(float((-lp * mask).sum() / mask.sum()), rel=1e-6)
    loss_s, _ = call(NLLLoss(token_level_loss=False), lp, batch)
    per_seq = (-lp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    assert float(loss_s) == pytest.approx(float((per_seq * batch["sample_mask"]).sum() / 5), rel=1e-6)


def test_dpo_prefers_chosen():
    batch, lp, mask = setup()
    batch["sample_mask"] = torch.ones(6)
    loss_fn = DPOLoss(beta=0.5)
    loss, metrics = call(loss_fn, lp, batch)
    m = token_mask = batch["token_mask"].clone()
    token_mask[:, 0] = 0
    r = ((lp - batch["reference_logprobs"]) * m).sum(-1)
    margin = 0.5 * (r[0::2] - r[1::2])
    expected = -torch.nn.functional.logsigmoid(margin).mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(metrics["accuracy"]) == pytest.approx(float((margin > 0).float().mean()), rel=1e-6)
    with pytest.raises(ValueError, match="pairs"):
        call(loss_fn, lp[:5], batch[:5])


def test_ipo_is_the_squared_length_normalised_margin():
    batch, lp, _ = setup()
    batch["sample_mask"] = torch.ones(6)
    loss, _ = call(DPOLoss(beta=0.5, loss_type="ipo"), lp, batch)
    m = batch["token_mask"].clone()
    m[:, 0] = 0
    r = ((lp - batch["reference_logprobs"]) * m).sum(-1) / m.sum(-1)
    expected = ((r[0::2] - r[1::2] - 1 / (2 * 0.5)) ** 2).mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_metric_kinds_rescale_placeholder_sums():
    """Placeholder counts of 1 then finalize == calling with the true counts."""
    batch, lp, mask = setup()
    for loss_fn in (ClippedPGLoss(token_level_loss=False), ClippedPGLoss(), NLLLoss()):
        _, true = call(loss_fn, lp, batch)
        one = torch.ones(())
        _, raw = loss_fn(lp, batch, one, one)
        seqs, toks = float(batch["sample_mask"].sum()), float(mask.sum())
        final = finalize_metrics(
            {k: float(v) for k, v in raw.items()}, loss_fn.metric_kinds, loss_fn.loss_type, seqs, toks
        )
        for k, v in true.items():
            assert final[k] == pytest.approx(float(v), rel=1e-6), k
        assert final["num_valid_samples"] == 5  # raw counts are not divided
    assert ClippedPGLoss(token_level_loss=False).loss_type == LossType.SEQUENCE_LEVEL


def _trl_dr_grpo(lp, old, ref, adv, completion_mask, max_completion_length, eps=0.2, beta=0.0):
    """TRL GRPOTrainer._compute_loss with loss_type="dr_grpo" (trl/trainer/grpo_trainer.py, token-level
    importance sampling, no vLLM correction), on completion-only [B, C] tensors."""
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token_loss = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    return (per_token_loss * completion_mask).sum() / (per_token_loss.size(0) * max_completion_length)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_dr_grpo_equals_trl_and_keeps_the_global_contract(beta):
    """Our rows are prompt (3 tokens) + completion (up to 9); TRL's tensors are the completions alone. Two
    micro-batches with the global counts sum to TRL's loss on the whole batch (1e-6)."""
    g = torch.Generator().manual_seed(3)
    b, p, c, max_len = 6, 3, 9, 12
    lengths = torch.tensor([9, 4, 7, 1, 9, 5])
    completion_mask = (torch.arange(c)[None] < lengths[:, None]).float()
    lp, old, ref = (-torch.rand(b, c, generator=g) * 2 - 0.1 for _ in range(3))
    adv = torch.randn(b, generator=g)
    pad = lambda x: torch.nn.functional.pad(x, (p, 0))  # noqa: E731 - prompt positions in front
    from posttrain.data.batch import make_batch

    batch = make_batch(
        input_ids=torch.ones(b, p + c, dtype=torch.long), input_lengths=p + lengths, token_mask=pad(completion_mask),
        sample_mask=torch.ones(b), advantages=pad(adv[:, None].expand(b, c)), prev_logprobs=pad(old),
        generation_logprobs=pad(old), reference_logprobs=pad(ref),
    )  # fmt: skip
    loss_fn = ClippedPGLoss(
        loss_type="dr_grpo", max_completion_length=max_len, reference_policy_kl_penalty=beta,
        kl_input_clamp_value=None, kl_output_clamp_value=None,
    )  # fmt: skip
    assert loss_fn.loss_type == LossType.SEQUENCE_LEVEL
    seqs, toks = batch["sample_mask"].sum(), completion_mask.sum()
    ours = sum(loss_fn(pad(lp)[i : i + 3], batch[i : i + 3], seqs, toks)[0] for i in (0, 3))
    expected = _trl_dr_grpo(lp, old, ref, adv, completion_mask, max_len, beta=beta)
    assert float(ours) == pytest.approx(float(expected), rel=1e-6, abs=1e-7)
    dapo = ClippedPGLoss(
        reference_policy_kl_penalty=beta, kl_input_clamp_value=None, kl_output_clamp_value=None
    )
    assert float(call(dapo, pad(lp), batch)[0]) != pytest.approx(float(expected), rel=1e-3)  # not the default


def test_dr_grpo_needs_its_constant():
    with pytest.raises(ValueError, match="set loss.max_completion_length"):
        ClippedPGLoss(loss_type="dr_grpo")
    from posttrain.algorithms.losses import ClippedPGConfig, with_completion_length

    cfg = with_completion_length(ClippedPGConfig(loss_type="dr_grpo"), 16)
    assert ClippedPGLoss(cfg).constant == 16


def test_an_overflowing_sequence_weight_is_masked_by_icepop_not_nan():
    """The product of 2000 token ratios of e^0.05 is e^100: inf in fp32. icepop must mask that sequence
    (weight 0), leaving the other row's loss and gradient as if the masked row had no advantage."""
    from posttrain.data.batch import make_batch

    t = 2001
    torch.manual_seed(0)
    gen = -torch.rand(2, t) - 0.5
    prev = gen.clone()
    prev[0] += 0.05
    prev[1] += 0.0001
    gen[:, 0] = prev[:, 0] = 0

    def batch_with(adv_row0: float):
        return make_batch(
            input_ids=torch.randint(4, 50, (2, t)),
            input_lengths=torch.full((2,), t),
            token_mask=torch.ones(2, t),
            sample_mask=torch.ones(2),
            advantages=torch.tensor([[adv_row0], [-1.0]]).expand(2, t).clone(),
            generation_logprobs=gen,
            prev_logprobs=prev,
        )

    loss_fn = ClippedPGLoss(
        use_importance_sampling_correction=True,
        importance_sampling_level="sequence",
        truncated_importance_sampling_type="icepop",
    )
    one = torch.ones(())
    grads = []
    for adv in (1.0, 0.0):
        lp = prev.clone().requires_grad_(True)
        loss, metrics = loss_fn(lp, batch_with(adv), one, one)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        grads.append((loss.detach(), lp.grad))
    assert grads[0][0] == grads[1][0] and torch.equal(grads[0][1], grads[1][1])
    assert grads[0][1][0].abs().max() == 0 and grads[0][1][1].abs().max() > 0


def test_a_sequence_level_weight_without_a_bound_is_refused():
    with pytest.raises(ValueError, match="set truncated_importance_sampling_type=tis"):
        ClippedPGLoss(use_importance_sampling_correction=True, importance_sampling_level="sequence")
    for bounded in (
        {"truncated_importance_sampling_type": "tis"},
        {"importance_sampling_level": "geometric"},
    ):
        ClippedPGLoss(
            use_importance_sampling_correction=True, **{"importance_sampling_level": "sequence", **bounded}
        )
