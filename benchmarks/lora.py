"""LoRA vs full fine-tuning on the same ~19M-parameter model, side by side in one run.

- trainable state: bytes of the parameters that train, their gradients (measured inside an open split
  step, after backward) and the optimizer state (after the step), LoRA rank 16 on every linear layer
  of the decoder vs the full model; plus the reference policy each keeps (a host copy of the weights
  for full fine-tuning, nothing for LoRA: its reference is the model with adapters disabled);
- GRPO train-step time (clipped policy-gradient loss, AdamW), interleaved repeats, medians;
- weight sync: bytes and seconds moved into a generation engine, merged weights vs adapters alone
  (each probe-checked against the trainer).

    python benchmarks/lora.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line, time_repeats  # noqa: E402

from posttrain.algorithms.losses import ClippedPGLoss  # noqa: E402
from posttrain.data.batch import make_batch  # noqa: E402
from posttrain.generation.engine import GenerationEngine  # noqa: E402
from posttrain.generation.weight_sync import WeightSync, WeightSyncConfig  # noqa: E402
from posttrain.policy.config import PolicyConfig  # noqa: E402
from posttrain.policy.model_init import engine_model  # noqa: E402
from posttrain.policy.policy import Policy  # noqa: E402

SHAPE = {  # ~19M parameters
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
RANK = 16


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def policy_for(lora: dict | None, b: int, engine: str = "merged") -> Policy:
    cfg = {
        "model": {"tiny": SHAPE},
        "train_global_batch_size": b,
        "microbatch": {"train_micro_batch_size": b},
        "optimizer": {"lr": 1e-4},
    }
    if lora is not None:
        cfg["lora"] = {**lora, "engine": engine}
    return Policy(PolicyConfig.model_validate(cfg))


def rl_batch(b: int, t: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    token_mask = torch.ones(b, t)
    token_mask[:, : t // 2] = 0  # the prompt
    logprobs = -torch.rand(b, t, generator=g) * 3 - 1
    return make_batch(
        input_ids=ids,
        input_lengths=torch.full((b,), t),
        token_mask=token_mask,
        sample_mask=torch.ones(b),
        advantages=torch.randn(b, 1, generator=g).expand(b, t).clone(),
        prev_logprobs=logprobs,
        generation_logprobs=logprobs,
        reference_logprobs=logprobs,
    )


def trainable_state(policy: Policy, batch) -> dict[str, int]:
    """Bytes of the trainable parameters, their gradients and the optimizer state, and the reference copy."""
    worker = policy.group.workers[0]
    trainable = [p for p in worker.model.parameters() if p.requires_grad]
    loss = ClippedPGLoss()
    worker.begin_train_step(loss)
    worker.train_microbatch(batch)
    grads = nbytes(p.grad for p in trainable if p.grad is not None)
    worker.finish_train_step()
    optim = nbytes(v for s in worker.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    reference = nbytes(worker.reference_weights.values()) if worker.reference_weights else 0
    total = sum(p.numel() for p in worker.model.parameters())
    return {
        "params": nbytes(trainable),
        "grads": grads,
        "optim": optim,
        "reference": reference,
        "n_trainable": sum(p.numel() for p in trainable),
        "n_total": total,
    }


def sync_cost(policy: Policy, repeats: int) -> dict[str, float]:
    cfg = policy.cfg
    worker = policy.group.workers[0]
    engine = GenerationEngine(engine_model(cfg.model, cfg.lora, worker.tokenizer), worker.tokenizer)
    sync = WeightSync(WeightSyncConfig(), engine.vocab_size)
    runs = [sync.sync_local(policy, engine, v + 1) for v in range(repeats)]
    return {
        "bytes": runs[0]["bytes"],
        "seconds": median([r["seconds"] for r in runs]),
        "probe": max(r["probe_max_abs_diff"] for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    b, t = (8, 64) if args.quick else (16, 128)
    repeats = 3 if args.quick else 7
    torch.manual_seed(0)
    lora = {"rank": RANK, "alpha": 2 * RANK}
    full, adapted = policy_for(None, b), policy_for(lora, b)
    vocab = len(full.group.workers[0].tokenizer)
    batch = rl_batch(b, t, vocab)

    mem_full, mem_lora = trainable_state(full, batch), trainable_state(adapted, batch)
    state = {k: v["params"] + v["grads"] + v["optim"] for k, v in (("full", mem_full), ("lora", mem_lora))}

    loss = ClippedPGLoss()
    t_full, t_lora = [], []
    for _ in range(repeats):  # interleaved: both share the machine's noise
        t_full += time_repeats(lambda: full.train(batch, loss), 1, warmup=0)
        t_lora += time_repeats(lambda: adapted.train(batch, loss), 1, warmup=0)

    merged = sync_cost(adapted, repeats)
    adapters_only = sync_cost(policy_for(lora, b, engine="adapters"), repeats)

    mib = 2**20
    print(
        f"model {SHAPE}: {mem_full['n_total'] / 1e6:.1f}M parameters; LoRA rank {RANK} on all linear layers"
    )
    print(f"batch {b}x{t}, threads {torch.get_num_threads()}, {repeats} interleaved repeats")
    for name, m in (("full", mem_full), ("lora", mem_lora)):
        print(
            f"{name:5s}: trainable {m['n_trainable'] / 1e6:7.3f}M  params {m['params'] / mib:7.2f} MiB  "
            f"grads {m['grads'] / mib:7.2f} MiB  optimizer {m['optim'] / mib:7.2f} MiB  "
            f"= {state[name] / mib:7.2f} MiB; reference copy {m['reference'] / mib:7.2f} MiB"
        )
    print(
        f"GRPO train step: full median {median(t_full) * 1e3:8.1f} ms, LoRA median {median(t_lora) * 1e3:8.1f} ms"
    )
    for name, s in (("merged", merged), ("adapters", adapters_only)):
        print(
            f"weight sync ({name:8s}): {s['bytes'] / mib:8.2f} MiB in {s['seconds'] * 1e3:7.1f} ms "
            f"(probe max |diff| {s['probe']:.2e})"
        )
    print(result_line("lora_state_mem_ratio", state["lora"] / state["full"], "<=0.1"))
    print(result_line("lora_step_speedup", median(t_full) / median(t_lora), ">=1.0"))
    print(result_line("lora_sync_bytes_ratio", adapters_only["bytes"] / merged["bytes"], "<=0.1"))


if __name__ == "__main__":
    main()
