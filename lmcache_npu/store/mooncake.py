"""Mooncake tier (DESIGN §7, L3): chunk shards in a Mooncake distributed store, shared by every instance.

Workers `put` / `get_into` between arena slots and the store (through a bounce buffer, or zero-copy on a trusted
network); the scheduler's client answers `exists`. Nothing here raises in the serving path: every client call runs on
the tier's threads with a deadline behind a circuit breaker, and a get is verified in the arena slot, never in memory
a peer can write. The client's behaviour, faults and trust: docs/storage.md §5.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .config import PROTOCOLS, MooncakeConfig
from .tier import OK, Failure, TierCounters, TierResult
from .metrics import Metric

__all__ = ["PROTOCOLS", "MooncakeConfig", "MooncakeTier", "Check"]

logger = logging.getLogger(__name__)

_MISSING = -704
_BUFFER_TOO_SMALL = -600
_PROBE_KEY = "lmcache-npu-probe"
_EXISTS = 1

Check = Callable[[memoryview], Optional[str]]  # None: these bytes may be used; else why not


def _master_accepts(master: str, timeout: float) -> bool:
    """A TCP connection to the master's RPC port succeeds within `timeout`."""
    host, port = master.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _default_store_factory() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise RuntimeError("the Mooncake tier needs the Mooncake client: pip install mooncake-transfer-engine-non-cuda"
                           " (CPU/TCP), mooncake-transfer-engine (CUDA) or mooncake-transfer-engine-npu (Ascend); "
                           f"import failed: {exc}") from exc
    return MooncakeDistributedStore()


def _close_late_client(future: Any) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    try:
        future.result().close()
    except Exception as exc:  # best effort: the cluster also expires a silent client's lease
        logger.warning("Mooncake tier: closing a late client failed: %r", exc)


def _address_of(buffer: memoryview) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


