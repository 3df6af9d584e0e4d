"""GRPO step time at one size of the size sweep (_sizes.py): posttrain's `run_grpo`, with the shared-prefix
training forward on (`policy.microbatch.share_prefix`, its default) and off, vs TRL's `GRPOTrainer`.

For benchmarks/sweep.py (`grpo_step_times`), and on its own:

    python benchmarks/_grpo_at_size.py --size 20m [--quick] [--threads N] [--workdir DIR]

The model is a random-init `tiny` decoder of the size's shape with the sweep's 32000-token vocabulary,
saved once with its tokenizer to `<workdir>/model`, from which both sides load it (the runs write to
`<workdir>/share` and `<workdir>/noshare`). The tokenizer is posttrain's character tokenizer (tiny's
own) widened to 32000 tokens by one token per extra character (CJK and the code points after it, below
the surrogates), so every id decodes. No SFT: the numbers are timings only. The task and reward are
vs_trl.py's (arithmetic, prompts `<s>a+b=` of 5 to 7 tokens); on a random model nearly every reward is
0, which costs both sides the same (they still generate, score, compute the loss, backpropagate and
step the optimizer).

Both sides generate exactly `max_new_tokens` tokens per completion (checked after every run): posttrain
with `sampling.stop_at_eos=False`; TRL with `generation_kwargs={"min_new_tokens": max_new_tokens}`, which
keeps EOS from being sampled (TRL cuts a completion's loss mask at its first EOS whatever the stopping
rule, so not stopping at EOS alone would not do).

Setting: 4 prompts x 4 generations per step, 128 new tokens, 3 steps (quick: 2 x 2, 16 new tokens, 2
steps), seed 0, vs_trl.py's mapping of every other setting (its module docstring). The timing is
vs_trl.py's: each posttrain variant runs in lockstep with its own TRL run (`run_pair`, one step each in
turn, so both see the same background load), step wall clock on both sides, medians over all steps but
each run's first. The share-prefix pair has posttrain take the first step, the no-share pair TRL.

At these lengths the shared-prefix plan is not taken: it runs only when it drops at least a quarter of a
micro-batch's tokens, i.e. for G completions of C tokens per prompt of P tokens when (G-1)P >= G(P+C)/4
(P >= C/2 at G=4, P >= C at G=2); a prompt of 5 to 7 tokens before 16 or 128 new tokens saves far less,
so the two posttrain variants run the same code and differ by noise. Both are measured so that the
comparison holds at any prompt length.

TRL's options, from those trl 1.16 has for a CPU run:
- enabled: `optim="adamw_torch_fused"` (AdamW's fused kernel, which posttrain's AdamW also uses by
  default for fp32 parameters on CPU; TRL's default is the unfused one); as in vs_trl.py, SDPA
  attention, no gradient checkpointing, no reference model (beta=0), no vLLM.
- tried, not used: `use_transformers_continuous_batching` (transformers' paged generation engine): works
  on CPU but made a step 4.5x slower (3m model, 16 completions of 64 tokens: 12.4s vs 2.8s);
  `cache_implementation="static"`: no faster without compilation (3.1s vs 2.8s there).
- not available: `use_liger_kernel` (liger-kernel is not installed; TRL also deprecates it) and its
  replacement, Hub kernels (`model_init_kwargs={"use_kernels": True}`: the `kernels` package is not
  installed and it downloads kernels from the Hub); GRPOConfig has no padding-free option (SFT and DPO
  have). Left off: `torch_compile` (its compile time would dominate a 3-step run) and bf16 (it would
  change the precision; posttrain runs in fp32).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _sizes  # noqa: E402
from _common import median, require, run_main  # noqa: E402

SEED = 0


def setting(quick: bool):
    """The shared setting (vs_trl.Setting; no SFT steps: there is no warm start)."""
    from vs_trl import Setting

    if quick:
        return Setting(
            sft_steps=0, prompts_per_step=2, generations=2, max_new_tokens=16, steps=2, seeds=(SEED,)
        )
    return Setting(sft_steps=0, prompts_per_step=4, generations=4, max_new_tokens=128, steps=3, seeds=(SEED,))


def sweep_tokenizer():
    """posttrain's character tokenizer widened to `_sizes.VOCAB` tokens, one per extra character."""
    from posttrain.models.tokenizer import DEFAULT_CHARS, build_char_tokenizer

    room = _sizes.VOCAB - len(build_char_tokenizer())
    tokenizer = build_char_tokenizer(DEFAULT_CHARS + "".join(chr(0x4E00 + i) for i in range(room)))
    if len(tokenizer) != _sizes.VOCAB:
        raise RuntimeError(f"the widened tokenizer has {len(tokenizer)} tokens, not {_sizes.VOCAB}")
    return tokenizer


def save_model(size: str, out: Path) -> tuple[int, tuple[int, int]]:
    """Save the random-init model of `size` and its tokenizer to `out`; returns its parameter count and
    the (shortest, longest) prompt in tokens."""
    from vs_trl import _task

    from posttrain.models.hf import TinyModelConfig, build_tiny_model
    from posttrain.tokenizer_files import save_tokenizer

    tokenizer = sweep_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=SEED, cfg=TinyModelConfig(**_sizes.shape(size)))
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    prompts = [len(it.prompt_token_ids) for it in _task(tokenizer).train.items]
    return sum(p.numel() for p in model.parameters()), (min(prompts), max(prompts))


