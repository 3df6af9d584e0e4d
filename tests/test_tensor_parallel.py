"""Tensor, sequence and context parallelism: every layout of the (dp, cp, tp) mesh takes the same
optimizer step, and gives the same logprobs and top-k, as one rank (gloo ranks in spawned processes)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import random_batch
from helpers import assert_only_adapters_moved, assert_params_close, full_params, policy_cfg
from posttrain.checkpoint import read_metadata
from posttrain.data import microbatch
from posttrain.data.batch import shard_batch
from posttrain.models.hf import load_model
from posttrain.parallel.dims import ParallelDims
from posttrain.parallel.processes import run_ranks
from posttrain.parallel.tensor_parallel import apply_tp, check_tp_divides
from posttrain.policy.config import PolicyConfig
from posttrain.policy.export import export_hf
from posttrain.policy.worker import PolicyWorker
from test_invariance import LOSSES, SGD

PADDED = {"train_micro_batch_size": 3, "logprob_micro_batch_size": 3}
PACKED = {"mode": "packed", "max_tokens": 40}
DYNAMIC = {"mode": "dynamic", "max_tokens": 40}
WINDOWED = {"tiny": {"family": "mistral", "sliding_window": 5}}
WINDOW_10 = {"tiny": {"family": "mistral", "sliding_window": 10}}  # between a row / tp and a row
# LoRA adapters and two steps: B starts at zero, so A's gradient is zero in the first step and only the
# second moves A (on a tensor-parallel mesh A and B are sharded differently: both must move alike)
LORA = {"lora": {"rank": 4, "alpha": 8}, "steps": 2}
LORA_ADAPTERS = {"lora": {"rank": 4, "alpha": 8, "engine": "adapters"}, "steps": 2}


def _batch(sc: dict):
    """The scenario's batch: random rows, or (`shared_prompts`) two groups of four rows that start with
    the same 8-token prompt, so micro-batches take the shared-prefix plans."""
    if not sc.get("shared_prompts"):
        return random_batch(8, 16, rl=True)
    batch = random_batch(8, 16, rl=True, prompt_len=8)
    for first in (0, 4):
        batch["input_ids"][first : first + 4, :8] = batch["input_ids"][first, :8]
    return batch


@contextlib.contextmanager
def _plans(sc: dict):
    """`two_call`: every shared-prefix micro-batch takes the two-call plan (GroupedRows never fits)."""
    saved = microbatch.GROUPED_ROW_MAX
    microbatch.GROUPED_ROW_MAX = 1 if sc.get("two_call") else saved
    try:
        yield
    finally:
        microbatch.GROUPED_ROW_MAX = saved


SCENARIO_ONLY = ("loss", "split_api", "shared_prompts", "two_call", "rebuild_comms", "steps")


def _cfg(world: int, sc: dict) -> PolicyConfig:
    extra = {k: v for k, v in sc.items() if k not in SCENARIO_ONLY}
    extra.setdefault("optimizer", SGD)
    return policy_cfg(cluster={"backend": "ray", "num_workers": world}, **extra)


def _reference_cfg(sc: dict) -> PolicyConfig:
    """The same step on one local rank: no parallel layout, default micro-batching."""
    keep = {k: v for k, v in sc.items() if k in ("model", "optimizer", "logprob_temperature", "lora")}
    keep.setdefault("optimizer", SGD)
    return policy_cfg(**keep)


def _step(worker: PolicyWorker, batch, sc: dict) -> dict:
    """`steps` (default 1) optimizer steps on `batch`; the metrics of the last."""
    return [_one_step(worker, batch, sc) for _ in range(sc.get("steps", 1))][-1]


def _one_step(worker: PolicyWorker, batch, sc: dict) -> dict:
    loss = LOSSES[sc.get("loss", "pg_token")]()
    if not sc.get("split_api"):
        return worker.train(batch, loss)
    worker.begin_train_step(loss)
    half = batch.batch_size[0] // 2
    worker.train_microbatch(batch[:half])
    worker.train_microbatch(batch[half:])
    return worker.finish_train_step()


def _outcome(worker: PolicyWorker, batch, metrics: dict) -> dict:
    """Metrics, full (with LoRA: merged) weights, what an engine receives, logprobs, reference logprobs
    (with LoRA: adapters disabled) and top-k after the step."""
    return {
        "metrics": metrics,
        "params": worker.full_state_dict(),
        "engine": worker.engine_state_dict(),
        "logprobs": worker.get_logprobs(batch),
        "reference_logprobs": worker.get_reference_policy_logprobs(batch),
        "topk": worker.get_topk_logits(batch, 3),
    }


def _scenarios_on_ranks(rank: int, world: int, port: int, scenarios: list[dict]) -> list[dict | None]:
    """Every scenario on this rank: a fresh worker on the scenario's mesh, one step on its dp shard."""
    out = []
    for sc in scenarios:
        worker = PolicyWorker(_cfg(world, sc), rank=rank, world_size=world, master_port=port)
        shard = shard_batch(_batch(sc), worker.dims.dp)[worker.dims.dp_index(rank)]
        if sc.get("rebuild_comms"):  # every group of the mesh destroyed and created anew before the step
            worker.get_logprobs(shard)
            worker.teardown_comms()
            worker.rebuild_comms()
        before = full_params(worker.model) if "lora" in sc else None
        with _plans(sc):
            result = _outcome(worker, shard, _step(worker, shard, sc))
        if before is not None:  # gathered from the shards: every rank takes part
            after = full_params(worker.model)
            if rank == 0:
                assert_only_adapters_moved(before, after)
        worker.teardown_comms()  # this scenario's groups are not needed again
        out.append(result if rank == 0 else None)
    return out


