"""Config loading: YAML + dotted overrides, errors that name the key, allowed values and nearest key."""

from __future__ import annotations

import re

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


def test_a_plain_sections_name_keeps_its_other_keys(tmp_path):
    """`policy.optimizer.name` is a plain key: the optimizer's other keys keep the command's values (the
    demo's, a file's), not the class defaults (lr 1e-5)."""
    from posttrain.algorithms.demo import DemoConfig
    from posttrain.algorithms.grpo import GRPOConfig

    adam = "torch.optim.Adam"
    cfg = load_config(DemoConfig, None, [f"sft.policy.optimizer.name={adam}"])
    assert cfg.sft.policy.optimizer.name == adam and cfg.sft.policy.optimizer.lr == 3e-3
    path = tmp_path / "c.yaml"
    path.write_text("policy:\n  optimizer: {lr: 3.0e-4, weight_decay: 0.1}\n")
    cfg = load_config(GRPOConfig, path, [f"policy.optimizer.name={adam}"])
    assert (cfg.policy.optimizer.lr, cfg.policy.optimizer.weight_decay) == (3e-4, 0.1)
    path.write_text(f"policy:\n  optimizer: {{name: {adam}}}\n")
    assert load_config(GRPOConfig, path).policy.optimizer.lr == GRPOConfig().policy.optimizer.lr


def test_another_kind_replaces_a_union_section_of_a_file(tmp_path):
    """A task's or an environment's `name` picks another kind: the file's keys of the old kind are
    dropped (not merged into the new kind, where they are unknown keys), whatever the overrides' order;
    without `name` an override merges into the file's section."""
    from posttrain.algorithms.demo import DemoConfig
    from posttrain.algorithms.sft import SFTConfig
    from posttrain.envs.guess import GuessEnvConfig

    path = tmp_path / "demo.yaml"
    path.write_text("sft:\n  env: {name: calculator, num_train: 50, direct_answer_fraction: 0.6}\n")
    for overrides in (["sft.env.name=guess"], ["sft.env.limits.max_turns=3", "sft.env.name=guess"]):
        env = load_config(DemoConfig, path, overrides).sft.env
        assert isinstance(env, GuessEnvConfig), overrides
    assert env.limits.max_turns == 3
    env = load_config(DemoConfig, path, ["sft.env.num_train=30"]).sft.env
    assert (env.name, env.num_train, env.direct_answer_fraction) == ("calculator", 30, 0.6)
    path.write_text("task: {max_operand: 5}\n")  # no name: the default kind (arithmetic)
    assert load_config(SFTConfig, path, ["task.name=chain"]).task.name == "chain"
    assert load_config(SFTConfig, path, ["task.name=arithmetic"]).task.max_operand == 5


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("runs/exp #3", "runs/exp #3"),  # ' #' started a YAML comment: the value was cut to 'runs/exp'
        ("Give the answer after #### on the last line", "Give the answer after #### on the last line"),
        ("Reply in the form Answer: <n>", "Reply in the form Answer: <n>"),  # was a mapping
        ("- a", "- a"),  # was a list
        ("'a #b'", "a #b"),  # quotes still make a string
        ("3", 3),
        ("[a, 'b #c']", ["a", "b #c"]),
        ("{x: 1}", {"x": 1}),
    ],
)
def test_an_override_value_is_kept_as_written_where_yaml_would_cut_or_reshape_it(value, expected):
    from posttrain.config import apply_overrides

    assert apply_overrides({}, [f"x={value}"])["x"] == expected


def test_yaml_1_2_scalars_in_files_and_overrides(tmp_path):
    """`off` is the string 'off' (a documented value of policy.moe.routing_replay; YAML 1.1: False),
    `0123` is 123 (YAML 1.1: octal 83), `1e-8` a float (YAML 1.1: a string, which reached the optimizer
    through policy.optimizer.kwargs), true/false in any case are booleans."""
    from posttrain.algorithms.grpo import GRPOConfig

    path = tmp_path / "c.yaml"
    path.write_text(
        "policy:\n  moe: {routing_replay: off}\n  optimizer: {kwargs: {eps: 1e-8, amsgrad: TRUE}}\n"
        "grpo: {seed: 0123}\n"
    )
    cfg = load_config(GRPOConfig, path)
    assert cfg.policy.moe.routing_replay == "off" and cfg.grpo.seed == 123
    assert cfg.policy.optimizer.kwargs == {"eps": 1e-8, "amsgrad": True}
    assert isinstance(cfg.policy.optimizer.kwargs["eps"], float)
    over = ["policy.moe.routing_replay=off", "grpo.seed=0123", "policy.optimizer.kwargs={eps: 1e-8}"]
    cfg = load_config(GRPOConfig, None, over)
    assert cfg.policy.moe.routing_replay == "off" and cfg.grpo.seed == 123
    assert cfg.policy.optimizer.kwargs == {"eps": 1e-8}
    assert load_config(GRPOConfig, None, ["grpo.seed=0x10"]).grpo.seed == 16


@pytest.mark.parametrize("spelling", ["None", "null", "~"])
def test_none_null_and_tilde_are_none(spelling):
    """The descriptions say 'None = no clip': `KEY=None` was the string 'None' (refused for a number,
    a directory named None for a path)."""
    from posttrain.algorithms.grpo import GRPOConfig

    over = [f"policy.max_grad_norm={spelling}", f"checkpointing.checkpoint_dir={spelling}"]
    cfg = load_config(GRPOConfig, None, over)
    assert cfg.policy.max_grad_norm is None and cfg.checkpointing.checkpoint_dir is None
    quoted = load_config(GRPOConfig, None, ["checkpointing.checkpoint_dir='None'"])
    assert quoted.checkpointing.checkpoint_dir == "None"


