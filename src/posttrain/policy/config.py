"""Configuration of the policy (trainer): model, precision, batching, optimizer, schedule, parallelism."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Literal

import torch
from pydantic import Field, PrivateAttr, field_validator, model_validator

from posttrain.config import Config
from posttrain.models.hf import TinyModelConfig
from posttrain.models.lora import LoraSettings
from posttrain.parallel.cluster import ClusterConfig
from posttrain.parallel.dims import ParallelDims


class ModelConfig(Config):
    """Which model and tokenizer to train."""

    name: str = Field("tiny", description="HF hub name or local directory; 'tiny' builds a random tiny model")
    tokenizer: str | None = Field(
        None,
        description="tokenizer name/dir; default: same as `name` (char tokenizer for tiny); tiny-chat: the "
        "char tokenizer with chat tokens and a chat template (multi-turn environments)",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="shape of the tiny model")
    seed: int = Field(0, description="init seed of the tiny model (and of a new score head)")
    head: Literal["lm", "score"] = Field(
        "lm",
        description="lm: a causal LM (logprobs); score: one scalar per token from a linear head on the "
        "decoder (AutoModelForSequenceClassification, num_labels=1): a reward model, or a critic. `name` "
        "is then a sequence-classification model, or a causal LM whose head is replaced by a new one",
    )
    disable_dropout: bool = Field(
        True,
        description="zero the trained model's dropout (as TRL's disable_dropout; LoRA's lora_dropout stays "
        "as configured): the reference, previous and engine logprobs are computed without dropout, so a "
        "training forward with it would make the ratios and DPO's first margins noise; the model's saved "
        "config keeps its values. false: each rank seeds its generators with the run's seed plus its (dp, cp) "
        "coordinate; refused with tensor_parallel_size > 1 when the model's config has dropout",
    )
    cpu_matmul: Literal["torch", "onednn"] = Field(
        "torch",
        description="GEMM of the linear layers for fp32 on the CPU (the trainer's, and the engine's "
        "smaller ones; the engine's decode projections and prefill linears of >= 65536 weights always use "
        "oneDNN): torch = F.linear (MKL, bit-stable); onednn = "
        "oneDNN's linear for the forward and both backward products, up to 2.2x the GFLOP/s of MKL on "
        "AMD CPUs with AVX-512 (equal to fp32 rounding, not bit for bit). GPUs, bf16 and tensor-"
        "parallel shards always use F.linear",
    )


class MicroBatchConfig(Config):
    """How a rank's share of a global batch is cut into micro-batches."""

    mode: Literal["fixed", "dynamic", "packed"] = Field(
        "fixed", description="fixed rows, token budget, or packing"
    )
    train_micro_batch_size: int = Field(4, ge=1, description="rows per training micro-batch (mode=fixed)")
    logprob_micro_batch_size: int = Field(8, ge=1, description="rows per logprob micro-batch (mode=fixed)")
    max_tokens: int = Field(2048, ge=1, description="token budget per micro-batch (modes dynamic and packed)")
    share_prefix: bool = Field(
        True,
        description="modes fixed and dynamic: rows that start with the same prompt (a GRPO group) run the "
        "prompt once per micro-batch, then each completion on its keys/values; same logprobs and "
        "gradients, fewer tokens. Used when it drops at least a quarter of a micro-batch's tokens",
    )
    skip_inert_rows: bool = Field(
        True,
        description="training: rows the loss declares inert (loss and gradient exactly 0: a policy-"
        "gradient row whose every advantage is 0, when no KL term is on) are counted in the step's "
        "normalizer but not run; same update, less compute. Token- and sequence-mean metrics then "
        "average over the rows run",
    )


def import_object(path: str) -> Any:
    """Import `package.module.Name`; a clear error names the path when it does not resolve."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"'{path}' is not an import path; write it as package.module.Name")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import '{path}': {e}") from e


class OptimizerConfig(Config):
    """Any torch optimizer by class path; AdamW by default."""

    name: str = Field("torch.optim.AdamW", description="import path of the optimizer class")
    lr: float = Field(1e-5, gt=0, description="learning rate (the scheduler stages' factors multiply it)")
    weight_decay: float = Field(0.0, ge=0, description="the optimizer's weight_decay argument")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra constructor arguments (betas, eps, ...)"
    )

    @field_validator("name")
    @classmethod
    def _importable(cls, name: str) -> str:
        """Checked at load (not when the optimizer is built, after the model): the class must import."""
        found = import_object(name)
        if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
            raise ValueError(f"'{name}' is not a torch.optim.Optimizer subclass; e.g. torch.optim.AdamW")
        return name


class SchedulerStage(Config):
    """One stage of the learning-rate schedule (stages run one after another, SequentialLR-style)."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    steps: int = Field(
        0,
        ge=0,
        description="length of the stage in optimizer steps (0 = rest of training, constant stages only)",
    )
    start_factor: float = Field(1.0, ge=0, description="linear: lr factor at the stage start")
    end_factor: float = Field(1.0, ge=0, description="linear: lr factor at the stage end")
    min_factor: float = Field(0.0, ge=0, description="cosine: lr factor at the stage end")

    @model_validator(mode="after")
    def _check(self) -> SchedulerStage:
        if self.kind != "constant" and self.steps == 0:
            raise ValueError(
                f"a '{self.kind}' scheduler stage needs steps > 0 (the optimizer steps it spans); only a "
                "'constant' stage may be open-ended (steps: 0 = the rest of training)"
            )
        return self


