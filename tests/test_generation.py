"""The generation engine: exactness against transformers and the trainer, sampling statistics,
reproducible seeds, stop rules, bad input, continuous batching, the async API and sleep/wake.

All on tiny fp32 models on CPU (a few seconds in total)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from scipy import stats

from helpers import policy_cfg
from posttrain.generation.engine import EngineStateError, GenerationEngine
from posttrain.generation.params import GenerationConfig, SamplingParams
from posttrain.generation.sampler import RowParams, mix64, mix64_tensor, request_key, sample
from posttrain.models.hf import build_tiny_model
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.policy.policy import Policy

TOK = build_char_tokenizer()
VOCAB = len(TOK)


def make_engine(family: str = "llama", seed: int = 0, **cfg) -> GenerationEngine:
    return GenerationEngine(build_tiny_model(VOCAB, seed=seed, family=family), TOK, GenerationConfig(**cfg))


def prompts_of(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos: int) -> list[list[int]]:
    """transformers generate(do_sample=False) on a left-padded batch, cut after the first eos."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
    )
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


# ---------------------------------------------------------------------------- exactness


def generic_path(engine: GenerationEngine) -> GenerationEngine:
    """Turn off the Llama-family fast paths (own LM head, lean decode): the path every other model takes."""
    engine._body = engine._lean = None
    return engine


@pytest.mark.parametrize("path", ["fast", "generic"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_transformers_generate(family, path):
    prompts = prompts_of([5, 1, 12, 3, 9, 7, 2, 11])
    reference = build_tiny_model(VOCAB, seed=3, family=family).eval()
    engine = make_engine(family, seed=3, max_num_seqs=3)  # fewer slots than prompts: continuous batching
    assert engine._lean is not None and engine._body is not None
    if path == "generic":
        generic_path(engine)
    results = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=20))
    expected = hf_greedy(reference, prompts, 20, eos=TOK.eos_token_id)
    assert [r.token_ids for r in results] == expected
    assert [r.prompt_index for r in results] == list(range(len(prompts)))
    for r, e in zip(results, expected):
        assert r.finish_reason == ("stop" if e[-1] == TOK.eos_token_id else "length")


def test_tied_embeddings_greedy_equals_transformers():
    prompts = prompts_of([4, 10, 6])
    reference = build_tiny_model(VOCAB, seed=5, tie_word_embeddings=True).eval()
    engine = GenerationEngine(build_tiny_model(VOCAB, seed=5, tie_word_embeddings=True), TOK)
    results = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12))
    assert [r.token_ids for r in results] == hf_greedy(reference, prompts, 12, eos=TOK.eos_token_id)


@pytest.mark.parametrize("path", ["fast", "generic"])
def test_logprobs_equal_trainer_get_logprobs(path):
    policy = Policy(policy_cfg(logprob_temperature=0.7))
    engine = make_engine(seed=99)  # other weights: the sync below must replace all of them
    if path == "generic":
        generic_path(engine)
    engine.load_weights(policy.full_state_dict(), version=1)
    prompts = prompts_of([3, 8, 5, 12, 1, 6, 9, 4])
    results = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=10, seed=0))
    sequences = [r.sequence for r in results]
    from posttrain.data.batch import make_batch

    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    lengths = torch.tensor([len(s) for s in sequences])
    trainer = policy.get_logprobs(make_batch(input_ids=ids, input_lengths=lengths))
    worst = 0.0
    for i, r in enumerate(results):
        p = len(r.prompt_token_ids)
        got = torch.tensor(r.logprobs)
        want = trainer[i, p : p + len(r.token_ids)]
        worst = max(worst, float((got - want).abs().max()))
    assert worst < 1e-5, worst
    # compute_logprobs (the probe path) follows the trainer's convention on every position
    torch.testing.assert_close(engine.compute_logprobs(sequences, 0.7), trainer, atol=1e-5, rtol=0)
    assert all(r.weight_version == 1 for r in results)


# ---------------------------------------------------------------------------- sampling statistics


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value, merging cells with expected count < 5 into one."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:  # fold a tiny rest cell into the smallest big one
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[exp.argmin()] += counts[~big].sum()
        exp[exp.argmin()] += expected[~big].sum()
    return float(stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_first_token_frequencies_match_softmax(temperature):
    model = build_tiny_model(VOCAB, seed=4)
    prompt = prompts_of([6])[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(logits / temperature, -1)
    engine = GenerationEngine(model, TOK, GenerationConfig(max_num_seqs=256))
    n = 4000
    params = SamplingParams(temperature=temperature, max_new_tokens=1, seed=temperature.as_integer_ratio()[0])
    results = engine.generate([prompt] * n, params)
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=VOCAB)
    assert _chi_square_pvalue(counts, probs) > 1e-3
    # the reported logprob is log softmax(logits / T) of the drawn token
    r = results[0]
    assert abs(r.logprobs[0] - float(probs[r.token_ids[0]].log())) < 1e-5


def _rows(n: int, vocab: int, **params) -> RowParams:
    return RowParams.build(
        [SamplingParams(**params)] * n, [request_key(7, i) for i in range(n)], vocab, "cpu"
    )


@pytest.mark.parametrize(
    "params",
    [{}, {"temperature": 0.8}, {"top_k": 5}, {"top_p": 0.7}, {"top_k": 6, "top_p": 0.8, "temperature": 1.3}],
)
def test_sampler_distribution_on_wide_vocabulary(params):
    """6000 draws over a 1500-token vocabulary (two-level search): chi-square against the (top-k /
    top-p restricted, renormalized) softmax; no excluded token is ever drawn."""
    vocab, n = 1500, 6000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=g) * 3
    rows = _rows(n, vocab, **params)
    tokens, logprobs = sample(logits.expand(n, vocab).clone(), rows, torch.arange(n) % 17)
    probs = torch.softmax(logits / params.get("temperature", 1.0), -1)
    allowed = torch.ones(vocab, dtype=torch.bool)
    order = probs.argsort(descending=True)
    if params.get("top_k"):
        allowed[order[params["top_k"] :]] = False
    restricted = probs * allowed
    restricted /= restricted.sum()
    if params.get("top_p"):
        sorted_p = restricted[order]
        keep = (sorted_p.cumsum(0) - sorted_p) < params["top_p"]
        allowed[order[~keep]] = False
        restricted = probs * allowed
        restricted /= restricted.sum()
    assert bool(allowed[tokens].all()), "an excluded token was drawn"
    counts = torch.bincount(tokens, minlength=vocab)
    assert _chi_square_pvalue(counts[allowed], restricted[allowed]) > 1e-3
    torch.testing.assert_close(logprobs, probs[tokens].log(), atol=1e-5, rtol=0)


