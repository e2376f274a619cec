"""Checks of the values a key takes, shared by every layer (configs, tiers, policies, tools): one way to refuse a
value, with a message that names the key and the rule."""

from __future__ import annotations


class NotAnInteger(TypeError, ValueError):
    """A key that takes an integer got something else (a bool too). A ValueError as well: every config path reports
    a bad value as ValueError, and a wrong type is a bad value there."""


def _rule(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an integer from {lo} to {hi}"
    if lo is not None:
        return f"an integer >= {lo}"
    if hi is not None:
        return f"an integer <= {hi}"
    return "an integer"


def check_int(key: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """`value` when it is an int (never a bool: True is no count) within [lo, hi] (None: unbounded on that side);
    else a TypeError (`NotAnInteger`) for the wrong type or a ValueError out of range, naming `key` and the rule."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise NotAnInteger(f"{key} must be {_rule(lo, hi)}, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{key} must be {_rule(lo, hi)}, got {value!r}")
    return value


def hash_blocks_per_chunk(chunk_tokens: int, hash_block_size: int) -> int:
    """How many of vLLM's hash blocks one chunk holds. A chunk is keyed by the block hash at its last token, so it
    must hold whole blocks: the one home of that rule (layout discovery, chunk keys and KV events ask it)."""
    check_int("chunk_tokens", chunk_tokens, lo=1)
    check_int("the hash block size", hash_block_size, lo=1)
    if chunk_tokens % hash_block_size:
        raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of the hash block size {hash_block_size}: "
                         "a chunk is keyed by the block hash at its last token")
    return chunk_tokens // hash_block_size
