"""Communicator teardown/rebuild (parallel/comms.py and the worker/Policy verbs).

The multi-rank tests run two CPU ranks (gloo) with `parallel.processes.run_ranks`; each rank runs a
`PolicyWorker` directly and returns its results.
"""

from __future__ import annotations

import math
import os
import time
import traceback

import pytest
import torch

from conftest import random_batch
from helpers import policy_cfg
from posttrain.algorithms.losses import ClippedPGLoss
from posttrain.parallel import comms
from posttrain.parallel.processes import run_ranks
from posttrain.policy.lifecycle import PhaseError

WORLD = 2
# Growth allowed over 50 cycles. A leaked 2-rank gloo group costs ~5 fds and ~3 threads, so one leak per
# cycle would show as ~250 fds; RSS grew by ~3 MiB in our runs (allocator noise).
FD_TOLERANCE = 4
THREAD_TOLERANCE = 2
RSS_TOLERANCE = 16 * 2**20


# ---------------------------------------------------------------------------------------------- harness


def make_worker(rank: int, world: int, port: int, **overrides):
    from posttrain.policy.worker import PolicyWorker

    os.environ["LOCAL_RANK"] = str(rank)  # one GPU per rank where there are GPUs
    torch.manual_seed(0)
    cfg = policy_cfg(cluster={"backend": "ray", "num_workers": world}, **overrides)
    return PolicyWorker(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port)


def rank_batch(rank: int, world: int, step: int):
    batch = random_batch(8, 16, rl=True, seed=step)
    return batch[rank::world]


def local_params(worker) -> dict[str, torch.Tensor]:
    from posttrain.parallel.mesh import local_tensor

    return {n: local_tensor(p).detach().clone() for n, p in worker.model.named_parameters()}


def proc_usage() -> dict[str, int]:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "rss": rss,
    }


# ---------------------------------------------------------------------------------------------- rank bodies


def _train_three_steps(worker, rank, world, cycle: bool) -> tuple[list[dict], list[dict]]:
    losses, stats = [], []
    for step in range(3):
        if cycle:  # the colocated sequence: offload, tear down, (engine generates), back, rebuild
            worker.offload_after_refit()
            stats.append(worker.teardown_comms())
            worker.prepare_for_training()
            stats.append(worker.rebuild_comms())
        losses.append(worker.train(rank_batch(rank, world, step), ClippedPGLoss()))
    return losses, stats


def _bitwise_rank(rank, world, port):
    cycled = make_worker(rank, world, port)
    plain = make_worker(rank, world, port)  # a second model on its own DP group in the same ranks
    losses_c, stats = _train_three_steps(cycled, rank, world, cycle=True)
    losses_p, _ = _train_three_steps(plain, rank, world, cycle=False)
    return dict(
        losses_c=losses_c,
        losses_p=losses_p,
        params_c=local_params(cycled),
        params_p=local_params(plain),
        stats=stats,
        logprobs_c=cycled.get_logprobs(rank_batch(rank, world, 9)),
        logprobs_p=plain.get_logprobs(rank_batch(rank, world, 9)),
    )


def _cycle(worker, probe) -> None:
    worker.teardown_comms()
    worker.rebuild_comms()
    worker.get_logprobs(probe)  # the rebuilt group carries FSDP all-gathers, as in a real run


def _cycles_rank(rank, world, port, cycles):
    worker = make_worker(rank, world, port)
    worker.train(rank_batch(rank, world, 0), ClippedPGLoss())
    probe = rank_batch(rank, world, 1)[:1]
    for _ in range(3):  # warm-up: first-use allocations are not leaks
        _cycle(worker, probe)
    before = proc_usage()
    start = time.perf_counter()
    for _ in range(cycles):
        _cycle(worker, probe)
    per_cycle_s = (time.perf_counter() - start) / cycles
    after = proc_usage()
    metrics = worker.train(rank_batch(rank, world, 1), ClippedPGLoss())
    return dict(before=before, after=after, per_cycle_s=per_cycle_s, loss=metrics["loss"])


