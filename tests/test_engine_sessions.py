"""Sessions in the generation engine: a multi-turn conversation keeps its keys/values between turns and
prefills only each turn's new tokens, with the same tokens and logprobs as prefilling every prompt
whole; misses, weight loads, sleep, the LRU bound, the off switch and the asyncio verbs.

All on tiny fp32 models on CPU. A conversation's turn t+1 prompt is its turn-t prompt + completion +
observation tokens, as a multi-turn environment builds it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig, GenerationResult, SamplingParams
from posttrain.models.hf import build_tiny_model
from posttrain.models.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()
VOCAB = len(TOK)
GREEDY = SamplingParams(greedy=True, max_new_tokens=6, temperature=0.8)
SEEDED = SamplingParams(max_new_tokens=7, seed=5, temperature=1.3, top_k=20)


def make_engine(family: str = "llama", seed: int = 3, **cfg) -> GenerationEngine:
    return GenerationEngine(build_tiny_model(VOCAB, seed=seed, family=family), TOK, GenerationConfig(**cfg))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def next_prompt(result: GenerationResult, conversation: int, turn: int) -> list[int]:
    """The conversation's next prompt: what it has so far plus an observation of 1..4 tokens."""
    return result.sequence + tokens(1 + (conversation + turn) % 4, seed=1000 * conversation + turn)


def converse(engine, firsts, params, turns: int = 3, sessions: bool = True) -> list[list[GenerationResult]]:
    """`turns` turns of every conversation (all conversations in one generate() call per turn)."""
    keys = [f"conv{i}" for i in range(len(firsts))] if sessions else None
    prompts, out = firsts, []
    for turn in range(turns):
        results = engine.generate(prompts, params, sessions=keys)
        out.append(results)
        prompts = [next_prompt(r, i, turn) for i, r in enumerate(results)]
    return out


def assert_same(got: list[GenerationResult], want: list[GenerationResult]) -> None:
    assert [r.sequence for r in got] == [r.sequence for r in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def count_extends(engine) -> list[int]:
    """Rows of every continued-prompt forward of `engine`, appended as they run."""
    rows: list[int] = []
    plan = engine.cache.plan_extend
    engine.cache.plan_extend = lambda first, offsets, *a: (
        rows.append(len(offsets)),
        plan(first, offsets, *a),
    )[1]
    return rows


# ---------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("path", ["fast", "generic"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_conversation_with_sessions_equals_prefilling_every_prompt(family, path, params):
    """Four conversations of three turns, continued together (one forward, a different offset per
    row): the same tokens and logprobs (1e-5) as prefilling each prompt whole. The fast path also
    decodes with the lean decoder over the continued slots."""
    firsts = [tokens(n, seed=n) for n in (5, 11, 2, 8)]
    engine = make_engine(family)
    if path == "generic":
        engine._body = engine._lean = None  # the path every other model takes
    else:
        assert engine._lean is not None and engine._body is not None
    extends = count_extends(engine)
    got = converse(engine, firsts, params)
    want = converse(make_engine(family), firsts, params, sessions=False)
    for g, w in zip(got, want):
        assert_same(g, w)
    assert extends == [4, 4]  # turns 2 and 3: all four conversations in one continued forward
    assert engine.num_cached_sessions == 4


def test_only_the_new_tokens_are_prefilled():
    firsts = [tokens(n, seed=n) for n in (6, 3, 9)]
    params = SamplingParams(max_new_tokens=5, seed=1, stop_at_eos=False)
    engine = make_engine()
    turns = converse(engine, firsts, params)
    prompt_lengths = [[len(r.prompt_token_ids) for r in results] for results in turns]
    stored = [[len(r.sequence) - 1 for r in results] for results in turns]  # the last token has no KV
    prefilled = sum(prompt_lengths[0]) + sum(
        p - s for t in (1, 2) for p, s in zip(prompt_lengths[t], stored[t - 1])
    )
    assert engine.num_prefill_tokens == prefilled
    assert engine.num_reused_tokens == sum(stored[0]) + sum(stored[1])
    assert engine.num_session_misses == 3  # the first turns
    plain = make_engine()
    converse(plain, firsts, params, sessions=False)
    assert plain.num_prefill_tokens == sum(map(sum, prompt_lengths)) and plain.num_reused_tokens == 0
    assert engine.num_generated_tokens == plain.num_generated_tokens == 3 * 3 * 5


def test_a_continuation_equals_compute_logprobs_of_the_whole_sequence():
    firsts = [tokens(n, seed=n) for n in (4, 7)]
    params = SamplingParams(max_new_tokens=8, seed=2, temperature=0.7, stop_at_eos=False)
    engine = make_engine()
    last = converse(engine, firsts, params)[-1]
    assert engine.num_reused_tokens > 0
    scored = engine.compute_logprobs([r.sequence for r in last], temperature=0.7)
    for i, r in enumerate(last):
        p = len(r.prompt_token_ids)
        want = scored[i, p : p + len(r.token_ids)]
        torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=1e-5, rtol=0)


