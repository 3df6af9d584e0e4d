"""Training throughput: `Policy.train` vs a hand-written PyTorch loop on the same model and data.

Both do forward + backward over the same micro-batches (gradient accumulation), clip the gradient
norm and take one AdamW step per global batch. Interleaved repeats; medians and the ratio printed,
with each side's model FLOP/s and its fraction of the fp32 matmul peak measured in the same run
(benchmarks/_roofline.py).

    python benchmarks/train_throughput.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line, time_repeats  # noqa: E402
from _roofline import DecoderShape, gflops, machine, matmul_peak  # noqa: E402

from posttrain.algorithms.losses import NLLLoss  # noqa: E402
from posttrain.data.batch import make_batch  # noqa: E402
from posttrain.dtypes import DTYPES  # noqa: E402
from posttrain.models.hf import build_tiny_model  # noqa: E402
from posttrain.models.tokenizer import build_char_tokenizer  # noqa: E402
from posttrain.parallel.mesh import default_device  # noqa: E402
from posttrain.policy.config import PolicyConfig  # noqa: E402
from posttrain.policy.policy import Policy  # noqa: E402

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def make_data(b: int, t: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    lengths = torch.full((b,), t)
    token_mask = torch.ones(b, t)
    token_mask[:, : t // 4] = 0
    return make_batch(input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(b))


def handwritten_step(model, opt, batch, mbs: int, dtype: torch.dtype = torch.float32) -> None:
    """One step; `dtype` other than fp32 runs the forward under autocast to it (fp32 weights)."""
    device = next(model.parameters()).device
    cast = torch.autocast(device.type, dtype) if dtype != torch.float32 else contextlib.nullcontext()
    opt.zero_grad(set_to_none=True)
    mask_all = batch["token_mask"][:, 1:]
    n = mask_all.sum()
    for s in range(0, batch.batch_size[0], mbs):
        ids = batch["input_ids"][s : s + mbs]
        mask = mask_all[s : s + mbs]
        with cast:
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1].float()
        lp = torch.gather(logits, -1, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, -1)
        loss = -(lp * mask).sum() / n
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()


def compare_train(
    shape: dict,
    vocab: int,
    b: int,
    t: int,
    mbs: int,
    repeats: int,
    precision: str = "float32",
    cpu_matmul: str = "torch",
) -> tuple[list[float], list[float], int]:
    """Seconds per step of `Policy.train` and of the hand-written loop (interleaved repeats) on a model of
    `shape` with a `vocab`-token vocabulary, global batch b x t in micro-batches of `mbs` rows; and the
    model FLOPs of one step. Both run on the policy's device (a GPU when there is one) in `precision`
    (fp32 weights, autocast to a lower one); `cpu_matmul`: the policy's `model.cpu_matmul` (the
    hand-written loop keeps F.linear)."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(vocab, seed=0, **shape).save_pretrained(tmp)  # ids are random: any tokenizer
        build_char_tokenizer().save_pretrained(tmp)
        cfg = PolicyConfig.model_validate(
            {
                "model": {"name": tmp, "cpu_matmul": cpu_matmul},
                "train_global_batch_size": b,
                "microbatch": {"train_micro_batch_size": mbs},
                "optimizer": {"lr": 1e-4},
                "precision": precision,
                "init_reference_model": False,
            }
        )
        policy = Policy(cfg)
    batch = make_data(b, t, vocab)
    device = default_device()
    model = build_tiny_model(vocab, seed=0, **shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    loss_fn = NLLLoss()
    dtype = DTYPES[precision]
    on_device = batch.to(device)
    ours, ref = [], []

    def synced(fn):
        """`fn`, then a wait for what it left queued on a GPU (each side's optimizer step)."""

        def run() -> None:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return run

    for _ in range(repeats):  # interleave to share the machine's noise
        ours += time_repeats(synced(lambda: policy.train(batch, loss_fn)), 1)
        ref += time_repeats(synced(lambda: handwritten_step(model, opt, on_device, mbs, dtype)), 1)
    policy.shutdown()
    flops = DecoderShape.of(model.config).train_flops(batch["input_lengths"].tolist())
    return ours, ref, flops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    b, t, mbs = (8, 128, 4) if args.quick else (16, 256, 4)
    repeats = 3 if args.quick else 7
    vocab = len(build_char_tokenizer())
    print(f"machine: {machine()}")
    peak = matmul_peak(report=True)
    ours, ref, flops = compare_train(SHAPE, vocab, b, t, mbs, repeats)
    tokens = b * t
    tps_ours, tps_ref = tokens / median(ours), tokens / median(ref)
    print(
        f"batch {b}x{t}, micro-batch {mbs}, model {SHAPE}, vocab {vocab}, threads {torch.get_num_threads()}"
    )
    print(f"roofline: fp32 matmul peak {peak:.1f} GFLOP/s, measured now; {flops / 1e9:.1f} GFLOP per step")
    for name, times, tps in (("posttrain Policy.train", ours, tps_ours), ("hand-written loop", ref, tps_ref)):
        achieved = gflops(flops, median(times))
        print(
            f"{name:22s} : median {median(times) * 1e3:8.1f} ms/step  {tps:10.0f} tokens/s  "
            f"{achieved:6.1f} GFLOP/s ({achieved / peak:.0%} of peak)"
        )
    print(result_line("train_vs_handwritten", tps_ours / tps_ref, ">=0.9"))


if __name__ == "__main__":
    main()
