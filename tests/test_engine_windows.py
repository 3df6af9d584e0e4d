"""The generation engine on models with sliding-window attention, soft-capping and attention sinks:
Mistral (every layer windowed), Qwen2 (full layers, then windowed ones), Gemma2 (alternating layers,
attention and final-logit soft-capping, query_pre_attn_scalar), Gemma3 text (its own layer pattern,
a local rope for windowed layers) and gpt-oss (alternating layers, attention sinks, MoE experts).

Windows of 4-6 tokens under prompts of 2-12 tokens plus 20 drawn ones, so every window cuts: greedy
tokens equal transformers' `generate`, logprobs equal a full transformers forward (1e-5), a session
continued from its kept keys/values equals prefilling the whole prompt, and a windowed layer's KV
buffers hold `window` positions per slot. Tiny fp32 random-weight models on CPU."""

from __future__ import annotations

import pytest
import torch

from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig, SamplingParams

VOCAB = 61
MAX_LEN = 64
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.2,
)  # fmt: skip
FAMILIES = {
    "mistral": dict(sliding_window=5),
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=2),
    "gemma2": dict(
        sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=16
    ),
    "gemma3_text": dict(sliding_window=6, sliding_window_pattern=2, query_pre_attn_scalar=16),
    "gpt_oss": dict(
        sliding_window=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),  # fmt: skip
}
LAYER_WINDOWS = {  # the window of each layer (None: full attention), as the configs above lay them out
    "mistral": [5, 5, 5, 5],
    "qwen2": [None, None, 6, 6],
    "gemma2": [4, None, 4, None],
    "gemma3_text": [6, None, 6, None],
    "gpt_oss": [4, None, 4, None],
}
LENGTHS = [3, 12, 7, 12, 2, 9]  # prompts 1 and 3 are equal: prefilled once, the repeat copies its slots
STEPS = [20, 14, 20, 9, 17, 20]  # unequal: slots free at different steps and the rest are compacted


def build(family: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.families import attn_implementation

    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # eager for Gemma2's attention soft-capping: transformers 5.17 runs it under SDPA without the
        # capping (the reference would be off by 0.1 in logprob), 5.24 refuses SDPA for it
        return AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation(config)
        ).eval()


def make_engine(family: str, **cfg) -> GenerationEngine:
    return GenerationEngine(build(family), None, GenerationConfig(max_model_len=MAX_LEN, **cfg))


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    out[3] = out[1]
    return out


def hf_greedy(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """transformers generate(do_sample=False) on a left-padded batch (no eos)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], attn[i, width - len(p) :] = torch.tensor(p), 1
    out = model.generate(
        input_ids=ids, attention_mask=attn, do_sample=False, max_new_tokens=steps, pad_token_id=0
    )
    return out[:, width:].tolist()


def hf_logprobs(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Logprob of token t given tokens < t (t >= 1) of each sequence, from one full forward each."""
    out = []
    for s in sequences:
        ids = torch.tensor([s])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1]
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def per_prompt(steps: list[int]) -> list[SamplingParams]:
    return [SamplingParams(greedy=True, max_new_tokens=n, stop_at_eos=False) for n in steps]


