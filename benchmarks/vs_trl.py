"""GRPO end to end: posttrain's `run_grpo` vs TRL's `GRPOTrainer`, same model, task and settings; then
DPO step time, `run_dpo` vs TRL's `DPOTrainer` (_dpo_vs_trl.py, from the same warm start).

Both sides start from the same SFT warm start of the tiny model (posttrain SFT on the demo's
arithmetic task, a + b with operands 0..19, run once here) and train with the same prompts per step, generations per prompt, completion length,
temperature, learning rate (constant), clip epsilon, no KL term, token-level loss mean, grad-norm clip,
one optimizer step per generation batch and the same number of steps.

Timing on a shared machine: each pair of runs (one posttrain, one TRL, same seed) runs as two
processes in lockstep. Both start up, meet at a barrier, then take turns one step each, so every
posttrain step has a TRL neighbour under the same background load; start-up is excluded. A step is
timed by wall clock around the whole step on both sides (posttrain: `grpo_step`, i.e. generate, score,
advantages, logprobs, train, weight sync; TRL: `on_step_begin` to `on_step_end`, i.e. generate, score,
train). Seeds alternate which side goes first. Medians over all steps but each run's first. Every
process uses one intra-op thread by default (`--threads`): with two on a shared 2-core machine,
OpenMP barrier stalls dominate the tiny model's ops, on both sides alike.

Accuracy: each final model is saved and evaluated by the same code here, greedy decoding of the
held-out arithmetic prompts with HF `generate`; the mean over seeds is reported.

Config mapping (TRL terms): per_device_train_batch_size = prompts x generations (completions per
optimizer step), gradient_accumulation_steps = steps_per_generation = 1, num_iterations = 1, so
prompts per step = per_device_train_batch_size * gradient_accumulation_steps / num_generations.
loss_type="dapo" (masked token sum over the generation batch / its token count) is posttrain's
token-level mean; scale_rewards="group" is normalize_rewards; beta=0 is reference_policy_kl_penalty=0;
epsilon is ratio_clip_min = ratio_clip_max; lr_scheduler_type="constant" is posttrain's empty schedule.

posttrain otherwise runs with its defaults, which on this one-process CPU run means: the engine aliases
the trainer's weights (weight_sync.share=auto: a sync copies nothing, the probe check still runs),
colocation moves nothing (host memory is shared), and each prompt group's prompt runs once in the
training forward (microbatch.share_prefix: same logprobs and gradients, about half the tokens here).

    python benchmarks/vs_trl.py [--quick]      # needs trl: pip install -e .[bench]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    ChildDied,
    median,
    require,
    result_line,
    run_main,
    same_host_memory,
    start,
    wait_for,
    watch,
)

TINY = {"family": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
# the demo's task: a + b for a, b in 0..19 (400 problems, 80 held out), where GRPO measurably helps
TASK = {"name": "arithmetic", "operations": ["+"], "max_operand": 19}
# bound on waiting for the other side while it is alive (a dead side is noticed within a second)
WAIT_S = 900.0


@dataclasses.dataclass(frozen=True)
class Setting:
    """What both sides share."""

    sft_steps: int
    prompts_per_step: int
    generations: int
    max_new_tokens: int
    steps: int
    seeds: tuple[int, ...]
    temperature: float = 1.0
    lr: float = 1e-3
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    sft_lr: float = 3e-3
    sft_batch: int = 32

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.generations


QUICK = Setting(sft_steps=10, prompts_per_step=4, generations=4, max_new_tokens=4, steps=4, seeds=(0,))
# lr 3e-4 for 150 steps: the setting where GRPO raises held-out accuracy on this task (posttrain alone,
# seed 0: 0.237 -> 0.438); at lr 1e-3 for 40 steps both sides ended below the warm start, so the
# accuracy comparison measured noise
FULL = Setting(
    sft_steps=150, prompts_per_step=16, generations=8, max_new_tokens=4, steps=150, seeds=(0, 1, 2), lr=3e-4
)


def _task(tokenizer, task: dict | None = None):
    """The task `task` (a `task:` section, default TASK) built with `tokenizer`."""
    from pydantic import TypeAdapter

    from posttrain.tasks.build import TaskConfig, build_task

    return build_task(TypeAdapter(TaskConfig).validate_python(task or TASK), tokenizer)


class Lockstep:
    """Two processes take turns one step at a time, after both are ready (see the module docstring).

    Every wait polls: it gives up within a second when the parent sets `abort` (the other side died)
    or the parent itself died (`_common.wait_for`)."""

    def __init__(self, ctx, first: int) -> None:
        self.ready = [ctx.Event(), ctx.Event()]
        self.turn = [ctx.Semaphore(int(first == 0)), ctx.Semaphore(int(first == 1))]
        self.abort = ctx.Event()
        self.me = -1
        self.started = False

    def _wait(self, ready, what: str) -> None:
        wait_for(ready, f"the {SIDES[1 - self.me]} side {what}", timeout_s=WAIT_S, abort=self.abort)

    def begin(self) -> None:
        if not self.started:
            self.ready[self.me].set()
            self._wait(self.ready[1 - self.me].wait, "to start up")
            self.started = True
        self._wait(lambda t: self.turn[self.me].acquire(timeout=t), "to finish its step")

    def end(self) -> None:
        self.turn[1 - self.me].release()


# --------------------------------------------------------------------------- warm start


def warm_start(s: Setting, out: Path, model: dict | None = None, source: dict | None = None) -> Path:
    """posttrain SFT of the tiny model (`model`, default: the tiny char model) on arithmetic (or on
    `source`, a `task:` or `env:` section); both sides start from `<out>/hf`."""
    from posttrain.algorithms.sft import SFTConfig, run_sft

    cfg = SFTConfig.model_validate(
        {
            "policy": {
                "model": model or {"name": "tiny", "tiny": TINY},
                "train_global_batch_size": s.sft_batch,
                "microbatch": {"train_micro_batch_size": s.sft_batch},
                "optimizer": {"lr": s.sft_lr},
                "init_reference_model": False,
            },
            **(source or {"task": TASK}),
            "max_num_steps": s.sft_steps,
            "val_period": 0,
            "output_dir": str(out),
            "overwrite": True,  # a --workdir used before: the warm start runs again
            "logging": {"progress_bar": False},
        }
    )
    run_sft(cfg)
    return out / "hf"


# --------------------------------------------------------------------------- the two sides


def _merged(base: dict, extra: dict) -> dict:
    """`base` with the keys of `extra` set; where both hold a section (a dict), merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _merged(base[key], value) if both else value
    return out


