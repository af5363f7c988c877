"""The JSON of the archive's records (graphpersist.archive.manifest): manifest.json and rank.json, strict both ways.

Reading is total: any bytes give a record or a ManifestError naming the problem. The JSON itself is read by
safejson (strict: UTF-8, no duplicate keys, no NaN/Infinity, integers within 64 bits, bounded nesting); then
every field is type-checked, and every integer field (all are counts, sizes, indices, ranks or addresses) must
lie in 0 .. 2**64-1. Free-form fields (`flags` values, `extra.engine_notes`) take any JSON that passes safejson;
the rest of a rank's `extra` is the typed RankExtra, checked key by key. A manifest of another format, or of a
version this release does not read, is refused before anything else (UnsupportedFormat); a world whose facts
pass a cap (World.limit_problem), as it is read.

Writing gives the JSON SAVE has always written: the records' fields in order, `extra`'s keys only where present,
a manifest's `format` first; each record reads back to an equal record.

    to_dict(record), to_json(record)           the JSON object; the text manifest.json or rank.json holds
    from_dict(Type, data), from_json(Type, t)  the record, or a ManifestError naming the field
    parsed(Type, text)                         the record and the JSON object it was read from (what digests hash)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from graphpersist.archive import safejson
from graphpersist.archive.manifest import (
    FORMAT_NAME,
    MANIFEST_NAME,
    RANK_RECORD_NAME,
    SUPPORTED_FORMAT_VERSIONS,
    UINT_MAX,
    Manifest,
    ManifestError,
    RankExtra,
    RankRecord,
    RecordDigests,
    UnsupportedFormat,
    World,
)
from graphpersist.archive.shown import shown
from graphpersist.records import STATE_HOWS, HostMemoryRecord, Phase, StateRecord

R = TypeVar("R")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Where a record's messages start (`rank.device must be an object`, `extra.phases[1].start: ...`).
_WHERE: dict[Any, str] = {Manifest: "manifest", RankRecord: "rank", World: "world", RankExtra: "extra"}
_FILE_NAME: dict[Any, str] = {Manifest: MANIFEST_NAME, RankRecord: RANK_RECORD_NAME}


def to_dict(record: Any) -> dict[str, Any]:
    """The JSON object of a record: a manifest's `format` first, a RankExtra's keys only where present."""
    if isinstance(record, Manifest):
        return {"format": FORMAT_NAME, **_to_json(record)}
    return _to_json(record)


def to_json(record: Any) -> str:
    """The text manifest.json or rank.json holds for `record` (indented, UTF-8 as it is, a newline at the end)."""
    return _dumps(to_dict(record))


def from_dict(tp: type[R], data: Any) -> R:
    """The record of type `tp` that `data` (parsed JSON) holds, every field checked; ManifestError naming the field.
    A manifest of another format or version is refused before anything else, a world past its caps as it is read."""
    if tp is Manifest:
        return typing.cast(R, _manifest(data))
    return typing.cast(R, _converter(tp)(data, _WHERE.get(tp, tp.__name__)))


def from_json(tp: type[R], text: str | bytes) -> R:
    """The record of type `tp` that a JSON text holds (manifest.json, rank.json); ManifestError naming the problem."""
    return parsed(tp, text)[0]


def parsed(tp: type[R], text: str | bytes) -> tuple[R, dict[str, Any]]:
    """The record and the JSON object it was read from (what graphpersist.archive.digests hashes)."""
    doc = _loads(text, _FILE_NAME.get(tp, tp.__name__))
    return from_dict(tp, doc), doc


def _manifest(data: Any) -> Manifest:
    """Parses a manifest, refusing other formats and unknown versions before reading anything else."""
    if not isinstance(data, Mapping):
        raise ManifestError("the manifest must be a JSON object")
    if data.get("format") != FORMAT_NAME:
        given = _show(data.get("format"))
        raise ManifestError(f"not a graphpersist manifest (format {given}, want {FORMAT_NAME!r})")
    version = data.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= UINT_MAX:
        raise ManifestError(f"format_version must be a positive integer, got {_show(version)}")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_FORMAT_VERSIONS))
        older = version < max(SUPPORTED_FORMAT_VERSIONS)
        raise UnsupportedFormat(
            f"archive format version {version} is {'older' if older else 'newer'} than what this graphpersist "
            f"reads (format {supported})",
            version=version,
            older=older,
        )
    body = {k: v for k, v in data.items() if k != "format"}
    return _converter(Manifest)(body, "manifest")


def _extra_to_dict(extra: RankExtra) -> dict[str, Any]:
    """The JSON object rank.json's `extra` holds: the keys present, in the order SAVE has always written them."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(extra):
        value = getattr(extra, f.name)
        if value is None:
            continue
        if f.name in ("phases", "state"):
            out[f.name] = [row.to_json() for row in value]
        elif f.name == "digests":  # `manifest` only in rank 0's
            out[f.name] = {k: v for k, v in _to_json(value).items() if v is not None}
        else:
            out[f.name] = _to_json(value)
    return out


