"""GRPO time to held-out accuracy, posttrain vs TRL, at 20M parameters with 136-token completions.

    python benchmarks/grpo_time_to_acc.py [--quick] [--seeds N] [--workdir DIR]   # needs .[bench]

Model: the size sweep's 20m shape (benchmarks/_sizes.py: Llama-3-style, 6 layers, hidden 384, 32000-token
vocabulary, 21.7M parameters), random init, and its widened character tokenizer (_grpo_at_size.py).
Task: posttrain's `chain` task (posttrain/tasks/chain.py): from a start number x0 (`417:`) write 11 steps
of x -> x + 137 mod 1000 as equations, then `:` and the last value (`417+137=554,...,787+137=924:924`):
136 completion tokens with EOS; right only when the final value is. Problems are the 1000 start
numbers: 800 train, 100 validation, 100 test, never shared.

Warm start: posttrain SFT on the training problems' shown work, batch 16, 200 steps at lr 2e-3 then 100
at lr 1e-3 (a second run from the first's weights; each stage cached in the workdir with its setting).
Both sides then run GRPO from it with the same setting (vs_trl.py's mapping of every option:
token-level loss mean over the step, no KL, clip 0.2, grad-norm clip 1, constant lr, one optimizer
step per generation batch, group-normalized advantages, temperature 1, no reference model, stop at EOS),
and TRL with `optim="adamw_torch_fused"` as in _grpo_at_size.py.

Steps and learning rates: 120 steps of 4 prompts x 4 completions; at 30 steps no lr of 1e-5..2e-4 moved
validation accuracy on either side, and posttrain alone at 5e-5 went 0.34 -> 0.38-0.44 over steps 90-120
(benchmarks/RESULTS.md). The lr is chosen on the validation split for each side alike: one pair of runs
per lr of the grid and validation seed (seeds 1000-1002), each side taking the lr with the best validation
accuracy averaged over its last two evaluations and the seeds (one seed of 100 problems was too noisy to
choose on: its choice collapsed on a test seed, RESULTS.md). Then `--seeds` pairs (seeds 0..N-1, default
10) at the chosen lrs, evaluated on the test split.

Timing: each pair runs in lockstep (vs_trl.run_pair: two processes take turns one step each, both with
`--threads` threads), the clock of a side is the sum of its step times (generate, score, train, and
posttrain's weight sync; start-up excluded). Every `eval_every` steps a side writes its weights to disk
after its step's clock stopped and before the other side's turn; the copies are scored after the pair by
one evaluator for both sides (posttrain's engine, greedy, `rollout.validation.validate`), step 0 being
the warm start.

Kept pairs: every scored pair is written to the workdir and to the ledger `benchmarks/tta_pairs/`
(committed, a few kB per pair) under a key of the setting, the lrs, the split, PAIR_REVISION, the thread
count and a SHA-256 of the warm start's weights. A later run, in any session or workdir, reuses a pair
whose key matches and runs the others, so the grid and the test seeds can be filled in over several
sittings; a warm start that comes out different (another CPU's kernels, a change to SFT) matches
nothing and every pair runs again.

Time to accuracy: on the seed-mean curves (accuracy and clock averaged over seeds at each evaluated
step, smoothed over two evaluations) the target is the highest accuracy both reach, the lower of the
two curves' peaks (a run may fall after its peak, so final accuracies are no target: one below the
warm start would be "reached" at the first evaluation by both and restate the step-time ratio). Each
side's time to it is the clock at its first evaluated step that reaches it; the headline ratio is TRL's
time over posttrain's (`grpo_time_to_acc_vs_trl_chain`), nan when the target is not above the warm
start (no learning measured). Per seed the same is reported where both sides reach
it, with a t-interval of the geometric mean. `heldout_acc_minus_trl_chain`: the per-seed difference of
final test accuracies (paired by seed), mean and 95% t-interval, in points.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import itertools
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, require, result_line, run_main  # noqa: E402
from _stats import HeldoutScorer, curve, final_accuracy, summary, t_interval, time_to  # noqa: E402

SIZE = "20m"
TUNE_SEEDS = (1000, 1001, 1002)  # validation seeds of the lr choice
WINDOW = 2  # evaluations averaged into one point of a curve
# part of a kept pair's key: raise it when a change alters either side's run for the same setting, so
# pairs kept in a workdir from before are run again (2: posttrain's prompt order follows the run seed)
PAIR_REVISION = 2
LEDGER = Path(__file__).parent / "tta_pairs"  # scored pairs kept across sessions (see the docstring)


@dataclasses.dataclass(frozen=True)
class Setting:
    """What both sides share (vs_trl.Setting's fields, which run_pair and the trainers read, and more)."""

    sft_stages: tuple[tuple[int, float], ...]  # (steps, constant lr) of each SFT run, each from the last
    prompts_per_step: int
    generations: int
    max_new_tokens: int
    steps: int
    seeds: tuple[int, ...]
    lrs: tuple[float, ...]
    eval_every: int
    size: str = SIZE
    num_steps: int = 11  # the chain's length (136 completion tokens, EOS included; task default)
    temperature: float = 1.0
    lr: float = 0.0  # set per run from `lrs`
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    sft_batch: int = 16

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.generations

    def task(self, heldout: str) -> dict:
        return {"name": "chain", "num_steps": self.num_steps, "heldout": heldout}


FULL = Setting(
    sft_stages=((200, 2e-3), (100, 1e-3)),
    prompts_per_step=4,
    generations=4,
    max_new_tokens=140,
    steps=120,
    seeds=tuple(range(10)),  # 5 seeds left the CI at +/-6 points (RESULTS.md)
    lrs=(5e-5, 1e-4),
    eval_every=10,
)
# a smoke run of every part (the 3m size, 8-step chains, one seed): under a minute, numbers meaningless
QUICK = Setting(
    sft_stages=((2, 2e-3), (2, 1e-3)),
    prompts_per_step=2,
    generations=2,
    max_new_tokens=40,
    steps=2,
    seeds=(0,),
    lrs=(1e-4,),
    eval_every=1,
    size="3m",
    num_steps=8,
)


# --------------------------------------------------------------------------- warm start


def warm_start(s: Setting, root: Path) -> Path:
    """The SFT warm start of setting `s` under `root`: one SFT run per stage of `s.sft_stages`, each from
    the last one's weights with a fresh optimizer. A stage already there with the same setting (its
    `setting.json`) is reused."""
    from _grpo_at_size import save_model

    from posttrain.algorithms.sft import SFTConfig, run_sft

    init = root / "init"
    if not (init / "config.json").exists():
        save_model(s.size, init)
    key: dict = {"size": s.size, "batch": s.sft_batch, "chain": s.num_steps, "stages": []}
    for i, (steps, lr) in enumerate(s.sft_stages):
        key["stages"].append([steps, lr])
        out = root / f"sft{i}"
        done = (out / "setting.json").exists() and json.loads((out / "setting.json").read_text()) == key
        if not done:
            shutil.rmtree(out, ignore_errors=True)
            cfg = SFTConfig.model_validate(
                {
                    "policy": {
                        "model": {"name": str(init)},
                        "train_global_batch_size": s.sft_batch,
                        "microbatch": {"train_micro_batch_size": s.sft_batch},
                        "optimizer": {"lr": lr},
                        "init_reference_model": False,
                    },
                    "task": s.task("validation"),
                    "max_num_steps": steps,
                    "val_period": 0,
                    "output_dir": str(out),
                    "logging": {"progress_bar": False},
                }
            )
            run_sft(cfg)
            (out / "setting.json").write_text(json.dumps(key))
        init = out / "hf"
    return init


def fingerprint(model_dir: Path) -> str:
    """SHA-256 of the weights saved in `model_dir` (the digests of its safetensors files, in name order)."""
    from posttrain.checkpoint_verify import file_digest

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}: the warm start was not saved")
    return "+".join(file_digest(path) for path in files)


