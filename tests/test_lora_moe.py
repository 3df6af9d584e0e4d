"""LoRA on mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE) with the default `all-linear`: peft 0.21
would map it onto the fused 3-D experts and the router (`target_parameters`), which merge, weight sync and
export do not handle; posttrain resolves it to the model's linear layers. The merged weights the policy
syncs and saves are then peft's own merge (`merge_and_unload`), an engine fed them computes the trainer's
logprobs, `save_hf` and both exports load in transformers and peft; targets that lead peft onto the
experts anyway are refused naming the setting."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import random_batch
from helpers import policy_cfg
from model_zoo import save_family_model
from posttrain.algorithms.losses import ClippedPGConfig, ClippedPGLoss
from posttrain.cli import main
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.weight_sync import WeightSync, WeightSyncConfig
from posttrain.models.lora import LoraSettings, add_lora, all_linear_targets, is_adapter_key, lora_layers
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy.model_init import engine_model
from posttrain.policy.policy import Policy
from test_lora import randomize_adapters
from test_lora_checkpoint import hf_logprobs

TOK = build_char_tokenizer()
LORA = {"rank": 4, "alpha": 8.0}
ATTENTION = ["k_proj", "o_proj", "q_proj", "v_proj"]


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_all_linear_lora_on_moe_merges_syncs_saves_and_exports_as_peft_does(tmp_path, family):
    base_dir = save_family_model(family, TOK, tmp_path / "base")
    policy = Policy(policy_cfg(model={"name": str(base_dir)}, lora=LORA))
    model = policy.group.workers[0].model
    assert policy.cfg.lora.target_modules == "all-linear"
    # the linear layers: the attention projections; the fused experts and the router stay frozen
    layers = lora_layers(model)
    assert {type(m).__name__ for m in layers.values()} == {"Linear"}  # peft's lora.Linear, no ParamWrapper
    assert sorted({n.rsplit(".", 1)[-1] for n in layers}) == ATTENTION and len(layers) == 2 * 4
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert {n for n in frozen if ".mlp." in n} == {n for n, _ in model.named_parameters() if ".mlp." in n}
    policy.train(random_batch(8, 14, rl=True), ClippedPGLoss(ClippedPGConfig()))  # a step trains them
    randomize_adapters(model)  # far from B = 0, so the merge matters

    # what weight sync and save_hf send: peft's own merge of the same adapters into the base
    merged = policy.full_state_dict()
    policy.save_checkpoint(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "adapter"), "--adapter"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ATTENTION and not config["target_parameters"]
    adapted = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter"
    )
    batch = random_batch(8, 14)
    lp = policy.get_logprobs(batch)
    torch.testing.assert_close(hf_logprobs(adapted, batch), lp, rtol=0, atol=1e-5)
    peft_merged = adapted.merge_and_unload().state_dict()
    assert_same(merged, peft_merged, atol=1e-6)
    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    assert {n for n in merged if not torch.equal(merged[n], base[n])} == {f"{n}.weight" for n in layers}

    assert_same(policy.engine_state_dict(), merged, atol=0)
    engine = GenerationEngine(engine_model(policy.cfg.model, policy.cfg.lora, TOK), TOK)
    metrics = WeightSync(WeightSyncConfig(), len(TOK)).sync_local(policy, engine, 1)
    assert metrics["probe_max_abs_diff"] < 1e-5

    policy.save_hf(str(tmp_path / "hf"))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "merged")]) == 0
    # save_hf merges where the policy trains; export merges the checkpoint on the host: on a GPU the
    # two B @ A products differ in rounding (3e-8 seen on an H200)
    on_host = next(model.parameters()).device.type == "cpu"
    for out, atol in (("hf", 0), ("merged", 0 if on_host else 1e-6)):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / out)
        assert_same(loaded.state_dict(), merged, atol=atol)
        torch.testing.assert_close(hf_logprobs(loaded, batch), lp, rtol=0, atol=1e-5)


def test_an_engine_holding_adapters_of_an_moe_policy_computes_the_trainers_logprobs(tmp_path):
    base_dir = save_family_model("qwen3_moe", TOK, tmp_path / "base")
    policy = Policy(policy_cfg(model={"name": str(base_dir)}, lora={**LORA, "engine": "adapters"}))
    randomize_adapters(policy.group.workers[0].model)
    engine = GenerationEngine(engine_model(policy.cfg.model, policy.cfg.lora, TOK), TOK)
    assert sorted({n.rsplit(".", 1)[-1] for n in lora_layers(engine.model)}) == ATTENTION
    metrics = WeightSync(WeightSyncConfig(), len(TOK)).sync_local(policy, engine, 1)
    assert metrics["probe_max_abs_diff"] < 1e-5
    assert all(is_adapter_key(n) for n in policy.engine_state_dict())


def test_targets_that_lead_peft_onto_the_experts_are_refused_naming_the_setting(tmp_path):
    base_dir = save_family_model("qwen3_moe", TOK, tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    # a regular expression over every projection of layer 0: peft maps it onto the fused experts too
    with pytest.raises(
        ValueError,
        match=r"policy.lora.target_modules='.\*layers.*' made peft adapt parameters, not linear layers "
        r"\(model.layers.0.mlp.experts.*Use all-linear",
    ):
        add_lora(model, LoraSettings(**LORA, target_modules=r".*layers\.0\..*_proj"))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(4, 4)
        self.gate = torch.nn.Linear(4, 2)  # a router that is a linear layer (transformers 4)
        self.up = torch.nn.Linear(4, 4)
        self.mix = torch.nn.Module()
        self.mix.up = torch.nn.LayerNorm(4)  # not linear, named like one that is


def test_all_linear_is_every_linear_layer_but_the_lm_head_named_exactly():
    """As peft's all-linear among linear layers: a router that is an nn.Linear (transformers 4's MoE
    families) is adapted, the LM head and excluded modules are not, a non-linear module named like a
    linear one is not."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_Block(), _Block()])
    model.lm_head = torch.nn.Linear(4, 8)
    model.score = torch.nn.Linear(4, 1)
    assert all_linear_targets(model, exclude=("score",)) == [
        "gate",
        "layers.0.up",
        "layers.1.up",
        "q_proj",
    ]
    add_lora(model, LoraSettings(**LORA), exclude=("score",))
    assert sorted(lora_layers(model)) == [f"layers.{i}.{n}" for i in (0, 1) for n in ("gate", "q_proj", "up")]
    with pytest.raises(ValueError, match="no linear layer to adapt besides its LM head;"):
        all_linear_targets(torch.nn.ModuleDict({"lm_head": torch.nn.Linear(2, 2)}))
