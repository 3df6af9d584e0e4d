"""The keys of a config class, for `posttrain config show`: one entry per key that a config file or a dotted
override sets, with its type as written, its value and its field's description, and the listing as text.

A nested section's keys are dotted paths (`policy.optimizer.lr`). A section that may be one of several
configs (a discriminated union such as `task` or `env`, or an optional section such as `policy.lora`) has
an entry of its own, followed by each alternative's keys under the condition that selects it
(`when env.name=calculator`, `when policy.lora is set`). A list of sections (`policy.scheduler`) is one key,
set as a whole; the keys of its items follow as `policy.scheduler[].kind`. Values are those of the config
walked (its defaults when it was built with no file and no override); an alternative that is not in
effect shows its own defaults.
"""

from __future__ import annotations

import json
import math
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from posttrain.config import ConfigError, YamlDumper, model_candidates, nearest_key, tag_of


@dataclass(frozen=True)
class Condition:
    """When the keys below it apply: `text` reads 'when env.name=calculator', 'when policy.lora is set' or
    'each item of policy.scheduler'; `holds` whether it does in the config walked (None: list items)."""

    text: str
    holds: bool | None


@dataclass(frozen=True)
class ConfigKey:
    """One key: its dotted path, type as written, JSON-able value (`model_dump(mode='json')`'s) and
    description, and the conditions (outermost first) under which it applies."""

    path: str
    type: str
    value: Any
    description: str
    required: bool = False  # no default: a config must set it (value None)
    section: bool = False  # a section of several alternatives (or none); their keys follow this entry
    item: bool = False  # a key of a list's items: set through the list, not by its own override
    when: tuple[Condition, ...] = ()
    selects: tuple[str, ...] = ()  # the overrides that make the key apply (`env.name=calculator`)

    @property
    def value_text(self) -> str:
        """The value as an override or a YAML file writes it; '(required)' for a key without default."""
        if self.required:
            return "(required)"
        if self.section and isinstance(self.value, dict):
            return "(section)"  # its keys follow, under the note of the alternative in effect
        return yaml_text(self.value)


def yaml_text(value: Any) -> str:
    """`value` on one line as YAML reads it back (`null`, `true`, `[+, '-']`, `1e-05`); a string with a line
    break in JSON's double quotes, which YAML reads too."""
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    text = yaml.dump(
        value, Dumper=YamlDumper, default_flow_style=True, width=math.inf, allow_unicode=True, sort_keys=False
    )
    text = text.removesuffix("\n...\n").strip()
    return json.dumps(value, ensure_ascii=False) if "\n" in text else text


def type_text(ann: Any) -> str:
    """An annotation as written: `list[float]`, `int | None`, a Literal's values as `'a' | 'b'`."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return "None"
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_text(a) for a in args)}]"
    if ann is typing.Any:
        return "Any"
    return ann.__name__ if isinstance(ann, type) else str(ann).removeprefix("typing.")


def _written_type(model: type[BaseModel], name: str) -> str:
    """A field's annotation as its source writes it (`EnvConfig | None`, not the union it stands for)."""
    for klass in model.__mro__:
        written = klass.__dict__.get("__annotations__", {}).get(name)
        if isinstance(written, str):
            return written
    return type_text(model.model_fields[name].annotation)


@dataclass(frozen=True)
class _Walk:
    """Where the keys met in a walk apply, and what an alternative's `name` key says."""

    when: tuple[Condition, ...] = ()
    selects: tuple[str, ...] = ()
    item: bool = False
    kinds: str = ""  # 'calculator | guess | ...' inside an alternative of a union

    def inside(
        self, cond: Condition, selects: tuple[str, ...] = (), item: bool = False, kinds: str = ""
    ) -> _Walk:
        return _Walk(self.when + (cond,), self.selects + selects, self.item or item, kinds)

    def section(self) -> _Walk:
        """The walk of a plain section below: same conditions, no alternative's `name` of its own."""
        return _Walk(self.when, self.selects, self.item)

    def key(self, path: str, type_: str, value: Any, description: str, **kw: Any) -> ConfigKey:
        return ConfigKey(
            path, type_, value, description, item=self.item, when=self.when, selects=self.selects, **kw
        )


