"""The worker's `DeviceMover`: device pages <-> arena slots through the transfer backend, off the model's path.

`run` (on the model's thread) takes a batch of device moves (each a Store or Load with its block window, so nothing
is joined by command id), records where the model's stream is and queues the batch on a lane (a thread with its own
backend and, on NPU/CUDA, its own stream) that runs it as one kernel launch and reports every command.
`run_sliced` runs a load in S slices of `slices.py` (forward order), each followed by an event the model's stream can
wait on (`slice_progress.SlicedLoad`): all in one backend call where the backend offers `launch_sliced` (CUDA, with
slice 0's copies enqueued first by its `copy_ahead`, before the load is cut and planned), else one launch per slice.
`release_pages` is the page fence: the model's stream waits only for queued stores that read a page the step writes.
Why that keeps every page safe: docs/architecture.md §4, "Page lifetime".
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Optional, Sequence

import numpy as np
import torch

from ..layout.discovery import KVLayout
from .. import _host
from ..layout.slots import slot_geometry
from ..ops import ChunkBatch, CutRuns, Direction, PendingTransfer, TransferBackend, TransferStats
from ..ops.plan import TransferPlan
from ..platform.threads import pin_thread
from ..store.commands import DeviceMove
from ..store.routes.context import Report
from ..store.tier import Failure, TierCounters, TierResult
from .slice_progress import SlicedLoad
from .slices import SlicePlan, check_slice_order
from .streams import StreamKit
from ..store.metrics import Metric

logger = logging.getLogger(__name__)

# called once slice `index` is launched (on the thread that launched it), with its event (None on the host: landed)
SliceDone = Callable[[int, Optional[Any]], None]


def check_moves(moves: Sequence[object]) -> Direction:
    """The one direction of a batch of device moves; raises (naming the rule) before anything is queued for a batch
    that is empty, holds something else (a bare Store/Load has no device end), or mixes stores and loads."""
    if not moves:
        raise ValueError("a device batch needs at least one move")
    for move in moves:
        if not isinstance(move, DeviceMove):
            raise TypeError(f"KVMover moves DeviceMove objects (a Store/Load with its block window), got "
                            f"{type(move).__name__}: a command without its device end cannot be placed in pages")
    stores = {move.is_store for move in moves}  # type: ignore[union-attr]
    if len(stores) > 1:
        raise ValueError("a device batch is all stores or all loads (one kernel launch has one direction)")
    return Direction.STORE if stores.pop() else Direction.LOAD


@dataclass(eq=False)
class _Slicing:
    """A sliced load's progress (what the model's thread waits on) and the caller's per-slice callback."""

    progress: SlicedLoad
    on_slice_done: Optional[SliceDone]


@dataclass(eq=False)
class _Job:
    direction: Direction
    moves: list[DeviceMove]
    objects: list[torch.Tensor]
    report: Report
    ready: Optional[Any]  # the model stream's position the transfer waits for
    slicing: Optional[_Slicing] = None  # a load launched slice by slice (run_sliced)
    launched: Optional["_Launched"] = None  # enqueued by run_sliced on the caller's thread: the lane finishes it
    kernel_done: threading.Event = field(default_factory=threading.Event)  # set once pages_event exists (or None)
    pages_event: Optional[Any] = None  # completes when the kernel is done with the pages
    finished: threading.Event = field(default_factory=threading.Event)  # the lane is done: no page is read any more


@dataclass(eq=False)
class _Launched:
    """A sliced load run_sliced enqueued itself: the moves it carries and what finishes it (empty: nothing is left
    to finish, every command is reported)."""

    moves: Sequence[DeviceMove]
    pending: list[PendingTransfer]


class _Lane:
    """One direction's thread, queue, backend and stream kit."""

    def __init__(self, name: str, backend: TransferBackend, kit: StreamKit) -> None:
        self.name = name
        self.backend = backend
        self.kit = kit
        self.jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self.thread: Optional[threading.Thread] = None
        self.started = threading.Event()  # the thread tried to bind its stream (`has_stream` says whether it did)
        self.has_stream = False  # others may then enqueue on the lane's stream too
        # the slice plans whose tables the backend holds (the lane's thread), by identity and weakly
        self.prepared: "weakref.WeakSet[TransferPlan]" = weakref.WeakSet()


