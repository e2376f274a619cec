"""The encoding of what a peer sends the node cache service: a closed set of value kinds, decoded by plain code that
calls nothing a message names, so no message can make the service build more than a bounded multiple of its own size.

Pickle cannot promise that even with an allow-list: an allowed callable (`bytearray(1 << 40)`) runs, and with no
class at all a 9-byte pickle (`LONG_BINPUT 2**25`) makes the C unpickler zero a 512 MiB memo table before it fails.
Here every value consumes bytes of the message, every count is checked against the bytes left, and the decoder
keeps a running estimate of what it built (`MAX_DECODED_BYTES`).

A value is a tag byte and its body (native byte order: both ends share one host):
`N` None, `T`/`F` booleans, `i` int64, `I` a larger int (u16 length, signed little-endian), `f` float64, `s` str and
`b` bytes (u32 length), `l`/`t` list/tuple, `d` dict, `e`/`z` set/frozenset (u32 count, items), `K` ChunkKey (two
values), `E` enum and `D` dataclass of the registry below (u8 name length, name, then the value, or a u8 field
count and (field name, value) pairs). The hot verbs' lists have packed forms decoded at C speed: `H`/`h`
list/tuple of bytes of one length (u32 count, u32 length, the bytes), `X`/`x` of other bytes (u32 count, u32
lengths, the bytes), `Q`/`q` list/tuple of int64, `O` list of bools, `S` list of str (u32 count, a list of the
distinct ones, a u32 index each), `G` list of equal-length tuples stored column by column (u32 count, u8 width, one
list value per column).
"""

from __future__ import annotations

import dataclasses
import struct
from array import array
from enum import Enum
from itertools import accumulate
from operator import itemgetter
from typing import Any, Callable

from ..store.commands import Medium, Tier
from ..store.index.contract import DiskState, SlotState
from ..store.keys import ChunkKey
from .messages import Attach, Attached, PoolGeometry, Refused

MAGIC = b"\xa7\x01"  # never a pickle's first byte (PROTO is 0x80); the second is this encoding's version
MAX_DECODED_BYTES = 256 << 20  # what one message may make the service build (estimated as CPython sizes them)
MAX_DEPTH = 32  # nesting: the protocol needs 5 (a request, a list of records, a payload tuple, its hashes)
MAX_BIG_INT_BYTES = 64  # an int beyond int64: no field of the protocol holds one, a fuzzer or a bug might

_U8, _U16, _U32 = struct.Struct("=B"), struct.Struct("=H"), struct.Struct("=I")
_I64, _F64 = struct.Struct("=q"), struct.Struct("=d")
_INT64 = (-(1 << 63), (1 << 63) - 1)
_OBJECT, _POINTER = 64, 8  # a small object and a reference to one, as the decoded-size estimate counts them

DATACLASSES: dict[str, type] = {cls.__name__: cls for cls in (Attach, Attached, PoolGeometry, Refused)}
ENUMS: dict[str, type[Enum]] = {cls.__name__: cls for cls in (Tier, Medium, SlotState, DiskState)}
_FIELDS = {cls: tuple(field.name for field in dataclasses.fields(cls)) for cls in DATACLASSES.values()}


class CodecError(ValueError):
    """Not a message of this encoding, or one beyond its limits."""


# ---- encoding -------------------------------------------------------------------------------------------------------

def encode(message: Any) -> bytes:
    """`message` in this encoding; TypeError for a value of a kind it does not carry."""
    out = bytearray(MAGIC)
    _put(out, message, 0)
    return bytes(out)


