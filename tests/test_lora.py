"""LoRA (models/lora.py) on CPU: settings refused with their fix; the merge against peft's own and the
adapter directory read by peft; a step moves every adapter and no base weight; the reference is the
untouched base; engines fed merged weights or the adapters alone compute and sample what the trainer
does (sleep and wake included); then the SFT, GRPO and asynchronous GRPO loops with `policy.lora`."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from conftest import random_batch
from helpers import policy_cfg, small_async_grpo_cfg, small_grpo_cfg
from posttrain.algorithms.async_grpo.run import run_async_grpo
from posttrain.algorithms.grpo import run_grpo
from posttrain.algorithms.losses import ClippedPGConfig, ClippedPGLoss
from posttrain.algorithms.sft import SFTConfig, run_sft
from posttrain.config import build_config
from posttrain.generation.engine import EngineStateError, GenerationEngine
from posttrain.generation.params import SamplingParams
from posttrain.generation.probe import ProbeBatch, ProbeConfig, probe_metrics
from posttrain.generation.weight_sync import WeightSync, WeightSyncConfig
from posttrain.logging import read_metrics
from posttrain.models.hf import build_tiny_model
from posttrain.models.lora import (
    LoraSettings,
    add_lora,
    is_adapter_key,
    merged_weights,
    peft_state_dict,
    scalings,
)
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy.model_init import engine_model, load_full_model
from posttrain.policy.policy import Policy

TOK = build_char_tokenizer()
VOCAB = len(TOK)
LORA = {"rank": 4, "alpha": 8.0}
LORA_OVERRIDES = ("policy.lora.rank=4", "policy.lora.alpha=8.0")
PROMPTS = [[5, 9, 14, 22], [7], [30, 31, 32, 33, 34, 35, 36], [12, 40]]
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11, stop_at_eos=False)
GREEDY = SamplingParams(greedy=True, max_new_tokens=12, stop_at_eos=False)


def model_of(policy: Policy) -> torch.nn.Module:
    return policy.group.workers[0].model


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def randomize_adapters(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> None:
    """Adapters far from their start (B = 0 makes a fresh adapter the identity): outputs then differ
    clearly from the base model's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if is_adapter_key(name):
                p.copy_(torch.randn(p.shape, generator=g) * std)


def lora_policy(engine: str) -> Policy:
    policy = Policy(policy_cfg(lora={**LORA, "engine": engine}))
    randomize_adapters(model_of(policy))
    return policy


def engine_for(policy: Policy) -> GenerationEngine:
    """An engine built as the loops build theirs (adapters of its own with lora.engine=adapters)."""
    cfg = policy.cfg
    return GenerationEngine(engine_model(cfg.model, cfg.lora, TOK), TOK)


def max_diff(a: torch.Tensor, b: torch.Tensor, probe: ProbeBatch) -> float:
    return probe_metrics(a, b, probe)["probe_max_abs_diff"]


def tokens(engine: GenerationEngine, params: SamplingParams) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, params)]


# ---------------------------------------------------------------------------- settings


def test_settings_refuse_frozen_targets_empty_lists_and_dropout_under_tp():
    for bad in (["lm_head"], ["q_proj", "embed_tokens"], "lm_head"):
        with pytest.raises(ValidationError, match="may not include .* stay frozen"):
            LoraSettings(target_modules=bad)
    with pytest.raises(ValidationError, match="target_modules is empty; name modules"):
        LoraSettings(target_modules=[])
    # a bare name is one module name, not peft's regex over full paths (which "q_proj" would miss)
    assert LoraSettings(target_modules="q_proj").target_modules == ["q_proj"]
    assert LoraSettings().target_modules == "all-linear"
    tp = {"parallel": {"tensor_parallel_size": 2}, "cluster": {"backend": "ray", "num_workers": 2}}
    with pytest.raises(ValidationError, match="Set policy.lora.dropout=0"):
        policy_cfg(lora={"dropout": 0.1}, **tp)
    policy_cfg(lora={"dropout": 0.0}, **tp)
    policy_cfg(lora={"dropout": 0.1})  # no tensor parallelism: dropout is fine


