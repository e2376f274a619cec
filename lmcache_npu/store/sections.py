"""Parsing shared by every config section of the store: sizes with units and dataclass-checked key sets.

Its own module so that `config.py` (the store section) and `mooncake_config.py` (the mooncake section) both use it
without importing each other.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(key: str, value: Any) -> int:
    """A size in bytes from an int or a string such as "64GiB"; the error names the key and the rule."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a size in bytes (e.g. 68719476736 or \"64GiB\"), got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)) and match.group(2).lower() in _UNITS:
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise ValueError(f"{key}: expected a size in bytes (e.g. 68719476736 or \"64GiB\"; units "
                         f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}")
    if size < 0:
        raise ValueError(f"{key}: a size cannot be negative, got {value!r}")
    return size


def parse_section(section: str, schema: type, values: Mapping[str, Any], sizes: tuple[str, ...] = ()) -> dict:
    """`values` checked against the fields of dataclass `schema`: an unknown key is refused with the valid ones;
    the `sizes` keys are parsed to bytes. Returns the keyword arguments for `schema`."""
    valid = tuple(f.name for f in dataclasses.fields(schema))
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"unknown {section} config key(s) {', '.join(map(repr, unknown))}; valid keys: "
                         f"{', '.join(valid)}")
    parsed = dict(values)
    for key in sizes:
        if key in parsed:
            parsed[key] = parse_bytes(key if section == "store" else f"{section}.{key}", parsed[key])
    return parsed