def test_a_dumped_config_reads_back_as_written():
    """config.yaml (dump_config) quotes a string that a loader would read as another type, for this
    loader and for PyYAML's YAML 1.1 one."""
    import yaml

    from posttrain.algorithms.grpo import GRPOConfig
    from posttrain.config import YamlLoader, dump_config

    strings = ["off", "0123", "1e-8", "None", "yes"]
    cfg = load_config(GRPOConfig, None, [f"sampling.stop_strings={strings}"])
    assert cfg.sampling.stop_strings == strings
    text = dump_config(cfg)
    for loader in (YamlLoader, yaml.SafeLoader):
        assert yaml.load(text, Loader=loader)["sampling"]["stop_strings"] == strings


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (
            "policy.scheduler=[{kind: linear}]",
            "bad value for 'policy.scheduler.0': a 'linear' scheduler stage",
        ),
        ("policy.scheduler=[{kind: constant}, {kind: cosine, steps: 9}]", "stage 0 has steps: 0"),
        ("policy.optimizer.name=torch.optim.AdamWW", "cannot import 'torch.optim.AdamWW'"),
        ("policy.optimizer.name=torch.nn.Linear", "is not a torch.optim.Optimizer subclass"),
    ],
)
def test_a_schedule_or_optimizer_the_policy_cannot_build_is_refused_at_load(override, says):
    """Checked by the config, not when the policy builds them (after the model: the demo trained its
    whole SFT stage first)."""
    from posttrain.algorithms.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(GRPOConfig, None, [override])


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


def test_checkpoints_recorded_before_the_temperature_tie_resume():
    """A distillation or PPO checkpoint written before the tie recorded its teacher's or critic's
    logprob_temperature as 1.0 (the old default); the resume view records the value a policy scores
    at, so such a checkpoint resumes where nothing changed."""
    import copy

    from posttrain.algorithms.checkpointing import check_resume_config
    from posttrain.algorithms.distill import DistillConfig
    from posttrain.algorithms.grpo import RESUME_MAY_CHANGE, _resume_view
    from posttrain.algorithms.ppo import PPOConfig
    from posttrain.algorithms.runs import field_at_default

    for cls, overrides, (section, key) in (
        (DistillConfig, [], ("distill", "teacher")),
        (PPOConfig, ["ppo.critic.model.head=score"], ("ppo", "critic")),
    ):
        cfg = load_config(cls, None, overrides)
        view = _resume_view(cfg)
        saved = copy.deepcopy(view)
        saved[section][key]["logprob_temperature"] = 1.0
        check_resume_config(saved, view, RESUME_MAY_CHANGE, lambda k, cfg=cfg: field_at_default(cfg, k))


def test_an_older_async_config_yaml_with_every_key_loads():
    """An older version's config.yaml of a grpo-async run lists every key, the unused ones at their
    defaults: it loads; an unused key written at another value is refused."""
    from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
    from posttrain.config import build_config

    written = AsyncGRPORunConfig().model_dump(mode="json")
    assert written["grpo"]["max_num_steps"] == 50
    build_config(AsyncGRPORunConfig, written)
    written["grpo"]["max_num_steps"] = 7
    with pytest.raises(ConfigError, match="'grpo.max_num_steps' cannot be set"):
        build_config(AsyncGRPORunConfig, written)


def test_the_demos_grpo_stage_is_checked_on_the_environment_it_runs():
    """The demo's GRPO stage runs sft.env: its checks (routing replay with an environment) apply at load,
    before the SFT stage trains."""
    from posttrain.algorithms.demo import DemoConfig

    with pytest.raises(ConfigError, match=r"GRPO stage .*env \(calculator\) with policy.moe.routing_replay"):
        load_config(DemoConfig, None, ["grpo.policy.moe.routing_replay=rollout", "sft.env.name=calculator"])


def test_a_run_refuses_a_temperature_changed_after_the_config_was_built(tmp_path):
    """The tie is made when the config is built; a field changed later, or a policy built for another
    temperature passed in, is refused before the run starts anything."""
    from types import SimpleNamespace

    from posttrain.algorithms.grpo import GRPOConfig, setup

    cfg = load_config(GRPOConfig, None, [f"output_dir={tmp_path}"])
    cfg.sampling.temperature = 0.5
    with pytest.raises(
        ValueError, match=r"policy scores tokens at temperature 1.0 but sampling.temperature=0.5"
    ):
        setup(cfg, None)
    cfg = load_config(GRPOConfig, None, [f"output_dir={tmp_path}", "sampling.temperature=0.5"])
    other = SimpleNamespace(cfg=PolicyConfig())
    with pytest.raises(ValueError, match="the policy passed in scores tokens at temperature 1.0"):
        setup(cfg, other)
    assert not any(tmp_path.iterdir())


def test_mapping_overrides_merge_with_earlier_ones():
    """`a.b=X a={c: Y}` keeps X, as `a={c: Y} a.b=X` does; the file's other keys stay."""
    from posttrain.algorithms.grpo import GRPOConfig

    for overrides in (
        ["policy.optimizer.weight_decay=0.5", "policy.optimizer={name: torch.optim.Adam}"],
        ["policy.optimizer={name: torch.optim.Adam}", "policy.optimizer.weight_decay=0.5"],
    ):
        opt = load_config(GRPOConfig, None, ["policy.optimizer.lr=3e-4", *overrides]).policy.optimizer
        assert (opt.name, opt.weight_decay, opt.lr) == ("torch.optim.Adam", 0.5, 3e-4)
