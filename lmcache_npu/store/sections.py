"""Parsing shared by every config section of the store: sizes with units and dataclass-checked key sets.

Its own module so that `config.py` (the store section) and `mooncake_config.py` (the mooncake section) both use it
without importing each other.

Every function here fails one way: a ValueError that names the key and the rule, whatever the input (a YAML file
can hold int or null keys, 400-digit sizes, alias bombs and self-referencing lists).
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any, Iterable, Mapping

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# ASCII digits only: int() and Fraction() would also take other scripts' digits, which no operator means
_SIZE = re.compile(r"^\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Z]*)\s*$")
# sizes become u64 file offsets, mmap lengths and C size_t: past this they would overflow there, not here
MAX_SIZE_BYTES = 2**63 - 1
# no key takes a value nested deeper or holding more items; bounding them keeps every later check and error message
# (repr) finite, whatever a YAML file's anchors or a JSON string nest
MAX_VALUE_DEPTH = 16
MAX_VALUE_ITEMS = 10_000
_SIZE_RULE = ("expected a size in bytes (e.g. 68719476736 or \"64GiB\"; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; "
              f"at most {MAX_SIZE_BYTES})")


def parse_bytes(key: str, value: Any) -> int:
    """A size in bytes from an int or a string such as "64GiB"; the error names the key and the rule."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: {_SIZE_RULE}, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)) and match.group(2).lower() in _UNITS:
        # exact rational arithmetic: float() would round 19-digit sizes and turn 400 digits into inf
        size = int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise ValueError(f"{key}: {_SIZE_RULE}, got {_shown(value)}")
    if size < 0:
        raise ValueError(f"{key}: a size cannot be negative, got {_shown(value)}")
    if size > MAX_SIZE_BYTES:
        raise ValueError(f"{key}: a size must be at most {MAX_SIZE_BYTES} bytes (2**63 - 1), got {_shown(value)}")
    return size


def _shown(value: Any, limit: int = 200) -> str:
    """`repr(value)` cut to `limit` characters for an error message; never raises (an int past Python's digit limit
    cannot be repr'd)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def key_list(keys: Iterable[Any]) -> str:
    """Keys of any type (a YAML file may use 1 or null as a key) sorted and quoted for an error message: string keys
    in their usual order, then the others."""
    return ", ".join(_shown(k) for k in sorted(keys, key=lambda k: (0, k) if isinstance(k, str) else (1, _shown(k))))


def check_value_shape(key: str, value: Any) -> None:
    """Refuses a value nested deeper than MAX_VALUE_DEPTH levels or holding more than MAX_VALUE_ITEMS items in all,
    without recursion (a self-referencing YAML list ends at the depth bound)."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    items = 0
    while pending:
        current, depth = pending.pop()
        if isinstance(current, Mapping):
            children: Iterable[Any] = [*current.keys(), *current.values()]
        elif isinstance(current, (list, tuple, set, frozenset)):
            children = current
        else:
            continue
        if depth >= MAX_VALUE_DEPTH:
            raise ValueError(f"{key}: the value nests deeper than {MAX_VALUE_DEPTH} levels; no config key takes such "
                             "a value")
        items += len(current)
        if items > MAX_VALUE_ITEMS:
            raise ValueError(f"{key}: the value holds more than {MAX_VALUE_ITEMS} items; no config key takes such a "
                             "value")
        pending.extend((child, depth + 1) for child in children)


def parse_section(section: str, schema: type, values: Mapping[str, Any], sizes: tuple[str, ...] = ()) -> dict:
    """`values` checked against the fields of dataclass `schema`: an unknown key is refused with the valid ones;
    the `sizes` keys are parsed to bytes. Returns the keyword arguments for `schema`."""
    if not isinstance(values, Mapping):
        raise ValueError(f"the {section} config must be an object of {section} keys, got {_shown(values)}")
    valid = tuple(f.name for f in dataclasses.fields(schema))
    unknown = set(values) - set(valid)
    if unknown:
        raise ValueError(f"unknown {section} config key(s) {key_list(unknown)}; valid keys: {', '.join(valid)}")
    for key, value in values.items():
        check_value_shape(key if section == "store" else f"{section}.{key}", value)
    parsed = dict(values)
    for key in sizes:
        if key in parsed:
            parsed[key] = parse_bytes(key if section == "store" else f"{section}.{key}", parsed[key])
    return parsed
