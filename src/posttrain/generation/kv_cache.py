"""A preallocated KV cache of fixed slots for continuous batching, plugged into Hugging Face models.

Each of `num_slots` slots holds one sequence, keys and values at positions 0..max_len-1, laid out
`[slots, kv_heads, max_len, head_dim]` per layer. Active sequences always occupy slots 0..n-1 (the
engine moves the last sequence into the hole a finished one leaves), so a decode step attends over
the view `[:n, :, :L]` with no copy and no per-step concatenation.

The object is passed to the model as its cache (`models.hf.with_cache`); Hugging Face attention layers call
`update(key_states, value_states, layer_idx)` and attend over what it returns. Before each forward
the engine says what is being written (`plan_prefill`, `plan_extend` or `plan_decode`) and passes its
own 4-D mask, which transformers uses as is (no mask building per step). Buffers are allocated on the
first forward, from the shapes the model hands in, so any head layout works.

A `KVPrefix` is the keys/values of the first tokens of one slot copied out into a compact tensor of
its own (`read_prefix`), to be copied into another slot later (`load_prefixes`) and continued there
(`plan_extend`): the engine's multi-turn sessions (generation/sessions.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVPrefix:
    """Keys/values of the tokens `ids` (positions 0..len(ids)-1) of one sequence, out of any slot."""

    ids: tuple[int, ...]
    kv: torch.Tensor  # [2 * layers, kv_heads, len(ids), head_dim]: keys then values of each layer

    def __len__(self) -> int:
        return len(self.ids)


class SlotKVCache:
    """Per-slot static keys/values (see the module docstring)."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_len = max_len
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._mode = "idle"
        self._start = 0
        self._rows = 0
        self._positions: torch.Tensor | None = None
        self._row_index: torch.Tensor | None = None
        self._length = 0
        self._slots: torch.Tensor | None = None  # plan_extend: [rows, 1] slots and [rows, q] positions

    # ------------------------------------------------------------------ planning

    def plan_prefill(self, first_slot: int, rows: int) -> None:
        """The next forward writes `rows` prompts, from position 0, into slots first_slot.. ."""
        self._mode, self._start, self._rows = "prefill", first_slot, rows

    def plan_extend(self, first_slot: int, offsets: torch.Tensor, width: int, length: int) -> torch.Tensor:
        """The next forward writes `width` tokens per slot first_slot.. (one row per entry of `offsets`),
        row i at positions offsets[i].. (clamped to the last position: only padding gets there), and
        attends over positions < `length` of those slots. Returns those positions [rows, width]."""
        rows = offsets.shape[0]
        self._mode, self._start, self._rows, self._length = "extend", first_slot, rows, length
        self._slots = torch.arange(first_slot, first_slot + rows, device=offsets.device)[:, None]
        steps = torch.arange(width, device=offsets.device)
        self._positions = (offsets[:, None] + steps[None, :]).clamp_(max=self.max_len - 1)
        return self._positions

    def plan_decode(self, rows: int, positions: torch.Tensor, length: int) -> None:
        """The next forward writes one token per slot 0..rows-1 at `positions` [rows] and attends over
        positions < `length`."""
        self._mode, self._rows, self._positions, self._length = "decode", rows, positions, length
        if self._row_index is None or self._row_index.shape[0] < rows:
            self._row_index = torch.arange(self.num_slots, device=positions.device)

    # ------------------------------------------------------------------ the HF hook

    def _allocate(self, layer: int, like: torch.Tensor) -> None:
        shape = (self.num_slots, like.shape[1], self.max_len, like.shape[3])
        self.keys[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.values[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this forward's keys/values [b, kv_heads, q, head_dim]; return what to attend over."""
        if self.keys[layer_idx] is None:
            self._allocate(layer_idx, key_states)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "prefill":
            q = key_states.shape[2]
            k[self._start : self._start + self._rows, :, :q] = key_states
            v[self._start : self._start + self._rows, :, :q] = value_states
            return key_states, value_states
        if self._mode == "extend":
            k[self._slots, :, self._positions] = key_states.transpose(1, 2)  # [rows, q, kv_heads, d]
            v[self._slots, :, self._positions] = value_states.transpose(1, 2)
            rows = slice(self._start, self._start + self._rows)
            return k[rows, :, : self._length], v[rows, :, : self._length]
        if self._mode == "decode":
            rows = self._row_index[: self._rows]
            return self.write_decode(
                layer_idx, rows, self._positions, key_states[:, :, 0], value_states[:, :, 0], self._length
            )
        raise RuntimeError("SlotKVCache.update called without plan_prefill/plan_decode (engine bug)")

    def write_decode(
        self,
        layer: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token's keys/values [n, kv_heads, head_dim] per slot `rows` at `positions`; return
        the views [n, kv_heads, length, head_dim] to attend over (slots 0..n-1)."""
        k, v = self.keys[layer], self.values[layer]
        k[rows, :, positions] = keys
        v[rows, :, positions] = values
        n = keys.shape[0]
        return k[:n, :, :length], v[:n, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Transformers asks this only when no position ids are passed; the engine always passes them."""
        return 0

    # ------------------------------------------------------------------ slot moves and memory

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of slots `src` [m] into slots `dst` [m] (shared prompts,
        compaction after sequences finish; `src` is read before anything is written)."""
        for k, v in zip(self.keys, self.values):
            if k is not None:
                k[dst, :, :length] = k[src, :, :length]
                v[dst, :, :length] = v[src, :, :length]

    def read_prefix(self, slot: int, ids: list[int]) -> KVPrefix:
        """A copy of the keys/values of the first len(ids) positions of `slot` (which hold `ids`)."""
        n = len(ids)
        kv = torch.stack([t[slot, :, :n] for k, v in zip(self.keys, self.values) for t in (k, v)])
        return KVPrefix(tuple(ids), kv)

    def load_prefixes(self, first_slot: int, prefixes: list[KVPrefix]) -> None:
        """Copy prefix i into positions 0..len-1 of slot first_slot + i (one indexed write per layer)."""
        assert self.keys[0] is not None, "a prefix is loaded only into allocated buffers"
        device = self.keys[0].device
        slots = torch.cat(
            [torch.full((len(p),), first_slot + i, device=device) for i, p in enumerate(prefixes)]
        )
        positions = torch.cat([torch.arange(len(p), device=device) for p in prefixes])
        kv = torch.cat([p.kv for p in prefixes], dim=2).transpose(1, 2)  # [2 * layers, tokens, kv_heads, d]
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[slots, :, positions] = kv[2 * layer]
            v[slots, :, positions] = kv[2 * layer + 1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def free(self) -> None:
        """Drop the buffers (they are allocated again on the next forward)."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self._mode = "idle"