def config_keys(cls: type[BaseModel], cfg: BaseModel | None = None) -> list[ConfigKey]:
    """Every key of `cls` in declaration order, with the values of `cfg` (default: `cls()`, or the class
    defaults of each field when `cls` has required keys); not the keys its command refuses
    (`Config.refused_keys`: it sets them itself, or does not read them)."""
    if cfg is None:
        try:
            cfg = cls()
        except ValidationError:
            cfg = None
    refused = getattr(cls, "refused_keys", {})
    return [k for k in _walk(cls, cfg, "", _Walk()) if k.path not in refused]


def _value(instance: BaseModel | None, name: str, info: FieldInfo) -> tuple[Any, bool]:
    """(value, required): the instance's value, else the field's default (a default_factory's built one)."""
    if instance is not None:
        return getattr(instance, name), False
    if info.is_required():
        return None, True
    return info.get_default(call_default_factory=True), False


def _walk(
    model: type[BaseModel], instance: BaseModel | None, prefix: str, state: _Walk
) -> Iterator[ConfigKey]:
    fields = list(model.model_fields.items())
    if state.kinds:  # an alternative of a union: its `name` (what selects it) first
        fields.sort(key=lambda kv: kv[0] != "name")
    for name, info in fields:
        path, ann = prefix + name, info.annotation
        value, required = _value(instance, name, info)
        description = info.description or ""
        if name == "name" and state.kinds and not description:
            description = f"which kind of {prefix.rstrip('.')} this is: {state.kinds}"
        models, origin = model_candidates(ann), typing.get_origin(ann)
        if not models:
            yield state.key(path, type_text(ann), to_jsonable_python(value), description, required=required)
        elif models == [ann]:  # a plain section: its keys
            sub = value if isinstance(value, ann) else None
            yield from _walk(ann, sub, path + ".", state.section())
        elif origin in (list, tuple, set, dict):  # sections in a container: set as a whole
            yield state.key(path, type_text(ann), to_jsonable_python(value), description, required=required)
            if origin is not dict:
                cond = Condition(f"each item of {path}", None)
                yield from _walk(models[0], None, path + "[].", state.inside(cond, item=True))
        else:  # one of several sections, or none
            yield from _alternatives(model, name, path, value, required, description, models, state)


def _alternatives(
    model: type[BaseModel],
    name: str,
    path: str,
    value: Any,
    required: bool,
    description: str,
    models: list[type[BaseModel]],
    state: _Walk,
) -> Iterator[ConfigKey]:
    """The entry of a union or optional section, then each alternative's keys under its condition."""
    tags = [tag_of(m) for m in models]
    kinds = " | ".join(str(t) for t in tags if t is not None)
    if kinds and not description:
        description = f"{path}.name picks one of: {kinds}"
    shown = to_jsonable_python(value)
    yield state.key(path, _written_type(model, name), shown, description, required=required, section=True)
    for alt, tag in zip(models, tags):
        holds = isinstance(value, alt)
        if tag is None:
            inner = state.inside(Condition(f"when {path} is set", holds), kinds=kinds)
        else:
            select = f"{path}.name={tag}"
            inner = state.inside(Condition(f"when {select}", holds), (select,), kinds=kinds)
        yield from _walk(alt, value if holds else None, path + ".", inner)


