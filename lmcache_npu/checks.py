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
