"""The worker's `DeviceMover`: device pages <-> arena slots through the transfer backend, off the model's path.

`run` (on the model's thread) records where the model's stream is and queues the batch on a lane (a thread with its
own backend and, on NPU/CUDA, its own stream) that runs it as one kernel launch and reports every command.
`release_pages` is the page fence: the model's stream waits only for queued stores that read a page the step writes.
Why that keeps every page safe: docs/architecture.md §4, "Page lifetime".
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Optional, Sequence, Union

import numpy as np
import torch

from ..layout.discovery import KVLayout
from ..layout.slots import chunk_slots, row_tokens
from ..ops import SKIP_SLOT, ChunkBatch, Direction, TransferBackend
from ..store.commands import Load, Store
from ..store.routes.context import Report
from ..store.tier import Failure, TierCounters, TierResult
from .plans import LoadPlan, StorePlan
from .streams import StreamKit
from ..store.metrics import Metric

logger = logging.getLogger(__name__)

Plan = Union[LoadPlan, StorePlan]


@dataclass(eq=False)
class _Job:
    direction: Direction
    commands: list[Union[Store, Load]]
    objects: list[torch.Tensor]
    plans: list[Optional[Plan]]  # each command's request window, taken on the model's thread
    report: Report
    ready: Optional[Any]  # the model stream's position the transfer waits for
    kernel_done: threading.Event = field(default_factory=threading.Event)  # set once pages_event exists (or None)
    pages_event: Optional[Any] = None  # completes when the kernel is done with the pages
    finished: threading.Event = field(default_factory=threading.Event)  # the lane is done: no page is read any more


class _Lane:
    """One direction's thread, queue, backend and stream kit."""

    def __init__(self, name: str, backend: TransferBackend, kit: StreamKit) -> None:
        self.name = name
        self.backend = backend
        self.kit = kit
        self.jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self.thread: Optional[threading.Thread] = None