def _read_extra(data: Any, where: str = "extra") -> RankExtra:
    """Checks and converts rank.json's `extra`; ManifestError naming the key (and item) that is wrong."""
    if not isinstance(data, Mapping):
        raise ManifestError(f"{where}: must be an object, got {_show(data)}")
    unknown = [str(k) for k in data if k not in _EXTRA_PARSERS]
    if unknown:
        raise _unknown_fields(where, unknown)
    values = {}
    for key, value in data.items():
        if value is None and key == "engine_notes":
            continue  # as loadplan always read it: no notes
        values[key] = _EXTRA_PARSERS[key](value, f"{where}.{key}")
    return RankExtra(**values)


# ---------------------------------------------------------------------------------------------------------
# JSON <-> dataclass. Small and strict: the records use only str, int, bool, float, None, tuples, str-keyed dicts,
# nested records and Any (free-form JSON).


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def _loads(text: str | bytes, what: str) -> Any:
    try:
        return safejson.loads(text)
    except safejson.JsonError as exc:
        raise ManifestError(f"{what} is not valid JSON: {exc}") from None


def _show(value: Any) -> str:
    """A value for an error message: short, and safe for any value (no huge repr, no deep recursion)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if abs(value) <= UINT_MAX else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float | str):
        return _clip(repr(value))
    if isinstance(value, Mapping):
        return f"an object of {len(value)} field{'s' if len(value) != 1 else ''}"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    return f"a {type(value).__name__}"


def _clip(text: str, limit: int = 60) -> str:
    """Archive text as messages show it: control characters escaped (graphpersist.archive.shown), clipped."""
    return shown(text, limit)


def _to_json(obj: Any) -> Any:
    if isinstance(obj, RankExtra):
        return _extra_to_dict(obj)  # absent keys stay absent
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _to_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_to_json(v) for v in obj]
    return obj


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


@functools.cache
def _schema(tp: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    """A record class's resolved field types and fields, computed once per class: an archive of 2000 graphs parses
    2000 graph records, and resolving type hints each time cost more than the rest of opening it."""
    return typing.get_type_hints(tp), {f.name: f for f in dataclasses.fields(tp)}


def _from_json(tp: Any, value: Any, where: str) -> Any:
    return _converter(tp)(value, where)


# Each type gets a converter, built once: (value, where) -> the checked value, or ManifestError naming `where`.
# A rank record of an engine holds thousands of graph records; resolving each field's type on every call cost more
# than parsing the JSON. Scalars also get a predicate that is true exactly when the converter would return the
# value unchanged: the common case then costs one call, and the error path builds the same message as ever.
Converter = Callable[[Any, str], Any]


def _identity(value: Any, where: str) -> Any:
    return value


def _int_ok(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= UINT_MAX


def _check_int(value: Any, where: str) -> Any:
    if not _int_ok(value):
        raise ManifestError(f"{where} must be an integer from 0 to 2**64-1, got {_show(value)}")
    return value


def _float_ok(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _check_float(value: Any, where: str) -> Any:
    if not _float_ok(value):
        raise ManifestError(f"{where} must be a finite number, got {_show(value)}")
    return value


def _instance_check(tp: type) -> tuple[Callable[[Any], bool], Converter]:
    def ok(value: Any) -> bool:
        return isinstance(value, tp)

    def check(value: Any, where: str) -> Any:
        if not isinstance(value, tp):
            raise ManifestError(f"{where} must be a {_type_name(tp)}, got {_show(value)}")
        return value

    return ok, check


@functools.cache
def _scalar(tp: Any) -> tuple[Callable[[Any], bool], Converter] | None:
    """(predicate, converter) for the leaf types; None for containers, records and unions."""
    if tp is Any:
        return (lambda value: True), _identity
    if tp is int:
        return _int_ok, _check_int
    if tp is float:
        return _float_ok, _check_float
    if tp in (str, bool):
        return _instance_check(tp)
    return None


@functools.cache
def _converter(tp: Any) -> Converter:
    scalar = _scalar(tp)
    if scalar is not None:
        return scalar[1]
    if tp is RankExtra:  # its own parser, naming keys as rank.json does (`extra.phases[1].start`)
        return lambda value, where: _read_extra(value)
    if tp is World:  # its fields, then its caps
        return _world_converter()
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_converter(tp)
    if dataclasses.is_dataclass(tp):
        return _record_converter(tp)
    if origin is tuple:
        return _tuple_converter(typing.get_args(tp)[0])
    if origin is dict:
        return _dict_converter(typing.get_args(tp)[1])
    return _identity  # a plain type this module does not check (none of the records use one)


def _world_converter() -> Converter:
    fields = _record_converter(World)

    def convert(value: Any, where: str) -> World:
        world = fields(value, where)
        problem = world.limit_problem(where)
        if problem:
            raise ManifestError(problem)
        return world

    return convert


def _union_converter(tp: Any) -> Converter:
    options = typing.get_args(tp)
    nullable = type(None) in options
    converters = [_converter(o) for o in options if o is not type(None)]

    def convert(value: Any, where: str) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for option in converters:
            try:
                return option(value, where)
            except ManifestError as exc:
                errors.append(str(exc))
        raise ManifestError(errors[0] if len(errors) == 1 else f"{where}: unexpected value {_show(value)}")

    return convert


def _exact_types(tp: Any) -> frozenset[type] | None:
    """The value types a field takes as they are (str, bool, an int in range, None where allowed): what the record
    converter accepts without calling the field's converter. None: always call it (containers, records, float)."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if not all(o in (str, bool, int, type(None)) for o in options):
        return None
    return frozenset(options)