def test_target_names_that_match_no_linear_layer_are_refused_naming_the_layers_there():
    linear = r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"
    # peft itself refuses only when no name matches: a misspelt one next to a good one would be ignored
    for targets, bad in ((["q_proj", "v_prj"], "v_prj"), (["nope"], "nope"), (["norm"], "norm")):
        with pytest.raises(ValueError, match=rf"\['{bad}'\] name no linear layer .* {linear}: name some"):
            add_lora(build_tiny_model(VOCAB), LoraSettings(target_modules=targets))
    with pytest.raises(ValueError, match="name no linear layer"):
        Policy(policy_cfg(lora={"target_modules": ["qproj"]}))
    model = add_lora(build_tiny_model(VOCAB), LoraSettings(target_modules="q_proj"))
    assert sorted(scalings(model)) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    # a regular expression is peft's: over full module paths; the LM head stays frozen there too
    model = add_lora(build_tiny_model(VOCAB), LoraSettings(target_modules=r".*layers\.1\..*_proj"))
    assert len(scalings(model)) == 7 and all(".layers.1." in n for n in scalings(model))
    with pytest.raises(ValueError, match=r"adapts \['lm_head'\]: the embedding and LM head stay frozen"):
        add_lora(build_tiny_model(VOCAB), LoraSettings(target_modules="lm_head|.*q_proj"))


# ---------------------------------------------------------------------------- merge and peft's files


