"""GRPO end to end on CPU: resume exactness, reward failures, bad config."""

from __future__ import annotations

import json
import sys
import textwrap
import types

import pytest
import torch

from helpers import small_grpo_cfg as small_cfg
from posttrain.algorithms.grpo import run_grpo
from posttrain.logging import read_metrics
from posttrain.policy.policy import Policy
from posttrain.tasks.rewards import RewardError

TINY = {"policy": {"model": {"tiny": {"hidden_size": 32, "intermediate_size": 64}}}}


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    full = small_cfg(tmp_path / "full")
    run_grpo(full)
    stopped = small_cfg(tmp_path / "resumed", "grpo.max_num_steps=2")
    run_grpo(stopped)
    resumed = small_cfg(tmp_path / "resumed", "grpo.max_num_steps=4")
    run_grpo(resumed)
    a = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if r["step"] > 2]
    b = [r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if r["step"] > 2]
    keys = ["reward", "train/loss", "train/grad_norm", "completion_length", "train/probs_ratio"]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [3, 4]
    for ra, rb in zip(a, b):
        want = keys + ["val/accuracy"] * (ra["step"] % 2 == 0)  # val_period 2
        missing = [k for k in want if k not in ra or k not in rb]
        assert not missing, (ra["step"], missing)
        assert [ra[k] for k in want] == [rb[k] for k in want], ra["step"]
    ckpt_a = tmp_path / "full" / "checkpoints" / "step_4" / "extra_state.json"
    ckpt_b = tmp_path / "resumed" / "checkpoints" / "step_4" / "extra_state.json"
    assert json.loads(ckpt_a.read_text())["train_data"] == json.loads(ckpt_b.read_text())["train_data"]
    pol_a, pol_b = Policy(full.policy), Policy(full.policy)
    pol_a.load_checkpoint(str(tmp_path / "full" / "checkpoints" / "step_4"))
    pol_b.load_checkpoint(str(tmp_path / "resumed" / "checkpoints" / "step_4"))
    sa, sb = pol_a.full_state_dict(), pol_b.full_state_dict()
    assert sa and sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_resume_refuses_a_changed_loop_config(tmp_path):
    run_grpo(small_cfg(tmp_path, "grpo.max_num_steps=2"))
    with pytest.raises(ValueError, match=r"grpo.num_generations_per_prompt: checkpoint 4, now 2"):
        run_grpo(
            small_cfg(
                tmp_path,
                "grpo.max_num_steps=3",
                "grpo.num_generations_per_prompt=2",
                "policy.train_global_batch_size=8",
                "policy.microbatch.train_micro_batch_size=8",
            )
        )


def test_resume_refuses_a_changed_update_setting_before_loading_anything(tmp_path):
    """The policy settings that shape each update (here the grad-norm clip) must match the checkpoint;
    the refusal comes before any load, so a policy passed in keeps its weights and version. A setting
    of validation alone (task.max_eval_prompts) may change."""
    from helpers import params_of

    run_grpo(small_cfg(tmp_path, "grpo.max_num_steps=2", "policy.optimizer.lr=5e-2"))
    cfg = small_cfg(
        tmp_path, "grpo.max_num_steps=3", "policy.optimizer.lr=5e-2", "policy.max_grad_norm=0.001"
    )
    policy = Policy(cfg.policy)
    before = params_of(policy)
    with pytest.raises(ValueError, match=r"policy.max_grad_norm: checkpoint 1.0, now 0.001"):
        run_grpo(cfg, policy=policy)
    after = params_of(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert policy.get_states()[0]["trainer_version"] == 0
    policy.shutdown()
    run_grpo(
        small_cfg(tmp_path, "grpo.max_num_steps=3", "policy.optimizer.lr=5e-2", "task.max_eval_prompts=4")
    )
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3]


def test_resume_accepts_a_checkpoint_that_did_not_record_the_update_settings(tmp_path, monkeypatch):
    """Checkpoints written before the update settings were compared lack them: resumed whatever they
    are now (their run's values are unknown), here with a batch size that is not the default."""
    from posttrain.algorithms import grpo

    view = grpo._resume_view

    def older(cfg):
        out = view(cfg)
        out["policy"] = {k: out["policy"][k] for k in ("optimizer", "scheduler")}
        return out

    monkeypatch.setattr(grpo, "_resume_view", older)
    run_grpo(small_cfg(tmp_path, "grpo.max_num_steps=2"))
    monkeypatch.setattr(grpo, "_resume_view", view)
    run_grpo(small_cfg(tmp_path, "grpo.max_num_steps=3"))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3]


