"""Checked weight sync: in-process (copy, share, FSDP gather), across processes (Ray actors over a gloo
group, in buckets), corrupted / stale / partial syncs caught, and the GPU-only paths (CUDA IPC, NCCL,
sleep freeing device memory) behind the `gpu` marker."""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest
import torch

from conftest import random_batch
from helpers import policy_cfg
from posttrain.algorithms.losses import NLLLoss
from posttrain.generation.engine import EngineStateError, GenerationEngine
from posttrain.generation.params import GenerationConfig, SamplingParams
from posttrain.generation.payload import ALIGN, WeightsPayload, pack_tensors, packed_nbytes
from posttrain.generation.probe import WeightSyncError
from posttrain.generation.rollout import model_parts
from posttrain.generation.weight_sync import (
    WeightSync,
    WeightSyncConfig,
    broadcast_weights,
    new_group_info,
    pack_bucket,
    plan_buckets,
    sync_model,
    unpack_bucket,
)
from posttrain.models.hf import TinyModelConfig, build_tiny_model
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy.policy import Policy

TOK = build_char_tokenizer()
VOCAB = len(TOK)
GREEDY = SamplingParams(greedy=True, max_new_tokens=12, stop_at_eos=False)
PROMPTS = [[5, 9, 14, 22], [7], [30, 31, 32, 33, 34, 35, 36], [12, 40]]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def build_engine_parts(seed: int = 77):
    """Model and tokenizer of an engine (weights get replaced by every sync)."""
    return model_parts("tiny", seed)


def fresh_outputs(state: dict[str, torch.Tensor], device: str = "cpu") -> list[list[int]]:
    """Greedy completions of a new engine loaded from `state`: what a correct sync must reproduce."""
    engine = GenerationEngine(*build_engine_parts(), GenerationConfig(device=device))
    engine.load_weights(state, version=0)
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


def train(policy: Policy, steps: int = 2) -> None:
    for s in range(steps):
        policy.train(random_batch(8, 16, seed=s), NLLLoss())


def version_of(policy: Policy) -> int:
    return policy.get_states()[0]["trainer_version"]


# ---------------------------------------------------------------------------- in-process


def test_in_process_copy_sync_after_training():
    policy = Policy(policy_cfg())
    engine = GenerationEngine(*build_engine_parts())
    sync = WeightSync(WeightSyncConfig(), VOCAB)
    sync.sync_local(policy, engine, version_of(policy))
    before = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    train(policy)
    metrics = sync.sync_local(policy, engine, version_of(policy))
    assert metrics["version"] == 2 and engine.weight_version == 2
    assert metrics["probe_max_abs_diff"] < 1e-5 and metrics["probe_mean_abs_diff"] < 1e-6
    after = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in after] == fresh_outputs(policy.full_state_dict())
    assert [r.token_ids for r in after] != before  # training (lr 1e-2) changed the greedy outputs
    assert {r.weight_version for r in after} == {2}


def test_tied_embeddings_are_sent_once_and_the_engine_follows():
    """A tied model's embedding and LM head are one tensor: a sync sends it once (it went twice: two
    gathers, two host copies, twice in a payload), and the engine, tied the same way, scores as the
    trainer after training."""
    tied = {"tie_word_embeddings": True}
    policy = Policy(policy_cfg(model={"tiny": tied}))
    sent = policy.engine_state_dict()
    assert "model.embed_tokens.weight" in sent and "lm_head.weight" not in sent
    streamed: list[str] = []
    policy.send_weights(lambda pairs, rank: streamed.extend(n for n, _ in pairs) or {}, 0)
    assert sorted(streamed) == sorted(sent)
    engine = GenerationEngine(*model_parts("tiny", 77, TinyModelConfig(**tied)))
    sync = WeightSync(WeightSyncConfig(), VOCAB)
    train(policy)
    metrics = sync.sync_local(policy, engine, version_of(policy))
    assert metrics["probe_max_abs_diff"] < 1e-5
    # an untied engine loaded with both names (the full state dict) generates the same
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == fresh_outputs(policy.full_state_dict())


def share_engine(policy) -> GenerationEngine:
    """An engine on the trainer's device (a GPU when there is one): sharing needs the same device."""
    return GenerationEngine(
        *build_engine_parts(), GenerationConfig(device=str(policy.group.workers[0].device))
    )


