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

A layer may have a smaller capacity than `max_len` (`capacities`): a sliding-window layer keeps a
ring buffer of `window` positions per slot, position p at column p % window (generation/windows.py
says which positions each query then sees). A prefill or a continued prefill attends over what it
needs (the chunk's own keys, after the ring as it was) and the ring keeps the last `window` positions
of each row's real tokens (padding never overwrites them).

A `KVPrefix` is the keys/values of the first tokens of one slot copied out into compact tensors of
their own (`read_prefix`; of a ring layer only the last `window` positions), to be copied into another
slot later (`load_prefixes`) and continued there (`plan_extend`): the engine's multi-turn sessions
(generation/sessions.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.generation.windows import ring_positions


@dataclass(frozen=True)
class KVPrefix:
    """Keys/values of the tokens `ids` (positions 0..len(ids)-1) of one sequence, out of any slot."""

    ids: tuple[int, ...]
    # per layer [2, kv_heads, m, head_dim], keys then values of the last m positions (m = len(ids), or
    # the ring's capacity for a sliding-window layer if smaller)
    kv: tuple[torch.Tensor, ...]

    def __len__(self) -> int:
        return len(self.ids)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)


class SlotKVCache:
    """Per-slot static keys/values (see the module docstring)."""

    def __init__(
        self, num_layers: int, num_slots: int, max_len: int, capacities: list[int] | None = None
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_len = max_len
        self.capacities = list(capacities) if capacities is not None else [max_len] * num_layers
        assert len(self.capacities) == num_layers and all(0 < c <= max_len for c in self.capacities)
        self._rings = sorted(set(self.capacities) - {max_len})  # the ring capacities (windowed layers)
        self._ring_index: dict[int, torch.Tensor] = {}  # capacity -> [rows, capacity] source columns
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

    def plan_prefill(self, first_slot: int, rows: int, lengths: torch.Tensor | None = None) -> None:
        """The next forward writes `rows` prompts of `lengths` [rows] tokens (needed when a layer is a
        ring), from position 0, into slots first_slot.. ."""
        self._mode, self._start, self._rows = "prefill", first_slot, rows
        self._plan_rings(torch.zeros_like(lengths) if lengths is not None else None, lengths)

    def plan_extend(
        self,
        first_slot: int,
        offsets: torch.Tensor,
        width: int,
        length: int,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The next forward writes `width` tokens per slot first_slot.. (one row per entry of `offsets`),
        row i at positions offsets[i].. (clamped to the last position: only padding gets there), and
        attends over positions < `length` of those slots (a ring layer: over its ring, then the new
        tokens). Rows end at `lengths` [rows] (needed when a layer is a ring). Returns the positions
        [rows, width]."""
        rows = offsets.shape[0]
        self._mode, self._start, self._rows, self._length = "extend", first_slot, rows, length
        self._slots = torch.arange(first_slot, first_slot + rows, device=offsets.device)[:, None]
        steps = torch.arange(width, device=offsets.device)
        self._positions = (offsets[:, None] + steps[None, :]).clamp_(max=self.max_len - 1)
        self._plan_rings(offsets, lengths)
        return self._positions

    def _plan_rings(self, offsets: torch.Tensor | None, lengths: torch.Tensor | None) -> None:
        """For each ring capacity w: which column of [ring as it was (w columns), the chunk] each ring
        column takes, so that it ends holding the last w real positions of its row."""
        self._ring_index = {}
        for w in self._rings:
            assert lengths is not None and offsets is not None, "a ring layer needs the rows' lengths"
            wanted = ring_positions(lengths - 1, w)  # the position each column must hold afterwards
            keep = torch.arange(w, device=lengths.device)[None, :].expand_as(wanted)
            self._ring_index[w] = torch.where(wanted >= offsets[:, None], w + wanted - offsets[:, None], keep)

    def plan_decode(self, rows: int, positions: torch.Tensor, length: int) -> None:
        """The next forward writes one token per slot 0..rows-1 at `positions` [rows] and attends over
        positions < `length`."""
        self._mode, self._rows, self._positions, self._length = "decode", rows, positions, length
        # each layer capacity's columns, once per step (a ring of capacity w holds position p at p % w)
        self._decode_columns = {self.max_len: positions} | {
            w: torch.remainder(positions, w) for w in self._rings
        }
        if self._row_index is None or self._row_index.shape[0] < rows:
            self._row_index = torch.arange(self.num_slots, device=positions.device)

    # ------------------------------------------------------------------ the HF hook

    def _allocate(self, layer: int, like: torch.Tensor) -> None:
        shape = (self.num_slots, like.shape[1], self.capacities[layer], like.shape[3])
        self.keys[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.values[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this forward's keys/values [b, kv_heads, q, head_dim]; return what to attend over."""
        if self.keys[layer_idx] is None:
            self._allocate(layer_idx, key_states)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.capacities[layer_idx] < self.max_len and self._mode in ("prefill", "extend"):
            return self._update_ring(layer_idx, key_states, value_states)
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
            columns = self._decode_columns[self.capacities[layer_idx]]
            return self.write_decode(
                layer_idx, rows, columns, key_states[:, :, 0], value_states[:, :, 0], self._length
            )
        raise RuntimeError("SlotKVCache.update called without plan_prefill/plan_decode (engine bug)")

    def _update_ring(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Prefill or continued prefill of a ring layer: attend over the chunk (prefill) or over the ring
        as it was followed by the chunk (extend); then keep each row's last `capacity` positions."""
        w, rows = self.capacities[layer], slice(self._start, self._start + self._rows)
        index = self._ring_index[w]
        out = []
        for cache, new in ((self.keys[layer], key_states), (self.values[layer], value_states)):
            source = torch.cat([cache[rows], new], dim=2)  # a copy: read before the ring is written
            seen = new if self._mode == "prefill" else source
            picked = index[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
            cache[rows] = torch.gather(source, 2, picked)
            out.append(seen)
        return out[0], out[1]

    def write_decode(
        self,
        layer: int,
        rows: torch.Tensor,
        columns: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token's keys/values [n, kv_heads, head_dim] per slot `rows` at cache `columns` (the
        positions; for a ring layer of capacity w, the positions mod w); return the views
        [n, kv_heads, length, head_dim] to attend over (slots 0..n-1; a ring layer: its first
        min(length, w) columns, which hold exactly the positions in the window)."""
        k, v = self.keys[layer], self.values[layer]
        length = min(length, self.capacities[layer])
        k[rows, :, columns] = keys
        v[rows, :, columns] = values
        n = keys.shape[0]
        return k[:n, :, :length], v[:n, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Transformers asks this only when no position ids are passed; the engine always passes them."""
        return 0

    # ------------------------------------------------------------------ slot moves and memory

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of slots `src` [m] into slots `dst` [m] (shared prompts,
        compaction after sequences finish; `src` is read before anything is written)."""
        for k, v, w in zip(self.keys, self.values, self.capacities):
            if k is not None:
                n = min(length, w)  # a ring shorter than `length` is copied whole
                k[dst, :, :n] = k[src, :, :n]
                v[dst, :, :n] = v[src, :, :n]

    def _columns(self, layer: int, n: int, device: torch.device) -> torch.Tensor:
        """The columns of `layer` holding the last positions of a sequence of n tokens, oldest first:
        all n of them, or a ring's last `capacity` (column p % capacity holds p)."""
        w = self.capacities[layer]
        if w >= self.max_len or n <= w:
            return torch.arange(n, device=device)
        return torch.remainder(torch.arange(n - w, n, device=device), w)

    def read_prefix(self, slot: int, ids: list[int]) -> KVPrefix:
        """A copy of the keys/values of `slot`, which holds `ids` at positions 0..len(ids)-1 (of a ring
        layer, the positions it keeps)."""
        n, kv = len(ids), []
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            cols = self._columns(layer, n, k.device)
            kv.append(torch.stack([k[slot][:, cols], v[slot][:, cols]]))
        return KVPrefix(tuple(ids), tuple(kv))

    def load_prefixes(self, first_slot: int, prefixes: list[KVPrefix]) -> None:
        """Copy prefix i into slot first_slot + i where it came from (one indexed write per layer)."""
        assert self.keys[0] is not None, "a prefix is loaded only into allocated buffers"
        device = self.keys[0].device
        index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per capacity: slots, columns
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            w = self.capacities[layer]
            if w not in index:
                cols = [self._columns(layer, len(p), device) for p in prefixes]
                slots = [torch.full((len(c),), first_slot + i, device=device) for i, c in enumerate(cols)]
                index[w] = (torch.cat(slots), torch.cat(cols))
            slots, cols = index[w]
            kv = torch.cat([p.kv[layer] for p in prefixes], dim=2).transpose(1, 2)  # [2, tokens, kv_heads, d]
            k[slots, :, cols] = kv[0]
            v[slots, :, cols] = kv[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def free(self) -> None:
        """Drop the buffers (they are allocated again on the next forward)."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self._mode = "idle"
