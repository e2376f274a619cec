"""What the host kernel offers for anonymous memory: page sizes, transparent and explicit hugepages (read from
sysfs), and the `hugepages` key's values. The arena's segments (`store/segments.py`) map their memory by these."""

from __future__ import annotations

from typing import Optional

PAGE_BYTES = 4096
THP_BYTES = 2 << 20  # transparent hugepages are PMD-sized: segments start on this boundary so THP can back them whole
HUGEPAGE_CHOICES = {"auto": 0, "off": 0, "2M": 2 << 20, "1G": 1 << 30}


def parse_hugepages(value: object) -> str:
    """The `hugepages` key: auto (transparent hugepages where the kernel offers them), off, 2M or 1G (MAP_HUGETLB)."""
    if not isinstance(value, str) or value not in HUGEPAGE_CHOICES:
        raise ValueError(f"hugepages must be one of {', '.join(HUGEPAGE_CHOICES)}, got {value!r}")
    return value


def _thp_setting(name: str) -> str:
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{name}", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def transparent_hugepages_enabled() -> bool:
    """The kernel backs madvise(MADV_HUGEPAGE) ranges with transparent hugepages without stalling a fault on
    compaction: enabled 'always' or 'madvise', defrag 'defer' or 'never'. Where a madvised fault compacts
    synchronously (defrag 'always', 'madvise', 'defer+madvise'), pre-faulting a fragmented host ran 10x slower
    (0.13 vs 1.2 GB/s, docs/storage.md), so `hugepages: auto` leaves such kernels to their default."""
    return _thp_setting("enabled") in ("always", "madvise") and _thp_setting("defrag") in ("defer", "never")


def free_hugepages(page_bytes: int) -> Optional[int]:
    """Free explicit hugepages of `page_bytes` in the system pool (None where the kernel does not say)."""
    path = f"/sys/kernel/mm/hugepages/hugepages-{page_bytes // 1024}kB/free_hugepages"
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None
