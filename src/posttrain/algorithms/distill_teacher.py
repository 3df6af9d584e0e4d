"""The teacher of on-policy distillation: a second `Policy` used for inference only, and its checks.

The teacher is a policy like the student (its own model, precision, micro-batching and parallel layout;
it may be bigger and tensor-parallel), built from its own `PolicyConfig`, never trained: the loop only
calls its inference verbs. `TeacherPolicy` adds one verb to them, `get_logits_at`: the teacher's logits
at given candidate token ids at every position (the student's top-k ids, for the top-k KL), computed on
the vocabulary shards under tensor parallelism (no rank holds [.., V] logits, as for logprobs).

Student and teacher must share one vocabulary: token ids are passed from one model to the other, never
re-tokenized. `check_same_vocabulary` refuses a teacher whose tokenizer maps tokens to other ids (or
whose logits cover another vocabulary size) before either model's weights load.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from posttrain.data.microbatch import MicroBatch
from posttrain.models.logprobs import model_logits
from posttrain.models.vocab_parallel import VocabShard
from posttrain.policy.config import PolicyConfig
from posttrain.policy.lifecycle import ON_DEVICE, verb
from posttrain.policy.model_init import build_tokenizer, model_config
from posttrain.policy.policy import Policy
from posttrain.policy.worker import PolicyWorker

CANDIDATES = "candidate_ids"  # [B, T, k] batch key: the token ids whose logits `get_logits_at` returns


def logits_at(model, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """[b, t, k] logits / temperature of the distribution over token i at the ids `mb.data[CANDIDATES]`
    [b, t, k] (position 0 and padding: 0), padded or packed rows, plain or vocab-sharded logits."""
    ids = mb.data[CANDIDATES]
    b, t, k = ids.shape
    logits, shard = VocabShard.of(model_logits(model, mb))
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if mb.packed is None:
        rows, targets = logits[:, :-1], ids[:, 1:]
    else:  # each sequence's positions 1..n-1 of the packed row, scored by the positions before them
        p = mb.packed
        rows = torch.cat([logits[0, off : off + n - 1] for off, n in zip(p.offsets, p.lengths)])[None]
        targets = torch.cat([ids[i, 1:n] for i, n in enumerate(p.lengths)])[None]
    local, owned = shard.localize(targets)
    picked = shard.owned_sum(torch.gather(rows, -1, local), owned)
    if mb.packed is None:
        out = torch.nn.functional.pad(picked, (0, 0, 1, 0))
    else:
        out, first = logits.new_zeros(b, t, k), 0
        for i, n in enumerate(mb.packed.lengths):
            out[i, 1:n] = picked[0, first : first + n - 1]
            first += n - 1
    valid = torch.arange(t, device=out.device)[None, :] < mb.data["input_lengths"][:, None]
    return out * valid[..., None]


class TeacherWorker(PolicyWorker):
    """One rank of the teacher: a policy worker with the `get_logits_at` verb."""

    @verb(*ON_DEVICE, collective=True)
    def get_logits_at(self, batch: TensorDict) -> torch.Tensor:
        """[B, T, k] logits at the ids `batch[CANDIDATES]` (see `logits_at`)."""
        if self.split.active:
            raise ValueError(
                "the top-k distillation KL does not run on a teacher with sequence or context parallelism "
                "yet: set distill.teacher.parallel.sequence_parallel=false and context_parallel_size=1, "
                "or distill.top_k=null"
            )
        temp = self.cfg.scoring_temperature
        parts = self._infer(batch, lambda mb: logits_at(self.model, mb, temp), share_prefix=False)
        return self._scatter(batch, parts)


class TeacherPolicy(Policy):
    """The teacher over its ranks: `Policy`'s inference verbs plus `get_logits_at`."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg, worker_cls=TeacherWorker)

    @verb(*ON_DEVICE, collective=True)
    def get_logits_at(self, batch: TensorDict, candidate_ids: torch.Tensor) -> torch.Tensor:
        """[B, T, k] teacher logits at `candidate_ids` [B, T, k] (position 0 and padding: 0)."""
        keys = ("input_ids", "input_lengths", "token_mask", "sample_mask")
        view = TensorDict({k: batch[k] for k in keys}, batch_size=batch.batch_size)
        view[CANDIDATES] = candidate_ids
        return self._gather("get_logits_at", view)

    def weights(self) -> dict[str, torch.Tensor]:
        """The teacher's full weights on the host (to check that it was never updated)."""
        return self.full_state_dict()


def teacher_config(cfg: PolicyConfig) -> PolicyConfig:
    """The teacher's config as it runs: no reference copy (it is never trained, so never drifts)."""
    return cfg.model_copy(update={"init_reference_model": False, "lora": None})


def check_same_vocabulary(student: PolicyConfig, teacher: PolicyConfig, top_k: int | None) -> None:
    """Refuse a teacher whose vocabulary is not the student's (same token -> id map, and with top-k,
    the same logit width), naming both models; it runs on configs, before weights load."""
    s_tok, t_tok = build_tokenizer(student.model), build_tokenizer(teacher.model)
    s_vocab, t_vocab = s_tok.get_vocab(), t_tok.get_vocab()
    names = f"student {student.model.name!r} and teacher {teacher.model.name!r}"
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab) - set(t_vocab))[:5]
        only_t = sorted(set(t_vocab) - set(s_vocab))[:5]
        moved = sorted(k for k in set(s_vocab) & set(t_vocab) if s_vocab[k] != t_vocab[k])[:5]
        raise ValueError(
            f"distillation needs one vocabulary: the {names} tokenizers differ ({len(s_vocab)} vs "
            f"{len(t_vocab)} tokens; only in the student: {only_s}, only in the teacher: {only_t}, other "
            f"ids: {moved}). The teacher scores the student's token ids as they are, so pick a teacher of "
            "the student's model family (same tokenizer), or set distill.teacher.model.tokenizer to the "
            "student's tokenizer if the teacher was trained with it"
        )
    s_size = _vocab_size(student, s_tok)
    t_size = _vocab_size(teacher, t_tok)
    if top_k is not None and s_size != t_size:
        raise ValueError(
            f"distill.top_k compares the {names} logits over the same ids, but their vocabulary sizes "
            f"differ ({s_size} vs {t_size}; the tokenizers agree, so one embedding is padded). Use "
            "distill.top_k=null (the sampled-token KL needs only the shared tokens)"
        )


def _vocab_size(cfg: PolicyConfig, tokenizer: Any) -> int:
    return int(model_config(cfg.model, tokenizer).vocab_size)