def _guards(rank, world, port):
    worker = make_worker(rank, world, port)
    batch = rank_batch(rank, world, 0)
    out: dict = {}
    first = worker.teardown_comms()
    second = worker.teardown_comms()
    out["teardown"] = (first, second, worker.get_state()["comms_up"])
    errors = {}
    for name, call in {
        "train": lambda: worker.train(batch, ClippedPGLoss()),
        "get_logprobs": lambda: worker.get_logprobs(batch),
        "full_state_dict": lambda: worker.full_state_dict(),
    }.items():
        with pytest.raises(PhaseError) as e:
            call()
        errors[name] = str(e.value)
    worker.begin_train_step(ClippedPGLoss())  # not collective: allowed
    with pytest.raises(PhaseError) as e:
        worker.train_microbatch(batch)
    errors["train_microbatch"] = str(e.value)
    worker.abort_train_step()
    with pytest.raises(
        comms.CommsError
    ) as e:  # a stray use past the guard fails loudly, not on another group
        with torch.no_grad():
            worker.model(input_ids=batch["input_ids"])
    errors["stray_forward"] = str(e.value)
    out["errors"] = errors
    rebuilt = worker.rebuild_comms()
    again = worker.rebuild_comms()
    out["rebuild"] = (rebuilt, again, worker.get_state()["comms_up"])
    worker.begin_train_step(ClippedPGLoss())
    with pytest.raises(PhaseError) as e:
        worker.teardown_comms()
    errors["teardown_in_step"] = str(e.value)
    worker.abort_train_step()
    out["loss"] = worker.train(batch, ClippedPGLoss())["loss"]
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError) as e:  # a mesh over the default group cannot be torn down alone
        comms.collect_groups(None, mesh=init_device_mesh("cpu", (world,)))
    errors["default_group"] = str(e.value)
    return out


def _destroy_failure(rank, world, port):
    worker = make_worker(rank, world, port)
    batch = rank_batch(rank, world, 0)
    real = comms._destroy
    calls = []

    def flaky(pg):
        calls.append(pg.group_name)
        if rank == 1 and len(calls) == 1:
            raise RuntimeError("injected destroy failure")
        real(pg)

    comms._destroy = flaky
    out: dict = {}
    try:
        try:
            worker.teardown_comms()
            out["first"] = "ok"
        except comms.CommsError as e:
            out["first"] = str(e)
        out["comms_up_after_failure"] = worker.get_state()["comms_up"]
        with pytest.raises(PhaseError):
            worker.train(batch, ClippedPGLoss())
        out["retry"] = worker.teardown_comms()
    finally:
        comms._destroy = real
    out["rebuild"] = worker.rebuild_comms()
    out["loss"] = worker.train(batch, ClippedPGLoss())["loss"]
    return out


def _create_failure(rank, world, port):
    worker = make_worker(rank, world, port)
    batch = rank_batch(rank, world, 0)
    real = comms._create
    calls = []

    def flaky(spec):
        calls.append(spec.desc)
        if len(calls) == 1:  # on every rank, before any rendezvous, so the retry stays matched
            raise RuntimeError("injected create failure")
        return real(spec)

    comms._create = flaky
    worker.teardown_comms()
    out: dict = {}
    try:
        with pytest.raises(comms.CommsError) as e:
            worker.rebuild_comms()
        out["error"] = str(e.value)
        out["comms_up_after_failure"] = worker.get_state()["comms_up"]
        out["retry"] = worker.rebuild_comms()
    finally:
        comms._create = real
    out["loss"] = worker.train(batch, ClippedPGLoss())["loss"]
    return out


def _reference(rank, world, port):
    """The loss of the scenarios' first training step on a worker whose comms were never torn down."""
    return {"loss": make_worker(rank, world, port).train(rank_batch(rank, world, 0), ClippedPGLoss())["loss"]}


def _scenarios_rank(rank, world, port):
    """The small scenarios, one fresh worker each, in one pair of ranks (spawning costs more than they)."""
    out = {}
    # the reference runs last: an earlier worker's cached mesh changes what "destroy" counts
    scenarios = {
        "guards": _guards,
        "destroy": _destroy_failure,
        "create": _create_failure,
        "reference": _reference,
    }
    for name, scenario in scenarios.items():
        try:
            out[name] = scenario(rank, world, port)
        except Exception:
            out[name] = {"crashed": traceback.format_exc()}
    return out


# ---------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def scenarios():
    return run_ranks(WORLD, _scenarios_rank, timeout_s=240)


def _results(scenarios, name: str) -> list[dict]:
    results = [r[name] for r in scenarios]
    for r in results:
        assert "crashed" not in r, r.get("crashed")
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_teardown_rebuild_between_steps_is_bit_identical():
    for r in run_ranks(WORLD, _bitwise_rank, timeout_s=240):
        assert r["losses_c"] == r["losses_p"]  # every metric of every step, exactly
        assert r["params_c"].keys() == r["params_p"].keys()
        for name in r["params_c"]:
            assert torch.equal(r["params_c"][name], r["params_p"][name]), name
        assert torch.equal(r["logprobs_c"], r["logprobs_p"])
        teardowns, rebuilds = r["stats"][0::2], r["stats"][1::2]
        assert all(s["groups_destroyed"] == 1 and s["seconds"] >= 0 for s in teardowns)
        assert all(s["groups_created"] == 1 and s["groups_destroyed"] == 0 for s in rebuilds)


