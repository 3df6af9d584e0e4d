"""Run a function on N local ranks in separate processes, without Ray (tests and benchmarks of the
(dp, cp, tp) mesh on one machine).

`run_ranks(world, fn, *args)` starts `world` processes, each calling `fn(rank, world, port, *args)`
(a `PolicyWorker(cfg, rank, world, master_port=port)` joins them with torch.distributed); it returns
the per-rank results in rank order, or raises with the first failing rank's traceback. `fn` must be
importable by module name (with a fork server: by the `sys.path` of when the server started); the
caller's environment is passed on. Every wait is bounded (`timeout_s`); on a timeout or a dead rank
the processes are killed.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback

import torch

from posttrain.parallel.mesh import free_port


def _entry(fn, rank: int, world: int, port: int, results, args, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment now (a fork server's is of when it started)
    os.environ["LOCAL_RANK"] = str(rank)  # one GPU per rank where there are GPUs (as torchrun sets it)
    torch.set_num_threads(1)
    try:
        value = fn(rank, world, port, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # bytes, not shared-memory handles that die with this process
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


# imported once by the fork server, so a rank starts in well under a second instead of importing them
# (~5 s of CPU each on a 2-core machine)
PRELOAD = ["torch", "transformers", "posttrain.policy.worker"]


def rank_context():
    """Where ranks start: on a machine without CUDA, forked from a fork server that has imported PRELOAD
    and touched nothing else (no threads); else spawned (a CUDA check while importing PRELOAD could
    initialise the driver in the server, and a forked rank could then not use the GPU). Either way a
    rank sees none of the parent's in-memory changes; `run_ranks` hands it the parent's environment."""
    if torch.cuda.is_available() or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(world: int, fn, *args, timeout_s: float = 600) -> list:
    """`fn(rank, world, port, *args)` on every rank (processes of `rank_context`); results in rank
    order."""
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    # the caller's environment, with its sys.path as PYTHONPATH (for processes a rank starts itself)
    path = os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "PYTHONPATH": path}
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args, env)) for r in range(world)]
    try:
        for p in procs:
            p.start()
    except BaseException:
        _stop([p for p in procs if p.pid is not None])
        raise
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world)) - set(out))} did not finish in {timeout_s}s"
                    ) from None
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        _stop(procs)
    return [out[r] for r in range(world)]


def _stop(procs: list) -> None:
    """Join each process (a failed rank's peers may wait in a collective: killed after 10 s)."""
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