# --------------------------------------------------------------------------- weight copies (in the sides)


def save_copy(out: Path, every: int, model, step: int) -> None:
    """Write `model`'s weights (a posttrain Policy or a transformers model) to `<out>/copies/<step>.pt`
    every `every` steps."""
    import torch

    if step % every:
        return
    state = model.engine_state_dict() if hasattr(model, "engine_state_dict") else model.state_dict()
    (out / "copies").mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().to("cpu", copy=True) for k, v in state.items()}, out / "copies" / f"{step}.pt")


def trainers(s: Setting, heldout: str, lrs: dict[str, float]) -> dict:
    """run_pair's trainers: each side at its lr, on the chain task, writing weight copies."""
    from vs_trl import train_posttrain, train_trl

    def side(fn, name: str, **kw):
        return functools.partial(
            _at_lr, functools.partial(fn, task=s.task(heldout), save=False, **kw), lrs[name], s.eval_every
        )

    return {
        "posttrain": side(train_posttrain, "posttrain"),
        "trl": side(train_trl, "trl", options={"optim": "adamw_torch_fused"}),
    }


def _at_lr(fn, lr: float, every: int, s: Setting, init: Path, out: Path, seed: int, gate) -> dict:
    """`fn` with setting `s` at learning rate `lr`, writing weight copies every `every` steps."""
    return fn(
        dataclasses.replace(s, lr=lr),
        init,
        out,
        seed,
        gate,
        after_step=functools.partial(save_copy, out, every),
    )