@pytest.mark.distributed
@pytest.mark.slow
def test_fifty_cycles_do_not_leak_fds_threads_or_memory():
    results = run_ranks(WORLD, _cycles_rank, 50, timeout_s=400)
    for rank, r in enumerate(results):
        b, a = r["before"], r["after"]
        print(
            f"rank {rank}: {r['per_cycle_s'] * 1e3:.1f} ms per teardown+rebuild+logprobs cycle; "
            f"fds {b['fds']}->{a['fds']}, threads {b['threads']}->{a['threads']}, "
            f"rss {b['rss'] / 2**20:.1f}->{a['rss'] / 2**20:.1f} MiB"
        )
        assert a["fds"] - b["fds"] <= FD_TOLERANCE
        assert a["threads"] - b["threads"] <= THREAD_TOLERANCE
        assert a["rss"] - b["rss"] <= RSS_TOLERANCE
    assert results[0]["loss"] == results[1]["loss"]


@pytest.mark.distributed
def test_idempotency_and_guards(scenarios):
    for r, ref in zip(_results(scenarios, "guards"), _results(scenarios, "reference")):
        first, second, up = r["teardown"]
        assert first["groups_destroyed"] == 1 and second["groups_destroyed"] == 0 and up is False
        for name in ("train", "get_logprobs", "full_state_dict", "train_microbatch"):
            assert "call rebuild_comms() first" in r["errors"][name], name
            assert name in r["errors"][name]
        assert "torn down" in r["errors"]["stray_forward"]
        assert "rebuild_comms()" in r["errors"]["stray_forward"]
        assert "split train step is open" in r["errors"]["teardown_in_step"]
        assert "build_mesh" in r["errors"]["default_group"]
        rebuilt, again, up = r["rebuild"]
        assert rebuilt["groups_created"] == 1 and again["groups_created"] == 0 and up is True
        # after the refused calls, the aborted step and the rebuild, training is that of a worker that
        # never tore down: same initial weights (seed 0), same batch, same loss to the bit
        assert math.isfinite(ref["loss"]) and r["loss"] == ref["loss"], (r["loss"], ref["loss"])


@pytest.mark.distributed
def test_failed_destroy_names_the_group_and_a_retry_finishes(scenarios):
    r0, r1 = _results(scenarios, "destroy")
    assert r0["first"] == "ok"
    assert "failed to destroy process group" in r1["first"] and "(dp," in r1["first"]
    assert "injected destroy failure" in r1["first"] and "Call teardown_comms() again" in r1["first"]
    assert r0["comms_up_after_failure"] is False and r1["comms_up_after_failure"] is False
    # (>= 1: the earlier scenario's worker shares cached DTensor specs, hence its mesh, with this one)
    assert r0["retry"]["groups_destroyed"] == 0 and r1["retry"]["groups_destroyed"] >= 1
    assert r0["rebuild"]["groups_created"] == r1["rebuild"]["groups_created"] >= 1
    assert r0["loss"] == r1["loss"]


@pytest.mark.distributed
def test_failed_create_names_the_group_and_a_retry_finishes(scenarios):
    r0, r1 = _results(scenarios, "create")
    assert r0["loss"] == r1["loss"]
    for r in (r0, r1):
        assert "failed to create process group" in r["error"] and "(dp," in r["error"]
        assert "Call rebuild_comms() again" in r["error"]
        assert r["comms_up_after_failure"] is False
        assert r["retry"]["groups_created"] >= 1


def test_torn_down_placeholder_fails_loudly_but_copies():
    import copy

    ghost = comms.TornDownGroup("7")
    with pytest.raises(comms.CommsError, match=r"'7' is torn down .*call rebuild_comms\(\) first"):
        ghost.size()
    assert copy.deepcopy([ghost])[0].name == "7" and "7" in repr(ghost)


def test_single_rank_without_fsdp_has_nothing_to_tear_down():
    from posttrain.policy.policy import Policy

    policy = Policy(policy_cfg())
    try:
        assert policy.teardown_comms()[0]["groups_destroyed"] == 0
        with pytest.raises(PhaseError, match=r"train\(\) needs the worker's communicators"):
            policy.train(random_batch(8, 16, rl=True), ClippedPGLoss())
        assert policy.rebuild_comms()[0]["groups_created"] == 0
        assert policy.get_states()[0]["comms_up"] is True
    finally:
        policy.shutdown()


