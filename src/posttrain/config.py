"""Typed configuration: a pydantic base class, YAML loading and dotted command-line overrides.

Every component declares its own config class next to its code (fields documented where they are
declared) by subclassing `Config`. This module only knows how to load, override and validate them,
and how to turn a validation failure into a message that names the key, the allowed values and the
nearest valid key.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

C = TypeVar("C", bound="Config")


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message says how to fix it."""


class Config(BaseModel):
    """Base of every config: unknown keys are errors, assignments are validated.

    `refused_keys` (of a command's top-level config): dotted keys its run sets itself or never reads,
    each with what to do instead. Writing one (in a file or an override) is a ConfigError at load
    (`build_config`), `config show` does not list them and `dump_config` leaves them out."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
    refused_keys: ClassVar[dict[str, str]] = {}


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


def validation_problems(err: ValidationError) -> str:
    """The messages of a pydantic error, joined (for a check that validates a nested config itself)."""
    return "; ".join(_message(e) for e in err.errors())


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
        elif e["type"] == "union_tag_not_found":  # a union section without its `name`
            kinds = ", ".join(repr(tag_of(m)) for m in _field_models(owner, key))
            lines.append(f"'{dotted}' does not say which kind it is: set {dotted}.name (one of {kinds}).")
        elif not dotted:  # a check across sections: its message names the keys
            lines.append(_message(e))
        else:
            allowed = _allowed_values(owner, key)
            lines.append(f"bad value for '{dotted}': {_message(e)}{_shown_input(e)}.{allowed}")
    return f"{heading}:\n  " + "\n  ".join(lines)


# ------------------------------------------------------------------ YAML: config files and override values

_TAG = "tag:yaml.org,2002:"
# YAML 1.2's core schema for plain scalars (PyYAML implements YAML 1.1): (tag, pattern, first characters)
_RESOLVERS = (
    (_TAG + "bool", r"^(?:[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee])$", "tTfF"),
    (
        _TAG + "int",
        r"^[-+]?(?:[0-9](?:_?[0-9])*|0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+)$",
        "-+0123456789",
    ),
    (
        _TAG + "float",
        r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?"
        r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF))|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
    (_TAG + "null", r"^(?:~|null|Null|NULL|None|)$", ["~", "n", "N", ""]),
)


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading plain scalars as YAML 1.2 does, for config files and override values:
    only true/false (any case) are booleans (`off`, `no`, `y` stay strings: `routing_replay: off` is
    the value 'off'); an integer with a leading zero is decimal (`0123` is 123; 0x, 0o and 0b keep their
    base); `1e-8` is a float as `1.0e-8` is (YAML 1.1 wants the dot); null is null, ~, None or nothing;
    no timestamps."""


YamlLoader.yaml_implicit_resolvers = {  # PyYAML's anchors, aliases and merge keys; no 1.1 scalar types
    first: [(tag, rx) for tag, rx in found if tag in (_TAG + "merge", _TAG + "yaml")]
    for first, found in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    prefixed = text.lstrip("+-")[:2].lower() in ("0x", "0o", "0b")
    return int(text, 0 if prefixed else 10)  # '0123' -> 123 (YAML 1.1: octal 83)


YamlLoader.add_constructor(_TAG + "int", _construct_int)


class YamlDumper(yaml.SafeDumper):
    """Writes config YAML that YamlLoader and PyYAML's own safe_load both read back as written: a string
    that either would read as another type ('off', '0123', '1e-8', 'None') is quoted."""


for _tag, _pattern, _first in _RESOLVERS:
    YamlLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))
    YamlDumper.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))
_NULL = re.compile(_RESOLVERS[3][1])


def _parse_scalar(text: str) -> Any:
    """An override's value, read as a config file's value is (YamlLoader: `1e-4` a float, `true` a bool,
    `None` or `null` None, `[1, 2]` a list, `{a: 1}` a mapping; quotes make a string), except that text
    YAML would cut or reshape stays the text as written: ` #` starts no comment (`runs/exp #3`), `: `
    makes no mapping (`Answer: <n>`), a line break is kept."""
    stripped = text.strip()
    try:
        value = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError:
        return stripped  # not YAML (an unbalanced bracket, a stray colon): the text itself
    quoted = stripped[:1] in ("'", '"')
    if isinstance(value, str) and value != stripped and not quoted:
        return stripped
    if isinstance(value, (dict, list)) and stripped[:1] not in ("{", "["):
        return stripped
    if value is None and not quoted and not _NULL.match(stripped):
        return stripped  # '...' (YAML's end of document) is text
    return value


