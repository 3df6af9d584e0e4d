"""Loss functions: clipped policy gradient (GRPO/PPO family), NLL (SFT), DPO, Bradley-Terry (reward
models) and the clipped value loss (PPO's critic).

Contract (DESIGN.md, "normalization contract"): a loss is called per micro-batch with the per-token
logprobs of the current policy, the micro-batch, and the global valid sequence and token counts of
the whole optimizer step. It returns the micro-batch's masked *sum* divided by the global count for
its `loss_type`, so summing over micro-batches and ranks gives the global mean. Each metric is
normalized the same way by the kind it declares in `metric_kinds`:

- ``toks``: sum / global_valid_toks        - ``seqs``: sum / global_valid_seqs
- ``loss_type``: by the loss's own type   - ``none``: raw sum (counts)
- ``min`` / ``max``: min / max over valid tokens (+inf / -inf when there are none)

A loss reads logprobs of a causal LM, or, when it declares `head = "score"`, the per-token values of a
scalar-head model in their place (models/scalar_head.py; the trainer refuses a mismatch).

Departures from the textbook: the sequence-level loss averages each sequence over its own tokens
first; importance-sampling weights (generation vs trainer logprobs) multiply the KL term too.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from tensordict import TensorDict

from posttrain.config import Config
from posttrain.data.normalization import LossFn, LossType, MetricKind
from posttrain.models.scalar_head import action_values, last_token_values

__all__ = [
    "BradleyTerryConfig",
    "BradleyTerryLoss",
    "ClippedPGConfig",
    "ClippedPGLoss",
    "DPOConfig",
    "DPOLoss",
    "LossFn",
    "LossType",
    "NLLLoss",
    "ValueLoss",
    "kl_penalty",
    "with_completion_length",
]


def token_weights(batch: TensorDict) -> torch.Tensor:
    """[B, T] mask of trained tokens: token_mask · sample_mask with position 0 excluded."""
    mask = batch["token_mask"].float() * batch["sample_mask"].float()[:, None]
    mask = mask.clone()
    mask[:, 0] = 0
    return mask


class _Reducer:
    """Normalizes per-token values of one micro-batch according to the contract above."""

    def __init__(
        self,
        batch: TensorDict,
        loss_type: LossType,
        global_seqs: torch.Tensor,
        global_toks: torch.Tensor,
        constant: int | None = None,
    ):
        self.mask = token_weights(batch)
        self.sample_mask = batch["sample_mask"].float()
        self.loss_type = loss_type
        self.seqs = global_seqs
        self.toks = global_toks
        self.constant = constant  # Dr.GRPO: a sequence's value is its token sum / constant

    def toks_mean(self, values: torch.Tensor) -> torch.Tensor:
        return (values * self.mask).sum() / self.toks

    def seqs_mean(self, per_token: torch.Tensor) -> torch.Tensor:
        """Each sequence's token mean (its token sum / `constant` under Dr.GRPO), summed over the
        micro-batch's valid sequences / global valid sequences."""
        own = self.mask.sum(-1).clamp(min=1) if self.constant is None else self.constant
        per_seq = (per_token * self.mask).sum(-1) / own
        return (per_seq * self.sample_mask).sum() / self.seqs

    def by_loss_type(self, values: torch.Tensor) -> torch.Tensor:
        return self.toks_mean(values) if self.loss_type == LossType.TOKEN_LEVEL else self.seqs_mean(values)

    def min(self, values: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask > 0, values, torch.full_like(values, float("inf"))).min().detach()

    def max(self, values: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask > 0, values, torch.full_like(values, float("-inf"))).max().detach()

    def counts(self) -> dict[str, torch.Tensor]:
        return {"num_valid_samples": self.sample_mask.sum(), "num_valid_tokens": self.mask.sum()}