def test_teardown_after_the_process_group_was_destroyed_and_made_again(monkeypatch):
    """An FSDP policy, the process group destroyed, then a new FSDP LoRA policy in the same process:
    torch's sharding-propagation cache hands the new model specs whose mesh holds the destroyed groups.
    Teardown skips those (nothing is left of them) and the new policy's own groups cycle and train."""
    from posttrain.policy.worker import PolicyWorker

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    batch = random_batch(8, 16, rl=True)
    try:
        first = PolicyWorker(
            policy_cfg(model={"tiny": {"tie_word_embeddings": True}}, parallel={"fsdp": "always"})
        )
        first.train(batch, ClippedPGLoss())
        # a model of other shapes on a second dp group, named "2" (the next process group's one dp group
        # takes name "1" again): a later model of these shapes gets specs whose mesh names "2"
        narrow = {"tiny": {"hidden_size": 32, "intermediate_size": 64}}
        PolicyWorker(policy_cfg(model=narrow, parallel={"fsdp": "always"})).train(batch, ClippedPGLoss())
        torch.distributed.destroy_process_group()
        lora = {"rank": 4, "alpha": 8}
        # the narrow model first: its new dp group is "1" and "2" names nothing
        for cfg in (
            policy_cfg(model=narrow, parallel={"fsdp": "always"}),
            policy_cfg(lora=lora, parallel={"fsdp": "always"}),
        ):
            worker = PolicyWorker(cfg)
            assert worker.teardown_comms()["groups_destroyed"] == 1  # its own dp group, not the dead ones
            assert worker.rebuild_comms()["groups_created"] == 1
            assert math.isfinite(worker.train(batch, ClippedPGLoss())["loss"])
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_policy_verbs_on_two_ray_ranks(ray_session):
    from posttrain.policy.policy import Policy

    policy = Policy(policy_cfg(cluster={"backend": "ray", "num_workers": 2}))
    try:
        batch = random_batch(8, 16, rl=True)
        stats = policy.teardown_comms()
        assert [s["groups_destroyed"] for s in stats] == [1, 1]
        with pytest.raises(PhaseError, match="rebuild_comms"):
            policy.get_logprobs(batch)  # refused on the driver, no rank contacted
        assert [s["comms_up"] for s in policy.get_states()] == [False, False]
        assert [s["groups_created"] for s in policy.rebuild_comms()] == [1, 1]
        assert policy.train(batch, ClippedPGLoss())["grad_norm"] > 0
        assert [s["comms_up"] for s in policy.get_states()] == [True, True]
    finally:
        policy.shutdown()


# ---------------------------------------------------------------------------------------------- GPU tier


def _gpu_rank(rank, world, port):
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic kernels, so "identical" means it
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)  # its backward uses atomics
    cycled = make_worker(rank, world, port, parallel={"fsdp": "always"})
    plain = make_worker(rank, world, port, parallel={"fsdp": "always"})
    for worker in (cycled, plain):
        worker.train(rank_batch(rank, world, 0), ClippedPGLoss())
        group = next(worker.model.parameters()).device_mesh.get_group()
        torch.distributed.all_reduce(torch.ones(1, device=worker.device), group=group)  # NCCL comm is open
    down = cycled.teardown_comms()
    up = cycled.rebuild_comms()
    losses_c, _ = _train_three_steps(cycled, rank, world, cycle=True)
    losses_p, _ = _train_three_steps(plain, rank, world, cycle=False)
    params_c, params_p = local_params(cycled), local_params(plain)
    same = all(torch.equal(params_c[n], params_p[n]) for n in params_c)
    return dict(down=down, up=up, same_losses=losses_c == losses_p, same_params=same)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_teardown_frees_nccl_memory_and_training_is_identical():
    world = min(torch.cuda.device_count(), 2)  # NCCL needs one GPU per rank
    for rank, r in enumerate(run_ranks(world, _gpu_rank, timeout_s=240)):
        freed = r["down"]["device_freed_bytes"]
        print(f"rank {rank}: teardown freed {freed} bytes of device memory ({r['down']})")
        assert r["down"]["groups_destroyed"] == 1 and freed > 0
        assert r["up"]["groups_created"] == 1
        assert r["same_losses"] and r["same_params"]