def test_in_process_share_sync_follows_the_trainer():
    policy = Policy(policy_cfg())
    engine = share_engine(policy)
    sync = WeightSync(WeightSyncConfig(), VOCAB)
    metrics = sync.sync_local(policy, engine, 0, share=True)
    assert metrics["bytes"] == 0.0 and metrics["probe_max_abs_diff"] < 1e-5
    train(policy, steps=1)  # in-place optimizer step on the shared tensors
    metrics = sync.sync_local(policy, engine, version_of(policy), share=True)
    # nothing was re-pointed after a passed probe: the aliasing is the check, the probe is skipped
    assert metrics["probe_skipped"] == 1.0 and "probe_max_abs_diff" not in metrics
    assert engine.weight_version == 1
    assert (
        sync.check(engine.compute_logprobs(sync.probe.sequences), sync.trainer_probe(policy), 1)[
            "probe_max_abs_diff"
        ]
        < 1e-5
    )
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == fresh_outputs(policy.full_state_dict())
    # a later copy-sync must not write into the trainer's tensors
    snapshot = {k: v.clone() for k, v in policy.full_state_dict().items()}
    engine.load_weights(GenerationEngine(*build_engine_parts(seed=5)).model.state_dict(), version=9)
    for k, v in policy.full_state_dict().items():
        torch.testing.assert_close(v, snapshot[k], rtol=0, atol=0)


def test_a_share_that_fails_part_way_still_counts_as_sharing():
    """share_weights refused at its last tensor (a name the model lacks) has already aliased the others:
    the engine must treat itself as sharing, so a later copy-load detaches before writing (never into
    the trainer's tensors) and generation stays refused until a load completes."""
    trainer = build_tiny_model(VOCAB, seed=31)
    engine = GenerationEngine(*build_engine_parts())
    bad = {**trainer.state_dict(), "not.a.weight": torch.zeros(1)}
    with pytest.raises(ValueError):
        engine.share_weights(bad, version=1)
    with pytest.raises(EngineStateError):
        engine.generate(PROMPTS, GREEDY)
    snapshot = {k: v.clone() for k, v in trainer.state_dict().items()}
    other = build_tiny_model(VOCAB, seed=7).state_dict()
    engine.load_weights(other, version=2)
    for k, v in trainer.state_dict().items():
        torch.testing.assert_close(v, snapshot[k], rtol=0, atol=0)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == fresh_outputs(other)


def test_share_sync_probes_again_when_a_tensor_is_re_pointed():
    policy = Policy(policy_cfg())
    engine = share_engine(policy)
    sync = WeightSync(WeightSyncConfig(), VOCAB)
    first = sync.sync_local(policy, engine, 0, share=True)
    assert "probe_skipped" not in first and first["probe_max_abs_diff"] < 1e-5
    model = policy.group.workers[0].model
    weight = next(model.parameters())
    weight.data = weight.data.clone()  # the trainer replaced one parameter's memory
    again = sync.sync_local(policy, engine, 0, share=True)
    assert "probe_skipped" not in again and again["probe_max_abs_diff"] < 1e-5
    assert sync.sync_local(policy, engine, 0, share=True)["probe_skipped"] == 1.0
    # a copy-load in between ends the aliasing: the next share re-points everything and probes
    assert "probe_skipped" not in sync.sync_local(policy, engine, 0)
    assert "probe_skipped" not in sync.sync_local(policy, engine, 0, share=True)
    # another engine is not verified by this one's probe
    other = share_engine(policy)
    assert "probe_skipped" not in sync.sync_local(policy, other, 0, share=True)
    # a bf16-autocast trainer sharing its fp32 weights with an fp32 engine computes differently: the
    # probe keeps measuring that gap on every sync
    mixed = Policy(policy_cfg(precision="bfloat16"))
    loose = WeightSync(WeightSyncConfig(probe={"max_abs_diff": 0.5}), VOCAB)
    for _ in range(2):
        metrics = loose.sync_local(mixed, engine, 0, share=True)
        assert "probe_skipped" not in metrics and 0 < metrics["probe_max_abs_diff"] < 0.5
    # no probe at all: nothing reported as skipped
    off = WeightSync(WeightSyncConfig(probe={"enabled": False}), VOCAB)
    assert "probe_skipped" not in off.sync_local(policy, engine, 0, share=True)
    # recheck_shared probes every shared sync
    always = WeightSync(WeightSyncConfig(probe={"recheck_shared": True}), VOCAB)
    for _ in range(2):
        assert always.sync_local(policy, engine, 0, share=True)["probe_max_abs_diff"] < 1e-5


