"""How a config field is declared and read back. A section of the experiment config is a frozen
dataclass (fields.py, objective_fields.py); each of its fields is declared once, by `knob`,
with its default, its domain (domains.py) and a one-line meaning, and a nested section by
`section`. `records(cls)` reads every field back as a `Field` with its dotted path;
`to_configdict(cls)` builds the ml_collections ConfigDict of a section (defaults.py), and
`refuse_outside(record)` checks a dataclass instance's values against their domains (the
objective's ObjectiveConfig)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterator
from typing import Any

import ml_collections
from ml_collections.config_dict import placeholder

from ess_jax.config.domains import Choice, Domain, Flag, Free, FreeForm

AnyDomain = Domain | Choice | Free | Flag | FreeForm


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of the experiment config, read back from its section's record.

    `default`: the value it takes when nothing sets it; `config_default`: what base_config
    holds (None for an optional field, `domain.optional`: the objective picks its own value,
    e.g. its paper clip range, else `default`); `type`: its Python type (the type of
    base_config's placeholder when that is None)."""

    path: str
    type: type
    default: Any
    domain: AnyDomain
    meaning: str

    @property
    def config_default(self) -> Any:
        return None if self.domain.optional else self.default


def knob(default: Any, domain: AnyDomain, meaning: str) -> Any:
    """A field of a section record: its default, its domain and what it means, in one line
    (an empty mapping default is given as {} and becomes a fresh one each time)."""
    if isinstance(default, dict):
        kw = {"default_factory": dict}
    else:
        kw = {"default": default}
    return dataclasses.field(**kw, metadata={"domain": domain, "meaning": meaning})


def section(cls: type) -> Any:
    """A nested section (model.lora): the record `cls`, whose docstring opens with its path and
    what it holds."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls})


def _value_type(annotation: Any) -> type:
    """The Python type of an annotation: `float | None` -> float, `tuple[int, ...]` -> tuple."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return typing.get_origin(annotation) or annotation


@functools.cache
def _entries(cls: type, prefix: str) -> tuple[tuple[str, Field | type], ...]:
    """(name, its Field or its nested section's record) of each field of `cls`, in order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            out.append((f.name, f.metadata["section"]))
            continue
        default = {} if f.default is dataclasses.MISSING else f.default
        kind = _value_type(hints[f.name])
        out.append((f.name, Field(prefix + f.name, kind, default, **f.metadata)))
    return tuple(out)


def records(cls: type, prefix: str = "") -> Iterator[Field | tuple[str, type]]:
    """Every field of the section record `cls` in declaration order, nested sections depth
    first: a `Field` per field, a (path, record) pair before each nested section's own."""
    for name, entry in _entries(cls, prefix):
        if isinstance(entry, Field):
            yield entry
        else:
            yield prefix + name, entry
            yield from records(entry, f"{prefix}{name}.")


def fields(cls: type) -> dict[str, Field]:
    """path -> Field of every field of the section record `cls` (nested ones by dotted path)."""
    return {r.path: r for r in records(cls) if isinstance(r, Field)}


def to_configdict(cls: type) -> ml_collections.ConfigDict:
    """The ConfigDict of the section record `cls`: each field's `config_default` in declaration
    order (None as a placeholder of the field's type), nested sections as ConfigDicts."""
    c = ml_collections.ConfigDict()
    for name, entry in _entries(cls, ""):
        if not isinstance(entry, Field):
            setattr(c, name, to_configdict(entry))
            continue
        value = entry.config_default
        if isinstance(value, dict):
            value = dict(value)  # a fresh mapping each time (task.difficulty)
        setattr(c, name, placeholder(entry.type) if value is None else value)
    return c


@functools.cache
def _checks(cls: type) -> tuple[tuple[str, AnyDomain, bool], ...]:
    """(name, domain, None allowed) of each field of the record `cls`."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, f.metadata["domain"], type(None) in typing.get_args(hints[f.name]))
        for f in dataclasses.fields(cls)
    )


def refuse_outside(record: Any) -> None:
    """Each field of the dataclass instance `record` in its domain (None only where the field's
    type allows it); else ValueError naming the field and what it must be."""
    for name, domain, allows_none in _checks(type(record)):
        value = getattr(record, name)
        if value is None:
            if allows_none:
                continue
            raise ValueError(f"{name}: needs a value, got None")
        if not domain.contains(value):
            raise ValueError(f"{name}={value!r}: must be {domain.describe()}")
