"""The AscendC kernel on an Ascend NPU (lmcache_npu._npu); torch_npu is imported only by NpuRuntime.load().

Host chunk objects (the arena's slots) pass through a fixed device staging window: the kernel gathers into it (a
store) or scatters from it (a load) and the copy engine crosses the host link with aclrtMemcpyAsync, so no AI-core
time waits on PCIe. A batch larger than the window is moved in several windows, back to back on the lane's stream.
Every device operation of a transfer (table upload, zeroing, copies, the kernel, the status read-back) is enqueued
by the native module as tasks of torch_npu's task queue on the lane's current stream: ordered after what that stream
already queued (the page fence's waits), without draining the device-wide queue the model's launches go through, and
asynchronous by construction (the host side is page-locked memory we allocated or registered, never a torch_npu
guess). The lane waits on an event at the end, never on a stream, and never longer than its deadline: a task torch_npu
drops (after any failed task on the device) or refuses (its queue in an error state) fails the transfer at once, and
a transfer that does not complete in `wait_timeout_ms` fails too, so a device fault costs a recompute, never a hang.

A load can also return once enqueued (`launch`): each launch in flight has its own native Transfer (its completion
event), tables and status buffers, since a queued task reads them when it runs, so a sliced load's slices queue back
to back on the lane's stream with no host wait between them (the staging window is reused in stream order). Stores
run to their end.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..checks import check_int
from ..platform.npu_budget import (STAGING_WINDOW_BYTES_DEFAULT, TRANSFER_CORES_DEFAULT,
                                   TRANSFER_WAIT_TIMEOUT_MS_DEFAULT)
from ..platform.npu_runtime import DeviceBuffer, DeviceUnavailable, NpuRuntime, PinnedBuffer
from .batch import ChunkBatch
from .device_staging import StagingLedger, host_stretches, object_pieces, pack_into, packed_offsets
from .plan import CORE_STATUS_DTYPE, Direction, TransferPlan, align_up
from .soc import check_built_soc, check_soc_rules, soc_from_name
from .transfer_backend import (AfterKernel, BackendUnavailable, KernelReport, PendingTransfer, TransferBackend,
                               TransferStats, warm_up)

logger = logging.getLogger(__name__)

COPY_DTYPE = np.dtype([("device", "<u8"), ("host", "<u8"), ("bytes", "<u8")])
_LAUNCH_U64 = ("table_host", "table_device", "table_bytes", "planes", "groups", "runs", "objects", "status_device",
               "status_host", "status_bytes", "zero_device", "zero_bytes", "copies_in", "num_copies_in",
               "copies_out", "num_copies_out", "total_items")
_LAUNCH_U32 = ("block_dim", "num_planes", "num_groups", "num_runs", "num_chunks", "direction", "tile_bytes",
               "zero_tile_bytes")


def launch_dtype(native: Any) -> np.dtype:
    """The numpy twin of the native LaunchDesc, at the offsets the built module reports (a stale build fails here)."""
    fields = dict(native.LAUNCH_FIELDS)
    names = _LAUNCH_U64 + _LAUNCH_U32
    if set(fields) != set(names) or native.COPY_BYTES != COPY_DTYPE.itemsize:
        raise BackendUnavailable(f"lmcache_npu._npu has launch fields {sorted(fields)}; this package expects "
                                 f"{sorted(names)}: rebuild it (bash docker/install.sh, or pip install . with CANN)")
    formats = ["<u8"] * len(_LAUNCH_U64) + ["<u4"] * len(_LAUNCH_U32)
    return np.dtype({"names": list(names), "formats": formats, "offsets": [fields[n] for n in names],
                     "itemsize": native.LAUNCH_BYTES})


@dataclass
class _Grown:
    """A device buffer and its page-locked host twin that grow (between transfers only) to what a transfer needs."""

    device: Optional[DeviceBuffer] = None
    host: Optional[PinnedBuffer] = None

    def ensure(self, runtime: NpuRuntime, nbytes: int, what: str) -> tuple[DeviceBuffer, PinnedBuffer]:
        if self.device is None or self.host is None or self.device.nbytes < nbytes:
            size = max(4096, 1 << (max(nbytes, 1) - 1).bit_length())  # powers of two: few reallocations
            self.close()
            self.device = runtime.device_buffer(size, f"{what} (device)")
            self.host = runtime.pinned_buffer(size, f"{what} (host)")
        return self.device, self.host

    def close(self) -> None:
        for buffer in (self.device, self.host):
            if buffer is not None:
                buffer.close()
        self.device = self.host = None


@dataclass
class _Flight:
    """What one transfer uses until it is waited for: the native Transfer (its completion event), the tables its
    upload task reads and the status blocks its kernel writes. `late`: its last wait failed; it is handed out first,
    so its Transfer's Begin refuses every new transfer while that one may still run on the device."""

    transfer: Any
    tables: _Grown
    status: _Grown
    late: bool = False

    def close(self) -> None:
        self.tables.close()
        self.status.close()


