"""Multi-turn trajectories on the real engine and trainer: KV-continued turns give the logprobs the
trainer computes on the whole row, the sampled ids are what is trained, and both loops run
environments end to end (with checkpoints, resume and a killed rollout actor)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from helpers import policy_cfg
from posttrain.envs.base import Environment, EnvLimits, EnvSample, EnvStep
from posttrain.envs.build import EnvSuite
from posttrain.envs.tools import parse_hermes
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig, SamplingParams
from posttrain.logging import read_metrics
from posttrain.policy.model_init import build_tokenizer, load_full_model
from posttrain.policy.policy import Policy
from posttrain.rollout.config import GroupConfig
from posttrain.rollout.rows import samples_to_batch
from posttrain.rollout.trajectory import run_group

CHAT_MODEL = {"name": "tiny", "tokenizer": "tiny-chat", "tiny": {"hidden_size": 32, "intermediate_size": 64}}


class Echo(Environment):
    """Answers every reply with a user message quoting its length, for `max_turns` turns."""

    def reset(self):
        return [{"role": "user", "content": f"start {self.sample.sample_id}"}]

    def step(self, message):
        return EnvStep([{"role": "user", "content": f"got {len(message.token_ids)}"}])


def stops(tokenizer) -> list[int]:
    """Common characters as stop tokens: a random tiny model then ends its turns within a few tokens."""
    return tokenizer.convert_tokens_to_ids(list("aeiost0123"))


def test_continued_turns_match_the_trainers_logprobs_and_train_the_sampled_ids():
    policy = Policy(policy_cfg(model=CHAT_MODEL, train_global_batch_size=8))
    tok = build_tokenizer(policy.cfg.model)
    engine = GenerationEngine(
        load_full_model(policy.cfg.model, tok), tok, GenerationConfig(max_model_len=256)
    )
    engine.load_weights(policy.full_state_dict(), 1)
    calls = []
    agenerate = engine.agenerate

    async def recorded(prompt, params, **kw):
        res = await agenerate(prompt, params, **kw)
        calls.append((list(prompt), list(res.token_ids)))
        return res

    engine.agenerate = recorded
    suite = EnvSuite(
        "echo", None, None, Echo, EnvLimits(max_turns=4, max_tokens=200, max_tokens_per_turn=24), parse_hermes
    )
    sampling = SamplingParams(max_new_tokens=24, stop_token_ids=stops(tok))
    trajs = []
    for sid in range(2):
        trajs += asyncio.run(run_group(engine, tok, suite, EnvSample(sid, {}), 4, sampling, seed=sid))
    assert sum(len(t.turns) for t in trajs) >= 12 and engine.num_reused_tokens > 0
    for t in trajs:  # every turn's prompt is the trajectory so far; every reply is trained as sampled
        for turn in t.turns:
            prompt = t.prompt_token_ids + t.token_ids[: turn.start]
            assert (prompt, t.token_ids[turn.start : turn.end]) in calls
    n = len(trajs)
    batch, _ = samples_to_batch(
        trajs, torch.zeros(n), torch.zeros(n, dtype=torch.bool), torch.arange(n) // 4, GroupConfig(), 0, 8
    )
    trainer = policy.get_logprobs(batch)
    mask = batch["token_mask"].bool()
    assert mask.sum() == sum(sum(t.mask) for t in trajs)
    torch.testing.assert_close(trainer[mask], batch["generation_logprobs"][mask], atol=1e-5, rtol=0)
    policy.shutdown()


# --------------------------------------------------------------------------- both loops


def env_overrides(tok) -> list[str]:
    """The guess environment on the tiny chat model: short turns (common characters stop a turn)."""
    return [
        "policy.model.tokenizer=tiny-chat",
        "env.name=guess",
        "env.num_eval=4",
        "env.limits.max_turns=3",
        "env.limits.max_tokens=96",
        "env.limits.max_tokens_per_turn=8",
        "sampling.max_new_tokens=8",
        f"sampling.stop_token_ids={json.dumps(stops(tok))}",
    ]


def test_sync_grpo_plays_an_environment_checkpoints_and_resumes(tmp_path):
    from helpers import small_grpo_cfg
    from posttrain.algorithms.grpo import run_grpo

    tok = build_tokenizer(_model_cfg())
    out = tmp_path / "run"
    over = env_overrides(tok)
    first = run_grpo(small_grpo_cfg(out, *over, "grpo.max_num_steps=2"))
    assert first["env/turns"] >= 1 and first["env/failed"] == 0
    last = run_grpo(small_grpo_cfg(out, *over, "grpo.max_num_steps=3"))  # resumes from step 2
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert 1 <= r["env/turns"] <= 3 and r["env/sampled_tokens"] > 0 and r["reward"] == r["reward"]
    assert [r["step"] for r in records if "val/turns" in r] == [0, 2] and "env/turns" in last
    assert (out / "curves.png").is_file()


def _model_cfg():
    from posttrain.policy.config import ModelConfig

    return ModelConfig.model_validate(CHAT_MODEL)


def test_async_grpo_plays_an_environment_checkpoints_and_resumes(tmp_path):
    from helpers import small_async_grpo_cfg
    from posttrain.algorithms.async_grpo.run import run_async_grpo

    tok = build_tokenizer(_model_cfg())
    out = tmp_path / "run"
    over = env_overrides(tok)
    first = run_async_grpo(small_async_grpo_cfg(out, *over, "async_grpo.num_steps=2"))
    assert first["summary/steps"] == 2
    last = run_async_grpo(small_async_grpo_cfg(out, *over, "async_grpo.num_steps=3"))
    assert last["summary/steps"] == 3 and last["summary/trainer_version"] == 3
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(1 <= r["env/turns"] <= 3 and r["staleness/max"] <= 1 for r in steps)


@pytest.mark.distributed
def test_killing_a_rollout_actor_mid_trajectory_loses_no_sample(tmp_path, ray_session):
    """Ray rollout actors playing episodes: one is killed while its trajectories are in flight; its
    groups are played again elsewhere and every sample is trained exactly once."""
    from helpers import actor_killer, small_async_grpo_cfg
    from posttrain.algorithms.async_grpo.run import close, setup, train
    from posttrain.logging import MetricsLogger

    ray = ray_session
    tok = build_tokenizer(_model_cfg())
    cfg = small_async_grpo_cfg(
        tmp_path,
        *env_overrides(tok),
        "env.max_number=40",  # 36 training secrets
        "rollout.backend=ray",
        "rollout.num_workers=2",
        "rollout.torch_threads=1",
        "async_grpo.num_steps=null",
        "async_grpo.num_epochs=1",
        "async_grpo.max_staleness=100",
        "async_grpo.max_in_flight_per_worker=2",
        "async_grpo.max_groups_per_call=1",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "checkpointing.enabled=false",
    )
    run = setup(cfg)
    in_flight_at_kill: list[int] = []

    kill_busy_actor = actor_killer(ray, in_flight_at_kill)

    log = MetricsLogger(tmp_path)
    try:
        summary = asyncio.run(asyncio.wait_for(train(run, log, kill_busy_actor), 240))
    finally:
        log.close()
        close(run)
    assert in_flight_at_kill and list(summary.dead_workers) == [0]
    ledger = run.controller.ledger
    ledger.check_settled()
    counts = ledger.counts()
    assert counts["trained"] == sum(counts.values()) == 36 and summary.data_exhausted
    assert all(ledger.ended(g) for g in in_flight_at_kill) and summary.totals["retried"] >= 1


def test_a_steps_episode_metrics_weight_each_draw_by_its_samples_and_sum_the_failures():
    """A step with dynamic-sampling refills scores several draws of different sizes: its means are
    over samples (a draw of 12 counts less than one of 16), its failed episodes a total."""
    from posttrain.rollout.episodes import mean_episode_metrics, mean_metrics

    draws = [
        {"env/turns": 1.625, "env/failed": 1.0},
        {"env/turns": 2.0, "env/failed": 2.0},
        {"env/turns": 2.5},
    ]
    got = mean_episode_metrics(draws, [16, 12, 12])
    assert got["env/turns"] == pytest.approx((1.625 * 16 + 2.0 * 12 + 2.5 * 12) / 40)
    assert got["env/failed"] == 3.0
    assert mean_episode_metrics(draws)["env/turns"] == pytest.approx(
        (1.625 + 2.0 + 2.5) / 3
    )  # groups of one size
    parts = [{"reward/task": 1.0, "other": 5.0}, {"reward/task": 0.0}]
    assert mean_metrics(parts, "reward/", [3, 1]) == {"reward/task": 0.75}
