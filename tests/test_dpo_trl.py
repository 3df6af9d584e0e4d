"""Our DPO loss against TRL's `DPOTrainer` on the same model, reference model and pairs (sigmoid and IPO):
TRL collates and computes its loss with its own forward; ours runs the Policy's logprob path on the same
rows, laid out as (chosen, rejected) pairs, through `DPOLoss`.

Ours equals the paper's formula on a plain transformers forward (log_softmax of the logits) to 1e-6. TRL
1.16 scores tokens with its fused LM head (`add_fused_lm_head`: the head projected in tiles at labelled
positions only), whose per-token logprobs differ from that plain forward by up to ~1e-3 on this tiny
model (measured on the reference model's rows), so its loss agrees with ours to ~1e-4 relative: the test
holds TRL to 1e-3 relative and the textbook to 1e-6."""

from __future__ import annotations

import pytest
import torch

from helpers import policy_cfg
from posttrain.algorithms.losses import DPOLoss
from posttrain.data.batch import make_batch
from posttrain.models.hf import build_tiny_model
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy.policy import Policy

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

TOK = build_char_tokenizer()
ROWS = [{"prompt": f"{i}+{i % 3}=", "chosen": str(i + i % 3), "rejected": str(i * 7 + 11)} for i in range(6)]


def trl_loss_and_batch(tmp_path, policy_dir, ref_dir, loss_type: str, beta: float):
    from transformers import AutoModelForCausalLM

    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=6, beta=beta, loss_type=[loss_type],
        report_to=[], use_cpu=True, max_steps=1, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(ref_dir),
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=TOK,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    return float(loss), batch


def as_pairs(batch) -> dict:
    """TRL's [chosen..., rejected...] rows as our interleaved (chosen, rejected) pairs."""
    n = batch["input_ids"].shape[0] // 2
    order = [i for k in range(n) for i in (k, n + k)]
    ids, attn, comp = (batch[k][order] for k in ("input_ids", "attention_mask", "completion_mask"))
    return dict(
        input_ids=ids, input_lengths=attn.sum(-1), token_mask=comp.float(), sample_mask=torch.ones(2 * n)
    )


@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.5), ("ipo", 0.3)])
def test_our_dpo_loss_equals_trl(tmp_path, loss_type, beta):
    for name, seed in (("policy", 0), ("reference", 1)):  # different weights: the margins are not 0
        model = build_tiny_model(len(TOK), seed=seed)
        model.save_pretrained(tmp_path / name)
        TOK.save_pretrained(tmp_path / name)
    expected, trl_batch = trl_loss_and_batch(
        tmp_path, tmp_path / "policy", tmp_path / "reference", loss_type, beta
    )
    data = as_pairs(trl_batch)
    logprobs = {}
    for name in ("policy", "reference"):
        policy = Policy(policy_cfg(model={"name": str(tmp_path / name)}, init_reference_model=False))
        logprobs[name] = policy.get_logprobs(make_batch(**data))
        policy.shutdown()
    batch = make_batch(**data, reference_logprobs=logprobs["reference"])
    pairs = data["sample_mask"].sum()
    ours, _ = DPOLoss(beta=beta, loss_type=loss_type)(
        logprobs["policy"], batch, pairs, data["token_mask"][:, 1:].sum()
    )
    assert abs(expected) > 1e-3 and float(ours) == pytest.approx(expected, rel=1e-3)
    assert float(ours) == pytest.approx(textbook(tmp_path, data, loss_type, beta), rel=1e-6, abs=1e-7)


def textbook(tmp_path, data: dict, loss_type: str, beta: float) -> float:
    """DPO / IPO written out on log_softmax of a plain transformers forward of both models."""
    from transformers import AutoModelForCausalLM

    ids, lengths, mask = data["input_ids"], data["input_lengths"], data["token_mask"][:, 1:]
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    seq = {}
    for name in ("policy", "reference"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn).logits.float()
        token_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        seq[name] = (token_lp * mask).sum(-1)
    ratio = seq["policy"] - seq["reference"]
    if loss_type == "ipo":
        avg = ratio / mask.sum(-1)
        return float(((avg[0::2] - avg[1::2] - 1 / (2 * beta)) ** 2).mean())
    return float(-torch.nn.functional.logsigmoid(beta * (ratio[0::2] - ratio[1::2])).mean())
