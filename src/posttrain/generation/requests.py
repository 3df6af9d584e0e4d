"""One generation request on its way through the engine: validation on entry, the tokens drawn so
far, and the stop rules (stop token ids, stop strings, token and context limits)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

from posttrain.generation.kv_cache import KVPrefix
from posttrain.generation.params import FinishReason, GenerationResult, SamplingParams

# A character may take up to 4 byte-level tokens; stop strings are searched in the decoded text of the
# last (4 * longest stop string + 4) tokens.
_TOKENS_PER_CHAR = 4


@dataclass
class Request:
    """A request and its progress."""

    request_id: int
    prompt_index: int
    prompt: list[int]
    params: SamplingParams
    key: int  # random-stream key (signed int64), see generation/sampler.py
    limit: int  # tokens it may generate: max_new_tokens, or less where the context ends first
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    weight_version: int = 0
    session: Hashable | None = None  # its keys/values are kept under this key when it finishes
    reuse: KVPrefix | None = None  # the session's stored prefix this prompt extends (set at admission)
    routing: list | None = None  # MoE expert ids of the tokens fed so far (generation/routing.py)

    @property
    def position(self) -> int:
        """Cache position of the last drawn token (where it is written when fed back)."""
        return len(self.prompt) + len(self.tokens) - 1

    def append(self, token: int, logprob: float, tokenizer) -> bool:
        """Add a drawn token; True when the request is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif self.params.stop_strings and (hit := self._stop_string(tokenizer)) is not None:
            self.finish_reason, self.stop_reason = "stop", hit
        elif len(self.tokens) >= self.limit:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _stop_string(self, tokenizer) -> str | None:
        window = _TOKENS_PER_CHAR * max(len(s) for s in self.params.stop_strings) + _TOKENS_PER_CHAR
        text = tokenizer.decode(self.tokens[-window:])
        return next((s for s in self.params.stop_strings if s in text), None)

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        return GenerationResult(
            request_id=self.request_id,
            prompt_index=self.prompt_index,
            prompt_token_ids=list(self.prompt),
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            weight_version=self.weight_version,
            routing=torch.cat(self.routing) if self.routing else None,
        )


def check_prompt(prompt: list[int], vocab_size: int, max_len: int) -> list[int]:
    """A validated copy of a prompt (ValueError with the fix otherwise)."""
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(
            f"a prompt must be a list of token ids, got {type(prompt).__name__}; tokenize text first"
        )
    if len(prompt) == 0:
        raise ValueError("empty prompt: pass at least one token id (e.g. the tokenizer's bos token)")
    ids = [int(t) for t in prompt]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size}); "
            "tokenize with the engine model's tokenizer"
        )
    if len(ids) >= max_len:
        raise ValueError(
            f"prompt of {len(ids)} tokens does not fit the context of {max_len} tokens (max_model_len) "
            "with room for one new token; shorten the prompt or raise GenerationConfig.max_model_len"
        )
    return ids


def eos_token_ids(tokenizer, model) -> tuple[int, ...]:
    """Every EOS id of a model, first the tokenizer's, then those of the model config's and of its
    generation config's `eos_token_id` (an id or a list), without repeats. transformers.generate and
    vLLM stop at each id of the generation config's list: Qwen2.5-Instruct ends a turn with <|im_end|>
    and a document with <|endoftext|>, Llama-3-Instruct with <|eot_id|> and <|end_of_text|>. With a
    tokenizer that has an EOS, a config's list counts only if it holds that EOS: a model paired with
    another vocabulary's tokenizer (a tiny model's config says 2, an ordinary token of most vocabularies)
    must not stop at an ordinary token."""
    own = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    found: list[int] = [] if own is None else [int(own)]
    for source in (model.config, getattr(model, "generation_config", None)):
        ids = getattr(source, "eos_token_id", None)
        listed = [int(t) for t in (ids if isinstance(ids, (list, tuple)) else [ids]) if t is not None]
        if own is not None and int(own) not in listed:
            continue  # another vocabulary's ids
        found += [t for t in listed if t not in found]
    return tuple(found)


def stop_ids(params: SamplingParams, vocab_size: int, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The stop token ids of a request, checked against the vocabulary: its own, and with `stop_at_eos`
    every EOS id of the model (`eos_token_ids`)."""
    ids = set(params.stop_token_ids)
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"unknown stop token id {t}: the vocabulary has ids [0, {vocab_size}); "
                "pass ids from the engine model's tokenizer"
            )
    if params.stop_at_eos:
        ids.update(int(t) for t in eos_token_ids)
    return frozenset(ids)
