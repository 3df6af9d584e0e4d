"""posttrain on one GPU at real model shapes: the engine vs transformers `generate`, and `Policy.train` vs
a hand-written loop, in bf16, against the card's ceilings measured in the same run.

Sizes: the sweep's 150m (32000-token vocabulary) and the shapes of Qwen2.5-0.5B and Qwen2.5-1.5B
(151936-token vocabulary, q/k/v biases, tied embeddings), random weights. At each:

- generation (benchmarks/generation.py `compare`): the same prompts (24-40 tokens), 128 new tokens,
  batch 64, sampling (temperature 1, no top-k/top-p) and greedy, interleaved repeats, medians; both
  sides on the GPU in bf16. Decode on a GPU is bound by memory traffic, not arithmetic: each call is also
  reported as the fraction of the measured copy bandwidth that its decode traffic (every weight once per
  step, each sequence's cached keys and values) would need, prefill included in the time, so the
  fraction is a lower bound of the decode steps'.
- the engine replays its decode steps from CUDA graphs (`generation.cuda_graphs`, generation/graphs.py)
  of the step compiled by torch.compile (`generation.compile_decode`), each step launched before the
  host reads the one before (`generation.overlap_decode`), in both modes; greedy is also timed with
  these taken off one after another (`gpu_cuda_graphs_speedup_<size>`: greedy without graphs over
  graphs of the eager step; `gpu_compile_decode_speedup_<size>`: graphs of the eager step over graphs of
  the compiled one; `gpu_overlap_decode_speedup_<size>`: without overlap over with it; each printed only
  where the two runs differ in that option alone, after any fallback). `--no-cuda-graphs`,
  `--no-compile` and `--no-overlap` turn them off. Each size's RESULT lines are printed as it ends
  ("so far") and gpu.json rewritten, so a run cut short keeps them.
- training (benchmarks/train_throughput.py `compare_train`): one global batch of 16 x 512 tokens in
  micro-batches of 4, fp32 weights and bf16 autocast on both sides, AdamW; model FLOP/s as a fraction of
  the measured bf16 matmul peak.

    python benchmarks/gpu.py [--quick] [--sizes 150m,qwen2.5-0.5b,qwen2.5-1.5b] [--out DIR]

`--quick` runs 150m alone with short jobs (a few minutes, compiling included). Needs CUDA; `--device cpu`
runs the same code on the CPU (to check the script itself, numbers meaningless).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line, run_main  # noqa: E402
from _roofline import DecoderShape, gflops, matmul_peak  # noqa: E402
from _sizes import VOCAB, shape  # noqa: E402
from generation import compare, make_prompts  # noqa: E402
from train_throughput import compare_train  # noqa: E402

from posttrain.models.hf import tiny_config  # noqa: E402

QWEN_VOCAB = 151936
SIZES: dict[str, tuple[int, dict]] = {
    "150m": (VOCAB, shape("150m")),
    "qwen2.5-0.5b": (
        QWEN_VOCAB,
        {
            "family": "qwen2",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "max_position_embeddings": 1024,
        },
    ),
    "qwen2.5-1.5b": (
        QWEN_VOCAB,
        {
            "family": "qwen2",
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "max_position_embeddings": 1024,
        },
    ),
}


def copy_bandwidth(device: torch.device, gib: float = 1.0, repeats: int = 10) -> float:
    """Best bytes/s of a device-to-device copy, counting bytes read and written."""
    n = int(gib * 2**30) // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    dst.copy_(src)
    best = 0.0
    for _ in range(repeats):
        t0 = _now(device)
        dst.copy_(src)
        best = max(best, 2 * 4 * n / _elapsed(device, t0))
    return best


def gpu_matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """Best GFLOP/s of n x n x n matmuls in `dtype` on random data."""
    if device.type != "cuda":
        return matmul_peak(dtype)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    best = 0.0
    for _ in range(10):
        t0 = _now(device)
        torch.mm(a, b, out=out)
        best = max(best, 2 * n**3 / _elapsed(device, t0) / 1e9)
    return best


def _now(device: torch.device):
    """A start mark: a recorded CUDA event on a GPU, the host clock otherwise."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start
    return time.perf_counter()


def _elapsed(device: torch.device, t0) -> float:
    """Seconds since `t0` of `_now` (device events on a GPU)."""
    if device.type == "cuda":
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return t0.elapsed_time(end) / 1e3
    return time.perf_counter() - t0