def test_a_group_shares_its_first_prefill_and_then_continues_per_session():
    """The G samples of a group start from one prompt (prefilled once, as without sessions), each in a
    session of its own; every sample's next turn continues its own keys/values."""
    first = tokens(7, seed=7)
    engine = make_engine(max_num_seqs=8)
    rows: list[int] = []
    plan = engine.cache.plan_prefill
    engine.cache.plan_prefill = lambda start, n, *a: (rows.append(n), plan(start, n, *a))
    extends = count_extends(engine)
    got = converse(engine, [first] * 4, SEEDED, turns=2)
    want = converse(make_engine(max_num_seqs=8), [first] * 4, SEEDED, turns=2, sessions=False)
    for g, w in zip(got, want):
        assert_same(g, w)
    assert rows == [1] and extends == [4]
    assert len({tuple(r.token_ids) for r in got[0]}) == 4  # own random streams


def test_continuations_near_the_end_of_the_context():
    """Right-padded new parts of one forward: a row whose padding runs past the last cache position
    (clamped there, never read) next to a row with a long new part."""
    engine = make_engine(max_model_len=24)
    params = SamplingParams(max_new_tokens=4, seed=0, stop_at_eos=False)
    first = engine.generate([tokens(16, 1), tokens(3, 2)], params, sessions=["a", "b"])
    prompts = [first[0].sequence + tokens(2, 3), first[1].sequence + tokens(9, 4)]  # 22 and 16 tokens
    extends = count_extends(engine)
    got = engine.generate(prompts, params, sessions=["a", "b"])
    assert extends == [2] and engine.num_reused_tokens == 19 + 6
    assert_same(got, make_engine(max_model_len=24).generate(prompts, params))
    assert got[0].finish_reason == "length" and len(got[0].token_ids) == 2  # the context ends


# ---------------------------------------------------------------------------- misses


def test_a_prompt_that_does_not_extend_the_session_is_prefilled_whole():
    """A miss (the stored ids are not a strict prefix of the prompt) is prefilled whole, with the
    results of an engine that never saw the session; requests without a session are no misses. A
    continued and a fresh request admitted together each take a forward of their own."""
    params = SamplingParams(max_new_tokens=5, seed=3, stop_at_eos=False)
    opening, fresh = tokens(6, 1), tokens(4, 3)
    engine = make_engine()
    (first,) = engine.generate([opening], params)
    stored = first.sequence[:-1]
    edited = first.sequence + tokens(3, 2)
    edited[2] = (edited[2] + 1) % VOCAB  # the history was rewritten
    for key, prompt in enumerate((edited, stored, stored[:4])):  # not a prefix; equal; shorter
        engine.generate([opening], params, sessions=[key])  # the same first turn, stored under `key`
        misses, prefilled = engine.num_session_misses, engine.num_prefill_tokens
        got = engine.generate([prompt, fresh], params, sessions=[key, None])
        assert_same(got, make_engine().generate([prompt, fresh], params))
        assert engine.num_session_misses == misses + 1
        assert engine.num_prefill_tokens == prefilled + len(prompt) + len(fresh)
    assert engine.num_reused_tokens == 0

    engine.generate([opening], params, sessions=["a"])
    extends = count_extends(engine)
    extended = first.sequence + [7]
    got = engine.generate([extended, fresh], params, sessions=["a", None])
    assert extends == [1] and engine.num_reused_tokens == len(stored)
    assert_same(got, make_engine().generate([extended, fresh], params))


def test_end_session_and_clear_sessions():
    engine = make_engine()
    params = SamplingParams(max_new_tokens=3, seed=0)
    results = engine.generate(
        [tokens(5, 1), tokens(6, 2), tokens(4, 3)], params, sessions=["a", "b", ("c", 1)]
    )
    assert engine.num_cached_sessions == 3
    engine.end_session("a")
    engine.end_session("nope")  # no entry: nothing happens
    assert engine.num_cached_sessions == 2
    engine.generate([results[0].sequence + [5]], params, sessions=["a"])
    assert engine.num_session_misses == 4 and engine.num_reused_tokens == 0
    engine.clear_sessions()
    assert engine.num_cached_sessions == 0


def test_bad_session_arguments_give_clear_errors():
    engine = make_engine()
    with pytest.raises(ValueError, match="session key must be hashable"):
        engine.submit([5, 6], session=["a"])
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([[5], [6]], sessions=["a"])
    assert not engine.has_unfinished()


# ---------------------------------------------------------------------------- what drops entries