def test_sampler_draws_the_tail_of_a_peaked_distribution_over_a_real_vocabulary():
    """Like a trained model's next-token distribution: one token at 0.989, the other 1.1% spread over 32000
    (the two-level search's blocks hold mass near float32's resolution). 40960 draws: the top token and
    the tail (tokens below 1e-3) come out at their probabilities within 4 standard errors."""
    vocab, n, chunk = 32000, 40960, 4096
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(vocab, generator=g) * 1.5
    logits[123] = 16.0
    probs = torch.softmax(logits.double(), -1)
    tail = probs < 1e-3
    top = tail_hits = 0
    for c in range(n // chunk):
        rows = RowParams.build(
            [SamplingParams()] * chunk, [request_key(c, i) for i in range(chunk)], vocab, "cpu"
        )
        tokens, _ = sample(logits.expand(chunk, vocab).clone(), rows, torch.full((chunk,), 3))
        top += int((tokens == 123).sum())
        tail_hits += int(tail[tokens].sum())
    for drawn, p in ((top / n, float(probs[123])), (tail_hits / n, float(probs[tail].sum()))):
        assert abs(drawn - p) < 4 * (p * (1 - p) / n) ** 0.5, (drawn, p)


def test_counter_based_rng_matches_reference_and_is_uniform():
    values = [0, 1, 2**63 - 1, -(2**63), 123456789123, -987654321]
    got = mix64_tensor(torch.tensor(values, dtype=torch.long)).tolist()
    want = [mix64(v & (2**64 - 1)) for v in values]
    assert [g & (2**64 - 1) for g in got] == want
    from posttrain.generation.sampler import uniforms

    u = uniforms(torch.full((20000,), request_key(3, 0)), torch.arange(20000))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3


# ---------------------------------------------------------------------------- seeds, top-k/top-p


def test_seeds_make_draws_reproducible_whatever_the_batch():
    prompts = prompts_of([4, 9, 2, 7, 5])
    params = SamplingParams(temperature=1.2, max_new_tokens=12, seed=11, stop_at_eos=False)
    a = make_engine(max_num_seqs=5).generate(prompts, params)
    b = make_engine(max_num_seqs=2).generate(prompts, params)  # other slots, other batch-mates
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for ra, rb in zip(a, b):
        assert ra.logprobs == pytest.approx(rb.logprobs, abs=1e-5)
    c = make_engine(max_num_seqs=5).generate(prompts, params.model_copy(update={"seed": 12}))
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    # a request alone, submitted with its stream index, draws exactly what it drew in the batch
    alone = make_engine()
    rid = alone.submit(prompts[3], params, stream_index=3)
    (res,) = list(alone.iter_results())
    assert res.request_id == rid and res.token_ids == a[3].token_ids


def _teacher_forced_logits(model, result) -> torch.Tensor:
    seq = torch.tensor([result.sequence])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0]
    p = len(result.prompt_token_ids)
    return logits[p - 1 : p - 1 + len(result.token_ids)]


@pytest.mark.parametrize("params", [{"top_k": 3}, {"top_p": 0.5}, {"top_k": 4, "top_p": 0.6}])
def test_top_k_top_p_never_emit_excluded_tokens(params):
    model = build_tiny_model(VOCAB, seed=6)
    engine = GenerationEngine(build_tiny_model(VOCAB, seed=6), TOK)
    sp = SamplingParams(temperature=2.0, max_new_tokens=16, seed=0, stop_at_eos=False, **params)
    results = engine.generate(prompts_of([3, 6, 2, 8, 5, 4, 7, 1] * 2), sp)
    checked = 0
    for r in results:
        logits = _teacher_forced_logits(model, r) / sp.temperature
        for row, tok in zip(logits, r.token_ids):
            order = row.argsort(descending=True)
            rank = int((order == tok).nonzero())
            if sp.top_k:
                assert rank < sp.top_k
            if sp.top_p < 1:
                top = order[: sp.top_k] if sp.top_k else order
                probs = torch.softmax(row[top], -1)
                before = float(probs[:rank].sum())
                assert before < sp.top_p + 1e-5
            checked += 1
    assert checked == 16 * len(results)


# ---------------------------------------------------------------------------- stop rules


