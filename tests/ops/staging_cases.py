"""Device-staging cases shared by the CUDA and NPU suites: what a store copies out of a staging buffer that an
earlier load filled with host bytes."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from lmcache_npu.ops import GroupSpec, TransferBackend

from .oracle import Geometry, allocate, payload_mask

HOST_GAP = 0xEE
CHUNKS = 4


Place = Callable[[torch.Tensor], torch.Tensor]


def two_group_geometry(device: torch.device, place_pages: Optional[Place] = None) -> Geometry:
    """Two groups of equal shape, rows of 33 B: each 528 B segment leaves a 48 B alignment gap."""
    g = torch.Generator().manual_seed(5)
    geometry = Geometry([GroupSpec(16), GroupSpec(16)],
                        [allocate(2 * CHUNKS, 16, 33, 0, 0, g), allocate(2 * CHUNKS, 16, 33, 0, 1, g)], 16)
    for rp in geometry.raw_planes:
        rp.raw = place_pages(rp.raw) if place_pages is not None else rp.raw.to(device)
    return geometry


def two_group_slots() -> list[np.ndarray]:
    return [np.arange(16 * CHUNKS).reshape(CHUNKS, 16), np.arange(16 * CHUNKS).reshape(CHUNKS, 16) + 16 * CHUNKS]


def gap_bytes_of_a_store_after_a_load(backend: TransferBackend, device: torch.device,
                                      place_pages: Optional[Place] = None,
                                      pin: Place = lambda t: t.pin_memory()) -> np.ndarray:
    """Loads from pinned objects that are HOST_GAP everywhere, then stores into fresh ones: their gap bytes.
    `place_pages` and `pin` put pages and objects where a backend under test needs them (default: `device`, torch's
    pinned memory)."""
    geometry = two_group_geometry(device, place_pages)
    plan = geometry.plan()
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        prepare(plan)
    loaded = pin(torch.full((CHUNKS, plan.object_bytes), HOST_GAP, dtype=torch.uint8))
    backend.load(plan, two_group_slots(), loaded)
    stored = pin(torch.full((CHUNKS, plan.object_bytes), 0x5A, dtype=torch.uint8))
    backend.store(plan, two_group_slots(), stored)
    gaps = ~payload_mask(geometry)
    assert gaps.any(), "the geometry must leave alignment gaps"
    return stored.numpy()[:, gaps]
