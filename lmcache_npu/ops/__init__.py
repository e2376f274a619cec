"""The transfer contract's Python face: plans, batches, backends."""

from .backend import BACKEND_NAMES, get_backend
from .transfer_backend import BackendUnavailable, PendingTransfer, TransferBackend, TransferStats
from .batch import ChunkBatch, CutRuns
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
    "CutRuns",
    "Direction",
    "GroupSpec",
    "PageLayout",
    "Plane",
    "TransferBackend",
    "TransferPlan",
    "TransferStats",
    "PendingTransfer",
    "get_backend",
    "rows_per_chunk",
]