def _reference(sc: dict) -> dict:
    worker = PolicyWorker(_reference_cfg(sc))
    batch = _batch(sc)
    with _plans(sc):
        return _outcome(worker, batch, _step(worker, batch, {k: sc[k] for k in ("loss", "steps") if k in sc}))


def assert_same_as_one_rank(ref: dict, got: dict, rows: int, tol: float = 1e-5) -> None:
    """Metrics, parameters and engine weights within `tol` (1e-5: fp32 on CPU); logprobs and top-k on
    `rows` rows."""
    for k in ("loss", "grad_norm", "global_valid_toks", "global_valid_seqs"):
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=tol, abs=1e-7), k
    for k in ("params", "engine"):
        assert_params_close(ref[k], got[k], rtol=tol, atol=tol / 10)
    for k in ("logprobs", "reference_logprobs"):
        torch.testing.assert_close(got[k], ref[k][:rows], rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}")
    (v_ref, i_ref), (v, i) = ref["topk"], got["topk"]
    torch.testing.assert_close(v, v_ref[:rows], rtol=tol, atol=tol)
    assert torch.equal(i, i_ref[:rows])


def _rows(world: int, sc: dict) -> int:
    """The rows of the 8-row batch that rank 0 holds: its data-parallel shard."""
    par = sc.get("parallel", {})
    return 8 * par.get("tensor_parallel_size", 1) * par.get("context_parallel_size", 1) // world


def _run_matrix(world: int, scenarios: list[dict], tol: float = 1e-5) -> None:
    """Every scenario on `world` ranks (one spawn) against the same step on one rank."""
    results = run_ranks(world, _scenarios_on_ranks, scenarios)[0]
    refs: dict[str, dict] = {}
    for sc, got in zip(scenarios, results):
        key = repr(
            (
                _reference_cfg(sc).model_dump(),
                *(sc.get(k) for k in ("loss", "shared_prompts", "two_call", "steps")),
            )
        )
        if key not in refs:
            refs[key] = _reference(sc)
        try:
            assert_same_as_one_rank(refs[key], got, _rows(world, sc), tol)
        except AssertionError as e:
            raise AssertionError(f"scenario {sc}: {e}") from e


