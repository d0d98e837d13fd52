"""How a record field is read and written: the schema framework under the manifest's records.

A field's annotation says its JSON form: int, float, str, bool, dict, tuple (a JSON list), a
record (a nested object), Optional[...] (may be missing or null). `rule(...)` adds what the
annotation cannot say, in the field's metadata; `read_record` and `to_json` take everything from
the dataclasses, so a new field is one line in its record (records.py). What a record's fields
must agree on is its check, registered with `record_check` (checks.py).
"""
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Optional

from lantern.runtime.errors import LanternError

REEXPORT = "re-export the engine with `lantern-export onnx`"


@dataclass(frozen=True)
class _Rule:
    check: Optional[typing.Callable] = None  # check(json value) -> bool, on the value as the file has it
    why: str = ""  # what check wants, for the error line
    of: object = None  # a record type (or read(value, reader)) for each value of a dict / item of a tuple
    file: bool = False  # names a file of the directory: `files` must list it
    optional: bool = False  # may be missing or null although the type is not Optional (the default then)
    fix: Optional[str] = None  # what errors below this field tell the user to do
    read: Optional[typing.Callable] = None  # read(reader, name) -> value, for a field with its own JSON form
    write: Optional[typing.Callable] = None  # write(value) -> JSON, its inverse
    was: Optional[str] = None  # the field's key in files written before it was renamed (read, never written)


_PLAIN = _Rule()


def rule(check=None, why="", *, default=dataclasses.MISSING, default_factory=dataclasses.MISSING, **how):
    """A record field with its rule in the metadata (see _Rule), e.g. `rule(POSITIVE)`."""
    if isinstance(check, tuple):  # (check, why), as the shared rules below are
        check, why = check
    return field(default=default, default_factory=default_factory,
                 metadata={"lantern": _Rule(check=check, why=why, **how)})


def one_of(values, why=None):
    values = tuple(values)
    return lambda v: v in values, why or f"one of {', '.join(values)}"


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


POSITIVE = (lambda v: v > 0, "a positive integer")
AT_LEAST_0 = (lambda v: v >= 0, "an integer >= 0")
AN_ID = (lambda v: v >= 0, "an id >= 0")
NAMES = (lambda v: all(isinstance(x, str) for x in v), "a list of node names")

_RECORD_CHECKS = {}  # record type -> check(record, reader), run once its fields are read


def record_check(cls):
    """Registers the decorated check(record, reader) as what `cls`'s fields must agree on; it
    fails through the reader or returns the record (possibly normalised) or None."""
    def register(check):
        _RECORD_CHECKS[cls] = check
        return check
    return register


def _rule(f):
    return f.metadata.get("lantern", _PLAIN)


def to_json(value):
    if dataclasses.is_dataclass(value):
        return {f.name: (_rule(f).write or to_json)(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Reading: one reader for every record, driven by the fields


class Reader:
    """Typed access to one JSON object at `path` (e.g. "graphs.target.") of the file `where`;
    every failure is one LanternError naming the field and saying what to do (`fix`)."""

    def __init__(self, data, where, path="", fix=REEXPORT, key=None):
        self.where, self.path, self.fix = where, path, fix
        self.key = key  # the object's key in its parent (a graph's name, a tuned entry's settings key)
        if not isinstance(data, dict):
            self.fail("", f"must be an object, got {type(data).__name__}")
        self.data = data

    def fail(self, key, why):
        name = (self.path + key).rstrip(".")
        raise LanternError(f"{self.where}: {name + ' ' if name else ''}{why}; {self.fix}")

    def get(self, key, kind, optional=False, check=None, why=""):
        if key not in self.data:
            if optional:
                return None
            self.fail(key, "is missing")
        value = self.data[key]
        if value is None and optional:
            return None
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (check is not None and not check(value)):
            self.fail(key, f"is {value!r}, expected {why or kind.__name__}")
        return value

    def obj(self, key, optional=False, fix=None):
        value = self.get(key, dict, optional)
        return None if value is None else Reader(value, self.where, f"{self.path}{key}.", fix or self.fix)

    def done(self, known):
        unknown = sorted(set(self.data) - set(known))
        if unknown:
            self.fail("", f"has unknown field(s) {', '.join(unknown)} (written by a newer lantern?)")


def json_type(annotation):
    """(the type of a field's value, whether it may be missing or null) from its annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return annotation, False


def read_record(cls, r, **given):
    """A `cls` from the object `r` reads: each field by its annotation and rule, unknown fields
    refused, then the record's own check (record_check). `given`: fields the file holds elsewhere
    (a tuned tree's batch size is its key)."""
    values = dict(given)
    for f in dataclasses.fields(cls):
        if f.name not in given:
            values[f.name] = _read_field(r, f)
    r.done([f.name for f in dataclasses.fields(cls) if f.name not in given] +
           [_rule(f).was for f in dataclasses.fields(cls) if _rule(f).was])
    record = cls(**values)
    check = _RECORD_CHECKS.get(cls)
    return (check(record, r) or record) if check else record


def _read_field(r, f):
    how = _rule(f)
    if how.read:
        return how.read(r, f.name)
    name = f.name
    if how.was is not None and how.was in r.data:  # an engine written before the rename
        if name in r.data:
            r.fail(how.was, f"and {name} are one field under its old and new name")
        name = how.was
    kind, optional = json_type(f.type)
    record = dataclasses.is_dataclass(kind)
    value = r.get(name, dict if record else list if kind is tuple else kind, optional or how.optional,
                  how.check, how.why)
    if value is None:
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    fix = how.fix or r.fix  # what to do about what is wrong inside the value
    if record:
        return read_record(kind, Reader(value, r.where, f"{r.path}{name}.", fix))
    if how.of is None:
        return tuple(value) if kind is tuple else value
    place = [(f"{k}", v) for k, v in value.items()] if kind is dict else [(f"[{i}]", v) for i, v in enumerate(value)]
    items = {}
    for label, v in place:
        at = f"{r.path}{name}{'.' if kind is dict else ''}{label}."
        if dataclasses.is_dataclass(how.of):
            items[label] = read_record(how.of, Reader(v, r.where, at, fix, key=label))
        else:
            items[label] = how.of(v, Reader({}, r.where, at, fix))
    return items if kind is dict else tuple(items.values())


def file_references(value, path="", fix=REEXPORT):
    """(path, file name, fix) of every field marked file=True in a record and those below it."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            how, v = _rule(f), getattr(value, f.name)
            if how.file and v is not None:
                yield f"{path}{f.name}", v, fix
            elif not how.file:
                yield from file_references(v, f"{path}{f.name}.", how.fix or fix)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from file_references(v, f"{path}{k}.", fix)
    elif isinstance(value, tuple):
        for i, v in enumerate(value):
            yield from file_references(v, f"{path.rstrip('.')}[{i}].", fix)
