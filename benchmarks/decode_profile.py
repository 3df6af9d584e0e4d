"""Where one decode step of the engine spends its time on a GPU: the whole step as the host sees it
(wall time per engine.step() over steps run back to back: with overlap the launch of a step and the
host's read of the step before) against the device time of its parts, timed
alone with CUDA events: the replayed graph of the decoder body, the LM head, the sampler.

    python benchmarks/decode_profile.py [--sizes 150m,qwen2.5-1.5b] [--no-compile] [--no-overlap] [--steps 40]

Batch 64 (the prompts of benchmarks/gpu.py), bf16, CUDA graphs on. A step whose parts add up to much
less than the whole is bound by the host (Python bookkeeping, launches, the per-step read of the tokens);
one whose graph takes most of it is bound by the device's kernels. Prints one line per size; a
diagnostic, not a target (no RESULT lines).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, run_main  # noqa: E402
from generation import make_prompts  # noqa: E402
from gpu import SIZES, _elapsed, _now  # noqa: E402

from posttrain.generation.engine import GenerationEngine  # noqa: E402
from posttrain.generation.params import GenerationConfig, SamplingParams  # noqa: E402
from posttrain.generation.sampler import sample  # noqa: E402
from posttrain.models.hf import build_tiny_model  # noqa: E402


def device_ms(fn, repeats: int) -> float:
    """Median device milliseconds of fn() (gpu.py's CUDA events around each call)."""
    device = torch.device("cuda")
    times = []
    for _ in range(repeats):
        t0 = _now(device)
        fn()
        times.append(_elapsed(device, t0) * 1e3)
    return median(times)


def profile(size: str, compile_decode: bool, overlap: bool, steps: int, batch: int = 64) -> dict:
    vocab, shp = SIZES[size]
    prompts = make_prompts(vocab, batch)
    with torch.device("cuda"):
        model = build_tiny_model(vocab, seed=0, **shp)
    longest = max(map(len, prompts)) + 2 * steps + 16
    cfg = GenerationConfig(
        max_num_seqs=batch,
        max_model_len=longest,
        dtype="bfloat16",
        cuda_graphs=True,
        compile_decode=compile_decode,
        overlap_decode=overlap,
    )
    engine = GenerationEngine(model.to(torch.bfloat16), None, cfg)
    params = SamplingParams(greedy=True, max_new_tokens=2 * steps + 8, stop_at_eos=False)
    engine.generate(prompts, params)  # captures (and compiles)
    engine.submit_all(prompts, params)
    engine.step()  # prefill + the first decode step
    for _ in range(3):
        engine.step()
    # the steps back to back, one sync at the end (a sync per step would undo overlap_decode)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    whole = (time.perf_counter() - t0) / steps * 1e3
    n = engine.num_running
    length = int(engine._pos[:n].max()) + 1
    with torch.inference_mode():
        hidden = engine._graphs.run(n, length)
        body = device_ms(lambda: engine._graphs.run(n, length), steps)
        head = device_ms(lambda: engine._head(hidden), steps)
        logits = engine._head(hidden)
        rows = engine._rows
        sampler = device_ms(lambda: sample(logits, rows, engine._count[:n]), steps)
    out = {
        "size": size,
        "compile": compile_decode,
        "step": whole,
        "body": body,
        "head": head,
        "sample": sampler,
    }
    host = whole - body - head - sampler
    print(
        f"{size:14s} compile={compile_decode!s:5s} overlap={overlap!s:5s}: step {whole:.3f} ms = graph {body:.3f} + head {head:.3f} + "
        f"sampler {sampler:.3f} + the rest {host:.3f} (host-bound share {host / whole:.0%})",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="150m,qwen2.5-1.5b")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_profile.py needs CUDA")
    for size in args.sizes.split(","):
        profile(size, not args.no_compile, not args.no_overlap, args.steps)


if __name__ == "__main__":
    run_main(main)