@dataclass(frozen=True)
class _Submitted:
    """An enqueued transfer: its flight and how many windows it has."""

    flight: _Flight
    windows: int


class NpuBackend(TransferBackend):
    """`cores`: vector cores per launch (default platform.npu_budget.TRANSFER_CORES_DEFAULT, at most the SoC's);
    `staging_bytes`: the device staging window each lane keeps (at least one chunk object; default
    STAGING_WINDOW_BYTES_DEFAULT); `wait_timeout_ms`: how long a transfer may take before it fails (default
    TRANSFER_WAIT_TIMEOUT_MS_DEFAULT)."""

    name = "npu"

    def __init__(self, cores: Optional[int] = None, staging_bytes: Optional[int] = None,
                 wait_timeout_ms: Optional[int] = None) -> None:
        try:
            runtime = NpuRuntime.load()
        except DeviceUnavailable as exc:
            raise BackendUnavailable(str(exc)) from exc
        self._setup(runtime, cores, staging_bytes, wait_timeout_ms)

    @classmethod
    def on_runtime(cls, runtime: NpuRuntime, cores: Optional[int] = None, staging_bytes: Optional[int] = None,
                   wait_timeout_ms: Optional[int] = None) -> "NpuBackend":
        """A backend over a given runtime (tests: the native code built against a fake device)."""
        backend = cls.__new__(cls)
        backend._setup(runtime, cores, staging_bytes, wait_timeout_ms)
        return backend

    def _setup(self, runtime: NpuRuntime, cores: Optional[int], staging_bytes: Optional[int],
               wait_timeout_ms: Optional[int]) -> None:
        for key, value in (("cores", cores), ("staging_bytes", staging_bytes), ("wait_timeout_ms", wait_timeout_ms)):
            if value is not None:
                check_int(f"backend_options.{key}", value, lo=1, hi=2**31 - 1 if key == "wait_timeout_ms" else None)
        from lmcache_npu import _emu

        self.runtime = runtime
        self._launch_dtype = launch_dtype(runtime.native)
        platform = runtime.platform()
        try:
            self.soc = soc_from_name(platform.soc, platform.ub_bytes, platform.vector_cores)
            check_built_soc(platform.built_soc, platform.soc)
        except ValueError as exc:  # a build that cannot run here: refused at start, never a failed launch later
            raise BackendUnavailable(str(exc)) from exc
        self.wait_timeout_ms = wait_timeout_ms if wait_timeout_ms is not None else TRANSFER_WAIT_TIMEOUT_MS_DEFAULT
        if cores is not None and cores > platform.vector_cores:
            raise ValueError(f"backend_options.cores {cores} exceeds the {platform.vector_cores} vector cores of "
                             f"{platform.soc}")
        self.cores = cores if cores is not None else min(TRANSFER_CORES_DEFAULT, platform.vector_cores)
        self.staging_bytes = staging_bytes if staging_bytes is not None else STAGING_WINDOW_BYTES_DEFAULT
        self.tiling = _emu.ub_tiling(self.soc.ub_bytes)  # the one tiling function (transfer_plan.h)
        self.task_queue = platform.task_queue
        self._plane_tables: "weakref.WeakKeyDictionary[TransferPlan, DeviceBuffer]" = weakref.WeakKeyDictionary()
        self._staging: Optional[DeviceBuffer] = None
        self._ledger = StagingLedger()
        self._spares: list[_Flight] = []  # flights no transfer uses (a late one first)
        self._flights: list[_Flight] = []  # every flight made, closed with the backend
        self._flights_lock = threading.Lock()  # guards both lists: flights come back from the lanes' finishes
        self._lock = threading.Lock()  # one submission at a time: the staging window and its ledger are shared
        self.last_windows = 0
        self.last_submit_seconds = 0.0
        logger.info("npu backend on %s: %d of %d vector cores per launch, %d B UB, tile %d B, staging window %d MiB, "
                    "task queue %s", platform.soc, self.cores, platform.vector_cores, self.soc.ub_bytes,
                    self.tiling["tile_bytes"], self.staging_bytes >> 20, "on" if self.task_queue else "off")

    # ---- per plan ---------------------------------------------------------------------------------------------------

    def chunks_per_window(self, plan: TransferPlan) -> int:
        """Host chunk objects one staging window holds: as many as `staging_bytes` fits, at least one."""
        return max(1, self.staging_bytes // max(plan.object_bytes, 1))

    def staging_window_bytes(self, plan: TransferPlan) -> int:
        return max(self.chunks_per_window(plan) * plan.object_bytes, 64)

    def prepare(self, plan: TransferPlan) -> None:
        """Uploads the plan's plane table and sizes the staging window for it, before serving: nothing is allocated
        or uploaded on the transfer path afterwards."""
        with self._lock:
            self.runtime.bind_thread()
            self._plane_table(plan)
            window = self.staging_window_bytes(plan)
            if window > self.staging_bytes:
                logger.warning("npu backend: one chunk object (%d B) is larger than the staging window (%d B); the "
                               "window holds one chunk", plan.object_bytes, self.staging_bytes)
            if self._staging is None or self._staging.nbytes < window:
                if self._staging is not None:
                    self._staging.close()
                self._staging = self.runtime.device_buffer(window, "npu staging window")
                self._ledger.fresh()
        if plan.object_bytes:
            scratch = self.runtime.pinned_buffer(plan.object_bytes, "npu warm-up object")
            try:
                warm_up(self, plan, torch.from_numpy(scratch.array))
            finally:
                scratch.close()

    def _plane_table(self, plan: TransferPlan) -> DeviceBuffer:
        table = self._plane_tables.get(plan)
        if table is None:
            host = np.ascontiguousarray(plan.plane_table).view(np.uint8)
            table = self.runtime.device_buffer(max(host.nbytes, 64), "npu plane table")
            self.runtime.native.copy_to_device(table.address, host.ctypes.data, host.nbytes)
            self._plane_tables[plan] = table
        return table

    def close(self) -> None:
        """Frees the device and page-locked buffers now (after the last transfer)."""
        with self._lock:
            for table in list(self._plane_tables.values()):
                table.close()
            self._plane_tables.clear()
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            for flight in self._flights:
                flight.close()
            self._flights.clear()
            self._spares.clear()

    # ---- a transfer -------------------------------------------------------------------------------------------------

    def _launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        with self._lock:
            submitted = self._submit(batch, after_kernel)
        return self._complete(submitted)

    def launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> PendingTransfer:
        """A load returns once enqueued, on its own flight (the next launch reuses none of its buffers before it is
        finished); a store runs to its end."""
        if batch.direction != Direction.LOAD:
            return super().launch(batch, after_kernel)
        start = time.perf_counter()
        with self._lock:
            submitted = self._submit(batch, after_kernel)
        seconds = time.perf_counter() - start

        def finish() -> TransferStats:
            return self._stats(batch, self._complete(submitted), seconds)

        return PendingTransfer(finish, asynchronous=True)

    def _submit(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> _Submitted:
        """Checks the batch and enqueues all of it (windows, then the tail) on a spare flight; the caller holds the
        lock and completes the result. Raises before anything is enqueued on bad input."""
        plan = batch.plan
        if plan.device.type != self.runtime.device.type:
            raise ValueError(f"the npu backend moves {self.runtime.device.type} pages; the plan's planes are on "
                             f"{plan.device}")
        check_soc_rules(plan, self.soc)
        on_device = [self.runtime.is_device_tensor(o) for o in batch.objects]
        if any(on_device) and not all(on_device):
            raise ValueError("chunk objects must all be in device memory or all in host memory")
        staged = not on_device[0]
        if staged and (self._staging is None or self._staging.nbytes < self.staging_window_bytes(plan)):
            raise ValueError("the npu backend has no staging window for this plan: call prepare(plan) before "
                             "transferring host objects")
        windows = batch.chunk_windows(self.chunks_per_window(plan)) if staged else [batch]
        flight = self._spare()
        try:
            launches, keep = self._launches(plan, windows, staged, flight)
            flight.transfer.begin()  # a late flight refuses here while its transfer may still run on the device
        except BaseException:
            self._give_back(flight, flight.late)
            raise
        native, submitted = flight.transfer, _Submitted(flight, len(windows))
        started = time.perf_counter()
        # raising here keeps the flight out of the spares: windows it queued before failing may still read its tables
        native.submit_windows(launches.ctypes.data, len(launches))
        self.last_submit_seconds = time.perf_counter() - started  # ~0 unless a copy ran synchronously (selftest)
        try:
            if after_kernel is not None:
                after_kernel(None)  # the stream's queued position is right after the last kernel: the pages are free
        except BaseException:
            native.submit_tail(launches.ctypes.data, len(launches))  # whatever happened: the wait must end
            try:
                self._complete(submitted)
            except Exception:  # noqa: BLE001 - a consequence of the error being raised, which is the one to report
                logger.debug("npu backend: the failed submission's transfer also failed", exc_info=True)
            raise
        native.submit_tail(launches.ctypes.data, len(launches))
        del keep  # the native submits copied the records and the copy rows they point to
        self.last_windows = len(windows)
        return submitted

    def _complete(self, submitted: _Submitted) -> KernelReport:
        """Waits (no GIL, at most the deadline) for a submitted transfer and reads its kernel's status blocks; raises
        the first failed ACL call. Its flight is spare again either way (first, and late, after a failure)."""
        flight = submitted.flight
        try:
            flight.transfer.wait()
        except BaseException:
            self._give_back(flight, late=True)
            raise
        assert flight.status.host is not None
        statuses = flight.status.host.array[: submitted.windows * self._status_stride].reshape(submitted.windows, -1)
        report = np.ascontiguousarray(statuses[:, : self._status_bytes]).view(CORE_STATUS_DTYPE)
        self._give_back(flight, late=False)  # after its status is read: the next transfer on it overwrites it
        return KernelReport(bytes_moved=int(report["bytes_moved"].sum()), launches=submitted.windows,
                            items_done=int(report["items_done"].sum()),
                            items_rejected=int(report["items_rejected"].sum()),
                            dma_ops=int(report["dma_ops"].sum()) - self.cores * submitted.windows)

    def _spare(self) -> _Flight:
        """A flight no transfer uses, a late one first (its Begin refuses while its transfer may still run), made on
        this thread (the lane's: the Transfer's event needs the device) when none is spare."""
        with self._flights_lock:
            if self._spares:
                return self._spares.pop(0)
        self.runtime.bind_thread()
        flight = _Flight(self.runtime.native.Transfer(self.wait_timeout_ms), _Grown(), _Grown())
        with self._flights_lock:
            self._flights.append(flight)
        return flight

    def _give_back(self, flight: _Flight, late: bool) -> None:
        with self._flights_lock:
            flight.late = late
            self._spares.insert(0 if late else len(self._spares), flight)

    @property
    def _status_bytes(self) -> int:
        """One window's core status blocks."""
        return self.cores * CORE_STATUS_DTYPE.itemsize

    @property
    def _status_stride(self) -> int:
        """Where consecutive windows' status blocks start: 64 B apart at least (aclrtMemcpyAsync's alignment)."""
        return align_up(self._status_bytes, 64)

    def _launches(self, plan: TransferPlan, windows: Sequence[ChunkBatch], staged: bool,
                  flight: _Flight) -> tuple[np.ndarray, list[np.ndarray]]:
        """The LaunchDesc records of a transfer's windows and the arrays they point into (kept alive by the caller
        until the native submit has copied them)."""
        staging = self._staging.address if staged and self._staging is not None else 0
        capacity = self._staging.nbytes if staged and self._staging is not None else 0
        parts_per_window = []
        for window in windows:
            if staged:
                addresses = staging + np.arange(window.num_chunks, dtype=np.uint64) * np.uint64(plan.object_bytes)
            else:
                addresses = window.object_addresses()
            runs = window.runs if window.runs.size else np.zeros(1, dtype=window.runs.dtype)
            parts_per_window.append([window.group_table, runs, addresses])
        layouts = [packed_offsets(parts) for parts in parts_per_window]
        table_total = sum(size for _, size in layouts)
        tables_device, tables_host = flight.tables.ensure(self.runtime, table_total, "npu transfer tables")
        status_device, status_host = flight.status.ensure(self.runtime, len(windows) * self._status_stride,
                                                         "npu transfer status")
        launches = np.zeros(len(windows), dtype=self._launch_dtype)
        keep: list[np.ndarray] = []
        cursor = 0
        plane_table = self._plane_table(plan).address
        for w, (window, parts, (offsets, size)) in enumerate(zip(windows, parts_per_window, layouts)):
            pack_into(tables_host.array[cursor: cursor + size], parts, offsets)
            record = launches[w]
            record["table_host"], record["table_device"] = tables_host.address + cursor, tables_device.address + cursor
            record["table_bytes"] = size
            record["planes"] = plane_table
            for name, offset in zip(("groups", "runs", "objects"), offsets):
                record[name] = tables_device.address + cursor + offset
            record["status_device"] = status_device.address + w * self._status_stride
            record["status_host"] = status_host.address + w * self._status_stride
            record["status_bytes"] = self._status_bytes
            if staged:
                window_bytes = window.num_chunks * plan.object_bytes
                zero = self._ledger.claim(plan, window_bytes, capacity, window.direction)
                if zero is not None:
                    record["zero_device"], record["zero_bytes"] = staging + zero[0], zero[1] - zero[0]
                copies = self._copies(window, staging, plan.object_bytes)
                keep.append(copies)
                direction = "copies_in" if window.direction == Direction.LOAD else "copies_out"
                record[direction], record[f"num_{direction}"] = copies.ctypes.data, len(copies)
            record["total_items"] = window.total_items
            record["block_dim"] = self.cores
            record["num_planes"] = len(plan.plane_table)
            record["num_groups"] = len(window.group_table)
            record["num_runs"] = window.runs.size
            record["num_chunks"] = window.num_chunks
            record["direction"] = int(window.direction)
            record["tile_bytes"] = self.tiling["tile_bytes"]
            record["zero_tile_bytes"] = self.tiling["zero_tile_bytes"]
            cursor = align_up(cursor + size, 64)
        return launches, keep

    @staticmethod
    def _copies(window: ChunkBatch, staging: int, object_bytes: int) -> np.ndarray:
        """One copy per stretch contiguous in both staging and host memory (the arena's consecutive slots merge)."""
        if object_bytes == 0:
            return np.zeros(0, dtype=COPY_DTYPE)  # every group skipped: the objects hold nothing
        # a partial plan (a slice's planes) copies its planes' segments only: other planes' bytes stay untouched
        stretches = host_stretches(window.objects, object_pieces(window.plan, window.num_chunks), object_bytes)
        copies = np.zeros(len(stretches), dtype=COPY_DTYPE)
        for i, (chunk, offset, length) in enumerate(stretches):
            copies[i] = (staging + chunk * object_bytes + offset, window.objects[chunk].data_ptr() + offset, length)
        return copies
