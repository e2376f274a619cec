"""The closed encoding the service reads (codec.py): every value of the protocol round-trips, in its packed form where
it has one; a message that is cut, padded, nested too deep, claims more items than its bytes hold, names a class or
field outside the registry, or would decode beyond the size cap is refused with a CodecError, never decoded."""

from __future__ import annotations

import pickle
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.node import codec
from lmcache_npu.node.messages import Attach, PoolGeometry
from lmcache_npu.store.commands import Tier

from .harness import geometry, keys_of

U32 = struct.Struct("=I")


def tags(message: Any) -> bytes:
    """The tag byte of the message's outermost value."""
    return codec.encode(message)[len(codec.MAGIC):len(codec.MAGIC) + 1]


@pytest.mark.parametrize("value, tag", [
    ([b"h" * 32] * 3, b"H"), ((b"h" * 32, b"i" * 32), b"h"), ([b"a", b"bc"], b"X"), ([1, -2, 3], b"Q"),
    ((1, 2), b"q"), ([True, False], b"O"), (["", "x", ""], b"S"), ([(1, 0, True, ""), (2, 1, False, "x")], b"G"),
    ([b"", b""], b"X"), ([(1, b"")], b"G"), ([1, 2**70], b"l"), ([], b"l"), ((), b"t"), (2**70, b"I"), (-(2**63), b"i"), (keys_of(0, 1)[0], b"K"),
    (Tier.DISK, b"E"), (Attach("e", geometry(2)), b"D"), ({"a": [1.5]}, b"d"), ({1}, b"e"), (frozenset(), b"z"),
])
def test_values_round_trip_in_their_packed_form(value, tag):
    assert tags(value) == tag
    decoded = codec.decode(codec.encode(value))
    assert decoded == value and type(decoded) is type(value)


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=False) | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.lists(st.tuples(inner, inner), max_size=3)
    | st.dictionaries(st.text(max_size=3), inner, max_size=3) | st.frozensets(st.integers(), max_size=3),
    max_leaves=12)


@given(plain)
def test_any_plain_value_round_trips(value):
    assert codec.decode(codec.encode(value)) == value


@given(plain, st.data())
def test_any_cut_or_padded_message_is_refused(value, data):
    payload = codec.encode(value)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(codec.CodecError):
        codec.decode(payload[:cut])
    with pytest.raises(codec.CodecError, match="after the message's value"):
        codec.decode(payload + b"N")


@pytest.mark.parametrize("body, error", [
    (b"l" + U32.pack(5) + b"N", "a count of 5 items"),
    (b"H" + U32.pack(1 << 28) + U32.pack(32), "items of 32 B"),
    (b"H" + U32.pack(1 << 28) + U32.pack(0), "items of 0 B"),  # 2**28 empty bytes from 9 B: never
    (b"Q" + U32.pack(3) + b"\0" * 16, "a count of 3 items"),
    (b"s" + U32.pack(1 << 31), "the message would decode to more than"),
    (b"O" + U32.pack(2) + b"\x01\x02", "neither 0 nor 1"),
    (b"S" + U32.pack(1) + b"l" + U32.pack(1) + b"s" + U32.pack(0) + U32.pack(7), "a string its table does not hold"),
    (b"G" + U32.pack(2) + b"\x01" + b"Q" + U32.pack(1) + b"\0" * 8, "a column of 2 records"),
    (b"?", "unknown tag"),
    (b"E\x04Evil" + b"N", "may not contain the enum 'Evil'"),
    (b"E\x04Tier" + b"s" + U32.pack(3) + b"gpu", "'gpu' is no Tier"),
    (b"D\x06Socket" + b"\x00", "may not contain 'Socket'"),
    (b"D\x06Attach\x01" + b"s" + U32.pack(7) + b"__dict_" + b"N", "Attach has no field '__dict_'"),
    (b"D\x06Attach\x00", "Attach: "),  # its engine and geometry are missing
    (b"I" + struct.pack("=H", 65) + b"\0" * 65, "an int of 65 bytes"),
    (b"d" + U32.pack(1) + b"l" + U32.pack(0) + b"N", "a dict key: "),
    (b"s" + U32.pack(4) + b"ab", "truncated"),
])
def test_a_malformed_or_hostile_message_is_refused(body, error):
    with pytest.raises(codec.CodecError, match=error.replace("(", r"\(")):
        codec.decode(codec.MAGIC + body)


def test_nesting_is_bounded_both_ways():
    deep: Any = None
    for _ in range(codec.MAX_DEPTH + 2):
        deep = [deep, 0]
    with pytest.raises(TypeError, match="nests deeper"):
        codec.encode(deep)
    with pytest.raises(codec.CodecError, match="nests deeper"):
        codec.decode(codec.MAGIC + (b"l" + U32.pack(1)) * (codec.MAX_DEPTH + 2) + b"N")


def test_a_pickle_or_another_version_is_not_this_encoding():
    for payload in (pickle.dumps(("lookup", "r"), protocol=5), b"\xa7\x02N", b""):
        with pytest.raises(codec.CodecError, match="not a message of this encoding"):
            codec.decode(payload)


@pytest.mark.parametrize("value", [object(), 1j, bytearray(b"x"), PoolGeometry, print, [object()]],
                         ids=["object", "complex", "bytearray", "class", "function", "nested"])
def test_what_the_protocol_does_not_carry_is_refused_at_encoding(value):
    with pytest.raises(TypeError, match="may not carry"):
        codec.encode(value)
