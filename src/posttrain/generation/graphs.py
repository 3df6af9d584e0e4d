"""Decode steps replayed from CUDA graphs (`generation.cuda_graphs`).

On a GPU a decode step of a small or mid-size model is a few hundred kernels launched one by one from
Python: the first H100 runs measured 9-19 ms per step where the weights and the KV cache take 0.1-1 ms to
read (benchmarks/RESULTS.md, "On a GPU"). A CUDA graph launches the captured step as one unit.

A graph replays fixed shapes and fixed addresses, so the step runs on buckets: the rows padded to the
next power of two (at most `max_num_seqs`), the attended length rounded up to a multiple of
`LENGTH_BUCKET`, or of an eighth of its power of two when that is larger (past 2048 positions at most
an eighth of the attended length is padding; a 32k context has 40 length buckets), at most the cache's
length. Rows past the active ones are free slots: their position
is set to 0 and their mask shows column 0 alone, so each writes its key/value into its own free slot's
column 0 and attends over that (nothing reads it; a prefill overwrites it). One graph per (rows,
length) bucket, captured the first time the bucket is needed, all in one memory pool. Graphs hold the
addresses of the parameters and of the KV cache: the engine drops them (`drop`) when it sleeps (the
cache is freed, parameters may move to the host) and when a load re-points parameters (sharing a
trainer's tensors, or leaving them); copy loads write in place and keep them.

In the graph: the attention mask, built from the engine's positions buffer, and the lean decoder's
forward (generation/lean_decode.py), from the engine's own buffers (last tokens, positions) to the
final hidden states [rows, H]: the host's work per step is choosing the bucket and the replay. The LM head
(one matmul, whose [rows, vocabulary] output would otherwise be kept per graph) and the sampler run
after it, eagerly. What the forward reads as Python values is fixed at capture: the LoRA adapters that
are active and their scaling (nothing in the engine changes them; a load of adapter weights writes in
place). Models whose rotary embedding is `dynamic` decide on the host whether to recompute it, so the
engine refuses graphs for them.

With `capture=False` the same bucketed step runs eagerly: that is how the CPU tests check the bucketing
and padding (tests/test_decode_graphs.py); replay against eager is checked by the GPU tier.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.generation.lean_decode import LeanDecoder, compiled

LENGTH_BUCKET = 256  # the smallest step of attended lengths (see length_bucket)
WARMUP_STEPS = 2  # eager runs on a side stream before a capture (lazy initialisation of the step's ops)


def lean_step(lean: LeanDecoder | None, body, model_type: str, cfg) -> Callable[..., torch.Tensor] | None:
    """The engine's decode step: `lean` (None where the model decodes through transformers' forward),
    compiled with `cfg.compile_decode`. Refuses (ValueError with the fix) `cfg.cuda_graphs` and
    `cfg.compile_decode` for a model the lean decoder does not run, and graphs for a dynamic rotary
    embedding (it decides on the host whether to recompute, which a replay would skip)."""
    if lean is None:
        for flag in ("cuda_graphs", "compile_decode"):
            if getattr(cfg, flag):
                _refuse(flag, model_type, "decodes through transformers' forward")
    elif cfg.cuda_graphs and "dynamic" in str(getattr(body.rotary_emb, "rope_type", "")):
        _refuse(
            "cuda_graphs",
            model_type,
            "has a dynamic rotary embedding (recomputed on a host-side length check)",
        )
    return compiled(lean) if cfg.compile_decode else lean


def _refuse(flag: str, model_type: str, why: str) -> None:
    raise ValueError(
        f"generation.{flag} covers the lean decoder's models (Llama, Qwen2, Mistral without sliding "
        f"windows{' or dynamic rope' if flag == 'cuda_graphs' else ''}); this {model_type} model {why}. "
        f"Set generation.{flag}=false for it"
    )


def row_bucket(rows: int, max_rows: int) -> int:
    """The rows a step of `rows` active sequences runs with: the next power of two, at most `max_rows`."""
    return min(1 << max(rows - 1, 0).bit_length(), max_rows)


def length_bucket(length: int, max_len: int) -> int:
    """The attended length a step over `length` positions runs with: the next multiple of LENGTH_BUCKET or
    of an eighth of the power of two below `length`, whichever is larger; at most `max_len`."""
    step = max(LENGTH_BUCKET, 1 << max(length.bit_length() - 4, 0))
    return min(-(-length // step) * step, max_len)


class DecodeGraphs:
    """Bucketed decode steps, replayed from CUDA graphs (or run eagerly with `capture=False`).

    `step(rows, length)` is the engine's forward from its buffers: hidden states [rows, H] of the tokens
    `last[:rows]` at `positions[:rows]`, each row attending over the positions up to its own among the
    first `length` (its mask is built inside the step, from `positions`: no host work per step).
    `positions` is the engine's tensor of slot positions: `run` zeroes the padding rows' entries (free
    slots, written again when a prompt is admitted), so each sees its column 0 alone."""

    def __init__(
        self,
        step: Callable[[int, int], torch.Tensor],
        positions: torch.Tensor,
        max_len: int,
        capture: bool,
    ) -> None:
        if capture and positions.device.type != "cuda":
            raise ValueError(
                f"generation.cuda_graphs needs a CUDA device; this engine is on {positions.device.type}. "
                "Set generation.cuda_graphs=false (the default) there"
            )
        self.step = step
        self.positions = positions
        self.max_rows, self.max_len = positions.shape[0], max_len
        self.capture = capture
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # + output
        self._pool = None
        self.num_captured = 0  # graphs captured over the engine's life (a drop does not reset it)

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, rows: int, length: int) -> torch.Tensor:
        """The step's output for the first `rows` slots (a view of the graph's buffer, valid until the
        next step); `length`: the longest row's position + 1."""
        padded, bucket = row_bucket(rows, self.max_rows), length_bucket(length, self.max_len)
        if padded > rows:
            self.positions[rows:padded] = 0
        if not self.capture:
            return self.step(padded, bucket)[:rows]
        with torch.cuda.device(self.positions.device):  # a stepping thread starts on device 0
            graph, out = self._graphs.get((padded, bucket)) or self._capture(padded, bucket)
            graph.replay()
        return out[:rows]

    def _capture(self, rows: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture `step(rows, length)` into a graph of the shared pool. The warm-up runs write each
        row's key/value at its position, as the replay does: the same values, so nothing changes."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.step(rows, length)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # its own capture stream (not the class default another engine in the process would share)
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            out = self.step(rows, length)
        self.num_captured += 1
        self._graphs[(rows, length)] = (graph, out)
        return graph, out

    def drop(self) -> None:
        """Forget every graph and its memory (the parameters or the KV cache moved or were freed)."""
        self._graphs.clear()
        self._pool = None
