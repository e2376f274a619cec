"""The transfer contract's Python face: plans, batches, backends."""

from .backend import BACKEND_NAMES, BackendUnavailable, TransferBackend, TransferStats, get_backend
from .batch import ChunkBatch
from .plan import (
    LAYOUT_VERSION,
    OBJECT_ALIGN_BYTES,
    SKIP_SLOT,
    Direction,
    GroupSpec,
    PageLayout,
    Plane,
    TransferPlan,
    rows_per_chunk,
)

__all__ = [
    "BACKEND_NAMES",
    "LAYOUT_VERSION",
    "OBJECT_ALIGN_BYTES",
    "SKIP_SLOT",
    "BackendUnavailable",
    "ChunkBatch",
    "Direction",
    "GroupSpec",
    "PageLayout",
    "Plane",
    "TransferBackend",
    "TransferPlan",
    "TransferStats",
    "get_backend",
    "rows_per_chunk",
]
