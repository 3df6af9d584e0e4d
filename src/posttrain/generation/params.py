"""Typed contracts of the generation engine: its config, the sampling parameters of a request, the
result of a finished request, and the error of a call the engine cannot serve in its current state.

Logprob convention: `GenerationResult.logprobs[i]` is the logprob of `token_ids[i]` under
`softmax(logits / temperature)` over the whole vocabulary, i.e. exactly what the trainer computes with
`logprob_temperature = temperature` (models/logprobs.py). Top-k / top-p change which tokens can be
drawn, not the distribution the logprob is taken under (that is what the trainer sees too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from posttrain.config import Config

FinishReason = Literal["stop", "length"]


class EngineStateError(RuntimeError):
    """The engine cannot do this now (asleep, weights missing, requests in flight); the message says
    which call fixes it."""


class GenerationConfig(Config):
    """How an engine is laid out: batch slots, context length, device and dtype."""

    max_num_seqs: int = Field(
        64, ge=1, description="sequences decoded together (KV-cache slots); more requests wait their turn"
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="longest prompt + completion a slot holds (sizes the KV cache); "
        "None = the model's max_position_embeddings, at most 4096",
    )
    max_prefill_tokens: int = Field(
        8192,
        ge=1,
        description="token budget of one prefill forward (rows x padded prompt length); "
        "a single longer prompt is prefilled alone",
    )
    admit_min_free_fraction: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="while sequences decode, waiting prompts are admitted once this fraction of the slots "
        "is free (or all of them fit): fewer, larger prefills (each prefill is a forward of its own); "
        "0 = admit into any free slot at once",
    )
    admit_max_delay_steps: int = Field(
        8, ge=0, description="admit anyway after this many decode steps with free slots and prompts waiting"
    )
    device: str | None = Field(None, description="device of the engine; None = where the model already is")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and KV-cache dtype; auto = the model's dtype"
    )
    seed: int = Field(0, description="requests without a seed draw from streams derived from this seed")
    session_kv_reuse: bool = Field(
        True,
        description="keep the keys/values of a finished request that names a session, and prefill only "
        "the new tokens of the session's next prompt when it extends them (multi-turn); "
        "False = store nothing, always prefill whole prompts",
    )
    cuda_graphs: bool = Field(
        False,
        description="replay each decode step from a CUDA graph (one per bucket of rows and attended length, "
        "captured on first use): one launch instead of a few hundred per token; CUDA only, and for the "
        "families the lean decoder runs (Llama, Qwen2, Mistral without sliding windows)",
    )
    compile_decode: bool = Field(
        False,
        description="compile the decode step with torch.compile (inductor): the norms, rotary embedding, "
        "attention softmax and activation fuse into a few kernels per layer; with cuda_graphs the compiled "
        "step is what the graphs capture. The first step of a new shape compiles (seconds to a minute). "
        "For the families the lean decoder runs (Llama, Qwen2, Mistral without sliding windows); on CPU "
        "it replaces the oneDNN-packed step",
    )
    overlap_decode: bool = Field(
        False,
        description="launch each decode step before the host reads the one before (its inputs stay on the "
        "device), so the host's bookkeeping runs while the device decodes; results come one step later, "
        "each request draws the same tokens (generation/decode.py). Engines recording MoE routing do not "
        "overlap, nor models whose rotary embedding follows the sequence length (dynamic, longrope)",
    )
    record_routing: bool = Field(
        False,
        description="MoE models: return with each result the expert ids its tokens were routed to "
        "(`GenerationResult.routing`), for the trainer's routing replay",
    )
    max_cached_sessions: int = Field(
        256,
        ge=0,
        description="sessions whose keys/values are kept on the engine's device (the least recently "
        "used are dropped beyond it); each holds its whole conversation's keys/values",
    )


class SamplingParams(Config):
    """How to sample one request (or every request of a `generate` call)."""

    temperature: float = Field(
        1.0, description="logits are divided by this before sampling and for the returned logprobs"
    )
    top_p: float = Field(1.0, description="nucleus sampling: keep the smallest top set with mass >= top_p")
    top_k: int = Field(0, description="keep the k most likely tokens; 0 = no top-k")
    max_new_tokens: int = Field(16, description="at most this many tokens are generated")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="generation stops after any of these (the token is kept)"
    )
    stop_at_eos: bool = Field(
        True,
        description="also stop at every EOS id of the model: the tokenizer's and each of the model "
        "config's and generation config's eos_token_id lists (as transformers.generate and vLLM do)",
    )
    stop_strings: list[str] = Field(
        default_factory=list,
        description="stop once the completion text contains one of these (tokens kept up to the one "
        "that completes it)",
    )
    seed: int | None = Field(
        None,
        description="seed of the request's random stream; request k of a generate() call uses stream "
        "(seed, k). None = derived from the engine seed and the request id. Each request draws from "
        "the start of its stream: two requests with the same seed and stream (the turns of one session "
        "given the same SamplingParams) draw the same uniforms, so give each turn a seed of its own "
        "(sampler.derive_seed(seed, turn), as rollout/trajectory.py does)",
    )
    greedy: bool = Field(False, description="take the most likely token (argmax) instead of sampling")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(
                f"temperature must be > 0 (got {v}); for greedy decoding set greedy=True "
                "(logprobs are then reported at this temperature)"
            )
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {v}); use 1.0 to turn nucleus sampling off")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"top_k must be >= 0 (got {v}); use 0 to turn top-k off")
        return v

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {v}); ask for at least one new token")
        return v

    @field_validator("stop_strings")
    @classmethod
    def _stop_strings(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop_strings may not contain the empty string; remove it")
        return v


def model_sampling_defaults(generation_config: Any) -> dict[str, Any]:
    """The sampling a model's transformers generation config asks for, as SamplingParams fields: greedy
    when it sets do_sample false, else the temperature, top_p and top_k it sets; nothing from a config
    derived from the model config (a model saved without sampling defaults)."""
    if generation_config is None or getattr(generation_config, "_from_model_config", False):
        return {}
    temperature = getattr(generation_config, "temperature", None)
    if getattr(generation_config, "do_sample", None) is False or temperature == 0:
        return {"greedy": True}  # temperature 0 is a common spelling of greedy decoding
    valid = {  # values that mean "off" or that transformers itself refuses are left to the defaults
        "temperature": lambda v: v > 0,
        "top_p": lambda v: 0 < v <= 1,
        "top_k": lambda v: v >= 0,
    }
    out = {k: getattr(generation_config, k, None) for k in valid}
    return {k: v for k, v in out.items() if v is not None and valid[k](v)}


@dataclass
class GenerationResult:
    """One finished request: the completion (prompt excluded), its logprobs and why it ended."""

    request_id: int
    prompt_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    weight_version: int = 0
    routing: torch.Tensor | None = (
        None  # MoE, record_routing: [P + C - 1, L, k] int16 (generation/routing.py)
    )

    @property
    def sequence(self) -> list[int]:
        """Prompt followed by completion."""
        return self.prompt_token_ids + self.token_ids
