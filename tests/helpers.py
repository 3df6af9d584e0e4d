"""Small helpers shared by tests (importable as `helpers`)."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.policy.config import PolicyConfig

if TYPE_CHECKING:
    from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
    from posttrain.algorithms.grpo import GRPOConfig


SRC = str(Path(__file__).resolve().parents[1] / "src")


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python that imports posttrain from this checkout: `src`
    put before an inherited PYTHONPATH (which may hold the dependencies, as on a machine whose wheels
    are installed to a --target folder), plus `extra`."""
    path = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def stand_in(name: str) -> types.ModuleType:
    """An empty module for `name` with a spec (libraries that look a package up, e.g. accelerate's
    is_wandb_available, then find it)."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


@contextlib.contextmanager
def logging_packages_found() -> Iterator[None]:
    """While the block runs, the packages of the optional metrics sinks (tensorboard, wandb) that are not
    installed are found as empty stand-in modules: a config that asks for a sink (the GPU example's
    logging.tensorboard=true) then loads, its LoggingConfig checking only that the package is there."""
    added = [
        n for n in ("tensorboard", "wandb") if n not in sys.modules and importlib.util.find_spec(n) is None
    ]
    for name in added:
        sys.modules[name] = stand_in(name)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def policy_cfg(**overrides) -> PolicyConfig:
    """A tiny fp32 policy config; nested overrides as dicts."""
    base = {"train_global_batch_size": 8, "optimizer": {"lr": 1e-2}, "max_grad_norm": 1.0}
    base.update(overrides)
    return PolicyConfig.model_validate(base)


def params_of(policy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in policy.full_state_dict().items()}


def assert_params_close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: full tensor} of every parameter (gathered from its shards: collective on a mesh)."""
    from posttrain.parallel.mesh import full_tensor

    return {n: full_tensor(p).detach().clone() for n, p in model.named_parameters()}


def assert_only_adapters_moved(before: dict, after: dict) -> None:
    """Every LoRA adapter tensor changed, every base tensor kept its exact value."""
    from posttrain.models.lora import is_adapter_key

    assert before.keys() == after.keys()
    adapters = {n for n in before if is_adapter_key(n)}
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert adapters, "no adapter parameters"
    assert adapters <= moved, f"adapters that did not move: {sorted(adapters - moved)}"
    assert moved <= adapters, f"frozen parameters that moved: {sorted(moved - adapters)}"


def small_run_policy() -> dict:
    """The policy section of the tiny GRPO runs of the loop tests (sync and async)."""
    return {
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64}},
        "train_global_batch_size": 16,
        "microbatch": {"train_micro_batch_size": 16},
        "optimizer": {"lr": 1e-3},
    }


def small_grpo_cfg(out, *overrides: str) -> GRPOConfig:
    """The tiny synchronous GRPO run of the loop tests (4 steps of 4 prompts x 4 samples)."""
    from posttrain.algorithms.grpo import GRPOConfig
    from posttrain.config import apply_overrides, build_config

    base = {
        "policy": small_run_policy(),
        "generation": {"max_num_seqs": 16},
        "sampling": {"max_new_tokens": 3},
        "grpo": {
            "num_prompts_per_step": 4,
            "num_generations_per_prompt": 4,
            "max_num_steps": 4,
            "val_period": 2,
        },
        "task": {"max_eval_prompts": 8},
        "checkpointing": {"save_period": 2},
        "logging": {"progress_bar": False},
        "output_dir": str(out),
    }
    return build_config(GRPOConfig, apply_overrides(base, list(overrides)))


def small_async_grpo_cfg(out, *overrides: str) -> AsyncGRPORunConfig:
    """The tiny asynchronous GRPO run of the loop tests (4 steps of 4 groups x 4 samples)."""
    from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig
    from posttrain.config import apply_overrides, build_config

    base = {
        "policy": small_run_policy(),
        "generation": {"max_num_seqs": 32},
        "sampling": {"max_new_tokens": 3},
        "grpo": {"num_generations_per_prompt": 4, "val_period": 2},
        "async_grpo": {
            "num_steps": 4,
            "target_prompt_groups_per_step": 4,
            "max_staleness": 1,
            "request_timeout_s": 60.0,
            "admission_timeout_s": 120.0,
            "trainer_timeout_s": 60.0,
        },
        "task": {"max_eval_prompts": 8},
        "checkpointing": {"save_period": 2},
        "logging": {"progress_bar": False},
        "output_dir": str(out),
    }
    return build_config(AsyncGRPORunConfig, apply_overrides(base, list(overrides)))


