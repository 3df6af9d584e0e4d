"""Models with a sliding attention window: packed rows and shared-prefix plans pass explicit masks,
which must encode the window as transformers' own masks do (packed logprobs equal padded ones)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch
from helpers import policy_cfg
from posttrain.models.logprobs import supports_shared_prefix
from posttrain.policy.worker import PolicyWorker

PACKED = {"mode": "packed", "max_tokens": 40}


def _mixed_qwen2(path) -> str:
    """A tiny Qwen2 whose first layer attends fully and second through a window of 5 tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2", vocab_size=79, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
        max_window_layers=1, pad_token_id=0,
    )  # fmt: skip
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("which", ["mistral_window_5", "qwen2_full_then_window_5"])
def test_packed_logprobs_respect_the_window(which, tmp_path):
    if which == "mistral_window_5":
        model = {"tiny": {"family": "mistral", "sliding_window": 5}}
    else:
        model = {"name": _mixed_qwen2(tmp_path / "qwen2"), "tokenizer": "tiny"}
    batch = random_batch(8, 16, rl=True)
    padded = PolicyWorker(policy_cfg(model=model)).get_logprobs(batch)
    packed_worker = PolicyWorker(policy_cfg(model=model, microbatch=PACKED))
    torch.testing.assert_close(packed_worker.get_logprobs(batch), padded, rtol=1e-5, atol=1e-5)
    full = PolicyWorker(policy_cfg(model={"tiny": {"family": "mistral"}})).get_logprobs(batch)
    if which == "mistral_window_5":  # the window matters here: rows are longer than 5 tokens
        assert (full - padded).abs().max() > 1e-2
    assert not supports_shared_prefix(packed_worker.model)  # its masks do not encode a window