def test_stop_token_stop_string_length_and_context_limit():
    engine = make_engine(seed=2)
    prompt = prompts_of([5])[0]
    free = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=12, stop_at_eos=False))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12

    stop_tok = free.token_ids[4]
    cut = free.token_ids.index(stop_tok) + 1
    r = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=[stop_tok]))[
        0
    ]
    assert (r.token_ids, r.finish_reason, r.stop_reason) == (free.token_ids[:cut], "stop", stop_tok)

    text = TOK.decode(free.token_ids)
    target = text[3:5]
    n = next(i for i in range(1, 13) if target in TOK.decode(free.token_ids[:i]))
    r = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=12, stop_strings=[target]))[0]
    assert (r.token_ids, r.finish_reason, r.stop_reason) == (free.token_ids[:n], "stop", target)

    short = make_engine(seed=2, max_model_len=9)
    r = short.generate([prompt], SamplingParams(greedy=True, max_new_tokens=12, stop_at_eos=False))[0]
    assert (r.token_ids, r.finish_reason) == (free.token_ids[:4], "length")


@pytest.mark.parametrize("source", ["generation_config", "config"])
def test_every_eos_id_of_the_model_stops_a_request(source):
    """Qwen2.5-Instruct and Llama-3-Instruct list two EOS ids in generation_config.json (<|im_end|> and
    <|endoftext|>; <|eot_id|> and <|end_of_text|>): transformers.generate and vLLM stop at either, so
    does the engine, greedy or sampled, with finish reason 'stop'. Also a list in the model config of
    an engine without a tokenizer (every id of it, not its first)."""
    prompts = prompts_of([5, 3, 7, 4])
    model = build_tiny_model(VOCAB, seed=2)
    greedy, sampled = (
        SamplingParams(greedy=True, max_new_tokens=12),
        SamplingParams(max_new_tokens=12, seed=4),
    )
    free = GenerationEngine(model, TOK).generate(prompts, greedy.model_copy(update={"stop_at_eos": False}))
    second = free[0].token_ids[4]  # an id greedy decoding meets mid-completion
    assert second != TOK.eos_token_id and all(TOK.eos_token_id not in r.token_ids for r in free)
    if source == "generation_config":
        model.generation_config.eos_token_id = [TOK.eos_token_id, second]
        engine = GenerationEngine(model, TOK)
        reference = model.generate(  # transformers' own stop rule, from the generation config
            input_ids=torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=12, pad_token_id=0
        )[0, len(prompts[0]) :].tolist()
        assert reference == free[0].token_ids[:5]
    else:
        model.config.eos_token_id = [TOK.eos_token_id, second]
        engine = GenerationEngine(model)
    for params in (greedy, sampled):
        unstopped = engine.generate(prompts, params.model_copy(update={"stop_at_eos": False}))
        results = engine.generate(prompts, params)
        ends = [
            next((i for i, t in enumerate(u.token_ids) if t in (TOK.eos_token_id, second)), None)
            for u in unstopped
        ]
        assert any(e is not None and unstopped[k].token_ids[e] == second for k, e in enumerate(ends))
        for r, u, end in zip(results, unstopped, ends):
            if end is None:
                assert (r.token_ids, r.finish_reason) == (u.token_ids, "length")
            else:
                want = (u.token_ids[: end + 1], "stop", u.token_ids[end])
                assert (r.token_ids, r.finish_reason, r.stop_reason) == want
    assert set(engine.eos_token_ids) == {TOK.eos_token_id, second}


