"""Overlapped decode steps (generation.overlap_decode, generation/decode.py): step t+1 is launched before
the host reads step t. Every request draws what it draws without overlap (tokens, logprobs, finish and
stop reasons), through stop tokens, stop strings, length limits at the end of the context, admission of
more requests than slots, sessions, the asyncio verbs and a failed step; and the order of launches and
reads shows the overlap. On CPU the launch runs at once, so this checks the bookkeeping; the time it
saves is a GPU measurement (benchmarks/decode_profile.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.generation import decode
from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig, SamplingParams
from posttrain.models.hf import build_tiny_model
from posttrain.models.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()
VOCAB = len(TOK)
MAX_LEN = 48


def make_engine(overlap: bool, **cfg) -> GenerationEngine:
    cfg = {"max_num_seqs": 8, "max_model_len": MAX_LEN, **cfg}
    return GenerationEngine(
        build_tiny_model(VOCAB, seed=3), TOK, GenerationConfig(overlap_decode=overlap, **cfg)
    )


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """13 requests for 8 slots: mixed prompt lengths (two end 3 and 1 tokens short of the context),
    stops by token, by string and by length, greedy and sampled rows."""
    g = torch.Generator().manual_seed(7)
    lengths = [3, 9, 5, 14, MAX_LEN - 3, 7, 4, 11, 6, MAX_LEN - 1, 8, 2, 10]
    prompts = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]
    params = []
    for i in range(len(prompts)):
        params.append(
            SamplingParams(
                max_new_tokens=4 + 3 * (i % 5),
                seed=i,
                greedy=i % 4 == 3,
                temperature=1.2,
                stop_token_ids=[5 + i % 3, 40, 41] if i % 3 == 0 else [],
                stop_strings=["mk", "NNN", "x"] if i % 3 == 1 else [],
                stop_at_eos=False,
            )
        )
    return prompts, params


def assert_same(got, want, atol: float = 1e-5) -> None:
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [(r.finish_reason, r.stop_reason) for r in got] == [(r.finish_reason, r.stop_reason) for r in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0)


def test_overlapped_steps_draw_what_plain_steps_draw():
    prompts, params = workload()
    plain, overlapped = make_engine(False), make_engine(True)
    want, got = plain.generate(prompts, params), overlapped.generate(prompts, params)
    assert_same(got, want)
    reasons = {r.finish_reason for r in want} | {type(r.stop_reason) for r in want}
    assert {"stop", "length", int, str} <= reasons  # every stop rule fired
    assert [len(r.token_ids) for r in want][9] == 1  # the prompt one token short of the context
    # the draws of requests that had finished when the next step was launched are dropped, not counted
    assert (
        overlapped.num_generated_tokens == plain.num_generated_tokens == sum(len(r.token_ids) for r in want)
    )
    assert overlapped._pending is None and not overlapped.has_unfinished()
    # again on the same engines (slots reused, the pinned-buffer and pending state reset)
    assert_same(overlapped.generate(prompts[::-1], params[::-1]), plain.generate(prompts[::-1], params[::-1]))


def test_the_next_step_is_launched_before_the_last_is_read(monkeypatch):
    events: list[str] = []
    read = decode.Drawn.read
    monkeypatch.setattr(
        decode.Drawn, "read", lambda self: (events.append(f"read{len(self.requests)}"), read(self))[1]
    )

    def order(overlap: bool) -> list[str]:
        engine = make_engine(overlap)
        launch = engine._launch_decode
        engine._launch_decode = lambda: (events.append("launch"), launch())[1]
        events.clear()
        prompt = torch.arange(4, 10).tolist()
        engine.generate([prompt] * 2, SamplingParams(max_new_tokens=4, seed=0, stop_at_eos=False))
        return list(events)

    # prefill draws token 1 (read at once); decode steps draw tokens 2-4
    assert order(False) == ["read2", "launch", "read2", "launch", "read2", "launch", "read2"]
    # overlapped: each step's draws are read after the next step is launched; the last step (launched
    # before the host knew both requests had finished) is dropped unread
    assert order(True) == ["read2", "launch", "launch", "read2", "launch", "read2", "launch", "read2"]


def test_admission_reads_the_step_in_flight_first():
    """Requests waiting for slots are admitted once slots free up: the step in flight is read before
    the prefill, so a freed slot's new prompt never shares a step with unread draws."""
    prompts, params = workload()
    engine = make_engine(True, max_num_seqs=4, admit_min_free_fraction=0.0)
    prefill = engine._admit

    def admit(due: bool):
        if due and engine._active:
            assert engine._pending is None
        return prefill(due)

    engine._admit = admit
    assert_same(
        engine.generate(prompts, params), make_engine(False, max_num_seqs=4).generate(prompts, params)
    )


