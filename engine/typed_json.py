"""Parsed JSON checked against a record's type hints and built into the record, fast enough for big traces.

`decoder(tp)` compiles a type hint (a dataclass, list[...], dict[str, ...], X | None, an Enum, int,
float, str, bool, or an untyped dict) into a function, once per type. The function checks a value
that `json.loads` produced and builds it: required and unknown keys, exact types (a bool is not an
int), finite floats, Enum values and bounded list lengths. The happy path formats no strings; a
failure raises `Invalid`, and each enclosing level adds its part of the path ("positions[2].token")
only then. Recursion follows the type, never the value, so a deeply nested value cannot go deeper
than the record's own shape.
"""
from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from enum import Enum
from functools import cache
from typing import Any

MAX_LIST_LEN = 1 << 20      # no list in a sane record comes near this; a bound keeps a hostile file cheap

Decode = Callable[[Any], Any]


class Invalid(ValueError):
    """A value does not fit its type. `path` is filled in innermost first as the error unwinds."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []

    def at(self, where: str) -> str:
        """The message prefixed with the full path, e.g. "round.positions[2].token: expected ..."."""
        return f"{where}{''.join(reversed(self.path))}: {self.message}"


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def decode(tp: Any, value: Any, where: str, overrides: Mapping[tuple[type, str], Decode] | None = None) -> Any:
    """Check and build `value` as `tp`; raises Invalid whose `at(where)` names the failing field."""
    return decoder(tp, _freeze(overrides))(value)


def _freeze(overrides: Mapping[tuple[type, str], Decode] | None) -> tuple:
    return tuple(sorted(overrides.items(), key=lambda kv: (kv[0][0].__name__, kv[0][1]))) if overrides else ()


@cache
def decoder(tp: Any, overrides: tuple = ()) -> Decode:
    """The compiled check-and-build function for type hint `tp`. `overrides` are ((class, field), decode)
    pairs for fields whose JSON form needs more than their hint says."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return _optional(tp, overrides)
    if origin is list:
        return _list(decoder(typing.get_args(tp)[0], overrides), typing.get_args(tp)[0])
    if origin is dict:
        return _mapping(decoder(typing.get_args(tp)[1], overrides))
    if is_dataclass(tp):
        return _dataclass(tp, overrides)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _enum(tp)
    scalar = _SCALARS.get(tp)
    if scalar is None:
        raise TypeError(f"no decoder for {tp!r}")   # a new record field type: extend this module
    return scalar


def _optional(tp: Any, overrides: tuple) -> Decode:
    args = typing.get_args(tp)
    inner = decoder(next(a for a in args if a is not type(None)), overrides)
    if type(None) not in args:
        return inner
    return lambda value: None if value is None else inner(value)


def _list(item: Decode, item_type: Any) -> Decode:
    def check(value: Any) -> list:
        if type(value) is not list:
            raise Invalid(f"expected a list, got {type_name(value)}")
        if len(value) > MAX_LIST_LEN:
            raise Invalid(f"list of {len(value)} items exceeds the limit of {MAX_LIST_LEN}")
        if item_type is int and all(type(v) is int for v in value):   # token ids, slots: the common case
            return value
        try:
            return [item(v) for v in value]
        except Invalid as exc:
            exc.path.append(f"[{_first_bad(item, value)}]")
            raise
    return check


def _first_bad(item: Decode, value: list) -> int:
    """The index of the first item that fails (only called once one has)."""
    for i, v in enumerate(value):
        try:
            item(v)
        except Invalid:
            return i
    return -1


def _mapping(item: Decode) -> Decode:
    def check(value: Any) -> dict:
        if type(value) is not dict:
            raise Invalid(f"expected an object, got {type_name(value)}")
        out = {}
        for key, v in value.items():
            try:
                out[key] = item(v)
            except Invalid as exc:
                exc.path.append(f".{key}")
                raise
        return out
    return check


def _dataclass(cls: type, overrides: tuple) -> Decode:
    hints = typing.get_type_hints(cls)
    special = dict(overrides)
    names = tuple(f.name for f in fields(cls))
    expected = frozenset(names)
    parts = tuple((name, special.get((cls, name)) or decoder(hints[name], overrides)) for name in names)

    def check(value: Any) -> Any:
        if type(value) is not dict:
            raise Invalid(f"expected an object, got {type_name(value)}")
        if value.keys() != expected:
            missing = [n for n in names if n not in value]
            if missing:
                raise Invalid(f"missing key(s) {', '.join(missing)}")
            raise Invalid(f"unknown key(s) {', '.join(sorted(set(value) - expected))}")
        kwargs = {}
        name = ""
        try:
            for name, part in parts:
                kwargs[name] = part(value[name])
        except Invalid as exc:
            exc.path.append(f".{name}")
            raise
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:   # the record's own __post_init__ checks
            raise Invalid(str(exc)) from None
    return check


def _enum(cls: type[Enum]) -> Decode:
    by_value = {e.value: e for e in cls}
    allowed = ", ".join(str(v) for v in by_value)

    def check(value: Any) -> Enum:
        try:
            return by_value[value]
        except (KeyError, TypeError):   # TypeError: an unhashable value such as a list
            raise Invalid(f"{value!r} is not one of {allowed}") from None
    return check


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise Invalid(f"expected true or false, got {type_name(value)}")
    return value


def _int(value: Any) -> int:
    if type(value) is not int:
        raise Invalid(f"expected an integer, got {type_name(value)}")
    return value


def _float(value: Any) -> float:
    kind = type(value)
    if kind is float:
        if not math.isfinite(value):
            raise Invalid(f"{value} is not a finite number")
        return value
    if kind is int:
        return float(value)
    raise Invalid(f"expected a number, got {type_name(value)}")


def _str(value: Any) -> str:
    if type(value) is not str:
        raise Invalid(f"expected a string, got {type_name(value)}")
    problem = unicode_problem(value)
    if problem is not None:   # JSON can spell a lone surrogate ("\\ud800"); no renderer or encoder takes one
        raise Invalid(f"the text {problem}")
    return value


def unicode_problem(text: str) -> str | None:
    """None when every character of `text` can be encoded as UTF-8; else what is wrong, naming the first bad
    character and where it is ("contains '\\ud800' at character 3, which is not valid Unicode text (a lone
    surrogate)"). A str holds such a character after a broken paste, a JSON escape or a non-UTF-8 command line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"contains {text[exc.start]!r} at character {exc.start + 1}, which is not valid Unicode text "
                "(a lone surrogate)")
    return None


def _object(value: Any) -> dict:
    """An untyped dict field (a trace header's config): its contents are checked by whoever reads it."""
    if type(value) is not dict:
        raise Invalid(f"expected an object, got {type_name(value)}")
    return value


_SCALARS: Mapping[Any, Decode] = types.MappingProxyType(
    {bool: _bool, int: _int, float: _float, str: _str, dict: _object})