def policy_section(s, init: Path) -> dict:
    """The `policy:` section of a posttrain GRPO run of setting `s` from `init`: one micro-batch per
    step, constant lr, no reference model (this benchmark and async_vs_sync_learning.py)."""
    n = s.samples_per_step
    return {
        "model": {"name": str(init)},
        "train_global_batch_size": n,
        "microbatch": {"train_micro_batch_size": n, "logprob_micro_batch_size": n},
        "optimizer": {"lr": s.lr},
        "max_grad_norm": s.max_grad_norm,
        "logprob_temperature": s.temperature,
        "init_reference_model": False,
    }


def posttrain_config(
    s, init: Path, out: Path, seed: int, source: dict, max_new_tokens: int, overrides: dict | None = None
):
    """The posttrain side's GRPOConfig for setting `s` from `init`; `source` is the `task:` or `env:`
    section (this benchmark and benchmarks/multiturn.py share it); `overrides` sets further keys,
    section by section (e.g. {"sampling": {"stop_at_eos": False}})."""
    from posttrain.algorithms import grpo

    n = s.samples_per_step
    base = {
        "policy": policy_section(s, init),
        **source,
        "generation": {"max_num_seqs": n},
        "sampling": {"max_new_tokens": max_new_tokens, "temperature": s.temperature},
        "loss": {
            "ratio_clip_min": s.clip_eps,
            "ratio_clip_max": s.clip_eps,
            "reference_policy_kl_penalty": 0.0,
        },
        "grpo": {
            "num_prompts_per_step": s.prompts_per_step,
            "num_generations_per_prompt": s.generations,
            "max_num_steps": s.steps,
            "val_period": 0,
            "val_at_start": False,
            "seed": seed,
        },
        "checkpointing": {"enabled": False, "resume": "never", "overwrite": True},
        "logging": {"progress_bar": False},
        "output_dir": str(out),
    }
    return grpo.GRPOConfig.model_validate(_merged(base, overrides or {}))