def test_sessions_and_asyncio_with_overlap():
    prompts, params = workload()
    keys = [f"s{i}" for i in range(len(prompts))]
    plain, overlapped = make_engine(False), make_engine(True)
    for turn in range(2):
        want = plain.generate(prompts, params, sessions=keys)
        got = asyncio.run(overlapped.agenerate_all(prompts, params, sessions=keys))
        assert_same(got, want)
        prompts = [r.sequence[-(MAX_LEN // 2) :] + [7 + turn] for r in want]  # short enough to go on
    assert overlapped.num_reused_tokens == plain.num_reused_tokens


def test_a_failed_step_loses_no_draw(monkeypatch):
    """A step that fails while another is in flight: the one in flight is read (its requests continue
    from its draws, those it finished are parked for the next step()), so stepping on gives every request
    what it would have drawn."""
    prompts, params = workload()
    want = make_engine(False).generate(prompts, params)
    engine = make_engine(True)
    real, calls = decode.sample, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("device error")
        return real(*args)

    monkeypatch.setattr(decode, "sample", failing)
    with pytest.raises(RuntimeError, match="device error"):
        engine.generate(prompts, params)
    assert engine._pending is None
    got = {r.request_id: r for r in engine.iter_results()}
    assert len(got) == len(prompts)
    assert_same([got[k] for k in sorted(got)], want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_on_the_gpu_with_graphs_of_the_compiled_step():
    """On the GPU the draws go to pinned buffers behind events: the fastest engine (graphs of the
    compiled step, overlapped) draws what the plain eager engine draws."""
    prompts, params = workload()
    plain = make_engine(False, device="cuda")
    fast = make_engine(True, device="cuda", cuda_graphs=True, compile_decode=True)
    assert len(fast._host_buffers) == 2 and all(b.is_pinned() for b in fast._host_buffers)
    assert fast._host_buffers[0][:3].is_contiguous()  # a strided destination would copy via pageable memory
    assert_same(fast.generate(prompts, params), plain.generate(prompts, params), atol=1e-4)
    assert_same(
        fast.generate(prompts[::-1], params[::-1]), plain.generate(prompts[::-1], params[::-1]), atol=1e-4
    )


def test_no_overlap_where_a_finished_row_would_change_the_others():
    """A rotary embedding that follows the longest position a step feeds (dynamic NTK, longrope): a
    finished request's extra step would change the frequencies of the rows beside it, so such models
    decode without overlap (a request stopping at 16, past the switch, beside one that goes on)."""
    config = build_tiny_model(VOCAB, seed=3).config
    config.max_position_embeddings = 16
    config.rope_parameters = {"rope_type": "dynamic", "factor": 16.0, "rope_theta": 10000.0}

    def engine(overlap: bool) -> GenerationEngine:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        return GenerationEngine(
            model, TOK, GenerationConfig(max_model_len=MAX_LEN, max_num_seqs=4, overlap_decode=overlap)
        )

    plain, asked = engine(False), engine(True)
    assert asked._overlap is False and make_engine(True)._overlap is True
    prompts = [list(range(4, 10)), list(range(10, 15))]
    params = [
        SamplingParams(max_new_tokens=11, seed=3, stop_at_eos=False),
        SamplingParams(max_new_tokens=14, seed=4, stop_at_eos=False),
    ]
    assert_same(asked.generate(prompts, params), plain.generate(prompts, params), atol=1e-6)


def test_a_failed_session_save_finishes_its_requests(caplog):
    """Keeping a finished session's keys/values is a cache: where it fails (out of memory), the request
    still leaves its slot and finishes (it stayed there and drew one token too many) and the next turn
    prefills whole."""
    prompts, params = workload()
    keys = [f"s{i}" for i in range(len(prompts))]
    engine = make_engine(True)

    def failing(slots):
        raise torch.OutOfMemoryError("no memory for the session")

    engine._save_sessions = failing
    assert_same(engine.generate(prompts, params, sessions=keys), make_engine(False).generate(prompts, params))
    assert "could not keep the finished sessions" in caplog.text


def test_a_step_in_flight_that_cannot_be_read_takes_its_requests_out(monkeypatch):
    """When a step fails and the one in flight cannot be read either, its requests leave their slots
    (the device is a token ahead of them); the engine then serves new requests as a fresh one does."""
    prompts, params = workload()
    engine = make_engine(True)
    real_sample, real_read, calls = decode.sample, decode.Drawn.read, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device error")
        return real_sample(*args)

    def unreadable(self):
        if len(calls) >= 4:
            raise RuntimeError("cannot read")
        return real_read(self)

    monkeypatch.setattr(decode, "sample", failing)
    monkeypatch.setattr(decode.Drawn, "read", unreadable)
    with pytest.raises(RuntimeError, match="device error"):
        engine.generate(prompts[:5], params[:5])
    assert engine._pending is None and engine.num_running == 0
    monkeypatch.setattr(decode, "sample", real_sample)
    monkeypatch.setattr(decode.Drawn, "read", real_read)
    list(engine.iter_results())  # what finished before the failure
    assert_same(engine.generate(prompts, params), make_engine(False).generate(prompts, params))


@pytest.mark.parametrize("overlap", [False, True])
def test_draws_that_cannot_be_read_take_their_requests_out(monkeypatch, overlap):
    """A read of a step's draws that fails once (the device's buffers have moved on without the host):
    that step's requests leave the engine rather than go on a token short; every other request's result
    is what it would have been."""
    prompts, params = workload()
    want = make_engine(False).generate(prompts, params)
    engine = make_engine(overlap)
    real, reads = decode.Drawn.read, []

    def flaky(self):
        reads.append(len(self.requests))
        if len(reads) == 5:
            raise RuntimeError("read failed")
        return real(self)

    monkeypatch.setattr(decode.Drawn, "read", flaky)
    with pytest.raises(RuntimeError, match="read failed"):
        engine.generate(prompts, params)
    got = {r.request_id: r for r in engine.iter_results()}
    assert 0 < len(got) < len(prompts)  # the unread step's requests are gone
    for rid, result in got.items():
        assert_same([result], [want[rid]])
