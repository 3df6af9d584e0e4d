"""The driver side of the policy: shards batches over data-parallel ranks, calls every rank, gathers.

Under tensor or context parallelism several ranks work on one data-parallel shard (parallel/mesh.py):
each of them gets that shard, and the results of one rank per shard (its leader) are gathered.

It tracks the same lifecycle as its workers, so a wrong call raises `PhaseError` on the driver before
any rank is contacted. Each verb is dispatched to all ranks (that is what keeps their collectives
matched); results come back from every rank and are merged here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from posttrain.data.batch import shard_batch, validate_batch
from posttrain.data.normalization import LossFn
from posttrain.parallel.cluster import WorkerGroup
from posttrain.parallel.tensor_parallel import check_parallel_support
from posttrain.policy.config import PolicyConfig
from posttrain.policy.lifecycle import ANY_PHASE, ON_DEVICE, TRAIN_ONLY, Lifecycle, Phase, PhaseError, verb
from posttrain.policy.model_init import check_dropout_support, model_config
from posttrain.policy.worker import PolicyWorker


class Policy:
    """A model trained over `cluster.num_workers` ranks; see the module docstring."""

    def __init__(self, cfg: PolicyConfig, worker_cls: type = PolicyWorker, seed: int = 0) -> None:
        """`seed`: the run's seed; each rank seeds its generators with it (PolicyWorker._seed_generators)."""
        self.cfg = cfg
        self.lifecycle = Lifecycle(Phase.TRAINING)
        self.world_size = cfg.cluster.num_workers
        self.dims = cfg.parallel.dims(self.world_size)
        # before any rank starts or any weights load; the errors name the fix
        config = model_config(cfg.model)
        check_parallel_support(config, self.dims)
        check_dropout_support(cfg, config)
        self.group = WorkerGroup(worker_cls, cfg.cluster, cfg, seed=seed)
        self._step_loss: LossFn | None = None

    # ------------------------------------------------------------------ sharding

    def _per_rank(self, dp_shards: list[TensorDict]) -> list[tuple[TensorDict]]:
        """Rank r's argument tuple: the shard of its data-parallel index."""
        return [(dp_shards[self.dims.dp_index(r)],) for r in range(self.world_size)]

    def _shards(self, batch: TensorDict) -> list[tuple[TensorDict]]:
        return self._per_rank(shard_batch(batch, self.dims.dp))

    def _uneven_shards(self, batch: TensorDict) -> list[tuple[TensorDict]]:
        """Near-equal contiguous shards of any batch size; a rank left without rows gets one masked-out
        row, so it still takes part in the collectives and contributes nothing."""
        b, dp = batch.batch_size[0], self.dims.dp
        bounds = [round(r * b / dp) for r in range(dp + 1)]
        shards = []
        for lo, hi in zip(bounds, bounds[1:]):
            if hi > lo:
                shards.append(batch[lo:hi])
            else:
                filler = batch[:1].clone()
                filler["sample_mask"] = torch.zeros_like(filler["sample_mask"])
                filler["token_mask"] = torch.zeros_like(filler["token_mask"])
                shards.append(filler)
        return self._per_rank(shards)

    def _train_shards(self, batch: TensorDict) -> list[tuple[TensorDict]]:
        """Rank r gets, for every global batch g in order, the r-th slice of g (so DP size never changes
        which samples form an optimizer step)."""
        gbs = self.cfg.train_global_batch_size
        b = batch.batch_size[0]
        if b % gbs:
            raise ValueError(
                f"batch of {b} samples is not a multiple of train_global_batch_size={gbs}; "
                "send whole global batches (pad with sample_mask=0 rows if needed)"
            )
        per_dp: list[list[TensorDict]] = [[] for _ in range(self.dims.dp)]
        for start in range(0, b, gbs):
            for d, s in enumerate(shard_batch(batch[start : start + gbs], self.dims.dp)):
                per_dp[d].append(s)
        return self._per_rank([parts[0] if len(parts) == 1 else torch.cat(parts) for parts in per_dp])

    # ------------------------------------------------------------------ lifecycle

    def _transition(self, method: str, phase: Phase) -> None:
        self.group.run(method)
        self.lifecycle.phase = phase

    @verb(*ANY_PHASE, transition=True)
    def prepare_for_training(self) -> None:
        """All ranks: model and optimizer on the device."""
        self._transition("prepare_for_training", Phase.TRAINING)

    @verb(*ANY_PHASE, transition=True)
    def prepare_for_lp_inference(self) -> None:
        """All ranks: model on the device, optimizer state on the host."""
        self._transition("prepare_for_lp_inference", Phase.INFERENCE)

    @verb(*ANY_PHASE, transition=True)
    def offload_before_refit(self) -> None:
        """All ranks: optimizer state to the host."""
        phase = Phase.INFERENCE if self.lifecycle.phase == Phase.TRAINING else self.lifecycle.phase
        self._transition("offload_before_refit", phase)

    @verb(*ANY_PHASE, transition=True)
    def offload_after_refit(self) -> None:
        """All ranks: everything to the host."""
        self._transition("offload_after_refit", Phase.OFFLOADED)

    def get_states(self) -> list[dict[str, Any]]:
        """Each rank's phase, open-step flag, communicator flag and trainer version."""
        return self.group.run("get_state")

    # ------------------------------------------------------------------ training

    @verb(*TRAIN_ONLY, collective=True)
    def train(self, batch: TensorDict, loss_fn: LossFn, eval_mode: bool = False) -> dict[str, float]:
        """One optimizer step per `train_global_batch_size` samples of `batch`."""
        validate_batch(batch)
        return self.group.run("train", loss_fn, eval_mode, per_rank=self._train_shards(batch))[0]

    @verb(*TRAIN_ONLY)
    def begin_train_step(self, loss_fn: LossFn, eval_mode: bool = False) -> None:
        """Open a split train step on every rank."""
        if self.lifecycle.step_open:
            raise PhaseError(
                "begin_train_step() called while a train step is already open; "
                "call finish_train_step() or abort_train_step() first"
            )
        self.group.run("begin_train_step", loss_fn, eval_mode)
        self.lifecycle.step_open = True

    def submit_train_microbatch(self, batch: TensorDict) -> list[Any]:
        """Start `train_microbatch` on every rank with its shard; returns the Ray refs (or results)."""
        self.lifecycle.check("train_microbatch", TRAIN_ONLY, collective=True, transition=False, in_step=True)
        validate_batch(batch)
        return self.group.submit("train_microbatch", per_rank=self._uneven_shards(batch))

    @verb(*TRAIN_ONLY, collective=True, in_step=True)
    def train_microbatch(self, batch: TensorDict) -> None:
        """Forward/backward `batch` (sharded over ranks) into the open step's gradients."""
        self.group.get(self.submit_train_microbatch(batch), "train_microbatch")

    @verb(*TRAIN_ONLY, collective=True, in_step=True)
    def finish_train_step(self) -> dict[str, float]:
        """Close the step on every rank: one optimizer step; returns the global metrics."""
        try:
            results = self.group.run("finish_train_step")
        finally:
            self.lifecycle.step_open = False
        return results[0]

    @verb(*ANY_PHASE)
    def abort_train_step(self) -> None:
        """Drop the open step on every rank (idempotent)."""
        self.group.run("abort_train_step")
        self.lifecycle.step_open = False

    # ------------------------------------------------------------------ inference

    def _gather(self, method: str, batch: TensorDict, *args: Any) -> Any:
        validate_batch(batch, ("input_ids", "input_lengths"))
        results = self.group.run(method, *args, per_rank=self._shards(batch))
        results = [results[r] for r in self.dims.dp_leaders()]
        if isinstance(results[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*results))
        return torch.cat(results)

    @verb(*ON_DEVICE, collective=True)
    def get_logprobs(self, batch: TensorDict) -> torch.Tensor:
        """[B, T] logprobs of the current weights."""
        return self._gather("get_logprobs", batch)

    @verb(*ON_DEVICE, collective=True)
    def get_reference_policy_logprobs(self, batch: TensorDict) -> torch.Tensor:
        """[B, T] logprobs of the initial weights."""
        return self._gather("get_reference_policy_logprobs", batch)

    @verb(*ON_DEVICE, collective=True)
    def get_values(self, batch: TensorDict) -> torch.Tensor:
        """[B, T] per-token values of a scalar-head model (`model.head=score`)."""
        return self._gather("get_values", batch)

    @verb(*ON_DEVICE, collective=True)
    def score(self, batch: TensorDict) -> torch.Tensor:
        """[B] each row's score at its last real token (`model.head=score`: a reward model)."""
        return self._gather("score", batch)

    @verb(*ON_DEVICE)
    def pop_routing_stats(self) -> dict[str, int]:
        """MoE routing replay since the last call: decisions replayed (`total`) and those the trainer's own
        router would have made differently (`differ`), over the data-parallel ranks; resets them."""
        per_rank = self.group.run("pop_routing_stats")
        ranks = self.dims.dp_leaders()
        return {k: sum(per_rank[r][k] for r in ranks) for k in ("differ", "total")}

    @verb(*ON_DEVICE, collective=True)
    def get_topk_logits(self, batch: TensorDict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T, k] values, [B, T, k] token ids) of the top-k logits."""
        return self._gather("get_topk_logits", batch, k)

    @verb(*ON_DEVICE, collective=True)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights on the host (gathered from the shards; with LoRA, merged into the base's names)."""
        return self.group.run("full_state_dict")[0]

    @verb(*ON_DEVICE, collective=True)
    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """What weight sync sends: the full weights, or the adapters alone (`policy.lora.engine=adapters`)."""
        return self.group.run("engine_state_dict")[0]

    # ------------------------------------------------------------------ checkpoints

    def _check_no_open_step(self, verb_name: str) -> None:
        if self.lifecycle.step_open:
            raise PhaseError(
                f"{verb_name}() called while a split train step is open; "
                "call finish_train_step() or abort_train_step() first"
            )

    @verb(*ANY_PHASE, collective=True)
    def save_checkpoint(self, path: str, extra_state: dict | None = None) -> None:
        """All ranks write one sharded checkpoint to `path` (a directory every rank can reach), atomically."""
        self._check_no_open_step("save_checkpoint")
        self.group.run("save_checkpoint", str(Path(path).absolute()), extra_state)

    @verb(*ON_DEVICE, collective=True)
    def load_checkpoint(self, path: str) -> dict:
        """All ranks restore a checkpoint saved on any number of ranks; returns its extra_state."""
        self._check_no_open_step("load_checkpoint")
        return self.group.run("load_checkpoint", str(Path(path).absolute()))[0]

    @verb(*ON_DEVICE, collective=True)
    def save_hf(self, out_dir: str) -> None:
        """Write the current weights as a Hugging Face directory loadable by from_pretrained."""
        self.group.run("save_hf", out_dir)

    @verb(*ON_DEVICE, collective=True)
    def send_weights(self, sink, version: int) -> list[dict[str, float]]:
        """Every rank streams `engine_state_dict`'s tensors into `sink` (see PolicyWorker.send_weights)."""
        return self.group.run("send_weights", sink, version)

    def shutdown(self) -> None:
        self.group.shutdown()

    # ------------------------------------------------------------------ communicators

    @verb(*ANY_PHASE, transition=True)
    def teardown_comms(self) -> list[dict[str, Any]]:
        """All ranks: destroy the device communicators (idempotent); each rank's stats. Until
        `rebuild_comms()`, verbs that need a collective raise PhaseError here, before any rank is called."""
        self.lifecycle.comms_up = False  # set first: a failure may leave some ranks torn down
        return self.group.run("teardown_comms")

    @verb(*ANY_PHASE)
    def rebuild_comms(self) -> list[dict[str, Any]]:
        """All ranks: recreate the communicators and re-bind them to the model (idempotent); each rank's
        stats."""
        stats = self.group.run("rebuild_comms")
        self.lifecycle.comms_up = True
        return stats