def test_bad_input_gives_clear_errors():
    engine = make_engine(max_model_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]])
    with pytest.raises(ValueError, match="does not fit the context of 16"):
        engine.generate([[5] * 16])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown stop token id 5000"):
        engine.generate([[5, 6]], SamplingParams(stop_token_ids=[5000]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, VOCAB]])
    with pytest.raises(ValueError, match="greedy=True"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([[5], [6]], [SamplingParams()])
    with pytest.raises(ValueError, match="need a tokenizer"):
        GenerationEngine(build_tiny_model(VOCAB)).generate([[5]], SamplingParams(stop_strings=["x"]))
    assert not engine.has_unfinished()  # nothing half-queued by the failed calls


# ---------------------------------------------------------------------------- streaming APIs


def test_step_returns_results_as_they_finish():
    engine = make_engine(max_num_seqs=2)
    lengths = {
        engine.submit(p, SamplingParams(max_new_tokens=m, seed=0, stop_at_eos=False)): m
        for p, m in zip(prompts_of([3, 5, 4, 6]), [9, 2, 5, 1])
    }
    order = [r.request_id for r in engine.iter_results()]
    assert sorted(order) == sorted(lengths)
    assert order.index(1) < order.index(0)  # the 2-token request finished before the 9-token one
    assert engine.num_running == 0 and not engine.has_unfinished()


def test_async_stream_agenerate_and_agenerate_all():
    prompts = prompts_of([4, 6, 3, 5])
    params = [SamplingParams(max_new_tokens=m, seed=5, stop_at_eos=False) for m in (12, 2, 7, 4)]
    expected = make_engine().generate(prompts, params)

    async def main():
        engine = make_engine(max_num_seqs=4)
        streamed = [r async for r in engine.astream(prompts, params)]
        single = await asyncio.gather(
            engine.agenerate(prompts[0], params[0], stream_index=0),
            engine.agenerate(prompts[2], params[2], stream_index=2),
        )
        together = await engine.agenerate_all(prompts, params)
        assert not engine._futures  # nothing left behind
        return streamed, single, together

    streamed, single, together = asyncio.run(asyncio.wait_for(main(), 60))
    assert [r.prompt_index for r in together] == [0, 1, 2, 3]  # prompt order
    assert [r.token_ids for r in together] == [r.token_ids for r in expected]
    assert [r.prompt_index for r in streamed] == [1, 3, 2, 0]  # completion order
    by_index = {r.prompt_index: r for r in streamed}
    assert [by_index[i].token_ids for i in range(4)] == [r.token_ids for r in expected]
    assert [s.token_ids for s in single] == [expected[0].token_ids, expected[2].token_ids]


def test_submit_all_then_step_draws_what_generate_draws():
    """submit_all queues requests as generate would (request k on stream k), in several batches that
    share the engine; step() hands out their results."""
    prompts = prompts_of([4, 6, 3, 5])
    params = [SamplingParams(max_new_tokens=m, seed=5, stop_at_eos=False) for m in (12, 2, 7, 4)]
    expected = make_engine().generate(prompts, params)
    engine = make_engine(max_num_seqs=3)
    first, second = engine.submit_all(prompts[:2], params[:2]), engine.submit_all(prompts, params)
    got = {}
    while engine.has_unfinished():
        got |= {r.request_id: r for r in engine.step()}
    assert [got[i].token_ids for i in first] == [r.token_ids for r in expected[:2]]
    assert [got[i].token_ids for i in second] == [r.token_ids for r in expected]
    assert [got[i].prompt_index for i in second] == [0, 1, 2, 3]
    engine.sleep(keep_weights=False)
    with pytest.raises(EngineStateError, match="asleep"):
        engine.submit_all(prompts, params)


def test_agenerate_all_leaves_nothing_behind_when_cancelled():
    prompts = prompts_of([3, 4, 5, 6, 3, 4])
    params = [SamplingParams(max_new_tokens=2 + i, seed=1, stop_at_eos=False) for i in range(6)]
    expected = make_engine().generate(prompts, params)
    engine = make_engine(max_num_seqs=4)  # two waves, results finishing over several steps

    async def main():
        together = await engine.agenerate_all(prompts, params)
        task = asyncio.ensure_future(engine.agenerate_all(prompts, params))
        await asyncio.sleep(0)  # submitted; its results cannot have been handed over yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        again = await engine.agenerate_all(prompts[:2], params[:2])
        while engine.has_unfinished():  # the cancelled requests still decode; their results are dropped
            await asyncio.sleep(0.005)
        return together, again

    together, again = asyncio.run(asyncio.wait_for(main(), 60))
    assert [r.token_ids for r in together] == [r.token_ids for r in expected]
    assert [r.token_ids for r in again] == [r.token_ids for r in expected[:2]]
    assert not engine._futures and not engine._parked


def test_weights_load_between_requests_while_streaming():
    """load_weights_async pauses admission, lets running sequences finish on the old weights, loads,
    and the waiting requests then run on the new ones (each result says which)."""
    new_state = build_tiny_model(VOCAB, seed=21).state_dict()
    # enough work behind the first result that the stepping thread cannot finish it all before the
    # load pauses admission, even on a loaded machine
    prompts = prompts_of([3, 5, 4, 6, 2, 7] * 4)
    params = SamplingParams(max_new_tokens=6, seed=2, stop_at_eos=False)
    old_expected = make_engine(seed=20).generate(prompts, params)
    new_engine = make_engine(seed=20)
    new_engine.load_weights(new_state, version=5)
    new_expected = new_engine.generate(prompts, params)

    async def main():
        engine = make_engine(seed=20, max_num_seqs=2)
        stream = engine.astream(prompts, params)
        first = await stream.__anext__()  # the engine is now busy with the first requests
        await engine.load_weights_async(new_state, version=5)
        return [first] + [r async for r in stream]

    results = asyncio.run(asyncio.wait_for(main(), 60))
    versions = {r.prompt_index: r.weight_version for r in results}
    assert set(versions.values()) == {0, 5}
    for r in results:
        expected = new_expected if r.weight_version == 5 else old_expected
        assert r.token_ids == expected[r.prompt_index].token_ids


# ---------------------------------------------------------------------------- sleep / wake / weights


def test_sleep_wake_and_dropped_weights():
    engine = make_engine(seed=8)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    prompts = prompts_of([4, 7])
    params = SamplingParams(greedy=True, max_new_tokens=8)
    before = [r.token_ids for r in engine.generate(prompts, params)]
    assert engine.cache.nbytes() > 0
    engine.sleep()
    assert engine.is_sleeping and engine.cache.nbytes() == 0
    with pytest.raises(EngineStateError, match="call wake"):
        engine.generate(prompts, params)
    engine.wake()
    assert [r.token_ids for r in engine.generate(prompts, params)] == before

    released = engine.sleep(keep_weights=False)["bytes_released"]
    assert released >= sum(p.numel() * 4 for p in engine.model.parameters())
    engine.wake()
    with pytest.raises(EngineStateError, match="no complete weights"):
        engine.generate(prompts, params)
    engine.load_weights(state, version=3)
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == before and results[0].weight_version == 3


def test_weight_loading_is_checked():
    engine = make_engine()
    state = make_engine(seed=1).model.state_dict()
    partial = dict(list(state.items())[:-2])
    with pytest.raises(ValueError, match="incomplete weights"):
        engine.load_weights(partial, version=1)
    with pytest.raises(EngineStateError, match="no complete weights"):
        engine.generate([[4, 5]])
    with pytest.raises(ValueError, match="unexpected weight 'foo'"):
        engine.load_weights({"foo": torch.zeros(1)}, version=1)
    bad = dict(state)
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="has shape"):
        engine.load_weights(bad, version=1)
    engine.load_weights(state, version=2)
    assert engine.weight_version == 2 and engine.generate([[4, 5]])[0].weight_version == 2
    engine.submit([4, 5], SamplingParams(max_new_tokens=5))
    engine.step()
    with pytest.raises(EngineStateError, match="sequences are decoding"):
        engine.load_weights(state, version=3)


