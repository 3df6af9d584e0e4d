"""The batched generation engine: prefill, then decode with a per-slot KV cache, continuous batching.

`GenerationEngine(model, tokenizer, cfg)` wraps any Hugging Face causal LM whose attention layers
use the `past_key_values.update(...)` protocol (Llama, Qwen2/3, Mistral, Gemma2/3, gpt-oss). Layers
with a sliding window get masks of their own and keep only the window's keys/values; models whose
attention soft-caps or has sinks run eager attention (generation/windows.py). Requests wait
in a FIFO queue; each `step()` first prefills waiting prompts into free slots (right-padded, in
forwards of similar prompt lengths, up to `max_prefill_tokens` per chunk), then decodes one token
for every active slot (on a GPU optionally replayed from CUDA graphs, generation/graphs.py; the decode
step and its overlap with the host are generation/decode.py). A finished sequence frees its slot at
once (one step later with `overlap_decode`); waiting prompts take the free slots (continuous batching)
once a quarter of them is free, or all the waiting prompts fit, or a few decode steps have passed
(`admit_min_free_fraction`, `admit_max_delay_steps`): each prefill is a forward of its own, so a
trickle of one-slot prefills would cost more than the slots it fills.

Three ways in: `generate(prompts, params)` blocks and returns results in prompt order (the
synchronous loop); `submit()` + `step()` / `iter_results()` hand results back as they finish; and
`agenerate()` / `agenerate_all()` / `astream()` do the same for asyncio code (one stepping thread runs
while there is work, so the event loop stays free to submit more; generation/stepper.py). The engine
starts no thread at construction, so it can be built inside a Ray actor (see generation/rollout.py).

Sessions (multi-turn): a request may name a session key (`submit(..., session=key)`, likewise the
other verbs). When it finishes, the keys/values in its slot are kept under the key; when the session's
next prompt extends the kept tokens (prompt + completion + observation), only the new tokens are
prefilled, after the kept keys/values are copied into the slot. Weight loads and sleep() drop them all;
`end_session(key)` drops one (generation/sessions.py).

This file is the core: requests, slots, prefill/decode scheduling, sleep/wake. Weight loading is
generation/weights.py, sessions generation/sessions.py, the LM head and sequence scoring
generation/lm_head.py.

Departures from `transformers.generate`: a static per-slot cache instead of a growing
`DynamicCache` (no concatenation per step), 4-D masks built by the engine (transformers uses them
as they are), logits computed only at each prompt's last position during prefill, counter-based
per-request random streams (generation/sampler.py), and for plain-head families (Llama, Qwen2/3,
Mistral) the LM head applied by the engine: on CPU through a oneDNN-packed copy of its weight
(generation/lm_head.py).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from collections import deque
from collections.abc import Hashable, Iterator

import torch

from posttrain.dtypes import DTYPES
from posttrain.generation.decode import DecodeSteps
from posttrain.generation.graphs import DecodeGraphs, lean_step
from posttrain.generation.kv_cache import SlotKVCache
from posttrain.generation.lean_decode import PACK_MIN_NUMEL, LeanDecoder
from posttrain.generation.lm_head import LMHead, plain_head_body, sequence_logprobs
from posttrain.generation.params import EngineStateError, GenerationConfig, GenerationResult, SamplingParams
from posttrain.generation.requests import Request, check_prompt, eos_token_ids, stop_ids
from posttrain.generation.routing import RoutingLog
from posttrain.generation.sampler import RowParams, mix64, request_key, sample, to_device
from posttrain.generation.sessions import EngineSessions, PrefillBudget, prefill_groups
from posttrain.generation.stepper import AsyncStepping
from posttrain.generation.weights import EngineWeights
from posttrain.generation.windows import WindowMasks, check_supported, prepare_attention
from posttrain.host_memory import keep_freed_memory
from posttrain.models.cpu_gemm import OneDNNInferenceLinears, onednn_available
from posttrain.models.families import check_generation_support
from posttrain.models.hf import with_cache
from posttrain.models.lora import has_lora
from posttrain.models.moe import routers

__all__ = ["EngineStateError", "GenerationEngine"]

_UNSEEDED_SALT = 0x5851F42D4C957F2D  # separates engine-seeded streams from user-seeded ones
DEFAULT_MAX_LEN = 4096  # context per slot when max_model_len is not set (bounds the KV cache)


class GenerationEngine(AsyncStepping, DecodeSteps, EngineWeights, EngineSessions):
    """Batched sampler over one Hugging Face causal LM; see the module docstring. The asyncio verbs
    come from `AsyncStepping` (generation/stepper.py), the decode step from `DecodeSteps`
    (generation/decode.py), the weight verbs from `EngineWeights` (generation/weights.py), the session
    verbs from `EngineSessions` (generation/sessions.py)."""

    def __init__(self, model, tokenizer=None, cfg: GenerationConfig | None = None) -> None:
        self.cfg = cfg or GenerationConfig()
        self.tokenizer = tokenizer
        self._build_model(model)
        self._build_slots()
        self._build_queues()

    # ------------------------------------------------------------------ construction

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (the tokenizer's, where it has one), for a pad row."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def _build_model(self, model) -> None:
        check_generation_support(model.config)  # the support table: a clear refusal before any work
        first = next(model.parameters())
        self.device = torch.device(self.cfg.device) if self.cfg.device else first.device
        if self.device.type == "cpu":
            keep_freed_memory()  # each step's logits and scores reuse freed memory (host_memory.py)
        self.dtype = first.dtype if self.cfg.dtype == "auto" else DTYPES[self.cfg.dtype]
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        on_onednn = self.device.type == "cpu" and self.dtype == torch.float32 and onednn_available()
        # what `_forward_at` runs in: its larger linear layers on oneDNN for an fp32 CPU model
        self._prefill_linears = (
            OneDNNInferenceLinears(PACK_MIN_NUMEL) if on_onednn else contextlib.nullcontext()
        )
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_len = int(self.cfg.max_model_len or min(config.max_position_embeddings, DEFAULT_MAX_LEN))
        check_supported(model, self.max_len)
        prepare_attention(self.model)  # one that takes our 4-D masks and applies soft-caps and sinks
        self._masks = WindowMasks(config, self.max_len, self._additive)  # per layer type (windows.py)
        self._head = LMHead(model.get_output_embeddings(), self.cfg.max_num_seqs)
        self._body = plain_head_body(model)  # set: the engine applies the LM head itself
        packs = self._head.packs  # the lean decoder's projections are packed beside the head
        if self.cfg.compile_decode:  # inductor compiles the plain path (no oneDNN packs)
            packs = None
        self._lean = LeanDecoder.for_model(model, self.max_len, packs) if self._body is not None else None
        self._decoder = lean_step(self._lean, self._body, config.model_type, self.cfg)  # the decode step
        self.eos_token_ids = eos_token_ids(self.tokenizer, model)  # a request stops at any (stop_at_eos)
        self.pad_token_id = getattr(self.tokenizer, "pad_token_id", None) or 0
        self.weight_version = 0
        self._weights_valid = True
        self._shared = False
        self._sleeping = False
        self._released: dict[str, tuple[torch.Size, torch.dtype, torch.Tensor | None]] = {}
        self._adapters = has_lora(self.model)
        self._routing = RoutingLog(self.model) if self.cfg.record_routing and routers(self.model) else None

    def _build_slots(self) -> None:
        s, dev = self.cfg.max_num_seqs, self.device
        self.cache = SlotKVCache(self.model.config.num_hidden_layers, s, self.max_len, self._masks.capacities)
        self._last = torch.zeros(s, dtype=torch.long, device=dev)  # last drawn token of each slot
        self._pos = torch.zeros(s, dtype=torch.long, device=dev)  # where that token is written
        self._count = torch.zeros(s, dtype=torch.long, device=dev)  # tokens drawn so far
        self._arange = torch.arange(self.max_len, device=dev)
        self._rows: RowParams | None = None
        self._graphs = None
        if self.cfg.cuda_graphs:
            self._graphs = DecodeGraphs(self._graph_step, self._pos, self.max_len, capture=True)
        self._build_decode()  # the step in flight (generation/decode.py)

    def _graph_step(self, rows: int, length: int) -> torch.Tensor:
        """The decode forward a graph captures: hidden states of slots 0..rows-1 from the engine's buffers,
        each attending over the first `length` positions up to its own (the mask built here too)."""
        pos = self._pos[:rows]
        mask = self._masks.decode(self._arange[:length][None, :] <= pos[:, None])
        return self._decoder(self._last[:rows], pos, mask, self.cache)

    def _build_queues(self) -> None:
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []  # slot i holds _active[i]
        self._parked: list[GenerationResult] = []  # finished while nobody was asking for them
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._build_stepper()
        self._admit_paused = False
        self._admit_delay = 0  # decode steps that left free slots unfilled (see _admit_due)
        self.num_generated_tokens = 0
        self._build_sessions()  # the session store; num_prefill_tokens, num_reused_tokens, num_session_misses

    # ------------------------------------------------------------------ requests

    def _make_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        stream_index: int,
        prompt_index: int | None,
        checked: dict | None = None,
        session: Hashable | None = None,
    ) -> Request:
        """A validated request. `checked` memoizes validation over one call's repeated prompts/params."""
        checked = {} if checked is None else checked
        memo = (tuple(prompt), id(params)) if isinstance(prompt, (list, tuple)) else None
        if memo is None or memo not in checked:
            checked[memo] = (
                check_prompt(prompt, self.vocab_size, self.max_len),
                stop_ids(params, self.vocab_size, self.eos_token_ids),
            )
        ids, stops = checked[memo]
        try:
            hash(session)
        except TypeError:
            raise ValueError(f"a session key must be hashable (str, int, tuple), got {session!r}") from None
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
            session=session,
        )

    def _make_requests(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None,
        streams: list[int] | None = None,
        sessions: list[Hashable | None] | None = None,
    ) -> list[Request]:
        """Validated requests (nothing queued yet); request k draws from stream `streams[k]` (default k),
        reports prompt index `streams[k]` and belongs to session `sessions[k]` (default none)."""
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
        if sessions is None:
            sessions = [None] * len(prompts)
        elif len(sessions) != len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(sessions)} session keys; pass one per prompt"
            )
        checked: dict = {}
        return [
            self._make_request(p, sp, k, k, checked, s)
            for p, sp, k, s in zip(prompts, plist, streams, sessions)
        ]

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        *,
        stream_index: int = 0,
        prompt_index: int | None = None,
        session: Hashable | None = None,
    ) -> int:
        """Queue one request (of `session`, see the module docstring); returns its id. Safe to call while
        a step runs in another thread."""
        req = self._make_request(
            prompt, params or SamplingParams(), stream_index, prompt_index, session=session
        )
        self._waiting.append(req)
        return req.request_id

    def submit_all(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        streams: list[int] | None = None,
        sessions: list[Hashable | None] | None = None,
    ) -> list[int]:
        """Queue several requests as `generate` would (request k draws from stream k, or from
        `streams[k]`, and belongs to session `sessions[k]`); returns their ids, in prompt order. All or
        none: every request is validated before any is queued. `step()` then hands out their results."""
        self._check_can_run()  # before queueing anything
        reqs = self._make_requests(prompts, params, streams, sessions)
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
        """One step; returns the results of submit()/generate() requests, or with `park` (the stepping
        thread) parks them for step(). Results of asyncio requests go to their waiters, whoever steps
        (generation/stepper.py, `_route`)."""
        with self._lock, torch.inference_mode():
            self._check_can_run()
            finished: list[Request] = []
            try:
                due = self._admit_due()
                if due:  # prefills never run beside a step whose draws are unread (generation/decode.py)
                    finished += self._settle()
                finished += self._admit(due)
                if self._active:
                    finished += self._decode()
            except BaseException:
                finished += self._settle_after_failure()
                self._route([r.result() for r in finished], park=True)  # for the next step(): none lost
                raise
            if self._shared and not (self._active or self._waiting):
                # packed copies of weights shared with a trainer live while requests run: an optimizer
                # step between two generate() calls updates the tensors in place, not the copies
                self._head.drop_packed()
            return self._route([r.result() for r in finished], park)

    def iter_results(self) -> Iterator[GenerationResult]:
        """Step until nothing is left, yielding each result as it finishes."""
        while True:
            with self._lock:  # a consistent view against a stepping thread that may be parking results
                more = bool(self._waiting or self._active or self._parked)
            if not more:
                return
            yield from self.step()

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        sessions: list[Hashable | None] | None = None,
        streams: list[int] | None = None,
    ) -> list[GenerationResult]:
        """Generate a completion for every prompt (blocking; prompt k of session `sessions[k]`, drawing
        from random stream k of its seed, or `streams[k]`); results in prompt order. When a step fails,
        the error is raised and every result already finished waits for `step()` / `iter_results()`."""
        self._futures = {k: f for k, f in self._futures.items() if not (f.done() or f.get_loop().is_closed())}
        if self._futures:
            raise EngineStateError(
                "generate() called while asynchronous requests are pending; await them first "
                "(or use agenerate()/astream() for these prompts too)"
            )
        ids = self.submit_all(prompts, params, streams, sessions)
        wanted = set(ids)
        got: dict[int, GenerationResult] = {}
        try:
            while len(got) < len(ids):
                for res in self.step():
                    if res.request_id in wanted:
                        got[res.request_id] = res
                    else:
                        self._parked.append(res)
        except BaseException:  # a failed step: the results already taken wait for step() with the rest
            with self._lock:
                self._parked += got.values()
            raise
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
        """The next prefill chunk: waiting requests in order, while the distinct fresh prompts (repeats
        are prefilled once, see _prefill) padded to the longest, plus the new parts of prompts that
        continue a session, fit `max_prefill_tokens`."""
        chunk: list[Request] = []
        budget = PrefillBudget(self.cfg.max_prefill_tokens)
        while self._waiting and len(self._active) + len(chunk) < self.cfg.max_num_seqs:
            self._waiting[0].reuse = self._session_prefix(self._waiting[0])
            if not budget.take(self._waiting[0]):
                break
            chunk.append(self._waiting.popleft())
        return chunk

    def _admit(self, due: bool) -> list[Request]:
        finished: list[Request] = []
        if not due:
            return finished
        self._admit_delay = 0
        while self._waiting and not self._admit_paused and len(self._active) < self.cfg.max_num_seqs:
            fresh, continued = self._split_chunk(self._take_chunk())
            if fresh:
                finished += self._prefill(fresh)
            if continued:  # a forward of its own (generation/sessions.py)
                finished += self._prefill_continued(continued)
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
        prompts take the first slots, longest first, the repeats get a copy of their keys/values and of
        their logits, and each request then draws with its own random stream. The distinct prompts run
        in forwards of similar lengths (`prefill_groups`), so little of the work is padding."""
        first_of: dict[tuple[int, ...], Request] = {}
        for r in chunk:
            first_of.setdefault(tuple(r.prompt), r)
        firsts = sorted(first_of.values(), key=lambda r: -len(r.prompt))  # stable for equal lengths
        distinct = {tuple(r.prompt): i for i, r in enumerate(firsts)}
        repeats = [r for r in chunk if first_of[tuple(r.prompt)] is not r]
        chunk = firsts + repeats
        n0, k, u = len(self._active), len(chunk), len(firsts)
        lengths = torch.tensor([len(r.prompt) for r in firsts], dtype=torch.long, device=self.device)
        if self._routing:  # the routing record reads one forward's rows
            with self._routing.prefill(firsts, chunk, len(firsts[0].prompt)):
                logits = self._prefill_rows(firsts, lengths, n0)
        else:
            groups = prefill_groups([len(r.prompt) for r in firsts])
            logits = torch.cat([self._prefill_rows(firsts[a:b], lengths[a:b], n0 + a) for a, b in groups])
        self.num_prefill_tokens += sum(len(r.prompt) for r in firsts)
        if repeats:
            source = torch.tensor([distinct[tuple(r.prompt)] for r in chunk], device=self.device)
            longest = len(firsts[0].prompt)
            self.cache.copy_slots(source[u:] + n0, torch.arange(n0 + u, n0 + k, device=self.device), longest)
            logits, lengths = logits[source], lengths[source]
        return self._start(chunk, n0, logits, lengths)

    def _prefill_rows(self, rows: list[Request], lengths: torch.Tensor, first_slot: int) -> torch.Tensor:
        """One prefill forward of the prompts `rows` (of `lengths`, right-padded to the longest) into
        slots first_slot..; their next-token logits [len(rows), V]."""
        width = max(len(r.prompt) for r in rows)
        pad = self.pad_token_id
        ids = torch.tensor([r.prompt + [pad] * (width - len(r.prompt)) for r in rows], device=self.device)
        ar = self._arange[:width]
        mask = (ar[None, :, None] >= ar[None, None, :]) & (ar[None, None, :] < lengths[:, None, None])
        mask = self._masks.prefill(mask)
        self.cache.plan_prefill(first_slot, len(rows), lengths)
        return self._forward_at(ids, ar[None, :].expand(len(rows), width), mask, lengths - 1)

    def _start(
        self, chunk: list[Request], n0: int, logits: torch.Tensor, lengths: torch.Tensor
    ) -> list[Request]:
        """Seat prefilled requests in slots n0.. (prompt lengths `lengths`, next-token `logits`) and draw
        each one's first token."""
        k = len(chunk)
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
        return self._record(self._drawn(chunk, tokens, logprobs))

    def _forward_at(self, ids, position_ids, mask, last: torch.Tensor) -> torch.Tensor:
        """Logits [b, V] at position `last[i]` of each row, computing the LM head only there. On an fp32
        CPU model its linear layers of at least PACK_MIN_NUMEL weights run on oneDNN's GEMM, as the
        decode step's packed ones do (MKL's SGEMM, F.linear's, takes no AVX-512 path on AMD CPUs)."""
        with self._prefill_linears:
            rows = torch.arange(ids.shape[0], device=ids.device)
            if self._body is not None:
                return self._head(self._hidden(ids, position_ids, mask)[rows, last])
            if self._head.module is None:
                return self._forward(ids, position_ids, mask)[rows, last]

            def pick(module, args):
                return (args[0][rows, last][:, None], *args[1:])

            handle = self._head.module.register_forward_pre_hook(pick)
            try:
                return self._forward(ids, position_ids, mask)[:, 0]
            finally:
                handle.remove()

    def _hidden(self, ids, position_ids, mask) -> torch.Tensor:
        """Final hidden states [b, t, H] of the decoder body (plain-head models only)."""
        return self._run(self._body, ids, position_ids, mask).last_hidden_state

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
            use_cache=True,
            **with_cache(module, self.cache),
        )

    # ------------------------------------------------------------------ decode

    def _release(self, slots: list[int]) -> None:
        """Free finished slots and compact the rest into slots 0..m-1 (order kept): one batched copy of
        the moved sequences' keys/values and per-slot state, however many finished together."""
        gone = set(slots)
        keep = [i for i in range(len(self._active)) if i not in gone]
        moved = [(dst, src) for dst, src in enumerate(keep) if dst != src]
        if moved:
            dst = to_device([d for d, _ in moved], torch.long, self.device)  # no wait for a step in flight
            src = to_device([s for _, s in moved], torch.long, self.device)
            self.cache.copy_slots(src, dst, max(self._active[s].position for _, s in moved) + 1)
            for t in (self._last, self._pos, self._count):
                t[dst] = t[src]
        self._active = [self._active[i] for i in keep]
        self._rows = None

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
        return sequence_logprobs(self.model, self._body, self._head, ids, valid, temperature, self._shared)

    # ------------------------------------------------------------------ idle check (weights, sleep)

    def _check_idle(self, verb: str) -> None:
        if self._active:
            raise EngineStateError(
                f"{verb}() while {len(self._active)} sequences are decoding; call it between requests "
                "(after generate() returns, or via load_weights_async() from asyncio code)"
            )