class MooncakeTier:
    """One Mooncake client. Worker side: `register` the arena, then `put` / `get_into`; scheduler side: `exists`."""

    def __init__(self, config: MooncakeConfig, store_factory: Optional[Callable[[], Any]] = None,
                 io_threads: int = 4, exists_only: bool = False) -> None:
        """`exists_only`: a client for existence checks (the scheduler's), which moves no chunk bytes, so it keeps no
        bounce buffer and registers nothing."""
        self.config = config
        self.exists_only = exists_only
        self.counters = TierCounters()
        self._factory = store_factory or _default_store_factory
        # the real client's setup blocks the process while it retries a dead master: probe its port first
        self._probe_master = store_factory is None
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="lmcache-mooncake")
        # setup and probes get their own thread: they must not queue behind calls stuck on a dead master
        self._control = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-mooncake-control")
        self._lock = threading.Lock()
        self._store: Any = None
        self._down_until = 0.0
        self._probing = False
        self._closed = False
        self._wanted: list[tuple[int, int]] = []  # memory the caller asked to register
        self._bounce: Optional[np.ndarray] = None
        self._bounce_lock = threading.Lock()  # one batch at a time owns the bounce buffer
        if not config.zero_copy and not exists_only:  # only this buffer is registered: peers cannot reach the arena
            raw = np.zeros(config.bounce_bytes + 4096, dtype=np.uint8)
            skip = -raw.ctypes.data % 4096
            self._bounce = raw[skip:skip + config.bounce_bytes]
            self._wanted.append((int(self._bounce.ctypes.data), config.bounce_bytes))
        self._registered: list[tuple[int, int]] = []  # what the current client registered successfully
        self._connect()  # a missing client package raises here, at startup; a dead master only opens the circuit

    # ---- connection and circuit breaker -------------------------------------------------------------------------

    def _connect(self) -> bool:
        """setup() with a deadline; False leaves the tier unhealthy until the next retry."""
        def setup() -> Any:
            store = self._factory()  # a missing client package raises here, whatever the master's state
            # the client's own setup retries for ~90 s against a dead master, holding the GIL: the whole process
            # would stall; a master that refuses a TCP connection is down, and the circuit opens at once instead
            if self._probe_master and not _master_accepts(self.config.master, min(1.0, self.config.timeout_s)):
                raise ConnectionError("the master does not accept connections")
            code = store.setup(self.config.resolved_hostname(), self.config.metadata,
                               self.config.global_segment_bytes, self.config.local_buffer_bytes,
                               self.config.protocol, self.config.device_name, self.config.master)
            if code != 0:
                raise ConnectionError(f"setup returned {code}")
            return store

        future = self._control.submit(setup)
        try:
            store = future.result(self.config.timeout_s * 2)
        except RuntimeError as exc:
            if "pip install" in str(exc):
                raise
            return self._open_circuit(f"cannot join the Mooncake cluster at {self.config.master}: {exc}")
        except FutureTimeout:
            self.counters.add(Metric.TIMEOUTS)
            future.add_done_callback(_close_late_client)  # a setup that finishes after we gave up must not linger
            return self._open_circuit(f"joining the Mooncake cluster at {self.config.master} timed out")
        except Exception as exc:  # any client failure at setup: unhealthy, retried later
            return self._open_circuit(f"cannot join the Mooncake cluster at {self.config.master}: {exc}")
        with self._lock:
            self._store = store
            self._registered = []
        for address, size in self._wanted:
            self._register_now(address, size)
        logger.info("Mooncake tier: joined %s (%s, segment %d B)", self.config.master, self.config.protocol,
                    self.config.global_segment_bytes)
        return True

    def _open_circuit(self, why: str) -> bool:
        with self._lock:
            already = self._down_until > time.monotonic()
            self._down_until = time.monotonic() + self.config.retry_after_s
        if not already:
            logger.error("Mooncake tier unavailable for %.0f s: %s", self.config.retry_after_s, why)
        self.counters.add(Metric.UNAVAILABLE)
        return False

    def _available(self) -> bool:
        """False while the circuit is open; past the retry time exactly one caller probes (or reconnects)."""
        with self._lock:
            if self._closed:
                return False
            if time.monotonic() < self._down_until or self._probing:
                self.counters.add(Metric.UNHEALTHY_SKIPS)
                return False
            if self._down_until == 0.0:
                return True
            self._probing = True
        try:
            if self._store is None:
                healthy = self._connect()
            else:
                healthy = self._call("probe", lambda s: s.batch_is_exist([_PROBE_KEY]), probing=True,
                                     pool=self._control) is not None
            if healthy:
                with self._lock:
                    self._down_until = 0.0
                logger.warning("Mooncake tier at %s is reachable again", self.config.master)
            return healthy
        finally:
            with self._lock:
                self._probing = False

    def _call(self, what: str, work: Callable[[Any], Any], probing: bool = False, touches_memory: bool = False,
              pool: Optional[ThreadPoolExecutor] = None) -> Any:
        """Runs `work(store)` with the deadline; None (after opening the circuit) on timeout, error or RPC
        failure. An RPC failure shows as a result list of codes <= -900.

        A call that reads or writes caller memory (`touches_memory`: puts and gets on arena slots) is never
        abandoned while it runs: past the deadline the circuit opens (others stop waiting on the client), but this
        caller waits for the call to end, so the slot is not handed back while the client may still touch it."""
        if not probing and not self._available():
            return None
        store = self._store
        if store is None:
            return None
        future = (pool or self._pool).submit(work, store)
        try:
            result = future.result(self.config.timeout_s)
        except FutureTimeout:
            self.counters.add(Metric.TIMEOUTS)
            self._open_circuit(f"{what} took longer than {self.config.timeout_s} s")
            if future.cancel() or not touches_memory:
                return None
            logger.warning("Mooncake tier: waiting for a late %s before its slots are released", what)
            try:
                future.result()
            except Exception:  # its outcome no longer matters: the command fails either way
                pass
            self.counters.add(Metric.LATE_CALLS)
            return None
        except Exception as exc:  # the client raised: a miss and a counter, never an exception for the caller
            self.counters.add(Metric.ERRORS)
            self._open_circuit(f"{what} raised {exc!r}")
            return None
        if isinstance(result, list) and any(isinstance(c, int) and c <= -900 for c in result):
            self.counters.add(Metric.ERRORS)
            self._open_circuit(f"{what}: the master did not answer (codes {sorted(set(result))[:4]})")
            return None
        return result

    def healthy(self) -> bool:
        with self._lock:
            return not self._closed and self._store is not None and self._down_until == 0.0

    # ---- registration ---------------------------------------------------------------------------------------------

    def register(self, address: int, size: int) -> bool:
        """Registers host memory (the arena) so puts and gets from it are zero-copy; False: copies will be used
        (always with `zero_copy` off: the tier moves bytes through its own registered bounce buffer instead)."""
        if self._bounce is not None:
            logger.info("Mooncake tier: zero_copy is off: %d B at 0x%x stay unregistered; transfers go through a "
                        "%d B bounce buffer", size, address, self._bounce.nbytes)
            return False
        self._wanted.append((address, size))
        return self._store is not None and self._register_now(address, size)

    def _register_now(self, address: int, size: int) -> bool:
        if not hasattr(self._store, "register_buffer") or not hasattr(self._store, "batch_put_from"):
            return False
        try:
            code = self._pool.submit(self._store.register_buffer, address, size).result(self.config.timeout_s)
        except Exception as exc:  # registration is an optimisation: fall back to copies
            logger.warning("Mooncake tier: registering %d B at 0x%x failed (%s); using copies", size, address, exc)
            return False
        if code != 0:
            logger.warning("Mooncake tier: register_buffer returned %s; using copies", code)
            return False
        with self._lock:
            self._registered.append((address, size))
        return True

    def registered(self) -> list[tuple[int, int]]:
        """(address, bytes) of every range the current client registered with the transfer engine."""
        with self._lock:
            return list(self._registered)

    def _bounce_ready(self) -> bool:
        return self._bounce is not None and self._store is not None and bool(self._registered)

    def _bounce_groups(self, buffers: Sequence[memoryview]) -> list[list[tuple[int, int]]]:
        """(index, offset in the bounce buffer) in runs whose sizes fit the bounce buffer together; a buffer larger
        than it is a run alone (offset 0)."""
        assert self._bounce is not None
        groups: list[list[tuple[int, int]]] = []
        used = self._bounce.nbytes
        for i, buffer in enumerate(buffers):
            if used + buffer.nbytes > self._bounce.nbytes or buffer.nbytes > self._bounce.nbytes:
                groups.append([])
                used = 0
            groups[-1].append((i, used))
            used += buffer.nbytes
        return groups

    def _zero_copy(self, buffers: Sequence[memoryview]) -> Optional[list[int]]:
        """The buffers' addresses when every one lies inside registered memory."""
        if not self._registered or not hasattr(self._store, "batch_get_into"):
            return None
        addresses = [_address_of(b) for b in buffers]
        for address, buffer in zip(addresses, buffers):
            if not any(start <= address and address + buffer.nbytes <= start + size
                       for start, size in self._registered):
                return None
        return addresses

    # ---- the tier ---------------------------------------------------------------------------------------------------

    def put(self, names: Sequence[str], buffers: Sequence[memoryview],
            verify: Optional[Sequence[Optional[Check]]] = None) -> list[TierResult]:
        """Stores each buffer under its name. `verify[i]` checks an object that already has the name (its envelope
        for this key and rank): valid counts as stored, anything else is replaced; without it only the length is
        compared."""
        if not names:
            return []
        checks = list(verify) if verify is not None else [None] * len(names)
        present = self._call("exists", lambda s: list(s.batch_is_exist(list(names))))
        if present is None:
            return [TierResult.fail(Failure.UNAVAILABLE)] * len(names)
        results: list[Optional[TierResult]] = [None] * len(names)
        existing = [i for i, code in enumerate(present) if code == _EXISTS]
        to_write = [i for i, code in enumerate(present) if code != _EXISTS]
        replacing = self._check_existing(names, buffers, checks, existing, results)
        if replacing:
            removed = self._call("remove", lambda s: list(s.batch_remove([names[i] for i in replacing], True)))
            for i, code in zip(replacing, removed or [None] * len(replacing)):
                if code in (0, _MISSING):
                    to_write.append(i)
                else:
                    logger.warning("Mooncake tier: %s exists with other contents and could not be removed (%s)",
                                   names[i], code)
                    results[i] = TierResult.fail(Failure.PUT, "name exists with other contents")
        written = self._write([names[i] for i in to_write], [buffers[i] for i in to_write])
        for i, result in zip(to_write, written):
            results[i] = result
            if result.ok and i in replacing:
                self.counters.add(Metric.PUT_REPLACED_INVALID)
        return [r if r is not None else TierResult.fail(Failure.UNAVAILABLE) for r in results]

    def _check_existing(self, names: Sequence[str], buffers: Sequence[memoryview], checks: Sequence[Optional[Check]],
                        existing: Sequence[int], results: list[Optional[TierResult]]) -> list[int]:
        """Fills `results` for existing names whose object is valid; returns those to remove and put again."""
        if not existing:
            return []

        def fetch(store: Any) -> list[Optional[str]]:
            problems: list[Optional[str]] = []
            for i in existing:
                data = store.get(names[i])
                if not data:
                    problems.append("gone")
                elif len(data) != buffers[i].nbytes:
                    problems.append("length")
                else:
                    check = checks[i]
                    problems.append(None if check is None else check(memoryview(data)))
            return problems

        problems = self._call("get", fetch)
        replacing = []
        for i, problem in zip(existing, problems or ["unavailable"] * len(existing)):
            if problem is None:
                results[i] = OK
                self.counters.add(Metric.PUT_EXISTING)
            elif problem == "unavailable":
                results[i] = TierResult.fail(Failure.UNAVAILABLE)
            else:
                if problem != "gone":
                    logger.warning("Mooncake tier: %s exists with an object that does not verify (%s); replacing "
                                   "it", names[i], problem)
                replacing.append(i)
        return replacing

    def _write(self, names: Sequence[str], buffers: Sequence[memoryview]) -> list[TierResult]:
        if not names:
            return []
        if self._bounce_ready():
            codes = self._bounce_put(names, buffers)
            self.counters.add(Metric.BOUNCE_OPS, len(names))
        else:
            addresses = self._zero_copy(buffers) if self._store is not None else None
            if addresses is not None:
                sizes = [b.nbytes for b in buffers]
                codes = self._call("put", lambda s: list(s.batch_put_from(list(names), addresses, sizes)),
                                   touches_memory=True)
                self.counters.add(Metric.ZERO_COPY_OPS, len(names))
            else:
                payloads = [bytes(b) for b in buffers]
                codes = self._call("put", lambda s: [s.put(n, p) for n, p in zip(names, payloads)])  # owns its copies
                self.counters.add(Metric.COPY_OPS, len(names))
        if codes is None:
            return [TierResult.fail(Failure.UNAVAILABLE)] * len(names)
        results = [OK if code == 0 else TierResult.fail(Failure.PUT_ERROR, str(code)) for code in codes]
        done = sum(r.ok for r in results)
        self.counters.add(Metric.PUTS, done)
        self.counters.add(Metric.PUT_BYTES, sum(b.nbytes for b, r in zip(buffers, results) if r.ok))
        self.counters.add(Metric.PUT_FAILURES, len(results) - done)
        return results

    def _bounce_put(self, names: Sequence[str], buffers: Sequence[memoryview]) -> Optional[list[int]]:
        assert self._bounce is not None
        codes: list[int] = []
        base = int(self._bounce.ctypes.data)
        for group in self._bounce_groups(buffers):
            first = group[0][0]
            with self._bounce_lock:
                if buffers[first].nbytes > self._bounce.nbytes:
                    payload = bytes(buffers[first])
                    got = self._call("put", lambda s: [s.put(names[first], payload)])
                else:
                    for i, offset in group:
                        self._bounce[offset:offset + buffers[i].nbytes] = np.frombuffer(buffers[i], dtype=np.uint8)
                    got = self._call("put", lambda s: list(s.batch_put_from(
                        [names[i] for i, _ in group], [base + o for _, o in group],
                        [buffers[i].nbytes for i, _ in group])), touches_memory=True)
            if got is None:
                return None
            codes.extend(got)
        return codes

    def get_into(self, names: Sequence[str], buffers: Sequence[memoryview],
                 verify: Optional[Sequence[Optional[Check]]] = None) -> list[TierResult]:
        """Reads each object into its buffer. `verify[i]` checks the bytes read (the buffer itself when zero-copy,
        the bounce buffer or a copy before a byte reaches the buffer otherwise); a failed check is a miss counted
        as "rejected"."""
        if not names:
            return []
        checks = list(verify) if verify is not None else [None] * len(names)
        rejected: dict[int, str] = {}
        if self._bounce_ready():
            codes = self._bounce_get(names, buffers, checks, rejected)
            self.counters.add(Metric.BOUNCE_OPS, len(names))
        else:
            addresses = self._zero_copy(buffers) if self._store is not None else None
            if addresses is not None:
                sizes = [b.nbytes for b in buffers]
                codes = self._call("get", lambda s: list(s.batch_get_into(list(names), addresses, sizes)),
                                   touches_memory=True)
                self.counters.add(Metric.ZERO_COPY_OPS, len(names))
                for i, (code, buffer, check) in enumerate(zip(codes or [], buffers, checks)):
                    if code == buffer.nbytes and check is not None and (why := check(buffer)) is not None:
                        rejected[i] = why
            else:
                codes = self._call("get", lambda s: [self._copy_get(s, i, n, b, checks[i], rejected)
                                                     for i, (n, b) in enumerate(zip(names, buffers))],
                                   touches_memory=True)
                self.counters.add(Metric.COPY_OPS, len(names))
        if codes is None:
            return [TierResult.fail(Failure.UNAVAILABLE)] * len(names)
        results = []
        for i, (code, buffer) in enumerate(zip(codes, buffers)):
            if i in rejected:
                results.append(TierResult.fail(Failure.REJECTED, rejected[i]))
                self.counters.add(Metric.REJECTED)  # the caller logs it: it knows which chunk it asked for
            elif code == buffer.nbytes:
                results.append(OK)
            elif code == _MISSING:
                results.append(TierResult.fail(Failure.MISS))
            elif code >= 0 or code == _BUFFER_TOO_SMALL:
                results.append(TierResult.fail(Failure.CORRUPT, "length"))
            else:
                results.append(TierResult.fail(Failure.GET_ERROR, str(code)))
        done = sum(r.ok for r in results)
        self.counters.add(Metric.GETS, done)
        self.counters.add(Metric.GET_BYTES, sum(b.nbytes for b, r in zip(buffers, results) if r.ok))
        self.counters.add(Metric.MISSES, sum(r.kind is Failure.MISS for r in results))
        return results

    def _bounce_get(self, names: Sequence[str], buffers: Sequence[memoryview], checks: Sequence[Optional[Check]],
                    rejected: dict[int, str]) -> Optional[list[int]]:
        """Gets through the bounce buffer: each object is checked there and copied into its buffer only if good."""
        assert self._bounce is not None
        codes: list[int] = []
        base = int(self._bounce.ctypes.data)
        for group in self._bounce_groups(buffers):
            with self._bounce_lock:
                first = group[0][0]
                if buffers[first].nbytes > self._bounce.nbytes:
                    got = self._call("get", lambda s: [self._copy_get(s, first, names[first], buffers[first],
                                                                      checks[first], rejected)], touches_memory=True)
                    if got is None:
                        return None
                    codes.extend(got)
                    continue
                got = self._call("get", lambda s: list(s.batch_get_into(
                    [names[i] for i, _ in group], [base + o for _, o in group],
                    [buffers[i].nbytes for i, _ in group])), touches_memory=True)
                if got is None:
                    return None
                for (i, offset), code in zip(group, got):
                    size = buffers[i].nbytes
                    if code == size:
                        # into the slot first, then check the slot: peers can rewrite the bounce buffer at any time,
                        # the slot never, so the bytes that verify are the bytes that stay
                        buffers[i][:] = memoryview(self._bounce[offset:offset + size])
                        why = checks[i](buffers[i]) if checks[i] is not None else None
                        if why is not None:
                            rejected[i] = why
                codes.extend(got)
        return codes

    @staticmethod
    def _copy_get(store: Any, index: int, name: str, buffer: memoryview, check: Optional[Check],
                  rejected: dict[int, str]) -> int:
        data = store.get(name)
        if not data:
            return _MISSING
        if len(data) != buffer.nbytes:
            return len(data)  # a wrong length never reaches the buffer
        buffer[:] = data
        why = check(buffer) if check is not None else None  # what is checked is what stays in the buffer
        if why is not None:
            rejected[index] = why
        return len(data)

    def exists(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        codes = self._call("exists", lambda s: list(s.batch_is_exist(list(names))))
        if codes is None:
            return [False] * len(names)
        self.counters.add(Metric.EXISTS_ERRORS, sum(c < 0 for c in codes))
        return [c == 1 for c in codes]

    def delete(self, names: Sequence[str]) -> None:
        """Best effort: an object being read holds a lease and stays until it expires (Mooncake evicts it later)."""
        if names:
            self._call("delete", lambda s: list(s.batch_remove(list(names))) if hasattr(s, "batch_remove")
                       else [s.remove(n) for n in names])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            try:
                self._control.submit(store.close).result(self.config.timeout_s)
            except Exception as exc:  # closing a client of a dead master may hang or fail; nothing to keep
                logger.warning("Mooncake tier: close did not finish cleanly: %r", exc)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False, cancel_futures=True)
