"""Generation throughput of `GenerationEngine` vs `transformers` `generate`, and weight-sync speed.

Same model, prompts, lengths and sampling for both: a tiny Llama (hidden 256, 4 layers, 4 heads,
2 KV heads, MLP 512) with a 32000-token vocabulary (Llama/Mistral size), batch 64, prompts of 24-40
tokens (mixed lengths), 64 new tokens, temperature 1.0 without top-k/top-p (the RL setting), no stop
token; and the same with greedy decoding, where transformers does not pay for `torch.multinomial`
over the vocabulary (the part of the sampling speedup that is its sampler). The two are run
interleaved, repeated, and the medians compared. Each side's model FLOP/s is reported as a fraction of
the fp32 matmul peak measured in the same run at the same thread count (benchmarks/_roofline.py).
Without --quick an INFO line gives the same comparison with the 79-token character vocabulary of the
built-in tasks.

Weight sync: seconds per GB of fp32 parameters, in-process (`load_weights`) and to an engine in a
spawned process over a gloo `WeightSyncGroup` (64 MiB buckets, timed until the engine has loaded).

    python benchmarks/generation.py [--quick] [--threads N]

Both sides use torch's default intra-op threads (all cores) unless --threads says otherwise; without
--quick an INFO line repeats the comparison with one thread each.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import GenerationConfig as HFGenerationConfig

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line, run_main, start, stop, wait_for, watchdog  # noqa: E402
from _roofline import DecoderShape, gflops, machine, matmul_peak  # noqa: E402

from posttrain.generation.engine import GenerationEngine  # noqa: E402
from posttrain.generation.params import GenerationConfig, SamplingParams  # noqa: E402
from posttrain.models.hf import build_tiny_model  # noqa: E402

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
BATCH, NEW_TOKENS = 64, 64


def make_prompts(vocab: int, batch: int = BATCH) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(24, 41, (batch,), generator=g)
    return [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in lengths]


def hf_runner(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, greedy: bool = False):
    """transformers generate on the left-padded batch, sampling at temperature 1 (or greedy), exactly
    `new_tokens`, on the model's device."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    ids, attn = ids.to(model.device), attn.to(model.device)
    sampling = (
        {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    )
    cfg = HFGenerationConfig(**sampling, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=attn, generation_config=cfg)
        assert out.shape[1] == width + new_tokens
        out[0, -1].item()  # wait for the device
        return len(prompts) * new_tokens

    return run


def engine_runner(
    model,
    prompts: list[list[int]],
    new_tokens: int = NEW_TOKENS,
    greedy: bool = False,
    engine_cfg: dict | None = None,
):
    longest = max(map(len, prompts)) + new_tokens
    cfg = GenerationConfig(max_num_seqs=len(prompts), max_model_len=longest, **(engine_cfg or {}))
    engine = GenerationEngine(model, None, cfg)
    params = SamplingParams(
        temperature=1.0, greedy=greedy, max_new_tokens=new_tokens, seed=0, stop_at_eos=False
    )

    def run() -> int:
        results = engine.generate(prompts, params)
        assert all(len(r.token_ids) == new_tokens for r in results)
        return sum(len(r.token_ids) for r in results)

    return run


@dataclass
class Comparison:
    """Engine vs transformers on one job: medians of interleaved runs."""

    ours_s: float  # seconds per generate call
    ref_s: float
    ratio: float  # median over paired runs of ref / ours
    tokens: int  # new tokens per call
    flops: int  # model FLOPs per call (benchmarks/_roofline.py)

    @property
    def ours_tps(self) -> float:
        return self.tokens / self.ours_s

    @property
    def ref_tps(self) -> float:
        return self.tokens / self.ref_s

    @property
    def ours_gflops(self) -> float:
        return gflops(self.flops, self.ours_s)

    @property
    def ref_gflops(self) -> float:
        return gflops(self.flops, self.ref_s)


def compare(
    vocab: int,
    repeats: int,
    shape: dict | None = None,
    greedy: bool = False,
    batch: int = BATCH,
    new_tokens: int = NEW_TOKENS,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    engine_cfg: dict | None = None,
    cpu_matmul: str = "torch",
) -> Comparison:
    """The engine vs transformers generate on the same model (`shape`, default SHAPE) and prompts, both
    on `device` in `dtype`; `engine_cfg`: more GenerationConfig fields of the engine; `cpu_matmul`: the
    engine model's `model.cpu_matmul` (its smaller prefill layers' GEMM; transformers keeps F.linear)."""
    from posttrain.models.cpu_gemm import apply_cpu_matmul

    shape = shape or SHAPE
    with torch.device(device):  # initialised where it runs (a 1.5B model takes minutes on a host CPU)
        model = build_tiny_model(vocab, seed=0, **shape)
    ref_model = copy.deepcopy(model).to(device, dtype).eval()  # same weights, untouched by the engine
    ours_model = apply_cpu_matmul(model.to(device, dtype).eval(), cpu_matmul)
    prompts = make_prompts(vocab, batch)
    ours = engine_runner(ours_model, prompts, new_tokens, greedy, engine_cfg)
    ref = hf_runner(ref_model, prompts, new_tokens, greedy)
    ours(), ref()  # warm-up (first-call costs, the engine's KV cache and packed LM head)
    t_ours, t_ref = [], []
    for _ in range(repeats):
        for fn, times in ((ref, t_ref), (ours, t_ours)):
            t0 = time.perf_counter()
            n = fn()
            times.append(time.perf_counter() - t0)
    flops = DecoderShape.of(ours_model.config).generate_flops([len(p) for p in prompts], new_tokens)
    ratios = [a / b for a, b in zip(t_ref, t_ours)]
    return Comparison(median(t_ours), median(t_ref), median(ratios), n, flops)


def throughput(vocab: int, repeats: int) -> tuple[float, float, float]:
    """Median tokens/s of the engine and of transformers (interleaved runs, sampling) and the ratio."""
    c = compare(vocab, repeats)
    return c.ours_tps, c.ref_tps, c.ratio


# ---------------------------------------------------------------------------- weight sync


def sync_in_process(vocab: int, repeats: int) -> float:
    """Seconds per GB of `engine.load_weights(state_dict)`."""
    state = build_tiny_model(vocab, seed=1, **SHAPE).state_dict()
    engine = GenerationEngine(build_tiny_model(vocab, seed=0, **SHAPE))
    gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    times = []
    for v in range(repeats + 1):
        t0 = time.perf_counter()
        engine.load_weights(state, version=v)
        times.append(time.perf_counter() - t0)
    return median(times[1:]) / gb


def _receiver(info, vocab: int, rounds: int, conn) -> None:
    from posttrain.generation.rollout import RolloutEngine

    torch.set_num_threads(1)
    engine = RolloutEngine(lambda: (build_tiny_model(vocab, seed=0, **SHAPE), None))
    engine.join_weight_group(info, 1)
    for _ in range(rounds):
        engine.receive_weights()
        conn.send(engine.weight_version)


def sync_across_processes(vocab: int, repeats: int) -> float:
    """Seconds per GB from the first byte sent to the remote engine having loaded everything."""
    from posttrain.generation.weight_sync import (
        WeightSyncConfig,
        WeightSyncGroup,
        broadcast_weights,
        new_group_info,
    )

    cfg = WeightSyncConfig(backend="gloo", bucket_mb=64, timeout_s=120)
    state = build_tiny_model(vocab, seed=1, **SHAPE).state_dict()
    gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    info = new_group_info(1, cfg)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = start(ctx, {"receiver": (_receiver, (info, vocab, repeats + 1, child))})
    times = []
    # the rendezvous and the broadcasts block in C until their timeout if the receiver died: the
    # watchdog ends the benchmark instead; the reply is polled and re-checks that the receiver lives
    try:
        with watchdog(procs):
            group = WeightSyncGroup(info, 0)
            for v in range(repeats + 1):
                t0 = time.perf_counter()
                broadcast_weights(group, state.items(), v, cfg.bucket_bytes)
                wait_for(parent.poll, f"weight version {v} to load", timeout_s=cfg.timeout_s, procs=procs)
                assert parent.recv() == v
                times.append(time.perf_counter() - t0)
            procs["receiver"].join(timeout=60)
    finally:
        stop(procs)  # after the watchdog: it would take this SIGTERM for a crash
    return median(times[1:]) / gb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats (< 1 minute)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for both sides (default: torch's, all cores)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    repeats = 2 if args.quick else 5
    vocab = 32000
    print(f"model: tiny llama {SHAPE}, vocab {vocab}; batch {BATCH}, prompts 24-40, {NEW_TOKENS} new tokens")
    print(f"threads {threads}, repeats {repeats} (interleaved), medians")
    print(f"machine: {machine()}")
    peak = matmul_peak(report=True)
    print(f"roofline: fp32 matmul peak {peak:.1f} GFLOP/s at {threads} thread(s), measured now")
    results = {mode: compare(vocab, repeats, greedy=mode == "greedy") for mode in ("sampling", "greedy")}
    for mode, c in results.items():
        print(
            f"{mode:8s} engine {c.ours_tps:8.1f} tok/s ({c.ours_gflops:5.1f} GFLOP/s, "
            f"{c.ours_gflops / peak:.0%} of peak)   transformers {c.ref_tps:8.1f} tok/s "
            f"({c.ref_gflops:5.1f} GFLOP/s, {c.ref_gflops / peak:.0%})   "
            f"ratio (median of paired runs) {c.ratio:.2f}x"
        )
    ratio = results["sampling"].ratio
    if not args.quick:
        small_ours, small_ref, small_ratio = throughput(79, repeats)
        print(
            f"INFO char vocab (79): engine {small_ours:.1f} tok/s, transformers {small_ref:.1f} tok/s, "
            f"ratio {small_ratio:.2f}x"
        )
        if threads > 1:
            torch.set_num_threads(1)
            one_ours, one_ref, one_ratio = throughput(vocab, repeats)
            torch.set_num_threads(threads)
            print(
                f"INFO one thread each: engine {one_ours:.1f} tok/s, transformers {one_ref:.1f} tok/s, "
                f"ratio {one_ratio:.2f}x"
            )
    local = sync_in_process(vocab, repeats)
    remote = sync_across_processes(vocab, 1 if args.quick else repeats)
    print(f"weight sync in-process          {local:.3f} s/GB")
    print(f"weight sync across processes    {remote:.3f} s/GB (gloo, 64 MiB buckets)")
    print(result_line("gen_speedup_vs_hf", ratio, ">=3"))
    print(result_line("gen_speedup_vs_hf_greedy", results["greedy"].ratio, ">=1"))
    print(result_line("weight_sync_inprocess_s_per_gb", local, "<=2"))
    print(result_line("weight_sync_xproc_s_per_gb", remote, "<=20"))


if __name__ == "__main__":
    run_main(main)
