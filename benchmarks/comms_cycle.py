"""Communicator teardown + rebuild latency on 2 CPU ranks (gloo), against a bare gloo group.

ours: `PolicyWorker.teardown_comms()` + `rebuild_comms()` on an FSDP2 tiny model, then the first
all-reduce on the rebuilt data-parallel group (a cycle is done when the new group has carried a
collective; backends that connect lazily, like NCCL, pay their connection there).
reference: `dist.new_group` over the same ranks + the first all-reduce + `dist.destroy_process_group`,
i.e. the cost of the communicator alone, with nothing to find or re-bind.

The two alternate, one cycle each, so load from other processes hits both alike. Times are rank 0's.

    python benchmarks/comms_cycle.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line, run_main, start, watch  # noqa: E402

from posttrain.parallel.mesh import free_port  # noqa: E402

WORLD = 2


def _rank(rank: int, port: int, cycles: int, out: str) -> None:
    from posttrain.policy.config import PolicyConfig
    from posttrain.policy.worker import PolicyWorker

    cfg = PolicyConfig.model_validate(
        {"cluster": {"backend": "ray", "num_workers": WORLD}, "init_reference_model": False}
    )
    worker = PolicyWorker(cfg, rank=rank, world_size=WORLD, master_addr="127.0.0.1", master_port=port)
    probe = {"input_ids": torch.randint(4, 60, (1, 8)), "input_lengths": torch.tensor([8])}
    from posttrain.data.batch import make_batch

    worker.get_logprobs(make_batch(**probe))  # FSDP lazy init and the first connect
    x = torch.ones(1)
    timings: dict[str, list[float]] = {k: [] for k in ("teardown", "rebuild", "connect", "ref_create")}
    timings |= {"ref_connect": [], "ref_destroy": []}

    def dp_group():
        return next(worker.model.parameters()).device_mesh.get_group()

    def ours() -> None:
        dist.barrier()
        t0 = time.perf_counter()
        worker.teardown_comms()
        t1 = time.perf_counter()
        worker.rebuild_comms()
        t2 = time.perf_counter()
        group = dp_group()
        t3 = time.perf_counter()
        dist.all_reduce(x, group=group)
        t4 = time.perf_counter()
        timings["teardown"].append(t1 - t0)
        timings["rebuild"].append(t2 - t1)
        timings["connect"].append(t4 - t3)

    def reference() -> None:
        dist.barrier()
        t0 = time.perf_counter()
        group = dist.new_group(list(range(WORLD)), backend="gloo")
        t1 = time.perf_counter()
        dist.all_reduce(x, group=group)
        t2 = time.perf_counter()
        dist.destroy_process_group(group)
        del group
        t3 = time.perf_counter()
        timings["ref_create"].append(t1 - t0)
        timings["ref_connect"].append(t2 - t1)
        timings["ref_destroy"].append(t3 - t2)

    for _ in range(2):  # warm-up
        ours()
        reference()
    for k in timings:
        timings[k].clear()
    for _ in range(cycles):
        ours()
        reference()
    if rank == 0:
        torch.save(timings, out)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 cycles (under a minute)")
    ap.add_argument("--cycles", type=int, default=None, help="cycles of each kind (default 50; quick: 10)")
    args = ap.parse_args()
    cycles = args.cycles or (10 if args.quick else 50)
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "timings.pt")
        port = free_port()
        ranks = {f"rank {r}": (_rank, (r, port, cycles, out)) for r in range(WORLD)}
        watch(start(tmp.get_context("spawn"), ranks))  # a dead rank stops the other at once
        t = torch.load(out)
    ms = {k: median(v) * 1e3 for k, v in t.items()}
    ours = [a + b + c for a, b, c in zip(t["teardown"], t["rebuild"], t["connect"])]
    ref = [a + b + c for a, b, c in zip(t["ref_create"], t["ref_connect"], t["ref_destroy"])]
    cycle_ms, ref_ms = median(ours) * 1e3, median(ref) * 1e3
    print(f"{WORLD} CPU ranks (gloo), tiny FSDP2 model, {cycles} cycles of each; medians on rank 0")
    print(
        f"ours      : teardown {ms['teardown']:7.2f} ms  rebuild {ms['rebuild']:7.2f} ms  "
        f"first all-reduce {ms['connect']:7.2f} ms  cycle {cycle_ms:7.2f} ms"
    )
    print(
        f"reference : new_group {ms['ref_create']:6.2f} ms  destroy {ms['ref_destroy']:7.2f} ms  "
        f"first all-reduce {ms['ref_connect']:7.2f} ms  cycle {ref_ms:7.2f} ms"
    )
    print(f"ratio ours/reference: {cycle_ms / ref_ms:.2f}")
    print(result_line("comms_cycle_ms", cycle_ms, "<=500"))
    print(result_line("comms_cycle_vs_bare_group", cycle_ms / ref_ms, "<=3"))


if __name__ == "__main__":
    run_main(main)