def test_packed_weights_follow_every_weight_change(monkeypatch):
    """The CPU engine applies the LM head and the lean decoder's projections from packed copies of
    their weights. A copy-load gives what a fresh engine on the same weights gives; shared weights are
    packed only while requests run, so an in-place optimizer step between generate() calls (fused
    AdamW bumps no version counter) is seen; the plain fallback agrees too, and the packed decode
    equals the plain one."""
    import posttrain.generation.lm_head as lm_head_module

    monkeypatch.setattr(lm_head_module, "_PACK_MIN_NUMEL", 0)  # pack even this tiny head
    prompts = prompts_of([4, 7, 3])
    params = SamplingParams(max_new_tokens=8, seed=4, stop_at_eos=False)

    def fresh(state) -> list[list[int]]:
        engine = make_engine()
        engine.load_weights(state, version=1)
        return [r.token_ids for r in engine.generate(prompts, params)]

    engine = make_engine(seed=0)
    packed_run = engine.generate(prompts, params)  # packs the seed-0 head and projections
    layers = engine.model.config.num_hidden_layers
    assert len(engine._head.packs) == 1 + 5 * layers  # head; per layer q|k|v, o, gate, up, down
    engine._head.packs.failed = True  # plain matmuls: the same tokens, logprobs within rounding
    engine._head.drop_packed()
    plain_run = engine.generate(prompts, params)
    engine._head.packs.failed = False
    assert [r.token_ids for r in packed_run] == [r.token_ids for r in plain_run]
    for a, b in zip(packed_run, plain_run):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    new_state = build_tiny_model(VOCAB, seed=30).state_dict()
    engine.load_weights(new_state, version=1)
    assert len(engine._head.packs) == 0
    assert [r.token_ids for r in engine.generate(prompts, params)] == fresh(new_state)

    trainer = build_tiny_model(VOCAB, seed=31)
    shared = make_engine()
    shared.share_weights(trainer.state_dict(), version=1)
    shared.submit(prompts[0], params)
    shared.step()  # shared weights are packed while requests run ...
    assert len(shared._head.packs) == 1 + 5 * layers
    list(shared.iter_results())  # ... and dropped when the engine falls idle
    assert len(shared._head.packs) == 0
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=0.05, fused=True)
    for p in trainer.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # in place, on the tensors the engine aliases
    assert [r.token_ids for r in shared.generate(prompts, params)] == fresh(trainer.state_dict())

    hidden = torch.randn(5, trainer.config.hidden_size)
    engine.load_weights(trainer.state_dict(), version=2)
    expected = trainer.lm_head(hidden).detach()
    torch.testing.assert_close(engine._head(hidden), expected, rtol=0, atol=1e-5)
    assert len(engine._head.packs) == 1
    engine._head.packs.failed = True  # a torch build without oneDNN
    engine._head.drop_packed()
    torch.testing.assert_close(engine._head(hidden), expected, rtol=0, atol=1e-5)


def test_stepping_thread_drops_cancelled_results_and_reports_errors():
    prompts = prompts_of([4, 6])
    params = SamplingParams(max_new_tokens=30, seed=1, stop_at_eos=False)

    async def cancel_one(engine):
        slow = asyncio.ensure_future(engine.agenerate(prompts[0], params))
        fast = engine.agenerate(prompts[1], params.model_copy(update={"max_new_tokens": 2}))
        await asyncio.sleep(0)
        slow.cancel()
        await fast
        while engine.has_unfinished():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # the last delivery reaches the loop

    engine = make_engine()
    asyncio.run(asyncio.wait_for(cancel_one(engine), 60))
    assert engine._parked == [] and engine._futures == {}

    async def failing(engine):
        def boom():
            raise RuntimeError("decode exploded")

        engine._decode = boom
        await engine.agenerate(prompts[0], params)

    with pytest.raises(RuntimeError, match="decode exploded"):
        asyncio.run(asyncio.wait_for(failing(make_engine()), 30))