# --------------------------------------------------------------------------- evaluation (parent)


class Evaluator:
    """Greedy held-out accuracy of weight copies, one engine for both sides (_stats.HeldoutScorer)."""

    def __init__(self, s: Setting, init: Path, heldout: str) -> None:
        from posttrain.algorithms import grpo

        cfg = grpo.GRPOConfig.model_validate(
            {
                "policy": {"model": {"name": str(init)}, "init_reference_model": False},
                "task": s.task(heldout),
                "sampling": {"max_new_tokens": s.max_new_tokens},
                "generation": {"max_num_seqs": 128},
            }
        )
        self.score = HeldoutScorer(cfg)
        self.start = self.score()  # the warm start, as loaded

    def run(self, out: Path, step_times: list[float]) -> dict:
        """{accuracy, clock} per evaluated step of the side that wrote `out` (step 0: the warm start);
        the copies are deleted once scored."""
        import torch

        clock = [0.0, *itertools.accumulate(step_times)]
        acc, at = {0: self.start}, {0: 0.0}
        for path in sorted((out / "copies").glob("*.pt"), key=lambda p: int(p.stem)):
            step = int(path.stem)
            acc[step], at[step] = self.score(torch.load(path), step), clock[step]
            path.unlink()
        return {"accuracy": acc, "clock": at}


# --------------------------------------------------------------------------- runs


def pairs(
    s: Setting,
    init: Path,
    root: Path,
    seeds,
    heldout: str,
    lrs: dict[str, float],
    threads: int,
    ledger: Path | None = None,
):
    """{side: [result per seed]}: one lockstep pair per seed, each side's copies scored on `heldout`.
    Each scored pair is written to `root` (pair_<heldout>_seed<seed>.json) and to `ledger` (when given)
    with its key, and a later run whose key matches reuses it, so a run that stops loses at most the pair
    under way, and the ledger carries pairs from one session to the next."""
    from vs_trl import SIDES, run_pair

    evaluator = None
    warm = fingerprint(init)
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for i, seed in enumerate(seeds):
        key = json.loads(json.dumps({
            "setting": dataclasses.asdict(dataclasses.replace(s, seeds=())),
            "lrs": lrs,
            "heldout": heldout,
            "revision": PAIR_REVISION,
            "threads": threads,
            "warm_start": warm,
        }))  # fmt: skip
        path = root / f"pair_{heldout}_seed{seed}.json"
        kept_at = ledger / f"pair_{heldout}_seed{seed}_{_digest(key)}.json" if ledger else None
        kept = next((k for k in (_read_pair(path), _read_pair(kept_at)) if k and k["key"] == key), None)
        if kept is not None:
            scored_pair = {side: _with_int_steps(kept[side]) for side in SIDES}
            print(f"  {heldout} seed {seed}: reused the kept pair of {kept.get('date', '?')}", flush=True)
        else:
            t0 = time.perf_counter()
            evaluator = evaluator or Evaluator(s, init, heldout)
            raw = run_pair(
                s, init, root, seed, first=SIDES[i % 2], threads=threads, trainers=trainers(s, heldout, lrs)
            )
            scored_pair = {}
            for side in SIDES:
                r = raw[side]
                scored = evaluator.run(root / f"{side}_seed{seed}", r["step_times"])
                scored_pair[side] = {
                    **scored,
                    "seed": seed,
                    "start": evaluator.start,
                    "step_times": [round(t, 4) for t in r["step_times"]],
                    "rewards": [round(x, 4) for x in r["rewards"]],
                    "completion_lengths": r["completion_lengths"],
                    "phases": r["phases"],
                }
            date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            text = json.dumps({"key": key, "date": date, **scored_pair}, indent=None)
            for where in (path, kept_at):
                if where is not None:
                    where.parent.mkdir(parents=True, exist_ok=True)
                    tmp = where.with_suffix(".tmp")
                    tmp.write_text(text)
                    tmp.replace(where)  # never a half-written pair
            print(f"  (pair took {time.perf_counter() - t0:.0f}s with evaluation)", flush=True)
        for side in SIDES:
            r = scored_pair[side]
            results[side].append(r)
            curve = " ".join(f"{k}:{a:.2f}" for k, a in sorted(r["accuracy"].items()))
            print(
                f"  {heldout} seed {seed} {side:9s} lr {lrs[side]:g}: median step {median(r['step_times'][1:]):.2f}s, "
                f"clock {sum(r['step_times']):.1f}s, mean completion {statistics.mean(r['completion_lengths']):.0f} "
                f"tokens; accuracy by step {curve}"
                + "".join(f"; {k} {v:.2f}s" for k, v in r["phases"].items()),
                flush=True,
            )
    return results, results["posttrain"][0]["start"]


