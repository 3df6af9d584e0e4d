"""Golden trajectories: fixed-seed runs whose per-step numbers and final parameters are pinned.

Recorded before the rollout-layer redesign (issue 22) and kept bit-identical after it: a refactor that
does not change the math must not change a single bit of these runs. The numbers live in
`golden/trajectories.json`; `python tests/test_golden.py --record` rewrites them (only do that for a
change that is meant to alter the math, and say why in the commit).

Bit-identity holds on the platform the numbers were recorded on (torch version, CPU capability and
CPU model are stored with them). Elsewhere, float reductions may round differently, so the runs are compared at
1e-4 relative instead, and the test says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden" / "trajectories.json"
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(GOLDEN.parent))  # golden_reward

from helpers import small_async_grpo_cfg, small_grpo_cfg  # noqa: E402
from posttrain.logging import read_metrics  # noqa: E402

STEP_KEYS = (
    "reward",
    "reward_failed",
    "train/loss",
    "train/grad_norm",
    "val/accuracy",
    "completion_length",
    "weight_sync/probe_max_abs_diff",
)


def cpu_model() -> str:
    """The processor's model name: CPUs of one capability (AVX512) but another make or generation pick
    other GEMM kernels in MKL/oneDNN and round differently (an Intel Xeon and an AMD EPYC differ at 1e-7)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform as host

        return host.processor() or host.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def platform() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": cpu_model(),
        "threads": str(torch.get_num_threads()),
    }


def checksum(state: dict[str, torch.Tensor]) -> dict[str, object]:
    """sha256 over every parameter's bytes (sorted names) and the float64 sum, for a readable diff."""
    h = hashlib.sha256()
    total = 0.0
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
        total += float(t.double().sum())
    return {"sha256": h.hexdigest(), "sum": total}


def step_rows(path: Path) -> list[dict[str, float]]:
    rows = []
    for r in read_metrics(path):
        kept = {k: r[k] for k in STEP_KEYS if k in r}
        if kept:
            rows.append({"step": r["step"], **kept})
    return rows


def final_params(cfg, out: Path, step: int) -> dict[str, object]:
    from posttrain.policy.policy import Policy

    policy = Policy(cfg.policy)
    policy.load_checkpoint(str(out / "checkpoints" / f"step_{step}"))
    return checksum(policy.full_state_dict())


GOLDEN_RUN = ("task.reward_fn=golden_reward:reward", "checkpointing.save_period=4")


def sync_run(out: Path) -> dict[str, object]:
    from posttrain.algorithms.grpo import run_grpo

    cfg = small_grpo_cfg(out, *GOLDEN_RUN)
    run_grpo(cfg)
    return {"steps": step_rows(out / "metrics.jsonl"), "params": final_params(cfg, out, 4)}


def async_local_run(out: Path) -> dict[str, object]:
    from posttrain.algorithms.async_grpo.run import run_async_grpo

    cfg = small_async_grpo_cfg(out, *GOLDEN_RUN, "async_grpo.max_staleness=0")
    run_async_grpo(cfg)
    return {"steps": step_rows(out / "metrics.jsonl"), "params": final_params(cfg, out, 4)}


def async_dry_run() -> dict[str, object]:
    """The controller with fake parts, one worker, fixed latencies: which groups each step trained,
    at which versions, and the controller's counters."""
    from doubles import FAKE_LOSS, FakeRolloutWorker, FakeTrainer, fake_dataset, make_fake_prepare
    from posttrain.algorithms.async_grpo.config import AsyncGRPOConfig
    from posttrain.algorithms.async_grpo.controller import AsyncGRPOController

    worker = FakeRolloutWorker("w0", latency=0.0)
    trainer = FakeTrainer()
    cfg = AsyncGRPOConfig(
        target_prompt_groups_per_step=4, max_staleness=1, max_in_flight_per_worker=2, seed=3, num_epochs=2
    )
    ctrl = AsyncGRPOController(cfg, fake_dataset(12), [worker], trainer, make_fake_prepare(), FAKE_LOSS)
    summary = asyncio.run(asyncio.wait_for(ctrl.run(), 30))
    steps = [[[b.group_id, b.prompt_id, b.weight_version] for b in step] for step in trainer.steps]
    return {"steps": steps, "totals": summary.totals, "groups": summary.groups}


RUNS = {"sync_grpo": sync_run, "async_grpo_local": async_local_run}


def record(tmp: Path) -> dict[str, object]:
    out: dict[str, object] = {"platform": platform(), "async_dry_run": async_dry_run()}
    for name, fn in RUNS.items():
        out[name] = fn(tmp / name)
    return out


def assert_rows(got: list[dict], want: list[dict], exact: bool) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), g["step"]
        for k in w:
            if exact:
                assert g[k] == w[k], (g["step"], k, g[k], w[k])
            else:
                assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (g["step"], k)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_async_dry_run_is_unchanged(golden):
    assert async_dry_run() == golden["async_dry_run"]


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the golden trajectories are CPU runs (on a GPU the trainer is offloaded during generation and "
    "the engine copies rather than shares the weights, so the metrics differ in kind)",
)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_run_is_bit_identical_to_the_golden_trajectory(name, golden, tmp_path):
    exact = golden["platform"] == platform()
    got = RUNS[name](tmp_path / name)
    want = golden[name]
    assert_rows(got["steps"], want["steps"], exact)
    if exact:
        assert got["params"]["sha256"] == want["params"]["sha256"], (got["params"], want["params"])
    else:
        assert got["params"]["sum"] == pytest.approx(want["params"]["sum"], rel=1e-4)


if __name__ == "__main__" and "--record" in sys.argv:
    import tempfile

    torch.set_num_threads(1)  # as conftest.py sets it for the tests

    with tempfile.TemporaryDirectory() as d:
        data = record(Path(d))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