def family_model(family: str, **overrides):
    """A tiny randomly initialised model of any transformers family (fp32, sdpa, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config = AutoConfig.for_model(family, **(shape | overrides))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_qwen3_uses_the_generic_body_and_still_matches_transformers():
    """Qwen3 normalizes queries and keys per head, which the lean decode step does not do: the engine
    must notice and keep the Hugging Face body (its own LM head still applies)."""
    torch.manual_seed(7)
    model = family_model("qwen3", head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    reference = family_model("qwen3", head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    reference.load_state_dict(model.state_dict())
    engine = GenerationEngine(model, TOK)
    assert engine._lean is None and engine._body is not None
    prompts = prompts_of([4, 9, 6])
    results = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=10))
    assert [r.token_ids for r in results] == hf_greedy(reference, prompts, 10, eos=TOK.eos_token_id)

    gelu = build_tiny_model(VOCAB, seed=0)
    gelu.config.hidden_act = "gelu"
    assert GenerationEngine(gelu, TOK)._lean is None


def test_repeated_prompts_are_prefilled_once_with_the_same_results():
    """GRPO asks for n completions of each prompt: the engine prefills each distinct prompt once and
    copies its keys/values, and every request still gets what it would get prefilled on its own."""
    base = prompts_of([5, 9, 3])
    prompts = [base[0]] * 4 + [base[1]] * 3 + [base[2]] + [base[0]]
    params = SamplingParams(max_new_tokens=12, seed=3, stop_at_eos=False)
    engine = make_engine(max_num_seqs=16)
    prefilled = []
    plan = engine.cache.plan_prefill
    engine.cache.plan_prefill = lambda first, rows, *a: (prefilled.append(rows), plan(first, rows, *a))
    got = engine.generate(prompts, params)
    assert prefilled == [1, 1, 1]  # each distinct prompt once (lengths 9, 5, 3: a forward each)
    alone = make_engine(max_num_seqs=16, max_prefill_tokens=1).generate(prompts, params)  # one per chunk
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    for a, b in zip(got, alone):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)
    assert len({tuple(r.token_ids) for r in got[:4]}) == 4  # own random streams: distinct completions


def test_prompts_of_similar_length_share_a_prefill_forward():
    """A chunk's distinct prompts run longest first, in forwards whose prompts are at least
    PREFILL_MIN_FILL of the forward's longest (little padding), and sample what each would alone."""
    from posttrain.generation.sessions import PREFILL_MIN_FILL, prefill_groups

    assert PREFILL_MIN_FILL == 0.75
    assert prefill_groups([8, 7, 6, 4, 3]) == [(0, 3), (3, 5)]
    assert prefill_groups([40, 31, 30, 29, 12]) == [(0, 3), (3, 4), (4, 5)]  # 30 = 0.75 x 40 stays
    assert prefill_groups([5]) == [(0, 1)] and prefill_groups([]) == []
    with pytest.raises(AssertionError, match="longest prompt first"):
        prefill_groups([3, 5])
    prompts = prompts_of([4, 8, 3, 7, 6])
    params = SamplingParams(max_new_tokens=6, seed=1, stop_at_eos=False)
    engine = make_engine(max_num_seqs=16)
    widths = []
    forward = engine._forward_at
    engine._forward_at = lambda ids, *a: (widths.append(tuple(ids.shape)), forward(ids, *a))[1]
    got = engine.generate(prompts, params)
    assert widths[:2] == [(3, 8), (2, 4)]  # (rows, padded width): 8, 7, 6 then 4, 3
    alone = make_engine(max_num_seqs=16, max_prefill_tokens=1).generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    for a, b in zip(got, alone):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)


def test_prefill_budget_counts_a_repeated_prompt_once():
    """max_prefill_tokens bounds what one prefill forward computes: the distinct prompts padded to the
    longest. Repeats of a prompt ride along for free; a new distinct prompt that overflows starts a chunk."""
    a, b = prompts_of([7, 7])
    engine = make_engine(max_num_seqs=16, max_prefill_tokens=len(a))
    prefilled = []
    plan = engine.cache.plan_prefill
    engine.cache.plan_prefill = lambda first, rows, *a: (prefilled.append(rows), plan(first, rows, *a))
    results = engine.generate([a] * 8 + [b] * 8, SamplingParams(max_new_tokens=2, seed=0))
    assert prefilled == [1, 1]  # two forwards of one distinct row each, admitting 8 requests each
    assert [r.prompt_token_ids for r in results] == [a] * 8 + [b] * 8


def test_finished_slots_are_refilled_in_batches_with_the_same_results():
    """While sequences decode, waiting prompts enter once a quarter of the slots is free (or every
    waiting prompt fits, or after admit_max_delay_steps steps): a trickle of finished sequences does not
    cost a prefill forward each. Each request still draws exactly what it draws admitted at once."""
    prompts = prompts_of([3 + i % 5 for i in range(24)], seed=4)
    # staggered lengths: request i stops after 2 + i % 7 tokens
    params = [SamplingParams(max_new_tokens=2 + i % 7, seed=i, stop_at_eos=False) for i in range(24)]

    def run(**cfg) -> tuple[list, list[int]]:
        engine = make_engine(max_num_seqs=8, **cfg)
        admitted: list[int] = []  # prompts per admission (a chunk may run as several forwards)
        prefill = engine._prefill
        engine._prefill = lambda chunk: (admitted.append(len(chunk)), prefill(chunk))[1]
        return engine.generate(prompts, params), admitted

    at_once, eager = run(admit_min_free_fraction=0.0)
    batched, lazy = run(admit_min_free_fraction=0.5)
    late, capped = run(admit_min_free_fraction=1.0, admit_max_delay_steps=1)
    assert sum(eager) == sum(lazy) == sum(capped) == 24
    assert len(lazy) < len(eager)
    assert min(lazy[1:-1]) >= 4  # refills wait for half of the 8 slots (the last takes what is left)
    for got in (batched, late):
        assert [r.token_ids for r in got] == [r.token_ids for r in at_once]
        for a, b in zip(got, at_once):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert GenerationConfig().admit_min_free_fraction == 0.25


