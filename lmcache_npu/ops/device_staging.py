"""What device backends keep between transfers: the plane table on the device, the staging buffer, and the
packing and copying of per-call tables and host objects around it."""

from __future__ import annotations

import weakref
from typing import Collection, Optional, Sequence

import numpy as np
import torch

from .plan import OBJECT_ALIGN_BYTES, Direction, TransferPlan


class PlaneTables:
    """The plan's plane table, uploaded once per plan to the device its planes live on."""

    def __init__(self) -> None:
        self._tables: "weakref.WeakKeyDictionary[TransferPlan, torch.Tensor]" = weakref.WeakKeyDictionary()

    def get(self, plan: TransferPlan) -> torch.Tensor:
        table = self._tables.get(plan)
        if table is None:
            table = torch.from_numpy(plan.plane_table.view(np.uint8)).to(plan.device)
            self._tables[plan] = table
        return table

    def upload(self, plan: TransferPlan) -> None:
        """The table on the device now, the copy finished: later transfers on any stream read it."""
        table = self.get(plan)
        getattr(torch, table.device.type).current_stream(table.device).synchronize()


def packed_offsets(parts: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Where each part of a packed table buffer starts (64 B aligned), and the buffer's size."""
    offsets, end = [], 0
    for part in parts:  # a handful of parts: plain arithmetic, no numpy call per transfer
        offsets.append(end)
        end += (part.nbytes + 63) // 64 * 64
    return offsets, max(end, 64)


def pack_into(view: np.ndarray, parts: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
    """Writes each part at its offset of a uint8 host buffer."""
    for part, offset in zip(parts, offsets):
        view[offset: offset + part.nbytes] = np.ascontiguousarray(part).view(np.uint8).reshape(-1)


class StagingLedger:
    """Which bytes of a reused device staging buffer may hold something other than a store's output.

    A store copies whole stretches of the buffer to the host, alignment gaps included, so every byte a store can copy
    out must hold the kernel's output or zeros: never another plan's device payload, nor host bytes (another object's
    gaps) that an earlier load copied in. A gap-free plan's store overwrites every byte, so it never zeroes; otherwise
    the zeroing is stream-ordered before the store's kernel and covers only bytes a load or another plan dirtied.
    Uses must be claimed in the order the device runs them."""

    def __init__(self) -> None:
        self._plan: Optional["weakref.ref[TransferPlan]"] = None
        self._dirty = (0, 0)  # [begin, end): may hold bytes that are not a store's output

    def fresh(self) -> None:
        """The buffer is new memory (zeroed, or never read before a store writes it)."""
        self._dirty = (0, 0)
        self._plan = None

    def claim(self, plan: TransferPlan, nbytes: int, capacity: int, direction: Direction) -> Optional[tuple[int, int]]:
        """Records a use of the first `nbytes` of a `capacity`-byte buffer; the [begin, end) bytes the device must
        zero before this use's kernel (a store's only), or None."""
        if self._plan is not None and self._plan() is not plan:
            self._dirty = (0, capacity)  # the old plan's payload sits where this plan has gaps
        self._plan = weakref.ref(plan)
        begin, end = self._dirty
        if direction == Direction.LOAD:
            if not plan.gap_free:
                self._dirty = (0, max(end, nbytes))  # host bytes land in [0, nbytes), this plan's gaps included
            return None
        pending = (begin, min(end, nbytes)) if not plan.gap_free and begin < min(end, nbytes) else None
        rest = max(begin, nbytes)  # [0, nbytes) will hold this store's output or zeros
        self._dirty = (rest, end) if rest < end else (0, 0)
        return pending

    @property
    def dirty(self) -> tuple[int, int]:
        """The byte range a store would zero before use (for tests and logs)."""
        return self._dirty


class StagingBuffer:
    """The device buffer host chunk objects pass through (a torch tensor on the plan's device), kept across
    transfers and zeroed only where the StagingLedger says."""

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None
        self._address = 0  # the buffer's first byte
        self._ledger = StagingLedger()
        # bytes reserve() found dirty, zeroed by zero_pending() or by the caller (take_pending())
        self._pending: Optional[tuple[int, int]] = None

    def get(self, plan: TransferPlan, nbytes: int, direction: Direction) -> torch.Tensor:
        """reserve() then zero_pending(): the buffer ready for this transfer's kernel."""
        view = self.reserve(plan, nbytes, direction)
        self.zero_pending()
        return view

    def reserve(self, plan: TransferPlan, nbytes: int, direction: Direction) -> torch.Tensor:
        """The first `nbytes` of the buffer for one transfer; host bookkeeping only (an allocation at most), so a
        caller can prepare everything before its first device operation and zero the pending bytes right before
        the kernel."""
        self.claim(plan, nbytes, direction)
        return self._buffer[:nbytes]  # type: ignore[index]

    def claim(self, plan: TransferPlan, nbytes: int, direction: Direction) -> int:
        """`reserve` for a caller that needs only the buffer's address (no tensor view is made)."""
        buffer = self._buffer
        if buffer is None or buffer.numel() < nbytes or buffer.device != plan.device:
            buffer = self._buffer = torch.zeros(nbytes, dtype=torch.uint8, device=plan.device)
            self._address = buffer.data_ptr()
            self._ledger.fresh()
        self._pending = self._ledger.claim(plan, nbytes, buffer.numel(), direction)
        return self._address

    def zero_pending(self) -> None:
        """Enqueues the zeroing reserve() found necessary on the current stream (nothing when none was)."""
        pending = self.take_pending()
        if pending is not None and self._buffer is not None:
            self._buffer[pending[0]:pending[1]].zero_()

    def take_pending(self) -> Optional[tuple[int, int]]:
        """The [begin, end) bytes reserve() found dirty, for a caller that enqueues the zeroing itself."""
        pending, self._pending = self._pending, None
        return pending

    @property
    def dirty(self) -> tuple[int, int]:
        """The byte range a store would zero before use (for tests and logs)."""
        return self._ledger.dirty


def plane_segments(plan: TransferPlan, planes: Optional[Collection[int]] = None) -> list[tuple[int, int]]:
    """(offset, length) of each moved plane's bytes in an object (only `planes`, indices into the moved planes, where
    given), in object order, with neighbours merged across alignment gaps only (< OBJECT_ALIGN_BYTES: a plane in
    between is at least that far away, as planes are aligned), so a partial plan's copies never cover a plane
    outside it."""
    spans = sorted((offset, plan.rows_per_chunk[p.group] * p.row_bytes)
                   for i, (offset, p) in enumerate(zip(plan.object_offsets, plan.moved_planes))
                   if planes is None or i in planes)
    merged: list[list[int]] = []
    for offset, length in spans:
        if length <= 0:
            continue
        if merged and offset - (merged[-1][0] + merged[-1][1]) < OBJECT_ALIGN_BYTES:
            merged[-1][1] = offset + length - merged[-1][0]
        else:
            merged.append([offset, length])
    return [(o, n) for o, n in merged]


def object_pieces(plan: TransferPlan, num_chunks: int) -> list[tuple[int, int, int]]:
    """The (chunk, offset, length) pieces a staged transfer copies: whole objects for a full plan (a store then
    writes every object byte, gaps as zeros), only the planes' segments for a partial plan (`plane_subset`)."""
    if not plan.partial:
        return [(c, 0, plan.object_bytes) for c in range(num_chunks)]
    segments = plane_segments(plan)
    return [(c, offset, length) for c in range(num_chunks) for offset, length in segments]


def stretch_table(addresses: np.ndarray, storages: np.ndarray, pieces: np.ndarray, object_bytes: int) -> np.ndarray:
    """Merges (chunk, offset, length[, slice]) piece rows, ordered by staging offset, into the longest stretches
    contiguous in both staging (chunk c at c * object_bytes) and host memory (each chunk's object at `addresses[c]`,
    inside allocation `storages[c]`; and within one slice, where a fourth column names it), so each becomes one async
    copy. Vectorized: a sliced load plans hundreds of pieces."""
    pieces = np.asarray(pieces, dtype=np.int64)
    if len(pieces) <= 1:
        return pieces.copy()
    chunk, offset, length = pieces[:, 0], pieces[:, 1], pieces[:, 2]
    address, storage = addresses.astype(np.int64), storages.astype(np.int64)
    staged, hosted = chunk * object_bytes + offset, address[chunk] + offset
    joins = ((staged[1:] == staged[:-1] + length[:-1]) & (hosted[1:] == hosted[:-1] + length[:-1])
             & (storage[chunk[1:]] == storage[chunk[:-1]]))
    if pieces.shape[1] > 3:
        joins &= pieces[1:, 3] == pieces[:-1, 3]
    begins = np.flatnonzero(np.concatenate(([True], ~joins)))
    lasts = np.append(begins[1:], len(pieces)) - 1
    merged = pieces[begins].copy()
    merged[:, 2] = staged[lasts] + length[lasts] - staged[begins]
    return merged


def host_stretches(objects: Sequence[torch.Tensor], pieces: Sequence[tuple[int, int, int]],
                   object_bytes: int) -> list[tuple[int, int, int]]:
    """`stretch_table` over (chunk, offset, length) tuples."""
    addresses = np.array([o.data_ptr() for o in objects], dtype=np.uint64)
    storages = np.array([o.untyped_storage().data_ptr() for o in objects], dtype=np.uint64)
    table = stretch_table(addresses, storages, np.array(pieces, dtype=np.int64).reshape(-1, 3), object_bytes)
    return [(int(c), int(o), int(n)) for c, o, n in table.tolist()]
