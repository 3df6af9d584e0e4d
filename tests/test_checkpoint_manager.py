"""CheckpointManager: save period, keep-top-k by metric (newest always kept), resume modes."""

from __future__ import annotations

import json

import pytest

from posttrain.algorithms.checkpointing import CheckpointingConfig, CheckpointManager, check_resume_config
from posttrain.checkpoint import FORMAT, FORMAT_VERSION


class FakePolicy:
    def save_checkpoint(self, path, extra_state):
        from pathlib import Path

        p = Path(path)
        p.mkdir(parents=True)
        (p / "extra_state.json").write_text(json.dumps(extra_state))
        (p / "metadata.json").write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION}))


def test_keep_top_k_by_metric_keeps_best_and_newest(tmp_path):
    cfg = CheckpointingConfig(save_period=1, keep_top_k=2, metric_name="val/accuracy")
    mgr = CheckpointManager(cfg, tmp_path)
    for step, acc in enumerate([0.5, 0.9, 0.1, 0.7, 0.2], start=1):
        mgr.save(FakePolicy(), step, {"step": step}, {"val/accuracy": acc, "nan": float("nan")})
    kept = [p.name for p in mgr.complete_checkpoints()]
    assert kept == ["step_2", "step_4", "step_5"]  # best two (0.9, 0.7) + the newest
    assert mgr.resume_path().name == "step_5"


@pytest.mark.parametrize("metric", [None, "val/accuracy"])
def test_keep_top_k_keeps_the_checkpoint_just_saved_below_a_left_history(tmp_path, metric):
    """A run resumed from step 2 (explicitly, or past a damaged step 4) saves step 3 while step 4 of
    the history it left is still on disk: step 3 is the newest, and step 4 ranks last, whatever its
    metric. Keeping the highest step number deleted every new save and could leave nothing usable."""
    cfg = CheckpointingConfig(save_period=1, keep_top_k=1, metric_name=metric)
    mgr = CheckpointManager(cfg, tmp_path)
    for step, acc in ((2, 0.5), (4, 0.9)):
        mgr.save(FakePolicy(), step, {"step": step}, {"val/accuracy": acc})
    mgr.save(FakePolicy(), 3, {"step": 3}, {"val/accuracy": 0.1})
    assert [p.name for p in mgr.complete_checkpoints()] == ["step_3"]
    assert mgr.resume_path().name == "step_3"


def test_a_metric_name_the_step_does_not_log_is_warned_about_once(tmp_path, caplog):
    """A misspelled metric_name scores every checkpoint None, and keep_top_k then keeps the oldest."""
    cfg = CheckpointingConfig(save_period=1, keep_top_k=1, metric_name="val/acuracy")
    mgr = CheckpointManager(cfg, tmp_path)
    for step in (1, 2):
        mgr.save(FakePolicy(), step, {"step": step}, {"val/accuracy": 0.5, "reward": 0.1})
    warned = [r.getMessage() for r in caplog.records if "metric_name" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "'val/acuracy' is not among the metrics of step 1 (did you mean 'val/accuracy'?)" in warned[0]
    caplog.clear()
    good = CheckpointManager(cfg.model_copy(update={"metric_name": "val/accuracy"}), tmp_path / "good")
    good.save(FakePolicy(), 1, {"step": 1}, {"val/accuracy": 0.5})
    assert not [r for r in caplog.records if "metric_name" in r.getMessage()]


def test_a_validation_metric_at_a_step_that_did_not_validate_names_the_periods(tmp_path, caplog):
    """metric_name=val/accuracy, first saved at a step without validation: the cause is that save_period
    does not line up with val_period (no suggestion of the very name set)."""
    cfg = CheckpointingConfig(save_period=3, keep_top_k=1, metric_name="val/accuracy")
    CheckpointManager(cfg, tmp_path).save(FakePolicy(), 3, {"step": 3}, {"reward": 0.1})
    (warned,) = [r.getMessage() for r in caplog.records if "metric_name" in r.getMessage()]
    assert "step 3 saved without validating" in warned
    assert (
        "checkpointing.save_period=3 does not line up with the validation period (grpo.val_period)" in warned
    )
    assert "did you mean" not in warned and "e.g. val/accuracy" not in warned


def test_resume_modes(tmp_path):
    mgr = CheckpointManager(CheckpointingConfig(resume="never"), tmp_path)
    mgr.save(FakePolicy(), 3, {}, {})
    assert mgr.resume_path() is None
    assert CheckpointManager(CheckpointingConfig(resume="auto"), tmp_path / "empty").resume_path() is None
    explicit = CheckpointManager(
        CheckpointingConfig(resume=str(tmp_path / "checkpoints" / "step_3")), tmp_path
    )
    assert explicit.resume_path().name == "step_3"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        CheckpointManager(CheckpointingConfig(resume=str(tmp_path / "nope")), tmp_path).resume_path()
    (tmp_path / "checkpoints" / "step_9").mkdir()  # incomplete (no metadata.json): ignored by auto
    assert CheckpointManager(CheckpointingConfig(), tmp_path).resume_path().name == "step_3"


def test_should_save():
    mgr = CheckpointManager(CheckpointingConfig(save_period=3), "x")
    assert [s for s in range(1, 8) if mgr.should_save(s, last_step=7)] == [3, 6, 7]
    assert not CheckpointManager(CheckpointingConfig(enabled=False), "x").should_save(3, 7)


def test_a_key_the_checkpoint_lacks_is_accepted_only_at_its_default():
    saved = {"grpo": {"seed": 0}}
    current = {"grpo": {"seed": 0, "sample_seeds": "step"}}
    check_resume_config(saved, current, at_default=lambda key: key == "grpo.sample_seeds")
    with pytest.raises(ValueError, match=r"grpo.sample_seeds: checkpoint None, now 'step'"):
        check_resume_config(saved, current)  # nothing says it is a default: refused as before
    with pytest.raises(ValueError, match=r"grpo.seed: checkpoint 0, now 1"):  # present and changed
        check_resume_config(saved, {"grpo": {"seed": 1}}, at_default=lambda key: True)


def test_field_at_default_walks_the_config_sections():
    from posttrain.algorithms.grpo import GRPOConfig
    from posttrain.algorithms.runs import field_at_default

    cfg = GRPOConfig()
    assert field_at_default(cfg, "grpo.sample_seeds") and field_at_default(cfg, "policy.optimizer.lr")
    assert field_at_default(cfg, "policy.scheduler")  # a list, compared whole
    cfg.grpo.sample_seeds = "group"
    assert not field_at_default(cfg, "grpo.sample_seeds")
    assert not field_at_default(cfg, "grpo.no_such_key") and not field_at_default(cfg, "nowhere.lr")


def test_config_mismatch_lists_each_key():
    with pytest.raises(ValueError, match=r"grpo.seed: checkpoint 0, now 1"):
        check_resume_config(
            {"grpo": {"seed": 0, "max_num_steps": 3}},
            {"grpo": {"seed": 1, "max_num_steps": 9}},
            ("grpo.max_num_steps",),
        )
    check_resume_config(
        {"grpo": {"max_num_steps": 3}}, {"grpo": {"max_num_steps": 9}}, ("grpo.max_num_steps",)
    )