class KVMover:
    """One per worker; each direction's transfers run on its lane, in the order `run` was called."""

    def __init__(self, layout: KVLayout, make_backend: Callable[[], TransferBackend], make_kit: Callable[[], StreamKit],
                 rank: int, load_retries: int, counters: TierCounters) -> None:
        self.layout = layout
        self.rank = rank
        self.load_retries = load_retries
        self.counters = counters
        self.kit = make_kit()  # the model thread's view: events on the model's stream
        self._plans: dict[int, Plan] = {}  # this step's plans by command id; only the model's thread touches it
        self._reading: list[_Job] = []  # store jobs the model's stream has not waited for, maybe still reading
        self.fence_waits = 0  # store batches the model's stream waited for (since start; stats get the deltas)
        self.fence_skips = 0  # in-flight store batches a fence let read on beside the step (counted per fence)
        self._lanes = {direction: _Lane(f"lmcache-npu-{direction.name.lower()}-r{rank}", make_backend(), make_kit())
                       for direction in (Direction.LOAD, Direction.STORE)}
        for lane in self._lanes.values():
            lane.backend.prepare(layout.plan)
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

    def expect(self, plans: Sequence[Plan]) -> None:
        """The requests behind this step's Load/Store commands: their block windows and which rows to leave alone.
        Replaces the previous step's plans: a command the executor never passed on (a refused slot) leaves nothing."""
        self._plans = {cmd_id: plan for plan in plans for cmd_id in plan.cmd_ids}

    def run(self, commands: Sequence[Union[Store, Load]], objects: Sequence[torch.Tensor], report: Report) -> None:
        """DeviceMover: queue one batch (all Stores or all Loads) behind everything the model has enqueued so far."""
        direction = Direction.STORE if isinstance(commands[0], Store) else Direction.LOAD
        plans = [self._plans.pop(c.cmd_id, None) for c in commands]
        job = _Job(direction, list(commands), list(objects), plans, report, self.kit.record())
        if direction == Direction.STORE:
            self._reading.append(job)
        self._lanes[direction].jobs.put(job)

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
            if wanted is None or any(c.cmd_id in wanted for c in job.commands):
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
        try:
            lane.kit.bind_thread()
        except Exception as exc:  # no stream on this thread: every batch fails (and is recomputed), none hangs
            logger.exception("rank %d: the %s thread has no device stream", self.rank, lane.name)
            failure = TierResult.fail(Failure.DEVICE, f"the {lane.name} thread could not bind its device: {exc}")
            while (job := lane.jobs.get()) is not None:
                self._report_all(job, job.commands, failure)
                job.kernel_done.set()
                job.finished.set()
            return
        with lane.kit.side_stream():
            while (job := lane.jobs.get()) is not None:
                try:
                    self._execute(lane, job)
                except Exception as exc:  # a bug here must fail the batch, never stop the thread or hang the index
                    logger.exception("rank %d: transfer thread error", self.rank)
                    self._report_all(job, job.commands, TierResult.fail(Failure.DEVICE, str(exc)))
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

    def _execute(self, lane: _Lane, job: _Job) -> None:
        commands, objects, slots = self._slots(job)
        if not commands:
            return
        lane.kit.wait(job.ready)
        loads = job.direction == Direction.LOAD
        try:
            batch = ChunkBatch.build(self.layout.plan, slots, objects, job.direction)
        except ValueError as exc:  # validation refused it before any kernel ran: nothing was touched
            logger.error("rank %d: %s of %d chunks refused: %s", self.rank, job.direction.name.lower(),
                         len(commands), exc)
            self._report_all(job, commands, TierResult.fail(Failure.DEVICE, str(exc)))
            return
        attempts = 1 + (self.load_retries if loads else 0)
        for attempt in range(attempts):
            try:
                stats = lane.backend.transfer(batch, after_kernel=lambda event: self._after_kernel(lane, job, event))
                break
            except Exception as exc:  # a device fault: retried for loads (every row is rewritten), else reported
                self.counters.add(Metric.TRANSFER_FAILURES)
                logger.exception("rank %d: %s of %d chunks failed (attempt %d of %d)", self.rank,
                                 job.direction.name.lower(), len(commands), attempt + 1, attempts)
                if attempt + 1 == attempts:
                    self._report_all(job, commands, TierResult.fail(Failure.DEVICE, str(exc)))
                    return
                self.counters.add(Metric.LOAD_RETRIES)
        chunks, moved, seconds = ((Metric.LOADED_CHUNKS, Metric.LOADED_BYTES, Metric.LOAD_SECONDS) if loads else
                                  (Metric.STORED_CHUNKS, Metric.STORED_BYTES, Metric.STORE_SECONDS))
        self.counters.add(chunks, len(commands))
        self.counters.add(moved, stats.payload_bytes)
        moved_s = stats.device_seconds or stats.seconds
        self.counters.add(seconds, moved_s)
        self._report_all(job, commands, TierResult(True, seconds=moved_s))  # the cost model learns the move alone

    def _report_all(self, job: _Job, commands: Sequence[Union[Store, Load]], result: TierResult) -> None:
        for command in commands:
            job.report(command.cmd_id, result)

    def _slots(self, job: _Job) -> tuple[list, list, list[Optional[np.ndarray]]]:
        """Slot matrices of the batch (one per plan group, chunks in command order) and the commands they cover;
        a command without its plan, or a store that would write zeros for rows the model needs, is refused."""
        layout, chunk = self.layout, self.layout.plan.chunk_tokens
        rows: list[list[np.ndarray]] = [[] for _ in layout.groups]
        keep_commands, keep_objects = [], []
        for command, obj, plan in zip(job.commands, job.objects, job.plans):
            if plan is None:
                job.report(command.cmd_id, TierResult.fail(Failure.DEVICE, "no block window for this command"))
                continue
            per_group = self._command_slots(command, plan, chunk)
            if per_group is None:
                job.report(command.cmd_id,
                           TierResult.fail(Failure.DEVICE, "the chunk's rows are not all in live blocks"))
                continue
            for g, matrix in enumerate(per_group):
                rows[g].append(matrix)
            keep_commands.append(command)
            keep_objects.append(obj)
        slots = [None if g.skipped or not keep_commands else np.concatenate(rows[g.index]) for g in layout.groups]
        return keep_commands, keep_objects, slots

    def _command_slots(self, command: Union[Store, Load], plan: Plan, chunk: int) -> Optional[list[np.ndarray]]:
        """(1, rows_per_chunk) slots per plan group for one chunk, with the rows this transfer leaves alone at -1."""
        index = np.array([command.chunk_index])
        out = []
        for g in self.layout.groups:
            if g.skipped:
                out.append(np.zeros((1, 0), dtype=np.int64))
                continue
            sg = g.scheduler_group
            matrix = chunk_slots(g, chunk, plan.window.block_ids[sg], index, first_block=plan.window.first_block[sg])
            if isinstance(plan, LoadPlan):
                tokens = row_tokens(g, chunk, index)
                matrix[tokens < plan.first_token] = SKIP_SLOT  # vLLM's own cached rows
                if g.recurrent and (command.chunk_index + 1) * chunk != plan.end_token:
                    matrix[:] = SKIP_SLOT  # only the hit's last state is read back
                elif not g.recurrent:
                    matrix[tokens >= plan.end_token] = SKIP_SLOT  # a hit ending inside a chunk (a P/D hand-off)
            elif g.recurrent and command.cmd_id in plan.without_end_state:
                matrix[:] = SKIP_SLOT
            else:
                past = (row_tokens(g, chunk, index) >= plan.tail_end) if plan.tail_end else None
                if (matrix[~past] if past is not None else matrix).min(initial=0) < 0:
                    return None
                if past is not None:  # a prompt's partial last chunk: rows past the prompt are not the request's yet
                    matrix[past] = SKIP_SLOT
            out.append(matrix)
        return out
