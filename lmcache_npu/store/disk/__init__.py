"""The local-disk (NVMe) tier: `format` (names, header, file cost), `trust` (the directory checks), `lock` (one tier
per name), `scan` (what a restart finds) and `tier` (`DiskTier`: the write-behind queue, reads, deletes)."""

from .format import DISK_FORMAT_VERSION, HEADER_BYTES, DiskEntry, disk_chunks_for_capacity
from .scan import scan_disk_directory
from .tier import DiskTier
from .trust import check_disk_parent, data_parallel_root, parent_refusal, root_refusal

__all__ = ["DISK_FORMAT_VERSION", "HEADER_BYTES", "DiskEntry", "DiskTier", "check_disk_parent", "data_parallel_root",
           "disk_chunks_for_capacity", "parent_refusal", "root_refusal", "scan_disk_directory"]