def run_gated(cfg, gate: Lockstep, after_step: Callable | None = None):
    """run_grpo on its own policy, each step gated by `gate`; returns (step seconds, policy,
    metrics records with a step time, median seconds per phase). `after_step(policy, step)` runs after
    each timed step, before the other side's turn (so its time counts on neither side)."""
    from posttrain.algorithms import grpo
    from posttrain.logging import read_metrics
    from posttrain.policy.policy import Policy

    times: list[float] = []
    inner = grpo.grpo_step

    def gated_step(run):  # run_grpo looks grpo_step up in its module on every step
        gate.begin()
        t0 = time.perf_counter()
        try:
            return inner(run)
        finally:
            times.append(time.perf_counter() - t0)
            try:
                if after_step is not None:
                    after_step(run.policy, len(times))
            finally:
                gate.end()

    grpo.grpo_step = gated_step
    policy = Policy(cfg.policy)
    grpo.run_grpo(cfg, policy)
    records = [r for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl") if "step_time_s" in r]
    phases = sorted({k for r in records for k in r if k.startswith("timing/")})
    return times, policy, records, {k[7:-2]: median([r[k] for r in records if k in r]) for k in phases}


def train_posttrain(
    s: Setting,
    init: Path,
    out: Path,
    seed: int,
    gate: Lockstep,
    overrides: dict | None = None,
    save: bool = True,
    task: dict | None = None,
    after_step: Callable | None = None,
) -> dict:
    """run_grpo from `init` on `task` (a `task:` section, default TASK; each step gated by `gate`;
    `overrides`: posttrain_config's; `after_step`: run_gated's); with `save`, saves the final model to
    `<out>/final`."""
    cfg = posttrain_config(s, init, out, seed, {"task": task or TASK}, s.max_new_tokens, overrides)
    times, policy, records, phases = run_gated(cfg, gate, after_step)
    if save:
        policy.prepare_for_lp_inference()
        policy.save_hf(str(out / "final"))
    return {
        "step_times": times,
        "phases": phases,
        "rewards": [r.get("reward", float("nan")) for r in records],
        "completion_lengths": [r["completion_length"] for r in records],
    }


def gated_timer(gate: Lockstep, after_step: Callable | None = None):
    """A TRL callback that gates every step by `gate` and records its seconds (`.times`);
    `after_step(model, step)` runs after each timed step, before the other side's turn."""
    from transformers import TrainerCallback

    class GatedStepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            gate.begin()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.times.append(time.perf_counter() - self.t0)
            try:
                if after_step is not None:
                    after_step(model, len(self.times))
            finally:
                gate.end()

    return GatedStepTimer()


def trl_args(s, out: Path, seed: int, max_completion_length: int, **extra):
    """TRL's GRPOConfig matching posttrain_config (the mapping of the module docstring); `extra`
    adds or overrides fields (e.g. max_tool_calling_iterations)."""
    from trl import GRPOConfig

    fields = dict(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        seed=seed,
        max_steps=s.steps,
        per_device_train_batch_size=s.samples_per_step,
        gradient_accumulation_steps=1,
        num_generations=s.generations,
        num_iterations=1,
        max_completion_length=max_completion_length,
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=s.max_grad_norm,
        optim="adamw_torch",
        beta=0.0,
        epsilon=s.clip_eps,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        gradient_checkpointing=False,
        use_vllm=False,
    )
    return GRPOConfig(**{**fields, **extra})


def train_trl(
    s: Setting,
    init: Path,
    out: Path,
    seed: int,
    gate: Lockstep,
    options: dict | None = None,
    save: bool = True,
    task: dict | None = None,
    after_step: Callable | None = None,
) -> dict:
    """TRL GRPOTrainer from `init` on CPU on `task` (default TASK), matching config (module docstring;
    `options`: further GRPOConfig fields, as trl_args' `extra`; `after_step`: gated_timer's); with
    `save`, the final model to `<out>/final`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(init)
    task = _task(tokenizer, task)
    # TRL tokenizes the prompt text as is; posttrain prepends BOS to the ids, so the text carries it:
    # both sides see exactly the same prompt token ids (checked).
    by_text = {tokenizer.bos_token + it.prompt: it for it in task.train.items}
    assert all(tokenizer(t)["input_ids"] == list(it.prompt_token_ids) for t, it in by_text.items())

    def task_reward(prompts, completions, **_):
        items = [by_text[p] for p in prompts]
        res = task.reward([it.prompt for it in items], completions, [it.metadata for it in items])
        return [None if f else r for r, f in zip(res.rewards, res.failed)]

    args = trl_args(s, out, seed, s.max_new_tokens, **(options or {}))
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa")
    timer = gated_timer(gate, after_step)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": t} for t in by_text]),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts on the console
    trainer.train()
    if save:
        trainer.model.save_pretrained(out / "final", safe_serialization=True)
        tokenizer.save_pretrained(out / "final")
    logs = trainer.state.log_history
    return {
        "step_times": timer.times,
        "phases": {},
        "rewards": [h["reward"] for h in logs if "reward" in h],
        "completion_lengths": [h["completions/mean_length"] for h in logs if "completions/mean_length" in h],
    }


SIDES = ("posttrain", "trl")
TRAIN = {"posttrain": train_posttrain, "trl": train_trl}


def _trainer(kind: str, side: str):
    """The function that trains `side` in section `kind` (grpo: above; dpo: _dpo_vs_trl.py)."""
    if kind == "dpo":
        from _dpo_vs_trl import TRAIN as DPO_TRAIN

        return DPO_TRAIN[side]
    return TRAIN[side]


def _side_main(
    side: str,
    s,
    init: Path,
    out: Path,
    seed: int,
    gate: Lockstep,
    threads: int,
    results,
    kind: str,
    train: Callable | None,
) -> None:
    import torch

    torch.set_num_threads(threads)
    same_host_memory()  # both sides' processes, as posttrain's workers set their own
    t0 = time.perf_counter()
    gate.me = SIDES.index(side)
    result = (train or _trainer(kind, side))(s, init, out, seed, gate)
    results[side] = {**result, "process_s": time.perf_counter() - t0}


def run_pair(
    s,
    init: Path,
    root: Path,
    seed: int,
    first: str,
    threads: int = 1,
    kind: str = "grpo",
    trainers: Mapping[str, Callable] | None = None,
) -> dict[str, dict]:
    """One posttrain and one TRL run of section `kind` with setting `s` and `seed`, in lockstep; `first`
    takes the first step. `trainers` replaces the function that trains a side (picklable, called as
    `fn(s, init, out, seed, gate)` in the side's process, e.g. a `functools.partial` of train_posttrain
    with overrides); by default section `kind`'s."""
    trainers = trainers or {}
    ctx = mp.get_context("spawn")
    gate = Lockstep(ctx, SIDES.index(first))
    with ctx.Manager() as manager:
        results = manager.dict()
        args = {
            side: (
                side,
                s,
                init,
                root / f"{side}_seed{seed}",
                seed,
                gate,
                threads,
                results,
                kind,
                trainers.get(side),
            )
            for side in SIDES
        }
        watch(start(ctx, {side: (_side_main, args[side]) for side in SIDES}), abort=gate.abort)
        missing = [side for side in SIDES if side not in results]
        if missing:
            raise ChildDied(f"the {' and '.join(missing)} process exited without a result")
        return dict(results)


# --------------------------------------------------------------------------- evaluation (same code for both)


def heldout_accuracy(model_dir: Path, max_new_tokens: int) -> float:
    """Greedy accuracy of a saved model on the held-out arithmetic prompts (HF generate, one batch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    items = _task(tokenizer).eval.items
    width = max(len(it.prompt_token_ids) for it in items)
    ids = torch.full((len(items), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for i, it in enumerate(items):  # left padding
        ids[i, width - len(it.prompt_token_ids) :] = torch.tensor(it.prompt_token_ids)
        mask[i, width - len(it.prompt_token_ids) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    res = _task(tokenizer).reward([it.prompt for it in items], texts, [it.metadata for it in items])
    return sum(r >= 1.0 and not f for r, f in zip(res.rewards, res.failed)) / len(items)


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny setting, under a minute")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of every process")
    ap.add_argument("--only", choices=["grpo", "dpo"], default=None, help="run one section (both by default)")
    args = ap.parse_args()
    require("trl", "datasets")  # before the warm start, not after it
    import torch

    torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    accs: dict[str, list[float]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        t0 = time.perf_counter()
        init = warm_start(s, root / "sft")
        acc0 = heldout_accuracy(init, s.max_new_tokens)
        print(
            f"warm start: {s.sft_steps} SFT steps in {time.perf_counter() - t0:.1f}s, heldout_acc={acc0:.3f}"
        )
        for i, seed in enumerate(s.seeds if args.only != "dpo" else ()):
            results = run_pair(s, init, root, seed, first=SIDES[i % 2], threads=args.threads)
            for side in SIDES:
                r = results[side]
                acc = heldout_accuracy(root / f"{side}_seed{seed}" / "final", s.max_new_tokens)
                times[side] += r["step_times"][1:]  # the first step carries warm-up
                accs[side].append(acc)
                phases = "".join(f" {k}={v:.3f}" for k, v in r["phases"].items())
                print(
                    f"{side:9s} seed={seed} median_step={median(r['step_times'][1:]):.3f}s "
                    f"process={r['process_s']:.1f}s reward first/last={r['rewards'][0]:.2f}/{r['rewards'][-1]:.2f} "
                    f"heldout_acc={acc:.3f}{phases}"
                )
        if args.only != "grpo":
            from _dpo_vs_trl import dpo_section

            dpo_speedup = dpo_section(args.quick, root, args.threads, run_pair)
    if args.only == "dpo":
        print(result_line("dpo_speedup_vs_trl", dpo_speedup, ">=1.5"))
        return
    ours, trl = median(times["posttrain"]), median(times["trl"])
    acc_ours, acc_trl = (sum(accs[side]) / len(accs[side]) for side in SIDES)
    print(
        f"setting: {s.prompts_per_step} prompts x {s.generations} generations, {s.max_new_tokens} new tokens, "
        f"lr {s.lr}, {s.steps} steps, seeds {list(s.seeds)}, {args.threads} thread(s) per process"
    )
    print(f"seconds/step median: posttrain {ours:.3f}  trl {trl:.3f}  speedup {trl / ours:.2f}x")
    print(
        f"heldout accuracy (mean over seeds): posttrain {acc_ours:.3f}  trl {acc_trl:.3f}  (start {acc0:.3f})"
    )
    print(result_line("grpo_speedup_vs_trl", trl / ours, ">=2"))
    print(result_line("heldout_acc_minus_trl", 100 * (acc_ours - acc_trl), ">=0"))
    if args.only is None:
        print(result_line("dpo_speedup_vs_trl", dpo_speedup, ">=1.5"))


if __name__ == "__main__":
    run_main(main)