LAYOUTS_2 = {
    "tp2": {"tensor_parallel_size": 2},
    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "cp2": {"context_parallel_size": 2},
}


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_tp_sp_cp_match_one_rank():
    """TP=2, TP=2+SP and CP=2, each for token- and sequence-level clipped PG and NLL, padded and packed;
    LoRA on each of them and on dp=2 (FSDP2): the same merged weights and adapters, and only the
    adapters move."""
    scenarios = [
        {"parallel": par, "microbatch": mb, "loss": loss}
        for par in LAYOUTS_2.values()
        for loss in LOSSES
        for mb in (PADDED, PACKED)
    ]
    lora = [
        {**LORA, "parallel": LAYOUTS_2["tp2"], "microbatch": PADDED},
        {**LORA_ADAPTERS, "parallel": LAYOUTS_2["tp2_sp"], "microbatch": PACKED, "loss": "pg_seq"},
        {**LORA, "parallel": LAYOUTS_2["cp2"], "microbatch": PACKED},
        {**LORA_ADAPTERS, "parallel": {}, "microbatch": PACKED, "loss": "nll"},  # dp=2
    ]
    _run_matrix(2, scenarios + lora)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_features_match_one_rank():
    """What works on one rank works on the mesh: split step, dynamic batching, activation checkpointing,
    FSDP CPU offload, tied embeddings, Qwen3 (per-head q/k norms), Gemma, Mistral (with a sliding window
    shorter than the rows), temperature, shared-prompt batches (both shared-prefix plans under TP; off
    under CP); LoRA with activation checkpointing, CPU offload and the split step, on a tied embedding and
    on Qwen3, whose frozen norms stay frozen."""
    tp2, sp, cp2 = LAYOUTS_2["tp2"], LAYOUTS_2["tp2_sp"], LAYOUTS_2["cp2"]
    scenarios = [
        {"parallel": tp2, "microbatch": PADDED, "split_api": True},
        {"parallel": cp2, "microbatch": PACKED, "split_api": True, "loss": "pg_seq"},
        {"parallel": sp, "microbatch": DYNAMIC},
        {"parallel": cp2, "microbatch": DYNAMIC},
        {"parallel": {**sp, "activation_checkpointing": True}, "microbatch": PACKED},
        {"parallel": {**cp2, "activation_checkpointing": True}, "microbatch": PADDED},
        {"parallel": {**tp2, "fsdp_cpu_offload": True}, "microbatch": PADDED},
        {"parallel": sp, "microbatch": PADDED, "model": {"tiny": {"tie_word_embeddings": True}}},
        {"parallel": sp, "microbatch": PACKED, "model": {"tiny": {"family": "qwen3"}}},
        {"parallel": tp2, "microbatch": PADDED, "model": {"tiny": {"family": "gemma"}}},
        {"parallel": cp2, "microbatch": PACKED, "model": {"tiny": {"family": "mistral"}}, "loss": "nll"},
        {"parallel": sp, "microbatch": PACKED, "logprob_temperature": 0.7},
        {"parallel": tp2, "microbatch": {"train_micro_batch_size": 4}, "shared_prompts": True},
        {
            "parallel": tp2,
            "microbatch": {"train_micro_batch_size": 4},
            "shared_prompts": True,
            "two_call": True,
        },
        {"parallel": cp2, "microbatch": {"train_micro_batch_size": 4}, "shared_prompts": True},
        {"parallel": cp2, "microbatch": PADDED, "model": WINDOWED},
        {"parallel": cp2, "microbatch": PACKED, "model": WINDOWED},
        {"parallel": sp, "microbatch": PACKED, "model": WINDOWED},
        {"parallel": sp, "microbatch": PADDED, "model": WINDOWED},  # window 5 <= 16 / tp
        {"parallel": sp, "microbatch": DYNAMIC, "model": WINDOW_10},
        {"parallel": cp2, "microbatch": PADDED, "logprob_temperature": 0.7, "loss": "pg_seq"},
        {**LORA, "parallel": {**sp, "activation_checkpointing": True}, "microbatch": DYNAMIC},
        {**LORA, "parallel": {**tp2, "fsdp_cpu_offload": True}, "microbatch": PADDED, "split_api": True},
        {**LORA, "parallel": {**cp2, "activation_checkpointing": True}, "microbatch": PADDED},
        {**LORA, "parallel": sp, "microbatch": PADDED, "model": {"tiny": {"tie_word_embeddings": True}}},
        {**LORA, "parallel": sp, "microbatch": PACKED, "model": {"tiny": {"family": "qwen3"}}},
    ]
    _run_matrix(2, scenarios)


