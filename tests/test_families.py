"""The model support table (models/families.py): families outside it are refused, with the reason and
the supported list, before any weights load (Policy, worker, engine model and the CLI); Gemma2 and
gpt-oss train with their eager attention, packed equal to padded; the README's table is the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import random_batch
from helpers import policy_cfg
from posttrain.algorithms.losses import ClippedPGLoss
from posttrain.cli import main
from posttrain.models.families import (
    SUPPORTED,
    attn_implementation,
    check_generation_support,
    family_support,
    support_table_markdown,
)
from posttrain.parallel.dims import ParallelDims
from posttrain.parallel.tensor_parallel import check_parallel_support
from posttrain.policy.policy import Policy
from posttrain.policy.worker import PolicyWorker
from test_bad_inputs import SMALL, SYNC

SHAPE = dict(
    vocab_size=79, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
UNSUPPORTED = {
    "bloom": ({"n_layer": 2, "n_head": 4}, "ALiBi"),
    "deepseek_v3": ({"kv_lora_rank": 16, "q_lora_rank": 32, "n_routed_experts": 4}, "latent attention"),
    "mamba": ({"state_size": 8}, "state-space"),
    "lfm2": ({"layer_types": ["conv", "full_attention"]}, "short-convolution"),
    "qwen3_next": ({"layer_types": ["linear_attention", "full_attention"]}, "linear-attention"),
}
TRAINED = {
    "gemma2": {"head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 16},
    "gpt_oss": {
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}  # fmt: skip


def _config_only(path: Path, model_type: str, extra: dict) -> str:
    """A model directory with config.json and no weights: a refusal must come before any load."""
    AutoConfig.for_model(model_type, **SHAPE, **extra).save_pretrained(path)
    return str(path)


def _model_dir(path: Path, model_type: str) -> str:
    config = AutoConfig.for_model(model_type, **SHAPE, **TRAINED[model_type])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation(config)).save_pretrained(
        path
    )
    return str(path)


@pytest.mark.parametrize("model_type", list(UNSUPPORTED))
def test_unsupported_family_is_refused_before_loading_weights(model_type, tmp_path):
    extra, why = UNSUPPORTED[model_type]
    model = {"name": _config_only(tmp_path / model_type, model_type, extra), "tokenizer": "tiny"}
    expected = rf"model type '{model_type}' is not supported for training: .*{why}.*Supported model types"
    with pytest.raises(ValueError, match=expected):
        Policy(policy_cfg(model=model))
    with pytest.raises(ValueError, match=expected):
        PolicyWorker(policy_cfg(model=model))
    with pytest.raises(ValueError, match=rf"'{model_type}' is not supported for generation"):
        check_generation_support(AutoConfig.from_pretrained(model["name"]))


@pytest.mark.parametrize("model_type", ["bloom", "qwen3_next"])
def test_cli_grpo_refuses_an_unsupported_family_in_one_message(model_type, tmp_path, capsys):
    path = _config_only(tmp_path / model_type, model_type, UNSUPPORTED[model_type][0])
    argv = [
        "grpo",
        f"output_dir={tmp_path / 'run'}",
        f"policy.model.name={path}",
        "policy.model.tokenizer=tiny",
    ]
    code = main([*argv, *SMALL, *SYNC])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    messages = [line for line in err.splitlines() if re.match(r"error: ", line)]
    assert len(messages) == 1 and f"model type '{model_type}' is not supported for training" in messages[0]
    assert "llama" in err and "qwen2" in err  # the supported list


def test_an_unknown_model_type_is_refused_as_unverified_or_by_its_architecture():
    with pytest.raises(
        ValueError, match="'qwen2_moe' is not supported for training: it has not been verified"
    ):
        family_support(AutoConfig.for_model("qwen2_moe", **SHAPE))
    with pytest.raises(ValueError, match="encoder-decoder"):
        family_support(AutoConfig.for_model("t5"))
    with pytest.raises(ValueError, match="recurrent or linear attention"):
        family_support(AutoConfig.for_model("jamba", **SHAPE))


def test_layouts_outside_the_table_are_refused():
    gpt_oss = AutoConfig.for_model("gpt_oss", **SHAPE, **TRAINED["gpt_oss"])
    with pytest.raises(
        ValueError, match="context parallelism is not supported for model type 'gpt_oss'.*sinks"
    ):
        check_parallel_support(gpt_oss, ParallelDims(world=2, cp=2))
    with pytest.raises(ValueError, match="tensor parallelism is not supported for model type 'gpt_oss'"):
        check_parallel_support(gpt_oss, ParallelDims(world=2, tp=2))
    gemma2 = AutoConfig.for_model("gemma2", **SHAPE, **TRAINED["gemma2"])
    with pytest.raises(ValueError, match="soft-capping"):
        check_parallel_support(gemma2, ParallelDims(world=2, cp=2))


@pytest.mark.parametrize("model_type", list(TRAINED))
def test_eager_families_train_and_packed_equals_padded(model_type, tmp_path):
    model = {"name": _model_dir(tmp_path / model_type, model_type), "tokenizer": "tiny"}
    batch = random_batch(8, 16, rl=True)
    worker = PolicyWorker(policy_cfg(model=model))
    assert worker.model.config._attn_implementation == "eager"  # transformers has no SDPA path for them
    padded = worker.get_logprobs(batch)
    packed = PolicyWorker(policy_cfg(model=model, microbatch={"mode": "packed", "max_tokens": 40}))
    torch.testing.assert_close(packed.get_logprobs(batch), padded, rtol=1e-5, atol=1e-5)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    metrics = worker.train(batch, ClippedPGLoss())
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    moved = [n for n, p in worker.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before), sorted(set(before) - set(moved))


def test_sdpa_where_transformers_has_it():
    assert attn_implementation(AutoConfig.for_model("llama", **SHAPE)) == "sdpa"
    assert attn_implementation(AutoConfig.for_model("gemma3_text", **SHAPE)) == "sdpa"


def test_readme_table_is_the_code_table():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert support_table_markdown() in readme, "regenerate: python -m posttrain.models.families"
    assert set(SUPPORTED) >= {"llama", "qwen2", "gemma2", "gpt_oss"}