def _record_converter(tp: Any) -> Converter:
    hints, known = _schema(tp)
    names = frozenset(known)
    fields = []
    for name, f in known.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        exact = frozenset([object]) if hints[name] is Any else _exact_types(hints[name])
        fields.append((name, required, exact, _converter(hints[name])))

    def convert(value: Any, where: str) -> Any:
        if not isinstance(value, Mapping):
            raise ManifestError(f"{where} must be an object, got {type(value).__name__}")
        if not value.keys() <= names:
            raise _unknown_fields(where, [str(k) for k in set(value) - names])
        kwargs = {}
        for name, required, exact, field_converter in fields:
            if name not in value:
                if required:
                    raise ManifestError(f"{where}.{name} is missing")
                continue
            item = value[name]
            kind = type(item)
            if exact is not None and (kind in exact or object in exact) and (kind is not int or 0 <= item <= UINT_MAX):
                kwargs[name] = item  # what the field's converter would return, without the call
            else:
                kwargs[name] = field_converter(item, f"{where}.{name}")
        return tp(**kwargs)

    return convert


def _unknown_fields(where: str, keys: list[str]) -> ManifestError:
    unknown = sorted(keys)
    listed = ", ".join(_clip(k) for k in unknown[:8])
    listed += f", … ({len(unknown)} in all)" if len(unknown) > 8 else ""
    return ManifestError(f"{where}: unknown field(s) {listed} for this format version")


