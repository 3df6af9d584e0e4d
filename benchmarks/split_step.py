"""Split train step vs `train()`: the same 8 micro-batches, one optimizer step, timed side by side.

`train()` gets the whole global batch (cut into 8 micro-batches by config); the split path calls
`begin_train_step`, then `train_microbatch` 8 times (one micro-batch each), then `finish_train_step`.

    python benchmarks/split_step.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line, time_repeats  # noqa: E402
from train_throughput import SHAPE, make_data  # noqa: E402

from posttrain.algorithms.losses import NLLLoss  # noqa: E402
from posttrain.policy.config import PolicyConfig  # noqa: E402
from posttrain.policy.policy import Policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    mbs, t = (2, 64) if args.quick else (4, 128)
    b = 8 * mbs
    repeats = 5 if args.quick else 11
    cfg = PolicyConfig.model_validate(
        {
            "model": {"tiny": SHAPE},
            "train_global_batch_size": b,
            "microbatch": {"train_micro_batch_size": mbs},
            "init_reference_model": False,
        }
    )
    policy = Policy(cfg)
    batch = make_data(b, t, len(policy.group.workers[0].tokenizer))
    loss_fn = NLLLoss()

    def split():
        policy.begin_train_step(loss_fn)
        for s in range(0, b, mbs):
            policy.train_microbatch(batch[s : s + mbs])
        policy.finish_train_step()

    ours, ref = [], []
    for _ in range(repeats):
        ref += time_repeats(lambda: policy.train(batch, loss_fn), 1)
        ours += time_repeats(split, 1)
    overhead = (median(ours) / median(ref) - 1) * 100
    print(f"8 micro-batches of {mbs}x{t}, model {SHAPE}")
    print(f"train()    : median {median(ref) * 1e3:8.1f} ms/step")
    print(f"split step : median {median(ours) * 1e3:8.1f} ms/step   overhead {overhead:+.2f}%")
    print(result_line("split_step_overhead_pct", overhead, "<=3"))


if __name__ == "__main__":
    main()