def decode_bytes(model_shape: DecoderShape, prompt_lengths: list[int], new_tokens: int, elem: int) -> int:
    """Bytes a decode must read for `new_tokens` after each prompt, past the prefill: at each of the
    new_tokens - 1 steps every matmul weight once (the batch shares it) and each sequence's cached keys
    and values up to its position."""
    s = model_shape
    kv_per_token = 2 * s.layers * s.kv_heads * s.head_dim * elem
    weights = s.matmul_params * elem
    total = 0
    for step in range(1, new_tokens):
        total += weights + kv_per_token * sum(p + step for p in prompt_lengths)
    return total


def generation(
    size: str,
    device: torch.device,
    quick: bool,
    bandwidth: float,
    graphs: bool,
    compiled: bool,
    overlap: bool,
) -> dict:
    vocab, shp = SIZES[size]
    batch, new_tokens, repeats = (16, 32, 2) if quick else (64, 128, 3)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict = {"batch": batch, "new_tokens": new_tokens}
    lengths = [len(p) for p in make_prompts(vocab, batch)]  # the prompts `compare` decodes
    moved = decode_bytes(DecoderShape.of(tiny_config(vocab, **shp)), lengths, new_tokens, dtype.itemsize)
    # the engine in its fastest configuration (CUDA graphs of the compiled step, overlapped with the host)
    # in both modes; greedy is also timed with them taken off one after another, the engines of before.
    # Each mode falls back to the next simpler configuration where its own fails (the error is printed
    # and kept; the rest still counts)
    fast = {"cuda_graphs": graphs, "compile_decode": compiled, "overlap_decode": overlap}
    modes = {
        **({"greedy_no_graphs": {"cuda_graphs": False}} if graphs else {}),
        **({"greedy_graphs": {"cuda_graphs": True}} if graphs and (compiled or overlap) else {}),
        **({"greedy_compiled": {**fast, "overlap_decode": False}} if compiled and overlap else {}),
        "sampling": fast,
        "greedy": fast,
    }
    for mode, engine_cfg in modes.items():
        greedy, errors = mode != "sampling", []
        run = functools.partial(compare, vocab, repeats, shp, greedy, batch, new_tokens, str(device), dtype)
        fallbacks = [full_cfg(c) for c in (engine_cfg, {**engine_cfg, "compile_decode": False}, {})]
        for cfg in [c for i, c in enumerate(fallbacks) if c not in fallbacks[:i]]:
            try:
                c = run(cfg)
                break
            except Exception as e:
                if cfg == fallbacks[-1]:
                    raise
                errors.append(f"{cfg}: {type(e).__name__}: {e}")
                print(f"  generate {mode}: {errors[-1]}; timed with less", flush=True)
        out[mode] = {
            "engine_cfg": cfg,
            "errors": errors,
            "engine_tok_s": c.ours_tps,
            "hf_tok_s": c.ref_tps,
            "speedup": c.ratio,
            "engine_s": c.ours_s,
            "hf_s": c.ref_s,
            "engine_bw_frac": moved / c.ours_s / bandwidth,
            "hf_bw_frac": moved / c.ref_s / bandwidth,
            "engine_ms_per_step": c.ours_s / new_tokens * 1e3,
            "hf_ms_per_step": c.ref_s / new_tokens * 1e3,
        }
        g = out[mode]
        print(
            f"  generate {mode:16s}: engine {g['engine_tok_s']:9.1f} tok/s ({g['engine_ms_per_step']:.2f} ms/step, "
            f"{g['engine_bw_frac']:.1%} of bandwidth), transformers {g['hf_tok_s']:9.1f} tok/s "
            f"({g['hf_ms_per_step']:.1f} ms/step, {g['hf_bw_frac']:.1%}), speedup {g['speedup']:.2f}x"
            + (f" [ran as {cfg}]" if errors else ""),
            flush=True,
        )
    return out


KNOBS = ("cuda_graphs", "compile_decode", "overlap_decode")


def full_cfg(cfg: dict) -> dict:
    """An engine configuration with every knob this benchmark turns named (off unless set)."""
    return {k: bool(cfg.get(k, False)) for k in KNOBS}


def differ_in(before: dict, after: dict, knob: str) -> bool:
    """Whether `after` is `before` with `knob` turned on, and nothing else changed."""
    return not before[knob] and after[knob] and {**before, knob: True} == after


