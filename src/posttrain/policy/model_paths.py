"""Local model paths made absolute when a policy is built, so that a checkpoint records a base model and
tokenizer (`model.name`, `model.tokenizer` in its identity, policy/identity.py) that name the same
directory from any working directory: `posttrain export` rebuilds a LoRA checkpoint's base from them.

Checkpoints written before this recorded the paths as the config gave them, often relative to the run's
working directory (`model.name=runs/sft_arithmetic/hf`); a run resuming one from that directory still
matches it (`as_recorded`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.policy.config import ModelConfig, PolicyConfig

BUILT_IN = ("tiny", "tiny-chat")  # names that build a model or tokenizer, never paths
PATH_KEYS = {"model.name": "name", "model.tokenizer": "tokenizer"}  # identity key -> ModelConfig field


def absolute_local_path(name: str | None) -> str | None:
    """`name` as an absolute path when it is an existing local path (`~` expanded); a hub name, a
    built-in name or None as it is."""
    if name is None or name in BUILT_IN:
        return name
    path = Path(name).expanduser()
    return str(path.absolute()) if path.exists() else name


def with_absolute_paths(cfg: PolicyConfig) -> PolicyConfig:
    """`cfg` with its model's local `name` and `tokenizer` paths made absolute (from the current
    directory); the same object when there is nothing to change."""
    m = cfg.model
    update = {f: absolute_local_path(getattr(m, f)) for f in PATH_KEYS.values()}
    if all(update[f] == getattr(m, f) for f in update):
        return cfg
    model: ModelConfig = m.model_copy(update=update)
    return cfg.model_copy(update={"model": model})


def as_recorded(identity: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """`identity` (this run's, absolute paths) with a path the checkpoint recorded relative (`saved`,
    its identity) put back as recorded where it names the same directory from here: such a checkpoint
    resumes as it did when the paths were recorded as written."""
    out = dict(identity)
    for key in PATH_KEYS:
        old = saved.get(key)
        if isinstance(old, str) and old != out.get(key) and absolute_local_path(old) == out.get(key):
            out[key] = old
    return out