class ParallelConfig(Config):
    """Parallelism applied to the model."""

    fsdp: Literal["auto", "always", "never"] = Field(
        "auto", description="FSDP2 sharding; auto = when more than one rank (or fsdp_cpu_offload)"
    )
    fsdp_cpu_offload: bool = Field(
        False, description="FSDP2 CPUOffloadPolicy (params/grads/optimizer on host)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each block's activations in the backward (less memory, more compute)"
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks that split each weight (attention heads, MLP, vocabulary); must divide the "
        "attention heads, KV heads and intermediate size",
    )
    sequence_parallel: bool = Field(
        False,
        description="with tensor_parallel_size > 1: shard the activations between blocks (norms, "
        "residuals) on the sequence over the tensor-parallel ranks",
    )
    context_parallel_size: int = Field(
        1, ge=1, description="ranks that split each sequence (attention all-gathers keys/values)"
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="MoE models: ranks over which each layer's experts are sharded, tokens reaching "
        "theirs by all-to-all; must divide the data-parallel size (cp = 1) and the experts",
    )

    def dims(self, world: int) -> ParallelDims:
        """This layout over `world` ranks (ValueError when tp x cp does not divide it, or fsdp='never'
        meets several ranks)."""
        return ParallelDims(
            world,
            tp=self.tensor_parallel_size,
            cp=self.context_parallel_size,
            sequence_parallel=self.sequence_parallel,
            fsdp=self.fsdp,
            cpu_offload=self.fsdp_cpu_offload,
            ep=self.expert_parallel_size,
        )


class MoEConfig(Config):
    """Mixture-of-experts options (models/moe.py); a dense model ignores them."""

    routing_replay: Literal["off", "rollout"] = Field(
        "off",
        description="rollout: the trainer routes every token the engine routed to the engine's experts "
        "(recorded during generation), gate weights from its own router (which keeps its gradient), for "
        "logprobs and training; off: the trainer's router decides",
    )
    aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the load-balancing loss, per sequence (DeepSeek-V3's sequence-wise form): "
        "E x sum_i f_i P_i over each sequence's tokens (f_i: share of its expert slots routed to expert i, "
        "P_i: its mean router probability), averaged over MoE layers, weighted like the loss "
        "(logged as train/moe_aux_loss); 0 = off",
    )
    z_loss_coef: float = Field(
        0.0, ge=0, description="weight of the router z-loss, mean of logsumexp(router logits)^2 (0 = off)"
    )

    @property
    def shapes_calls(self) -> bool:
        """Whether the MoE options need plain model calls (no shared-prefix plans, no sequence split)."""
        return self.routing_replay != "off" or self.aux_loss_coef > 0 or self.z_loss_coef > 0


