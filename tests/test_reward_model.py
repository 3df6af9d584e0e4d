"""Scalar-head models (`policy.model.head=score`): `score()` is HF's sequence-classification forward of the
same weights, padded or packed; a causal LM starts a reward model with its backbone and a new, seeded
head; the Bradley-Terry loss and its normalization; and bad models or settings get one clear error."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from conftest import random_batch
from helpers import policy_cfg
from posttrain.algorithms.losses import BradleyTerryLoss, NLLLoss
from posttrain.data.batch import make_batch
from posttrain.policy.model_init import build_tokenizer, load_full_model
from posttrain.policy.policy import Policy
from posttrain.policy.worker import PolicyWorker

SCORE = {"head": "score"}
SGD = {"name": "torch.optim.SGD", "lr": 1.0}


def scorer(**over) -> PolicyWorker:
    return PolicyWorker(policy_cfg(model=SCORE, init_reference_model=False, **over))


def hf_scores(path, batch) -> torch.Tensor:
    """HF's own forward of a saved directory: the logit at the last non-pad token of each row."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    mask = (torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None]).long()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=mask).logits[:, 0]


def test_score_equals_a_direct_hf_forward_padded_and_packed(tmp_path):
    worker = scorer(optimizer=SGD)
    batch = random_batch(8, 16)  # real ids are >= 4, padding is the pad id 0
    worker.save_hf(str(tmp_path / "rm"))
    ref = hf_scores(tmp_path / "rm", batch)
    torch.testing.assert_close(worker.score(batch), ref, rtol=1e-5, atol=1e-5)
    packed = scorer(microbatch={"mode": "packed", "max_tokens": 40})
    torch.testing.assert_close(packed.score(batch), ref, rtol=1e-5, atol=1e-5)
    values = worker.get_values(batch)  # the per-token values a critic reads; score is the last real one
    assert values.shape == (8, 16) and torch.all(values[batch["input_ids"] == 0] == 0)
    torch.testing.assert_close(values[torch.arange(8), batch["input_lengths"] - 1], worker.score(batch))
    policy = Policy(policy_cfg(model=SCORE, init_reference_model=False))  # the driver side: same weights
    torch.testing.assert_close(policy.score(batch), ref, rtol=1e-5, atol=1e-5)


def test_a_trained_step_is_saved_as_hf_loads_it(tmp_path):
    worker = scorer(optimizer=SGD, train_global_batch_size=8, microbatch={"train_micro_batch_size": 2})
    batch = random_batch(8, 16)
    metrics = worker.train(batch, BradleyTerryLoss())
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    worker.save_hf(str(tmp_path / "rm"))
    torch.testing.assert_close(worker.score(batch), hf_scores(tmp_path / "rm", batch), rtol=1e-5, atol=1e-5)


def test_a_causal_lm_starts_a_reward_model_with_a_new_seeded_head(tmp_path):
    lm_worker = PolicyWorker(policy_cfg(init_reference_model=False))
    lm_worker.save_hf(str(tmp_path / "lm"))
    cfg = policy_cfg(model={"name": str(tmp_path / "lm"), **SCORE}).model
    tok = build_tokenizer(cfg)
    a, b = load_full_model(cfg, tok), load_full_model(cfg, tok)
    lm = lm_worker.full_state_dict()
    backbone = {k: v for k, v in a.state_dict().items() if k != "score.weight"}
    assert backbone.keys() == {k for k in lm if k != "lm_head.weight"}
    for k, v in backbone.items():
        assert torch.equal(v, lm[k]), k
    assert torch.equal(a.score.weight, b.score.weight) and a.score.weight.shape == (1, 64)


def test_bradley_terry_loss_and_its_global_normalization():
    values = torch.zeros(4, 5)
    lengths = torch.tensor([5, 3, 4, 2])
    values[0, 4], values[1, 2], values[2, 3], values[3, 1] = 2.0, 0.5, -1.0, 1.0  # margins 1.5, -2
    values[1, 4] = 100.0  # past row 1's end: never read
    batch = make_batch(
        input_ids=torch.ones(4, 5, dtype=torch.long),
        input_lengths=lengths,
        token_mask=torch.ones(4, 5),
        sample_mask=torch.ones(4),
    )
    loss, m = BradleyTerryLoss()(values, batch, torch.tensor(8.0), torch.tensor(1.0))  # 4 pairs globally
    want = (-torch.nn.functional.logsigmoid(torch.tensor([1.5, -2.0]))).sum() / 4
    torch.testing.assert_close(loss, want)
    assert float(m["accuracy"]) == pytest.approx(1 / 4) and float(m["reward_margin"]) == pytest.approx(
        -0.5 / 4
    )