def test_merged_weights_equal_peft_merge_and_the_adapter_directory_loads_in_peft(tmp_path):
    import peft
    from safetensors.torch import save_file

    settings = LoraSettings(
        rank=4, alpha=8.0, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    model = add_lora(build_tiny_model(VOCAB, seed=3), settings)
    randomize_adapters(model)
    assert set(scalings(model).values()) == {8.0 / math.sqrt(4)}  # rsLoRA: alpha / sqrt(rank)
    merged = dict(merged_weights(model.state_dict().items(), scalings(model)))
    assert merged.keys() == build_tiny_model(VOCAB, seed=3).state_dict().keys()  # the base's names

    adapters = peft_state_dict(model.named_parameters())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapters
    assert len(adapters) == 2 * 3 * 2  # A and B of 3 layer kinds in each of 2 decoder layers
    save_file(adapters, tmp_path / "adapter_model.safetensors")
    settings.peft_config().save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(build_tiny_model(VOCAB, seed=3), tmp_path)
    assert adapters.keys() == peft.get_peft_model_state_dict(loaded).keys()
    ids = torch.tensor(PROMPTS[2:3])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
        reference = loaded.merge_and_unload().state_dict()
    assert reference.keys() == merged.keys()
    for name, t in merged.items():
        torch.testing.assert_close(t, reference[name], rtol=0, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    changed = [
        n for n in merged if not torch.equal(merged[n], build_tiny_model(VOCAB, seed=3).state_dict()[n])
    ]
    assert len(changed) == 6  # exactly the adapted layers


# ---------------------------------------------------------------------------- training


def test_a_step_moves_every_adapter_and_no_base_weight_and_no_reference_copy_is_kept():
    policy = Policy(policy_cfg(lora=LORA))
    worker = policy.group.workers[0]
    assert worker.reference_weights is None  # the reference is the model with its adapters disabled
    model = worker.model
    adapter_ids = {id(p) for n, p in model.named_parameters() if is_adapter_key(n)}
    optimized = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert optimized == adapter_ids and len(adapter_ids) == 2 * 7 * 2  # A, B x 7 linear x 2 layers
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if is_adapter_key(n)
    }
    loss = ClippedPGLoss(ClippedPGConfig(reference_policy_kl_penalty=0.1))
    start = params(model)
    policy.train(random_batch(8, 16, seed=0, rl=True), loss)
    first = params(model)
    # B starts at zero, so A's gradient is zero on the first step (peft's init): only B moves
    for name, t in first.items():
        assert torch.equal(t, start[name]) == (".lora_B." not in name), name
    policy.train(random_batch(8, 16, seed=1, rl=True), loss)
    for name, t in params(model).items():
        assert torch.equal(t, start[name]) != is_adapter_key(name), name


def test_reference_logprobs_are_the_untouched_base_models():
    policy = Policy(policy_cfg(lora=LORA, optimizer={"lr": 3e-2}))
    for s in range(4):
        policy.train(random_batch(8, 16, seed=s, rl=True), ClippedPGLoss(ClippedPGConfig()))
    batch = random_batch(8, 16, seed=9)
    trained = policy.get_logprobs(batch)
    reference = policy.get_reference_policy_logprobs(batch)
    mask = batch["token_mask"][:, 1:].bool()
    assert (trained - reference)[:, 1:][mask].abs().max() > 1e-2  # the adapters moved the policy
    # the same code path on a full model without adapters: bit for bit
    assert torch.equal(reference, Policy(policy_cfg()).get_logprobs(batch))
    # a plain Hugging Face forward of the untouched base model
    base = load_full_model(policy.cfg.model, TOK).eval()
    with torch.no_grad():
        logits = base(batch["input_ids"]).logits.float()
    plain = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    torch.testing.assert_close(reference[:, 1:][mask], plain[mask], rtol=0, atol=1e-6)
    # the adapters are on again afterwards, and still the only trainable tensors
    assert torch.equal(policy.get_logprobs(batch), trained)
    model = model_of(policy)
    assert all(p.requires_grad == is_adapter_key(n) for n, p in model.named_parameters())


# ---------------------------------------------------------------------------- engines


def test_an_engine_fed_merged_weights_computes_the_trainers_logprobs():
    policy = lora_policy("merged")
    engine = engine_for(policy)
    sync = WeightSync(WeightSyncConfig(), VOCAB)
    metrics = sync.sync_local(policy, engine, 1)
    assert metrics["probe_max_abs_diff"] < 1e-5
    full = policy.full_state_dict()
    assert metrics["bytes"] == sum(t.numel() * t.element_size() for t in full.values())
    probe = ProbeBatch(ProbeConfig(seed=5, num_sequences=8), VOCAB)
    trainer = policy.get_logprobs(probe.batch)
    assert max_diff(engine.compute_logprobs(probe.sequences), trainer, probe) < 1e-5
    base = GenerationEngine(load_full_model(policy.cfg.model, TOK), TOK)
    assert max_diff(base.compute_logprobs(probe.sequences), trainer, probe) > 1e-2  # adapters matter


def test_an_engine_with_adapters_computes_and_samples_what_the_merged_engine_does():
    policy = lora_policy("adapters")
    engine = engine_for(policy)
    assert engine._lean is not None  # decode steps take the lean path's low-rank update
    sync = WeightSync(WeightSyncConfig(), VOCAB)
    metrics = sync.sync_local(policy, engine, 1)
    assert metrics["probe_max_abs_diff"] < 1e-5
    adapters = policy.engine_state_dict()
    assert adapters and all(is_adapter_key(n) for n in adapters)
    merged = GenerationEngine(load_full_model(policy.cfg.model, TOK), TOK)
    merged_stats = merged.load_weights(policy.full_state_dict(), version=1)
    # what travels: the adapters alone, a fraction of the merged weights
    assert metrics["bytes"] == sum(t.numel() * t.element_size() for t in adapters.values())
    assert metrics["bytes"] * 8 < merged_stats["bytes"]
    probe = ProbeBatch(ProbeConfig(seed=5, num_sequences=8), VOCAB)
    ours = engine.compute_logprobs(probe.sequences)
    assert max_diff(ours, merged.compute_logprobs(probe.sequences), probe) < 1e-5
    assert max_diff(ours, policy.get_logprobs(probe.batch), probe) < 1e-5
    sampled = tokens(engine, SAMPLED)
    assert len({t for row in sampled for t in row}) > 10  # varied tokens, not a repeated EOS
    assert sampled == tokens(merged, SAMPLED)
    assert tokens(engine, GREEDY) == tokens(merged, GREEDY)
    base = GenerationEngine(load_full_model(policy.cfg.model, TOK), TOK)
    assert tokens(base, GREEDY) != tokens(engine, GREEDY)  # the adapters change what is generated


def test_an_engine_with_adapters_sleeps_without_its_weights_and_wakes_with_its_base():
    policy = lora_policy("adapters")
    engine = engine_for(policy)
    engine.load_weights(policy.engine_state_dict(), version=1)
    before = tokens(engine, SAMPLED)
    base = {n: p.clone() for n, p in engine.model.named_parameters() if not is_adapter_key(n)}
    assert engine.sleep(keep_weights=False)["bytes_released"] > 0
    with pytest.raises(EngineStateError):
        engine.generate(PROMPTS, SAMPLED)
    engine.wake()
    woken = dict(engine.model.named_parameters())
    assert all(torch.equal(woken[n], t) for n, t in base.items())  # no load brings the base back: kept
    with pytest.raises(EngineStateError, match="no complete weights"):  # the adapters were dropped
        engine.generate(PROMPTS, SAMPLED)
    # a load of the adapters alone restores the outputs
    stats = engine.load_weights(policy.engine_state_dict(), version=2)
    assert stats["tensors"] == len(policy.engine_state_dict())
    assert tokens(engine, SAMPLED) == before


def test_an_engine_with_adapters_keeps_its_base_when_a_copy_load_follows_a_share():
    """After share_weights a copy load stops aliasing the trainer's tensors; it re-points only what it
    brings (the adapters), so the base, which no load sends, keeps its values."""
    policy = lora_policy("adapters")
    never_shared = engine_for(policy)
    never_shared.load_weights(policy.engine_state_dict(), version=1)
    engine = engine_for(policy)
    adapters = {n: t.detach().clone() for n, t in policy.engine_state_dict().items()}
    engine.share_weights(adapters, version=1)
    base = {n: p.clone() for n, p in engine.model.named_parameters() if not is_adapter_key(n)}
    engine.load_weights(adapters, version=2)
    now = dict(engine.model.named_parameters())
    assert all(torch.equal(now[n], t) for n, t in base.items())
    assert all(now[n].data_ptr() != t.data_ptr() for n, t in adapters.items())  # copies, not aliases
    assert tokens(engine, GREEDY) == tokens(never_shared, GREEDY)
    assert tokens(engine, SAMPLED) == tokens(never_shared, SAMPLED)


def test_engines_refuse_weights_of_the_other_kind_saying_what_to_send():
    policy = lora_policy("adapters")
    with pytest.raises(ValueError, match="carries LoRA adapters and loads only them; send the adapter"):
        engine_for(policy).load_weights(policy.full_state_dict(), version=1)
    plain = GenerationEngine(load_full_model(policy.cfg.model, TOK), TOK)
    with pytest.raises(ValueError, match="this engine has no adapters; build the engine with"):
        plain.load_weights(policy.engine_state_dict(), version=1)


# ---------------------------------------------------------------------------- loops


@pytest.fixture
def length_reward(tmp_path) -> str:
    """A reward that varies within a group (the completion's length), so advantages are not all zero;
    named by file path, which Ray rollout actors can load too."""
    path = tmp_path / "length_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            def reward(prompts, completions, metadata):
                return [float(len(c)) for c in completions]
            """
        )
    )
    return f"{path}:reward"


def assert_only_adapters_moved(before: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    for name, t in params(model).items():
        # (on a GPU the run ends with the trainer offloaded to the host)
        assert torch.equal(t.cpu(), before[name].cpu()) != is_adapter_key(name), name


def test_sft_trains_the_adapters_and_saves_the_merged_model(tmp_path):
    cfg = build_config(
        SFTConfig,
        {
            "policy": {
                "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64}},
                "train_global_batch_size": 16,
                "microbatch": {"train_micro_batch_size": 16},
                "optimizer": {"lr": 1e-2},
                "lora": LORA,
            },
            "max_num_steps": 12,
            "val_period": 0,
            "output_dir": str(tmp_path),
            "logging": {"progress_bar": False},
        },
    )
    policy = Policy(cfg.policy)
    before = params(model_of(policy))
    run_sft(cfg, policy)
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    # (the random tiny model's frozen LM head and final norm bound how peaked its logits can get: the
    # loss starts near log(vocab) and adapters alone take it down a few tenths)
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3
    assert_only_adapters_moved(before, model_of(policy))
    # the saved Hugging Face model is the merged one: a plain model that computes the policy's logprobs
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    probe = ProbeBatch(ProbeConfig(), VOCAB)
    with torch.no_grad():
        logits = saved(probe.batch["input_ids"]).logits
    ids = probe.batch["input_ids"]
    plain = torch.zeros(ids.shape)
    plain[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    assert max_diff(plain, policy.get_logprobs(probe.batch), probe) < 1e-5


def test_grpo_trains_only_the_adapters_and_both_engine_modes_train_alike(tmp_path, length_reward):
    """One short run per engine mode (KL on, so the reference is the adapters-disabled model): the probe
    passes every sync, adapters-only syncs move a fraction of the bytes, and the two runs draw the same
    samples (their engines agree to ~1e-7 in logprob) and train alike."""
    runs, adapter_bytes = {}, 0
    for mode in ("merged", "adapters"):
        cfg = small_grpo_cfg(
            tmp_path / mode,
            *LORA_OVERRIDES,
            f"policy.lora.engine={mode}",
            "policy.optimizer.lr=1e-2",
            "loss.reference_policy_kl_penalty=0.1",
            f"task.reward_fn={length_reward}",
            "grpo.max_num_steps=3",
            "grpo.val_period=3",
            "checkpointing.save_period=3",
        )
        policy = Policy(cfg.policy)
        before = params(model_of(policy))
        run_grpo(cfg, policy)
        assert_only_adapters_moved(before, model_of(policy))
        runs[mode] = [r for r in read_metrics(tmp_path / mode / "metrics.jsonl") if "train/loss" in r]
        if mode == "adapters":
            policy.prepare_for_lp_inference()  # on a GPU the run ends with the trainer offloaded
            adapter_bytes = sum(t.numel() * t.element_size() for t in policy.engine_state_dict().values())
    assert [r["step"] for r in runs["merged"]] == [r["step"] for r in runs["adapters"]] == [1, 2, 3]
    for a, b in zip(runs["merged"], runs["adapters"]):
        assert a["weight_sync/probe_max_abs_diff"] < 1e-5 and b["weight_sync/probe_max_abs_diff"] < 1e-5
        assert b["weight_sync/bytes"] == adapter_bytes and adapter_bytes * 4 < a["weight_sync/bytes"]
        assert a["reward"] == b["reward"] and a["train/grad_norm"] > 0
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
    assert (tmp_path / "adapters" / "checkpoints" / "step_3" / "metadata.json").is_file()


@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_async_grpo_trains_only_the_adapters(tmp_path, length_reward, mode):
    cfg = small_async_grpo_cfg(
        tmp_path,
        *LORA_OVERRIDES,
        f"policy.lora.engine={mode}",
        "policy.optimizer.lr=1e-2",
        f"task.reward_fn={length_reward}",
        "async_grpo.num_steps=3",
        "grpo.val_period=3",
        "checkpointing.enabled=false",
    )
    policy = Policy(cfg.policy)
    before = params(model_of(policy))
    last = run_async_grpo(cfg, policy)
    assert last["summary/steps"] == 3
    assert_only_adapters_moved(before, model_of(policy))
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["weight_sync/probe_max_abs_diff"] < 1e-5 for r in steps)


@pytest.mark.distributed
def test_async_grpo_with_a_ray_rollout_actor_holding_adapters(tmp_path, length_reward, ray_session):
    cfg = small_async_grpo_cfg(
        tmp_path,
        *LORA_OVERRIDES,
        "policy.lora.engine=adapters",
        "policy.optimizer.lr=1e-2",
        f"task.reward_fn={length_reward}",
        "rollout.backend=ray",
        "rollout.num_workers=1",
        "rollout.torch_threads=1",
        "async_grpo.num_steps=3",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "checkpointing.enabled=false",
    )
    policy = Policy(cfg.policy)
    before = params(model_of(policy))
    assert run_async_grpo(cfg, policy)["summary/steps"] == 3
    assert_only_adapters_moved(before, model_of(policy))
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["weight_sync/probe_max_abs_diff"] < 1e-5 for r in steps)
