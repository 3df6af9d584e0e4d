"""Bucketed decode steps (generation/graphs.py): the padding and buckets on CPU (the eager stand-in of a
graph), the refusals, and on a GPU the replayed graphs against eager decoding."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.generation import graphs
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.graphs import DecodeGraphs, length_bucket, row_bucket
from posttrain.generation.params import GenerationConfig, SamplingParams
from posttrain.models.hf import build_tiny_model
from posttrain.models.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()
VOCAB = len(TOK)


def prompts_of(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def staggered(n: int = 7) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of mixed lengths whose requests stop after 3, 6, 9, ... tokens: the active rows shrink step
    by step through every row bucket, and the attended length grows through several length buckets."""
    prompts = prompts_of([3 + (5 * i) % 11 for i in range(n)])
    params = [SamplingParams(max_new_tokens=3 + 3 * i, seed=i, stop_at_eos=False) for i in range(n)]
    return prompts, params


def test_buckets():
    assert [row_bucket(n, 64) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 64, 64]
    assert row_bucket(40, 48) == 48  # never past the slots
    assert graphs.LENGTH_BUCKET == 256
    assert [length_bucket(n, 1000) for n in (1, 256, 257, 999, 1000)] == [256, 256, 512, 1000, 1000]
    # past 4096 positions the step is an eighth of the power of two: at most 1/8 of padding
    assert [length_bucket(n, 40000) for n in (4095, 4097, 5000, 9000, 33000)] == [
        4096,
        4608,
        5120,
        9216,
        36864,
    ]
    assert len({length_bucket(n, 32768) for n in range(1, 32769)}) == 40


@pytest.mark.parametrize("n", [7, 13])
def test_bucketed_steps_sample_what_plain_steps_sample(monkeypatch, n):
    """Padding rows (free slots at position 0, seeing column 0) and attended lengths rounded up change
    nothing a request draws: same tokens, logprobs within rounding, on every row and length bucket; with
    13 requests for 8 slots, later prompts are admitted into slots that padding rows wrote into."""
    monkeypatch.setattr(graphs, "LENGTH_BUCKET", 8)
    prompts, params = staggered(n)
    cfg = GenerationConfig(max_num_seqs=8, admit_min_free_fraction=0.0)
    expected = GenerationEngine(build_tiny_model(VOCAB, seed=0), TOK, cfg).generate(prompts, params)
    engine = GenerationEngine(build_tiny_model(VOCAB, seed=0), TOK, cfg)
    assert engine._lean is not None
    engine._graphs = bucketed = DecodeGraphs(engine._graph_step, engine._pos, engine.max_len, False)
    seen = []
    step = engine._graph_step
    engine._graph_step = lambda rows, length: (seen.append((rows, length)), step(rows, length))[1]
    bucketed.step = engine._graph_step
    got = engine.generate(prompts, params)
    assert {rows for rows, _ in seen} == {8, 4, 2, 1}  # 7 (or 8) active rows, then fewer
    assert {length for _, length in seen} >= {16, 24, 32}
    assert all(length % 8 == 0 for _, length in seen)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_graphs_are_dropped_when_parameters_or_the_cache_move():
    """Graphs hold addresses: sleep (cache freed, parameters may go to the host), wake and a load that
    re-points parameters (sharing a trainer's tensors, or leaving them) drop them; a copy load, which
    writes in place, keeps them."""
    engine = GenerationEngine(build_tiny_model(VOCAB, seed=0), TOK, GenerationConfig(max_num_seqs=4))
    engine._graphs = DecodeGraphs(engine._graph_step, engine._pos, engine.max_len, False)
    drops = []
    engine._graphs.drop = lambda: drops.append(1)
    weights = build_tiny_model(VOCAB, seed=1).state_dict()
    engine.load_weights(weights, version=1)
    assert drops == []
    engine.sleep()
    engine.wake()
    assert len(drops) == 2
    engine.load_weights(weights, version=2)
    assert len(drops) == 2
    engine.share_weights(weights, version=3)
    shared = len(drops)
    assert shared >= 3  # the parameters now view the given tensors
    engine.share_weights(weights, version=4)  # the same tensors again (GRPO's sync every step)
    assert len(drops) == shared
    engine.load_weights(weights, version=5)  # leaves the shared tensors: re-points every parameter
    assert len(drops) == shared + 1


def test_cuda_graphs_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="needs a CUDA device; this engine is on cpu"):
        GenerationEngine(build_tiny_model(VOCAB, seed=0), TOK, GenerationConfig(cuda_graphs=True))
    config = build_tiny_model(VOCAB, seed=0).config
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    dynamic = AutoModelForCausalLM.from_config(config)  # its rotary decides on the host when to recompute
    with pytest.raises(ValueError, match="llama model has a dynamic rotary embedding"):
        GenerationEngine(dynamic, TOK, GenerationConfig(cuda_graphs=True))
    qwen3 = build_tiny_model(VOCAB, seed=0, family="qwen3")  # q/k norms: not a lean-decoder model
    with pytest.raises(ValueError, match="qwen3 model decodes through transformers' forward"):
        GenerationEngine(qwen3, TOK, GenerationConfig(cuda_graphs=True))
    with pytest.raises(
        ValueError, match="compile_decode covers.*qwen3 model decodes through.*compile_decode=false"
    ):
        GenerationEngine(qwen3, TOK, GenerationConfig(compile_decode=True))


