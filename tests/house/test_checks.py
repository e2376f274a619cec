"""The one integer check every layer uses: the type refused as TypeError (and ValueError, for the config paths), the
range as ValueError, each message naming the key and the rule."""

from __future__ import annotations

import pytest

from lmcache_npu.checks import NotAnInteger, check_int


@pytest.mark.parametrize("value, lo, hi", [(0, 0, None), (7, None, 7), (-3, None, None), (1 << 70, 1, None),
                                           (5, 1, 64)])
def test_an_int_within_its_bounds_is_returned(value: int, lo: int | None, hi: int | None) -> None:
    assert check_int("k", value, lo, hi) == value


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, [1]])
def test_a_non_int_or_a_bool_is_a_type_error_naming_key_and_rule(value: object) -> None:
    with pytest.raises(TypeError, match=r"^io_threads must be an integer from 1 to 64, got ") as caught:
        check_int("io_threads", value, 1, 64)
    assert isinstance(caught.value, (NotAnInteger, ValueError))
    assert caught.value.args[0].endswith(repr(value))


@pytest.mark.parametrize("value, lo, hi, rule", [
    (0, 1, None, "an integer >= 1"), (11, 0, 10, "an integer from 0 to 10"), (-1, 0, 10, "an integer from 0 to 10"),
    (9, None, 8, "an integer <= 8")])
def test_out_of_range_is_a_value_error_naming_key_and_rule(value: int, lo: int | None, hi: int | None,
                                                           rule: str) -> None:
    with pytest.raises(ValueError, match=f"^load_retries must be {rule}, got {value}$") as caught:
        check_int("load_retries", value, lo, hi)
    assert not isinstance(caught.value, TypeError)  # a range error is not a type error


def test_negative_control_the_bounds_are_inclusive_and_one_past_them_is_refused() -> None:
    assert check_int("k", 1, 1, 3) == 1 and check_int("k", 3, 1, 3) == 3
    for outside in (0, 4):
        with pytest.raises(ValueError):
            check_int("k", outside, 1, 3)


def test_a_chunk_holds_whole_hash_blocks():
    from lmcache_npu.checks import hash_blocks_per_chunk

    assert hash_blocks_per_chunk(256, 16) == 16 and hash_blocks_per_chunk(128, 128) == 1
    for chunk, block, rule in ((200, 16, "not a multiple of the hash block size 16"), (0, 16, "chunk_tokens"),
                               (128, 0, "hash block size"), (True, 16, "chunk_tokens")):
        with pytest.raises(ValueError, match=rule):
            hash_blocks_per_chunk(chunk, block)