class KVMover:
    """One per worker; each direction's transfers run on its lane, in the order `run` was called."""

    def __init__(self, layout: KVLayout, make_backend: Callable[[], TransferBackend], make_kit: Callable[[], StreamKit],
                 rank: int, load_retries: int, counters: TierCounters, cpus: Optional[Sequence[int]] = None) -> None:
        self.layout = layout
        self.cpus = tuple(cpus or ())  # the lanes' threads pin themselves here (store key transfer_cpus); (): anywhere
        self.rank = rank
        self.load_retries = load_retries
        self.counters = counters
        self.kit = make_kit()  # the model thread's view: events on the model's stream
        # slice plans check_slice_order passed, by id and held weakly (an id a dead plan left is checked again)
        self._run_groups = _run_groups(layout)  # what the native cut of every batch takes, per plan group
        self._checked_slices: "weakref.WeakValueDictionary[int, SlicePlan]" = weakref.WeakValueDictionary()
        self._reading: list[_Job] = []  # store jobs the model's stream has not waited for, maybe still reading
        self.fence_waits = 0  # store batches the model's stream waited for (since start; stats get the deltas)
        self.fence_skips = 0  # in-flight store batches a fence let read on beside the step (counted per fence)
        self._lanes = {direction: _Lane(f"lmcache-npu-{direction.name.lower()}-r{rank}", make_backend(), make_kit())
                       for direction in (Direction.LOAD, Direction.STORE)}
        for lane in self._lanes.values():
            lane.backend.prepare(layout.plan)
            lane.prepared.add(layout.plan)
        for lane in self._lanes.values():
            lane.thread = threading.Thread(target=self._loop, args=(lane,), name=lane.name, daemon=True)
            lane.thread.start()

    @property
    def backends(self) -> dict[Direction, TransferBackend]:
        return {direction: lane.backend for direction, lane in self._lanes.items()}

    def set_backend(self, direction: Direction, backend: TransferBackend) -> None:
        """Replaces one lane's backend (tests put wrappers around it)."""
        self._lanes[direction].backend = backend

    # ---- the model's thread -----------------------------------------------------------------------------------

    def run(self, moves: Sequence[DeviceMove], objects: Sequence[torch.Tensor], report: Report) -> None:
        """DeviceMover: queue one batch (all stores or all loads) behind everything the model has enqueued so far."""
        direction = check_moves(moves)
        job = _Job(direction, list(moves), list(objects), report, self.kit.record())
        if direction == Direction.STORE:
            self._reading.append(job)
        self._lanes[direction].jobs.put(job)

    def run_sliced(self, moves: Sequence[DeviceMove], objects: Sequence[torch.Tensor], report: Report,
                   slices: SlicePlan, on_slice_done: Optional[SliceDone] = None) -> SlicedLoad:
        """A load launched in slices on the load lane's stream, in forward order, behind everything the model has
        enqueued so far, each slice a kernel launch over its plane subset with an event after it. A backend that
        enqueues every slice in one call (`launch_sliced`: CUDA) is called here, on the caller's thread, so slice 0
        waits for no thread hand-off (nor for the GIL while the model's thread runs on); the lane only finishes
        the load. Elsewhere the lane launches one slice at a time (the host backend copies on it while the model
        computes).
        Returns the handle `wait_for_layer_load` waits on. Every command is reported once, after the last slice (or
        when the load fails). Raises before anything is queued for stores, or for slices of another layout or out
        of the forward's order."""
        if check_moves(moves) != Direction.LOAD:
            raise ValueError("run_sliced moves loads only: a store has no layer to wait for")
        if len(objects) != len(moves):
            raise ValueError(f"run_sliced: {len(moves)} moves but {len(objects)} arena objects")
        if self._checked_slices.get(id(slices)) is not slices:  # a plan is checked once
            check_slice_order(slices, self.layout)
            self._checked_slices[id(slices)] = slices
        progress = SlicedLoad(slices, self.kit)
        job = _Job(Direction.LOAD, list(moves), list(objects), report, self.kit.record(),
                   _Slicing(progress, on_slice_done))
        lane = self._lanes[Direction.LOAD]
        if getattr(lane.backend, "launch_sliced", None) is not None and lane.started.wait(60) and lane.has_stream:
            self._launch_here(lane, job)
        lane.jobs.put(job)
        return progress

    def release_pages(self, stores: Optional[Collection[int]] = None) -> int:
        """Before the model may overwrite pages: the model's stream waits until each queued store batch holding a
        command in `stores` (every queued batch when None: the step's writes are unknown) is done reading its pages
        (on NPU/CUDA an event wait, the host does not block; on CPU the host waits for the store's end). Returns how
        many batches were waited for."""
        wanted = None if stores is None else frozenset(stores)
        waits = skips = 0
        reading: list[_Job] = []
        for job in self._reading:
            if job.finished.is_set():
                continue  # its backend returned after synchronizing: nothing of it reads a page
            if wanted is None or any(m.cmd_id in wanted for m in job.moves):
                job.kernel_done.wait()
                self.kit.wait(job.pages_event)
                waits += 1  # the stream keeps its order: later work of the model is behind this batch for good
            else:
                reading.append(job)
                skips += 1
        self._reading = reading
        self.fence_waits += waits
        self.fence_skips += skips
        if waits:
            self.counters.add(Metric.FENCE_WAITS, waits)
        if skips:
            self.counters.add(Metric.FENCE_SKIPS, skips)
        return waits

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.jobs.put(None)
        for lane in self._lanes.values():
            if lane.thread is not None:
                lane.thread.join()

    # ---- the transfer thread ----------------------------------------------------------------------------------

    def _loop(self, lane: _Lane) -> None:
        if self.cpus:
            pin_thread(self.cpus)
        try:
            lane.kit.bind_thread()
            lane.has_stream = True
        except Exception as exc:  # no stream on this thread: every batch fails (and is recomputed), none hangs
            lane.started.set()
            logger.exception("rank %d: the %s thread has no device stream", self.rank, lane.name)
            failure = TierResult.fail(Failure.DEVICE, f"the {lane.name} thread could not bind its device: {exc}")
            while (job := lane.jobs.get()) is not None:
                self._fail(job, job.moves, failure.reason)
                job.kernel_done.set()
                job.finished.set()
            return
        lane.started.set()
        with lane.kit.side_stream():
            while (job := lane.jobs.get()) is not None:
                try:
                    self._execute(lane, job)
                except Exception as exc:  # a bug here must fail the batch, never stop the thread or hang the index
                    logger.exception("rank %d: transfer thread error", self.rank)
                    self._fail(job, job.moves, str(exc))
                finally:
                    job.kernel_done.set()  # a batch that never launched touched no page
                    job.finished.set()
                    job.objects = []  # slot views must not outlive the batch: an unmapped epoch's pages go with them

    @staticmethod
    def _after_kernel(lane: _Lane, job: _Job, event: Optional[Any]) -> None:
        """The backend's kernel is done with the pages once `event` completes (None: at the lane stream's present
        position)."""
        job.pages_event = event if event is not None else lane.kit.record()
        job.kernel_done.set()

    def _launch_here(self, lane: _Lane, job: _Job) -> None:
        """Plans and enqueues a sliced load on the caller's thread, on the lane's stream (the backend serializes
        its launches), slice 0's copies first where the backend copies ahead; the job then carries what the lane
        finishes. A failure is reported, never raised."""
        ahead = None
        try:
            with lane.kit.side_stream():
                ahead = self._copy_ahead(lane, job)
                planned = self._checked_batch(lane, job)
                if planned is None:
                    job.launched = _Launched([], [])
                    return
                moves, batch = planned
                pending = self._launch_sliced(lane, job, job.slicing, batch, moves,  # type: ignore[arg-type]
                                              ahead)
            job.launched = _Launched(moves if pending is not None else [], pending or [])
        except Exception as exc:  # a bug here must fail the load (it is recomputed), never the model's step
            logger.exception("rank %d: sliced load launch error", self.rank)
            self._fail(job, job.moves, str(exc))
            job.launched = _Launched([], [])
            job.kernel_done.set()
        finally:
            if ahead is not None:
                ahead.release()  # the record goes back to the backend unless the launch took it

    def _copy_ahead(self, lane: _Lane, job: _Job) -> Optional[Any]:
        """Slice 0's copies enqueued before the load is cut and planned, where the backend offers it (CUDA:
        `copy_ahead`), so the bytes move while the host plans; None where it does not or could not (the launch
        then copies slice 0 itself)."""
        copy_ahead = getattr(lane.backend, "copy_ahead", None)
        if copy_ahead is None:
            return None
        try:
            return copy_ahead(self.layout.plan, job.slicing.progress.slices.plane_slices,  # type: ignore[union-attr]
                              job.objects)
        except Exception:  # the launch copies slice 0 itself: nothing is lost but the head start
            logger.warning("rank %d: slice 0's copies could not be enqueued ahead", self.rank, exc_info=True)
            return None

    def _execute(self, lane: _Lane, job: _Job) -> None:
        if job.launched is not None:
            if job.launched.pending:
                self._finish_sliced(job, job.launched.moves, job.launched.pending)
            return
        planned = self._checked_batch(lane, job)
        if planned is None:
            return
        moves, batch = planned
        if job.slicing is None:
            stats = self._transfer(lane, job, batch, moves)
            if stats is not None:
                self._finished(job, moves, [stats])
            return
        pending = self._launch_sliced(lane, job, job.slicing, batch, moves)
        if pending is not None:
            self._finish_sliced(job, moves, pending)

    def _checked_batch(self, lane: _Lane, job: _Job) -> Optional[tuple[list[DeviceMove], ChunkBatch]]:
        """The job's moves that keep their rows and their checked batch, with the current stream behind the
        model's position; None once nothing is left to move (every refusal reported)."""
        moves, objects, cuts = self._cut_runs(job)
        if not moves:
            if job.slicing is not None:
                job.slicing.progress.failed("every move of the load was refused")
            return None
        lane.kit.wait(job.ready)
        try:  # the whole plan's batch: a sliced load's rows are checked once, before any kernel runs
            batch = ChunkBatch.from_cut_runs(self.layout.plan, cuts, objects, job.direction)
        except ValueError as exc:  # validation refused it before any kernel ran: nothing was touched
            logger.error("rank %d: %s of %d chunks refused: %s", self.rank, job.direction.name.lower(),
                         len(moves), exc)
            self._fail(job, moves, str(exc))
            return None
        return moves, batch

    def _launch_sliced(self, lane: _Lane, job: _Job, sliced: _Slicing, batch: ChunkBatch,
                       moves: Sequence[DeviceMove], ahead: Optional[Any] = None) -> Optional[list[PendingTransfer]]:
        """Launches the slices back to back, marking each once enqueued: in one backend call where the backend
        offers `launch_sliced` (CUDA; `ahead`: what its `copy_ahead` enqueued), else one launch per slice. None once
        a launch failed (reported, every waiter released; what did launch is finished)."""
        at_once = getattr(lane.backend, "launch_sliced", None)
        pending: list[PendingTransfer] = []
        try:
            if at_once is not None:
                launched = self._launch_slices_at_once(lane, job, sliced, batch, moves, at_once, pending, ahead)
            else:
                launched = self._launch_each_slice(lane, job, sliced, batch, moves, pending)
        except BaseException:  # e.g. a slice callback that raised: what launched still gives its buffers back
            self._finish_quietly(pending)
            raise
        if launched:
            return pending
        self._finish_quietly(pending)
        return None

    def _finish_sliced(self, job: _Job, moves: Sequence[DeviceMove], pending: list[PendingTransfer]) -> None:
        """Waits for every launched slice once and reports the job."""
        try:
            stats = [transfer.finish() for transfer in pending]
        except Exception as exc:  # a kernel that moved less than its batch: found once the slices had launched
            self.counters.add(Metric.TRANSFER_FAILURES)
            logger.exception("rank %d: sliced load of %d chunks failed", self.rank, len(moves))
            self._fail(job, moves, str(exc))
            self._finish_quietly(pending)
            return
        self._finished(job, moves, stats)

    @staticmethod
    def _finish_quietly(pending: Sequence[PendingTransfer]) -> None:
        """Nothing launched may still use the backend's buffers once the job ends (failures are reported)."""
        for transfer in pending:
            try:
                transfer.finish()
            except Exception:  # already reported
                pass

    @staticmethod
    def _landed(sliced: _Slicing, index: int, event: Optional[Any]) -> None:
        sliced.progress.landed(index, event)
        if sliced.on_slice_done is not None:
            sliced.on_slice_done(index, event)

    def _launch_each_slice(self, lane: _Lane, job: _Job, sliced: _Slicing, batch: ChunkBatch,
                           moves: Sequence[DeviceMove], pending: list[PendingTransfer]) -> bool:
        """One launch per slice, each marked by an event after it on the lane's stream; False once one failed."""
        for index, piece in enumerate(sliced.progress.slices.slices):
            if piece.planes:
                self._prepare(lane, piece.plan)
                launched = self._launch(lane, job, batch.for_plan(piece.plan), moves)
                if launched is None:
                    return False
                pending.append(launched)
            self._landed(sliced, index, lane.kit.record())  # after this slice's work (None on the host)
        return True

    def _launch_slices_at_once(self, lane: _Lane, job: _Job, sliced: _Slicing, batch: ChunkBatch,
                               moves: Sequence[DeviceMove], at_once: Callable[..., Any],
                               pending: list[PendingTransfer], ahead: Optional[Any]) -> bool:
        """Every slice enqueued in one backend call (no host step between slices), then each marked with its own
        event; False once the call failed."""
        slices = sliced.progress.slices
        self._prepare(lane, batch.plan)
        extra = {} if ahead is None else {"ahead": ahead}
        launched = self._attempt(job, moves, lambda after: at_once(batch, slices.plane_slices, len(slices),
                                                                   after_kernel=after, **extra), lane)
        if launched is None:
            return False
        pending.append(launched.pending)
        for index, event in enumerate(launched.events):
            self._landed(sliced, index, event)
        return True

    @staticmethod
    def _prepare(lane: _Lane, plan: TransferPlan) -> None:
        """A slice's plane subset readies its tables once per plan object on this lane (held weakly by identity: a
        new plan is prepared even where it reuses a dead one's id)."""
        if plan not in lane.prepared:
            lane.backend.prepare(plan)
            lane.prepared.add(plan)

    def _finished(self, job: _Job, moves: Sequence[DeviceMove], stats: Sequence[TransferStats]) -> None:
        loads = job.direction == Direction.LOAD
        chunks, moved, seconds = ((Metric.LOADED_CHUNKS, Metric.LOADED_BYTES, Metric.LOAD_SECONDS) if loads else
                                  (Metric.STORED_CHUNKS, Metric.STORED_BYTES, Metric.STORE_SECONDS))
        spent = sum(s.device_seconds or s.seconds for s in stats)
        self.counters.add(chunks, len(moves))
        self.counters.add(moved, int(sum(s.payload_bytes for s in stats)))
        self.counters.add(seconds, spent)
        self._report_all(job, moves, TierResult(True, seconds=spent))  # the cost model learns the move alone

    def _transfer(self, lane: _Lane, job: _Job, batch: ChunkBatch,
                  moves: Sequence[DeviceMove]) -> Optional[TransferStats]:
        """One launch run to its end, retried for loads (every row is rewritten); None once it failed for good."""
        pending = self._launch(lane, job, batch, moves, run=True)
        return None if pending is None else pending.finish()

    def _launch(self, lane: _Lane, job: _Job, batch: ChunkBatch, moves: Sequence[DeviceMove],
                run: bool = False) -> Optional[PendingTransfer]:
        """One launch (`run`: run to its end), retried for loads while nothing of it is marked (every row is
        rewritten); None once it failed for good (then reported)."""
        launch = None if run else getattr(lane.backend, "launch", None)  # a wrapper may offer transfer only
        if launch is None:
            return self._attempt(job, moves, lambda after: PendingTransfer.done(
                lane.backend.transfer(batch, after_kernel=after)), lane)
        return self._attempt(job, moves, lambda after: launch(batch, after_kernel=after), lane)

    def _attempt(self, job: _Job, moves: Sequence[DeviceMove], start: Callable[[Any], Any], lane: _Lane) -> Any:
        """`start(after_kernel)` (None for loads), retried for loads while nothing of it is marked (every row is
        rewritten); None once it failed for good (then reported)."""
        loads = job.direction == Direction.LOAD
        attempts = 1 + (self.load_retries if loads else 0)
        # only stores are fenced (release_pages): a load's pages belong to its request alone, so no event is made
        after = None if loads else (lambda event: self._after_kernel(lane, job, event))
        for attempt in range(attempts):
            try:
                return start(after)
            except Exception as exc:  # a device fault: retried for loads, else reported
                self.counters.add(Metric.TRANSFER_FAILURES)
                logger.exception("rank %d: %s of %d chunks failed (attempt %d of %d)", self.rank,
                                 job.direction.name.lower(), len(moves), attempt + 1, attempts)
                if attempt + 1 == attempts:
                    self._fail(job, moves, str(exc))
                    return None
                self.counters.add(Metric.LOAD_RETRIES)
        return None

    def _fail(self, job: _Job, moves: Sequence[DeviceMove], reason: str) -> None:
        """Every one of `moves` failed; a sliced load's waiters are released and told why."""
        if job.slicing is not None:
            job.slicing.progress.failed(reason)
        self._report_all(job, moves, TierResult.fail(Failure.DEVICE, reason))

    def _report_all(self, job: _Job, moves: Sequence[DeviceMove], result: TierResult) -> None:
        for move in moves:
            job.report(move.cmd_id, result)

    def _cut_runs(self, job: _Job) -> tuple[list[DeviceMove], list[torch.Tensor], list[Optional[CutRuns]]]:
        """The moves that keep their rows, their objects, and per plan group their slots cut into checked runs, in
        one native call over every block window (csrc/host/move_runs.h: on a sliced load's path to slice 0); a
        store that would write zeros for rows the model needs is refused and reported."""
        moves = job.moves
        windows, begin = [], 0
        while begin < len(moves):  # moves of one block window (a request's) are consecutive
            window, end = moves[begin].window, begin + 1
            while end < len(moves) and moves[end].window is window:
                end += 1
            windows.append((end, 0, window.block_ids, window.first_block))
            begin = end
        store = job.direction == Direction.STORE
        refused, per_group = _host.move_runs(
            self._run_groups, windows, [m.chunk_index for m in moves], [m.first_token for m in moves],
            [m.end_token for m in moves], [store] * len(moves), [m.without_end_state for m in moves], store,
            not store)
        cuts = [None if cut is None else CutRuns(*cut) for cut in per_group]
        if not refused.any():
            return list(moves), list(job.objects), cuts
        for i in np.flatnonzero(refused).tolist():
            job.report(moves[i].cmd_id, TierResult.fail(Failure.DEVICE, "the chunk's rows are not all in live blocks"))
        kept = (~refused).tolist()
        return ([m for m, k in zip(moves, kept) if k], [o for o, k in zip(job.objects, kept) if k], cuts)


def _run_groups(layout: KVLayout) -> list[Optional[tuple[Any, ...]]]:
    """Per plan group what `_host.move_runs` takes: None for a skipped group, else its slot geometry, block table,
    whether the plan moves it, and its pages' rows per block and rows."""
    plan = layout.plan
    out: list[Optional[tuple[Any, ...]]] = []
    for g in layout.groups:
        if g.skipped:
            out.append(None)
            continue
        moved = g.index in plan.moved_group_set
        rows_per_block = plan.group_rows_per_block[g.index] if moved else 0
        limit = plan.group_num_blocks[g.index] * rows_per_block if moved else 0
        out.append((*slot_geometry(g, plan.chunk_tokens), g.scheduler_group, moved, rows_per_block, limit))
    return out
