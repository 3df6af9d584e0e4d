"""Mixture of experts: an MoE train step against a dense one at equal active parameters, and the cost of
rollout routing replay, side by side in one run.

- models: Qwen3-MoE shapes, hidden 256, 4 layers; the MoE model has 8 experts of width 256 per layer, 2
  per token; the dense model is the same architecture with every layer dense (`mlp_only_layers`) and an
  MLP of width 512 = 2 x 256, so both run the same attention and the same active MLP per token;
- train step: `Policy.train` with the clipped policy-gradient loss and AdamW on the same batch,
  interleaved repeats, medians (transformers' eager experts: on this CPU the fastest of its experts
  implementations, 0.32 s vs grouped_mm 0.39 s and batched_mm 27 s per forward+backward);
- replay: the MoE step with a recorded routing in the batch and `policy.moe.routing_replay=rollout`
  against the same step without;
- ep=2 vs dp=2 (two gloo processes, one thread each, the same global batch): step time (tokens/s), and
  per rank the parameter and optimizer-state bytes held between steps, plus the expert bytes a MoE layer
  holds while it runs (FSDP2 gathers the layer's whole experts, expert parallelism never does).
  `ep2_param_mem_ratio` is ep=2's per-rank parameters + optimizer state over what a rank of replicated
  data parallelism (DDP) holds, one full copy; posttrain's dp=2 is FSDP2, which already shards both, so
  against it the persistent ratio is ~1 and the difference is the gathered experts (printed).

    python benchmarks/moe.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, result_line, run_main, time_repeats  # noqa: E402

from posttrain.algorithms.losses import ClippedPGLoss  # noqa: E402
from posttrain.data.batch import make_batch  # noqa: E402
from posttrain.models import moe  # noqa: E402
from posttrain.models.tokenizer import build_char_tokenizer  # noqa: E402
from posttrain.parallel.mesh import local_tensor  # noqa: E402
from posttrain.parallel.processes import run_ranks  # noqa: E402
from posttrain.policy.config import PolicyConfig  # noqa: E402
from posttrain.policy.policy import Policy  # noqa: E402

EXPERTS, TOP_K, EXPERT_WIDTH, LAYERS = 8, 2, 256, 4
SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "moe_intermediate_size": EXPERT_WIDTH,
    "intermediate_size": TOP_K * EXPERT_WIDTH,  # the dense layers' MLP: the MoE layers' active width
    "max_position_embeddings": 512,
}


def save_model(out: Path, dense: bool) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_char_tokenizer()
    extra = {"mlp_only_layers": list(range(LAYERS))} if dense else {}
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tok), **SHAPE, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def policy_for(path: Path, b: int, replay: str = "off") -> Policy:
    return Policy(
        PolicyConfig.model_validate(
            {
                "model": {"name": str(path)},
                "train_global_batch_size": b,
                "microbatch": {"train_micro_batch_size": b},
                "optimizer": {"lr": 1e-5},
                "init_reference_model": False,
                "moe": {"routing_replay": replay},
            }
        )
    )


def rl_batch(b: int, t: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    mask = torch.ones(b, t)
    mask[:, : t // 4] = 0  # a quarter prompt
    lp = -torch.rand(b, t, generator=g) - 0.5
    return make_batch(
        input_ids=ids,
        input_lengths=torch.full((b,), t),
        token_mask=mask,
        sample_mask=torch.ones(b),
        advantages=torch.randn(b, 1, generator=g).expand(b, t).contiguous() * mask,
        generation_logprobs=lp,
        prev_logprobs=lp,
        reference_logprobs=lp,
    )


def recorded_routing(policy: Policy, batch) -> torch.Tensor:
    """The routing the model itself chooses on `batch` [b, t, L, k] (what an fp32 engine records), with
    the last token unrecorded as an engine leaves it."""
    model = policy.group.workers[0].model
    with torch.no_grad(), moe.record_routing(model) as calls:
        model(input_ids=batch["input_ids"])
    b, t = batch["input_ids"].shape
    routing = calls[0].view(b, t, *calls[0].shape[1:]).clone()
    routing[:, -1] = moe.NO_RECORD
    return routing


def nbytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def two_ranks(rank: int, world: int, port: int, path: str, ep: int, b: int, t: int, repeats: int) -> dict:
    """One rank of a dp=2 or ep=2 run: step times, and its bytes of parameters, optimizer state and
    the experts resident while a MoE layer runs."""
    from posttrain.data.batch import shard_batch
    from posttrain.policy.worker import PolicyWorker

    torch.set_num_threads(1)
    cfg = PolicyConfig.model_validate(
        {
            "model": {"name": path},
            "train_global_batch_size": b,
            "microbatch": {"train_micro_batch_size": b // world},
            "optimizer": {"lr": 1e-5},
            "init_reference_model": False,
            "parallel": {"expert_parallel_size": ep},
            "cluster": {"backend": "ray", "num_workers": world},
        }
    )
    worker = PolicyWorker(cfg, rank=rank, world_size=world, master_port=port)
    shard = shard_batch(rl_batch(b, t, len(build_char_tokenizer())), world)[rank]
    experts = worker.model.model.layers[0].mlp.experts
    seen: list[int] = []

    def resident(module, args):  # under FSDP2 the layer's parameters are gathered here
        seen.append(nbytes([module.gate_up_proj, module.down_proj]))

    handle = experts.register_forward_pre_hook(resident)
    loss = ClippedPGLoss()
    times = time_repeats(lambda: worker.train(shard, loss), repeats, warmup=1)
    handle.remove()
    params = nbytes(worker.model.parameters())
    optim = nbytes(v for st in worker.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    worker.teardown_comms()
    return {"times": times, "params": params, "optim": optim, "experts_in_forward": max(seen)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    b, t = (8, 64) if args.quick else (16, 128)
    repeats = 3 if args.quick else 7
    with tempfile.TemporaryDirectory() as tmp:
        dense_dir, moe_dir = save_model(Path(tmp) / "dense", True), save_model(Path(tmp) / "moe", False)
        dense, sparse, replaying = (
            policy_for(dense_dir, b),
            policy_for(moe_dir, b),
            policy_for(moe_dir, b, "rollout"),
        )
    vocab = len(build_char_tokenizer())
    batch = rl_batch(b, t, vocab)
    replay_batch = batch.clone()
    replay_batch["routing"] = recorded_routing(sparse, batch)
    count = {
        name: sum(v.numel() for v in p.full_state_dict().values())
        for name, p in (("dense", dense), ("moe", sparse))
    }
    loss = ClippedPGLoss()
    t_dense, t_moe, t_replay = [], [], []
    for _ in range(repeats):  # interleaved: all three share the machine's noise
        t_dense += time_repeats(lambda: dense.train(batch, loss), 1, warmup=1)
        t_moe += time_repeats(lambda: sparse.train(batch, loss), 1, warmup=1)
        t_replay += time_repeats(lambda: replaying.train(replay_batch, loss), 1, warmup=1)
    stats = replaying.pop_routing_stats()
    full_state = nbytes(sparse.group.workers[0].model.parameters()) + nbytes(
        v
        for st in sparse.group.workers[0].optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )
    for p in (dense, sparse, replaying):
        p.shutdown()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(save_model(Path(tmp) / "moe", False))
        runs = {ep: run_ranks(2, two_ranks, path, ep, b, t, repeats) for ep in (1, 2)}
    step = {ep: median([x for r in runs[ep] for x in r["times"]]) for ep in (1, 2)}
    state = {ep: runs[ep][0]["params"] + runs[ep][0]["optim"] for ep in (1, 2)}
    ratio = median(t_moe) / median(t_dense)
    overhead = 100 * (median(t_replay) / median(t_moe) - 1)
    print(
        f"dense {count['dense'] / 1e6:.2f}M parameters; MoE {count['moe'] / 1e6:.2f}M ({EXPERTS} experts x "
        f"{EXPERT_WIDTH}, {TOP_K} per token: the dense model's active MLP); batch {b}x{t}, "
        f"threads {torch.get_num_threads()}, {repeats} interleaved repeats"
    )
    print(
        f"train step median: dense {median(t_dense) * 1e3:.1f} ms, MoE {median(t_moe) * 1e3:.1f} ms, "
        f"MoE with routing replay {median(t_replay) * 1e3:.1f} ms ({stats['total']} decisions replayed, "
        f"{stats['differ']} overriding the trainer's own)"
    )
    mib = 2**20
    for ep, name in ((1, "dp=2 (FSDP2)"), (2, "ep=2")):
        r = runs[ep][0]
        print(
            f"{name:13s}: step {step[ep] * 1e3:.1f} ms ({b * t / step[ep]:.0f} tokens/s); per rank params "
            f"{r['params'] / mib:.2f} MiB + optimizer {r['optim'] / mib:.2f} MiB; a MoE layer's experts "
            f"resident while it runs {r['experts_in_forward'] / mib:.2f} MiB"
        )
    print(
        f"one full replica (replicated data parallelism per rank): {full_state / mib:.2f} MiB; ep=2 / dp=2 "
        f"(FSDP2) per-rank state {state[2] / state[1]:.3f}, tokens/s {step[1] / step[2]:.3f}"
    )
    print(result_line("moe_vs_dense_active_step_time", ratio, "<=2.0"))
    print(result_line("ep2_param_mem_ratio", state[2] / full_state, "<=0.6"))
    print(result_line("routing_replay_overhead_pct", overhead, "<=5"))


if __name__ == "__main__":
    run_main(main)