def test_in_process_sync_gathers_fsdp2_shards():
    policy = Policy(policy_cfg(parallel={"fsdp": "always"}))
    train(policy, steps=1)
    model = policy.group.workers[0].model
    assert any(type(p).__name__ == "DTensor" for p in model.parameters())
    engine = GenerationEngine(*build_engine_parts())
    sync_model(model, engine, version=1)
    sync = WeightSync(WeightSyncConfig(), VOCAB)
    metrics = sync.check(engine.compute_logprobs(sync.probe.sequences), sync.trainer_probe(policy), version=1)
    assert metrics["probe_max_abs_diff"] < 1e-5
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == fresh_outputs(policy.full_state_dict())
    with pytest.raises(ValueError, match="share=True needs unsharded"):
        sync_model(model, engine, version=2, share=True)


def test_corrupted_stale_and_partial_syncs_are_caught():
    policy = Policy(policy_cfg())
    engine = GenerationEngine(*build_engine_parts())
    sync = WeightSync(WeightSyncConfig(), VOCAB)
    stale = {k: v.clone() for k, v in policy.full_state_dict().items()}
    train(policy)
    reference = sync.trainer_probe(policy)

    corrupted = policy.full_state_dict()
    corrupted["model.layers.1.mlp.down_proj.weight"] += 0.05 * torch.randn_like(
        corrupted["model.layers.1.mlp.down_proj.weight"]
    )
    engine.load_weights(corrupted, version=2)
    with pytest.raises(WeightSyncError, match="failed the probe check"):
        sync.check(engine.compute_logprobs(sync.probe.sequences), reference, version=2)

    engine.load_weights(stale, version=2)  # the old weights under the new version number
    with pytest.raises(WeightSyncError, match="version 2"):
        sync.check(engine.compute_logprobs(sync.probe.sequences), reference, version=2)

    partial = dict(list(policy.full_state_dict().items())[1:])
    with pytest.raises(ValueError, match="incomplete weights"):
        engine.load_weights(partial, version=2)
    with pytest.raises(EngineStateError, match="no complete weights"):
        engine.compute_logprobs(sync.probe.sequences)


def test_buckets_are_bounded_and_roundtrip_any_dtype():
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("a", torch.randn(10, 30, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.randint(0, 9, (3, 4), generator=g)),
        ("big", torch.randn(2000, generator=g)),
        ("d", torch.randn(5, 5, generator=g).half()),
    ]
    bound = 2048
    buckets = list(plan_buckets(tensors, bound))
    assert [len(b) for b in buckets] == [3, 1, 1]  # "big" (8000 bytes > bound) travels alone
    out = {}
    for bucket in buckets:
        header, buffer = pack_bucket(bucket, 4, None, torch.device("cpu"))
        assert header.nbytes <= bound or len(bucket) == 1
        out.update({k: v.clone() for k, v in unpack_bucket(header, buffer)})
    for name, t in tensors:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


def test_reused_bucket_buffer_grows_and_offsets_are_aligned():
    small = [("a", torch.randn(3))]
    large = [("b", torch.randn(100)), ("c", torch.randn(7).to(torch.bfloat16))]
    header, buffer = pack_bucket(large, 1, None, torch.device("cpu"))
    assert all(e.offset % ALIGN == 0 for e in header.entries)
    header, again = pack_bucket(small, 2, buffer, torch.device("cpu"))
    assert again is buffer and header.nbytes < buffer.numel()  # kept at its size for the next bucket
    packed, _ = pack_tensors(small, buffer)
    assert packed.data_ptr() == buffer.data_ptr() and packed.numel() == header.nbytes