@pytest.mark.distributed
@pytest.mark.slow
def test_four_ranks_dp2_tp2_and_cp2_tp2_match_one_rank():
    """dp=2 x tp=2 for every loss, padded and packed; cp=2 x tp=2 + SP, dp=2 x cp=2 and dp=2 x tp=2 + SP
    after a teardown and rebuild of every communicator of the mesh; LoRA on dp=2 x tp=2 and, after a
    rebuild, on cp=2 x tp=2 + SP."""
    dp_tp = {"tensor_parallel_size": 2}
    cp_tp = {"tensor_parallel_size": 2, "context_parallel_size": 2, "sequence_parallel": True}
    dp_cp = {"context_parallel_size": 2}
    dp_tp_sp = {"tensor_parallel_size": 2, "sequence_parallel": True}
    scenarios = [
        *({"parallel": dp_tp, "microbatch": mb, "loss": loss} for loss in LOSSES for mb in (PADDED, PACKED)),
        {"parallel": cp_tp, "microbatch": PACKED, "loss": "pg_seq", "rebuild_comms": True},
        *({"parallel": p, "microbatch": PACKED, "rebuild_comms": True} for p in (dp_cp, dp_tp_sp)),
        {**LORA_ADAPTERS, "parallel": dp_tp, "microbatch": PACKED},
        {**LORA, "parallel": cp_tp, "microbatch": PADDED, "rebuild_comms": True},
    ]
    _run_matrix(4, scenarios)


# ------------------------------------------------------------------ checkpoints, export, sync, comms


# momentum carries optimizer state across the resume; Adam's first steps (g/|g|) would amplify the float
# noise of near-zero gradients past an fp32 tolerance
MOMENTUM = {"name": "torch.optim.SGD", "lr": 0.5, "kwargs": {"momentum": 0.9}}


def _save_after_one_step(rank: int, world: int, port: int, par: dict, path: str) -> None:
    sc = {"parallel": par, "optimizer": MOMENTUM}
    worker = PolicyWorker(_cfg(world, sc), rank=rank, world_size=world, master_port=port)
    shard = shard_batch(random_batch(8, 16, rl=True), worker.dims.dp)[worker.dims.dp_index(rank)]
    worker.train(shard, LOSSES["pg_token"]())
    worker.save_checkpoint(path, {"step": 1})


