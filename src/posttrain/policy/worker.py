"""One rank of the policy: a Hugging Face causal LM under FSDP2 (or plain, on one rank), its optimizer,
its reference weights, and the verbs RL needs (train, split train step, logprobs, top-k, lifecycle).
With `model.head=score` the model is a scalar-head decoder (reward model, critic): losses then receive
its per-token values instead of logprobs, and `get_values` / `score` (policy/scalar_verbs.py) serve it.

The same class serves every layout: it runs in-process (local backend) or inside a Ray actor, on a
(dp, cp, tp) layout (`ParallelDims`, parallel/dims.py) that parallel/parallelize.py applies to the model.
Ranks of one data-parallel shard (same dp index) get the same data, so counts and metrics are reduced
over the dp group only; gradients are summed over (dp, cp) by FSDP2, and tensor-parallel ranks hold
their own slices of each weight.
Verbs declare the phases they accept (policy/lifecycle.py); the split-step rules are in
policy/train_step.py.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from posttrain import checkpoint
from posttrain.config import dump_config
from posttrain.data.batch import BASE_KEYS, valid_counts, validate_batch
from posttrain.data.microbatch import (
    MicroBatch,
    SharedPrefix,
    dummy_like,
    make_microbatches,
    plan_shared_prefix,
)
from posttrain.data.normalization import LossFn, loss_normalizer
from posttrain.dtypes import DTYPES
from posttrain.host_memory import keep_freed_memory
from posttrain.logging import get_logger
from posttrain.models.hf import save_hf
from posttrain.models.logprobs import microbatch_logprobs, microbatch_topk
from posttrain.models.lora import adapters_disabled, is_adapter_key, merged_weights, scalings
from posttrain.models.rope import frequency_key
from posttrain.models.scalar_head import model_outputs, shares_prefix
from posttrain.models.tokenizer import pad_token_id
from posttrain.parallel import comms
from posttrain.parallel import mesh as pmesh
from posttrain.parallel.expert_parallel import replicated_experts, sync_expert_grads
from posttrain.parallel.mesh import full_state_dict, full_tensor, iter_full_weights, local_tensor
from posttrain.policy import offload
from posttrain.policy.config import PolicyConfig
from posttrain.policy.identity import base_weights, check_lora_matches, checkpoint_identity, saved_identity
from posttrain.policy.lifecycle import ANY_PHASE, ON_DEVICE, TRAIN_ONLY, Lifecycle, Phase, PhaseError, verb
from posttrain.policy.model_init import build_policy_model, build_tokenizer
from posttrain.policy.model_paths import as_recorded, with_absolute_paths
from posttrain.policy.moe_verbs import RoutingVerbs
from posttrain.policy.optim import build_optimizer, build_scheduler, set_base_lr
from posttrain.policy.scalar_verbs import ScalarHeadVerbs
from posttrain.policy.train_step import (
    NonFiniteLossError,
    OpenStep,
    check_loss_head,
    merge_step_metrics,
    reduce_step,
    without_inert_rows,
)

log = get_logger(__name__)


class PolicyWorker(ScalarHeadVerbs, RoutingVerbs):
    """One rank of the trainer. See the module docstring."""

    def __init__(
        self,
        cfg: PolicyConfig,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        seed: int = 0,
    ) -> None:
        cfg = self.cfg = with_absolute_paths(cfg)  # the checkpoint records paths valid from anywhere
        self.rank, self.world_size = rank, world_size
        self.dims = cfg.parallel.dims(world_size)
        self._seed_generators(seed)
        self.lifecycle = Lifecycle(Phase.TRAINING)
        self.trainer_version = 0
        self._step: OpenStep | None = None
        self._comms_snapshot: comms.CommsSnapshot | None = None
        self.dims.init_process_group(rank, master_addr, master_port)
        self.device = pmesh.default_device()
        if self.device.type == "cpu":
            keep_freed_memory()  # the step's large tensors reuse freed memory (host_memory.py)
        self.dtype = DTYPES[cfg.precision]
        self.tokenizer = build_tokenizer(cfg.model)
        self._pad_id = pad_token_id(self.tokenizer)
        self.dims.build_mesh(self.device)
        self.split = self.dims.sequence_split()
        self.model = build_policy_model(cfg, self.tokenizer, self.device, self.dims, self.dtype)
        self.base_weights = base_weights(cfg.model) if cfg.lora is not None else None  # LoRA's frozen base
        self.optimizer = build_optimizer(
            [p for p in self.model.parameters() if p.requires_grad], cfg.optimizer
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.scheduler)
        self._replicated_experts = replicated_experts(self.model)
        # with LoRA the reference is the same model with its adapters disabled: nothing to keep
        keep_reference = cfg.init_reference_model and cfg.lora is None
        self.reference_weights = self._snapshot_weights() if keep_reference else None
        self.model.train()

    # ------------------------------------------------------------------ helpers

    def _seed_generators(self, seed: int) -> None:
        """Seed this rank's torch generators (CPU and CUDA: dropout draws from them) with `seed` plus
        `dims.seed_offset(rank)`, so a tensor-parallel group draws alike and ranks holding other data draw
        otherwise. The local backend's one rank runs in the caller's process and keeps the caller's
        generators (a run seeds them with its seed before it builds the policy). A checkpoint's RNG
        states, loaded after construction, replace these."""
        if self.cfg.cluster.backend != "local":
            torch.manual_seed(seed + self.dims.seed_offset(self.rank))

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce over the data-parallel ranks (the ranks of one dp shard hold the same values)."""
        if self.dims.dp_enabled and t.numel() > 0:
            dist.all_reduce(t, op=op, group=self.dims.dp_group())
        return t

    def _autocast(self):
        if self.dtype == torch.float32 or self.dims.fsdp_enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def _cut(
        self, batch: TensorDict, training: bool, share_prefix: bool = True, row_group: int = 1
    ) -> list[MicroBatch]:
        mb = self.cfg.microbatch
        size = mb.train_micro_batch_size if training else mb.logprob_micro_batch_size
        return make_microbatches(
            batch,
            mb.mode,
            size=size,
            max_tokens=mb.max_tokens,
            pad_id=self._pad_id,
            share_prefix=share_prefix
            and mb.share_prefix
            and not self.split.active
            and not self._replays(batch)
            and shares_prefix(self.model, self.cfg.model.head),
            row_group=row_group,
            length_key=frequency_key(self.model),
        )

    def _model_to_device(self) -> None:
        """Parameters and buffers to the device. Every transition checks them all (so a transition that
        failed half-way is repaired by the next), except on a CPU device, where host and device are
        one and nothing can be elsewhere: there the walk over every module would be all the work."""
        if self.device.type != "cpu":
            offload.move_model(self.model, self.device, self.dims.cpu_offload)

    def _set_training(self, mode: bool) -> None:
        """Train/eval mode; skips the walk over every module when the model is already there."""
        if self.model.training != mode:
            self.model.train(mode)

    def _matched(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """Pad with dummy micro-batches up to the max count over ranks (see policy/train_step.py). If
        any rank runs a two-call `SharedPrefix` micro-batch, every micro-batch on every rank does, so
        the FSDP gathers of each model call line up."""
        if not self.dims.dp_enabled:
            return mbs
        two_calls = any(isinstance(mb.shared, SharedPrefix) for mb in mbs)
        agreed = torch.tensor([len(mbs), int(two_calls)], device=self.device)
        count, any_two_calls = self._all_reduce(agreed, dist.ReduceOp.MAX).tolist()
        if any_two_calls:
            for mb in mbs:
                if not isinstance(mb.shared, SharedPrefix) and mb.packed is None:
                    mb.shared = plan_shared_prefix(
                        mb.data, self._pad_id, force=True, length_key=frequency_key(self.model)
                    )
        return mbs + [dummy_like(mbs[i % len(mbs)]) for i in range(count - len(mbs))]

    def _snapshot_weights(self) -> dict[str, torch.Tensor]:
        pin = self.device.type == "cuda"
        return {
            n: local_tensor(p).detach().to("cpu", copy=True).pin_memory()
            if pin
            else local_tensor(p).detach().to("cpu", copy=True)
            for n, p in self.model.named_parameters()
        }

    @contextlib.contextmanager
    def _swapped_weights(self, weights: dict[str, torch.Tensor]):
        saved = {}
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                loc = local_tensor(p)
                saved[n] = loc.detach().clone()
                loc.copy_(weights[n], non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    local_tensor(p).copy_(saved[n])

    # ------------------------------------------------------------------ lifecycle

    @verb(*ANY_PHASE, transition=True)
    def prepare_for_training(self) -> None:
        """Model and optimizer state on the device; training mode."""
        self._model_to_device()
        offload.move_optimizer_state(self.optimizer, self.device, self.dims.cpu_offload)
        self._set_training(True)
        self.lifecycle.phase = Phase.TRAINING

    @verb(*ANY_PHASE, transition=True)
    def prepare_for_lp_inference(self) -> None:
        """Model on the device, optimizer state on the host; eval mode."""
        self._model_to_device()
        offload.move_optimizer_state(self.optimizer, torch.device("cpu"))
        self._set_training(False)
        self.lifecycle.phase = Phase.INFERENCE

    @verb(*ANY_PHASE, transition=True)
    def offload_before_refit(self) -> None:
        """Optimizer state to the host (before weights are sent to the engine)."""
        offload.move_optimizer_state(self.optimizer, torch.device("cpu"))
        offload.release_device_cache(self.device)
        if self.lifecycle.phase == Phase.TRAINING:
            self._set_training(False)
            self.lifecycle.phase = Phase.INFERENCE

    @verb(*ANY_PHASE, transition=True)
    def offload_after_refit(self) -> None:
        """Model, buffers and optimizer state to the host; device memory released."""
        offload.move_model(self.model, torch.device("cpu"))
        offload.move_optimizer_state(self.optimizer, torch.device("cpu"))
        offload.release_device_cache(self.device)
        self._set_training(False)
        self.lifecycle.phase = Phase.OFFLOADED

    @verb(*ANY_PHASE)
    def get_state(self) -> dict[str, Any]:
        """Phase, open-step and communicator flags, and the trainer version."""
        return {**self.lifecycle.snapshot(), "trainer_version": self.trainer_version}

    # ------------------------------------------------------------------ split train step

    @verb(*TRAIN_ONLY)
    def begin_train_step(self, loss_fn: LossFn, eval_mode: bool = False) -> None:
        """Open a step: gradients zeroed, accumulators reset. One optimizer step per begin/finish pair."""
        if self._step is not None:
            raise PhaseError(
                "begin_train_step() called while a train step is already open; "
                "call finish_train_step() or abort_train_step() first"
            )
        check_loss_head(loss_fn, self.cfg.model.head)
        self.optimizer.zero_grad(set_to_none=True)
        self._step = OpenStep(self._with_router_losses(loss_fn), eval_mode, self.device)
        self.lifecycle.step_open = True

    @verb(*TRAIN_ONLY, collective=True, in_step=True)
    def train_microbatch(self, batch: TensorDict) -> None:
        """Forward and backward on a batch of any size (cut into micro-batches by config)."""
        step = self._step
        assert step is not None
        validate_batch(batch, BASE_KEYS + tuple(step.loss_fn.required_keys))
        self._run_microbatches(step, batch)

    def _run_microbatches(self, step: OpenStep, batch: TensorDict) -> None:
        if not step.eval_mode and self.cfg.microbatch.skip_inert_rows:
            batch = without_inert_rows(step, batch)
        # a loss over row pairs (DPO, Bradley-Terry) declares `row_group = 2`: each pair stays in one micro-batch
        mbs = self._matched(self._cut(batch, training=True, row_group=getattr(step.loss_fn, "row_group", 1)))
        was_training = self.model.training
        self._set_training(not step.eval_mode)
        try:
            for mb in mbs:
                self._forward_backward(step, mb.to(self.device))
        finally:
            self._set_training(was_training)

    def _forward_backward(self, step: OpenStep, mb: MicroBatch) -> None:
        one = torch.ones((), device=self.device)
        grad_ctx = torch.no_grad() if step.eval_mode else contextlib.nullcontext()
        with self._replay(mb, count=True) as replay:  # open through the backward (recomputation)
            with grad_ctx, self._autocast(), self._capture(mb, step.loss_fn):
                outputs = model_outputs(
                    self.model, mb, self.cfg.model.head, self.cfg.scoring_temperature, self.split
                )
            replay.active = False
            loss, metrics = step.loss_fn(outputs, mb.data, one, one)
            if mb.is_dummy:
                loss = loss * 0.0
            if not step.eval_mode:
                loss.backward()
        if not mb.is_dummy:
            step.add(*valid_counts(mb.data), loss, metrics)

    @verb(*TRAIN_ONLY, collective=True, in_step=True)
    def finish_train_step(self) -> dict[str, float]:
        """Reduce counts and metrics over ranks, scale gradients by 1/N, clip, step optimizer and scheduler.
        Whatever fails on the way (an allocation of the optimizer's state, a collective) aborts the step
        before the error propagates: the gradients were scaled, so the step cannot be finished again."""
        try:
            return self._finish_step()
        except BaseException:
            self.abort_train_step()
            raise

    def _finish_step(self) -> dict[str, float]:
        step = self._step
        assert step is not None
        metrics, seqs, toks, nonfinite = reduce_step(step, self._all_reduce)
        if nonfinite > 0:
            self.abort_train_step()
            raise NonFiniteLossError(
                f"the loss was not finite on {int(nonfinite)} micro-batch(es); the step was refused and the "
                "optimizer left untouched. Check the batch (logprobs, advantages) and the learning rate"
            )
        n = loss_normalizer(step.loss_fn.loss_type, seqs, toks)
        if step.eval_mode or n == 0:
            self.abort_train_step()
            metrics["step_skipped"] = float(n == 0 and not step.eval_mode)
            return metrics
        metrics.update(self._apply_gradients(n))
        return metrics

    def _apply_gradients(self, n: float) -> dict[str, float]:
        params = [p for p in self.model.parameters() if p.grad is not None]
        with torch.no_grad():
            sync_expert_grads(self._replicated_experts)  # expert parallelism over several replica rows
            torch._foreach_div_([p.grad for p in params], n)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grad_norm = pmesh.clip_grad_norm(params, max_norm)
        if not math.isfinite(grad_norm):
            self.abort_train_step()
            raise NonFiniteLossError(
                f"the gradient norm is {grad_norm}; the step was refused and the optimizer left untouched"
            )
        lr = self.optimizer.param_groups[0]["lr"]  # recorded before the scheduler steps
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._step = None
        self.lifecycle.step_open = False
        self.trainer_version += 1
        return {"grad_norm": grad_norm, "lr": lr, "trainer_version": float(self.trainer_version)}

    @verb(*ANY_PHASE)
    def abort_train_step(self) -> None:
        """Drop the open step (idempotent): gradients cleared; optimizer, scheduler and version untouched."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.dims.fsdp_enabled:
            for m in self.model.modules():
                if hasattr(m, "reshard") and hasattr(m, "unshard"):
                    m.reshard()
        self._step = None
        self.lifecycle.step_open = False

    @verb(*TRAIN_ONLY, collective=True)
    def train(self, batch: TensorDict, loss_fn: LossFn, eval_mode: bool = False) -> dict[str, float]:
        """One optimizer step per local global-batch slice of `batch`, each a begin/microbatch/finish."""
        validate_batch(batch, BASE_KEYS + tuple(loss_fn.required_keys))
        local_gbs = self.cfg.train_global_batch_size // self.dims.dp
        b = batch.batch_size[0]
        if b % local_gbs:
            raise ValueError(
                f"this rank got {b} samples, not a multiple of its share ({local_gbs}) of "
                f"train_global_batch_size={self.cfg.train_global_batch_size}; send a multiple of the global batch size"
            )
        results = []
        for start in range(0, b, local_gbs):
            self.begin_train_step(loss_fn, eval_mode)
            try:
                self._run_microbatches(self._step, batch[start : start + local_gbs])  # validated above
                results.append(self.finish_train_step())
            except BaseException:
                self.abort_train_step()
                raise
        return merge_step_metrics(results, loss_fn.metric_kinds, loss_fn.loss_type)

    # ------------------------------------------------------------------ inference verbs

    def _infer(self, batch: TensorDict, fn, share_prefix: bool = True) -> list[tuple[MicroBatch, Any]]:
        validate_batch(batch, ("input_ids", "input_lengths"))
        if "token_mask" not in batch.keys():
            batch = batch.clone(False)
            batch["token_mask"] = torch.ones_like(batch["input_ids"], dtype=torch.float32)
            batch["sample_mask"] = torch.ones(batch.batch_size[0])
        mbs = self._matched(self._cut(batch, training=False, share_prefix=share_prefix))
        was_training = self.model.training
        self._set_training(False)
        out = []
        try:
            with torch.no_grad(), self._autocast():
                for mb in mbs:
                    with self._replay(mb):
                        res = fn(mb.to(self.device))
                    if not mb.is_dummy:
                        out.append((mb, res))
        finally:
            self._set_training(was_training)
        return out

    def _scatter(self, batch: TensorDict, parts: list[tuple[MicroBatch, torch.Tensor]]) -> torch.Tensor:
        b, t = batch["input_ids"].shape
        first = parts[0][1]
        out = torch.zeros((b, t, *first.shape[2:]), dtype=first.dtype)
        for mb, values in parts:
            tt = values.shape[1]
            out[mb.indices, :tt] = values.cpu()
        return out

    @verb(*ON_DEVICE, collective=True)
    def get_logprobs(self, batch: TensorDict) -> torch.Tensor:
        """[B, T] logprobs of each token given the previous ones (position 0 and padding: 0)."""
        self._require_head("lm", "get_logprobs")
        temp = self.cfg.scoring_temperature
        return self._scatter(
            batch,
            self._infer(batch, lambda mb: microbatch_logprobs(self.model, mb, temp, self.split).float()),
        )

    @verb(*ON_DEVICE, collective=True)
    def get_reference_policy_logprobs(self, batch: TensorDict) -> torch.Tensor:
        """Logprobs under the initial weights (kept on the host, swapped in for this call; with LoRA:
        the base model, adapters disabled for this call)."""
        if not self.cfg.init_reference_model:
            raise ValueError("reference logprobs need policy.init_reference_model=true")
        if self.cfg.lora is not None:
            with adapters_disabled(self.model):
                return self.get_logprobs(batch)
        assert self.reference_weights is not None
        with self._swapped_weights(self.reference_weights):
            return self.get_logprobs(batch)

    @verb(*ON_DEVICE, collective=True)
    def get_topk_logits(self, batch: TensorDict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k logits and token ids [B, T, k] of the distribution over each token (position 0: zeros)."""
        self._require_head("lm", "get_topk_logits")
        vocab = self.model.config.vocab_size
        if not 1 <= k <= vocab:
            raise ValueError(f"k must be between 1 and the vocabulary size {vocab}, got {k}")
        temp = self.cfg.scoring_temperature
        parts = self._infer(
            batch, lambda mb: microbatch_topk(self.model, mb, k, temp, self.split), share_prefix=False
        )
        values = self._scatter(batch, [(mb, v.float()) for mb, (v, _) in parts])
        ids = self._scatter(batch, [(mb, i) for mb, (_, i) in parts])
        return values, ids

    # ------------------------------------------------------------------ weights

    def _full_weights(self, adapters_only: bool = False, unique: bool = False):
        """(name, full tensor) of the model under its Hugging Face names, gathered one tensor at a time
        (collective under FSDP2/TP): with LoRA, merged (base + scaling * B @ A) or, with
        `adapters_only`, the adapter tensors alone; `unique`: tied tensors once (a weight sync's)."""
        if self.cfg.lora is None:
            return iter_full_weights(self.model, unique)
        if adapters_only:
            return (
                (n, full_tensor(p).detach()) for n, p in self.model.named_parameters() if is_adapter_key(n)
            )
        return merged_weights(iter_full_weights(self.model, unique), scalings(self.model))

    def _engine_adapters_only(self) -> bool:
        return self.cfg.lora is not None and self.cfg.lora.engine == "adapters"

    @verb(*ON_DEVICE, collective=True)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) parameters and persistent buffers on the host (collective under FSDP);
        with LoRA, the merged weights under the base model's names."""
        if self.cfg.lora is None:
            return full_state_dict(self.model)
        return {name: t.to("cpu", copy=True) for name, t in self._full_weights()}

    @verb(*ON_DEVICE, collective=True)
    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """What weight sync sends to an engine, on the host: the full state dict (a tied tensor once), or
        with `policy.lora.engine=adapters` the adapter tensors alone."""
        only = self._engine_adapters_only()
        return {name: t.to("cpu", copy=True) for name, t in self._full_weights(only, unique=True)}

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_state(self, verb_name: str) -> checkpoint.TrainState:
        if self._step is not None:
            raise PhaseError(
                f"{verb_name}() called while a split train step is open; "
                "call finish_train_step() or abort_train_step() first"
            )
        return checkpoint.TrainState(
            self.model,
            self.optimizer,
            self.scheduler,
            self.reference_weights,
            trainable_only=self.cfg.lora is not None,
        )

    @verb(*ANY_PHASE, collective=True)
    def save_checkpoint(self, path: str, extra_state: dict | None = None) -> None:
        """Model, optimizer, scheduler, RNG and reference weights to `path`, sharded and atomic (checkpoint.py)."""
        checkpoint.save_checkpoint(
            path,
            self._checkpoint_state("save_checkpoint"),
            trainer_version=self.trainer_version,
            identity=checkpoint_identity(self.cfg, base=self.base_weights),
            extra_state=extra_state,
            tokenizer=self.tokenizer,
            config_yaml=dump_config(self.cfg),
            mesh=self.dims.sizes(),
        )

    @verb(*ON_DEVICE, collective=True)
    def load_checkpoint(self, path: str) -> dict:
        """Restore everything `save_checkpoint` wrote (on any number of ranks); returns its extra_state. The
        learning rate is `optimizer.lr` of this policy's config, at the schedule's restored position."""
        saved = saved_identity(path)
        check_lora_matches(self.cfg, path, saved, self.base_weights)
        info = checkpoint.load_checkpoint(
            path,
            self._checkpoint_state("load_checkpoint"),
            identity=as_recorded(checkpoint_identity(self.cfg, saved, self.base_weights), saved),
            mesh=self.dims.sizes(),
        )
        set_base_lr(self.optimizer, self.scheduler, self.cfg.optimizer.lr)
        self.trainer_version = info.trainer_version
        if self.lifecycle.phase == Phase.INFERENCE:  # loading put the optimizer state next to the params
            offload.move_optimizer_state(self.optimizer, torch.device("cpu"))
        return info.extra_state

    # ------------------------------------------------------------------ communicators

    @verb(*ANY_PHASE, transition=True)
    def teardown_comms(self) -> dict[str, Any]:
        """Destroy this rank's device process groups (idempotent; parallel/comms.py). Until
        `rebuild_comms()`, verbs that need a collective raise PhaseError. Returns groups_destroyed, seconds
        and, on a GPU, device bytes used before/after. A failure names the group; call again to retry."""
        snap = self._comms_snapshot
        if snap is None:
            snap = comms.collect_groups(
                self.model if self.dims.fsdp_enabled else None,
                self.dims.meshes.all() if self.dims.meshes is not None else None,
                device_type=self.device.type,
            )
            self._comms_snapshot = snap
        self.lifecycle.comms_up = False
        return comms.teardown(snap)

    @verb(*ANY_PHASE)
    def rebuild_comms(self) -> dict[str, Any]:
        """Recreate the groups `teardown_comms()` destroyed and re-bind them to the model's sharding state
        (idempotent; collective: call on every rank). Returns groups_created, seconds and device bytes."""
        snap = self._comms_snapshot
        if snap is None:
            self.lifecycle.comms_up = True
            return {"groups_created": 0, "groups_destroyed": 0, "seconds": 0.0}
        _, stats = comms.rebuild(snap)
        self._comms_snapshot = None
        self.lifecycle.comms_up = True
        return stats

    @verb(*ON_DEVICE, collective=True)
    def send_weights(self, sink, version: int) -> dict[str, float]:
        """Stream what `engine_state_dict` holds, one gathered tensor at a time, into
        `sink(named_tensors, rank)` (e.g. generation.weight_sync.BroadcastSink): rank 0 sends straight to
        the engines, not through the driver. Collective under FSDP (every rank gathers)."""
        return sink(self._full_weights(self._engine_adapters_only(), unique=True), self.rank)

    @verb(*ON_DEVICE, collective=True)
    def save_hf(self, out_dir: str) -> None:
        """Write a Hugging Face directory (safetensors, config, tokenizer) from rank 0."""
        state = self.full_state_dict()
        if self.rank == 0:
            save_hf(self.model, self.tokenizer, out_dir, state_dict=state)