def test_weights_payload_pickles_as_one_buffer_and_back_exactly():
    """Every dtype (bf16 too), 0-d and non-contiguous tensors, with and without probe logprobs; one
    numpy buffer reused across versions (large enough, larger, too small)."""
    state = {
        "w": torch.randn(3, 4),
        "half": torch.randn(5).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "strided": torch.randn(4, 6)[:, ::2],
        "ids": torch.arange(7),
    }
    for probe in (None, torch.randn(2, 5)):
        back = pickle.loads(pickle.dumps(WeightsPayload(3, state, probe, 0.7)))
        assert (back.version, back.temperature) == (3, 0.7)
        assert back.state.keys() == state.keys()
        for k, v in state.items():
            assert back.state[k].dtype == v.dtype and torch.equal(back.state[k], v), k
        assert probe is None and back.probe_logprobs is None or torch.equal(back.probe_logprobs, probe)
    size = packed_nbytes(state)
    for buffer in (np.empty(size, np.uint8), np.empty(size + 100, np.uint8), np.empty(size // 2, np.uint8)):
        first = pickle.dumps(WeightsPayload(1, state, None, 1.0, buffer))
        doubled = {k: v * 2 for k, v in state.items()}
        second = pickle.dumps(WeightsPayload(2, doubled, None, 1.0, buffer))
        for blob, want in ((first, state), (second, doubled)):
            back = pickle.loads(blob).state
            assert all(torch.equal(back[k], v) for k, v in want.items())


# ---------------------------------------------------------------------------- across processes


@pytest.mark.distributed
def test_sync_to_ray_engine_over_gloo_in_buckets(ray_session):
    """Trainer in one Ray actor, engine in another; this process relays over a gloo group."""
    from posttrain.generation.rollout import RolloutEngine
    from posttrain.generation.weight_sync import WeightSyncGroup

    ray = ray_session
    policy = Policy(policy_cfg(cluster={"backend": "ray", "num_workers": 1}))
    actor_cls = ray.remote(num_cpus=1)(RolloutEngine)
    engine = actor_cls.remote(functools.partial(model_parts, "tiny", 77), GenerationConfig(max_num_seqs=8))
    cfg = WeightSyncConfig(bucket_mb=0.05, timeout_s=60)  # ~50 KB buckets: many of them
    info = new_group_info(1, cfg)
    joined = engine.join_weight_group.remote(info, 1)
    group = WeightSyncGroup(info, 0)
    ray.get(joined, timeout=60)
    sync = WeightSync(cfg, VOCAB)
    try:
        train(policy)
        metrics = sync.sync_remote(policy, [engine], group, version_of(policy))
        assert metrics["probe_max_abs_diff"] < 1e-5 and metrics["bytes"] > 0
        assert ray.get(engine.get_weight_version.remote(), timeout=60) == 2
        remote = ray.get(engine.generate.remote(PROMPTS, GREEDY), timeout=60)
        assert [r.token_ids for r in remote] == fresh_outputs(policy.full_state_dict())

        corrupted = policy.full_state_dict()
        corrupted["model.embed_tokens.weight"][10:20] = 0.0
        pending = engine.receive_weights.remote()
        stats = broadcast_weights(group, corrupted.items(), 3, cfg.bucket_bytes)
        assert stats["buckets"] > 3
        ray.get(pending, timeout=60)
        lp = ray.get(engine.compute_logprobs.remote(sync.probe.sequences), timeout=60)
        with pytest.raises(WeightSyncError, match="version 3"):
            sync.check(lp, sync.trainer_probe(policy), version=3)
    finally:
        ray.kill(engine)
        policy.shutdown()


@pytest.mark.distributed
@pytest.mark.slow
def test_trainer_actor_sends_straight_to_engine_actor(ray_session):
    """Two trainer ranks (FSDP2 over gloo) and one engine, each a Ray actor; rank 0 broadcasts to the
    engine over the sync group while both ranks gather shards (nothing goes through the driver)."""
    from posttrain.generation.rollout import RolloutEngine
    from posttrain.generation.weight_sync import BroadcastSink

    ray = ray_session
    policy = Policy(policy_cfg(cluster={"backend": "ray", "num_workers": 2}))
    engine = ray.remote(num_cpus=1)(RolloutEngine).remote(functools.partial(model_parts, "tiny", 77))
    cfg = WeightSyncConfig(bucket_mb=0.1, timeout_s=60)
    info = new_group_info(1, cfg)
    sync = WeightSync(cfg, VOCAB, dp_size=2)
    try:
        train(policy, steps=1)
        joined = engine.join_weight_group.remote(info, 1)
        sending = policy.group.submit("send_weights", BroadcastSink(info, 1, cfg.bucket_bytes), 1)
        ray.get(joined, timeout=60)  # the group forms once rank 0 of the trainer joins it
        received = engine.receive_weights.remote()
        sent = policy.group.get(sending, "send_weights")
        assert sent[0]["buckets"] > 1 and sent[1]["buckets"] == 0  # only rank 0 sends
        assert ray.get(received, timeout=60)["version"] == 1
        lp = ray.get(engine.compute_logprobs.remote(sync.probe.sequences), timeout=60)
        assert sync.check(lp, sync.trainer_probe(policy), version=1)["probe_max_abs_diff"] < 1e-5
        remote = ray.get(engine.generate.remote(PROMPTS, GREEDY), timeout=60)
        assert [r.token_ids for r in remote] == fresh_outputs(policy.full_state_dict())
    finally:
        ray.kill(engine)
        policy.shutdown()


# ---------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@needs_cuda
def test_a_failed_load_stays_failed_through_sleep_and_wake():
    """On an accelerator, sleep(keep_weights=True) moves the parameters to host memory; it must not
    turn half-loaded weights (a load refused part-way) into valid ones after wake."""
    engine = GenerationEngine(*build_engine_parts(), GenerationConfig(device="cuda", max_num_seqs=16))
    new = build_tiny_model(VOCAB, seed=5).state_dict()
    with pytest.raises(ValueError):
        engine.load_weights(dict(list(new.items())[: len(new) // 2]), version=9)
    engine.sleep(keep_weights=True)
    engine.wake()
    with pytest.raises(EngineStateError):
        engine.generate(PROMPTS, GREEDY)


@pytest.mark.gpu
@needs_cuda
def test_sleep_releases_and_wake_restores_cuda_memory():
    engine = GenerationEngine(*build_engine_parts(), GenerationConfig(device="cuda", max_num_seqs=16))
    before = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    engine.sleep()
    assert torch.cuda.memory_allocated() < used
    engine.wake()
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == before


def _ipc_engine_process(conn) -> None:
    from posttrain.generation.rollout import RolloutEngine

    engine = RolloutEngine(functools.partial(model_parts, "tiny", 77), GenerationConfig(device="cuda"))
    while True:
        bucket = conn.recv()
        conn.send(engine.load_ipc_bucket(bucket))
        if bucket.header.final:
            break
    conn.send([r.token_ids for r in engine.generate(PROMPTS, GREEDY)])


@pytest.mark.gpu
@pytest.mark.distributed
@needs_cuda
def test_cuda_ipc_sync_to_a_colocated_engine_process():
    import torch.multiprocessing as mp

    from posttrain.generation.weight_sync import push_ipc

    model = build_tiny_model(VOCAB, seed=3).cuda()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_engine_process, args=(child,))
    proc.start()
    try:

        def deliver(bucket):
            parent.send(bucket)
            return parent.recv()

        stats = push_ipc(model.state_dict().items(), 5, deliver, 4096, torch.device("cuda"))
        assert stats["bytes"] > 0
        assert parent.recv() == fresh_outputs(model.state_dict(), device="cuda")
    finally:
        proc.join(timeout=60)


def _nccl_receiver(info, conn) -> None:
    from posttrain.generation.rollout import RolloutEngine

    torch.cuda.set_device(1)
    engine = RolloutEngine(functools.partial(model_parts, "tiny", 77), GenerationConfig(device="cuda:1"))
    engine.join_weight_group(info, 1)
    conn.send(engine.receive_weights()["version"])


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_broadcast_sync():
    import torch.multiprocessing as mp

    from posttrain.generation.weight_sync import WeightSyncGroup

    cfg = WeightSyncConfig(backend="nccl", bucket_mb=0.01, timeout_s=60)
    info = new_group_info(1, cfg)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nccl_receiver, args=(info, child))
    proc.start()
    try:
        group = WeightSyncGroup(info, 0)
        model = build_tiny_model(VOCAB, seed=3).cuda()
        broadcast_weights(group, model.state_dict().items(), 7, cfg.bucket_bytes)
        assert parent.recv() == 7.0
    finally:
        proc.join(timeout=60)