def test_microbatch_size_does_not_change_a_reward_model_step():
    """Pairs stay whole in even micro-batches; 2 x 4 and 8 x 1 give one step."""
    out = []
    for mbs in (2, 8):
        w = scorer(optimizer=SGD, train_global_batch_size=8, microbatch={"train_micro_batch_size": mbs})
        m = w.train(random_batch(8, 16), BradleyTerryLoss())
        out.append((m, w.full_state_dict()))
    (m1, p1), (m2, p2) = out
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6) and m1["grad_norm"] == pytest.approx(
        m2["grad_norm"]
    )
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-5, atol=1e-6)


def _saved_config(path, arch: str, model_type: str = "llama", **extra) -> str:
    config = AutoConfig.for_model(model_type, architectures=[arch], **extra)
    config.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "arch, model_type, extra, message",
    [
        (
            "LlamaForSequenceClassification",
            "llama",
            {"num_labels": 2},
            "num_labels=2; a reward model has one",
        ),
        ("BertForMaskedLM", "bert", {}, "BertForMaskedLM, neither a causal LM nor a sequence classifier"),
        ("T5ForConditionalGeneration", "t5", {}, "neither a causal LM nor a sequence classifier"),
    ],
)
def test_a_model_that_cannot_score_is_refused_before_loading(tmp_path, arch, model_type, extra, message):
    path = _saved_config(tmp_path / "m", arch, model_type, **extra)
    with pytest.raises(ValueError, match=message):
        Policy(policy_cfg(model={"name": path, "tokenizer": "tiny", **SCORE}))


def test_verbs_and_losses_of_the_other_head_are_refused():
    worker = scorer()
    batch = random_batch(8, 16)
    with pytest.raises(ValueError, match=r"get_logprobs\(\) needs a causal LM \(model.head=lm\)"):
        worker.get_logprobs(batch)
    with pytest.raises(ValueError, match="NLLLoss reads the outputs of a model with model.head=lm"):
        worker.train(batch, NLLLoss())
    lm = PolicyWorker(policy_cfg(init_reference_model=False))
    with pytest.raises(ValueError, match=r"score\(\) needs a scalar head"):
        lm.score(batch)
    with pytest.raises(
        ValueError, match="BradleyTerryLoss reads the outputs of a model with model.head=score"
    ):
        lm.train(batch, BradleyTerryLoss())


def test_lora_trains_the_adapters_and_the_score_head():
    worker = scorer(optimizer=SGD, lora={"rank": 4, "alpha": 8}, train_global_batch_size=8)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    worker.train(random_batch(8, 16), BradleyTerryLoss())
    moved = {n for n, p in worker.model.named_parameters() if not torch.equal(p, before[n])}
    assert "score.weight" in moved and all(".lora_" in n for n in moved - {"score.weight"})
    assert any(".lora_B." in n for n in moved)  # B starts at zero: only it moves in the first step


def test_a_layout_scalar_heads_lack_is_refused():
    with pytest.raises(ValueError, match="context parallelism is not implemented for scalar heads"):
        policy_cfg(
            model=SCORE, parallel={"context_parallel_size": 2}, cluster={"backend": "ray", "num_workers": 2}
        )


def test_save_hf_writes_a_sequence_classifier(tmp_path):
    worker = scorer()
    worker.save_hf(str(tmp_path / "rm"))
    config = AutoConfig.from_pretrained(tmp_path / "rm")
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1


def test_a_tokenizer_that_pads_with_its_eos_is_warned_about(caplog):
    """posttrain reads a reward at the completion's EOS; transformers' sequence classifier pools at the
    last token that is not the pad id: with pad == EOS that is the token before, so they disagree."""
    from posttrain.models.scalar_head import warn_if_pad_is_eos
    from posttrain.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    with caplog.at_level("WARNING"):
        assert not warn_if_pad_is_eos(tok, "reward model training")
        assert "pads with its EOS" not in caplog.text
        tok.pad_token = tok.eos_token
        assert warn_if_pad_is_eos(tok, "reward model training")
    assert "reward model training: the tokenizer pads with its EOS" in caplog.text