def _tuple_converter(item_tp: Any) -> Converter:
    scalar = _scalar(item_tp)
    ok = scalar[0] if scalar else None
    item_converter = _converter(item_tp)

    def convert(value: Any, where: str) -> Any:
        if not isinstance(value, list | tuple):
            raise ManifestError(f"{where} must be a list, got {type(value).__name__}")
        if ok is not None and all(map(ok, value)):
            return tuple(value)
        return tuple(item_converter(v, f"{where}[{i}]") for i, v in enumerate(value))

    return convert


def _dict_converter(item_tp: Any) -> Converter:
    scalar = _scalar(item_tp)
    ok = scalar[0] if scalar else None
    item_converter = _converter(item_tp)

    def convert(value: Any, where: str) -> Any:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ManifestError(f"{where} must be an object with string keys, got {_show(value)}")
        if ok is not None and all(map(ok, value.values())):
            return dict(value)
        return {k: item_converter(v, f"{where}.{_clip(k)}") for k, v in value.items()}

    return convert


# ---------------------------------------------------------------------------------------------------------
# RankExtra's keys, one parser each: (value, where) -> the typed value, or ManifestError "<where>: <what is wrong>"
# (the wording LOAD's refusals have always used). Checks that need other files (a phase's events against the
# allocation log, a state's payload against the file table) are loadplan's.

_PHASE_INTS = ("start_event", "end_event", "start", "end", "limit")
_PHASE_BOOLS = ("exact", "skip_on_load", "post_capture", "implicit")
_PHASE_FIELDS = frozenset(f.name for f in dataclasses.fields(Phase))
_STATE_FIELDS = frozenset(f.name for f in dataclasses.fields(StateRecord))


