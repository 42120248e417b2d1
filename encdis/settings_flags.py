"""Settings flags: a node's frozen settings dataclass, built from CLI flags and ENCDIS_* variables.

Every field `some_field` becomes the flag `--some-field`, whose default is read from the
environment variable ENCDIS_SOME_FIELD, then from the dataclass, so a systemd
EnvironmentFile or a Kubernetes env block configures a node without changing its command
line. Flag types come from the field annotations:

    int, float, str, Path     the value as given
    bool                      --flag / --no-flag; in the environment 1/0, true/false, yes/no, on/off
    X | None                  an empty value means None
    tuple[str, ...]           a comma-separated list ("a:1, b:2" -> ("a:1", "b:2"))
    a settings dataclass      nested: its fields are flags of their own, at the same flat level
                              (a name used twice is an error); their defaults come from the
                              outer field's default instance

A field without a default is required: from_args refuses a missing or empty value. An
empty environment variable counts as unset. A bad environment value is reported by
from_args (naming the variable) unless the flag overrides it; a bad flag value is an
argparse error. Validation beyond types stays in each dataclass's __post_init__.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "ENCDIS_"

# The --dtype values both nodes accept ("auto": float32 on CPU, the node's GPU default otherwise).
DTYPES = ("auto", "float32", "bfloat16", "float16")

S = TypeVar("S")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_name(field_name: str) -> str:
    """ENCDIS_<FIELD_UPPER>: the variable that gives the field's flag its default."""
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class _InvalidEnv:
    """A default whose environment value did not parse; an error only if no flag replaces it."""

    variable: str
    raw: str
    reason: str

    def __repr__(self) -> str:
        return f"invalid {self.variable}={self.raw!r}"


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected one of {'/'.join(_TRUE + _FALSE)}, got {text!r}")


def parse_list(text: str) -> tuple[str, ...]:
    """A comma-separated list; blanks around items and empty items are dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _optional(conv: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return conv(text) if text else None

    parse.__name__ = getattr(conv, "__name__", "value")  # argparse names it in "invalid <name> value"
    return parse


def _converter(annotation: Any) -> Callable[[str], Any]:
    """The str -> value function for a resolved field annotation."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported settings annotation {annotation!r}")
        return _optional(_converter(inner[0]))
    if origin is tuple and args == (str, ...):
        return parse_list
    if annotation is bool:
        return parse_bool
    if annotation in (int, float, str, Path):
        return annotation
    raise TypeError(f"unsupported settings annotation {annotation!r}")


@dataclasses.dataclass(frozen=True)
class _Flag:
    """One leaf field of a settings tree: its name, type and default."""

    name: str
    annotation: Any
    default: Any
    required: bool


def _fields(settings_cls: type) -> list[tuple[dataclasses.Field, Any]]:
    # get_type_hints evaluates the string annotations that `from __future__ import annotations` leaves.
    hints = typing.get_type_hints(settings_cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(settings_cls) if f.init]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None  # required: from_args refuses it


def _flags(settings_cls: type, defaults: Any = None) -> list[_Flag]:
    """Every leaf field of `settings_cls`, nested settings dataclasses flattened in place;
    `defaults` is the instance a nested class's defaults come from."""
    out: list[_Flag] = []
    for f, annotation in _fields(settings_cls):
        default = _default(f) if defaults is None else getattr(defaults, f.name)
        if dataclasses.is_dataclass(annotation):
            out.extend(_flags(annotation, default))
            continue
        required = defaults is None and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append(_Flag(f.name, annotation, default, required))
    names = [flag.name for flag in out]
    if len(set(names)) != len(names):
        raise TypeError(f"{settings_cls.__name__}: a field name is used twice among its nested settings")
    return out


def flat_values(settings: Any) -> dict[str, Any]:
    """Every leaf field of a settings instance by its flag's field name, nested settings flattened."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        out.update(flat_values(value) if dataclasses.is_dataclass(value) else {f.name: value})
    return out


def _build(settings_cls: type[S], values: Mapping[str, Any]) -> S:
    kwargs = {}
    for f, annotation in _fields(settings_cls):
        kwargs[f.name] = _build(annotation, values) if dataclasses.is_dataclass(annotation) else values[f.name]
    return settings_cls(**kwargs)


def add_arguments(parser: argparse.ArgumentParser, settings_cls: type, help: Mapping[str, str], *,
                  environ: Mapping[str, str] | None = None,
                  choices: Mapping[str, Collection[str]] | None = None) -> None:
    """One flag per field of `settings_cls`, defaulting to its ENCDIS_* variable in `environ`
    (os.environ if None), then to the field's default. `help` has a text for every field;
    `choices` restricts a field's flag values (argparse refuses others)."""
    env = os.environ if environ is None else environ
    for f in _flags(settings_cls):
        annotation = f.annotation
        if f.name not in help:
            raise KeyError(f"{settings_cls.__name__}.{f.name} has no help text")
        conv = _converter(annotation)
        variable = env_name(f.name)
        raw = env.get(variable)
        default: Any = f.default
        if raw:
            try:
                default = conv(raw)
            except argparse.ArgumentTypeError as e:
                default = _InvalidEnv(variable, raw, str(e))
            except ValueError:
                default = _InvalidEnv(variable, raw, f"not a valid {getattr(conv, '__name__', 'value')}")
        suffix = "[required]" if f.required and default is None else f"(default {default!r})"
        text = f"{help[f.name]} {suffix} [env {variable}]".replace("%", "%%")  # argparse %-formats help
        kwargs: dict[str, Any] = {"default": default, "help": text}
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = conv
            if choices and f.name in choices:
                kwargs["choices"] = list(choices[f.name])
        parser.add_argument(flag_name(f.name), **kwargs)


def from_args(settings_cls: type[S], args: argparse.Namespace) -> S:
    """The settings from parsed flags; ValueError names a missing required flag or a bad variable."""
    values: dict[str, Any] = {}
    for f in _flags(settings_cls):
        value = getattr(args, f.name)
        if isinstance(value, _InvalidEnv):
            raise ValueError(f"{value.variable}={value.raw!r}: {value.reason} (for {flag_name(f.name)})")
        if f.required and value in (None, "", ()):
            raise ValueError(f"{flag_name(f.name)} is required (or set {env_name(f.name)})")
        values[f.name] = value
    return _build(settings_cls, values)
