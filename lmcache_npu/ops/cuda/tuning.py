"""The CUDA backend's knobs: which path reaches the host objects, when the kernel pipelines with the copy engine, and
how the work is cut. Every knob is a backend option under its field's name."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping, Optional

import numpy as np

from ..plan import Direction
from .work_order import LOAD_TAIL_BYTES, LOAD_TAIL_SHARE, PIECE_BYTES, STORE_FIRST_SLICE_BYTES, STORE_SLICE_GROWTH


class CudaPath(StrEnum):
    """How the kernel reaches the chunk objects."""

    AUTO = "auto"  # AUTO_PATH per direction
    MAPPED = "mapped"  # the kernel reads/writes pinned host memory directly through UVA (zero-copy)
    STAGING = "staging"  # the kernel gathers into (scatters from) a device buffer the copy engine moves
    DEVICE = "device"  # the objects are in device memory: taken whenever they are, never an option


OPTION_PATHS = (CudaPath.AUTO, CudaPath.MAPPED, CudaPath.STAGING)
# Chosen from the H200 measurements in docs/performance.md: staging is as fast as mapped or faster in both
# directions and leaves the SMs to the model while the copy engine crosses PCIe.
AUTO_PATH = {Direction.STORE: CudaPath.STAGING, Direction.LOAD: CudaPath.STAGING}
# Pipelining (the copy engine meets the kernel through per-slice flags) from this much payload: below it the
# handshakes cost more than the kernel they hide (H100, docs/performance.md).
AUTO_PIPELINE_MIN_BYTES = {Direction.STORE: 34 << 20, Direction.LOAD: 34 << 20}
# An unpipelined store's kernel writes 1/this of the bytes straight into the pinned host objects over PCIe while it
# gathers the rest, so PCIe is busy during the kernel too (H100: 1/16 beat 1/12, 1/24 and 1/48, docs/performance.md).
# Gap-free plans only: the kernel writes items, never the gaps between them.
STORE_MAPPED_PREFIX_SHARE = 16
# An unpipelined load's copy engine moves all but 1/this of the bytes before the kernel, which reads that share
# straight from the pinned host objects while it scatters the rest, so PCIe is busy during the scatter too (H100:
# 1/32 beat 1/8 and 1/16, one llama3-8b chunk 0.949 -> 0.972 of the pinned copy, docs/performance.md).
LOAD_MAPPED_PREFIX_SHARE = 32


@dataclass(frozen=True)
class CudaTuning:
    """The knobs, each checked by its type on construction (a wrong one is refused naming its option)."""

    path: CudaPath = CudaPath.AUTO
    blocks: Optional[int] = None  # grid size of every launch; None: per path and pipelining
    threads: int = 512
    pipeline: Optional[bool] = None  # None: from AUTO_PIPELINE_MIN_BYTES per direction
    piece_bytes: int = PIECE_BYTES
    store_first_slice_bytes: int = STORE_FIRST_SLICE_BYTES
    store_slice_growth: int = STORE_SLICE_GROWTH
    load_tail_bytes: int = LOAD_TAIL_BYTES
    load_tail_share: int = LOAD_TAIL_SHARE
    # None: one per SM for a store, so its slices complete in order; a load's blocks only wait for the copy engine,
    # which never waits for them, so it keeps the unpipelined count
    pipelined_blocks: Optional[int] = None
    store_mapped_prefix_share: int = STORE_MAPPED_PREFIX_SHARE  # 0: no mapped prefix
    load_mapped_prefix_share: int = LOAD_MAPPED_PREFIX_SHARE

    def __post_init__(self) -> None:
        kinds = typing.get_type_hints(CudaTuning)
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, _checked(field.name, getattr(self, field.name), kinds[field.name]))

    @classmethod
    def option_names(cls) -> list[str]:
        return [field.name for field in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> "CudaTuning":
        """The tuning backend_options ask for; an option that is no knob is refused with the valid ones."""
        unknown = sorted(set(options) - set(cls.option_names()), key=str)
        if unknown:
            raise ValueError(f"backend_options: {', '.join(repr(k) for k in unknown)} not accepted by the cuda "
                             f"backend; valid options: {', '.join(cls.option_names())}")
        return cls(**options)  # type: ignore[arg-type]

    def mapped_prefix_share(self, direction: Direction) -> int:
        return self.store_mapped_prefix_share if direction == Direction.STORE else self.load_mapped_prefix_share


def _checked(key: str, value: object, kind: object) -> object:
    """`value` as the knob's type, or a ValueError naming backend_options.`key`."""
    if kind is CudaPath:
        if value not in OPTION_PATHS:
            raise ValueError(f"backend_options.path must be one of {', '.join(OPTION_PATHS)}, got {value!r}")
        return CudaPath(value)
    optional = kind in (Optional[int], Optional[bool])
    if value is None and optional:
        return None
    if kind in (bool, Optional[bool]):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"backend_options.{key} must be true or false{' or null' if optional else ''}, "
                             f"got {value!r}")
        return bool(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"backend_options.{key} must be an integer{' or null' if optional else ''}, got {value!r}")
    return int(value)
