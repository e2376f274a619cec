"""A safetensors shard's header: its 8-byte little-endian length and JSON tensor index, read and validated without
trusting the file (every failure is a ValueError naming the shard), and the byte range of each tensor's data."""

from __future__ import annotations

import json
import math
import reprlib
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from .sample_reads import pread_exact

# safetensors' own refusal limit for a header; a larger length is a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000
# Bytes per element of the safetensors dtypes with whole-byte elements; sub-byte dtypes (F4, F6) are not checked.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


@dataclass(frozen=True)
class ShardHeader:
    """What a shard's header says: the header bytes as read (length prefix and JSON), the byte range holding tensor
    data, and the absolute (begin, end) of each non-empty tensor in header order."""

    raw: bytes
    region: tuple[int, int]
    tensors: Sequence[tuple[int, int]]


def _product(shape: list) -> Any:
    """The element count of a shape, or None when a dimension is not a plain int."""
    if not set(map(type, shape)) <= {int}:  # map/set run in C: no Python frame per dimension
        return None
    return math.prod(shape)


# header values in error messages: depth- and length-bounded, since they come from the file
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxlevel = 200, 200, 16, 4


def _shown(value: Any) -> str:
    return _REPR.repr(value)


def parse_header(name: str, size: int, raw: bytes) -> list[tuple[int, int]]:
    """Validates a safetensors JSON header; returns the data ranges (relative to the data start) in header order."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: the safetensors header is not valid JSON ({exc})") from None
    except ValueError as exc:  # an integer past Python's digit limit: no offset or dimension is that long
        raise ValueError(f"{name}: the safetensors header is not a tensor index ({exc})") from None
    except RecursionError:  # a tensor index is two levels deep; this file nests past the interpreter's stack
        raise ValueError(f"{name}: the safetensors header nests too deeply to be a tensor index; the file is "
                         "corrupt or not safetensors") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: the safetensors header must be a JSON object, not {type(header).__name__}")
    data_bytes = size - 8 - len(raw)
    ranges = []
    for tensor, info in header.items():
        if tensor == "__metadata__":
            if not isinstance(info, dict):
                raise ValueError(f"{name}: __metadata__ must be a JSON object of strings")
            continue
        if not isinstance(info, dict):
            raise ValueError(f"{name}: tensor {_shown(tensor)} must map to an object with dtype, shape and "
                             "data_offsets")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if type(dtype) is not str:
            raise ValueError(f"{name}: tensor {_shown(tensor)} has no string dtype")
        # C-level checks (prod, min) keep 90,000-tensor headers cheap; True/False as a dimension is caught by type().
        if type(shape) is not list or type(elements := _product(shape)) is not int or min(shape, default=0) < 0:
            raise ValueError(f"{name}: tensor {_shown(tensor)} shape must be a list of non-negative integers, got "
                             f"{_shown(shape)}")
        if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
                or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{name}: tensor {_shown(tensor)} data_offsets must be [begin, end] with 0 <= begin <= "
                             f"end, got {_shown(offsets)}")
        begin, end = offsets
        if end > data_bytes:
            raise ValueError(f"{name}: tensor {_shown(tensor)} ends at data byte {end} but the file holds only "
                             f"{data_bytes} data bytes: the shard is truncated")
        itemsize = _DTYPE_BYTES.get(dtype)
        if itemsize is not None and elements * itemsize != end - begin:
            raise ValueError(f"{name}: tensor {_shown(tensor)} is {dtype} {_shown(shape)} ({elements * itemsize} "
                             f"bytes) but its data_offsets span {end - begin} bytes")
        ranges.append((begin, end))
    return ranges


def read_header(fd: int, name: str, size: int, budget_left: int, max_read_bytes: int) -> ShardHeader:
    """Reads and validates the header of the `size`-byte shard open at `fd`, within `budget_left` bytes."""
    if size < 8:
        raise ValueError(f"{name}: {size} bytes is too short for a safetensors file (it starts with an "
                         f"8-byte little-endian header length)")
    if budget_left < 8:
        raise ValueError(f"max_read_bytes {max_read_bytes} is too small: the safetensors headers alone exceed it")
    prefix = pread_exact(fd, 8, 0, name)
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or length > size - 8:
        raise ValueError(f"{name}: safetensors header length {length} is absurd for a {size}-byte file "
                         f"(it must be at most {MAX_HEADER_BYTES} and fit in the file); the file is corrupt, truncated "
                         f"or not safetensors")
    if 8 + length > budget_left:
        raise ValueError(f"max_read_bytes {max_read_bytes} is too small: the safetensors headers alone exceed it")
    raw = pread_exact(fd, length, 8, name)
    start = 8 + length
    return ShardHeader(prefix + raw, (start, size),
                       [(start + b, start + e) for b, e in parse_header(name, size, raw) if e > b])
