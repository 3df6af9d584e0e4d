"""Multi-turn sessions: the keys/values of a finished request, kept for its conversation's next turn.

A request may name a session (any hashable key, e.g. a trajectory id). When it finishes, the engine
copies what its slot holds, the keys/values of the prompt and of every drawn token but the last (whose
keys/values are never computed), out into a compact tensor of its own (`KVPrefix`,
generation/kv_cache.py) stored under the key, in place of the key's older entry. When a later request
of that session is admitted and the stored token ids are a strict prefix of its prompt (turn 2's
prompt is turn 1's prompt + completion + the environment's observation), the stored keys/values are
copied into the request's slot and only the rest of the prompt is prefilled, at its true positions:
several such continuations share one forward, right-padded, each row from its own offset. Otherwise
the prompt is prefilled whole and the request counts as a miss. A conversation of T turns then runs
each token through prefill once, not once per later turn.

Sampling is not continued across turns: each request draws from the start of its random stream, so
the turns of a session given the same seed and stream would draw the same uniforms (correlated
samples). A caller seeding its requests derives a seed per turn (`derive_seed(seed, tag, turn)` in
rollout/trajectory.py); unseeded requests draw from their request id's stream and need nothing.

Stored keys/values belong to the weights that computed them: every weight load and `sleep()` drop them
all. At most `max_cached_sessions` entries are kept (the least recently used go first). The store has
a lock of its own, so `end_session()` from an event loop never waits for a step.

Departure from vLLM/SGLang prefix caching: no block table or radix tree shared between requests; an
entry belongs to one session and is matched against that session's prompts only (the G samples of a
group still share the prefill of their common first prompt, through the engine's prompt dedup).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from posttrain.generation.kv_cache import KVPrefix, SlotKVCache
from posttrain.generation.params import GenerationConfig
from posttrain.generation.requests import Request
from posttrain.generation.routing import RoutingLog
from posttrain.generation.windows import WindowMasks


class SessionStore:
    """Stored prefixes by session key, least recently used first, bounded; thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, KVPrefix] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes() for e in self._entries.values())

    def match(self, key: Hashable, prompt: list[int]) -> KVPrefix | None:
        """The entry of `key` if its token ids are a strict prefix of `prompt` (it is then the most
        recently used one), else None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or len(entry) >= len(prompt) or tuple(prompt[: len(entry)]) != entry.ids:
                return None
            self._entries.move_to_end(key)
            return entry

    def put(self, key: Hashable, entry: KVPrefix) -> None:
        """Store `entry` under `key` (replacing the key's entry), then evict beyond the capacity."""
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def drop(self, key: Hashable) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


# a prefill forward takes prompts down to this fraction of its longest one; shorter ones start the next
# forward (at most ~1/3 of a forward's rows x width is padding, and a chunk of lengths from l to L runs
# in about log(L / l) / log(1 / PREFILL_MIN_FILL) + 1 forwards)
PREFILL_MIN_FILL = 0.75


def prefill_groups(lengths: list[int]) -> list[tuple[int, int]]:
    """Split prompts of `lengths` (longest first) into runs [a, b) of similar length, one prefill
    forward each: a run ends before the first prompt shorter than PREFILL_MIN_FILL of its first."""
    groups, start = [], 0
    for i, n in enumerate(lengths):
        assert i == 0 or n <= lengths[i - 1], "prefill_groups wants the longest prompt first"
        if n < PREFILL_MIN_FILL * lengths[start]:
            groups.append((start, i))
            start = i
    return [*groups, (start, len(lengths))] if lengths else []


class PrefillBudget:
    """The token cost of one prefill chunk, held to `max_prefill_tokens`: the fresh prompts' forward
    (distinct prompts, as repeats are prefilled once, times the longest) plus the continued prompts'
    forward (rows times the longest new part)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.distinct: set[tuple[int, ...]] = set()
        self.fresh = (0, 0)  # (rows, longest prompt)
        self.continued = (0, 0)  # (rows, longest new part)

    def take(self, req: Request) -> bool:
        """Count `req` in if the chunk stays within the budget (a chunk's first request always fits)."""
        fresh, continued, prompt = self.fresh, self.continued, tuple(req.prompt)
        if req.reuse is None:
            fresh = (fresh[0] + (prompt not in self.distinct), max(fresh[1], len(prompt)))
        else:
            continued = (continued[0] + 1, max(continued[1], len(prompt) - len(req.reuse)))
        empty = self.fresh[0] + self.continued[0] == 0
        if not empty and fresh[0] * fresh[1] + continued[0] * continued[1] > self.tokens:
            return False
        self.fresh, self.continued = fresh, continued
        if req.reuse is None:
            self.distinct.add(prompt)
        return True


class EngineSessions:
    """The session verbs of `GenerationEngine` and the prefill of continued prompts (a mixin: it uses
    the engine's config, cache, slots and forward, declared below)."""

    cfg: GenerationConfig
    cache: SlotKVCache
    device: torch.device
    pad_token_id: int
    _active: list[Request]
    _arange: torch.Tensor
    _forward_at: Callable[..., torch.Tensor]
    _masks: WindowMasks
    _routing: RoutingLog | None
    _start: Callable[..., list[Request]]

    def _build_sessions(self) -> None:
        self._sessions = SessionStore(self.cfg.max_cached_sessions)
        self.num_prefill_tokens = 0  # prompt tokens run through prefill forwards (padding not counted)
        self.num_reused_tokens = 0  # prompt tokens whose keys/values came from a stored session
        self.num_session_misses = 0  # requests naming a session that were prefilled whole

    def end_session(self, key: Hashable) -> None:
        """Drop the stored keys/values of session `key` (nothing happens if there are none). A request
        of the session still running stores its own when it finishes."""
        self._sessions.drop(key)

    def clear_sessions(self) -> None:
        """Drop the stored keys/values of every session."""
        self._sessions.clear()

    @property
    def num_cached_sessions(self) -> int:
        return len(self._sessions)

    def _session_prefix(self, req: Request) -> KVPrefix | None:
        """The stored prefix that `req`'s prompt extends, if any (looked up as it is admitted)."""
        if req.session is None or not self.cfg.session_kv_reuse:
            return None
        return self._sessions.match(req.session, req.prompt)

    def _split_chunk(self, chunk: list[Request]) -> tuple[list[Request], list[Request]]:
        """The requests of a chunk to prefill whole (session misses counted) and those that continue."""
        fresh = [r for r in chunk if r.reuse is None]
        if self.cfg.session_kv_reuse:
            self.num_session_misses += sum(r.session is not None for r in fresh)
        return fresh, [r for r in chunk if r.reuse is not None]

    def _save_sessions(self, slots: list[int]) -> None:
        """Store the keys/values of the finished requests in `slots` that name a session."""
        if not self.cfg.session_kv_reuse or self.cfg.max_cached_sessions == 0:
            return
        for slot in slots:
            req = self._active[slot]
            if req.session is not None:
                self._sessions.put(req.session, self.cache.read_prefix(slot, req.prompt + req.tokens[:-1]))

    def _prefill_continued(self, chunk: list[Request]) -> list[Request]:
        """Prefill prompts that extend their session's stored prefix into the next free slots: each
        prefix is copied into its request's slot, then one forward runs only the new tokens
        (right-padded; row i from position len(prefix i) on, attending over its prefix and causally
        within its new part), and each request draws its first token."""
        n0 = len(self._active)
        prefixes = [r.reuse for r in chunk]
        self.cache.load_prefixes(n0, prefixes)
        new = [r.prompt[len(p) :] for r, p in zip(chunk, prefixes)]
        width, length = max(map(len, new)), max(len(r.prompt) for r in chunk)
        ids = torch.tensor([t + [self.pad_token_id] * (width - len(t)) for t in new], device=self.device)
        offsets = torch.tensor([len(p) for p in prefixes], device=self.device)
        lengths = torch.tensor([len(r.prompt) for r in chunk], device=self.device)
        positions = self.cache.plan_extend(n0, offsets, width, length, lengths)
        keys = self._arange[:length][None, None, :]
        full = (keys <= positions[:, :, None]) & (keys < lengths[:, None, None])
        mask = self._masks.extend(full, positions, offsets, lengths)  # per layer type (windows.py)
        starts = [len(p) for p in prefixes]
        recording = (
            self._routing.continued(chunk, starts, width) if self._routing else contextlib.nullcontext()
        )
        with recording:  # MoE routing of the new tokens (generation/routing.py)
            logits = self._forward_at(ids, positions, mask, lengths - offsets - 1)
        self.num_reused_tokens += sum(map(len, prefixes))
        self.num_prefill_tokens += sum(map(len, new))
        for r in chunk:
            r.reuse = None  # its slot holds the keys/values now; the store may drop the entry
        return self._start(chunk, n0, logits, lengths)
