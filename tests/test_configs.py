"""Every example config in configs/ validates (keys and values), so the README's commands work."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers import logging_packages_found
from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
from posttrain.algorithms.demo import DemoConfig, run_demo
from posttrain.algorithms.distill import DistillConfig
from posttrain.algorithms.dpo import DPORunConfig
from posttrain.algorithms.grpo import GRPOConfig
from posttrain.algorithms.ppo import PPOConfig
from posttrain.algorithms.rm import RMRunConfig
from posttrain.algorithms.sft import SFTConfig
from posttrain.config import load_config

CONFIGS = Path(__file__).parent.parent / "configs"


def mismatches(written, loaded, path: str = "") -> list[str]:
    """Where the validated config (`loaded`, as JSON data) does not hold what the file says (`written`)."""
    if isinstance(written, dict) and isinstance(loaded, dict):
        out = []
        for k, v in written.items():
            where = f"{path}.{k}" if path else k
            out += mismatches(v, loaded[k], where) if k in loaded else [f"{where}: not loaded"]
        return out
    if isinstance(written, list) and isinstance(loaded, list) and len(written) == len(loaded):
        return [
            m for i, (w, lo) in enumerate(zip(written, loaded)) for m in mismatches(w, lo, f"{path}[{i}]")
        ]
    return [] if written == loaded else [f"{path}: {written!r} in the file, {loaded!r} loaded"]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_config_validates(path):
    cls = (
        SFTConfig
        if path.name.startswith("sft")
        else DemoConfig
        if path.name.startswith("demo") or path.name == "grpo_arithmetic_moe.yaml"
        else RMRunConfig
        if path.name.startswith("rm")
        else AsyncGRPORunConfig
        if path.name.startswith("grpo_async")
        else DPORunConfig
        if path.name.startswith("dpo")
        else DistillConfig
        if path.name.startswith("distill")
        else PPOConfig
        if path.name.startswith("ppo")
        else GRPOConfig
    )
    with logging_packages_found():  # a config may ask for TensorBoard, not installed here
        cfg = load_config(cls, path)
    written = yaml.safe_load(path.read_text())
    assert written, path
    # every value the file sets is the one the run gets (none dropped, renamed or coerced)
    bad = mismatches(written, cfg.model_dump(mode="json"))
    assert not bad, bad


def test_readme_parallel_example_validates():
    """The README's tensor-parallel command line: 8 ranks as dp=4 x tp=2."""
    overrides = [
        "policy.cluster.backend=ray",
        "policy.cluster.num_workers=8",
        "policy.cluster.num_gpus_per_worker=1",
        "policy.parallel.tensor_parallel_size=2",
        "policy.parallel.sequence_parallel=true",
    ]
    with logging_packages_found():
        cfg = load_config(GRPOConfig, CONFIGS / "grpo_qwen2.5_math_gpu.yaml", overrides)
    assert cfg.policy.dp_size == 4


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("grpo.num_prompts_per_step=4", "async_grpo.target_prompt_groups_per_step instead"),
        ("grpo.max_num_steps=3", "async_grpo.num_steps instead"),
        ("grpo.sample_seeds=group", "remove it"),  # (a key written at its default loads: older files)
        ("async_grpo.seed=7", "set grpo.seed (or task.seed) instead"),
        ("async_grpo.shuffle=false", "always shuffled"),
    ],
)
def test_async_run_refuses_keys_it_would_ignore(override, names):
    """A grpo-async run refuses a key its loop does not read (the step size and count of grpo, the
    controller's own prompt order), naming what to set instead, rather than running without it."""
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=rf"{key}\b.*not used") as err:
        load_config(AsyncGRPORunConfig, None, [override])
    assert names in str(err.value)
    load_config(AsyncGRPORunConfig, None, ["grpo.seed=7"])  # where the order's seed goes


def test_an_async_runs_config_yaml_loads_back(tmp_path):
    """config.yaml leaves out the keys the asynchronous loop refuses, so it loads back with --config."""
    from posttrain.config import dump_config

    cfg = load_config(AsyncGRPORunConfig, None, ["grpo.seed=7"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(AsyncGRPORunConfig, path) == cfg


@pytest.mark.parametrize("name", ["demo_calculator", "demo_guess", "demo_code"])
def test_environment_demo_configs_run_end_to_end(tmp_path, name):
    """The environment demos of the README, shortened: SFT on demonstrations, then GRPO episodes."""
    overrides = [
        "sft.max_num_steps=3",
        "grpo.grpo.max_num_steps=2",
        "grpo.grpo.val_period=2",
        "grpo.grpo.val_max_prompts=4",
        f"output_dir={tmp_path}",
    ]
    res = run_demo(load_config(DemoConfig, CONFIGS / f"{name}.yaml", overrides))
    assert 0.0 <= res["accuracy_after_sft"] <= 1.0 and 0.0 <= res["accuracy_after_grpo"] <= 1.0
    assert (tmp_path / "grpo" / "curves.png").is_file()