def _resume_and_step(rank: int, world: int, port: int, par: dict, path: str) -> dict | None:
    sc = {"parallel": par, "optimizer": MOMENTUM}
    worker = PolicyWorker(_cfg(world, sc), rank=rank, world_size=world, master_port=port)
    assert worker.load_checkpoint(path) == {"step": 1}
    shard = shard_batch(random_batch(8, 16, rl=True, seed=1), worker.dims.dp)[worker.dims.dp_index(rank)]
    metrics = worker.train(shard, LOSSES["pg_token"]())
    params = worker.full_state_dict()
    return {"metrics": metrics, "params": params} if rank == 0 else None


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_across_a_mesh_change_is_exact(tmp_path):
    """Optimizer state and weights saved on one mesh continue exactly on another: dp=2 <-> tp=2 -> one
    rank; `export_hf` consolidates a tensor-parallel checkpoint."""
    straight = PolicyWorker(policy_cfg(optimizer=MOMENTUM))
    straight.train(random_batch(8, 16, rl=True), LOSSES["pg_token"]())
    after_one = straight.full_state_dict()
    m2 = straight.train(random_batch(8, 16, rl=True, seed=1), LOSSES["pg_token"]())
    expected = {"metrics": m2, "params": straight.full_state_dict()}

    dp2, tp2 = {}, {"tensor_parallel_size": 2}
    run_ranks(2, _save_after_one_step, dp2, str(tmp_path / "dp2"))
    run_ranks(2, _save_after_one_step, tp2, str(tmp_path / "tp2"))
    assert read_metadata(tmp_path / "tp2")["mesh"] == {"dp": 1, "cp": 1, "tp": 2}
    assert read_metadata(tmp_path / "dp2")["mesh"] == {"dp": 2, "cp": 1, "tp": 1}
    exported = load_model(str(export_hf(tmp_path / "tp2", tmp_path / "hf"))).state_dict()  # consolidated
    assert_params_close({k: after_one[k] for k in exported}, exported)
    for saved, par in (("dp2", tp2), ("tp2", dp2), ("tp2", tp2)):
        got = run_ranks(2, _resume_and_step, par, str(tmp_path / saved))[0]
        assert got["metrics"]["loss"] == pytest.approx(m2["loss"], rel=1e-5)
        assert_params_close(expected["params"], got["params"])
    local = PolicyWorker(policy_cfg(optimizer=MOMENTUM))
    local.load_checkpoint(str(tmp_path / "tp2"))
    m_local = local.train(random_batch(8, 16, rl=True, seed=1), LOSSES["pg_token"]())
    assert m_local["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    assert_params_close(expected["params"], local.full_state_dict())


class _Collect:
    """A weight-sync sink that keeps what rank 0 sends (full tensors assembled from the shards)."""

    def __call__(self, weights, rank: int) -> dict:
        got = {n: t.detach().cpu().clone() for n, t in weights}
        return {"tensors": got if rank == 0 else {}}


def _export_sync_comms(rank: int, world: int, port: int, par: dict, out_dir: str) -> dict | None:
    worker = PolicyWorker(_cfg(world, {"parallel": par}), rank=rank, world_size=world, master_port=port)
    batch = random_batch(8, 16, rl=True)
    worker.train(batch, LOSSES["pg_token"]())
    sent = worker.send_weights(_Collect(), version=1)["tensors"]
    worker.save_hf(out_dir)
    before = worker.get_logprobs(batch)
    torn = worker.teardown_comms()
    rebuilt = worker.rebuild_comms()
    metrics = worker.train(batch, LOSSES["pg_token"]())
    if rank:
        return None
    return {"sent": sent, "logprobs": before, "torn": torn, "rebuilt": rebuilt, "metrics": metrics}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("par", [LAYOUTS_2["tp2_sp"], LAYOUTS_2["cp2"]], ids=["tp2_sp", "cp2"])
def test_export_weight_sync_and_comms_rebuild(par, tmp_path):
    """HF export and weight sync send full tensors; communicators (every mesh group) come back after
    teardown and the next step is the step of one rank."""
    got = run_ranks(2, _export_sync_comms, par, str(tmp_path / "hf"))[0]
    ref = PolicyWorker(policy_cfg(optimizer=SGD))
    batch = random_batch(8, 16, rl=True)
    ref.train(batch, LOSSES["pg_token"]())
    full = ref.full_state_dict()
    assert_params_close(full, got["sent"])
    exported = load_model(str(tmp_path / "hf")).state_dict()
    assert_params_close({k: full[k] for k in exported}, exported)
    torch.testing.assert_close(got["logprobs"], ref.get_logprobs(batch), rtol=1e-5, atol=1e-5)
    assert got["torn"]["groups_destroyed"] >= 3 and got["rebuilt"]["groups_created"] >= 3
    m2 = ref.train(batch, LOSSES["pg_token"]())
    assert got["metrics"]["loss"] == pytest.approx(m2["loss"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_policy_on_ray_shards_by_data_parallel_index(ray_session):
    """The driver sends each dp shard to all ranks of that shard and gathers one rank per shard."""
    from posttrain.policy.policy import Policy

    ref = _reference({})
    policy = Policy(
        policy_cfg(
            optimizer=SGD,
            parallel={"tensor_parallel_size": 2},
            microbatch=PADDED,
            cluster={"backend": "ray", "num_workers": 2},
        )
    )
    try:
        batch = random_batch(8, 16, rl=True)
        got = _outcome(policy, batch, policy.train(batch, LOSSES["pg_token"]()))
    finally:
        policy.shutdown()
    assert_same_as_one_rank(ref, got, rows=8)


# ------------------------------------------------------------------ configuration errors


def test_parallel_dims_sizes_and_errors():
    dims = ParallelDims(8, tp=2, cp=2, sequence_parallel=True)
    assert (dims.dp, dims.dp_index(5), dims.dp_leaders()) == (2, 1, [0, 4])
    assert (dims.fsdp_enabled, dims.sp_enabled, dims.sequence_multiple) == (True, True, 4)
    one = ParallelDims(1, sequence_parallel=True)
    assert (one.fsdp_enabled, one.sp_enabled, one.sequence_multiple) == (False, False, 1)
    assert ParallelDims(1, cpu_offload=True).fsdp_enabled and ParallelDims(1, fsdp="always").fsdp_enabled
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=4 x context_parallel_size=1 = 4 does not divide"
    ):
        ParallelDims(6, tp=4)
    with pytest.raises(ValueError, match="fsdp='never' needs a single rank"):
        ParallelDims(2, fsdp="never")
    with pytest.raises(ValueError, match="not divisible by the 2 data-parallel ranks"):
        policy_cfg(
            train_global_batch_size=3,
            parallel={"tensor_parallel_size": 2},
            cluster={"backend": "ray", "num_workers": 4},
        )
    with pytest.warns(UserWarning, match="sequence_parallel=true has no effect"):
        policy_cfg(parallel={"sequence_parallel": True})


def test_tp_that_does_not_divide_the_model_names_the_valid_sizes():
    from posttrain.models.hf import tiny_config

    config = tiny_config(79)  # 4 heads, 2 KV heads, intermediate 128
    check_tp_divides(config, 2)
    with pytest.raises(
        ValueError, match=r"num_key_value_heads=2.*valid tensor_parallel_size values: \[1, 2\]"
    ):
        check_tp_divides(config, 4)
    from posttrain.policy.policy import Policy

    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide"):  # before any rank starts
        Policy(policy_cfg(parallel={"tensor_parallel_size": 4}, cluster={"backend": "ray", "num_workers": 4}))


def test_model_type_without_a_plan_lists_the_supported_ones():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="no plan for model type 'gpt2'.*supported model types: llama"):
        apply_tp(model, tp_mesh=None)


def _tiny_phi(path) -> str:
    """A tiny Phi model (a type without our own plan; its config has a colwise/rowwise tp plan)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "phi", vocab_size=79, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.mark.distributed
@pytest.mark.slow
def test_model_type_with_only_an_hf_plan_uses_it(tmp_path):
    """Phi's own plan, padded and packed; and with LoRA on two of its layers, where the plan's `layers.*`
    patterns also name the layers LoRA left alone."""
    model = {"name": _tiny_phi(tmp_path / "phi"), "tokenizer": "tiny"}
    tp2 = {"tensor_parallel_size": 2}
    some = {
        **LORA["lora"],
        "target_modules": r"model\.layers\.0\.self_attn\.q_proj|model\.layers\.1\.mlp\.fc2",
    }
    scenarios = [
        *({"parallel": tp2, "microbatch": mb, "model": model} for mb in (PADDED, PACKED)),
        {**LORA, "lora": some, "parallel": tp2, "microbatch": PADDED, "model": model},
    ]
    _run_matrix(2, scenarios)


def test_sequence_parallel_needs_a_plan_of_ours(tmp_path):
    from posttrain.models.hf import load_model

    model = load_model(_tiny_phi(tmp_path / "phi"))
    with pytest.raises(ValueError, match="sequence parallelism has no plan for model type 'phi'"):
        apply_tp(model, tp_mesh=None, sequence_parallel=True)


def test_top_k_beyond_the_vocabulary_is_refused():
    worker = PolicyWorker(policy_cfg())
    with pytest.raises(ValueError, match="k must be between 1 and the vocabulary size 79, got 80"):
        worker.get_topk_logits(random_batch(2, 8), 80)