class PolicyConfig(Config):
    """The trainer of one model over one or many ranks."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="compute dtype; master weights and optimizer state stay fp32"
    )
    train_global_batch_size: int = Field(8, ge=1, description="samples per optimizer step, over all DP ranks")
    microbatch: MicroBatchConfig = Field(default_factory=MicroBatchConfig)
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global grad norm (None = no clip)")
    logprob_temperature: float | None = Field(
        None,
        gt=0,
        description="logits are divided by this when scoring tokens. None: sampling.temperature in an RL "
        "run (grpo, grpo-async, ppo, distill; another value is refused there), 1 elsewhere (SFT, DPO)",
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: list[SchedulerStage] = Field(default_factory=list, description="lr stages; empty = constant")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    lora: LoraSettings | None = Field(
        None,
        description="train low-rank adapters (peft LoRA) instead of the full model; None: full fine-tuning",
    )
    init_reference_model: bool = Field(
        True,
        description="reference logprobs available: a copy of the initial weights on CPU, or, with lora, "
        "the same model with its adapters disabled (no copy)",
    )
    moe: MoEConfig = Field(default_factory=MoEConfig)
    # the sampling temperature an RL run ties an unset logprob_temperature to (scoring_at)
    _drawn_at: float | None = PrivateAttr(None)
    free_comms_during_generation: bool = Field(
        False,
        description="colocated loop: teardown_comms() after offload, rebuild_comms() before the next "
        "logprob or training call (frees communicator memory while the engine generates)",
    )

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: cluster.num_workers / (tensor_parallel_size x context_parallel_size)."""
        return self.parallel.dims(self.cluster.num_workers).dp

    @property
    def scoring_temperature(self) -> float:
        """What the logits are divided by: `logprob_temperature`; unset, the temperature the run's samples
        were drawn at (`scoring_at`), else 1."""
        if self.logprob_temperature is not None:
            return self.logprob_temperature
        return 1.0 if self._drawn_at is None else self._drawn_at

    def scoring_at(self, temperature: float, key: str, source: str) -> PolicyConfig:
        """A copy of this config that scores at `temperature`, the value of `source` (the key whose
        samples the model scores): an unset `logprob_temperature` follows it (the value is kept beside
        the fields, so the dumped config still reads unset and follows `source` when loaded again); one
        written otherwise (under `key`) is refused: a ratio, an importance weight or a KL between
        distributions at two temperatures is biased."""
        if self.logprob_temperature is not None and self.logprob_temperature != temperature:
            raise ValueError(
                f"{key}={self.logprob_temperature} but {source}={temperature}: the trainer must score "
                f"tokens at the temperature they were drawn at, or its ratios, importance weights and KL "
                f"compare two distributions. Set {key}={temperature} or leave it unset (it then follows "
                f"{source})"
            )
        tied = self.model_copy()
        tied._drawn_at = temperature
        return tied

    def check_routes_itself(self, key: str, engine_of: str) -> None:
        """Refuse routing replay in a model with no engine of its own (a critic, a teacher, under `key`):
        it would replay the routing `engine_of`'s engine recorded, not its own router's choices."""
        if self.moe.routing_replay != "off":
            raise ValueError(
                f"{key}.moe.routing_replay={self.moe.routing_replay} would route this model's tokens to the "
                f"experts the {engine_of}'s engine chose (it has no engine of its own), so its outputs would "
                f"not be its own: set {key}.moe.routing_replay=off"
            )

    def check_untempered(self, run: str) -> None:
        """Refuse a logprob_temperature other than 1 in a `run` that trains the model's own distribution."""
        if self.scoring_temperature != 1.0:
            raise ValueError(
                f"policy.logprob_temperature={self.logprob_temperature}: {run} trains the model's own "
                "distribution (its logits at temperature 1); tempered logits would train logits / "
                f"{self.logprob_temperature} instead, and the saved model would sample otherwise. Remove "
                "policy.logprob_temperature (RL runs set it: there it is the sampling temperature)"
            )

    def _check_score_head(self) -> None:
        if self.model.head != "score":
            return
        if self.parallel.context_parallel_size > 1:
            raise ValueError(
                "policy.model.head=score with context_parallel_size > 1: context parallelism is not "
                "implemented for scalar heads yet; use parallel.context_parallel_size=1"
            )

    @field_validator("scheduler")
    @classmethod
    def _milestones(cls, stages: list[SchedulerStage]) -> list[SchedulerStage]:
        for i, s in enumerate(stages[:-1]):
            if s.steps == 0:
                raise ValueError(
                    f"stage {i} has steps: 0, but every scheduler stage but the last needs steps > 0 (where "
                    "it ends is the next one's start); give it a length or make it the last stage"
                )
        return stages

    @model_validator(mode="after")
    def _check(self) -> PolicyConfig:
        if self.cluster.backend == "local" and self.cluster.num_workers != 1:
            raise ValueError(
                f"cluster.num_workers={self.cluster.num_workers} needs cluster.backend='ray'; the local backend runs one rank"
            )
        dp = self.dp_size
        if self.train_global_batch_size % dp:
            raise ValueError(
                f"train_global_batch_size={self.train_global_batch_size} is not divisible by the "
                f"{dp} data-parallel ranks (cluster.num_workers={self.cluster.num_workers} / "
                f"(tensor_parallel_size x context_parallel_size)); use a multiple of {dp}"
            )
        if self.lora is not None and self.lora.dropout > 0 and self.parallel.tensor_parallel_size > 1:
            raise ValueError(
                f"policy.lora.dropout={self.lora.dropout} with tensor_parallel_size="
                f"{self.parallel.tensor_parallel_size}: the ranks of a tensor-parallel group would drop "
                "different inputs of one replicated adapter. Set policy.lora.dropout=0"
            )
        self._check_score_head()
        if self.moe.shapes_calls and self.parallel.context_parallel_size > 1:
            raise ValueError(
                "policy.moe.routing_replay=rollout (or a router loss) with context parallelism: they follow "
                "the tokens of an unsplit model call; use context_parallel_size=1 (data, tensor and expert "
                "parallelism work)"
            )
        if self.parallel.sequence_parallel and self.parallel.tensor_parallel_size == 1:
            warnings.warn(
                "parallel.sequence_parallel=true has no effect with tensor_parallel_size=1; ignored",
                stacklevel=2,
            )
        return self
