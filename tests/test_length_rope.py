"""Rotary embeddings whose frequencies follow the sequence length (transformers' `longrope`: Phi-3-mini-128k,
Phi-3.5; `dynamic` NTK scaling: Llama family) give every sequence the frequencies of a forward of it alone,
whatever the layout (models/rope.py): micro-batch size, packing, both shared-prefix plans, context and
sequence parallelism, and the engine's scoring. The tiny models switch frequencies past 8 tokens; the
batch's rows (3-token prompts shared by groups of four) fall on both sides of that within each group."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import assert_params_close, policy_cfg
from model_zoo import save_family_model
from posttrain.data import microbatch
from posttrain.data.batch import make_batch, shard_batch
from posttrain.data.microbatch import GroupedRows, SharedPrefix, plan_shared_prefix
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig, SamplingParams
from posttrain.models.hf import build_tiny_model, load_model
from posttrain.models.rope import frequency_key, length_rotaries, per_sequence_rope
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.parallel.processes import run_ranks
from posttrain.policy.worker import PolicyWorker
from test_invariance import LOSSES, SGD

TOK = build_char_tokenizer()
LIMIT = 8  # rows longer than this take the long (longrope) or stretched (dynamic) frequencies
ROPES = {
    "longrope": (
        "phi3",
        {
            "max_position_embeddings": 64,
            "original_max_position_embeddings": LIMIT,
            "rope_scaling": {
                "rope_type": "longrope",
                "long_factor": [1.0, 2.0, 4.0, 8.0],
                "short_factor": [1.0, 1.0, 1.0, 1.0],
            },
        },
    ),
    "dynamic": (
        "llama",
        {"max_position_embeddings": LIMIT, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
    ),
}
PROMPT = 3
LENGTHS = [16, 7, 12, 8, 16, 14, 14, 9]  # rows 0-3 and 4-7 share a prompt
WIDTH = max(LENGTHS)


@pytest.fixture(scope="module")
def rope_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("length_rope")
    return {
        name: str(save_family_model(family, TOK, root / name, seed=1, **overrides))
        for name, (family, overrides) in ROPES.items()
    }


def rope_batch():
    """8 right-padded RL rows of LENGTHS; rows 0-3 and 4-7 start with the same PROMPT tokens."""
    g = torch.Generator().manual_seed(0)
    b = len(LENGTHS)
    lengths = torch.tensor(LENGTHS)
    valid = torch.arange(WIDTH)[None, :] < lengths[:, None]
    ids = torch.randint(4, 70, (b, WIDTH), generator=g)
    for first in (0, 4):
        ids[first : first + 4, :PROMPT] = ids[first, :PROMPT]
    token_mask = valid.float()
    token_mask[:, :PROMPT] = 0
    generation = (-torch.rand(b, WIDTH, generator=g) * 3 - 1) * valid
    return make_batch(
        input_ids=ids * valid,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.tensor([1.0, 1, 1, 1, 1, 0, 1, 1]),
        advantages=torch.randn(b, 1, generator=g).expand(b, WIDTH) * valid,
        generation_logprobs=generation,
        prev_logprobs=generation + 0.05 * torch.randn(b, WIDTH, generator=g) * valid,
        reference_logprobs=generation + 0.1 * torch.randn(b, WIDTH, generator=g) * valid,
    )


def alone(path: str, batch) -> torch.Tensor:
    """[b, t] logprobs of each row run alone through a freshly loaded transformers model."""
    base = load_model(path)
    out = torch.zeros(batch["input_ids"].shape)
    for i, n in enumerate(batch["input_lengths"].tolist()):
        ids = batch["input_ids"][i : i + 1, :n]
        with torch.no_grad():
            logits = copy.deepcopy(base)(input_ids=ids).logits.float()  # a fresh rotary state per row
        out[i, 1:n] = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    return out


# micro-batching of each layout; "plan" is the shared-prefix plan every micro-batch must take
LAYOUTS = {
    "padded_8": {
        "microbatch": {"train_micro_batch_size": 8, "logprob_micro_batch_size": 8, "share_prefix": False}
    },
    "padded_1": {"microbatch": {"train_micro_batch_size": 1, "logprob_micro_batch_size": 1}},
    "padded_3": {
        "microbatch": {"train_micro_batch_size": 3, "logprob_micro_batch_size": 3, "share_prefix": False}
    },
    "packed": {"microbatch": {"mode": "packed", "max_tokens": 40}},
    "grouped": {
        "microbatch": {"train_micro_batch_size": 8, "logprob_micro_batch_size": 8},
        "plan": GroupedRows,
    },
    "two_call": {
        "microbatch": {"train_micro_batch_size": 8, "logprob_micro_batch_size": 8},
        "plan": SharedPrefix,
    },
}


@pytest.fixture
def plans(monkeypatch):
    """`plans(GroupedRows)` / `plans(SharedPrefix)`: every padded micro-batch takes that shared-prefix plan
    (the planner would pick by cost, and skip plans that save less than a quarter of the tokens)."""

    def grouped(data, pad_id=0, force=False, length_key=None):
        g = microbatch._groups(data, length_key)
        return microbatch._grouped_plan(g, data["input_ids"], pad_id, data["input_ids"].shape[1])

    def use(plan) -> None:
        monkeypatch.undo()
        if plan is GroupedRows:
            monkeypatch.setattr(microbatch, "plan_shared_prefix", grouped)
        else:
            monkeypatch.setattr(microbatch, "MIN_SHARED_SAVING", -100.0)
            monkeypatch.setattr(microbatch, "GROUPED_ROW_MAX", 1)

    return use


def _worker(path: str, layout: dict, plans) -> PolicyWorker:
    if "plan" in layout:
        plans(layout["plan"])
    worker = PolicyWorker(policy_cfg(model={"name": path}, optimizer=SGD, microbatch=layout["microbatch"]))
    if "plan" in layout:  # the layout takes the plan it names, and it shares prompts
        for mb in worker._cut(rope_batch(), training=True):
            assert isinstance(mb.shared, layout["plan"])
            rows = mb.shared.input_ids if isinstance(mb.shared, GroupedRows) else mb.shared.prefix_ids
            assert rows.shape[0] < mb.data.batch_size[0]
    return worker


@pytest.mark.parametrize("rope", list(ROPES))
def test_every_layout_scores_each_row_as_its_forward_alone(rope, rope_models, plans):
    """Logprobs and the one-step update of every micro-batch layout; logprobs equal each row's forward
    alone (before the fix: a row took the frequencies of its micro-batch's width or of one call of a
    shared-prefix plan, 0.57 off), the steps equal one another (loss, grad norm, weights)."""
    batch = rope_batch()
    expected = alone(rope_models[rope], batch)
    steps = {}
    for name, layout in LAYOUTS.items():
        worker = _worker(rope_models[rope], layout, plans)
        got = worker.get_logprobs(batch)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        metrics = worker.train(batch, LOSSES["pg_token"]())
        steps[name] = metrics, worker.full_state_dict()
    (m_ref, p_ref) = steps.pop("padded_1")  # each row alone in its micro-batch
    for name, (m, p) in steps.items():
        for k in ("loss", "grad_norm"):
            assert m[k] == pytest.approx(m_ref[k], rel=1e-5, abs=1e-7), (name, k)
        assert_params_close(p_ref, p)


def test_shared_prefix_groups_only_rows_of_the_same_frequencies(rope_models):
    """A prompt shared by rows on both sides of the switch runs once per side (longrope) or once per
    distinct length past it (dynamic); without a key, once."""
    data = rope_batch()
    plain = plan_shared_prefix(data, force=True)
    assert plain.prefix_ids.shape[0] == 2
    for rope, prefixes in (("longrope", 3), ("dynamic", 6)):
        key = frequency_key(load_model(rope_models[rope]))
        plan = plan_shared_prefix(data, force=True, length_key=key)
        assert plan.prefix_ids.shape[0] == prefixes
        rows = plan.prefix_row_lengths[plan.row_prefix]  # every row's frequencies are its prefix's
        assert torch.equal(key(rows), key(data["input_lengths"]))


def test_other_models_keep_their_code_path():
    """A model whose rope does not follow the length: nothing is looked up or wrapped, the lengths are
    never computed and the forward is transformers' own (bit for bit)."""
    model = build_tiny_model(len(TOK))
    assert length_rotaries(model) == () and frequency_key(model) is None
    ids = torch.randint(4, 70, (2, 12))

    def never():
        raise AssertionError("lengths computed for a model that does not need them")

    with torch.no_grad(), per_sequence_rope(model, never):
        assert "forward" not in vars(model.model.rotary_emb)
        inside = model(input_ids=ids).logits
    assert torch.equal(inside, model(input_ids=ids).logits)


