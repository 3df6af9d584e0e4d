"""The batched generation engine: prefill, then decode with a per-slot KV cache, continuous batching.

`GenerationEngine(model, tokenizer, cfg)` wraps any Hugging Face causal LM whose attention layers
use the `past_key_values.update(...)` protocol (Llama, Qwen2, Mistral-style models). Requests wait
in a FIFO queue; each `step()` first prefills waiting prompts into free slots (right-padded, up to
`max_prefill_tokens` per forward), then decodes one token for every active slot. A finished
sequence frees its slot at once; waiting prompts take the free slots (continuous batching) once a
quarter of them is free, or all the waiting prompts fit, or a few decode steps have passed
(`admit_min_free_fraction`, `admit_max_delay_steps`): each prefill is a forward of its own, so a
trickle of one-slot prefills would cost more than the slots it fills.

Three ways in: `generate(prompts, params)` blocks and returns results in prompt order (the
synchronous loop); `submit()` + `step()` / `iter_results()` hand results back as they finish; and
`agenerate()` / `agenerate_all()` / `astream()` do the same for asyncio code (one stepping thread runs while there is
work, so the event loop stays free to submit more). The engine starts no thread at construction, so it can be built
inside a Ray actor (see generation/rollout.py).

Departures from `transformers.generate`: a static per-slot cache instead of a growing
`DynamicCache` (no concatenation per step), 4-D masks built by the engine (transformers uses them
as they are), logits computed only at each prompt's last position during prefill, counter-based
per-request random streams (generation/sampler.py), and for plain-head families (Llama, Qwen2/3,
Mistral) the LM head applied by the engine: on CPU through a oneDNN-packed copy of its weight.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import math
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator

import torch

from posttrain.generation.kv_cache import SlotKVCache
from posttrain.generation.lean_decode import LeanDecoder
from posttrain.generation.params import GenerationConfig, GenerationResult, SamplingParams
from posttrain.generation.requests import Request, check_prompt, stop_ids
from posttrain.generation.sampler import RowParams, mix64, request_key, sample
from posttrain.generation.weights import WeightLoad, WeightsLike, named_tensors
from posttrain.logging import get_logger
from posttrain.models.logprobs import token_logprobs

log = get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNSEEDED_SALT = 0x5851F42D4C957F2D  # separates engine-seeded streams from user-seeded ones
DEFAULT_MAX_LEN = 4096  # context per slot when max_model_len is not set (bounds the KV cache)


_STEPPER_IDLE_S = 0.5  # an idle stepping thread waits this long for more work before it exits


def _post(loop: asyncio.AbstractEventLoop | None, fn, arg) -> None:
    """Run fn(arg) on the event loop; dropped when the loop has closed (nobody is waiting)."""
    try:
        loop.call_soon_threadsafe(fn, arg)
    except (RuntimeError, AttributeError):
        pass


_STEPPERS: weakref.WeakKeyDictionary[threading.Thread, GenerationEngine] = weakref.WeakKeyDictionary()


@atexit.register
def _stop_steppers() -> None:
    """Stop and join running stepping threads before the interpreter tears torch down (a daemon
    thread still inside a torch op at that point aborts the process)."""
    for thread, engine in list(_STEPPERS.items()):
        with engine._work:
            engine._closing = True
            engine._work.notify_all()
        thread.join(timeout=10)


class EngineStateError(RuntimeError):
    """The engine cannot do this now (asleep, weights missing, requests in flight); the message says
    which call fixes it."""


_PLAIN_HEAD_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_HEAD_CHUNK = 4096  # vocabulary columns per LM-head matmul on CPU (the output block stays in cache)
_PACK_MIN_NUMEL = 1 << 20  # smaller LM heads: F.linear is as fast, and packing per sync is not free


def _plain_head_body(model):
    """The decoder body of a model whose logits are exactly `lm_head(body(...).last_hidden_state)`
    (no bias, scaling or soft-capping), or None; for those the engine applies the LM head itself."""
    head = model.get_output_embeddings()
    config = model.config
    plain = (
        getattr(config, "model_type", None) in _PLAIN_HEAD_FAMILIES
        and isinstance(head, torch.nn.Linear)
        and head.bias is None
        and getattr(config, "final_logit_softcapping", None) is None
        and getattr(config, "logit_scale", None) is None
    )
    return getattr(model, "model", None) if plain else None


def _check_supported(model, max_len: int) -> None:
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("GenerationEngine runs decoder-only causal LMs; this model is encoder-decoder")
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
    uses_window = getattr(config, "use_sliding_window", True)  # Qwen2 has the flag, Mistral does not
    if sliding or (uses_window and window and window < max_len):
        raise ValueError(
            "sliding-window attention is not supported by GenerationEngine yet; set max_model_len <= "
            f"sliding_window ({window}) or disable the sliding window in the model config"
        )


class GenerationEngine:
    """Batched sampler over one Hugging Face causal LM; see the module docstring."""

    def __init__(self, model, tokenizer=None, cfg: GenerationConfig | None = None) -> None:
        self.cfg = cfg or GenerationConfig()
        self.tokenizer = tokenizer
        self._build_model(model)
        self._build_slots()
        self._build_queues()

    # ------------------------------------------------------------------ construction

    def _build_model(self, model) -> None:
        first = next(model.parameters())
        self.device = torch.device(self.cfg.device) if self.cfg.device else first.device
        self.dtype = first.dtype if self.cfg.dtype == "auto" else DTYPES[self.cfg.dtype]
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_len = int(self.cfg.max_model_len or min(config.max_position_embeddings, DEFAULT_MAX_LEN))
        _check_supported(model, self.max_len)
        self._lm_head = model.get_output_embeddings()
        self._body = _plain_head_body(model)
        self._lean = LeanDecoder.for_model(model) if self._body is not None else None
        self._packed: tuple[tuple, torch.Tensor] | None = None  # see _packed_head
        self._pack_failed = not torch.backends.mkldnn.is_available()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else getattr(config, "eos_token_id", None)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else None
        self.pad_token_id = getattr(self.tokenizer, "pad_token_id", None) or 0
        self.weight_version = 0
        self._weights_valid = True
        self._shared = False
        self._sleeping = False
        self._released: dict[str, tuple[torch.Size, torch.dtype, torch.Tensor | None]] = {}

    def _build_slots(self) -> None:
        s, dev = self.cfg.max_num_seqs, self.device
        self.cache = SlotKVCache(self.model.config.num_hidden_layers, s, self.max_len)
        self._last = torch.zeros(s, dtype=torch.long, device=dev)  # last drawn token of each slot
        self._pos = torch.zeros(s, dtype=torch.long, device=dev)  # where that token is written
        self._count = torch.zeros(s, dtype=torch.long, device=dev)  # tokens drawn so far
        self._arange = torch.arange(self.max_len, device=dev)
        self._rows: RowParams | None = None

    def _build_queues(self) -> None:
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []  # slot i holds _active[i]
        self._parked: list[GenerationResult] = []  # finished while nobody was asking for them
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._futures: dict[int, asyncio.Future] = {}
        self._work = threading.Condition()  # guards _stepping/_loop; wakes an idle stepping thread
        self._stepping = False  # a stepping thread is running (see _ensure_driver)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_ids: set[int] = set()  # requests made by agenerate()/astream()
        self._closing = False  # set at interpreter exit: the stepping thread stops (see _stop_steppers)
        self._admit_paused = False
        self._admit_delay = 0  # decode steps that left free slots unfilled (see _admit_due)
        self.num_generated_tokens = 0

    # ------------------------------------------------------------------ requests

    def _make_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        stream_index: int,
        prompt_index: int | None,
        checked: dict | None = None,
    ) -> Request:
        """A validated request. `checked` memoizes validation over one call's repeated prompts/params."""
        checked = {} if checked is None else checked
        memo = (tuple(prompt), id(params)) if isinstance(prompt, (list, tuple)) else None
        if memo is None or memo not in checked:
            checked[memo] = (
                check_prompt(prompt, self.vocab_size, self.max_len),
                stop_ids(params, self.vocab_size, self.eos_token_id),
            )
        ids, stops = checked[memo]
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass one to GenerationEngine(model, tokenizer)")
        rid = next(self._ids)
        if params.seed is not None:
            key = request_key(params.seed, stream_index)
        else:
            key = request_key(mix64(self.cfg.seed) ^ _UNSEEDED_SALT, rid)
        return Request(
            request_id=rid,
            prompt_index=rid if prompt_index is None else prompt_index,
            prompt=ids,
            params=params,
            key=key,
            limit=min(params.max_new_tokens, self.max_len - len(ids)),
            stop_ids=stops,
        )

    def _make_requests(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None,
        streams: list[int] | None = None,
    ) -> list[Request]:
        """Validated requests (nothing queued yet); request k draws from stream `streams[k]` (default k)
        and reports prompt index `streams[k]`."""
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one per prompt "
                    "or a single one for all"
                )
            plist = params
        else:
            plist = [params or SamplingParams()] * len(prompts)
        if streams is None:
            streams = list(range(len(prompts)))
        elif len(streams) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(streams)} stream indices")
        checked: dict = {}
        return [self._make_request(p, sp, k, k, checked) for p, sp, k in zip(prompts, plist, streams)]

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        *,
        stream_index: int = 0,
        prompt_index: int | None = None,
    ) -> int:
        """Queue one request; returns its id. Safe to call while a step runs in another thread."""
        req = self._make_request(prompt, params or SamplingParams(), stream_index, prompt_index)
        self._waiting.append(req)
        return req.request_id

    def submit_all(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        streams: list[int] | None = None,
    ) -> list[int]:
        """Queue several requests as `generate` would (request k draws from stream k, or from
        `streams[k]`); returns their ids, in prompt order. All or none: every request is validated
        before any is queued. `step()` then hands out their results."""
        self._check_can_run()  # before queueing anything
        reqs = self._make_requests(prompts, params, streams)
        self._waiting.extend(reqs)
        return [r.request_id for r in reqs]

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or decoding."""
        return bool(self._waiting or self._active)

    @property
    def num_running(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[GenerationResult]:
        """Admit waiting prompts into free slots, decode one token for every slot; return what finished."""
        self._check_can_run()  # before taking the parked results, so an error loses none
        with self._lock:
            done, self._parked = self._parked, []
        return done + self._step_once()

    def _step_once(self, park: bool = False) -> list[GenerationResult]:
        """One step. With `park` (the stepping thread), the results nobody awaits (of submit() or
        generate() requests) are parked for step() in the same hold of the lock that finished them,
        so a caller never sees the engine idle with their results in neither place."""
        with self._lock, torch.inference_mode():
            self._check_can_run()
            finished = self._admit()
            if self._active:
                finished += self._decode()
            results = [r.result() for r in finished]
            if park:
                self._parked += [r for r in results if r.request_id not in self._async_ids]
                results = [r for r in results if r.request_id in self._async_ids]
            return results

    def iter_results(self) -> Iterator[GenerationResult]:
        """Step until nothing is left, yielding each result as it finishes."""
        while True:
            with self._lock:  # a consistent view against a stepping thread that may be parking results
                more = bool(self._waiting or self._active or self._parked)
            if not more:
                return
            yield from self.step()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Generate a completion for every prompt (blocking); results in prompt order."""
        self._futures = {k: f for k, f in self._futures.items() if not (f.done() or f.get_loop().is_closed())}
        if self._futures:
            raise EngineStateError(
                "generate() called while asynchronous requests are pending; await them first "
                "(or use agenerate()/astream() for these prompts too)"
            )
        ids = self.submit_all(prompts, params)
        wanted = set(ids)
        got: dict[int, GenerationResult] = {}
        while len(got) < len(ids):
            for res in self.step():
                if res.request_id in wanted:
                    got[res.request_id] = res
                else:
                    self._parked.append(res)
        return [got[i] for i in ids]

    def _check_can_run(self) -> None:
        if self._sleeping:
            raise EngineStateError("the engine is asleep (sleep() was called); call wake() first")
        if not self._weights_valid:
            raise EngineStateError(
                "the engine has no complete weights (an incomplete or failed load_weights(), or weights "
                "released by sleep(keep_weights=False) / shared weights); call load_weights() with the "
                "full state dict"
            )

    # ------------------------------------------------------------------ prefill

    def _take_chunk(self) -> list[Request]:
        """The next prefill chunk: waiting requests in order, while the distinct prompts (repeats are
        prefilled once, see _prefill) padded to the longest fit `max_prefill_tokens`."""
        chunk: list[Request] = []
        distinct: set[tuple[int, ...]] = set()
        longest = 0
        while self._waiting and len(self._active) + len(chunk) < self.cfg.max_num_seqs:
            prompt = tuple(self._waiting[0].prompt)
            rows = len(distinct) + (prompt not in distinct)
            n = max(longest, len(prompt))
            if chunk and n * rows > self.cfg.max_prefill_tokens:
                break
            chunk.append(self._waiting.popleft())
            distinct.add(prompt)
            longest = n
        return chunk

    def _admit(self) -> list[Request]:
        finished: list[Request] = []
        if not self._admit_due():
            return finished
        self._admit_delay = 0
        while self._waiting and not self._admit_paused and len(self._active) < self.cfg.max_num_seqs:
            finished += self._prefill(self._take_chunk())
        return finished

    def _admit_due(self) -> bool:
        """Whether to admit waiting prompts this step: always into an idle engine; while sequences
        decode, once `admit_min_free_fraction` of the slots is free (or every waiting prompt fits) or
        after `admit_max_delay_steps` steps of waiting, so that a trickle of finished sequences does
        not cost one small prefill forward each."""
        free = self.cfg.max_num_seqs - len(self._active)
        if not self._waiting or self._admit_paused or free <= 0:
            return False
        if not self._active:
            return True
        wanted = min(len(self._waiting), math.ceil(self.cfg.admit_min_free_fraction * self.cfg.max_num_seqs))
        if free >= wanted or self._admit_delay >= self.cfg.admit_max_delay_steps:
            return True
        self._admit_delay += 1
        return False

    def _prefill(self, chunk: list[Request]) -> list[Request]:
        """Prefill a chunk of prompts into the next free slots and draw each one's first token.

        Identical prompts (the n completions of one prompt in GRPO) are prefilled once: the distinct
        prompts take the first slots, the repeats get a copy of their keys/values and of their logits,
        and each request then draws with its own random stream."""
        distinct: dict[tuple[int, ...], int] = {}
        firsts, repeats = [], []
        for r in chunk:
            key = tuple(r.prompt)
            if key in distinct:
                repeats.append(r)
            else:
                distinct[key] = len(firsts)
                firsts.append(r)
        chunk = firsts + repeats
        n0, k, u = len(self._active), len(chunk), len(firsts)
        width = max(len(r.prompt) for r in firsts)
        rows = [r.prompt + [self.pad_token_id] * (width - len(r.prompt)) for r in firsts]
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        lengths = torch.tensor([len(r.prompt) for r in firsts], dtype=torch.long, device=self.device)
        ar = self._arange[:width]
        mask = (ar[None, :, None] >= ar[None, None, :]) & (ar[None, None, :] < lengths[:, None, None])
        self.cache.plan_prefill(n0, u)
        mask = self._additive(mask)[:, None]
        logits = self._forward_at(ids, ar[None, :].expand(u, width), mask, lengths - 1)
        if repeats:
            source = torch.tensor([distinct[tuple(r.prompt)] for r in chunk], device=self.device)
            self.cache.copy_slots(source[u:] + n0, torch.arange(n0 + u, n0 + k, device=self.device), width)
            logits, lengths = logits[source], lengths[source]
        for r in chunk:
            r.weight_version = self.weight_version
        self._active.extend(chunk)
        self._pos[n0 : n0 + k] = lengths
        self._count[n0 : n0 + k] = 0
        rows_params = RowParams.build(
            [r.params for r in chunk], [r.key for r in chunk], self.vocab_size, self.device
        )
        tokens, logprobs = sample(logits, rows_params, self._count[n0 : n0 + k])
        self._last[n0 : n0 + k] = tokens
        self._count[n0 : n0 + k] = 1
        self._rows = None
        return self._record(n0, tokens, logprobs)

    def _forward_at(self, ids, position_ids, mask, last: torch.Tensor) -> torch.Tensor:
        """Logits [b, V] at position `last[i]` of each row, computing the LM head only there."""
        rows = torch.arange(ids.shape[0], device=ids.device)
        if self._body is not None:
            return self._head(self._hidden(ids, position_ids, mask)[rows, last])
        if self._lm_head is None:
            return self._forward(ids, position_ids, mask)[rows, last]

        def pick(module, args):
            return (args[0][rows, last][:, None], *args[1:])

        handle = self._lm_head.register_forward_pre_hook(pick)
        try:
            return self._forward(ids, position_ids, mask)[:, 0]
        finally:
            handle.remove()

    def _hidden(self, ids, position_ids, mask) -> torch.Tensor:
        """Final hidden states [b, t, H] of the decoder body (plain-head models only)."""
        return self._run(self._body, ids, position_ids, mask).last_hidden_state

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [n, H] -> logits [n, V]. On CPU it uses a oneDNN copy of the
        weight packed for matmul (11 ms against 18 ms for `F.linear` on [64, 256] x [256, 32000], one
        thread), packed again after every load; not for shared weights, whose in-place updates (a fused
        optimizer step bumps no version counter) a copy would miss. Otherwise (and where oneDNN is
        missing) vocabulary blocks into one output buffer."""
        weight = self._lm_head.weight
        if hidden.device.type != "cpu" or hidden.shape[0] == 0:
            return torch.nn.functional.linear(hidden, weight)
        packed = self._packed_head(weight)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, packed, None, "none", [], "")
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
        for start in range(0, weight.shape[0], _HEAD_CHUNK):
            end = start + _HEAD_CHUNK
            torch.mm(hidden, weight[start:end].t(), out=out[:, start:end])
        return out

    def _packed_head(self, weight: torch.Tensor):
        """The oneDNN-packed LM-head weight (re-packed when its storage changed; loads, sleep and wake
        drop it); None for shared or small heads, non-fp32 weights, or a torch build without oneDNN."""
        if self._pack_failed or self._shared or weight.dtype != torch.float32:
            return None
        if weight.numel() < _PACK_MIN_NUMEL:
            return None
        key = (weight.data_ptr(), tuple(weight.shape))
        if self._packed is None or self._packed[0] != key:
            self._packed = None
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.cfg.max_num_seqs)
            except (AttributeError, RuntimeError) as e:  # no oneDNN in this build
                log.info("oneDNN-packed LM head unavailable (%s); using blocked matmuls", e)
                self._pack_failed = True
                return None
            self._packed = (key, packed)
        return self._packed[1]

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean attention mask as an additive float one (0 / dtype min): sdpa takes its fast path
        on strided KV-cache views with float masks, not with boolean ones (measured on CPU)."""
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    def _forward(self, ids, position_ids, mask) -> torch.Tensor:
        return self._run(self.model, ids, position_ids, mask).logits

    def _run(self, module, ids, position_ids, mask):
        """One Hugging Face forward through the slot cache (planned by the caller)."""
        return module(
            input_ids=ids,
            position_ids=position_ids,
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
        )

    # ------------------------------------------------------------------ decode

    def _decode(self) -> list[Request]:
        n = len(self._active)
        if self._rows is None:
            reqs = self._active
            self._rows = RowParams.build(
                [r.params for r in reqs], [r.key for r in reqs], self.vocab_size, self.device
            )
        length = max(r.position for r in self._active) + 1
        pos = self._pos[:n]
        mask = self._additive(self._arange[:length][None, :] <= pos[:, None])[:, None, None, :]
        self.cache.plan_decode(n, pos, length)
        if self._lean is not None and self.cache.keys[0] is not None:
            logits = self._head(self._lean(self._last[:n], pos, mask, self.cache))
        elif self._body is not None:
            logits = self._head(self._hidden(self._last[:n, None], pos[:, None], mask)[:, -1])
        else:
            logits = self._forward(self._last[:n, None], pos[:, None], mask)[:, -1]
        tokens, logprobs = sample(logits, self._rows, self._count[:n])
        self._last[:n] = tokens
        self._pos[:n] += 1
        self._count[:n] += 1
        return self._record(0, tokens, logprobs)

    def _record(self, first_slot: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> list[Request]:
        """Append drawn tokens to their requests (one host sync); release the slots that finished."""
        ended = []
        host = torch.stack([tokens.double(), logprobs.double()]).tolist()  # one device->host copy
        for i, (tok, lp) in enumerate(zip(host[0], host[1])):
            tok = int(tok)
            if self._active[first_slot + i].append(tok, lp, self.tokenizer):
                ended.append(first_slot + i)
        self.num_generated_tokens += len(tokens)
        finished = [self._active[s] for s in ended]
        if ended:
            self._release(ended)
        return finished

    def _release(self, slots: list[int]) -> None:
        """Free finished slots and compact the rest into slots 0..m-1 (order kept): one batched copy of
        the moved sequences' keys/values and per-slot state, however many finished together."""
        gone = set(slots)
        keep = [i for i in range(len(self._active)) if i not in gone]
        moved = [(dst, src) for dst, src in enumerate(keep) if dst != src]
        if moved:
            dst = torch.tensor([d for d, _ in moved], device=self.device)
            src = torch.tensor([s for _, s in moved], device=self.device)
            self.cache.copy_slots(src, dst, max(self._active[s].position for _, s in moved) + 1)
            for t in (self._last, self._pos, self._count):
                t[dst] = t[src]
        self._active = [self._active[i] for i in keep]
        self._rows = None

    # ------------------------------------------------------------------ asyncio

    async def agenerate(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        *,
        stream_index: int = 0,
        prompt_index: int | None = None,
    ) -> GenerationResult:
        """Submit one request and wait for its result (other coroutines may submit meanwhile)."""
        req = self._make_request(prompt, params or SamplingParams(), stream_index, prompt_index)
        fut = self._track(req)
        self._waiting.append(req)
        self._ensure_driver()
        try:
            return await fut
        finally:
            self._futures.pop(req.request_id, None)  # also when cancelled: nobody waits any more

    async def astream(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> AsyncIterator[GenerationResult]:
        """Submit prompts and yield each result as soon as it finishes (completion order)."""
        reqs = self._make_requests(prompts, params)
        futs = [self._track(r) for r in reqs]
        self._waiting.extend(reqs)
        self._ensure_driver()
        for fut in asyncio.as_completed(futs):
            yield await fut

    async def agenerate_all(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Submit prompts together and wait for all their results, in prompt order (request k draws
        from stream k, as in `generate`). One wake-up of the caller for all of them, where `astream`
        has one per result."""
        reqs = self._make_requests(prompts, params)
        futs = [self._track(r) for r in reqs]
        self._waiting.extend(reqs)
        self._ensure_driver()
        try:
            return list(await asyncio.gather(*futs))
        finally:
            for r in reqs:
                self._futures.pop(r.request_id, None)  # also when cancelled: nobody waits any more

    def _track(self, req: Request) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._futures[req.request_id] = fut
        self._async_ids.add(req.request_id)  # its result goes to the loop (or is dropped), never parked
        return fut

    def _ensure_driver(self) -> None:
        """Make sure the stepping thread runs and serves the calling event loop. The thread steps while
        there is work, hands finished results to the loop (which stays free), idles a moment when the
        work runs out (the next burst reuses it) and then exits."""
        loop = asyncio.get_running_loop()
        with self._work:
            self._loop = loop  # results go to the loop that asked last (an engine may outlive a loop)
            start = not self._stepping
            self._stepping = True
        # from the loop's next turn, so that requests submitted by coroutines scheduled in this turn
        # (asyncio.gather over a group's completions) are admitted, and prefilled, together
        loop.call_soon(self._start_stepping if start else self._wake_stepper)

    def _start_stepping(self) -> None:
        thread = threading.Thread(target=self._step_loop, name="engine-steps", daemon=True)
        _STEPPERS[thread] = self
        thread.start()

    def _wake_stepper(self) -> None:
        with self._work:
            self._work.notify()

    def _has_async_work(self) -> bool:
        return bool(self._active or (self._waiting and not self._admit_paused))

    def _step_loop(self) -> None:
        loop = None
        try:
            while True:
                with self._work:
                    if not self._has_async_work() and not self._closing:
                        self._work.wait(_STEPPER_IDLE_S)
                    if self._closing or not self._has_async_work():
                        self._stepping = False
                        return
                    loop = self._loop
                waited = self._step_once(park=True)  # submit()/generate() results wait for step()
                self._async_ids.difference_update(r.request_id for r in waited)
                if waited:
                    _post(loop, self._deliver, waited)
        except BaseException as e:  # hand the error to every waiter
            with self._work:
                self._stepping = False
                loop = self._loop
            log.error("generation step failed: %r", e)
            _post(loop, self._fail_all, e)

    def _deliver(self, results: list[GenerationResult]) -> None:
        """Resolve the futures of finished requests (on the event loop); a cancelled waiter's result is
        dropped."""
        for res in results:
            fut = self._futures.pop(res.request_id, None)
            if fut is not None and not fut.done():
                try:
                    fut.set_result(res)
                except RuntimeError:  # its loop has closed (asyncio.run ended): nobody is waiting
                    pass

    def _fail_all(self, error: BaseException) -> None:
        for fut in self._futures.values():
            if not fut.done():
                try:
                    fut.set_exception(error)
                except RuntimeError:  # its loop has closed
                    pass
        self._futures.clear()

    async def load_weights_async(self, weights: WeightsLike, version: int) -> dict[str, float]:
        """Load weights between requests: admission pauses, running sequences finish, weights load,
        admission resumes (waiting requests then run on the new weights).

        Idle is read under the stepping lock, between steps: a step that began before the pause may
        still be prefilling sequences it admitted. Once idle is seen with admission paused, no step
        admits any more (and load_weights takes the lock for the load itself)."""
        self._admit_paused = True
        try:
            while True:
                idle = False
                if self._lock.acquire(blocking=False):
                    idle = not self._active
                    self._lock.release()
                if idle:
                    return self.load_weights(weights, version)
                await asyncio.sleep(0.001)
        finally:
            self._admit_paused = False
            if self._waiting:
                self._ensure_driver()

    # ------------------------------------------------------------------ logprobs

    def compute_logprobs(self, sequences: list[list[int]], temperature: float = 1.0) -> torch.Tensor:
        """[B, T] logprobs of each token given the previous ones under `logits / temperature`, in the
        trainer's convention (position 0 and padding hold 0); returned on the host in fp32."""
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("compute_logprobs needs non-empty sequences")
        width = max(len(s) for s in sequences)
        out = torch.zeros(len(sequences), width)
        rows_per_chunk = max(1, self.cfg.max_prefill_tokens // width)
        with self._lock, torch.inference_mode():
            self._check_can_run()
            for start in range(0, len(sequences), rows_per_chunk):
                chunk = sequences[start : start + rows_per_chunk]
                out[start : start + len(chunk)] = self._chunk_logprobs(chunk, width, temperature)
        return out

    def _chunk_logprobs(self, chunk: list[list[int]], width: int, temperature: float) -> torch.Tensor:
        ids = torch.tensor(
            [list(s) + [self.pad_token_id] * (width - len(s)) for s in chunk], device=self.device
        )
        lengths = torch.tensor([len(s) for s in chunk], device=self.device)
        # not self._arange: scoring is not bound by the KV cache's max_model_len
        valid = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
        if self._body is not None:  # the generation path's LM head, so the probe check covers it
            hidden = self._body(input_ids=ids, attention_mask=valid.long(), use_cache=False).last_hidden_state
            logits = self._head(hidden.reshape(-1, hidden.shape[-1])).view(*ids.shape, -1)
        else:
            logits = self.model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits
        lp = token_logprobs(logits[:, :-1].float() / temperature, ids[:, 1:])
        return (torch.nn.functional.pad(lp, (1, 0)) * valid).cpu()

    # ------------------------------------------------------------------ weights

    def _check_idle(self, verb: str) -> None:
        if self._active:
            raise EngineStateError(
                f"{verb}() while {len(self._active)} sequences are decoding; call it between requests "
                "(after generate() returns, or via load_weights_async() from asyncio code)"
            )

    def begin_load(self, share: bool = False) -> WeightLoad:
        """Start loading weights piece by piece (e.g. one received bucket at a time); the engine refuses
        to generate until `WeightLoad.finish(version)` has checked that every tensor arrived. With
        `share` the tensors will be aliased, not copied (see share_weights)."""
        self._check_idle("load_weights")
        if self._sleeping:
            raise EngineStateError("load_weights() while asleep; call wake() first")
        if self._shared and not share:  # stop aliasing the trainer's tensors before writing into them
            state = self.model.state_dict(keep_vars=True).values()
            for t in {id(t): t for t in state}.values():
                t.data = torch.empty_like(t.data)
            self._shared = False
        self._weights_valid = False
        return WeightLoad(self)

    def load_weights(self, weights: WeightsLike, version: int) -> dict[str, float]:
        """Copy a full state dict (or a stream of (name, tensor)) into the engine and set its version.

        Names, shapes and completeness are checked; until a complete load succeeds the engine refuses
        to generate (so half-loaded weights cannot be used). Dtype and device are converted."""
        with self._lock, torch.no_grad():
            load = self.begin_load()
            for name, tensor in named_tensors(weights):
                load.add(name, tensor)
            return load.finish(version)

    def share_weights(self, weights: WeightsLike, version: int) -> dict[str, float]:
        """Point the engine's parameters at the given tensors (no copy): same shape, dtype and device
        required. In-place updates of those tensors (an optimizer step) are then seen by the engine."""
        with self._lock, torch.no_grad():
            load = self.begin_load(share=True)
            for name, tensor in named_tensors(weights):
                load.add(name, tensor, share=True)
            self._shared = True
            return load.finish(version)

    def _mark_loaded(self, version: int) -> None:
        self._packed = None  # loads write through .data, which bumps no version counter
        self._weights_valid = True
        self.weight_version = int(version)

    # ------------------------------------------------------------------ sleep / wake

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def sleep(self, keep_weights: bool = True) -> dict[str, float]:
        """Release device memory: the KV cache always; parameters too (moved to host memory when
        `keep_weights`, dropped otherwise; shared weights are dropped and come back with the next sync).
        On a CPU engine with `keep_weights` the parameters stay where they are. Idempotent."""
        with self._lock:
            self._check_idle("sleep")
            if self._sleeping:
                return {"bytes_released": 0.0}
            released = self.cache.nbytes()
            self.cache.free()
            self._packed = None
            keep_host = keep_weights and not self._shared
            if not (keep_host and self.device.type == "cpu"):
                released += self._release_params(keep_host)
                self._weights_valid = keep_host
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._sleeping = True
            return {"bytes_released": float(released)}

    def _release_params(self, to_host: bool) -> int:
        released = 0
        pin = self.device.type == "cuda"
        for name, p in self.model.named_parameters():
            host = None
            if to_host:
                host = p.data.to("cpu", copy=True)
                host = host.pin_memory() if pin else host
            self._released[name] = (p.shape, p.dtype, host)
            released += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._shared = False
        return released

    def wake(self) -> None:
        """Restore what `sleep()` released (parameters from host memory, or empty ones awaiting
        load_weights()); the KV cache is allocated again on the next forward. Idempotent."""
        with self._lock:
            if not self._sleeping:
                return
            params = dict(self.model.named_parameters())
            for name, (shape, dtype, host) in self._released.items():
                if host is not None:
                    params[name].data = host.to(self.device)
                else:
                    params[name].data = torch.empty(shape, dtype=dtype, device=self.device)
            self._released = {}
            self._packed = None
            self._sleeping = False
