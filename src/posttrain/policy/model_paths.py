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

from posttrain.logging import get_logger
from posttrain.policy.config import ModelConfig, PolicyConfig

log = get_logger(__name__)

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
    """`identity` (this run's, absolute paths) with a path the checkpoint recorded (`saved`, its
        identity) put back as recorded where it stands for the same directory: a relative path that names it
        from here (a checkpoint from before paths were recorded absolute), or a recorded local path that no
        longer exists while this run's, of the same name, does (the project moved: checkpoints record absolute
    paths; logged). What the
        directory holds is checked apart from its path: the parameters' names and shapes always, a LoRA base's
        weights by their digest (policy/identity.py)."""
    out = dict(identity)
    for key in PATH_KEYS:
        old, new = saved.get(key), out.get(key)
        if not isinstance(old, str) or not isinstance(new, str) or old == new:
            continue
        if absolute_local_path(old) == new:
            out[key] = old
        elif _moved(old, new):
            log.warning("checkpoint recorded %s=%r, which no longer exists; taking %r for it", key, old, new)
            out[key] = old
    return out


def _moved(old: str, new: str) -> bool:
    """Whether `new` (an existing absolute path) stands for the recorded local path `old`, which is gone:
    the same directory name, as after the project holding it moved."""
    if old in BUILT_IN or not looks_local(old) or Path(old).expanduser().exists():
        return False
    return Path(new).is_absolute() and Path(new).exists() and Path(old).name == Path(new).name


def looks_local(name: str) -> bool:
    """A recorded name that was a local path: absolute, `~`, or relative with a `./` or `../` start (a hub
    name is `owner/model` or `model`, never any of these)."""
    return name.startswith(("/", "~", "./", "../"))
