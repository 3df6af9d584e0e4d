"""The size sweep: posttrain vs its references from ~3M to ~150M parameters, against a measured roofline.

At each size of benchmarks/_sizes.py (Llama-3/Qwen2.5-style decoders, 32000-token vocabulary, tied
embeddings), in one run:

- generation: the engine vs transformers `generate`, sampling (temperature 1, no top-k/top-p) and
  greedy, same prompts (24-40 tokens) and new tokens, interleaved repeats (benchmarks/generation.py);
- training: `Policy.train` vs a hand-written loop, forward + backward + clip + AdamW
  (benchmarks/train_throughput.py);
- GRPO: a whole GRPO step vs TRL's `GRPOTrainer` with 128-token completions, prefix sharing on and off
  (benchmarks/_grpo_at_size.py; needs trl, skipped with --no-trl).

Each speed is also reported as model FLOP/s and its fraction of the fp32 matmul peak measured at the
start of the run at the same thread count (benchmarks/_roofline.py). The results go to
`sweep.json` and a plot `sweep.png` (speedups and fractions of the roofline vs size) in --out
(`sweep_onednn.*` with `--cpu-matmul onednn`).

    python benchmarks/sweep.py [--quick] [--sizes 3m,20m,60m,150m] [--no-trl] [--no-train] [--no-gen]
                               [--out benchmarks] [--gen-batch 32] [--cpu-matmul torch|onednn]

`--gen-batch` sets the sequences decoded together (default 32); results of any other batch carry a
`_b<N>` suffix in their RESULT names, so they are never read as the default setting's. `--cpu-matmul
onednn` runs posttrain's side with `model.cpu_matmul=onednn` (its linear layers on oneDNN's GEMM: the
train step, GRPO's trainer, the engine's smaller layers; the engine's decode and its prefill's layers
of >= 65536 weights run on oneDNN in both settings; the references keep F.linear); its RESULT names end in
`_onednn`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, require, result_line, run_main  # noqa: E402
from _roofline import describe, gflops, kernel_peaks, machine, matmul_peak  # noqa: E402
from _sizes import SIZES, VOCAB, shape  # noqa: E402
from generation import compare  # noqa: E402
from train_throughput import compare_train  # noqa: E402

ROOFLINE_FROM = 20e6  # the decode roofline target applies from this many parameters


def params_of(size: str) -> int:
    """Parameters of a sweep size (tied embeddings counted once)."""
    from posttrain.models.hf import tiny_config

    config = tiny_config(VOCAB, **shape(size))
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


GEN_BATCH = 32


def measure(
    size: str,
    quick: bool,
    trl: bool,
    threads: int,
    workdir: Path,
    train: bool = True,
    gen_batch: int = GEN_BATCH,
    cpu_matmul: str = "torch",
    gen: bool = True,
) -> dict:
    """Every comparison at one size (see the module docstring), with GFLOP/s where FLOPs are counted;
    `fractions` turns them into fractions of the run's peak. `cpu_matmul`: posttrain's
    `model.cpu_matmul` on every side of posttrain (the references keep F.linear)."""
    out: dict = {"size": size, "params": params_of(size)}
    batch, new_tokens, repeats = (8, 16, 1) if quick else (gen_batch, 64, 3)
    out["gen_batch"] = batch
    for mode in ("sampling", "greedy") if gen else ():
        c = compare(
            VOCAB,
            repeats,
            shape(size),
            greedy=mode == "greedy",
            batch=batch,
            new_tokens=new_tokens,
            cpu_matmul=cpu_matmul,
        )
        out[f"gen_{mode}"] = {
            "engine_tok_s": c.ours_tps,
            "hf_tok_s": c.ref_tps,
            "speedup": c.ratio,
            "engine_gflops": c.ours_gflops,
            "hf_gflops": c.ref_gflops,
        }
    if train:
        out["train"] = train_step(size, quick, cpu_matmul)
    if trl:
        from _grpo_at_size import grpo_step_times

        out["grpo"] = grpo_step_times(
            size, quick=quick, threads=threads, workdir=workdir / f"grpo_{size}", cpu_matmul=cpu_matmul
        )
    return out


def train_step(size: str, quick: bool, cpu_matmul: str = "torch") -> dict:
    """`Policy.train` vs the hand-written loop at one size."""
    b, t, mbs, reps = (4, 64, 2, 1) if quick else (8, 256, 4, 3)
    ours, ref, flops = compare_train(shape(size), VOCAB, b, t, mbs, reps, cpu_matmul=cpu_matmul)
    return {
        "ours_s": median(ours),
        "ref_s": median(ref),
        "speedup": median([r / o for o, r in zip(ours, ref)]),
        "ours_gflops": gflops(flops, median(ours)),
        "ref_gflops": gflops(flops, median(ref)),
    }


def fractions(r: dict, peak: float) -> None:
    """Add to result `r` each GFLOP/s as a fraction of `peak` (`*_frac`)."""
    for part in [r[k] for k in ("gen_sampling", "gen_greedy", "train") if k in r]:
        for key in [k for k in part if k.endswith("_gflops")]:
            part[key.replace("_gflops", "_frac")] = part[key] / peak


def report(r: dict) -> None:
    print(f"--- {r['size']}: {r['params'] / 1e6:.1f}M parameters, decode batch {r['gen_batch']}", flush=True)
    for mode in [m for m in ("sampling", "greedy") if f"gen_{m}" in r]:
        g = r[f"gen_{mode}"]
        print(
            f"  generate {mode:8s}: engine {g['engine_tok_s']:8.1f} tok/s ({g['engine_frac']:.0%} of peak), "
            f"transformers {g['hf_tok_s']:8.1f} tok/s ({g['hf_frac']:.0%}), speedup {g['speedup']:.2f}x"
        )
    if "train" in r:
        t = r["train"]
        print(
            f"  train step       : posttrain {t['ours_s']:.3f} s ({t['ours_frac']:.0%} of peak), hand-written "
            f"{t['ref_s']:.3f} s ({t['ref_frac']:.0%}), ratio {t['speedup']:.2f}"
        )
    if "grpo" in r:
        g = r["grpo"]
        print(
            f"  grpo step        : posttrain {g['share_s']:.3f} s (share_prefix off: {g['noshare_s']:.3f} s), TRL "
            f"{g['trl_s']:.3f} s, speedup {g['speedup_share']:.2f}x ({g['speedup_noshare']:.2f}x); "
            f"{g['samples_per_step']} completions of {g['completion_tokens']} tokens per step, prompts "
            f"{g['prompt_tokens'][0]}-{g['prompt_tokens'][1]} tokens"
        )


def plot(results: list[dict], path: Path) -> None:
    """Speedups and fractions of the roofline vs parameters (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["params"] / 1e6 for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    gen = all("gen_sampling" in r for r in results)
    if gen:
        left.plot(x, [r["gen_sampling"]["speedup"] for r in results], "o-", label="generate, sampling vs HF")
        left.plot(x, [r["gen_greedy"]["speedup"] for r in results], "o-", label="generate, greedy vs HF")
    if all("train" in r for r in results):
        left.plot(x, [r["train"]["speedup"] for r in results], "o-", label="train step vs hand-written")
    if all("grpo" in r for r in results):
        left.plot(x, [r["grpo"]["speedup_share"] for r in results], "o-", label="GRPO step vs TRL")
        left.plot(
            x,
            [r["grpo"]["speedup_noshare"] for r in results],
            "o--",
            label="GRPO step vs TRL, no prefix sharing",
        )
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xscale="log", xlabel="parameters (M)", ylabel="speedup (x)", title="posttrain vs reference")
    for mode, marker in (("sampling", "o"), ("greedy", "s")) if gen else ():
        right.plot(
            x,
            [r[f"gen_{mode}"]["engine_frac"] for r in results],
            f"{marker}-",
            label=f"engine decode ({mode})",
        )
        right.plot(
            x, [r[f"gen_{mode}"]["hf_frac"] for r in results], f"{marker}--", label=f"HF generate ({mode})"
        )
    if all("train" in r for r in results):
        right.plot(x, [r["train"]["ours_frac"] for r in results], "^-", label="posttrain train step")
        right.plot(x, [r["train"]["ref_frac"] for r in results], "^--", label="hand-written train step")
    right.axhline(0.7, color="grey", lw=0.8, ls=":")
    right.set(xscale="log", xlabel="parameters (M)", ylabel="fraction of fp32 matmul peak", ylim=(0, 1))
    right.set_title("fraction of the measured roofline")
    for ax in (left, right):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the smallest size, short jobs (< 1 minute)")
    ap.add_argument("--sizes", default=None, help=f"comma-separated, of {', '.join(SIZES)} (default: all)")
    ap.add_argument("--no-trl", action="store_true", help="skip the GRPO-vs-TRL comparison")
    ap.add_argument("--out", default=str(Path(__file__).parent), help="where sweep.json and sweep.png go")
    ap.add_argument("--no-train", action="store_true", help="skip the train-step comparison")
    ap.add_argument("--no-gen", action="store_true", help="skip the generation comparison")
    ap.add_argument(
        "--gen-batch", type=int, default=GEN_BATCH, help="sequences decoded together (default 32)"
    )
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    ap.add_argument(
        "--cpu-matmul",
        choices=("torch", "onednn"),
        default="torch",
        help="posttrain's model.cpu_matmul (train step, GRPO's trainer); the references keep F.linear",
    )
    args = ap.parse_args()
    sizes = args.sizes.split(",") if args.sizes else (["3m"] if args.quick else list(SIZES))
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    trl = not args.no_trl
    if trl:
        require("trl", "datasets")
    require("matplotlib")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before the runs: a bad --out fails now, not after them
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    # the peak is probed before every size and the best probe of the run is the roofline: on a shared
    # machine a probe taken while something else runs reads low, and a low roofline flatters everyone
    host = machine()
    print(f"machine: {host}")
    kernels = kernel_peaks()
    print(describe(kernels), flush=True)
    probes = [max(kernels.values())]
    print(
        f"fp32 matmul probe {probes[0]:.1f} GFLOP/s at {threads} thread(s); sizes {sizes}; "
        f"posttrain model.cpu_matmul={args.cpu_matmul}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            results.append(
                measure(
                    size,
                    args.quick,
                    trl,
                    threads,
                    Path(tmp),
                    not args.no_train,
                    args.gen_batch,
                    args.cpu_matmul,
                    not args.no_gen,
                )
            )
            probes.append(matmul_peak())
    peak = max(probes)
    print(f"roofline: fp32 matmul peak {peak:.1f} GFLOP/s (best of the probes {[round(p) for p in probes]})")
    for r in results:
        fractions(r, peak)
        report(r)
    gemm = "" if args.cpu_matmul == "torch" else f"_{args.cpu_matmul}"
    stem = f"sweep{gemm}"  # a run of another GEMM writes beside the default run's files, not over them
    record = {
        "peak_gflops": peak,
        "probes": probes,
        "first_probe_by_kernel": kernels,
        "threads": threads,
        "cpu_matmul": args.cpu_matmul,
        "machine": host,
        "results": results,
    }
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    plot(results, out / f"{stem}.png")
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.png'}")
    for r in results:
        batch = "" if r["gen_batch"] == GEN_BATCH or args.quick else f"_b{r['gen_batch']}"
        s = r["size"] + batch + gemm
        if "gen_sampling" in r:
            print(result_line(f"gen_speedup_vs_hf_{s}", r["gen_sampling"]["speedup"], ">=3"))
            print(result_line(f"gen_speedup_vs_hf_greedy_{s}", r["gen_greedy"]["speedup"], ">=1"))
        if "gen_sampling" in r and r["params"] >= ROOFLINE_FROM:
            print(result_line(f"engine_decode_roofline_frac_{s}", r["gen_sampling"]["engine_frac"], ">=0.7"))
        if "train" in r:
            print(result_line(f"train_vs_handwritten_{r['size']}{gemm}", r["train"]["speedup"], ">=0.9"))
        if "grpo" in r:
            print(result_line(f"grpo_speedup_vs_trl_{r['size']}{gemm}", r["grpo"]["speedup_share"], ">=2"))
            noshare = r["grpo"]["speedup_noshare"]
            print(result_line(f"grpo_speedup_vs_trl_noshare_{r['size']}{gemm}", noshare, ">=1.5"))


if __name__ == "__main__":
    run_main(main)