def test_a_waiting_prompt_is_admitted_after_admit_max_delay_steps():
    """Prompts that find fewer free slots than admit_min_free_fraction asks (and more prompts waiting
    than slots free) wait at most admit_max_delay_steps decode steps for more slots to free up."""
    prompts = prompts_of([4, 5, 6, 3, 4, 5], seed=5)
    engine = make_engine(max_num_seqs=4, admit_min_free_fraction=1.0, admit_max_delay_steps=3)
    for p in prompts[:3]:
        engine.submit(p, SamplingParams(max_new_tokens=30, seed=0, stop_at_eos=False))
    engine.submit(prompts[3], SamplingParams(max_new_tokens=1, seed=0, stop_at_eos=False))
    assert len(engine.step()) == 1  # all four admitted into the idle engine; the short one is done
    late = [
        engine.submit(p, SamplingParams(max_new_tokens=1, seed=1, stop_at_eos=False)) for p in prompts[4:]
    ]
    steps, done = 0, []
    while not any(r.request_id == late[0] for r in done):
        done += engine.step()
        steps += 1
        assert steps < 10
    assert steps == 4  # one slot free, two prompts waiting: three steps of waiting, then admitted
    done += engine.iter_results()
    assert len(done) == 5 and set(late) <= {r.request_id for r in done}


def test_requests_gathered_in_one_loop_turn_are_admitted_together():
    prompt = prompts_of([6])[0]
    params = [SamplingParams(max_new_tokens=5, seed=i, stop_at_eos=False) for i in range(6)]
    engine = make_engine(max_num_seqs=8)
    prefilled = []
    plan = engine.cache.plan_prefill
    engine.cache.plan_prefill = lambda first, rows, *a: (prefilled.append(rows), plan(first, rows, *a))

    async def main():
        return await asyncio.gather(*(engine.agenerate(prompt, p) for p in params))

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert prefilled == [1] and engine.num_generated_tokens == 30  # one prefill row, six streams
    assert len({tuple(r.token_ids) for r in results}) == 6


def test_an_engine_serves_one_event_loop_after_another():
    """asyncio.run() twice on one engine (a Ray actor's loop restarted, or a script calling asyncio.run
    per phase): the second loop gets its results even if the first one ended with work in flight."""
    prompts = prompts_of([4, 6, 5])
    params = SamplingParams(max_new_tokens=6, seed=2, stop_at_eos=False)
    expected = [r.token_ids for r in make_engine().generate(prompts, params)]
    engine = make_engine()

    async def abandon():  # leaves a long request in flight when the loop ends
        asyncio.ensure_future(engine.agenerate(prompts[0], params.model_copy(update={"max_new_tokens": 40})))
        await asyncio.sleep(0)

    async def run_all():
        return await asyncio.gather(
            *(engine.agenerate(p, params, stream_index=i) for i, p in enumerate(prompts))
        )

    asyncio.run(abandon())
    for _ in range(2):
        results = asyncio.run(asyncio.wait_for(run_all(), 30))
        assert [r.token_ids for r in results] == expected


def test_sync_calls_after_async_use_neither_hang_nor_lose_results():
    """A stepping thread left idle by the last asyncio.run must not steal (and drop) the results of a
    blocking generate() or of submit()-ed requests; a cancelled waiter whose loop has closed does not
    block generate(); a failing step() keeps the parked results."""
    prompts = prompts_of([4, 6, 5, 3])
    params = SamplingParams(max_new_tokens=40, seed=2, stop_at_eos=False)
    engine = make_engine()
    expected = [r.token_ids for r in make_engine().generate(prompts, params)]

    async def one():
        return await engine.agenerate(prompts[0], params)

    async def abandon():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.agenerate(prompts[1], params), 0.001)

    asyncio.run(one())  # the stepping thread now idles for a while
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    asyncio.run(abandon())
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected

    ids = [engine.submit(p, params, stream_index=i) for i, p in enumerate(prompts)]
    got = {r.request_id: r.token_ids for r in engine.iter_results()}
    assert [got[i] for i in ids] == expected

    rid = engine.submit(prompts[2], SamplingParams(max_new_tokens=1, stop_at_eos=False))
    engine.generate([prompts[3]], SamplingParams(max_new_tokens=3))  # rid finishes: parked
    engine.sleep()
    with pytest.raises(EngineStateError, match="asleep"):
        engine.step()
    engine.wake()
    assert [r.request_id for r in engine.step()] == [rid]


def test_a_step_callers_step_hands_asyncio_results_to_their_waiters_never_to_itself(monkeypatch):
    """A cancelled agenerate's request decodes on; when a generate() caller's step finishes it, its
    result is dropped, neither returned nor parked for the next step() caller (who never submitted it,
    and whose bookkeeping breaks on a foreign id). An asyncio request finished by a step() caller's
    step goes to its waiter. No stepping thread here (_ensure_driver switched off): the blocking
    caller's steps are the only ones."""
    prompts = prompts_of([4, 6, 5])
    params = SamplingParams(max_new_tokens=5, seed=2, stop_at_eos=False)
    expected = [r.token_ids for r in make_engine().generate(prompts, params)]
    engine = make_engine()
    monkeypatch.setattr(engine, "_ensure_driver", lambda: None)

    async def abandon():
        task = asyncio.ensure_future(engine.agenerate(prompts[0], params))
        await asyncio.sleep(0)  # queued
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(abandon())
    assert engine.has_unfinished()  # the cancelled request still waits to run
    mine = engine.generate([prompts[1]], params.model_copy(update={"max_new_tokens": 20}))
    assert len(mine) == 1 and not engine.has_unfinished()  # generate's steps finished the other one too
    assert engine._parked == [] and list(engine.iter_results()) == [] and not engine._async_ids

    def drain() -> list:
        out = []
        while engine.has_unfinished():
            out += engine.step()
        return out

    async def waited():
        fut = asyncio.ensure_future(engine.agenerate(prompts[2], params, stream_index=2))
        await asyncio.sleep(0)
        stepped = await asyncio.to_thread(drain)
        return stepped, await fut

    stepped, result = asyncio.run(asyncio.wait_for(waited(), 30))
    assert stepped == [] and result.token_ids == expected[2]
    assert not engine._async_ids and not engine._futures and engine._parked == []


