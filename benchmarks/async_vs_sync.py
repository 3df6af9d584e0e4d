"""Wall-clock of synchronous vs asynchronous GRPO for the same number of trained samples.

The same run three ways, interleaved and repeated (medians): the synchronous loop (grpo.py: generate,
score, logprobs, train, weight sync, in turn) and the asynchronous one (algorithms/async_grpo/) at
max_staleness 1 and 2. The asynchronous trainer runs in this process and its single rollout engine in
a Ray actor, so generation and training can use one core each; every process uses one torch thread.
The synchronous loop runs in this process with one torch thread too (on this tiny model a second
thread does not help it: see RESULTS.md).

Sizes are picked so that the synchronous loop spends about as long generating as training (the
script prints its measured per-phase medians): a tiny Llama (hidden 64, 2 layers), 32 prompts x 8
completions per step of 32 new tokens (a random model rarely stops early), an engine that decodes 64
sequences at a time (four waves per step; the asynchronous controller sends one wave per call and
keeps a second call queued at the actor), training micro-batches of 32 rows, arithmetic prompts,
rewards computed but (random model) all zero, which changes no timing. Timed: the training loop only
(model, engine and actor start-up excluded for both, and so is the first weight load: the synchronous
set-up syncs its engine, the asynchronous one pushes the policy's weights to its rollout actor); the
asynchronous time also includes filling the pipeline and cancelling the requests in flight at the end.
Before the timed runs (not with --quick) one untimed step of each loop takes the process's first-call
costs out of the timings: the synchronous loop trains on this thread, the asynchronous trainer on a
policy thread that later runs reuse (async_grpo.trainer.SerialThread); each asynchronous run's fresh rollout
actor generates one untimed wave after its start-up for the same reason.
A run is 30 steps of 256 samples (earlier: 12 of 128): each asynchronous step has fixed costs the
synchronous one has not (a Ray call per wave and one per weight version, the weight export and the
probe check on both sides), and filling the pipeline costs one wave per run; real steps are larger
and runs longer. `--prompts 16 --steps 12` is the old setting.
Both loops skip the prev-logprob forward (one optimizer step per step: the loss takes them from its
training forward); the asynchronous one keeps its truncated importance sampling.

    python benchmarks/async_vs_sync.py [--quick] [--steps N] [--repeats R] [--prompts P]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import ChildDied, median, require, result_line, run_main  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import sync_config_like  # noqa: E402  (the tests' converter: same model, task, groups, steps)
from posttrain.algorithms import grpo  # noqa: E402
from posttrain.algorithms.async_grpo.config import AsyncGRPORunConfig  # noqa: E402
from posttrain.algorithms.async_grpo.run import close, setup, train  # noqa: E402
from posttrain.algorithms.losses import ClippedPGConfig  # noqa: E402
from posttrain.config import build_config  # noqa: E402
from posttrain.logging import MetricsLogger, read_metrics  # noqa: E402
from posttrain.parallel.cluster import ensure_ray  # noqa: E402

PROMPTS, GENERATIONS = 32, 8  # PROMPTS: --prompts
ENGINE_SEQS = 64  # sequences the engine decodes at once: a step's 256 completions take four waves
SHAPE = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2}
PHASES = ("generation", "reward", "logprobs", "training", "weight_sync")


def set_prompts(n: int) -> None:
    global PROMPTS
    PROMPTS = n


def make_cfg(out: str, steps: int, staleness: int, new_tokens: int) -> AsyncGRPORunConfig:
    return build_config(
        AsyncGRPORunConfig,
        {
            "policy": {
                "model": {"tiny": SHAPE},
                "train_global_batch_size": PROMPTS * GENERATIONS,
                "microbatch": {"train_micro_batch_size": 32, "logprob_micro_batch_size": 64},
                "optimizer": {"lr": 1e-4},
                "init_reference_model": False,
            },
            "generation": {"max_num_seqs": ENGINE_SEQS},
            "sampling": {"max_new_tokens": new_tokens, "temperature": 1.0},
            "grpo": {"num_generations_per_prompt": GENERATIONS, "val_period": 0, "val_at_start": False},
            "async_grpo": {
                "num_steps": steps,
                "target_prompt_groups_per_step": PROMPTS,
                "max_staleness": staleness,
                # a call is one engine batch; a second call waits in the actor's queue (Ray runs a
                # synchronous actor's calls in order), so the engine never idles for a round trip
                "max_groups_per_call": ENGINE_SEQS // GENERATIONS,
                "max_in_flight_per_worker": 2 * ENGINE_SEQS // GENERATIONS,
            },
            "rollout": {"backend": "ray", "num_workers": 1, "torch_threads": 1},
            "checkpointing": {"enabled": False, "resume": "never", "overwrite": True},
            "logging": {"progress_bar": False},
            "output_dir": out,
        },
    )


SPIN = (
    "import time\n"
    "t0, c0 = time.perf_counter(), time.process_time()\n"
    "while time.perf_counter() - t0 < {seconds}:\n"
    "    pass\n"
    "print(time.process_time() - c0)\n"
)


def parallel_capacity(seconds: float) -> tuple[float, float]:
    """Cores this machine gives one busy process, and two busy processes together, right now."""
    import subprocess

    out = []
    for n in (1, 2):
        cmd = [sys.executable, "-c", SPIN.format(seconds=seconds)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(n)]
        try:
            outs = [pr.communicate(timeout=seconds + 60)[0] for pr in procs]
        finally:
            for pr in procs:
                pr.kill()  # no-op for those that finished
        if any(pr.returncode for pr in procs):
            raise ChildDied(f"a spin-test process exited with {[pr.returncode for pr in procs]}")
        cpu = sum(float(o) for o in outs)
        out.append(cpu / seconds)
    return out[0], out[1]


def time_sync(cfg: AsyncGRPORunConfig) -> dict[str, float]:
    """The synchronous loop over the same steps (grpo.setup + grpo_step, the body of run_grpo), with
    its own default loss: on-policy, no importance sampling; it skips the prev-logprob pass."""
    sync_cfg = sync_config_like(cfg, loss=ClippedPGConfig())  # the sync loop's own default loss
    run = grpo.setup(sync_cfg, None)
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(sync_cfg.grpo.max_num_steps):
        run.step += 1
        metrics = grpo.grpo_step(run)
        for p in PHASES:
            phases[p].append(metrics[f"timing/{p}_s"])
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    run.policy.shutdown()
    out = {"total_s": total, "cores_used": cpu / total}
    return out | {f"{p}_s": statistics.median(v) for p, v in phases.items()}


def time_async(cfg: AsyncGRPORunConfig) -> dict[str, float]:
    """The asynchronous loop (setup, i.e. policy, engine actor, its model and first weights, not timed)."""
    import ray

    run = setup(cfg)
    log = MetricsLogger(cfg.output_dir)
    # start-up of the rollout actor: one untimed wave pays its process's first-call costs
    wave = [run.task.train.items[i] for i in range(ENGINE_SEQS // GENERATIONS)]
    ray.get(run.actors[0].generate_groups.remote(wave, run.trainer.version), timeout=120)

    def actor_cpu() -> float:
        return ray.get(run.actors[0].__ray_call__.remote(lambda _: time.process_time()), timeout=60)

    try:
        a0, c0, t0 = actor_cpu(), time.process_time(), time.perf_counter()
        summary = asyncio.run(train(run, log))
        total, cpu, a_cpu = time.perf_counter() - t0, time.process_time() - c0, actor_cpu() - a0
    finally:
        log.close()
        close(run)
    steps = [r for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl") if "train/loss" in r]
    assert summary.steps == cfg.async_grpo.num_steps, summary
    return {
        "total_s": total,
        "cores_used": (cpu + a_cpu) / total,
        "trainer_cpu_s": cpu,
        "rollout_cpu_s": a_cpu,
        "step_s": statistics.median(r["step_time_s"] for r in steps),
        "trainer_idle": statistics.median(r["trainer_idle_fraction"] for r in steps),
        "generation_idle": statistics.median(r["generation_idle_fraction"] for r in steps),
        "staleness_mean": statistics.mean(r["staleness/mean"] for r in steps),
        "dropped_stale": float(summary.totals["dropped_stale"]),
        "generated": float(summary.totals["generated_samples"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 steps, one repeat, no warm-up (< 1 minute)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30; quick 4)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; quick 1)")
    ap.add_argument("--new-tokens", type=int, default=32, help="completion length (sets gen vs train)")
    ap.add_argument("--prompts", type=int, default=PROMPTS, help="prompt groups per step (of 8 completions)")
    args = ap.parse_args()
    require("ray", extra="ray")  # the rollout actor; the actor's death fails the ray.get it is in
    set_prompts(args.prompts)
    steps = args.steps or (4 if args.quick else 30)
    repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(1)
    ensure_ray(num_cpus=4)
    kinds = {"sync": 0, "async_s1": 1, "async_s2": 2}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    spin_s = 0.5 if args.quick else 2.0
    with tempfile.TemporaryDirectory(prefix="async_vs_sync_") as tmp:
        if not args.quick:  # first-call costs out of the timings (see the module docstring)
            time_sync(make_cfg(f"{tmp}/warmup", 1, 0, args.new_tokens))
            time_async(make_cfg(f"{tmp}/warmup_async", 1, 1, args.new_tokens))
        capacity = [parallel_capacity(spin_s)]
        for rep in range(repeats):
            order = list(kinds)[rep % 3 :] + list(kinds)[: rep % 3]  # rotate who goes first
            for kind in order:
                cfg = make_cfg(f"{tmp}/{kind}_{rep}", steps, kinds[kind], args.new_tokens)
                results[kind].append(time_sync(cfg) if kind == "sync" else time_async(cfg))
                print(f"  repeat {rep} {kind:9s} {results[kind][-1]['total_s']:7.2f} s", flush=True)
        if not args.quick:
            capacity.append(parallel_capacity(spin_s))

    def med(kind: str, key: str) -> float:
        return median([r[key] for r in results[kind]])

    samples = steps * PROMPTS * GENERATIONS
    print(
        f"\n{steps} steps x {PROMPTS} prompts x {GENERATIONS} completions = {samples} trained samples; "
        f"model {SHAPE}, {args.new_tokens} new tokens, engine batch {ENGINE_SEQS}; {repeats} repeat(s), medians"
    )
    phase = {p: med("sync", f"{p}_s") for p in PHASES}
    train_side = phase["logprobs"] + phase["training"] + phase["weight_sync"]
    print(
        "sync per-step phases: "
        + ", ".join(f"{p} {v:.3f} s" for p, v in phase.items())
        + f"  (generation+reward {phase['generation'] + phase['reward']:.3f} s vs "
        f"logprobs+training+sync {train_side:.3f} s)"
    )
    sync_step_cpu = 1000 * median([r["total_s"] * r["cores_used"] for r in results["sync"]]) / steps
    print(
        f"sync          total {med('sync', 'total_s'):7.2f} s  cores used {med('sync', 'cores_used'):.2f} "
        f"(CPU per step {sync_step_cpu:.0f} ms)"
    )
    for kind in ("async_s1", "async_s2"):
        print(
            f"{kind:13s} total {med(kind, 'total_s'):7.2f} s  step {med(kind, 'step_s'):.3f} s  "
            f"trainer idle {med(kind, 'trainer_idle'):.2f}  generation idle {med(kind, 'generation_idle'):.2f}  "
            f"mean lag {med(kind, 'staleness_mean'):.2f}  dropped stale {med(kind, 'dropped_stale'):.0f}  "
            f"generated {med(kind, 'generated'):.0f} samples\n"
            f"{'':13s} cores used {med(kind, 'cores_used'):.2f} (CPU s: trainer process "
            f"{med(kind, 'trainer_cpu_s'):.2f}, rollout actor {med(kind, 'rollout_cpu_s'):.2f}; per step "
            f"{1000 * med(kind, 'trainer_cpu_s') / steps:.0f} ms and "
            f"{1000 * med(kind, 'rollout_cpu_s') / steps:.0f} ms)"
        )
    one, two = (median([c[i] for c in capacity]) for i in (0, 1))
    print(
        f"machine right now: one busy process gets {one:.2f} cores, two busy processes get {two:.2f} "
        f"together (spin test{'' if args.quick else ', before and after the runs'}); the overlap can "
        f"gain at most ~{two / one:.2f}x here"
    )
    for kind in ("async_s1", "async_s2"):
        bound = max(med(kind, "trainer_cpu_s"), med(kind, "rollout_cpu_s"))
        sync_cpu = med("sync", "total_s") * med("sync", "cores_used")
        print(
            f"{kind}: with a free core per process the wall time would tend to the busier process's CPU "
            f"time, {bound:.2f} s (sync needs {sync_cpu:.2f} CPU s): bound ~{sync_cpu / bound:.2f}x"
        )
    sync_total = med("sync", "total_s")
    print(result_line("async_speedup_staleness1", sync_total / med("async_s1", "total_s"), ">=1.6"))
    print(result_line("async_speedup_staleness2", sync_total / med("async_s2", "total_s"), ">=1.6"))


if __name__ == "__main__":
    run_main(main)
