"""GRPO end to end: posttrain's `run_grpo` vs TRL's `GRPOTrainer`, same model, task and settings.

Both sides start from the same SFT warm start of the tiny model (posttrain SFT on the arithmetic task,
run once here) and train with the same prompts per step, generations per prompt, completion length,
temperature, learning rate (constant), clip epsilon, no KL term, token-level loss mean, one optimizer
step per generation batch and the same number of steps. Each training run is its own subprocess
(posttrain and TRL never share a process); in full mode the runs are interleaved (ABBA) over seeds.

Reported: median seconds per step (start-up excluded: posttrain's own `step_time_s`, TRL's wall-clock
from `on_step_begin` to `on_step_end`, both covering generate + score + train) and the final held-out
greedy accuracy of each trained model, both evaluated by the same code here (HF `generate`, greedy).

Config mapping (TRL terms): per_device_train_batch_size = prompts x generations (completions per optimizer
step), gradient_accumulation_steps = steps_per_generation = 1, num_iterations = 1, so prompts per step =
per_device_train_batch_size * gradient_accumulation_steps / num_generations. loss_type="dapo" (masked
token sum over the whole generation batch / its token count) is posttrain's token-level mean;
scale_rewards="group" is posttrain's normalize_rewards; beta=0 is reference_policy_kl_penalty=0.

    python benchmarks/vs_trl.py [--quick]      # needs `pip install -e .[bench]` (trl)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line  # noqa: E402

TINY = {"family": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


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
    sft_lr: float = 3e-3
    sft_batch: int = 32

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.generations


QUICK = Setting(sft_steps=40, prompts_per_step=4, generations=4, max_new_tokens=4, steps=4, seeds=(0,))
FULL = Setting(sft_steps=120, prompts_per_step=16, generations=8, max_new_tokens=4, steps=40, seeds=(0, 1))


def _task(tokenizer):
    from posttrain.tasks.arithmetic import ArithmeticTaskConfig
    from posttrain.tasks.build import build_task

    return build_task(ArithmeticTaskConfig(), tokenizer)


# --------------------------------------------------------------------------- warm start


def warm_start(s: Setting, out: Path) -> Path:
    """posttrain SFT of the tiny model on arithmetic; both sides start from `<out>/hf`."""
    from posttrain.algorithms.sft import SFTConfig, run_sft

    cfg = SFTConfig.model_validate(
        {
            "policy": {
                "model": {"name": "tiny", "tiny": TINY},
                "train_global_batch_size": s.sft_batch,
                "microbatch": {"train_micro_batch_size": s.sft_batch},
                "optimizer": {"lr": s.sft_lr},
                "init_reference_model": False,
            },
            "max_num_steps": s.sft_steps,
            "val_period": 0,
            "output_dir": str(out),
            "logging": {"progress_bar": False},
        }
    )
    run_sft(cfg)
    return out / "hf"


# --------------------------------------------------------------------------- the two sides (subprocesses)


def train_posttrain(s: Setting, init: Path, out: Path, seed: int) -> dict:
    """run_grpo from `init`; saves the final model to `<out>/final`."""
    from posttrain.algorithms.grpo import GRPOConfig, run_grpo
    from posttrain.logging import read_metrics
    from posttrain.policy.policy import Policy

    n = s.samples_per_step
    cfg = GRPOConfig.model_validate(
        {
            "policy": {
                "model": {"name": str(init)},
                "train_global_batch_size": n,
                "microbatch": {"train_micro_batch_size": n, "logprob_micro_batch_size": n},
                "optimizer": {"lr": s.lr},
                "max_grad_norm": 1.0,
                "logprob_temperature": s.temperature,
                "init_reference_model": False,
            },
            "generation": {"max_num_seqs": n},
            "sampling": {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature},
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
            "checkpointing": {"enabled": False, "resume": "never"},
            "logging": {"progress_bar": False},
            "output_dir": str(out),
        }
    )
    t0 = time.perf_counter()
    policy = Policy(cfg.policy)
    run_grpo(cfg, policy)
    total = time.perf_counter() - t0
    policy.prepare_for_lp_inference()
    policy.save_hf(str(out / "final"))
    records = [r for r in read_metrics(out / "metrics.jsonl") if "step_time_s" in r]
    phases = sorted({k for r in records for k in r if k.startswith("timing/")})
    return {
        "step_times": [r["step_time_s"] for r in records],
        "phases": {k: median([r[k] for r in records if k in r]) for k in phases},
        "rewards": [r.get("reward", float("nan")) for r in records],
        "total_s": total,
    }


def train_trl(s: Setting, init: Path, out: Path, seed: int) -> dict:
    """TRL GRPOTrainer from `init` on CPU with the matching config; saves the final model to `<out>/final`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(init)
    task = _task(tokenizer)
    # TRL tokenizes prompt text without adding special tokens here, so the BOS posttrain prepends is
    # written into the text: both sides see exactly the same prompt token ids.
    by_text = {tokenizer.bos_token + it.prompt: it for it in task.train.items}
    assert all(tokenizer(t)["input_ids"] == list(it.prompt_token_ids) for t, it in by_text.items())

    def arithmetic_reward(prompts, completions, **_):
        items = [by_text[p] for p in prompts]
        res = task.reward([it.prompt for it in items], completions, [it.metadata for it in items])
        return [None if f else r for r, f in zip(res.rewards, res.failed)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)

    args = GRPOConfig(
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
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=0.0,
        epsilon=s.clip_eps,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        gradient_checkpointing=False,
        use_vllm=False,
    )
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa")
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": t} for t in by_text]),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    total = time.perf_counter() - t0
    trainer.model.save_pretrained(out / "final", safe_serialization=True)
    tokenizer.save_pretrained(out / "final")
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"step_times": timer.times, "rewards": [h["reward"] for h in logs], "total_s": total}


