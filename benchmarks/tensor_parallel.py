"""Tensor parallelism at equal world size: training throughput (tp=2 vs dp=2) and per-rank memory.

Throughput: two CPU ranks (gloo) each build two `PolicyWorker`s on the same tiny Llama (hidden 256,
MLP 1024, 4 layers, 8 heads / 4 KV heads, fp32, AdamW): one with `tensor_parallel_size=1` (dp=2,
FSDP2) and one with `tensor_parallel_size=2` (dp=1, tp=2). Each rank feeds its data-parallel shard
(`shard_batch` by `dims.dp_index(rank)`) of the same fixed RL batch to `train()` with
`ClippedPGLoss`: forward + backward + clip + optimizer step. One untimed warm-up step each, then the
two alternate one step at a time (tp1, tp2, tp1, tp2, ...), each step between barriers so both see
the same load; a step's time is the slowest rank's. tokens/s = valid tokens of the global batch
(token_mask[:, 1:] x sample_mask, as the loss counts them) / median step time.

Memory: bytes of each rank's local tensors (`DTensor.to_local()`) of the model's parameters plus
every tensor of the optimizer state, after one AdamW step. tp=2 (world 2, dp=1) is compared with one
unsharded rank (world 1, tp=1, no FSDP); the dp=2 FSDP2 bytes per rank are printed for comparison.
This is an exact count of what each rank holds, the same on any device (not an allocator reading).

    python benchmarks/tensor_parallel.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line  # noqa: E402

from posttrain.parallel.processes import run_ranks  # noqa: E402

WORLD = 2
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def make_rl_batch(b: int, t: int, vocab: int, seed: int = 0):
    """A right-padded RL batch: uneven lengths (the first row full), completion-only token masks."""
    from posttrain.data.batch import make_batch

    g = torch.Generator().manual_seed(seed)
    prompt = t // 4
    ids = torch.randint(4, vocab, (b, t), generator=g)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    lengths[0] = t
    valid = torch.arange(t)[None, :] < lengths[:, None]
    ids = ids * valid
    token_mask = valid.float()
    token_mask[:, :prompt] = 0
    gen = (-torch.rand(b, t, generator=g) * 3 - 1) * valid
    return make_batch(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(b),
        advantages=torch.randn(b, 1, generator=g).expand(b, t).clone() * valid,
        generation_logprobs=gen,
        prev_logprobs=gen + 0.05 * torch.randn(b, t, generator=g) * valid,
        reference_logprobs=gen + 0.1 * torch.randn(b, t, generator=g) * valid,
    )


def valid_tokens(batch) -> float:
    return float((batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum())


def _config(world: int, tp: int, b: int, mbs: int):
    from posttrain.policy.config import PolicyConfig

    return PolicyConfig.model_validate(
        {
            "model": {"tiny": SHAPE},
            "cluster": {"backend": "ray" if world > 1 else "local", "num_workers": world},
            "parallel": {"tensor_parallel_size": tp},
            "train_global_batch_size": b,
            "microbatch": {"train_micro_batch_size": mbs},
            "optimizer": {"name": "torch.optim.AdamW", "lr": 1e-5},
            "init_reference_model": False,
        }
    )


def state_bytes(worker) -> int:
    """This rank's bytes of parameters + optimizer state (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in worker.model.parameters())
    optim = sum(
        nbytes(v) for s in worker.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    return params + optim


def _train_rank(rank: int, world: int, port: int, b: int, t: int, mbs: int, steps: int) -> dict:
    import torch.distributed as dist

    from posttrain.algorithms.losses import ClippedPGLoss
    from posttrain.data.batch import shard_batch
    from posttrain.policy.worker import PolicyWorker

    loss_fn = ClippedPGLoss()
    workers, shards = {}, {}
    for tp in (1, 2):
        w = PolicyWorker(_config(world, tp, b, mbs), rank=rank, world_size=world, master_port=port)
        batch = make_rl_batch(b, t, len(w.tokenizer))
        workers[tp] = w
        shards[tp] = shard_batch(batch, w.dims.dp)[w.dims.dp_index(rank)]
    out: dict = {"tokens": valid_tokens(batch), "times": {1: [], 2: []}, "bytes": {}, "first": {}}
    for tp, w in workers.items():  # warm-up (untimed); it also creates the AdamW state
        m = w.train(shards[tp], loss_fn)
        out["first"][tp] = (m["global_valid_toks"], m["loss"], m["grad_norm"])
        out["bytes"][tp] = state_bytes(w)
    for _ in range(steps):
        for tp, w in workers.items():
            dist.barrier()
            t0 = time.perf_counter()
            w.train(shards[tp], loss_fn)
            out["times"][tp].append(time.perf_counter() - t0)
    dist.barrier()
    return out


def _single_rank(rank: int, world: int, port: int, b: int, t: int, mbs: int) -> int:
    from posttrain.algorithms.losses import ClippedPGLoss
    from posttrain.policy.worker import PolicyWorker

    w = PolicyWorker(_config(1, 1, b, mbs))
    assert not w.dims.fsdp_enabled
    w.train(make_rl_batch(b, t, len(w.tokenizer)), ClippedPGLoss())
    return state_bytes(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller batch, fewer steps (under a minute)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps of each (default 10; quick: 4)")
    args = ap.parse_args()
    if torch.cuda.is_available() and torch.cuda.device_count() < WORLD:
        sys.exit(
            f"needs {WORLD} GPUs (NCCL, one per rank) or none (CPU, gloo); found {torch.cuda.device_count()}"
        )
    b, t, mbs = (8, 128, 4) if args.quick else (16, 256, 4)
    steps = args.steps or (4 if args.quick else 10)

    single = run_ranks(1, _single_rank, b, t, mbs)[0]
    ranks = run_ranks(WORLD, _train_rank, b, t, mbs, steps)
    tokens = ranks[0]["tokens"]
    first = ranks[0]["first"]
    for r in ranks:
        assert r["first"][1][0] == r["first"][2][0] == tokens, (r["first"], tokens)
    # a step's time: the slowest rank's
    step_s = {tp: [max(ts) for ts in zip(*(r["times"][tp] for r in ranks))] for tp in (1, 2)}
    tps = {tp: tokens / median(v) for tp, v in step_s.items()}
    mem = {tp: max(r["bytes"][tp] for r in ranks) for tp in (1, 2)}
    mib = 2**20

    print(
        f"{WORLD} CPU ranks (gloo, 1 thread each), model {SHAPE} fp32, AdamW, ClippedPGLoss; "
        f"batch {b}x{t} ({tokens:.0f} valid tokens), micro-batch {mbs}, {steps} timed steps of each"
    )
    print(f"{'layout':<22} {'median ms/step':>15} {'tokens/s':>10} {'params+optim / rank':>21}")
    print(f"{'1 rank, tp=1 (no FSDP)':<22} {'':>15} {'':>10} {single / mib:>17.2f} MiB")
    print(
        f"{'dp=2, tp=1 (FSDP2)':<22} {median(step_s[1]) * 1e3:>15.1f} {tps[1]:>10.0f} {mem[1] / mib:>17.2f} MiB"
    )
    print(f"{'dp=1, tp=2':<22} {median(step_s[2]) * 1e3:>15.1f} {tps[2]:>10.0f} {mem[2] / mib:>17.2f} MiB")
    print(
        f"same first step: loss {first[1][1]:.6f} (dp=2) vs {first[2][1]:.6f} (tp=2), "
        f"grad norm {first[1][2]:.6f} vs {first[2][2]:.6f}"
    )
    print(f"per-rank bytes, tp=2: {[r['bytes'][2] for r in ranks]}; dp=2: {[r['bytes'][1] for r in ranks]}")
    print(f"memory tp2 / unsharded: {mem[2] / single:.3f}  (dp=2 FSDP2 / unsharded: {mem[1] / single:.3f})")
    print(f"throughput tp2 / dp2: {tps[2] / tps[1]:.3f}")
    print(result_line("tp2_param_mem_ratio", mem[2] / single, "<=0.55"))
    print(result_line("tp2_vs_tp1_tokens_per_s", tps[2] / tps[1], ">=0.5"))


if __name__ == "__main__":
    main()