def result_lines(r: dict) -> list[str]:
    """The RESULT lines of one size. A speedup of a knob is printed only where the two runs it compares
    ran (after any fallback) with that knob alone different."""
    size, g = r["size"], r["generate"]
    out = [
        result_line(f"gpu_gen_speedup_vs_hf_{size}", g["sampling"]["speedup"], ">=1"),
        result_line(f"gpu_gen_speedup_vs_hf_greedy_{size}", g["greedy"]["speedup"], ">=1"),
        result_line(f"gpu_decode_bw_frac_{size}", g["greedy"]["engine_bw_frac"], ">=0.5"),
    ]
    comparisons = [
        ("cuda_graphs", ["greedy_no_graphs"], g.get("greedy_graphs", g["greedy"]), ">=2"),
        ("compile_decode", ["greedy_graphs"], g.get("greedy_compiled", g["greedy"]), ">=1.5"),
        ("overlap_decode", ["greedy_compiled", "greedy_graphs", "greedy_no_graphs"], g["greedy"], ">=1.1"),
    ]
    for knob, candidates, after, target in comparisons:
        for mode in candidates:
            before = g.get(mode)
            if before is not None and differ_in(before["engine_cfg"], after["engine_cfg"], knob):
                speedup = before["engine_s"] / after["engine_s"]
                out.append(result_line(f"gpu_{knob}_speedup_{size}", speedup, target))
                break
    if "train" in r:
        out.append(result_line(f"gpu_train_vs_handwritten_{size}", r["train"]["speedup"], ">=0.9"))
    return out


def training(size: str, quick: bool, peak: float) -> dict:
    vocab, shp = SIZES[size]
    b, t, mbs, repeats = (4, 128, 2, 2) if quick else (16, 512, 4, 3)
    precision = "bfloat16" if torch.cuda.is_available() else "float32"
    ours, ref, flops = compare_train(shp, vocab, b, t, mbs, repeats, precision)
    r = {
        "ours_s": median(ours),
        "ref_s": median(ref),
        "speedup": median(ref) / median(ours),
        "ours_frac": gflops(flops, median(ours)) / peak,
        "ref_frac": gflops(flops, median(ref)) / peak,
        "batch": [b, t, mbs],
    }
    print(
        f"  train step {b}x{t}: posttrain {r['ours_s'] * 1e3:.1f} ms ({r['ours_frac']:.1%} of bf16 peak), "
        f"hand-written {r['ref_s'] * 1e3:.1f} ms ({r['ref_frac']:.1%}), ratio {r['speedup']:.2f}",
        flush=True,
    )
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="150m alone, short jobs")
    ap.add_argument("--sizes", default=None, help=f"comma-separated, of {', '.join(SIZES)} (default: all)")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only checks the script")
    ap.add_argument("--no-train", action="store_true", help="skip the train-step comparison")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="the engine without generation.cuda_graphs")
    ap.add_argument("--no-compile", action="store_true", help="the engine without generation.compile_decode")
    ap.add_argument("--no-overlap", action="store_true", help="the engine without generation.overlap_decode")
    ap.add_argument("--out", default=None, help="write gpu.json here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "benchmarks/gpu.py needs CUDA (torch.cuda.is_available() is False); --device cpu checks the script"
        )
    sizes = ["150m"] if args.quick else (args.sizes.split(",") if args.sizes else list(SIZES))
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        sys.exit(f"unknown size(s) {unknown}: choose from {', '.join(SIZES)}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth(device)
    peak = gpu_matmul_peak(device)
    print(f"device: {name}, torch {torch.__version__}")
    print(
        f"ceilings, measured now: copy {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul {peak / 1e3:.0f} TFLOP/s"
    )
    results = []
    for size in sizes:
        print(f"--- {size}", flush=True)
        graphs = device.type == "cuda" and not args.no_cuda_graphs  # CUDA graphs need CUDA
        compiled = not args.no_compile
        gen = generation(size, device, args.quick, bandwidth, graphs, compiled, not args.no_overlap)
        r = {"size": size, "generate": gen}
        if not args.no_train:
            r["train"] = training(size, args.quick, peak)
        results.append(r)
        if args.out:  # after each size: a run cut short keeps what it measured
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, "gpu.json").write_text(
                json.dumps(
                    {"device": name, "bandwidth": bandwidth, "peak_gflops": peak, "results": results},
                    indent=1,
                )
            )
        for line in result_lines(r):  # the same lines again at the end, all sizes together
            print(f"  so far: {line}", flush=True)
    for r in results:
        for line in result_lines(r):
            print(line)


if __name__ == "__main__":
    run_main(main)
