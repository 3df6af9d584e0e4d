"""Inert rows (policy.microbatch.skip_inert_rows): a policy-gradient row whose every advantage is 0 has
loss and gradient exactly 0, so the trainer counts it in the step's normalizer without running it. The
step must equal the one that runs every row: parameters, loss, gradient norm and global counts."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch
from helpers import assert_params_close, params_of, policy_cfg
from posttrain.algorithms.losses import ClippedPGLoss
from posttrain.policy.policy import Policy

INERT = [1, 4]  # zero advantages; row 5 is sample-masked (random_batch), so inert as well
SAME = (
    "loss",
    "pg_loss",
    "grad_norm",
    "global_valid_toks",
    "global_valid_seqs",
    "num_valid_samples",
    "num_valid_tokens",
)


def batch_with_inert_rows(seed: int = 0, rows=INERT):
    batch = random_batch(8, 16, rl=True, seed=seed)
    batch["advantages"][rows] = 0.0
    return batch


def rows_run(policy) -> list[int]:
    """Rows of every training forward of the local worker's model, appended as they run."""
    seen: list[int] = []
    policy.group.workers[0].model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((kwargs.get("input_ids", args[0] if args else None)).shape[0]),
        with_kwargs=True,
    )
    return seen


def train(batches, loss_fn, skip: bool, **cfg):
    cfg.setdefault("microbatch", {})
    cfg["microbatch"] = {
        "skip_inert_rows": skip,
        "share_prefix": False,
        "train_micro_batch_size": 8,
        **cfg["microbatch"],
    }
    policy = Policy(policy_cfg(**cfg))
    try:
        seen = rows_run(policy)
        metrics = [policy.train(b, loss_fn) for b in batches]
        return metrics, params_of(policy), seen
    finally:
        policy.shutdown()


# fp32 on a GPU: fewer rows change the matmuls' shapes and with them cuBLAS's summation order (measured
# on an H100: grad norm 3e-5 relative apart)
SLACK = 10.0 if torch.cuda.is_available() else 1.0


def assert_same(ref, other) -> None:
    for m_ref, m in zip(ref[0], other[0]):
        for k in SAME:
            assert m[k] == pytest.approx(m_ref[k], rel=1e-5 * SLACK, abs=1e-7 * SLACK), k
    if not torch.cuda.is_available():
        # (not on a GPU: where an element's gradient is rounding noise, Adam's first step is +-lr whatever
        # its size, so the GPU's summation order moved a few elements in thousands by up to 1e-3)
        assert_params_close(ref[1], other[1])


@pytest.mark.parametrize(
    "loss_fn",
    [ClippedPGLoss(), ClippedPGLoss(token_level_loss=False), ClippedPGLoss(force_on_policy_ratio=True)],
    ids=["token", "sequence", "on_policy"],
)
def test_skipping_inert_rows_leaves_the_step_unchanged(loss_fn):
    batches = [batch_with_inert_rows(0), batch_with_inert_rows(1)]  # two Adam steps: moments count too
    ran, skipped = train(batches, loss_fn, skip=False), train(batches, loss_fn, skip=True)
    assert_same(ran, skipped)
    assert ran[2] == [8, 8] and skipped[2] == [5, 5]  # rows 1, 4 and the masked 5 were not run
    assert [m["inert_seqs_skipped"] for m in skipped[0]] == [2.0, 2.0]  # the masked row counts no sequence
    assert [m["inert_seqs_skipped"] for m in ran[0]] == [0.0, 0.0]


def test_an_all_inert_batch_still_steps_on_zero_gradients():
    """Adam moves parameters on zero gradients (its first moment): a step of inert rows only is kept,
    one row run, and the parameters move exactly as when every row runs."""
    batches = [batch_with_inert_rows(0), batch_with_inert_rows(1, rows=list(range(8)))]
    ran, skipped = train(batches, ClippedPGLoss(), skip=True), train(batches, ClippedPGLoss(), skip=False)
    assert_same(ran, skipped)
    assert ran[2] == [5, 1] and ran[0][1]["loss"] == 0.0
    before = train(batches[:1], ClippedPGLoss(), skip=True)[1]
    assert any(not torch.equal(before[k], ran[1][k]) for k in before)  # the second step moved them


def test_a_kl_term_or_eval_mode_runs_every_row():
    """With a reference KL term a zero-advantage row still has a gradient: nothing is skipped."""
    metrics, _, seen = train(
        [batch_with_inert_rows(0)], ClippedPGLoss(reference_policy_kl_penalty=0.1), skip=True
    )
    assert seen == [8] and metrics[0]["inert_seqs_skipped"] == 0.0
    policy = Policy(policy_cfg(microbatch={"train_micro_batch_size": 8, "share_prefix": False}))
    try:
        seen = rows_run(policy)
        policy.train(batch_with_inert_rows(0), ClippedPGLoss(), eval_mode=True)
        assert seen == [8]
    finally:
        policy.shutdown()