def test_resume_accepts_a_checkpoint_written_before_a_setting_existed(tmp_path, monkeypatch):
    """A checkpoint whose config lacks a setting added since (here grpo.sample_seeds, as one written
    before it existed) resumes when the setting is at its default, which keeps the behaviour the
    checkpoint was written with; set to anything else, the resume is refused, naming the key."""
    from posttrain.algorithms import grpo

    view = grpo._resume_view

    def older(cfg):
        out = view(cfg)
        out["grpo"] = {k: v for k, v in out["grpo"].items() if k != "sample_seeds"}
        return out

    monkeypatch.setattr(grpo, "_resume_view", older)
    run_grpo(small_cfg(tmp_path, "grpo.max_num_steps=2"))
    monkeypatch.setattr(grpo, "_resume_view", view)
    with pytest.raises(ValueError, match=r"grpo.sample_seeds: checkpoint None, now 'group'"):
        run_grpo(small_cfg(tmp_path, "grpo.max_num_steps=3", "grpo.sample_seeds=group"))
    run_grpo(small_cfg(tmp_path, "grpo.max_num_steps=3"))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3]


def test_resume_refuses_changed_dropout_and_accepts_an_older_checkpoint_at_the_default(tmp_path, monkeypatch):
    """Dropout shapes each update: a resume with another policy.lora.dropout or policy.model.disable_dropout
    is refused, naming the key. A checkpoint written before they were compared resumes with whatever its
    run sets (as other keys recorded later: runs._RECORDED_SINCE)."""
    from posttrain.algorithms import grpo

    lora = ("policy.lora.rank=4", "policy.lora.alpha=8")
    run_grpo(small_cfg(tmp_path / "a", "grpo.max_num_steps=1", *lora))
    with pytest.raises(ValueError, match=r"policy.lora.dropout: checkpoint 0.0, now 0.1"):
        run_grpo(small_cfg(tmp_path / "a", "grpo.max_num_steps=2", *lora, "policy.lora.dropout=0.1"))
    with pytest.raises(ValueError, match=r"policy.model.disable_dropout: checkpoint True, now False"):
        run_grpo(
            small_cfg(tmp_path / "a", "grpo.max_num_steps=2", *lora, "policy.model.disable_dropout=false")
        )

    view = grpo._resume_view

    def older(cfg):
        out = view(cfg)
        out["policy"] = {k: v for k, v in out["policy"].items() if k not in ("model", "lora")}
        return out

    monkeypatch.setattr(grpo, "_resume_view", older)
    dropout = (*lora, "policy.lora.dropout=0.1", "policy.model.disable_dropout=false")
    run_grpo(small_cfg(tmp_path / "b", "grpo.max_num_steps=1", *dropout))
    monkeypatch.setattr(grpo, "_resume_view", view)
    # it cannot tell what it was trained with: its run resumes with its own non-default settings
    run_grpo(small_cfg(tmp_path / "b", "grpo.max_num_steps=2", *dropout))
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "train/loss" in r] == [1, 2]


def test_a_lora_checkpoint_is_not_resumed_as_a_full_run_with_a_changed_setting(tmp_path):
    """A LoRA checkpoint in a full run: the refusal names the way across (not a changed policy.lora)."""
    run_grpo(small_cfg(tmp_path, "grpo.max_num_steps=1", "policy.lora.rank=4", "policy.lora.alpha=8"))
    with pytest.raises(ValueError, match="holds LoRA adapters .* set the same policy.lora to resume it"):
        run_grpo(small_cfg(tmp_path, "grpo.max_num_steps=2"))