SIDES = {"posttrain": train_posttrain, "trl": train_trl}


def run_side(side: str, s: Setting, init: Path, out: Path, seed: int) -> dict:
    """One training run in a fresh interpreter; returns its timing record."""
    payload = json.dumps({"setting": dataclasses.asdict(s), "init": str(init), "out": str(out), "seed": seed})
    subprocess.run([sys.executable, __file__, "--side", side, "--payload", payload], check=True)
    return json.loads((out / "result.json").read_text())


# --------------------------------------------------------------------------- evaluation (same code for both)


def heldout_accuracy(model_dir: Path, max_new_tokens: int) -> float:
    """Greedy held-out accuracy of a saved model on the arithmetic eval prompts (HF generate)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    task = _task(tokenizer)
    items = task.eval.items
    width = max(len(it.prompt_token_ids) for it in items)
    pad = tokenizer.pad_token_id
    ids = torch.tensor(
        [[pad] * (width - len(it.prompt_token_ids)) + list(it.prompt_token_ids) for it in items]
    )
    mask = (
        torch.arange(width)[None, :]
        >= torch.tensor([width - len(it.prompt_token_ids) for it in items])[:, None]
    ).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    res = task.reward([it.prompt for it in items], texts, [it.metadata for it in items])
    return sum(r >= 1.0 and not f for r, f in zip(res.rewards, res.failed)) / len(items)


# --------------------------------------------------------------------------- main


def child(side: str, payload: str) -> None:
    p = json.loads(payload)
    s = Setting(**{**p["setting"], "seeds": tuple(p["setting"]["seeds"])})
    out = Path(p["out"])
    out.mkdir(parents=True, exist_ok=True)
    result = SIDES[side](s, Path(p["init"]), out, p["seed"])
    (out / "result.json").write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--payload", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return child(args.side, args.payload)
    s = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        t0 = time.perf_counter()
        init = warm_start(s, root / "sft")
        print(f"warm start: {s.sft_steps} SFT steps in {time.perf_counter() - t0:.1f}s")
        acc0 = heldout_accuracy(init, s.max_new_tokens)
        times: dict[str, list[float]] = {"posttrain": [], "trl": []}
        accs: dict[str, list[float]] = {"posttrain": [], "trl": []}
        for i, seed in enumerate(s.seeds):
            order = ("posttrain", "trl") if i % 2 == 0 else ("trl", "posttrain")  # ABBA interleave
            for side in order:
                out = root / f"{side}_seed{seed}"
                r = run_side(side, s, init, out, seed)
                acc = heldout_accuracy(out / "final", s.max_new_tokens)
                times[side] += r["step_times"][1:]  # the first step carries warm-up
                accs[side].append(acc)
                extra = "".join(f" {k[7:-2]}={v:.3f}" for k, v in r.get("phases", {}).items())
                print(
                    f"{side:9s} seed={seed} median_step={median(r['step_times'][1:]):.3f}s total={r['total_s']:.1f}s "
                    f"reward first/last={r['rewards'][0]:.2f}/{r['rewards'][-1]:.2f} heldout_acc={acc:.3f}{extra}"
                )
    ours, trl = median(times["posttrain"]), median(times["trl"])
    acc_ours, acc_trl = sum(accs["posttrain"]) / len(accs["posttrain"]), sum(accs["trl"]) / len(accs["trl"])
    print(
        f"setting: {s.prompts_per_step} prompts x {s.generations} generations, {s.max_new_tokens} new tokens, "
        f"lr {s.lr}, {s.steps} steps, seeds {list(s.seeds)}"
    )
    print(f"heldout accuracy after SFT warm start: {acc0:.3f}")
    print(f"seconds/step median: posttrain {ours:.3f}  trl {trl:.3f}  speedup {trl / ours:.2f}x")
    print(f"heldout accuracy (mean over seeds): posttrain {acc_ours:.3f}  trl {acc_trl:.3f}")
    print(result_line("grpo_speedup_vs_trl", trl / ours, ">=2"))
    print(result_line("heldout_acc_minus_trl", 100 * (acc_ours - acc_trl), ">=0"))


if __name__ == "__main__":
    main()