def test_weight_loads_and_sleep_drop_every_session():
    firsts = [tokens(n, seed=n) for n in (5, 8)]
    params = SamplingParams(max_new_tokens=5, seed=4, stop_at_eos=False)
    keys = ["a", "b"]
    new_weights = build_tiny_model(VOCAB, seed=9).state_dict()
    engine = make_engine()
    first = engine.generate(firsts, params, sessions=keys)
    engine.load_weights(new_weights, version=1)
    assert engine.num_cached_sessions == 0
    prompts = [next_prompt(r, i, 0) for i, r in enumerate(first)]
    second = engine.generate(prompts, params, sessions=keys)  # misses: prefilled whole, new weights
    assert engine.num_session_misses == 4 and engine.num_reused_tokens == 0
    assert_same(second, make_engine(seed=9).generate(prompts, params))
    assert all(r.weight_version == 1 for r in second)

    for keep_weights in (True, False):
        engine.sleep(keep_weights=keep_weights)
        assert engine.num_cached_sessions == 0
        engine.wake()
        if not keep_weights:
            engine.load_weights(new_weights, version=2)
        prompts = [next_prompt(r, i, 1) for i, r in enumerate(second)]
        second = engine.generate(prompts, params, sessions=keys)
        assert_same(second, make_engine(seed=9).generate(prompts, params))
    assert engine.num_session_misses == 8 and engine.num_reused_tokens == 0
    prompts = [next_prompt(r, i, 2) for i, r in enumerate(second)]
    assert_same(
        engine.generate(prompts, params, sessions=keys), make_engine(seed=9).generate(prompts, params)
    )
    assert engine.num_reused_tokens > 0  # and the sessions are kept again


def test_least_recently_used_sessions_are_dropped_beyond_max_cached_sessions():
    engine = make_engine(max_cached_sessions=2)
    params = SamplingParams(max_new_tokens=3, seed=1, stop_at_eos=False)
    last = {}

    def turn(key: str, prompt: list[int] | None = None) -> None:
        prompt = prompt or last[key].sequence + [6]
        (last[key],) = engine.generate([prompt], params, sessions=[key])

    turn("a", tokens(5, 1))
    turn("b", tokens(6, 2))
    turn("a")  # a hit: "a" is now the most recently used
    assert engine.num_session_misses == 2
    turn("c", tokens(4, 3))  # evicts "b", the least recently used
    assert engine.num_cached_sessions == 2
    turn("a")
    assert engine.num_session_misses == 3
    turn("b")
    assert engine.num_session_misses == 4
    none_kept = make_engine(max_cached_sessions=0)
    none_kept.generate([[5, 6]], params, sessions=["x"])
    assert none_kept.num_cached_sessions == 0
    with pytest.raises(ValueError):
        GenerationConfig(max_cached_sessions=-1)


def test_session_kv_reuse_off_stores_nothing_and_prefills_everything():
    firsts = [tokens(n, seed=n) for n in (5, 9)]
    engine = make_engine(session_kv_reuse=False)
    got = converse(engine, firsts, SEEDED)
    assert engine.num_cached_sessions == 0
    assert engine.num_reused_tokens == 0 and engine.num_session_misses == 0
    assert engine.num_prefill_tokens == sum(len(r.prompt_token_ids) for results in got for r in results)
    for g, w in zip(got, converse(make_engine(), firsts, SEEDED)):
        assert_same(g, w)


# ---------------------------------------------------------------------------- asyncio


def test_concurrent_conversations_through_agenerate():
    """Five conversations as coroutines, each awaiting its own turns (so turns of different
    conversations overlap and are admitted in changing company), plus an agenerate_all turn: the
    results of prefilling every prompt whole, with the later turns continued."""
    firsts = [tokens(n, seed=n) for n in (3, 7, 5, 10, 4)]
    params = SamplingParams(max_new_tokens=6, seed=8, stop_at_eos=False)
    want = converse(make_engine(), firsts, params, turns=4, sessions=False)
    engine = make_engine(max_num_seqs=4)

    async def conversation(i: int) -> list[GenerationResult]:
        prompt, out = firsts[i], []
        for turn in range(3):
            out.append(await engine.agenerate(prompt, params, stream_index=i, session=f"conv{i}"))
            prompt = next_prompt(out[-1], i, turn)
        return out

    async def main():
        runs = await asyncio.gather(*(conversation(i) for i in range(len(firsts))))
        prompts = [next_prompt(run[-1], i, 2) for i, run in enumerate(runs)]
        keys = [f"conv{i}" for i in range(len(firsts))]
        return runs, await engine.agenerate_all(prompts, params, sessions=keys)

    runs, fourth = asyncio.run(asyncio.wait_for(main(), 60))
    for turn in range(3):
        assert_same([run[turn] for run in runs], want[turn])
    assert_same(fourth, want[3])
    assert engine.num_session_misses == len(firsts)  # the first turns only
    assert engine.num_reused_tokens == sum(len(r.sequence) - 1 for results in want[:3] for r in results)