@pytest.fixture
def flaky_reward_module(tmp_path, monkeypatch):
    """A reward module that raises for prompts with an even answer and scores the rest by length + 1;
    every list of rewards it returns is appended to `<tmp_path>/scored.jsonl`."""
    mod = tmp_path / "flaky_reward.py"
    mod.write_text(
        textwrap.dedent(
            f"""
            import json

            def reward(prompts, completions, metadata):
                out = []
                for c, m in zip(completions, metadata):
                    if int(m["answer"]) % 2 == 0:
                        raise RuntimeError("reward server down for " + c)
                    out.append(float(len(c)) + 1.0)
                with open({str(tmp_path / "scored.jsonl")!r}, "a") as f:
                    f.write(json.dumps(out) + "\\n")
                return out

            def always_fails(prompts, completions, metadata):
                raise RuntimeError("broken reward")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "flaky_reward"
    sys.modules.pop("flaky_reward", None)


def test_failed_rewards_are_counted_not_zeroed(tmp_path, flaky_reward_module):
    cfg = small_cfg(
        tmp_path,
        f"task.reward_fn={flaky_reward_module}:reward",
        "grpo.max_num_steps=2",
        "checkpointing.enabled=false",
        "task.reward.max_failed_fraction=1.0",
        "grpo.val_period=0",  # no validation: every scored sample below is a training sample
        "grpo.val_at_start=false",
    )
    run_grpo(cfg)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0 and "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["reward_failed"] for r in steps) > 0
    # the rewards of the scored samples in order: one step's 16 samples are scored in one call (split
    # into one call per sample when it raised), so each step takes the next 16 - failed of them
    scored = [x for line in (tmp_path / "scored.jsonl").read_text().splitlines() for x in json.loads(line)]
    for r in steps:
        n_ok = 16 - int(r["reward_failed"])
        ok, scored = scored[:n_ok], scored[n_ok:]
        assert len(ok) == n_ok > 0, r
        # the mean over the scored samples only: a failed sample entered as 0 would lower it
        assert r["reward"] == pytest.approx(sum(ok) / n_ok), (r, ok)
        assert r["train/num_valid_samples"] == n_ok
    assert scored == []


def test_reward_errors_stop_the_run_when_configured(tmp_path, flaky_reward_module):
    cfg = small_cfg(
        tmp_path, f"task.reward_fn={flaky_reward_module}:always_fails", "task.reward.on_reward_error=raise"
    )
    with pytest.raises(RewardError):
        run_grpo(cfg)


def test_unknown_reward_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no_such_module"):
        run_grpo(small_cfg(tmp_path, "task.reward_fn=no_such_module:reward"))


def test_generation_time_leaves_out_the_reward_time(tmp_path, monkeypatch):
    """timing/generation_s and timing/reward_s are separate phases: a clock that moves only while the
    rewards are scored puts all of the step's time in timing/reward_s."""
    from posttrain.algorithms import grpo as grpo_module

    now = [0.0]
    real_score = grpo_module.score

    def slow_score(*args, **kwargs):
        now[0] += 5.0
        return real_score(*args, **kwargs)

    monkeypatch.setattr(grpo_module, "score", slow_score)
    monkeypatch.setattr(grpo_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    cfg = small_cfg(
        tmp_path,
        "grpo.max_num_steps=1",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "checkpointing.enabled=false",
    )
    run_grpo(cfg)
    (row,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] == 1]
    assert (row["timing/reward_s"], row["timing/generation_s"], row["step_time_s"]) == (5.0, 0.0, 5.0)


def train_records_by(tmp_path, key: str, values, *overrides) -> dict[str, list[dict]]:
    """One short run per value of `key` (no validation); each run's per-step training records."""
    runs = {}
    for value in values:
        out = tmp_path / value
        run_grpo(small_cfg(out, f"{key}={value}", "grpo.val_period=0", "grpo.val_at_start=false", *overrides))
        runs[value] = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    return runs


def test_skipping_the_on_policy_prev_logprob_pass_does_not_change_training(tmp_path):
    """With one optimizer step per batch the PPO ratio is 1 by construction: skipping the extra trainer
    forward (recompute_prev_logprobs=auto) trains exactly like computing it (always)."""
    runs = train_records_by(
        tmp_path,
        "grpo.recompute_prev_logprobs",
        ("auto", "always"),
        "grpo.max_num_steps=2",
        "checkpointing.save_period=2",
    )
    for a, b in zip(runs["auto"], runs["always"]):
        assert a["reward"] == b["reward"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5, abs=1e-7)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="colocated on a GPU the trainer is offloaded during generation, so the engine keeps its own copy",
)
def test_engine_sharing_the_trainer_weights_trains_like_copying_them(tmp_path):
    """On one CPU process the engine aliases the trainer's tensors (no bytes copied per sync, probe
    checked when the aliasing is set up); the run is the same as one that copies the weights at every
    sync."""
    runs = train_records_by(
        tmp_path,
        "weight_sync.share",
        ("auto", "never"),
        "grpo.max_num_steps=3",
        "checkpointing.enabled=false",
    )
    assert all(r["weight_sync/bytes"] == 0 for r in runs["auto"])
    assert all(r["weight_sync/bytes"] > 0 for r in runs["never"])
    # the set-up sync probed the aliasing; the steps' syncs re-point nothing, so they skip the probe
    assert all(r["weight_sync/probe_skipped"] == 1.0 for r in runs["auto"])
    for a, b in zip(runs["auto"], runs["never"], strict=True):
        assert b["weight_sync/probe_max_abs_diff"] < 1e-5
        assert (a["reward"], a["train/loss"], a["train/grad_norm"]) == (
            b["reward"],
            b["train/loss"],
            b["train/grad_norm"],
        )


def test_a_prompt_drawn_twice_in_a_step_makes_two_groups(tmp_path):
    """An epoch that ends inside a step (or a refill) can draw one prompt twice: each draw is its own
    group with its own baseline, as in the asynchronous loop; pooling them by prompt id would give the
    second, all-correct group advantages from the first one's misses."""
    from posttrain.algorithms import grpo

    run = grpo.setup(small_cfg(tmp_path, "colocated=false"), None)
    ro = grpo.generate(run)
    items = [ro.items[0], ro.items[0], *ro.items[2:]]  # the first prompt drawn twice
    rewards = torch.tensor([1.0, 0.0] * 2 + [1.0] * 4 + [1.0, 0.0] * 2 + [0.0, 1.0] * 2)
    failed = torch.zeros(len(rewards), dtype=torch.bool)
    batch, _ = grpo.build_batch(run, grpo.Rollouts(items, ro.results, rewards, failed))
    adv = batch["advantages"].sum(1) / batch["token_mask"].sum(1)  # one value per completion
    assert adv[4:8].abs().max() == 0  # the all-correct draw: no signal
    assert (adv[0:4].sign() == torch.tensor([1.0, -1.0, 1.0, -1.0])).all()
    torch.testing.assert_close(adv[0:4], adv[8:12])  # same rewards, same advantages as a lone group
    run.policy.shutdown()


def test_group_seeds_give_a_prompt_drawn_twice_in_a_step_new_samples(tmp_path):
    """With one seed per group (`grpo.sample_seeds=group`, the asynchronous loop's way), a prompt drawn
    twice at the same weights must not draw the same completions twice: its second group is seeded by
    its repeat. Three training prompts, four per step: every step holds a prompt twice."""
    from posttrain.algorithms import grpo

    cfg = small_cfg(
        tmp_path,
        "colocated=false",
        "grpo.sample_seeds=group",
        "task.operations=['+']",
        "task.max_operand=1",
        "task.eval_fraction=0.25",
    )
    run = grpo.setup(cfg, None)
    assert len(run.task.train.items) == 3
    g = cfg.grpo.num_generations_per_prompt
    ro = grpo.generate(run)
    ids = [it.prompt_id for it in ro.items]
    twice = [p for p in set(ids) if ids.count(p) == 2]
    assert len(twice) == 1 and sorted(it.repeat for it in ro.items if it.prompt_id == twice[0]) == [0, 1]
    first, second = [i for i, p in enumerate(ids) if p == twice[0]]
    groups = [[r.token_ids for r in ro.results[j * g : (j + 1) * g]] for j in (first, second)]
    assert groups[0] != groups[1]
    run.policy.shutdown()


def test_after_a_step_that_trains_nothing_a_prompt_drawn_again_draws_new_samples(tmp_path, monkeypatch):
    """Every group flat and dropped (dynamic sampling, no refills): the step trains nothing and the
    weights keep their version, so the next step draws at the same weights. Under group seeds its draws
    of the same prompts count on from the last step's (one counter per run, saved in checkpoints): new
    samples, and a run resumed after the empty step draws what the uninterrupted run drew."""
    from posttrain.algorithms import grpo

    (tmp_path / "flat_reward.py").write_text(
        "def reward(prompts, completions, metadata):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    drawn: dict[str, list] = {}
    sample = grpo.sample_groups

    def spy(run, items, salt):
        results = sample(run, items, salt)
        g = run.cfg.grpo.num_generations_per_prompt
        for j, it in enumerate(items):
            groups = tuple(tuple(r.token_ids) for r in results[j * g : (j + 1) * g])
            drawn[run.cfg.output_dir].append((run.step, run.engine.weight_version, it.prompt_id, groups))
        return results

    monkeypatch.setattr(grpo, "sample_groups", spy)

    def cfg(out, steps):
        drawn.setdefault(str(out), [])
        return small_cfg(
            out,
            "colocated=false",
            "grpo.sample_seeds=group",
            "task.operations=['+']",
            "task.max_operand=1",
            "task.eval_fraction=0.25",
            "task.reward_fn=flat_reward:reward",
            "grpo.dynamic_sampling=true",
            "grpo.dynamic_sampling_max_refills=0",
            f"grpo.max_num_steps={steps}",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "checkpointing.save_period=1",
        )

    run_grpo(cfg(tmp_path / "full", 2))
    full = drawn[str(tmp_path / "full")]
    assert {(s, v) for s, v, _, _ in full} == {(1, 0), (2, 0)}  # both steps at the first weights
    for s2, _, p2, g2 in full:
        if s2 == 2:
            assert all(g1 != g2 for s1, _, p1, g1 in full if s1 == 1 and p1 == p2), p2
    run_grpo(cfg(tmp_path / "resumed", 1))
    run_grpo(cfg(tmp_path / "resumed", 2))
    resumed = [d for d in drawn[str(tmp_path / "resumed")] if d[0] == 2]
    assert resumed == [d for d in full if d[0] == 2]


def test_a_run_ended_by_its_epoch_limit_saves_its_last_step_and_resumes_without_a_false_warning(
    tmp_path, caplog
):
    cfg = small_cfg(
        tmp_path,
        "task.operations=['+']",
        "task.max_operand=2",
        "task.eval_fraction=0.25",
        "grpo.max_num_steps=1000",
        "grpo.max_num_epochs=1",
        "checkpointing.save_period=5",
        "grpo.val_period=0",
    )
    run_grpo(cfg)
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert steps and steps[-1] < 5  # the data ran out before the first periodic save
    assert (tmp_path / "checkpoints" / f"step_{steps[-1]}" / "metadata.json").is_file()
    with caplog.at_level("WARNING"):
        run_grpo(cfg)  # resume=auto: nothing left to train; the history is kept, and not said to be replaced
    assert "no checkpoint to resume from" not in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == steps


def test_a_resume_onto_another_dataset_is_refused_before_the_policy_loads(tmp_path, monkeypatch):
    """The data file changed under the same config: the checkpoint's data position belongs to another
    dataset. Refused, and a policy passed in keeps its weights (the check runs before any load)."""
    from helpers import params_of

    data = tmp_path / "problems.jsonl"
    (tmp_path / "exact_reward.py").write_text(
        "def reward(prompts, completions, metadata):\n"
        "    return [float(c.strip() == m['answer']) for c, m in zip(completions, metadata)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(offset):
        rows = [json.dumps({"problem": f"{a}+{offset}=", "answer": str(a + offset)}) for a in range(12)]
        data.write_text("\n".join(rows) + "\n")

    def cfg(steps):
        from posttrain.algorithms.grpo import GRPOConfig
        from posttrain.config import build_config

        plain = small_cfg(tmp_path / "run", f"grpo.max_num_steps={steps}", "grpo.val_period=0")
        section = {"name": "custom", "dataset": {"train_path": str(data), "eval_fraction": 0.25}}
        section["reward_fn"] = "exact_reward:reward"
        return build_config(GRPOConfig, plain.model_dump(mode="json") | {"task": section})

    write(1)
    run_grpo(cfg(2))
    write(2)
    resumed = cfg(3)
    policy = Policy(resumed.policy)
    before = params_of(policy)
    with pytest.raises(ValueError, match="data position was saved with fingerprint"):
        run_grpo(resumed, policy=policy)
    after = params_of(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert policy.get_states()[0]["trainer_version"] == 0  # the checkpoint's (2) never loaded
    policy.shutdown()