def _put(out: bytearray, value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TypeError(f"a node cache message nests deeper than {MAX_DEPTH}")
    kind = type(value)
    put = _PUT.get(kind)
    if put is not None:
        put(out, value, depth)
    elif value is None:
        out += b"N"
    elif kind.__name__ in ENUMS and ENUMS[kind.__name__] is kind:
        _put_name(out, b"E", kind.__name__)
        _put(out, value.value, depth + 1)
    elif kind.__name__ in DATACLASSES and DATACLASSES[kind.__name__] is kind:
        _put_name(out, b"D", kind.__name__)
        names = _FIELDS[kind]
        out += _U8.pack(len(names))
        for name in names:
            _put_str(out, name, depth)
            _put(out, getattr(value, name), depth + 1)
    else:
        raise TypeError(f"a node cache message may not carry a {kind.__module__}.{kind.__qualname__}")


def _put_name(out: bytearray, tag: bytes, name: str) -> None:
    data = name.encode()
    out += tag + _U8.pack(len(data)) + data


def _put_int(out: bytearray, value: int, depth: int) -> None:
    if _INT64[0] <= value <= _INT64[1]:
        out += b"i" + _I64.pack(value)
        return
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    if len(data) > MAX_BIG_INT_BYTES:
        raise TypeError(f"an int of {len(data)} bytes is beyond a node cache message's {MAX_BIG_INT_BYTES}")
    out += b"I" + _U16.pack(len(data)) + data


def _put_str(out: bytearray, value: str, depth: int) -> None:
    data = value.encode("utf-8", "surrogatepass")
    out += b"s" + _U32.pack(len(data))
    out += data


def _put_bytes(out: bytearray, value: bytes, depth: int) -> None:
    out += b"b" + _U32.pack(len(value))
    out += value


def _put_sequence(out: bytearray, items: Any, depth: int) -> None:
    is_list = type(items) is list
    if items:
        kinds = set(map(type, items))  # C speed: a lookup's 512 hashes take microseconds
        if kinds == {bytes}:
            lengths = set(map(len, items))
            if len(lengths) == 1 and 0 not in lengths:  # chunk hashes: one length, no table of lengths
                out += (b"H" if is_list else b"h") + _U32.pack(len(items)) + _U32.pack(lengths.pop())
            else:
                out += (b"X" if is_list else b"x") + _U32.pack(len(items))
                out += array("I", map(len, items)).tobytes()
            out += b"".join(items)
            return
        if kinds == {int}:
            try:
                packed = array("q", items).tobytes()
            except OverflowError:  # beyond int64: item by item below
                pass
            else:
                out += (b"Q" if is_list else b"q") + _U32.pack(len(items))
                out += packed
                return
        if is_list and kinds == {bool}:
            out += b"O" + _U32.pack(len(items)) + bytes(items)
            return
        if is_list and kinds == {str}:  # few distinct ones (a step's failure reasons): a table and an index each
            table = {text: number for number, text in enumerate(dict.fromkeys(items))}
            out += b"S" + _U32.pack(len(items)) + b"l" + _U32.pack(len(table))
            for text in table:
                _put_str(out, text, depth + 1)
            out += array("I", map(table.__getitem__, items)).tobytes()
            return
        if is_list and kinds == {tuple}:
            widths = set(map(len, items))
            if len(widths) == 1 and 0 < (width := widths.pop()) < 256:  # records (a step's answers): by column
                out += b"G" + _U32.pack(len(items)) + _U8.pack(width)
                for column in range(width):  # itemgetter, not zip(*items): no 4096-wide tuples for the GC
                    _put_sequence(out, list(map(itemgetter(column), items)), depth + 1)
                return
    out += (b"l" if is_list else b"t") + _U32.pack(len(items))
    for item in items:
        _put(out, item, depth + 1)


def _put_dict(out: bytearray, value: dict, depth: int) -> None:
    out += b"d" + _U32.pack(len(value))
    for key, item in value.items():
        _put(out, key, depth + 1)
        _put(out, item, depth + 1)


def _put_set(out: bytearray, value: Any, depth: int) -> None:
    out += (b"e" if type(value) is set else b"z") + _U32.pack(len(value))
    for item in value:
        _put(out, item, depth + 1)


def _put_key(out: bytearray, value: ChunkKey, depth: int) -> None:
    out += b"K"
    _put(out, value.namespace, depth + 1)
    _put(out, value.chunk_hash, depth + 1)


_PUT: dict[type, Callable[[bytearray, Any, int], None]] = {
    bool: lambda out, value, depth: out.extend(b"T" if value else b"F"),
    int: _put_int,
    float: lambda out, value, depth: out.extend(b"f" + _F64.pack(value)),
    str: _put_str,
    bytes: _put_bytes,
    list: _put_sequence,
    tuple: _put_sequence,
    dict: _put_dict,
    set: _put_set,
    frozenset: _put_set,
    ChunkKey: _put_key,
}


# ---- decoding -------------------------------------------------------------------------------------------------------

def decode(payload: bytes) -> Any:
    """The message `payload` (MAGIC first) encodes; CodecError when it is not exactly one well-formed value."""
    if payload[:len(MAGIC)] != MAGIC:
        raise CodecError("not a message of this encoding (or of another version of it)")
    reader = _Reader(payload)
    value = reader.value(0)
    if reader.pos != len(payload):
        raise CodecError(f"{len(payload) - reader.pos} B after the message's value")
    return value


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)
        self.pos = len(MAGIC)
        self.budget = MAX_DECODED_BYTES

    def take(self, nbytes: int) -> int:
        """Claims the next `nbytes` of the message; where they start."""
        start = self.pos
        if nbytes < 0 or start + nbytes > len(self.data):
            raise CodecError(f"truncated: {nbytes} B wanted at offset {start} of {len(self.data)}")
        self.pos = start + nbytes
        return start

    def spend(self, nbytes: int) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise CodecError(f"the message would decode to more than {MAX_DECODED_BYTES} B")

    def unpack(self, layout: struct.Struct) -> Any:
        return layout.unpack_from(self.data, self.take(layout.size))[0]

    def count(self, least_bytes_each: int) -> int:
        """A u32 count of items each at least `least_bytes_each` long: never more than the bytes left hold."""
        number = self.unpack(_U32)
        if number * least_bytes_each > len(self.data) - self.pos:
            raise CodecError(f"a count of {number} items at offset {self.pos} exceeds the message")
        return number

    def blob(self, nbytes: int) -> bytes:
        start = self.take(nbytes)
        return self.data[start:start + nbytes]

    def name(self) -> str:
        return self.blob(self.unpack(_U8)).decode("ascii", "replace")

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError(f"the message nests deeper than {MAX_DEPTH}")
        tag = self.data[self.take(1)]
        read = _READ.get(tag)
        if read is None:
            raise CodecError(f"unknown tag {bytes([tag])!r} at offset {self.pos - 1}")
        return read(self, depth)

    def items(self, depth: int) -> list:
        number = self.count(1)
        self.spend(_OBJECT + _POINTER * number)
        return [self.value(depth + 1) for _ in range(number)]

    def str_(self, depth: int) -> str:
        size = self.unpack(_U32)
        self.spend(_OBJECT + size)
        return self.blob(size).decode("utf-8", "surrogatepass")

    def bytes_(self, depth: int) -> bytes:
        size = self.unpack(_U32)
        self.spend(_OBJECT + size)
        return self.blob(size)

    def big_int(self, depth: int) -> int:
        size = self.unpack(_U16)
        if size > MAX_BIG_INT_BYTES:
            raise CodecError(f"an int of {size} bytes (at most {MAX_BIG_INT_BYTES})")
        self.spend(_OBJECT + size)
        return int.from_bytes(self.blob(size), "little", signed=True)

    def bytes_list(self, depth: int) -> list[bytes]:
        number = self.count(4)
        lengths = array("I")
        lengths.frombytes(self.blob(4 * number))
        total = sum(lengths)
        self.spend((_OBJECT + _POINTER) * number + total)
        start = self.take(total)
        ends = list(accumulate(lengths, initial=start))
        data = self.data
        return [data[begin:end] for begin, end in zip(ends, ends[1:])]

    def hashes(self, depth: int) -> list[bytes]:
        number = self.count(0)
        size = self.unpack(_U32)
        if size == 0 or number * size > len(self.data) - self.pos:  # empty ones go as `X`: each costs bytes
            raise CodecError(f"{number} items of {size} B at offset {self.pos} exceed the message")
        self.spend((_OBJECT + _POINTER + size) * number)
        return list(struct.unpack_from(f"{size}s" * number, self.data, self.take(number * size)))  # C speed

    def int_list(self, depth: int) -> list[int]:
        number = self.count(8)
        self.spend((_OBJECT + _POINTER) * number)
        values = array("q")
        values.frombytes(self.blob(8 * number))
        return values.tolist()

    def bool_list(self, depth: int) -> list[bool]:
        number = self.count(1)
        self.spend(_POINTER * number)
        flags = self.blob(number)
        if flags.translate(None, b"\x00\x01"):
            raise CodecError("a packed bool that is neither 0 nor 1")
        return [flag == 1 for flag in flags]

    def str_list(self, depth: int) -> list[str]:
        number = self.count(4)
        table = self.value(depth + 1)
        if type(table) is not list or not all(type(text) is str for text in table):
            raise CodecError("a packed str list's table is not a list of str")
        self.spend(_POINTER * number)
        indices = array("I")
        indices.frombytes(self.blob(4 * number))
        if number and max(indices) >= len(table):
            raise CodecError("a packed str list names a string its table does not hold")
        return list(map(table.__getitem__, indices))

    def records(self, depth: int) -> list[tuple]:
        number = self.count(0)
        width = self.unpack(_U8)
        if number > len(self.data) - self.pos:  # each record costs its column entries at least a byte
            raise CodecError(f"{number} records at offset {self.pos} exceed the message")
        self.spend((_OBJECT + _POINTER * (width + 1)) * number)
        columns = []
        for _ in range(width):
            column = self.value(depth + 1)
            if type(column) is not list or len(column) != number:
                raise CodecError(f"a column of {number} records is {type(column).__name__} of another length")
            columns.append(column)
        return list(zip(*columns))

    def mapping(self, depth: int) -> dict:
        number = self.count(2)
        self.spend(_OBJECT + 3 * _POINTER * number)
        try:
            return {self.value(depth + 1): self.value(depth + 1) for _ in range(number)}
        except TypeError as exc:  # an unhashable key
            raise CodecError(f"a dict key: {exc}") from None

    def set_(self, depth: int, kind: type) -> Any:
        number = self.count(1)
        self.spend(4 * _OBJECT + 4 * _POINTER * number)  # a set's table: 8 slots at least, 2 words each
        try:
            return kind(self.value(depth + 1) for _ in range(number))
        except TypeError as exc:
            raise CodecError(f"a set item: {exc}") from None

    def key(self, depth: int) -> ChunkKey:
        self.spend(_OBJECT)
        return tuple.__new__(ChunkKey, (self.value(depth + 1), self.value(depth + 1)))  # the service checks types

    def enum(self, depth: int) -> Enum:
        name = self.name()
        cls = ENUMS.get(name)
        if cls is None:
            raise CodecError(f"a node cache message may not contain the enum {name!r}")
        value = self.value(depth + 1)
        try:
            return cls(value)
        except ValueError:
            raise CodecError(f"{value!r} is no {name}") from None

    def dataclass(self, depth: int) -> Any:
        name = self.name()
        cls = DATACLASSES.get(name)
        if cls is None:
            raise CodecError(f"a node cache message may not contain {name!r}")
        fields = {}
        for _ in range(self.unpack(_U8)):
            field = self.value(depth + 1)
            if field not in _FIELDS[cls] or field in fields:
                raise CodecError(f"{name} has no field {field!r} (or names it twice)")
            fields[field] = self.value(depth + 1)
        self.spend(2 * _OBJECT + 3 * _POINTER * len(fields))
        try:
            return cls(**fields)
        except TypeError as exc:  # a field without a default missing
            raise CodecError(f"{name}: {exc}") from None