def _section(data: dict[str, Any], parts: list[str], item: str, create: bool) -> dict[str, Any] | None:
    """The section of `data` at `parts` (made when `create`; None when absent); a ConfigError when a part
    of the way is a value."""
    node = data
    for part in parts:
        child = node.get(part)
        if child is None and not create:
            return None
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
        node = child
    return node


def apply_overrides(
    data: dict[str, Any], overrides: list[str], model: type[BaseModel] | None = None
) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (in place) and return it. The overrides merge into
    `data` as `deep_merge` merges with the config class `model`: one that changes a task's or an
    environment's `name` replaces that section of `data` (in any order with the section's other
    overrides); a mapping value merges into the section it sets."""
    update: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override '{item}' has no '=': write it as dotted.key=value, e.g. policy.optimizer.lr=1e-4"
            )
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        _section(data, parts[:-1], item, create=False)
        target = _section(update, parts[:-1], item, create=True)
        value, earlier = _parse_scalar(raw), target.get(parts[-1])  # type: ignore[union-attr]
        if isinstance(earlier, dict) and isinstance(value, dict):  # an earlier override of the section
            value = deep_merge(earlier, value)
        target[parts[-1]] = value  # type: ignore[index]
    merged = deep_merge(data, update, model)
    data.clear()
    data.update(merged)
    return data


def _field_models(model: type[BaseModel] | None, key: str) -> list[type[BaseModel]]:
    """The config classes field `key` of `model` holds (several: a discriminated union, as task or env)."""
    field = model.model_fields.get(key) if model is not None else None
    return model_candidates(field.annotation) if field is not None else []


def _kind(model: type[BaseModel], key: str, section: dict[str, Any]) -> Any:
    """The kind (`name`) of a union section: its own, else that of the field's default (a task without
    `name` is the default task)."""
    if "name" in section:
        return section["name"]
    return getattr(model.model_fields[key].get_default(call_default_factory=True), "name", None)


def deep_merge(
    base: dict[str, Any], update: dict[str, Any], model: type[BaseModel] | None = None
) -> dict[str, Any]:
    """`update` merged into `base` (new dict); `model` is the config class both describe (None: merge
    every section). A section that is a discriminated union (task, env) whose `name` changes (another
    task) replaces the base section instead of merging into it; any other section merges key by key
    (`policy.optimizer.name=torch.optim.Adam` keeps the other optimizer keys)."""
    out = dict(base)
    for key, value in update.items():
        old = out.get(key)
        if not (isinstance(old, dict) and isinstance(value, dict)):
            out[key] = value
            continue
        kinds = _field_models(model, key)
        if len(kinds) > 1:
            kind = _kind(model, key, old)  # model is set: a field has kinds
            if "name" in value and value["name"] != kind:
                out[key] = value
                continue
            kinds = [m for m in kinds if tag_of(m) == kind]
        out[key] = deep_merge(old, value, kinds[0] if len(kinds) == 1 else None)
    return out


_UNWRITTEN = object()


def _written(data: dict[str, Any], path: str) -> Any:
    """The value of the dotted key `path` in the nested dict `data`, `_UNWRITTEN` where it has none."""
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _UNWRITTEN
        node = node[part]
    return node


def build_config(cls: type[C], data: dict[str, Any]) -> C:
    """Validate a nested dict into `cls` on top of its defaults (so a nested override keeps the other
    defaults of its section), raising ConfigError with fix-it messages. A key of `cls.refused_keys`
    in `data` is refused unless it holds its default (a config.yaml written by an older version lists
    every key)."""
    try:
        defaults = cls().model_dump(mode="json")
    except ValidationError:  # a config with required fields has no complete default
        defaults = {}
    refused = [
        f"'{k}' cannot be set: {why}"
        for k, why in cls.refused_keys.items()
        if _written(data, k) is not _UNWRITTEN and _written(data, k) != _written(defaults, k)
    ]
    if refused:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(refused))
    try:
        return cls.model_validate(deep_merge(defaults, data, cls))
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
        loaded = yaml.load(p.read_text(), Loader=YamlLoader) or {}
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
    apply_overrides(data, overrides or [], cls)
    return build_config(cls, data)


def dump_config(cfg: Config) -> str:
    """YAML text of a config (used in checkpoints and run directories), without its `refused_keys`: the
    file loads back with --config."""
    data = cfg.model_dump(mode="json")
    for key in cfg.refused_keys:
        *parts, last = key.split(".")
        node = _written(data, ".".join(parts)) if parts else data
        if isinstance(node, dict):
            node.pop(last, None)
    return yaml.dump(data, Dumper=YamlDumper, sort_keys=False)
