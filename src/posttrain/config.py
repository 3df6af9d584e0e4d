"""Typed configuration: a pydantic base class, YAML loading and dotted command-line overrides.

Every component declares its own config class next to its code (fields documented where they are
declared) by subclassing `Config`. This module only knows how to load, override and validate them,
and how to turn a validation failure into a message that names the key, the allowed values and the
nearest valid key.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

C = TypeVar("C", bound="Config")


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message says how to fix it."""


class Config(BaseModel):
    """Base of every config: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def model_candidates(ann: Any) -> list[type[BaseModel]]:
    """Pydantic model classes inside an annotation (unwrapping Optional, unions and Annotated)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(ann):
        out.extend(model_candidates(arg))
    return out


def tag_of(model: type[BaseModel]) -> Any:
    """The literal value of a discriminated-union member's `name` field, if it has one."""
    field = model.model_fields.get("name")
    if field is not None and typing.get_origin(field.annotation) is typing.Literal:
        return typing.get_args(field.annotation)[0]
    return None


def _walk_path(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, str, tuple]:
    """The model class owning the last key of `loc`, that key, and `loc` without union tags."""
    current: type[BaseModel] | None = model
    clean: list[Any] = []
    i = 0
    while i < len(loc):
        key = loc[i]
        clean.append(key)
        if i == len(loc) - 1 or current is None or not isinstance(key, str):
            i += 1
            continue
        field = current.model_fields.get(key)
        candidates = model_candidates(field.annotation) if field is not None else []
        current = candidates[0] if len(candidates) == 1 else None
        if len(candidates) > 1 and i + 1 < len(loc):  # pydantic puts the union tag next in loc
            tagged = {tag_of(c): c for c in candidates}
            if loc[i + 1] in tagged:
                current = tagged[loc[i + 1]]
                i += 1
        i += 1
    keys = [k for k in clean if isinstance(k, str)]
    return current, keys[-1] if keys else "", tuple(clean)


def _allowed_values(model: type[BaseModel] | None, key: str) -> str:
    if model is None or key not in model.model_fields:
        return ""
    ann = model.model_fields[key].annotation
    args = [a for a in typing.get_args(ann)]
    lits: list[Any] = []
    if typing.get_origin(ann) is typing.Literal:
        lits = args
    else:
        for a in args:
            if typing.get_origin(a) is typing.Literal:
                lits.extend(typing.get_args(a))
    if lits:
        return " Allowed values: " + ", ".join(repr(v) for v in lits) + "."
    return ""


MAX_SHOWN_INPUT = 100  # characters of a rejected value repeated in a message


def _shown_input(e: Any) -> str:
    """' (got VALUE)' for a rejected value, cut to MAX_SHOWN_INPUT characters; nothing for a whole
    section (a mapping: the message names the section, and its dump would bury the message)."""
    if "input" not in e or isinstance(e["input"], dict) or "(got " in str(e["msg"]):
        return ""
    text = repr(e["input"])
    if len(text) > MAX_SHOWN_INPUT:
        text = text[: MAX_SHOWN_INPUT - 3] + "..."
    return f" (got {text})"


def _message(e: Any) -> str:
    """pydantic's message without its 'Value error, ' prefix (our validators' text says the fix)."""
    msg = str(e["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    return msg


def _describe_missing(owner: type[BaseModel] | None, key: str, dotted: str) -> str:
    field = owner.model_fields.get(key) if owner is not None else None
    what = f" ({field.description.rstrip('.')})" if field is not None and field.description else ""
    return f"required key '{dotted}' is missing; set it{what}."


def nearest_key(key: str, valid: list[str]) -> str | None:
    """The valid key closest to a mistyped `key` (the 'Did you mean' of unknown-key messages), or None
    when none is close."""
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return near[0] if near else None


def format_validation_error(
    model: type[BaseModel], err: ValidationError, heading: str = "invalid configuration"
) -> str:
    """Turn a pydantic ValidationError into one message per problem, each with the fix."""
    lines = []
    for e in err.errors():
        owner, key, loc = _walk_path(model, tuple(e.get("loc", ())))
        dotted = ".".join(str(x) for x in loc)
        if e["type"] == "extra_forbidden":
            valid = _field_names(owner) if owner is not None else []
            near = nearest_key(key, valid)
            prefix = ".".join(str(x) for x in loc[:-1])
            hint = f" Did you mean '{prefix + '.' if prefix else ''}{near}'?" if near else ""
            lines.append(f"unknown config key '{dotted}'.{hint} Valid keys here: {', '.join(valid)}.")
        elif e["type"] == "missing":
            lines.append(_describe_missing(owner, key, dotted))
        elif not dotted:  # a check across sections: its message names the keys
            lines.append(_message(e))
        else:
            allowed = _allowed_values(owner, key)
            lines.append(f"bad value for '{dotted}': {_message(e)}{_shown_input(e)}.{allowed}")
    return f"{heading}:\n  " + "\n  ".join(lines)


def _parse_scalar(text: str) -> Any:
    """Parse an override value the way YAML would ('1e-4' -> float, 'true' -> bool, '[1,2]' -> list)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # not YAML (an unbalanced bracket, a stray colon): the text itself
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override '{item}' has no '=': write it as dotted.key=value, e.g. policy.lr=1e-4"
            )
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = _parse_scalar(raw)
    return data


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` merged into `base` (new dict). A section whose `name` changes (a different member of a
    discriminated union, e.g. another task) replaces the base section instead of merging into it."""
    out = dict(base)
    for key, value in update.items():
        old = out.get(key)
        same_kind = not (
            isinstance(value, dict)
            and "name" in value
            and isinstance(old, dict)
            and old.get("name") != value["name"]
        )
        if isinstance(old, dict) and isinstance(value, dict) and same_kind:
            out[key] = deep_merge(old, value)
        else:
            out[key] = value
    return out


def build_config(cls: type[C], data: dict[str, Any]) -> C:
    """Validate a nested dict into `cls` on top of its defaults (so a nested override keeps the other
    defaults of its section), raising ConfigError with fix-it messages."""
    try:
        defaults = cls().model_dump(mode="json")
    except ValidationError:  # a config with required fields has no complete default
        defaults = {}
    try:
        return cls.model_validate(deep_merge(defaults, data))
    except ValidationError as err:
        raise ConfigError(format_validation_error(cls, err)) from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """'line L, column C: problem' of a YAML parse error (pyyaml counts from 0)."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and (mark is None or start.line != mark.line):
        context += f" that starts at line {start.line + 1}"
    return f"{where}{problem}" + (f" ({context})" if context else "")


def _read_yaml(p: Path) -> dict[str, Any]:
    """The mapping in the YAML file `p`; a ConfigError naming the file (and the line) otherwise."""
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(
            f"config file '{p}' is not valid YAML: {_yaml_problem(err)}. Fix it there"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file '{p}' cannot be read: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"config file '{p}' must hold a mapping at the top level (key: value lines), "
            f"not a {type(loaded).__name__}"
        )
    return loaded


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | None = None) -> C:
    """Load `cls` from an optional YAML file plus dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path))
    apply_overrides(data, overrides or [])
    return build_config(cls, data)


def dump_config(cfg: Config) -> str:
    """YAML text of a config (used in checkpoints and run directories)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
