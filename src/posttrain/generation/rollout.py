"""`RolloutEngine`: a generation engine that builds its own model and receives weights, so it can live
in another process (a Ray actor) and be refitted over a `WeightSyncGroup` or CUDA IPC.

    engine = ray.remote(RolloutEngine).remote(functools.partial(model_parts, "tiny", 0), GenerationConfig())

`build` is any picklable zero-argument callable returning `(model, tokenizer)` (`model_parts` covers
Hugging Face directories and the built-in tiny model); nothing heavy crosses the process boundary at
construction. Ray is not imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import GenerationConfig
from posttrain.generation.weight_sync import (
    IpcBucket,
    IpcReceiver,
    SyncGroupInfo,
    WeightSyncGroup,
    receive_weights,
)
from posttrain.models.hf import TinyModelConfig, build_tiny_model, load_model, load_tokenizer
from posttrain.models.tokenizer import build_char_tokenizer


def model_parts(name: str = "tiny", seed: int = 0, tiny: TinyModelConfig | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): a Hugging Face directory or hub name, or `tiny` (random tiny model with the
    built-in character tokenizer, deterministic for `seed`)."""
    if name == "tiny":
        tokenizer = build_char_tokenizer()
        return build_tiny_model(len(tokenizer), seed=seed, cfg=tiny), tokenizer
    return load_model(name), load_tokenizer(name)


class RolloutEngine(GenerationEngine):
    """A `GenerationEngine` built from a factory, with the receiving side of every weight transport."""

    def __init__(self, build: Callable[[], tuple[Any, Any]], cfg: GenerationConfig | None = None) -> None:
        model, tokenizer = build()
        super().__init__(model, tokenizer, cfg)
        self._group: WeightSyncGroup | None = None
        self._ipc: IpcReceiver | None = None

    def join_weight_group(self, info: SyncGroupInfo, rank: int) -> None:
        """Join the sync group as `rank` (1..n); returns once every member has joined."""
        self._group = WeightSyncGroup(info, rank)

    def receive_weights(self) -> dict[str, float]:
        """Receive one broadcast sync (call together with the sender's `broadcast_weights`)."""
        if self._group is None:
            raise ValueError("receive_weights() before join_weight_group(); join the sync group first")
        return receive_weights(self._group, self)

    def load_ipc_bucket(self, bucket: IpcBucket) -> dict[str, float] | None:
        """Copy one CUDA IPC bucket in; the final marker completes the load and sets the version."""
        self._ipc = self._ipc or IpcReceiver(self)
        return self._ipc.load_bucket(bucket)

    def get_weight_version(self) -> int:
        return self.weight_version