def _fixed(layout: struct.Struct) -> Callable[[_Reader, int], Any]:
    def read(reader: _Reader, depth: int) -> Any:
        reader.spend(_OBJECT)
        return reader.unpack(layout)

    return read


_READ: dict[int, Callable[[_Reader, int], Any]] = {
    ord("N"): lambda reader, depth: None,
    ord("T"): lambda reader, depth: True,
    ord("F"): lambda reader, depth: False,
    ord("i"): _fixed(_I64),
    ord("I"): _Reader.big_int,
    ord("f"): _fixed(_F64),
    ord("s"): _Reader.str_,
    ord("b"): _Reader.bytes_,
    ord("l"): _Reader.items,
    ord("t"): lambda reader, depth: tuple(reader.items(depth)),
    ord("X"): _Reader.bytes_list,
    ord("x"): lambda reader, depth: tuple(reader.bytes_list(depth)),
    ord("H"): _Reader.hashes,
    ord("h"): lambda reader, depth: tuple(reader.hashes(depth)),
    ord("Q"): _Reader.int_list,
    ord("q"): lambda reader, depth: tuple(reader.int_list(depth)),
    ord("O"): _Reader.bool_list,
    ord("S"): _Reader.str_list,
    ord("G"): _Reader.records,
    ord("d"): _Reader.mapping,
    ord("e"): lambda reader, depth: reader.set_(depth, set),
    ord("z"): lambda reader, depth: reader.set_(depth, frozenset),
    ord("K"): _Reader.key,
    ord("E"): _Reader.enum,
    ord("D"): _Reader.dataclass,
}
