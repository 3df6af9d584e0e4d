"""Config loading: YAML + dotted overrides, errors that name the key, allowed values and nearest key."""

from __future__ import annotations

import pytest

from posttrain.config import ConfigError, load_config
from posttrain.policy.config import PolicyConfig


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lr: 1.0e-3\nmicrobatch:\n  mode: packed\n")
    cfg = load_config(
        PolicyConfig, path, ["optimizer.lr=1e-4", "max_grad_norm=0.5", "microbatch.max_tokens=512"]
    )
    assert cfg.optimizer.lr == 1e-4
    assert cfg.max_grad_norm == 0.5
    assert cfg.microbatch.mode == "packed" and cfg.microbatch.max_tokens == 512


def test_unknown_key_suggests_nearest():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'optimizer.lrr'. Did you mean 'optimizer.lr'\?"
    ):
        load_config(PolicyConfig, None, ["optimizer.lrr=1"])


def test_bad_literal_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"microbatch.mode.*Allowed values: 'fixed', 'dynamic', 'packed'"):
        load_config(PolicyConfig, None, ["microbatch.mode=pack"])


def test_bad_number_is_named():
    with pytest.raises(ConfigError, match=r"bad value for 'optimizer.lr'.*greater than 0"):
        load_config(PolicyConfig, None, ["optimizer.lr=-1"])


def test_override_without_equals_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no '='"):
        load_config(PolicyConfig, None, ["optimizer.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(PolicyConfig, tmp_path / "nope.yaml")


def test_task_union_keys_are_checked_against_the_chosen_task():
    from posttrain.algorithms.sft import SFTConfig

    assert load_config(SFTConfig, None, ["task.max_operand=3"]).task.max_operand == 3
    with pytest.raises(
        ConfigError, match=r"unknown config key 'task.max_operandd'. Did you mean 'task.max_operand'"
    ):
        load_config(SFTConfig, None, ["task.max_operandd=3"])
    with pytest.raises(ConfigError, match="'arithmetic', 'chain', 'math', 'custom'"):
        load_config(SFTConfig, None, ["task.name=arith"])


def test_rl_runs_score_at_the_sampling_temperature_and_sft_dpo_at_one():
    """An unset policy.logprob_temperature follows sampling.temperature in every RL run (the trainer's
    ratios and KL then compare the distribution sampled); one written otherwise is refused, as is a
    tempered SFT or DPO run."""
    from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
    from posttrain.algorithms.dpo import DPORunConfig
    from posttrain.algorithms.grpo import GRPOConfig
    from posttrain.algorithms.ppo import PPOConfig
    from posttrain.algorithms.sft import SFTConfig

    for cls in (GRPOConfig, AsyncGRPORunConfig, PPOConfig):
        cfg = load_config(cls, None, ["sampling.temperature=0.6"])
        assert cfg.policy.scoring_temperature == 0.6 and cfg.policy.logprob_temperature is None
        again = cls.model_validate(cfg.model_dump())  # a saved config.yaml follows the sampling again
        assert again.policy.scoring_temperature == 0.6
        assert load_config(cls, None, []).policy.scoring_temperature == 1.0
        same = ["sampling.temperature=0.6", "policy.logprob_temperature=0.6"]
        assert load_config(cls, None, same).policy.scoring_temperature == 0.6
        with pytest.raises(ConfigError, match="policy.logprob_temperature=1.0 but sampling.temperature=0.6"):
            load_config(cls, None, ["sampling.temperature=0.6", "policy.logprob_temperature=1.0"])
    for cls, run in ((SFTConfig, "SFT"), (DPORunConfig, "DPO")):
        with pytest.raises(ConfigError, match=f"logprob_temperature=0.7: {run} trains the model's own"):
            load_config(cls, None, ["policy.logprob_temperature=0.7"])


def test_a_kl_to_the_reference_without_one_is_refused_at_load():
    """A KL term needs reference logprobs: refused at load (it failed at the first step's logprobs, after
    a demo's whole SFT stage), naming the key of each run kind."""
    from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
    from posttrain.algorithms.demo import DemoConfig
    from posttrain.algorithms.grpo import GRPOConfig

    no_ref = "policy.init_reference_model=false"
    cases = [
        (GRPOConfig, [no_ref, "loss.reference_policy_kl_penalty=0.01"], "loss.reference_policy_kl_penalty"),
        (
            AsyncGRPORunConfig,
            [no_ref, "async_grpo.loss.reference_policy_kl_penalty=0.01"],
            "async_grpo.loss.reference_policy_kl_penalty",
        ),
        (DemoConfig, ["grpo." + no_ref, "grpo.loss.reference_policy_kl_penalty=0.01"], "needs the reference"),
    ]
    for cls, overrides, key in cases:
        with pytest.raises(ConfigError, match=f"{key}.*set policy.init_reference_model=true"):
            load_config(cls, None, overrides)
    load_config(GRPOConfig, None, [no_ref])  # no KL term: no reference needed


def test_an_overlong_buffer_as_long_as_the_completions_is_refused_at_load():
    """DAPO shaping penalises the last overlong_buffer_length tokens before max_new_tokens: a buffer at
    least that long took reward off every sample, a 2-token answer stopped on EOS included."""
    from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
    from posttrain.algorithms.demo import DemoConfig
    from posttrain.algorithms.grpo import GRPOConfig
    from posttrain.algorithms.ppo import PPOConfig

    shaping = ["grpo.overlong_reward_shaping=true", "sampling.max_new_tokens=8"]
    message = r"grpo.overlong_buffer_length=(8|32) is not below sampling.max_new_tokens=8.*at most 7"
    for cls, prefix in ((GRPOConfig, ""), (AsyncGRPORunConfig, ""), (PPOConfig, ""), (DemoConfig, "grpo.")):
        for buffer in (8, 32):
            overrides = [prefix + o for o in [*shaping, f"grpo.overlong_buffer_length={buffer}"]]
            with pytest.raises(ConfigError, match=message):
                load_config(cls, None, overrides)
        ok = load_config(cls, None, [prefix + o for o in [*shaping, "grpo.overlong_buffer_length=7"]])
        assert (ok.grpo.grpo if prefix else ok.grpo).overlong_buffer_length == 7
    unused = load_config(GRPOConfig, None, ["sampling.max_new_tokens=8", "grpo.overlong_buffer_length=32"])
    assert not unused.grpo.overlong_reward_shaping  # no shaping, no penalty: accepted