def sync_config_like(cfg: AsyncGRPORunConfig, loss=None) -> GRPOConfig:
    """The synchronous run with the same model, task, groups, steps and loss (or `loss`) as the
    asynchronous `cfg` (not colocated): the two loops compared on equal samples (a converter of the
    tests and benchmarks, not of the library)."""
    from posttrain.algorithms.grpo import GRPOConfig

    a = cfg.async_grpo
    loop = cfg.grpo.model_copy(
        update={
            "num_prompts_per_step": a.target_prompt_groups_per_step,
            "max_num_steps": a.num_steps or cfg.grpo.max_num_steps,
            "max_num_epochs": a.num_epochs or cfg.grpo.max_num_epochs,
        }
    )
    return GRPOConfig(
        policy=cfg.policy,
        generation=cfg.generation,
        sampling=cfg.sampling,
        task=cfg.task,
        loss=a.loss if loss is None else loss,
        grpo=loop,
        weight_sync=cfg.weight_sync,
        colocated=False,
        checkpointing=cfg.checkpointing,
        logging=cfg.logging,
        output_dir=cfg.output_dir,
    )


def lagged_grpo_step(lag: int):
    """A synchronous GRPO step (`run_grpo(..., step_fn=)`) whose samples come from the weights `lag`
    optimizer steps behind the ones it trains: what the asynchronous loop computes at
    `max_staleness=lag` when every group is as stale as allowed (a reference of the tests and
    benchmarks, not of the library). Step t generates with version max(0, t-1-lag), trains version t-1
    into t, then loads version max(0, t-lag) into the engine for the next step. Needs an engine that
    holds a copy of the weights (`weight_sync.share=never`): an aliasing engine sees every update."""
    from posttrain.algorithms import grpo

    if lag < 1:
        raise ValueError(f"lag={lag}: a lag of 0 is the synchronous step itself (grpo.grpo_step)")
    held: dict[int, dict[str, torch.Tensor]] = {}  # trainer version -> the engine's weights of it

    def train(run, batch) -> dict[str, float]:
        version = run.policy.get_states()[0]["trainer_version"]
        held[version] = {k: v.detach().clone() for k, v in run.policy.engine_state_dict().items()}
        return grpo.train(run, batch)

    def step(run) -> dict[str, float]:
        if run.share_weights:
            raise ValueError(
                "lagged_grpo_step needs weight_sync.share=never (the engine aliases the trainer)"
            )
        metrics = grpo.grpo_step(run, train_fn=train)  # ends with the engine at the new weights
        newest = run.policy.get_states()[0]["trainer_version"]
        version = max(min(held), newest - lag)
        run.engine.load_weights(held[version], version)
        for old in [v for v in held if v < version]:  # never loaded again
            del held[old]
        return metrics | {"generation_version_next": float(version)}

    return step


def actor_killer(ray, in_flight_at_kill: list[int]):
    """An on-step hook for the asynchronous run: after step 1, wait until Ray rollout actor 0 is
    generating at the new weights (requests sent before them may be about to return: weights go out
    while they finish), then kill it with its groups in flight (their ids go to `in_flight_at_kill`)."""
    import asyncio

    async def kill_busy_actor(r, step, metrics):
        if step != 1:
            return
        pool = r.controller.pool
        slot = pool.slots[0]
        for _ in range(2000):
            if slot.in_flight and slot.version == pool.published_version:
                break
            await asyncio.sleep(0.005)
        in_flight_at_kill.extend(slot.in_flight)
        ray.kill(r.actors[0])

    return kill_busy_actor