def _timed_steps(result: dict, side: str, max_new_tokens: int) -> list[float]:
    """A run's step times but the first; raises when a completion was not `max_new_tokens` long."""
    lengths = result["completion_lengths"]
    if not lengths or any(n != max_new_tokens for n in lengths):
        raise RuntimeError(
            f"the {side} run generated mean completion lengths {lengths} per step, not {max_new_tokens} "
            "tokens each: a completion stopped early, so the two sides did not do the same work"
        )
    return result["step_times"][1:]


def grpo_step_times(
    size: str, *, quick: bool, threads: int = 1, workdir: Path, cpu_matmul: str = "torch"
) -> dict:
    """Time GRPO steps at sweep size `size` (module docstring), under `workdir`, every process with
    `threads` intra-op threads, posttrain with `policy.model.cpu_matmul=cpu_matmul`. Returns:

    - `share_s`, `noshare_s`, `trl_s`: median seconds per step of posttrain with
      `policy.microbatch.share_prefix` on and off, and of TRL (over both TRL runs), first steps excluded;
    - `speedup_share`, `speedup_noshare`: TRL's median over posttrain's, each from its own lockstep pair;
    - `prompt_tokens` (shortest, longest, BOS included), `completion_tokens`, `samples_per_step`
      (completions per step), `params` (the model's parameter count, tied embeddings once).
    """
    if size not in _sizes.SIZES:
        raise ValueError(f"unknown size {size!r}; the sweep's sizes are {', '.join(_sizes.SIZES)}")
    require("trl", "datasets")
    from vs_trl import SIDES, run_pair, train_posttrain, train_trl

    s = setting(quick)
    root = Path(workdir)
    init = root / "model"
    params, prompt_tokens = save_model(size, init)
    trl = functools.partial(
        train_trl,
        options={"optim": "adamw_torch_fused", "generation_kwargs": {"min_new_tokens": s.max_new_tokens}},
        save=False,
    )
    medians: dict[str, float] = {}
    speedups: dict[str, float] = {}
    trl_steps: list[float] = []
    for i, (variant, share) in enumerate((("share", True), ("noshare", False))):
        ours = functools.partial(
            train_posttrain,
            overrides={
                "policy": {"microbatch": {"share_prefix": share}, "model": {"cpu_matmul": cpu_matmul}},
                "sampling": {"stop_at_eos": False},
            },
            save=False,
        )
        results = run_pair(
            s,
            init,
            root / variant,
            SEED,
            first=SIDES[i % 2],
            threads=threads,
            trainers={"posttrain": ours, "trl": trl},
        )
        posttrain_steps = _timed_steps(results["posttrain"], f"posttrain ({variant})", s.max_new_tokens)
        trl_pair = _timed_steps(results["trl"], f"TRL (beside posttrain {variant})", s.max_new_tokens)
        medians[variant] = median(posttrain_steps)
        speedups[variant] = median(trl_pair) / medians[variant]
        trl_steps += trl_pair
    return {
        "share_s": medians["share"],
        "noshare_s": medians["noshare"],
        "trl_s": median(trl_steps),
        "speedup_share": speedups["share"],
        "speedup_noshare": speedups["noshare"],
        "prompt_tokens": prompt_tokens,
        "completion_tokens": s.max_new_tokens,
        "samples_per_step": s.samples_per_step,
        "params": params,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", required=True, choices=list(_sizes.SIZES), help="a size of _sizes.SIZES")
    ap.add_argument("--quick", action="store_true", help="2 x 2 completions of 16 tokens, 2 steps")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of every process")
    ap.add_argument("--workdir", default=None, help="keep the model and runs here (default: a temp dir)")
    ap.add_argument(
        "--cpu-matmul", choices=("torch", "onednn"), default="torch", help="posttrain's model.cpu_matmul"
    )
    args = ap.parse_args()
    require("trl", "datasets")
    with tempfile.TemporaryDirectory() as tmp:
        r = grpo_step_times(
            args.size,
            quick=args.quick,
            threads=args.threads,
            workdir=Path(args.workdir or tmp),
            cpu_matmul=args.cpu_matmul,
        )
    s = setting(args.quick)
    lo, hi = r["prompt_tokens"]
    print(
        f"size {args.size} ({r['params'] / 1e6:.1f}M params, vocab {_sizes.VOCAB}): "
        f"{s.prompts_per_step} prompts x {s.generations} generations, prompts {lo}-{hi} tokens, "
        f"{r['completion_tokens']} new tokens, {s.steps} steps, {args.threads} thread(s) per process, "
        f"posttrain model.cpu_matmul={args.cpu_matmul}"
    )
    print(
        f"seconds/step median: posttrain share_prefix {r['share_s']:.3f}  "
        f"no share_prefix {r['noshare_s']:.3f}  trl {r['trl_s']:.3f}"
    )
    print(
        f"trl/posttrain: share_prefix {r['speedup_share']:.2f}x  no share_prefix {r['speedup_noshare']:.2f}x"
    )


if __name__ == "__main__":
    run_main(main)
