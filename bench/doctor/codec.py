"""Dataclasses to and from JSON objects, the report's one writer (`to_json`) and one reader
(`from_json`). A field marked `omitted()` is left out where None, one marked `flat()` writes its
keys into its owner's object; a union of parts reads as the one whose keys are there."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import field
from typing import Union

_OMITTED = "omitted"  # a key only where it applies: left out of the JSON when None
_FLAT = "flat"  # a part whose keys sit in its owner's JSON object, not under a key of its own


def omitted():
    """A field written only where it is not None."""
    return field(default=None, metadata={_OMITTED: True})


def flat(*, optional: bool = False):
    """A part whose keys are written into its owner's object; `optional`: None, and nothing written."""
    return field(default=None, metadata={_FLAT: True}) if optional else field(metadata={_FLAT: True})


def to_json(value):
    """`value` (a dataclass, a list of them, or a plain value) as JSON's types."""
    if dataclasses.is_dataclass(value):
        out: dict = {}
        for f in dataclasses.fields(value):
            got = getattr(value, f.name)
            if f.metadata.get(_FLAT):
                out.update(to_json(got) if got is not None else {})
            elif got is not None or not f.metadata.get(_OMITTED):
                out[f.name] = to_json(got)
        return out
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def from_json(cls, data: dict):
    """A `cls` from its JSON object. A key missing (a report of an older doctor, a test's partial
    one) reads as None; a part whose keys are all missing is None."""
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get(_FLAT):
            values[f.name] = _read_flat(hints[f.name], data)
        else:
            values[f.name] = _read(hints[f.name], data.get(f.name))
    return cls(**values)


def _read(kind, value):
    if value is None:
        return None
    kinds = _members(kind)
    if dataclasses.is_dataclass(kinds[0]):
        return from_json(_pick(kinds, value), value)
    if typing.get_origin(kinds[0]) is list:
        item = typing.get_args(kinds[0])[0]
        return [_read(item, v) for v in value]
    return value


def _read_flat(kind, data: dict):
    kinds = _members(kind)
    if type(None) in typing.get_args(kind) and not any(_keys(k) & data.keys() for k in kinds):
        return None
    return from_json(_pick(kinds, data), data)


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _members(kind) -> list:
    """The types a field may hold, None aside."""
    if typing.get_origin(kind) in (Union, types.UnionType):
        return [k for k in typing.get_args(kind) if k is not type(None)]
    return [kind]


def _pick(kinds: list, data: dict):
    """Which of `kinds` `data` is: the first whose own keys are all there, else the first with any."""
    whole = [k for k in kinds if _own_keys(k) <= data.keys()]
    some = [k for k in kinds if _keys(k) & data.keys()]
    return (whole or some or kinds)[0]


def _own_keys(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if not f.metadata.get(_FLAT)}


def _keys(cls) -> set[str]:
    """Every key `cls` writes, those of its flat parts too."""
    hints = _hints(cls)
    keys = _own_keys(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get(_FLAT):
            keys |= set().union(*(_keys(k) for k in _members(hints[f.name])))
    return keys
