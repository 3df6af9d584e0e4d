"""Rollout generation: the batched engine (engine.py), its typed contracts (params.py), and the checked
weight sync from the trainer (weight_sync.py, probe.py). See each module's docstring."""

from posttrain.generation.engine import EngineStateError, GenerationEngine
from posttrain.generation.params import GenerationConfig, GenerationResult, SamplingParams

__all__ = ["EngineStateError", "GenerationConfig", "GenerationEngine", "GenerationResult", "SamplingParams"]