def test_a_failed_asyncio_request_leaves_nothing_in_the_engine():
    """An asyncio request is refused at the call, and not queued, while the engine cannot run (asleep,
    weights incomplete); a step that fails fails its asyncio waiters and takes their requests out (waiting or
    decoding): none is left for a later generate() to run, for load_weights()/sleep() to wait on or for
    a later step() to fail in. A submit()-ed request stays for step()."""
    prompts = prompts_of([4, 6, 5, 3])
    params = SamplingParams(max_new_tokens=12, seed=2, stop_at_eos=False)
    expected = [r.token_ids for r in make_engine().generate(prompts, params)]
    engine = make_engine(max_num_seqs=2)  # two of the three asyncio requests decode, one waits
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}

    async def stream():
        return [r async for r in engine.astream(prompts, params)]

    async def refused():
        for call in (engine.agenerate(prompts[0], params), engine.agenerate_all(prompts, params), stream()):
            with pytest.raises(EngineStateError, match="asleep"):
                await call

    engine.sleep()
    with pytest.MonkeyPatch.context() as mp:  # refused at the call: no stepping thread needed to fail it
        mp.setattr(engine, "_ensure_driver", lambda: None)
        asyncio.run(asyncio.wait_for(refused(), 30))
    engine.wake()
    assert not engine.has_unfinished() and not engine._async_ids
    engine.load_weights(state, version=1)

    steps, real_decode = [], engine._decode

    def failing_decode():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("decode exploded")
        return real_decode()

    engine._decode = failing_decode
    rid = engine.submit(prompts[3], params, stream_index=3)

    async def failing():
        with pytest.raises(RuntimeError, match="decode exploded"):
            await engine.agenerate_all(prompts[:3], params)

    asyncio.run(asyncio.wait_for(failing(), 30))
    engine._decode = real_decode
    assert not engine._async_ids and not engine._futures
    assert [r.request_id for r in [*engine._waiting, *engine._active]] == [rid]  # the submit()-ed one
    assert [(r.request_id, r.token_ids) for r in engine.iter_results()] == [(rid, expected[3])]
    engine.load_weights(state, version=2)  # nothing decoding
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    assert engine._parked == [] and list(engine.iter_results()) == []


def test_asyncio_requests_a_failed_clean_up_leaves_behind_stay_theirs():
    """A failed step whose clean-up fails too (the slots cannot be released): the requests it could not
    take out keep their asyncio ids, so when a step() caller later finishes them, their results go to
    their own (failed) side, never to that caller."""
    prompts = prompts_of([4, 6, 5])
    params = SamplingParams(max_new_tokens=6, seed=2, stop_at_eos=False)
    engine = make_engine(max_num_seqs=2)
    steps, real_decode, real_release = [], engine._decode, engine._release

    def failing_decode():
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("decode exploded")
        return real_decode()

    def failing_release(slots):
        raise RuntimeError("release exploded")

    engine._decode, engine._release = failing_decode, failing_release

    async def failing():
        with pytest.raises(RuntimeError, match="decode exploded"):
            await engine.agenerate_all(prompts, params)

    asyncio.run(asyncio.wait_for(failing(), 30))
    engine._decode, engine._release = real_decode, real_release
    left = {r.request_id for r in engine._active}
    assert left and left <= engine._async_ids  # the decoding ones stayed, still asyncio requests
    handed = []
    while engine.has_unfinished():
        handed += engine.step()
    assert handed == [] and list(engine.iter_results()) == []


def test_mistral_sliding_window_shorter_than_the_context_is_windowed():
    """Mistral configs set `sliding_window` without a `use_sliding_window` flag: a window shorter than
    the engine's context is applied (ring buffers of the window, no lean decoder; exactness in
    tests/test_engine_windows.py), not silently treated as full attention."""
    model = family_model("mistral", num_hidden_layers=1, sliding_window=16)
    engine = GenerationEngine(model, TOK, GenerationConfig(max_model_len=64))
    assert engine.cache.capacities == [16] and engine._lean is None
    assert GenerationEngine(model, TOK, GenerationConfig(max_model_len=16))._lean is not None


def test_a_config_of_another_vocabulary_adds_no_eos_id():
    """A model config or generation config whose EOS list lacks the tokenizer's EOS is another
    vocabulary's (a tiny model's config says 2 while a real tokenizer's EOS is, e.g., 151645): its ids
    are ordinary tokens here and stop nothing; a list that holds it adds its other ids."""
    from types import SimpleNamespace

    from posttrain.generation.requests import eos_token_ids

    model = build_tiny_model(VOCAB, seed=2)
    model.config.eos_token_id = 2
    model.generation_config.eos_token_id = [2, 9]
    assert eos_token_ids(SimpleNamespace(eos_token_id=40), model) == (40,)
    model.generation_config.eos_token_id = [40, 9]
    assert eos_token_ids(SimpleNamespace(eos_token_id=40), model) == (40, 9)
    assert eos_token_ids(None, model) == (2, 40, 9)