def _uint(value: Any, where: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= UINT_MAX:
        raise ManifestError(f"{where}: must be an integer from {low} to 2**64-1, got {_show(value)}")
    return value


def _rows(value: Any, where: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise ManifestError(f"{where}: must be a list, got {_show(value)}")
    return value


def _str_keys(value: Any, where: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ManifestError(f"{where}: must be an object {what}, got {_show(value)}")
    return value


def _names_to_str(value: Any, where: str) -> dict[str, str]:
    found = _str_keys(value, where, "of graph names to fingerprints")
    for key, item in found.items():
        if not isinstance(item, str):
            raise ManifestError(f"{where}.{_clip(key)}: must be a string, got {_show(item)}")
    return dict(found)


def _names_to_uint(value: Any, where: str) -> dict[str, int]:
    found = _str_keys(value, where, "of phase names to counts")
    return {key: _uint(item, f"{where}.{_clip(key)}") for key, item in found.items()}


def _notes(value: Any, where: str) -> dict[str, Any]:
    """Free-form JSON (safejson checked it), but an object: the engine's glue looks its sections up by name."""
    return dict(_str_keys(value, where, "(the engine's notes)"))


def _pairs(value: Any, where: str, second: str) -> tuple[tuple[int, Any], ...]:
    """[[address, size]] (`second` "size") or [[address, phase name]] (`second` "phase")."""
    out = []
    for i, row in enumerate(_rows(value, where)):
        at = f"{where}[{i}]"
        if not isinstance(row, list | tuple) or len(row) != 2:
            raise ManifestError(f"{at}: must be [address, {second}], got {_show(row)}")
        address = _uint(row[0], f"{at}[0]")
        if second == "size":
            out.append((address, _uint(row[1], f"{at}[1]")))
        elif isinstance(row[1], str):
            out.append((address, row[1]))
        else:
            raise ManifestError(f"{at}[1]: must be a phase name, got {_show(row[1])}")
    return tuple(out)


def _phases(value: Any, where: str) -> tuple[Phase, ...]:
    out = []
    for i, row in enumerate(_rows(value, where)):
        at = f"{where}[{i}]"
        if not isinstance(row, Mapping):
            raise ManifestError(f"{at}: must be an object, got {_show(row)}")
        if set(row) - _PHASE_FIELDS or not isinstance(row.get("name"), str):
            raise ManifestError(f"{at}: needs a name and only Phase's fields, got {sorted(map(shown, row))[:8]}")
        for key in _PHASE_BOOLS:
            if key in row and type(row[key]) is not bool:
                raise ManifestError(f"{at}.{key}: must be true or false, got {_show(row[key])}")
        for key in _PHASE_INTS:
            if key in row:
                _uint(row[key], f"{at}.{key}")
        for key in ("headroom", "span"):
            if row.get(key) is not None:
                _uint(row[key], f"{at}.{key}")
        ph = Phase.from_json(row)
        if not ph.start_event <= ph.end_event:
            raise ManifestError(f"{at}: events {ph.start_event}..{ph.end_event} out of order")
        if not ph.start <= ph.end <= ph.limit:
            raise ManifestError(f"{at}: offsets start {ph.start}, end {ph.end}, limit {ph.limit} out of order")
        out.append(ph)
    return tuple(out)


def _states(value: Any, where: str) -> tuple[StateRecord, ...]:
    out = []
    for i, row in enumerate(_rows(value, where)):
        at = f"{where}[{i}]"
        if not isinstance(row, Mapping) or set(row) - _STATE_FIELDS:
            raise ManifestError(f"{at}: must be an object of StateRecord's fields")
        name, how, sha, file, ph = (row.get(k) for k in ("name", "how", "sha256", "file", "phase"))
        if not isinstance(name, str) or how not in STATE_HOWS or not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise ManifestError(f"{at}: needs a name, how (bytes or recreated) and a sha256")
        _uint(row.get("addr"), f"{at}.addr", 1)
        _uint(row.get("nbytes"), f"{at}.nbytes", 1)
        if ph is not None and not isinstance(ph, str):
            raise ManifestError(f"{at}.phase: must be a phase name or null, got {_show(ph)}")
        if (how == "bytes") != isinstance(file, str) or (file is not None and not isinstance(file, str)):
            raise ManifestError(f"{at}.file: names the payload of a 'bytes' state, and only of one")
        out.append(StateRecord.from_json(row))
    return tuple(out)


def _digests(value: Any, where: str) -> RecordDigests:
    if not isinstance(value, Mapping) or not {"files", "record"} <= set(value) <= {"files", "record", "manifest"}:
        raise ManifestError(f"{where}: must be an object with `files`, `record` and (rank 0's) `manifest`")
    for key in ("record", "manifest"):
        if key in value and (not isinstance(value[key], str) or not _SHA256.fullmatch(value[key])):
            raise ManifestError(f"{where}.{key}: must be a sha256 (64 lower-case hex digits)")
    files = value["files"]
    if not isinstance(files, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and _SHA256.fullmatch(v) for k, v in files.items()
    ):
        raise ManifestError(f"{where}.files: must map archive paths to sha256s")
    return RecordDigests(files=dict(files), record=value["record"], manifest=value.get("manifest"))


def _host_memory(value: Any, where: str) -> HostMemoryRecord:
    if not isinstance(value, Mapping) or set(value) != {"ranges", "words"}:
        raise ManifestError(f"{where}: must be an object with exactly `ranges` and `words`")
    return HostMemoryRecord(
        ranges=_pairs(value["ranges"], f"{where}.ranges", "size"), words=_uint(value["words"], f"{where}.words")
    )


_EXTRA_PARSERS: dict[str, Converter] = {
    "setup_events": _uint,
    "setup_cursor": _uint,
    "address_fingerprints": _names_to_str,
    "granularity": _uint,
    "phases": _phases,
    "state": _states,
    "engine_notes": _notes,
    "pointer_phases": _names_to_uint,
    "variable_pointers": lambda value, where: _pairs(value, where, "phase"),
    "torch_blocks": lambda value, where: _pairs(value, where, "size"),
    "digests": _digests,
    "host_memory": _host_memory,
}  # one per RankExtra field (test_rank_extra round-trips a record that has them all)
