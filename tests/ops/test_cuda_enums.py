"""The CUDA backend's IntEnums name and number what the C enums of csrc/cuda/kv_transfer_cuda.h do (read from the
header's text, so no GPU and no build is needed)."""

from __future__ import annotations

import re
from enum import IntEnum
from pathlib import Path

import pytest

from lmcache_npu.ops.cuda.native import Pipeline, TransferEvent

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "kv_transfer_cuda.h"
# (C enum, Python enum, the prefix its enumerators carry); the enumerator named Count ends an enum, it is no member
MIRRORS = [("LmcachePipeline", Pipeline, "kLmcache"), ("LmcacheTransferEvent", TransferEvent, "kLmcacheEvent")]


def c_enum(text: str, name: str, prefix: str) -> dict[str, int]:
    """Enumerator -> value of `enum name { ... }` in C source `text`, named in Python's style (kLmcacheNoPipeline with
    prefix kLmcache: NO_PIPELINE); an enumerator without `= value` follows the one before it, as in C."""
    body = re.search(rf"enum\s+{name}\s*\{{(.*?)\}}", text, re.S)
    assert body is not None, f"enum {name} not found"
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", body.group(1), flags=re.S)
    values, next_value = {}, 0
    for entry in (e.strip() for e in code.split(",")):
        if not entry:
            continue
        parts = re.fullmatch(r"(\w+)\s*(?:=\s*(\d+))?", entry)
        assert parts is not None and parts.group(1).startswith(prefix), f"enum {name}: cannot read {entry!r}"
        value = int(parts.group(2)) if parts.group(2) is not None else next_value
        words = re.findall(r"[A-Z][a-z0-9]*", parts.group(1)[len(prefix):])
        values["_".join(w.upper() for w in words)] = value
        next_value = value + 1
    return values


def mismatches(text: str) -> list[str]:
    """Every way the Python enums differ from the header's."""
    found = []
    for name, mirror, prefix in MIRRORS:
        members = c_enum(text, name, prefix)
        count = members.pop("COUNT", None)
        python = {member.name: int(member) for member in mirror}
        if members != python:
            found.append(f"{mirror.__name__} {python} != {name} {members}")
        if count is not None and count != len(mirror):
            found.append(f"{name} counts {count} enumerators, {mirror.__name__} has {len(mirror)}")
    return found


def test_the_python_enums_mirror_the_header() -> None:
    text = HEADER.read_text()
    assert mismatches(text) == []
    assert all(issubclass(mirror, IntEnum) and len(mirror) > 1 for _, mirror, _ in MIRRORS)


@pytest.mark.parametrize("original, doctored", [
    ("kLmcacheMappedPrefix = 3", "kLmcacheMappedPrefix = 4"),
    ("kLmcacheEventFirst = 0", "kLmcacheEventFirst = 1"),  # every implicit value after it moves too
    ("kLmcacheEventPagesFree,", "kLmcacheEventPagesFree,\n  kLmcacheEventExtra,"),
    ("kLmcacheAcquireSlices = 2", "kLmcacheAcquireSlice = 2"),
])
def test_negative_control_a_doctored_header_is_noticed(original: str, doctored: str) -> None:
    text = HEADER.read_text()
    assert original in text
    assert mismatches(text.replace(original, doctored, 1)) != []