def kl_penalty(
    logprobs: torch.Tensor,
    reference: torch.Tensor,
    kind: Literal["k1", "k2", "k3"],
    input_clamp: float | None = None,
    output_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs (Schulman's k1/k2/k3)."""
    log_ratio = reference - logprobs  # log(pi_ref / pi)
    if input_clamp is not None:
        log_ratio = log_ratio.clamp(-input_clamp, input_clamp)
    if kind == "k1":
        kl = -log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = log_ratio.exp() - log_ratio - 1
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


class ClippedPGConfig(Config):
    """Options of the clipped policy-gradient loss (names follow NeMo-RL)."""

    ratio_clip_min: float = Field(0.2, ge=0, description="lower clip: ratio >= 1 - ratio_clip_min")
    ratio_clip_max: float = Field(0.2, ge=0, description="upper clip: ratio <= 1 + ratio_clip_max")
    ratio_clip_c: float | None = Field(
        None, gt=1, description="dual-clip constant c (> 1) for negative advantages"
    )
    reference_policy_kl_penalty: float = Field(
        0.0, ge=0, description="beta of the reference KL term (0 = off)"
    )
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = Field(
        "k3", description="estimator of KL(pi || pi_ref) from the sampled tokens (Schulman's k1/k2/k3)"
    )
    kl_input_clamp_value: float | None = Field(
        20.0, gt=0, description="clamp of log(pi_ref/pi) before the KL"
    )
    kl_output_clamp_value: float | None = Field(10.0, gt=0, description="clamp of the per-token KL value")
    token_level_loss: bool = Field(True, description="token-level mean (True) or per-sequence mean (False)")
    loss_type: Literal["token_level", "sequence_level", "dr_grpo"] | None = Field(
        None,
        description="normalization of the masked token sum, overriding token_level_loss: token_level "
        "(/ global valid tokens; TRL 'dapo'), sequence_level (each sequence's token mean / global valid "
        "sequences; TRL 'grpo'), dr_grpo (/ (global valid sequences x max_completion_length); TRL "
        "'dr_grpo', Dr.GRPO's constant normalization)",
    )
    max_completion_length: int | None = Field(
        None,
        ge=1,
        description="dr_grpo's constant (TRL's max_completion_length); None: the run's "
        "sampling.max_new_tokens",
    )
    use_importance_sampling_correction: bool = Field(
        False, description="weight tokens by pi_prev/pi_gen to correct for generation/trainer mismatch"
    )
    truncated_importance_sampling_type: Literal["tis", "icepop"] | None = Field(
        None,
        description="tis: cap weights at the max; icepop: zero tokens whose weight is outside [min, max]",
    )
    importance_sampling_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="what one IS weight covers: token (pi_prev/pi_gen of each token), sequence (the "
        "product over the sequence's trained tokens: the likelihood ratio of the whole sample), geometric "
        "(its per-token geometric mean); a sequence's weight is truncated (tis) or masked (icepop) whole",
    )
    truncated_importance_sampling_ratio: float = Field(2.0, gt=0, description="upper bound of the IS weight")
    truncated_importance_sampling_ratio_min: float = Field(0.5, ge=0, description="icepop lower bound")
    disable_ppo_ratio: bool = Field(
        False, description="plain policy gradient: -A * logprob, no ratio or clip"
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="token: one ratio per token (PPO/GRPO); sequence: GSPO, one ratio per sequence, "
        "exp of the mean token log-ratio, clipped per sequence (pair it with token_level_loss=false and "
        "clip ranges of ~3e-4/4e-4 as the GSPO paper does)",
    )

    force_on_policy_ratio: bool = Field(
        False,
        description="the step is one optimizer step at the weights that made the batch's prev logprobs, "
        "so prev := lp.detach() (ratio exp(lp - lp.detach()): 1 in value, on-policy grad; IS weight "
        "exp(lp.detach() - gen) and the mismatch metrics alike) and the batch needs no prev_logprobs",
    )

    @model_validator(mode="after")
    def _check(self) -> ClippedPGConfig:
        if (
            self.use_importance_sampling_correction
            and self.importance_sampling_level == "sequence"
            and self.truncated_importance_sampling_type is None
        ):
            raise ValueError(
                "importance_sampling_level=sequence multiplies the token ratios of a whole completion, "
                "which overflows fp32 (a product above e^88 is inf and makes the step's loss NaN) unless it "
                "is bounded: set truncated_importance_sampling_type=tis (cap) or icepop (mask), or use "
                "importance_sampling_level=geometric"
            )
        return self


def _per_sequence(values: torch.Tensor, mask: torch.Tensor, mean: bool) -> torch.Tensor:
    """[B]: each row's sum of `values` over its trained tokens (mask > 0), or their mean."""
    total = torch.where(mask > 0, values, torch.zeros_like(values)).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if mean else total


def _sequence_ratio(logprobs: torch.Tensor, prev: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ratio as a [B, T] tensor: every token of sequence i holds s_i = exp(mean_t (lp - prev)) in
    value, with gradient s_i * d lp_t (GSPO-token: sg[s_i] * exp(lp_t - sg[lp_t])). A loss that averages
    each sequence over its own tokens then has exactly GSPO's value and gradient, s_i * mean_t d lp_t,
    and every token of a sequence is clipped alike."""
    seq = _per_sequence(logprobs.detach() - prev, mask, mean=True)
    return (seq[:, None] + logprobs - logprobs.detach()).exp()


def with_completion_length(cfg: ClippedPGConfig, max_new_tokens: int) -> ClippedPGConfig:
    """`cfg` with dr_grpo's constant defaulted to the run's `max_new_tokens` (TRL's max_completion_length)."""
    if cfg.loss_type == "dr_grpo" and cfg.max_completion_length is None:
        return cfg.model_copy(update={"max_completion_length": max_new_tokens})
    return cfg


class ClippedPGLoss:
    """Clipped surrogate policy-gradient loss with optional dual clip, reference KL and IS correction."""

    _keys = ("advantages", "prev_logprobs", "generation_logprobs", "reference_logprobs")
    metric_kinds: dict[str, MetricKind] = {
        "loss": "loss_type",
        "pg_loss": "loss_type",
        "kl_penalty": "loss_type",
        "probs_ratio": "toks",
        "probs_ratio_min": "min",
        "probs_ratio_max": "max",
        "clip_fraction": "toks",
        "token_mult_prob_error": "toks",
        "gen_kl_error": "toks",
        "importance_weight": "toks",
        "is_oob_fraction": "toks",
        "num_valid_samples": "none",
        "num_valid_tokens": "none",
    }

    def __init__(self, cfg: ClippedPGConfig | None = None, **kwargs) -> None:
        self.cfg = cfg or ClippedPGConfig(**kwargs)
        mode = self.cfg.loss_type or ("token_level" if self.cfg.token_level_loss else "sequence_level")
        # Dr.GRPO is sequence-level with a constant per-sequence divisor: sum / (seqs x L) =
        # sum over sequences of (token sum / L) / seqs, so the global contract holds as it is
        self.loss_type = LossType.TOKEN_LEVEL if mode == "token_level" else LossType.SEQUENCE_LEVEL
        self.constant = self.cfg.max_completion_length if mode == "dr_grpo" else None
        if mode == "dr_grpo" and self.constant is None:
            raise ValueError(
                "loss_type=dr_grpo divides by max_completion_length: set loss.max_completion_length (the "
                "GRPO loops set it to sampling.max_new_tokens)"
            )

    @property
    def required_keys(self) -> tuple[str, ...]:
        """Batch keys read; prev_logprobs only when they are not the training logprobs themselves."""
        if self.cfg.force_on_policy_ratio:
            return tuple(k for k in self._keys if k != "prev_logprobs")
        return self._keys

    def inert_rows(self, batch) -> torch.Tensor | None:
        """[B] bool: rows whose loss and gradient are exactly 0, whatever the logprobs: every advantage
        of the row's trained tokens is 0 (the clipped, dual-clipped, plain and importance-weighted terms
        are all advantage x something) and no reference KL term is on. The trainer counts them in the
        step's normalizer without running them (policy.microbatch.skip_inert_rows). None: none can be."""
        if self.cfg.reference_policy_kl_penalty > 0:
            return None
        return ~((batch["advantages"] != 0) & (token_weights(batch) > 0)).any(-1)

    def _importance_weights(self, prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor):
        cfg = self.cfg
        if not cfg.use_importance_sampling_correction:
            return torch.ones_like(prev), torch.zeros_like(prev)
        log_w = (prev - gen).detach()
        if cfg.importance_sampling_level != "token":  # one weight per sequence, on each of its tokens
            geometric = cfg.importance_sampling_level == "geometric"
            log_w = _per_sequence(log_w, mask, mean=geometric)[:, None].expand_as(prev)
        w = log_w.exp()
        hi, lo = cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min
        if cfg.truncated_importance_sampling_type == "tis":
            oob = (w > hi).float()
            w = w.clamp(max=hi)
        elif cfg.truncated_importance_sampling_type == "icepop":
            oob = ((w > hi) | (w < lo)).float()
            w = torch.where(oob > 0, torch.zeros_like(w), w)  # not w * (1 - oob): an overflowed w is inf
        else:
            oob = torch.zeros_like(w)
        return w, oob

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        cfg = self.cfg
        red = _Reducer(batch, self.loss_type, global_valid_seqs, global_valid_toks, self.constant)
        adv = batch["advantages"].float()
        gen = batch["generation_logprobs"].float()
        # force_on_policy_ratio: the trainer's logprobs before the update are these, so no extra forward
        prev = logprobs.detach().float() if cfg.force_on_policy_ratio else batch["prev_logprobs"].float()
        if cfg.ratio_level == "sequence":
            ratio = _sequence_ratio(logprobs, prev, red.mask)
        else:
            ratio = (logprobs - prev).exp()
        if cfg.disable_ppo_ratio:
            pg = -adv * logprobs
            clipped = torch.zeros_like(pg)
        else:
            ratio_c = ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
            loss1, loss2 = -adv * ratio, -adv * ratio_c
            pg = torch.maximum(loss1, loss2)
            clipped = (loss2 > loss1).float()
            if cfg.ratio_clip_c is not None:
                loss3 = -adv * cfg.ratio_clip_c
                pg = torch.where(adv < 0, torch.minimum(pg, loss3), pg)
        weights, oob = self._importance_weights(prev, gen, red.mask)
        per_token = pg * weights
        kl = torch.zeros_like(per_token)
        if cfg.reference_policy_kl_penalty > 0:
            kl = cfg.reference_policy_kl_penalty * kl_penalty(
                logprobs,
                batch["reference_logprobs"].float(),
                cfg.reference_policy_kl_type,
                cfg.kl_input_clamp_value,
                cfg.kl_output_clamp_value,
            )
            per_token = per_token + kl * weights
        loss = red.by_loss_type(per_token)
        with torch.no_grad():
            metrics = {
                "loss": loss.detach(),
                "pg_loss": red.by_loss_type(pg * weights),
                "kl_penalty": red.by_loss_type(kl * weights),
                "probs_ratio": red.toks_mean(ratio.detach()),
                "probs_ratio_min": red.min(ratio.detach()),
                "probs_ratio_max": red.max(ratio.detach()),
                "clip_fraction": red.toks_mean(clipped),
                "token_mult_prob_error": red.toks_mean((gen - prev).abs().exp()),
                "gen_kl_error": red.toks_mean(kl_penalty(prev, gen, "k3")),
                "importance_weight": red.toks_mean(weights),
                "is_oob_fraction": red.toks_mean(oob),
                **red.counts(),
            }
        return loss, metrics


class NLLLoss:
    """Negative log-likelihood of the masked tokens (SFT)."""

    required_keys: tuple[str, ...] = ()
    metric_kinds: dict[str, MetricKind] = {
        "loss": "loss_type",
        "num_valid_samples": "none",
        "num_valid_tokens": "none",
    }

    def __init__(self, token_level_loss: bool = True) -> None:
        self.loss_type = LossType.TOKEN_LEVEL if token_level_loss else LossType.SEQUENCE_LEVEL

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        red = _Reducer(batch, self.loss_type, global_valid_seqs, global_valid_toks)
        loss = red.by_loss_type(-logprobs)
        return loss, {"loss": loss.detach(), **red.counts()}


class DPOConfig(Config):
    """Direct preference optimization options."""

    beta: float = Field(0.1, gt=0, description="inverse temperature of the implicit reward (IPO: its tau)")
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="sigmoid: DPO, -log sigmoid(beta * margin); ipo: (margin' - 1/(2 beta))^2 with each "
        "sequence's log-ratio averaged over its tokens (as TRL, after the IPO authors)",
    )
    sft_weight: float = Field(
        0.0, ge=0, description="weight of an NLL term on the chosen responses (RPO's alpha; 0 = off)"
    )


class DPOLoss:
    """DPO over rows laid out as (chosen, rejected) pairs: rows 2i and 2i+1 of every micro-batch.

    Sequence-level: the pair loss is summed and divided by the global number of pairs
    (global_valid_seqs / 2); the trainer keeps pairs whole in every micro-batching mode (`row_group`).
    """

    required_keys = ("reference_logprobs",)
    loss_type = LossType.SEQUENCE_LEVEL
    row_group = 2  # rows 2i and 2i+1 stay in one micro-batch, in order, whatever the micro-batching
    metric_kinds: dict[str, MetricKind] = {
        "loss": "loss_type",
        "preference_loss": "seqs",
        "sft_loss": "seqs",
        "accuracy": "seqs",
        "policy_accuracy": "seqs",
        "reward_margin": "seqs",
        "num_valid_samples": "none",
    }

    def __init__(self, cfg: DPOConfig | None = None, **kwargs) -> None:
        self.cfg = cfg or DPOConfig(**kwargs)

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        b = logprobs.shape[0]
        if b % 2:
            raise ValueError(f"DPO needs (chosen, rejected) row pairs; got a micro-batch of {b} rows (odd)")
        mask = token_weights(batch)
        ref = batch["reference_logprobs"].float()
        seq_logratio = ((logprobs - ref) * mask).sum(-1)
        seq_lp = (logprobs.detach() * mask).sum(-1)
        chosen, rejected = seq_logratio[0::2], seq_logratio[1::2]
        pair_mask = batch["sample_mask"].float()[0::2]
        margin = self.cfg.beta * (chosen - rejected)
        if self.cfg.loss_type == "ipo":
            lengths = mask.sum(-1).clamp(min=1)
            delta = chosen / lengths[0::2] - rejected / lengths[1::2]
            pref = (delta - 1 / (2 * self.cfg.beta)) ** 2
        else:
            pref = -torch.nn.functional.logsigmoid(margin)
        # a pair counts as 2 sequences in global_valid_seqs, hence the factor 2
        scale = 2 * pair_mask / global_valid_seqs
        pref_loss = (pref * scale).sum()
        nll = -(logprobs * mask).sum(-1)[0::2] / mask[0::2].sum(-1).clamp(min=1)
        sft_loss = (nll * scale).sum()
        loss = pref_loss + self.cfg.sft_weight * sft_loss
        with torch.no_grad():
            metrics = {
                "loss": loss.detach(),
                "preference_loss": pref_loss.detach(),
                "sft_loss": sft_loss.detach(),
                "accuracy": ((margin > 0).float() * scale).sum(),
                # the policy alone prefers the chosen completion (its summed logprob is higher)
                "policy_accuracy": ((seq_lp[0::2] > seq_lp[1::2]).float() * scale).sum(),
                "reward_margin": (margin * scale).sum(),
                "num_valid_samples": batch["sample_mask"].float().sum(),
            }
        return loss, metrics


class BradleyTerryConfig(Config):
    """Reward-model loss options."""

    center_rewards_coefficient: float = Field(
        0.0,
        ge=0,
        description="weight of mean((r_chosen + r_rejected)^2), which keeps rewards near 0 (as TRL's "
        "RewardTrainer; 0 = off): rewards summed with a rule reward then keep their scale",
    )


class BradleyTerryLoss:
    """-log sigmoid(r_chosen - r_rejected) over rows laid out as (chosen, rejected) pairs (rows 2i and
    2i+1 of every micro-batch), where a row's reward is the scalar head's value at its last real token.

    Reads a score head's per-token values (`head = "score"`). Sequence-level: each pair's loss is divided
    by the global number of pairs (global_valid_seqs / 2); pairs stay whole as for DPO (`row_group`).
    """

    head = "score"
    required_keys: tuple[str, ...] = ()
    loss_type = LossType.SEQUENCE_LEVEL
    row_group = 2  # rows 2i and 2i+1 stay in one micro-batch, in order, whatever the micro-batching
    metric_kinds: dict[str, MetricKind] = {
        "loss": "loss_type",
        "accuracy": "seqs",
        "reward_margin": "seqs",
        "reward_chosen": "seqs",
        "reward_rejected": "seqs",
        "num_valid_samples": "none",
    }

    def __init__(self, cfg: BradleyTerryConfig | None = None, **kwargs) -> None:
        self.cfg = cfg or BradleyTerryConfig(**kwargs)

    def __call__(self, values, batch, global_valid_seqs, global_valid_toks):
        b = values.shape[0]
        if b % 2:
            raise ValueError(
                f"a reward model trains on (chosen, rejected) row pairs; got a micro-batch of {b} rows"
            )
        rewards = last_token_values(values.float(), batch["input_lengths"])
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = chosen - rejected
        # a pair counts as 2 sequences in global_valid_seqs, hence the factor 2
        scale = 2 * batch["sample_mask"].float()[0::2] / global_valid_seqs
        per_pair = -torch.nn.functional.logsigmoid(margin)
        if self.cfg.center_rewards_coefficient > 0:
            per_pair = per_pair + self.cfg.center_rewards_coefficient * (chosen + rejected) ** 2
        loss = (per_pair * scale).sum()
        with torch.no_grad():
            metrics = {
                "loss": loss.detach(),
                "accuracy": ((margin > 0).float() * scale).sum(),
                "reward_margin": (margin * scale).sum(),
                "reward_chosen": (chosen * scale).sum(),
                "reward_rejected": (rejected * scale).sum(),
                "num_valid_samples": batch["sample_mask"].float().sum(),
            }
        return loss, metrics


class ValueLoss:
    """PPO's clipped value loss for a critic (a scalar-head model, `head = "score"`):

        0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)   per trained token,

    V: the critic's value of the state each token was sampled from (`action_values`), V_old: the values
    the returns were computed with (batch `old_values`), R: the GAE returns (batch `returns`);
    `clip=None` drops the clipped term. Token-level: the masked sum / the global valid tokens.
    """

    head = "score"
    required_keys = ("returns", "old_values")
    loss_type = LossType.TOKEN_LEVEL
    metric_kinds: dict[str, MetricKind] = {
        "loss": "loss_type",
        "value_clip_fraction": "toks",
        "value_mean": "toks",
        "value_abs_error": "toks",
        "num_valid_samples": "none",
        "num_valid_tokens": "none",
    }

    def __init__(self, clip: float | None = 0.2) -> None:
        if clip is not None and clip <= 0:
            raise ValueError(f"value clip {clip} must be > 0 (or None: no clipping)")
        self.clip = clip

    def __call__(self, values, batch, global_valid_seqs, global_valid_toks):
        red = _Reducer(batch, self.loss_type, global_valid_seqs, global_valid_toks)
        v = action_values(values.float())
        returns, old = batch["returns"].float(), batch["old_values"].float()
        per_token = (v - returns).square()
        clipped = torch.zeros_like(per_token)
        if self.clip is not None:
            v_clipped = old + (v - old).clamp(-self.clip, self.clip)
            other = (v_clipped - returns).square()
            clipped = (other > per_token).float()
            per_token = torch.maximum(per_token, other)
        loss = 0.5 * red.toks_mean(per_token)
        with torch.no_grad():
            metrics = {
                "loss": loss.detach(),
                "value_clip_fraction": red.toks_mean(clipped),
                "value_mean": red.toks_mean(v.detach()),
                "value_abs_error": red.toks_mean((v.detach() - returns).abs()),
                **red.counts(),
            }
        return loss, metrics
