"""The DPO section of vs_trl.py: posttrain's `run_dpo` vs TRL's `DPOTrainer`, same model, pairs and settings.

Both sides start from vs_trl.py's SFT warm start and train on the same preference pairs: the built-in
arithmetic pairs (posttrain's tasks/preferences.py: a problem's correct answer chosen, a wrong one off by
1-5 rejected, 4 pairs per problem), given to TRL as text that tokenizes to exactly posttrain's ids (checked
on every pair after TRL's own tokenization). Shared settings: pairs per optimizer step, sigmoid loss, beta,
learning rate (constant), AdamW, grad-norm clip, steps, seed.

Reference logprobs: posttrain computes them once before training with the starting weights (the design:
no second model kept); TRL does the same with `precompute_ref_log_probs=True`, so neither side's step
runs a reference forward. A step is timed by wall clock, posttrain: `Policy.train` of the step's batch
(forward, backward, optimizer step over the pairs), TRL: `on_step_begin` to `on_step_end`; both exclude
building the step's batch. The two processes take turns one step at a time (vs_trl.py's `Lockstep`), seeds
alternate which side goes first, medians over all steps but each run's first.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

TASK = {"operations": ["+"], "max_operand": 19}  # the demo's problems (vs_trl.py's TASK)


@dataclasses.dataclass(frozen=True)
class DPOSetting:
    """What both sides share."""

    pairs_per_step: int
    steps: int
    seeds: tuple[int, ...]
    beta: float = 0.1
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    wrong_per_problem: int = 4


QUICK = DPOSetting(pairs_per_step=16, steps=6, seeds=(0,))
FULL = DPOSetting(pairs_per_step=64, steps=40, seeds=(0, 1, 2))


def pairs_of(init: Path, s: DPOSetting):
    """posttrain's training pairs for the warm start's tokenizer, and the tokenizer."""
    from posttrain.policy.config import ModelConfig
    from posttrain.policy.model_init import build_tokenizer
    from posttrain.tasks.preferences import PreferenceDataConfig, build_pairs

    tokenizer = build_tokenizer(ModelConfig(name=str(init)))
    cfg = PreferenceDataConfig(arithmetic=TASK, wrong_per_problem=s.wrong_per_problem)
    return build_pairs(cfg, tokenizer)[0], tokenizer


def posttrain_config(s: DPOSetting, init: Path, out: Path, seed: int):
    from posttrain.algorithms.dpo import DPORunConfig

    rows = 2 * s.pairs_per_step
    return DPORunConfig.model_validate(
        {
            "policy": {
                "model": {"name": str(init)},
                "train_global_batch_size": rows,
                "microbatch": {"train_micro_batch_size": rows, "logprob_micro_batch_size": rows},
                "optimizer": {"lr": s.lr},
                "max_grad_norm": s.max_grad_norm,
                "init_reference_model": False,
            },
            "data": {"arithmetic": TASK, "wrong_per_problem": s.wrong_per_problem, "eval_fraction": 0.0},
            "loss": {"beta": s.beta, "loss_type": "sigmoid"},
            "max_num_steps": s.steps,
            "val_period": 0,
            "seed": seed,
            "save_final_model": False,
            "output_dir": str(out),
            "overwrite": True,  # a --workdir used before
            "logging": {"progress_bar": False},
        }
    )


def train_posttrain(s: DPOSetting, init: Path, out: Path, seed: int, gate) -> dict:
    """run_dpo from `init`, each training step gated by `gate` and timed."""
    from posttrain.algorithms.dpo import run_dpo
    from posttrain.policy.policy import Policy

    cfg = posttrain_config(s, init, out, seed)
    policy = Policy(cfg.policy)
    times: list[float] = []
    inner = policy.train

    def gated_train(batch, loss_fn, eval_mode: bool = False):
        if eval_mode:  # the held-out pass at the end is not a step
            return inner(batch, loss_fn, eval_mode=True)
        gate.begin()
        t0 = time.perf_counter()
        try:
            return inner(batch, loss_fn)
        finally:
            times.append(time.perf_counter() - t0)
            gate.end()

    policy.train = gated_train
    last = run_dpo(cfg, policy)
    policy.shutdown()
    return {"step_times": times, "loss": last.get("loss", float("nan"))}


def train_trl(s: DPOSetting, init: Path, out: Path, seed: int, gate) -> dict:
    """TRL DPOTrainer from `init` on CPU with the matching settings (module docstring)."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, PrinterCallback
    from vs_trl import gated_timer

    pairs, tokenizer = pairs_of(init, s)
    strip = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    rows = [
        {
            "prompt": strip(p.prompt_token_ids),
            "chosen": strip(p.chosen_token_ids),
            "rejected": strip(p.rejected_token_ids),
        }
        for p in pairs
    ]
    args = trl.DPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, fp16=False, report_to="none", disable_tqdm=True,
        save_strategy="no", logging_steps=1, seed=seed, max_steps=s.steps,
        per_device_train_batch_size=s.pairs_per_step, gradient_accumulation_steps=1, learning_rate=s.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=s.max_grad_norm,
        optim="adamw_torch", beta=s.beta, loss_type=["sigmoid"], precompute_ref_log_probs=True,
        gradient_checkpointing=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa")
    timer = gated_timer(gate)
    trainer = trl.DPOTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)
    seen = trainer.train_dataset
    for i, p in enumerate(pairs):  # TRL's tokenization of the text is posttrain's ids, pair by pair
        got = (seen[i]["prompt_ids"], seen[i]["chosen_ids"], seen[i]["rejected_ids"])
        if got != (p.prompt_token_ids, p.chosen_token_ids, p.rejected_token_ids):
            raise AssertionError(f"pair {i}: TRL tokenized {got}, posttrain has {p}")
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"step_times": timer.times, "loss": losses[-1] if losses else float("nan")}


TRAIN = {"posttrain": train_posttrain, "trl": train_trl}


def dpo_section(quick: bool, root: Path, threads: int, run_pair) -> float:
    """Run every seed's pair (vs_trl.run_pair with kind 'dpo'), print the per-seed lines and the summary;
    returns TRL's median seconds per step over posttrain's."""
    from _common import median

    s = QUICK if quick else FULL
    init = root / "sft" / "hf"
    times: dict[str, list[float]] = {"posttrain": [], "trl": []}
    for i, seed in enumerate(s.seeds):
        first = ("posttrain", "trl")[i % 2]
        results = run_pair(s, init, root / "dpo", seed, first=first, threads=threads, kind="dpo")
        for side in ("posttrain", "trl"):
            r = results[side]
            times[side] += r["step_times"][1:]
            print(
                f"dpo {side:9s} seed={seed} median_step={median(r['step_times'][1:]):.4f}s "
                f"process={r['process_s']:.1f}s final_loss={r['loss']:.3f}"
            )
    ours, trl = median(times["posttrain"]), median(times["trl"])
    print(
        f"dpo setting: {s.pairs_per_step} pairs ({2 * s.pairs_per_step} rows) per step, {s.steps} steps, "
        f"beta {s.beta}, lr {s.lr}, seeds {list(s.seeds)}"
    )
    print(f"dpo seconds/step median: posttrain {ours:.4f}  trl {trl:.4f}  speedup {trl / ours:.2f}x")
    return trl / ours
