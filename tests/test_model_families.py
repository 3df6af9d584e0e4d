"""Every family of the support table, end to end through the real loading paths (issue 25): a tiny
random-weight model saved as a local HF directory is loaded by the Policy (trainer) and by the engine's
loader; the engine's greedy tokens equal transformers `generate` token for token on prompts of
unequal lengths that run past the sliding window; the engine's logprobs of sampled tokens equal the
trainer's (1e-5, fp32); one training step runs and moves the weights."""

from __future__ import annotations

import pytest
import torch

from helpers import policy_cfg
from model_zoo import FAMILIES, save_family_model
from posttrain.algorithms.losses import ClippedPGLoss
from posttrain.data.batch import make_batch
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig, SamplingParams
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy.model_init import engine_model
from posttrain.policy.policy import Policy
from test_generation import hf_greedy, prompts_of

TOK = build_char_tokenizer()
NEW_TOKENS = 14


def padded(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    return ids, torch.tensor([len(s) for s in sequences])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_generates_exactly_and_trains(family, tmp_path):
    path = save_family_model(family, TOK, tmp_path / family, seed=3)
    policy = Policy(policy_cfg(model={"name": str(path)}, train_global_batch_size=8))
    try:
        engine = GenerationEngine(
            engine_model(policy.cfg.model, None, TOK), TOK, GenerationConfig(max_num_seqs=3, max_model_len=64)
        )
        prompts = prompts_of([9, 3, 16, 5, 12, 7, 2, 14])

        greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS))
        reference = engine_model(policy.cfg.model, None, TOK).eval()
        expected = hf_greedy(reference, prompts, NEW_TOKENS, eos=TOK.eos_token_id)
        assert [r.token_ids for r in greedy] == expected

        sampled = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=0))
        ids, lengths = padded([r.sequence for r in sampled])
        trainer = policy.get_logprobs(make_batch(input_ids=ids, input_lengths=lengths))
        worst = max(
            float((torch.tensor(r.logprobs) - trainer[i, len(p) : len(p) + len(r.token_ids)]).abs().max())
            for i, (r, p) in enumerate(zip(sampled, prompts))
        )
        assert worst < 1e-5, worst

        before = {k: v.clone() for k, v in policy.full_state_dict().items()}
        batch = make_batch(input_ids=ids, input_lengths=lengths)
        mask = torch.zeros_like(ids, dtype=torch.float32)
        for i, p in enumerate(prompts):
            mask[i, len(p) : lengths[i]] = 1
        batch["token_mask"], batch["sample_mask"] = mask, torch.ones(len(prompts))
        batch["advantages"] = torch.linspace(-1, 1, len(prompts))[:, None].expand_as(mask).contiguous()
        for key in ("prev_logprobs", "generation_logprobs", "reference_logprobs"):
            batch[key] = trainer
        metrics = policy.train(batch, ClippedPGLoss())
        assert torch.isfinite(torch.tensor(metrics["loss"]))
        after = policy.full_state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        policy.shutdown()
