"""Benchmarks that start processes fail fast: a missing optional dependency is named before anything
runs, and a dead child ends the benchmark with a non-zero status naming it and its exit code.

The subprocess timeouts are hang guards only (a regression would otherwise wait out the benchmark's
own 900 s bounds); nothing here asserts on wall-clock time.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import ChildDied, start, stop, wait_for, watch  # noqa: E402

HANG_GUARD_S = 120


def _run(
    args: list[str], extra_env: dict[str, str], pythonpath: list[Path] = ()
) -> subprocess.CompletedProcess:
    env = os.environ | extra_env
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in [*pythonpath, ROOT / "src", *inherited])
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def test_vs_trl_without_trl_names_it_before_running_anything(tmp_path):
    blocked = tmp_path / "blocked"
    (blocked / "trl").mkdir(parents=True)
    (blocked / "trl" / "__init__.py").write_text("raise ImportError('trl is blocked by this test')\n")
    proc = _run(["benchmarks/vs_trl.py", "--quick"], {}, [blocked])
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "needs trl (ImportError: trl is blocked by this test)" in proc.stderr, proc.stderr
    assert 'pip install -e ".[bench]"' in proc.stderr
    assert "warm start" not in proc.stdout  # checked up front, before the SFT warm start


def test_multiturn_without_trl_names_it_before_running_anything(tmp_path):
    blocked = tmp_path / "blocked"
    (blocked / "trl").mkdir(parents=True)
    (blocked / "trl" / "__init__.py").write_text("raise ImportError('trl is blocked by this test')\n")
    proc = _run(["benchmarks/multiturn.py", "--quick"], {}, [blocked])
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "needs trl (ImportError: trl is blocked by this test)" in proc.stderr, proc.stderr
    assert "model:" not in proc.stdout  # checked up front, before the KV-reuse runs


def test_multiturn_environment_has_exactly_four_turns_and_reuse_prefills_less():
    import multiturn

    from posttrain.envs.base import AssistantMessage, EnvSample

    env = multiturn.FourTurns(EnvSample(3, {"opening": 40, "observation": 12}))
    assert len(env.reset()[0]["content"]) == 40
    steps = [env.step(AssistantMessage("x")) for _ in range(multiturn.TURNS)]
    assert [st.done for st in steps] == [False] * (multiturn.TURNS - 1) + [True]
    assert all(len(st.messages[0]["content"]) == 12 for st in steps[:-1])
    tiny = dataclasses.replace(multiturn.QUICK, samples=1, generations=2, opening=32, observation=8, rounds=1)
    runs, identical = multiturn.play_rounds(tiny)
    reuse, whole = runs[True][0], runs[False][0]
    assert identical and reuse.tokens == whole.tokens > 0
    assert reuse.reused > 0 and whole.reused == 0 and reuse.prefill < whole.prefill


@pytest.mark.distributed
def test_vs_trl_reports_the_side_that_died(tmp_path):
    pytest.importorskip("trl")
    proc = _run(
        ["benchmarks/vs_trl.py", "--quick", "--workdir", str(tmp_path)], {"BENCH_CHILD_EXIT": "trl:3"}
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "vs_trl.py: the trl process exited (exit code 3); stopping posttrain" in proc.stderr, proc.stderr
    assert "RESULT" not in proc.stdout


def _spawn():
    return mp.get_context("spawn")


@pytest.mark.distributed
def test_watch_names_the_dead_child_stops_the_others_and_sets_abort():
    ctx = _spawn()
    abort = ctx.Event()
    procs = start(ctx, {"sleeper": (time.sleep, (HANG_GUARD_S,)), "crasher": (os._exit, (3,))})
    try:
        with pytest.raises(
            ChildDied, match=r"^the crasher process exited \(exit code 3\); stopping sleeper$"
        ):
            watch(procs, abort=abort, timeout_s=HANG_GUARD_S)
        assert abort.is_set()
        assert procs["sleeper"].exitcode == -15  # SIGTERM from `stop`, not a sleep that ran out
    finally:
        stop(procs)


@pytest.mark.distributed
def test_watch_returns_when_every_child_exits_cleanly():
    procs = start(_spawn(), {"a": (os._exit, (0,)), "b": (time.sleep, (0.1,))})
    watch(procs, timeout_s=HANG_GUARD_S)
    assert [p.exitcode for p in procs.values()] == [0, 0]


@pytest.mark.distributed
def test_wait_for_gives_up_when_the_child_it_waits_on_dies():
    ctx = _spawn()
    reader, _writer = ctx.Pipe(duplex=False)  # nobody ever writes
    procs = start(ctx, {"sender": (os._exit, (3,))})
    try:
        with pytest.raises(ChildDied, match=r"the sender process exited \(exit code 3\) while waiting for"):
            wait_for(reader.poll, "the reply", timeout_s=HANG_GUARD_S, procs=procs, poll_s=0.1)
    finally:
        stop(procs)


def test_wait_for_gives_up_when_abort_is_set_and_returns_once_ready():
    abort = threading.Event()
    threading.Timer(0.2, abort.set).start()
    never = threading.Event()
    with pytest.raises(ChildDied, match="another process died while this one waited for the turn"):
        wait_for(never.wait, "the turn", timeout_s=HANG_GUARD_S, abort=abort, poll_s=0.05)
    soon = threading.Event()
    threading.Timer(0.2, soon.set).start()
    wait_for(soon.wait, "the turn", timeout_s=HANG_GUARD_S, abort=threading.Event(), poll_s=0.05)
    with pytest.raises(TimeoutError, match="waited 0s for the turn"):
        wait_for(never.wait, "the turn", timeout_s=0.1, poll_s=0.05)


@pytest.mark.distributed
def test_watchdog_ends_a_parent_blocked_while_its_child_dies():
    code = (
        "import os, sys, time, multiprocessing as mp\n"
        "sys.path.insert(0, 'benchmarks')\n"
        "from _common import start, watchdog\n"
        "if __name__ == '__main__':\n"
        "    procs = start(mp.get_context('spawn'), {'receiver': (os._exit, (7,))})\n"
        "    with watchdog(procs, poll_s=0.1):\n"
        "        time.sleep(600)  # stands in for a collective with the dead child\n"
        "    print('not reached')\n"
    )
    proc = _run(["-c", code], {})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the receiver process exited (exit code 7)" in proc.stderr, proc.stderr
    assert "not reached" not in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_benchmark_without_cuda_says_so_before_running_anything():
    proc = _run(["benchmarks/gpu.py", "--quick"], {})
    assert proc.returncode != 0
    assert "needs CUDA" in proc.stderr and "--device cpu" in proc.stderr, proc.stderr
    assert "device:" not in proc.stdout
