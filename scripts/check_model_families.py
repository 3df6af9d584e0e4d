"""Evidence for the model support table (src/posttrain/models/families.py): for each decoder family that
transformers can build from a tiny config, build a random tiny model and check what posttrain does with
it, bypassing the table's refusal. Prints one JSON line per family.

Checks (CPU, fp32):
- attn: the attention implementation the trainer uses (`models.families.attn_implementation`)
- padded: trainer logprobs (models/logprobs.py) of right-padded rows equal each row run alone (1e-5)
- packed: logprobs of packed rows (explicit 4-D / per-layer-type masks) equal padded ones (1e-5)
- train: a backward of the masked logprob sum gives finite gradients, non-zero for most parameters
- tp_plan: the tensor-parallel plan that applies (ours, the config's colwise/rowwise plan, or an error)
- generate: greedy of the current GenerationEngine equals transformers' generate (20 tokens, 4 prompts)

Usage: PYTHONPATH=src python scripts/check_model_families.py [family ...]
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.data.batch import make_batch
from posttrain.data.microbatch import fixed_microbatches, packed_microbatches
from posttrain.models.logprobs import microbatch_logprobs

VOCAB = 79
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
WINDOW = 5
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama3_rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),  # fmt: skip
    "mistral": ("mistral", {}),
    "mistral_window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 16}),
    "gemma3_text": (
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),  # fmt: skip
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "qwen3_moe": (
        "qwen3_moe",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "mixtral_window": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    ),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": (
        "gpt_oss",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),  # fmt: skip
    "phi": ("phi", {}),
    "stablelm": ("stablelm", {}),
    "cohere": ("cohere", {}),
    "glm": ("glm", {"head_dim": 16}),
    "olmo": ("olmo", {}),
    "starcoder2": ("starcoder2", {"sliding_window": None}),
    "gpt_neox": ("gpt_neox", {}),
    "bloom": ("bloom", {"n_layer": 2, "n_head": 4}),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),  # fmt: skip
    "mamba": ("mamba", {"state_size": 8, "expand": 2}),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"]}),
    "qwen3_next": (
        "qwen3_next",
        {
            "head_dim": 16,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),  # fmt: skip
}


def build(name: str):
    from posttrain.models.families import attn_implementation

    model_type, extra = FAMILIES[name]
    config = AutoConfig.for_model(model_type, **{**BASE, **extra})
    torch.manual_seed(0)
    attn = attn_implementation(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    return model, attn


def batch():
    g = torch.Generator().manual_seed(0)
    b, t = 6, 16
    ids = torch.randint(4, VOCAB, (b, t), generator=g)
    lengths = torch.tensor([16, 9, 13, 6, 16, 11])
    valid = torch.arange(t)[None] < lengths[:, None]
    mask = valid.float()
    mask[:, :3] = 0
    return make_batch(
        input_ids=ids * valid, input_lengths=lengths, token_mask=mask, sample_mask=torch.ones(b)
    )


def check_logprobs(model, data) -> dict:
    padded = microbatch_logprobs(model, fixed_microbatches(data, 6)[0])
    alone = []
    for i, n in enumerate(data["input_lengths"].tolist()):
        row = data[i : i + 1].clone()
        row["input_ids"] = row["input_ids"][:, :n]
        row["token_mask"] = row["token_mask"][:, :n]
        lp = microbatch_logprobs(model, fixed_microbatches(row, 1)[0])
        alone.append(torch.nn.functional.pad(lp, (0, 16 - n)))
    out = {"padded_vs_alone": float((padded - torch.cat(alone)).abs().max())}
    mbs = packed_microbatches(data, 40)
    packed = torch.zeros_like(padded)
    for mb in mbs:
        lp = microbatch_logprobs(model, mb)
        packed[mb.indices, : lp.shape[1]] = lp
    out["packed_vs_padded"] = float((packed - padded).abs().max())
    return out


def check_train(model, data) -> dict:
    model.train()
    mb = packed_microbatches(data, 40)[0]
    lp = microbatch_logprobs(model, mb)
    loss = -(lp * mb.data["token_mask"]).sum()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    finite = all(g is None or torch.isfinite(g).all() for g in grads)
    nonzero = sum(1 for g in grads if g is not None and g.abs().sum() > 0)
    model.zero_grad()
    model.eval()
    return {"train_finite": finite, "params_with_grad": f"{nonzero}/{len(grads)}"}


def check_tp(model) -> str:
    from posttrain.parallel.tensor_parallel import SUPPORTED_MODEL_TYPES, _from_hf_plan, moe_block

    if model.config.model_type in SUPPORTED_MODEL_TYPES:
        names = {n.split(".", 3)[-1] for n, _ in model.named_modules() if n.startswith("model.layers.0.")}
        need = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
        if not moe_block(model.model.layers[0]):  # an MoE block stays whole under tensor parallelism
            need |= {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
        return "ours" if need <= names else f"ours, but missing {sorted(need - names)}"
    try:
        return f"hf plan ({len(_from_hf_plan(model.config))} entries)"
    except ValueError as e:
        return f"none: {str(e)[:90]}"


def check_generate(model) -> str:
    from posttrain.generation.engine import GenerationEngine
    from posttrain.generation.params import GenerationConfig, SamplingParams

    sys.path.insert(0, "tests")
    from test_generation import hf_greedy

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 9, 3)]
    try:
        engine = GenerationEngine(model, None, GenerationConfig(max_num_seqs=2))
        got = [r.token_ids for r in engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=20))]
    except Exception as e:  # noqa: BLE001 - evidence: what the engine says
        return f"error: {type(e).__name__}: {str(e)[:80]}"
    want = hf_greedy(model, prompts, 20, eos=2)
    return "equal" if got == want else "DIFFERENT"


def check(name: str) -> dict:
    out: dict = {"family": name}
    try:
        model, attn = build(name)
        out["attn"] = attn
        model.eval()
        data = batch()
        with torch.no_grad():
            out |= check_logprobs(model, data)
        out |= check_train(model, data)
        out["tp_plan"] = check_tp(model)
        out["generate"] = check_generate(model)
    except Exception as e:  # noqa: BLE001 - evidence: where and how it fails
        frame = traceback.extract_tb(e.__traceback__)[-1]
        out["error"] = f"{type(e).__name__}: {str(e)[:160]} [{frame.filename.split('/')[-1]}:{frame.lineno}]"
    return out


# ------------------------------------------------------------------ parallel layouts (2 gloo ranks)

LAYOUTS = {"tp2": ({"tensor_parallel_size": 2}, "padded"), "cp2": ({"context_parallel_size": 2}, "packed")}


def _worker_cfg(path: str, layout: str | None, world: int = 1):
    from posttrain.policy.config import PolicyConfig

    cfg = {"model": {"name": path, "tokenizer": "tiny"}, "train_global_batch_size": 6}
    if layout is not None:
        par, mode = LAYOUTS[layout]
        cfg |= {"parallel": par, "cluster": {"backend": "ray", "num_workers": world}}
        if mode == "packed":
            cfg["microbatch"] = {"mode": "packed", "max_tokens": 40}
    return PolicyConfig.model_validate(cfg)


def _on_ranks(rank: int, world: int, port: int, jobs: list[tuple[str, str]]) -> list:
    from posttrain.policy.worker import PolicyWorker

    out = []
    for path, layout in jobs:
        try:
            worker = PolicyWorker(
                _worker_cfg(path, layout, world), rank=rank, world_size=world, master_port=port
            )
            lp = worker.get_logprobs(batch())
            worker.teardown_comms()
            out.append(lp if rank == 0 else None)
        except Exception as e:  # noqa: BLE001 - evidence
            out.append(f"error: {type(e).__name__}: {str(e)[:120]}")
    return out


def check_parallel(names: list[str]) -> None:
    import tempfile

    from posttrain.parallel.processes import run_ranks
    from posttrain.policy.worker import PolicyWorker

    root = tempfile.mkdtemp()
    jobs, refs = [], {}
    for name in names:
        model, _ = build(name)
        path = f"{root}/{name}"
        model.save_pretrained(path)
        refs[path] = PolicyWorker(_worker_cfg(path, None)).get_logprobs(batch())
        jobs += [(path, layout) for layout in LAYOUTS]
    results = run_ranks(2, _on_ranks, jobs)[0]
    for (path, layout), got in zip(jobs, results):
        res = got if isinstance(got, str) else float((got - refs[path]).abs().max())
        print(
            json.dumps({"family": path.rsplit("/", 1)[-1], "layout": layout, "vs_one_rank": res}), flush=True
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    args = sys.argv[1:]
    if args[:1] == ["--parallel"]:
        check_parallel(args[1:] or list(FAMILIES))
    else:
        for name in args or FAMILIES:
            print(json.dumps(check(name)), flush=True)
