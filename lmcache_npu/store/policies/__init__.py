"""Arena eviction policies for the scheduler's index (DESIGN §7): one module per policy, `base.py` the interface.

`make_policy(name, capacity)` builds one by its configuration name (`eviction_policy`).
"""

from __future__ import annotations

from .arc import ArcPolicy
from .base import Evictable, EvictionPolicy
from .lru import LruPolicy
from .s3fifo import S3FifoPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LruPolicy, ArcPolicy, S3FifoPolicy)}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called `name` for an arena of `capacity` slots; an unknown name is refused with the known ones."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"eviction_policy must be one of {', '.join(sorted(POLICIES))}, got {name!r}")
    return cls(capacity)


__all__ = ["POLICIES", "ArcPolicy", "Evictable", "EvictionPolicy", "LruPolicy", "S3FifoPolicy", "make_policy"]