def test_compiled_decode_step_samples_what_the_eager_step_samples():
    """generation.compile_decode (torch.compile of the lean step; on CPU inductor's C++ kernels): the same
    tokens as the eager engine, logprobs within rounding, through shrinking rows and growing lengths
    (the dynamic-shape variant), after a copy load and after a load that re-points the parameters
    (parameters are inputs of the compiled graph, not constants), and from the asyncio stepping thread."""
    prompts, params = staggered()
    greedy = [SamplingParams(max_new_tokens=p.max_new_tokens, greedy=True, stop_at_eos=False) for p in params]

    def engine(compile_decode: bool) -> GenerationEngine:
        model = build_tiny_model(VOCAB, seed=0, family="qwen2")  # q/k/v biases
        return GenerationEngine(model, TOK, GenerationConfig(max_num_seqs=8, compile_decode=compile_decode))

    eager, compiled = engine(False), engine(True)
    assert compiled._decoder is not compiled._lean and compiled._lean.packs is None

    def same(p) -> None:
        a, b = eager.generate(prompts, p), compiled.generate(prompts, p)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)

    same(params)
    same(greedy)
    other = build_tiny_model(VOCAB, seed=1, family="qwen2").state_dict()
    for e in (eager, compiled):
        e.load_weights(other, version=1)
    same(params)
    shared = {k: v.clone() for k, v in build_tiny_model(VOCAB, seed=2, family="qwen2").state_dict().items()}
    for e in (eager, compiled):
        e.share_weights(shared, version=2)  # the parameters now view these tensors
    same(greedy)
    a = eager.generate(prompts, params)
    b = asyncio.run(compiled.agenerate_all(prompts, params))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_graphs_decode_what_eager_steps_decode():
    """On the GPU: graphs replay the eager step (same greedy tokens, logprobs within bf16-free fp32
    rounding); a copy load keeps them and they read the new weights; sleep drops them."""
    prompts, params = staggered()
    greedy = [SamplingParams(max_new_tokens=p.max_new_tokens, greedy=True, stop_at_eos=False) for p in params]

    def engine(cuda_graphs: bool) -> GenerationEngine:
        cfg = GenerationConfig(max_num_seqs=8, device="cuda", cuda_graphs=cuda_graphs, max_model_len=600)
        return GenerationEngine(build_tiny_model(VOCAB, seed=0), TOK, cfg)

    eager, graphed = engine(False), engine(True)
    for p in (params, greedy):
        a, b = eager.generate(prompts, p), graphed.generate(prompts, p)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    captured = graphed._graphs.num_captured
    assert captured == 4 and len(graphed._graphs) == 4  # rows 8, 4, 2, 1 at length 256; reused by greedy
    other = build_tiny_model(VOCAB, seed=1).state_dict()
    for e in (eager, graphed):
        e.load_weights(other, version=1)
    assert len(graphed._graphs) == captured  # a copy load writes in place: the graphs stay valid
    a, b = eager.generate(prompts, greedy), graphed.generate(prompts, greedy)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    graphed.sleep()
    assert len(graphed._graphs) == 0
    graphed.wake()
    assert [r.token_ids for r in graphed.generate(prompts, greedy)] == [r.token_ids for r in a]
    assert graphed._graphs.num_captured > captured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_of_the_compiled_step_decode_what_eager_steps_decode():
    """On the GPU: graphs captured from the compiled step (generation.compile_decode, inductor's Triton
    kernels) replay the eager step: same tokens, logprobs within fp32 rounding, also after a copy load."""
    prompts, params = staggered()
    greedy = [SamplingParams(max_new_tokens=p.max_new_tokens, greedy=True, stop_at_eos=False) for p in params]

    def engine(fast: bool) -> GenerationEngine:
        cfg = GenerationConfig(
            max_num_seqs=8, device="cuda", cuda_graphs=fast, compile_decode=fast, max_model_len=600
        )
        return GenerationEngine(build_tiny_model(VOCAB, seed=0, family="qwen2"), TOK, cfg)

    eager, fast = engine(False), engine(True)
    for p in (params, greedy):
        a, b = eager.generate(prompts, p), fast.generate(prompts, p)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    assert len(fast._graphs) == 4
    other = build_tiny_model(VOCAB, seed=1, family="qwen2").state_dict()
    for e in (eager, fast):
        e.load_weights(other, version=1)
    a, b = eager.generate(prompts, greedy), fast.generate(prompts, greedy)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