# ---------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_generate(family):
    """Unequal prompts (some longer than the window), fewer slots than prompts, unequal lengths to
    draw: the engine's greedy tokens equal transformers' token for token."""
    prompts = prompts_of(LENGTHS)
    engine = make_engine(family, max_num_seqs=4)
    assert engine._lean is None  # the lean decoder attends over every cached position
    results = engine.generate(prompts, per_prompt(STEPS))
    expected = hf_greedy(build(family), prompts, max(STEPS))
    assert [r.token_ids for r in results] == [e[:n] for e, n in zip(expected, STEPS)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logprobs_equal_a_full_forward(family):
    """Sampled tokens' logprobs (and compute_logprobs) equal a full transformers forward over prompt +
    completion, final-logit soft-capping included (Gemma2: without it they would differ)."""
    prompts = prompts_of(LENGTHS, seed=2)
    engine = make_engine(family, max_num_seqs=4)
    params = SamplingParams(max_new_tokens=20, seed=7, temperature=1.0, stop_at_eos=False)
    results = engine.generate(prompts, params)
    want = hf_logprobs(build(family), [r.sequence for r in results])
    for r, w in zip(results, want):
        torch.testing.assert_close(
            torch.tensor(r.logprobs), w[len(r.prompt_token_ids) - 1 :], atol=1e-5, rtol=0
        )
    scored = engine.compute_logprobs([r.sequence for r in results])
    for i, w in enumerate(want):
        torch.testing.assert_close(scored[i, 1 : len(w) + 1], w, atol=1e-5, rtol=0)
    if family == "gemma2":
        uncapped = hf_logprobs(build(family, final_logit_softcapping=None), [results[0].sequence])[0]
        assert (uncapped - want[0]).abs().max() > 1e-2


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_session_continued_equals_prefilling_the_whole_prompt(family):
    """Three turns of four conversations: continuing each from its kept keys/values (ring buffers
    included, rows at different offsets in one forward, new parts of 2 to 11 tokens, so some longer
    than the window) gives the tokens and logprobs (1e-5) of
    prefilling every prompt whole."""
    firsts = prompts_of([5, 11, 2, 8], seed=3)
    firsts[3] = firsts[3][:8]
    params = SamplingParams(max_new_tokens=7, seed=5, temperature=1.3, top_k=20, stop_at_eos=False)
    runs = {}
    for sessions in (True, False):
        engine, prompts, out = make_engine(family, max_num_seqs=4), firsts, []
        keys = [f"conv{i}" for i in range(len(firsts))] if sessions else None
        for turn in range(3):
            results = engine.generate(prompts, params, sessions=keys)
            out.append(results)
            prompts = [
                r.sequence + prompts_of([1 + 3 * ((i + turn) % 4)] * 4, seed=10 + turn)[i]
                for i, r in enumerate(results)
            ]
        runs[sessions] = (engine, out)
    (engine, kept), (_, whole) = runs[True], runs[False]
    assert engine.num_reused_tokens > 0 and engine.num_session_misses == len(firsts)  # the first turn
    for got, want in zip(kept, whole):
        assert [r.sequence for r in got] == [r.sequence for r in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    entry = engine._sessions.match("conv1", kept[-1][1].sequence + [3])
    for kv, window in zip(entry.kv, LAYER_WINDOWS[family]):  # a kept windowed layer holds its window
        assert kv.shape[2] == (window or len(entry))


# ---------------------------------------------------------------------------- memory


@pytest.mark.parametrize("family", list(FAMILIES))
def test_windowed_layers_keep_window_positions_per_slot(family):
    engine = make_engine(family, max_num_seqs=4)
    engine.generate(prompts_of(LENGTHS), per_prompt(STEPS))
    for layer, window in enumerate(LAYER_WINDOWS[family]):
        for buffer in (engine.cache.keys[layer], engine.cache.values[layer]):
            assert buffer.shape == (4, 2, window or MAX_LEN, 8)
    per_position = 2 * 4 * 2 * 8 * 4  # keys and values, slots, kv heads, head dim, fp32
    full = per_position * MAX_LEN * 4
    assert engine.cache.nbytes() == per_position * sum(w or MAX_LEN for w in LAYER_WINDOWS[family])
    assert engine.cache.nbytes() < full


def test_a_window_as_long_as_the_context_keeps_the_lean_path():
    """A window that cuts nothing at max_model_len is full attention: full buffers, the lean decoder."""
    engine = GenerationEngine(
        build("mistral", sliding_window=MAX_LEN), None, GenerationConfig(max_model_len=MAX_LEN)
    )
    assert engine._lean is not None and engine.cache.capacities == [MAX_LEN] * 4


# ---------------------------------------------------------------------------- attention implementation


def test_soft_capping_under_sdpa_runs_eager():
    """sdpa has no soft-capping: a Gemma3 asking for it runs eager attention in the engine, exactly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma3_text", **{**COMMON, **FAMILIES["gemma3_text"]}, attn_logit_softcapping=2.0
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    engine = GenerationEngine(model, None, GenerationConfig(max_model_len=MAX_LEN))
    assert engine.model.config._attn_implementation == "eager"
    prompts = prompts_of(LENGTHS)[:3]
    results = engine.generate(prompts, per_prompt([15] * 3))
    assert [r.token_ids for r in results] == hf_greedy(reference.eval(), prompts, 15)


# ---------------------------------------------------------------------------- refusals


def test_unsupported_layer_types_and_bidirectional_attention_are_refused():
    model = build("gemma2")
    model.config.layer_types = ["sliding_attention", "full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\].*'full_attention'"):
        GenerationEngine(model, None, GenerationConfig(max_model_len=MAX_LEN))
    model = build("gemma3_text")
    model.config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention=False"):
        GenerationEngine(model, None, GenerationConfig(max_model_len=MAX_LEN))