def _under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or a key inside it (a list's items count as inside the list, with or
    without their `[]`)."""
    path, prefix = path.replace("[]", ""), prefix.replace("[]", "")
    return path == prefix or path.startswith(prefix + ".")


def select(keys: list[ConfigKey], prefix: str, what: str = "config") -> list[ConfigKey]:
    """The keys at or under `prefix` (a key or a section, dotted); a ConfigError that names the nearest
    valid key when there are none."""
    prefix = prefix.strip().rstrip(".")
    chosen = [k for k in keys if _under(k.path, prefix)]
    if not chosen:
        raise ConfigError(_unknown(keys, prefix, what))
    return chosen


def _unknown(keys: list[ConfigKey], prefix: str, what: str) -> str:
    """'unknown config key ...' with the nearest valid key and the keys valid where it went wrong, as for
    an unknown key in a config file."""
    real = {k.path.replace("[]", ""): k.path for k in keys}  # list items are matched without their []
    known = {".".join(p.split(".")[:n]) for p in real for n in range(1, p.count(".") + 2)}
    parts = prefix.replace("[]", "").split(".")
    depth = 0  # parts[:depth] is a known section (or key), parts[depth] the first wrong name
    while depth < len(parts) - 1 and ".".join(parts[: depth + 1]) in known:
        depth += 1
    parent = ".".join(parts[:depth])
    children = list(
        dict.fromkeys(p.split(".")[depth] for p in real if not parent or _under(p, parent) and p != parent)
    )
    if not children:  # below a key that is not a section
        return (
            f"unknown config key '{prefix}' for {what}: '{real.get(parent, parent)}' is a key, not a section."
        )
    near = nearest_key(parts[depth], children)
    if near is not None:
        guess = ".".join([*parts[:depth], near])
        longer = ".".join([guess, *parts[depth + 1 :]])
        guess = longer if longer in known else guess
    else:  # a section left out in front (`optimizer.lr` for `policy.optimizer.lr`), or any close key
        ends = [p for p in sorted(known, key=len) if p.endswith("." + ".".join(parts))]
        guess = ends[0] if ends else nearest_key(".".join(parts), sorted(known))
    hint = f" Did you mean '{real.get(guess, guess)}'?" if guess else ""
    where = f"under '{real.get(parent, parent)}'" if parent else "here"
    return f"unknown config key '{prefix}' for {what}.{hint} Valid keys {where}: {', '.join(children)}."


def render(keys: list[ConfigKey], value_label: str = "default", width: int = 100) -> str:
    """The keys as aligned text no wider than `width` where it can be: `KEY  TYPE  VALUE` lines, each key's
    description below it (indented, wrapped); a note line `(when env.name=calculator)` opens the keys of
    an alternative, which are indented under it. A value that does not fit goes on a line of its own."""
    key_w = min(max(2 * len(k.when) + len(k.path) for k in keys), 48)
    type_w = min(max(len(k.type) for k in keys), 30)
    lines = [f"{'KEY':<{key_w}}  {'TYPE':<{type_w}}  {value_label.upper()}"]
    before: tuple[Condition, ...] = ()
    for k in keys:
        pad, indent = "  " * len(k.when), "  " * len(k.when) + "    "
        notes = _notes(before, k.when)
        if (notes or len(k.when) < len(before)) and len(lines) > 1:
            lines.append("")  # a blank line sets an alternative's keys apart
        lines.extend(notes)
        before = k.when
        head = f"{pad + k.path:<{key_w}}  {k.type:<{type_w}}"
        value = k.value_text
        if len(head) + 2 + len(value) <= width:
            lines.append(f"{head}  {value}".rstrip())
        else:  # a long value (or type) goes on a line of its own, wrapped between list items
            lines += (
                [head.rstrip()] if len(head.rstrip()) <= width else [pad + k.path, f"{indent}type: {k.type}"]
            )
            lines += textwrap.wrap(
                value,
                width,
                initial_indent=f"{indent}{value_label}: ",
                subsequent_indent=indent + "  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        lines += textwrap.wrap(k.description, width, initial_indent=indent, subsequent_indent=indent)
    return "\n".join(lines)


def _notes(before: tuple[Condition, ...], now: tuple[Condition, ...]) -> list[str]:
    """The note lines that open the conditions of `now` not already open in `before`."""
    return [
        f"{'  ' * i}({cond.text}{'; in effect' if cond.holds else ''})"
        for i, cond in enumerate(now)
        if before[: i + 1] != now[: i + 1]
    ]