def _digest(key: dict) -> str:
    """A short name for a pair's key (the file name in the ledger; the key itself is in the file)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def _read_pair(path: Path | None) -> dict | None:
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def _with_int_steps(result: dict) -> dict:
    """A result read back from JSON: its per-step dicts keyed by int again."""
    return {
        k: {int(step): v for step, v in val.items()} if k in ("accuracy", "clock") else val
        for k, val in result.items()
    }


def choose_lrs(s: Setting, init: Path, root: Path, threads: int, ledger: Path | None) -> dict[str, float]:
    """Each side's lr of the grid with the best validation accuracy (mean over TUNE_SEEDS of its last two
    evaluations)."""
    if len(s.lrs) == 1:
        return {"posttrain": s.lrs[0], "trl": s.lrs[0]}
    scores: dict[str, dict[float, float]] = {"posttrain": {}, "trl": {}}
    for lr in s.lrs:
        both = {"posttrain": lr, "trl": lr}
        results, _ = pairs(s, init, root / f"tune_{lr:g}", TUNE_SEEDS, "validation", both, threads, ledger)
        for side, runs in results.items():
            scores[side][lr] = statistics.mean(final_accuracy(r, WINDOW) for r in runs)
    for side, by_lr in scores.items():
        print(
            f"validation accuracy by lr, {side}: " + ", ".join(f"{lr:g}: {a:.3f}" for lr, a in by_lr.items())
        )
    return {side: max(by_lr, key=by_lr.get) for side, by_lr in scores.items()}


def mean_curve(runs: list[dict]) -> dict:
    """Accuracy and clock averaged over seeds at each evaluated step."""
    steps = sorted(runs[0]["accuracy"])
    return {
        "accuracy": {k: statistics.mean(r["accuracy"][k] for r in runs) for k in steps},
        "clock": {k: statistics.mean(r["clock"][k] for r in runs) for k in steps},
    }


def report(results: dict[str, list[dict]], acc0: float, lrs: dict[str, float]) -> None:
    finals = {
        side: statistics.mean(final_accuracy(r, WINDOW) for r in runs) for side, runs in results.items()
    }
    means = {side: mean_curve(runs) for side, runs in results.items()}
    curves = {side: curve(mean, WINDOW) for side, mean in means.items()}
    peaks = {side: max(acc for _, _, acc in points) for side, points in curves.items()}
    target = min(peaks.values())
    learned = target > acc0 + 1e-9
    print(
        f"test accuracy: warm start {acc0:.3f}; final (mean over seeds of the last {WINDOW} evaluations) "
        + ", ".join(f"{side} {a:.3f}" for side, a in finals.items())
        + "; peak of the seed-mean curve "
        + ", ".join(f"{side} {a:.3f}" for side, a in peaks.items())
        + f"; target = the lower peak, {target:.3f}"
        + ("" if learned else " (not above the warm start: no learning measured, no time to accuracy)")
    )
    for side, points in curves.items():
        print(f"{side:9s} seed-mean curve (step:clock s:accuracy): " + " ".join(
            f"{k}:{c:.0f}:{a:.3f}" for k, c, a in points
        ))  # fmt: skip
    hits = {side: time_to(mean, target, WINDOW) for side, mean in means.items()}
    for side, hit in hits.items():
        steps = median([median(r["step_times"][1:]) for r in results[side]])
        where = f"at step {hit[1]}, {hit[0]:.1f} s of training" if hit else "not reached on the mean curve"
        print(
            f"{side:9s} (lr {lrs[side]:g}): median step {steps:.2f}s; seed-mean curve reaches the target {where}"
        )
    per_seed = []
    for ours, theirs in zip(results["posttrain"], results["trl"]):
        a, b = time_to(ours, target, WINDOW), time_to(theirs, target, WINDOW)
        if a and b:
            per_seed.append(b[0] / a[0])
        print(
            f"seed {ours['seed']}: time to {target:.3f}: posttrain {a[0] if a else math.nan:.1f}s, "
            f"trl {b[0] if b else math.nan:.1f}s; final acc posttrain {final_accuracy(ours, WINDOW):.3f}, "
            f"trl {final_accuracy(theirs, WINDOW):.3f}"
        )
    if per_seed:
        lo, hi = (math.exp(v) for v in t_interval([math.log(q) for q in per_seed]))
        gmean = math.exp(statistics.mean(math.log(q) for q in per_seed))
        print(
            f"per-seed time-to-target ratio trl/posttrain ({len(per_seed)} seeds where both reach it): "
            + ", ".join(f"{q:.2f}" for q in per_seed)
            + f"; median {median(per_seed):.2f}, geometric mean {gmean:.2f} [{lo:.2f}, {hi:.2f}]"
        )
    diffs = [
        100 * (final_accuracy(a, WINDOW) - final_accuracy(b, WINDOW))
        for a, b in zip(results["posttrain"], results["trl"])
    ]
    print(summary("final test accuracy posttrain - trl", diffs, unit=" pts"))
    lo, _ = t_interval(diffs)
    ratio = hits["trl"][0] / hits["posttrain"][0] if learned and all(hits.values()) else math.nan
    print(result_line("grpo_time_to_acc_vs_trl_chain", ratio, ">=3"))
    print(result_line("heldout_acc_minus_trl_chain", statistics.mean(diffs), ">=-2"))
    print(result_line("heldout_acc_minus_trl_chain_ci_low", lo, ">=-2"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run of every part at 3m (under a minute)")
    ap.add_argument(
        "--seeds",
        type=int,
        default=None,
        help=f"test seeds (default {len(FULL.seeds)}; quick {len(QUICK.seeds)})",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads of every process")
    ap.add_argument("--workdir", default=None, help="keep the warm start and runs here (default: a temp dir)")
    args = ap.parse_args()
    require("trl", "datasets", "scipy")
    import torch

    torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    if args.seeds is not None:
        s = dataclasses.replace(s, seeds=tuple(range(args.seeds)))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        t0 = time.perf_counter()
        init = warm_start(s, root)
        stages = " then ".join(f"{n} steps at lr {lr:g}" for n, lr in s.sft_stages)
        print(f"warm start: SFT {stages} ({time.perf_counter() - t0:.0f}s)", flush=True)
        ledger = None if args.quick else LEDGER  # quick pairs are smoke runs, not results to keep
        lrs = choose_lrs(s, init, root, args.threads, ledger)
        print(f"chosen on validation: posttrain lr {lrs['posttrain']:g}, trl lr {lrs['trl']:g}", flush=True)
        results, acc0 = pairs(s, init, root, s.seeds, "test", lrs, args.threads, ledger)
    print(
        f"setting: {s.size} ({SIZE if not args.quick else s.size}), chain of {s.num_steps} steps, "
        f"{s.prompts_per_step} prompts x {s.generations} completions, {s.steps} steps, eval every "
        f"{s.eval_every}, seeds {list(s.seeds)}, {args.threads} threads per process (lockstep)"
    )
    report(results, acc0, lrs)


if __name__ == "__main__":
    run_main(main)