@pytest.mark.parametrize("rope", list(ROPES))
def test_the_rotary_module_is_left_as_it_was(rope, rope_models):
    """transformers' dynamic scaling keeps state between calls (a longer call grows its frequencies for
    the calls after it); the per-sequence calls read none of it and leave none behind."""
    model = load_model(rope_models[rope])
    rotary = model.model.rotary_emb
    before = {k: v for k, v in vars(rotary).items() if not k.startswith("_")}, rotary.inv_freq.clone()
    ids = torch.randint(4, 70, (2, WIDTH))
    lengths = torch.tensor([[WIDTH], [LIMIT]]).expand(2, WIDTH)
    with torch.no_grad(), per_sequence_rope(model, lambda: lengths):
        model(input_ids=ids)
    assert "forward" not in vars(rotary)
    assert {k: v for k, v in vars(rotary).items() if not k.startswith("_")} == before[0]
    assert torch.equal(rotary.inv_freq, before[1])


@pytest.mark.parametrize("rope", list(ROPES))
def test_engine_scores_each_sequence_as_its_forward_alone(rope, rope_models):
    """The engine's `compute_logprobs` (the weight-sync probe's side) scores a batch of mixed lengths as
    the trainer does (before the fix: the batch's width chose the frequencies)."""
    batch = rope_batch()
    engine = GenerationEngine(load_model(rope_models[rope]), TOK, GenerationConfig(max_model_len=64))
    sequences = [row[:n].tolist() for row, n in zip(batch["input_ids"], LENGTHS)]
    torch.testing.assert_close(
        engine.compute_logprobs(sequences), alone(rope_models[rope], batch), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("rope", list(ROPES))
def test_engine_samples_what_the_trainer_scores_below_the_switch(rope, rope_models):
    """Sequences that stay within LIMIT tokens: the engine's generation logprobs are the trainer's. (Past
    it they are not: a decode step takes the frequencies of the longest sequence it runs and cached keys
    keep theirs; docs/DESIGN.md.)"""
    engine = GenerationEngine(load_model(rope_models[rope]), TOK, GenerationConfig(max_model_len=64))
    prompts = [[5, 9, 14, 30], [7, 21, 3], [40, 41, 42, 43, 44], [11, 12]]
    params = SamplingParams(temperature=1.0, max_new_tokens=LIMIT - 5, seed=0, stop_at_eos=False)
    results = engine.generate(prompts, params)
    sequences = [p + list(r.token_ids) for p, r in zip(prompts, results)]
    assert max(map(len, sequences)) == LIMIT
    width = max(map(len, sequences))
    batch = make_batch(
        input_ids=torch.tensor([s + [0] * (width - len(s)) for s in sequences]),
        input_lengths=torch.tensor([len(s) for s in sequences]),
    )
    trainer = PolicyWorker(policy_cfg(model={"name": rope_models[rope]})).get_logprobs(batch)
    for i, (p, r) in enumerate(zip(prompts, results)):
        got = torch.tensor(r.logprobs)
        torch.testing.assert_close(got, trainer[i, len(p) : len(p) + len(got)], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ parallel layouts

PARALLEL = [
    ("longrope", {"context_parallel_size": 2}, {"train_micro_batch_size": 3, "logprob_micro_batch_size": 3}),
    ("longrope", {"context_parallel_size": 2}, {"mode": "packed", "max_tokens": 40}),
    ("dynamic", {"context_parallel_size": 2}, {"train_micro_batch_size": 3, "logprob_micro_batch_size": 3}),
    ("dynamic", {"context_parallel_size": 2}, {"mode": "packed", "max_tokens": 40}),
    ("dynamic", {"tensor_parallel_size": 2, "sequence_parallel": True}, {"mode": "packed", "max_tokens": 40}),
    ("dynamic", {"tensor_parallel_size": 2, "sequence_parallel": True}, {"train_micro_batch_size": 3}),
    ("longrope", {}, {"train_micro_batch_size": 4, "logprob_micro_batch_size": 4, "two_call": True}),  # dp=2
]


def _on_ranks(rank: int, world: int, port: int, models: dict, scenarios: list) -> list | None:
    out = []
    for rope, par, mb in scenarios:
        mb = dict(mb)
        if mb.pop("two_call", False):  # every micro-batch on every rank takes the two-call plan
            microbatch.MIN_SHARED_SAVING, microbatch.GROUPED_ROW_MAX = -100.0, 1
        cfg = policy_cfg(
            model={"name": models[rope]},
            optimizer=SGD,
            parallel=par,
            microbatch=mb,
            cluster={"backend": "ray", "num_workers": world},
        )
        worker = PolicyWorker(cfg, rank=rank, world_size=world, master_port=port)
        shard = shard_batch(rope_batch(), worker.dims.dp)[worker.dims.dp_index(rank)]
        before = worker.get_logprobs(shard)
        metrics = worker.train(shard, LOSSES["pg_token"]())
        result = {
            "before": before,
            "metrics": metrics,
            "params": worker.full_state_dict(),
            "logprobs": worker.get_logprobs(shard),
            "topk": worker.get_topk_logits(shard, 3),
        }
        worker.teardown_comms()
        out.append(result if rank == 0 else None)
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_context_and_sequence_parallel_match_one_rank(rope_models):
    """CP=2 (padded and packed), TP=2 with sequence parallelism and dp=2 with two-call shared-prefix plans
    take the one-rank step, and score each row as its forward alone (before the fix: a CP rank took the
    frequencies of its chunk, 2.2 off for longrope, 1.4 for dynamic)."""
    results = run_ranks(2, _on_ranks, rope_models, PARALLEL)[0]
    batch = rope_batch()
    for (rope, par, mb), got in zip(PARALLEL, results):
        ref_worker = PolicyWorker(policy_cfg(model={"name": rope_models[rope]}, optimizer=SGD))
        ref = ref_worker.train(batch, LOSSES["pg_token"]()), ref_worker.full_state_dict()
        rows = got["logprobs"].shape[0]
        where = f"{rope} {par} {mb}"
        for k in ("loss", "grad_norm"):
            assert got["metrics"][k] == pytest.approx(ref[0][k], rel=1e-5, abs=1e-7), (where, k)
        assert_params_close(ref[1], got["params"])
        expected = alone(rope_models[rope], batch)[:rows]  # before the step
        torch.testing.assert_close(
            got["before"], expected, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}"
        )
        torch.testing.assert_close(
            got["logprobs"], ref_worker.get_logprobs(batch)[:rows], rtol=1e-5, atol=1e-5
        )
        values, ids = ref_worker.get_topk_logits(batch, 3)
        torch.testing.assert_close(got["topk"][0], values[:rows], rtol=1e-5, atol=1e-5)
        assert torch.equal(got["topk"][1], ids[:rows]), where


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
def test_an_engine_model_past_the_switch_is_warned_about(rope, rope_models, caplog):
    """Building an engine's model with such a rotary warns, naming the switch-over length: the engine's
    sampled logprobs past it differ from the trainer's (the limit the previous test documents)."""
    from posttrain.policy.config import ModelConfig
    from posttrain.policy.model_init import engine_model

    cfg = ModelConfig(name=rope_models[rope], tokenizer="tiny")
    with caplog.at_level("WARNING"):
        engine_model(cfg, None, TOK)
    assert f"changes frequencies past {LIMIT} tokens" in caplog.text
