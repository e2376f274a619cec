"""Engines in processes of their own, driven together as a router drives them: every wave of a workload is split
between them (turn k of conversation c goes to engine (c + k) % n, so a conversation's consecutive turns never meet
the same engine twice in a row with two engines), the engines serve their shares at the same time, and each answer
becomes part of its conversation's next prompt whichever engine gave it.

    with EnginePool(specs) as engines:                 # one process per spec: each engine built and warmed up
        run = run_round_robin(engines, conversations)  # the waves, each engine's share of each, its tokens by source
        reports = [e.finish() for e in engines]        # what each engine held and counted

Each child builds a `replay.engine.Engine` (vLLM in its own process, the connector in-process there), warms it up on
prompts unrelated to the workload, and answers waves sent over a pipe with the completions, the share's prompt tokens
by source (`runs.TurnAccounting`) and the host time vLLM's scheduler spent in the connector's hooks during the share
(`HookClock`): with a node cache those hooks are where the engine talks to the service.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from .accounting import TurnHits
from .configs import RunConfig
from .engine import Completion, EngineSettings
from .runner import TurnRun
from .runs import COMPARED_LOGPROBS
from .warmup import WarmUp
from .workload import FIRST_TOKEN, Conversation, prompt_of

logger = logging.getLogger(__name__)

# the connector hooks vLLM's scheduler calls (once per step: build_connector_meta; per request: the others)
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "take_events", "get_kv_connector_stats")
STEP_HOOK = "build_connector_meta"  # vLLM calls it once per scheduler step: the step count
LOOKUP_HOOK = "get_num_new_matched_tokens"  # once per waiting request and step: more than once while a lookup waits
START_TIMEOUT_S = 900.0  # building and warming up an engine on a busy two-core machine
WAVE_TIMEOUT_S = 1800.0
SETTLE_TIMEOUT_S = 60.0


def engine_for(conversation: int, turn: int, engines: int) -> int:
    """The engine that serves turn `turn` of conversation `conversation`: a round robin that moves every
    conversation to the next engine at each turn."""
    if engines < 1:
        raise ValueError(f"a round robin needs at least one engine, got {engines}")
    if conversation < 0 or turn < 0:
        raise ValueError(f"conversation and turn must be >= 0, got {conversation} and {turn}")
    return (conversation + turn) % engines


def split_wave(sending: Sequence[tuple[int, int]], engines: int) -> list[list[int]]:
    """Per engine, the positions in `sending` ((conversation, turn) pairs of one wave) it serves, in order."""
    shares: list[list[int]] = [[] for _ in range(engines)]
    for position, (conversation, turn) in enumerate(sending):
        shares[engine_for(conversation, turn, engines)].append(position)
    return shares


class HookClock:
    """Host time spent in some methods of an object, and their calls: each method is replaced on the instance by a
    timed one (vLLM calls the connector's hooks through the instance, so it calls the timed ones)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner: Any, names: Sequence[str]) -> list[str]:
        """Times `names` on `owner` (those it has); returns the names wrapped."""
        wrapped = []
        for name in names:
            original = getattr(owner, name, None)
            if original is None or not callable(original):
                continue
            self.seconds.setdefault(name, 0.0)
            self.calls.setdefault(name, 0)
            setattr(owner, name, self._timed(name, original))
            wrapped.append(name)
        return wrapped

    def _timed(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1

        return timed

    def total(self) -> tuple[float, int, int]:
        """(seconds in every wrapped method, calls of the step hook, calls of the lookup hook) so far."""
        return sum(self.seconds.values()), self.calls.get(STEP_HOOK, 0), self.calls.get(LOOKUP_HOOK, 0)


@dataclass(frozen=True)
class EngineSpec:
    """One engine process: its vLLM settings and connector, the environment it starts with (set before vLLM is
    imported), the CPUs it may run on (empty: any), and its warm-up prompts (empty: no warm-up)."""

    name: str
    settings: EngineSettings
    config: RunConfig
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()
    warmup: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Held:
    """What an engine's own store holds in its host arena (for a node cache engine: the node's, as it sees it)."""

    used_chunks: int = 0
    capacity_chunks: int = 0
    chunk_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        return self.used_chunks * self.chunk_bytes


@dataclass(frozen=True)
class EngineWave:
    """One engine's share of a wave, as its process reports it."""

    completions: tuple[Completion, ...]
    hits: TurnHits
    wall_s: float
    connector_s: float  # host time in the scheduler's connector hooks during the share
    steps: int  # scheduler steps during the share
    lookups: int = 0  # the connector's lookups during the share (a request whose lookup waits asks every step)


@dataclass(frozen=True)
class EngineReady:
    warmup: Optional[WarmUp]
    capacity_tokens: int
    held: Held  # after the warm-up, before the workload


@dataclass(frozen=True)
class EngineReport:
    """What an engine counted over the workload, and what its store held at the end."""

    name: str
    held: Held
    plugin_stats: dict[str, float]
    reloaded_tokens: int
    mismatches: tuple[str, ...]
    hook_seconds: dict[str, float]
    hook_calls: dict[str, int]


@dataclass
class RoundRobinRun:
    """The waves as the driver saw them (every conversation's completion; a wave's wall time from its submission
    until the last engine answered) and, per wave, each engine's share (None: it had no request in that wave)."""

    turns: list[TurnRun]
    shares: list[list[Optional[EngineWave]]]

    def hits(self) -> TurnHits:
        return TurnHits.summed([s.hits for wave in self.shares for s in wave if s is not None])

    def connector(self) -> tuple[float, int, int]:
        """(seconds in the scheduler's connector hooks, scheduler steps, lookups), every engine's together."""
        shares = [s for wave in self.shares for s in wave if s is not None]
        return sum(s.connector_s for s in shares), sum(s.steps for s in shares), sum(s.lookups for s in shares)


class EngineProcess:
    """One engine in a child process (multiprocessing's spawn: a fresh interpreter, so vLLM, torch and the
    environment start clean); every call but `send_wave` waits for the child's answer."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, spec), name=f"lmcache-npu {spec.name}")
        self.process.start()
        child.close()
        self.ready: Optional[EngineReady] = None

    def _receive(self, kind: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._connection.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"{self.spec.name} exited ({self.process.exitcode}) while {kind} was awaited")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.name} gave no {kind} in {timeout_s:.0f} s")
        try:
            answer, value = self._connection.recv()
        except EOFError:
            raise RuntimeError(f"{self.spec.name} closed its pipe while {kind} was awaited") from None
        if answer == "error":
            raise RuntimeError(f"{self.spec.name} failed:\n{value}")
        if answer != kind:
            raise RuntimeError(f"{self.spec.name} answered {answer!r}, not {kind!r}")
        return value

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> EngineReady:
        self.ready = self._receive("ready", timeout_s)
        return self.ready

    def send_wave(self, prompts: Sequence[Sequence[int]], outputs: Sequence[int]) -> None:
        self._connection.send(("wave", [list(p) for p in prompts], list(outputs)))

    def wave_result(self, timeout_s: float = WAVE_TIMEOUT_S) -> EngineWave:
        return self._receive("wave", timeout_s)

    def finish(self, timeout_s: float = 300.0) -> EngineReport:
        """Lets the engine's last stores land, then what it held and counted."""
        self._connection.send(("finish",))
        return self._receive("finish", timeout_s)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._connection.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(120)
        if self.process.is_alive():
            logger.warning("%s did not stop in 120 s: terminating it", self.spec.name)
            self.process.terminate()
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self._connection.close()


class EnginePool:
    """`with EnginePool(specs) as engines:` every engine started at once (their start-ups overlap) and ready
    (built, warmed up) when the block begins; every process stopped after it."""

    def __init__(self, specs: Sequence[EngineSpec]) -> None:
        if not specs:
            raise ValueError("an engine pool needs at least one engine spec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.specs = list(specs)
        self.engines: list[EngineProcess] = []

    def __enter__(self) -> list[EngineProcess]:
        try:
            for spec in self.specs:
                self.engines.append(EngineProcess(spec))
            for engine in self.engines:
                engine.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self.engines

    def __exit__(self, *exc: object) -> None:
        for engine in self.engines:
            engine.close()
        self.engines = []


def run_round_robin(engines: Sequence[EngineProcess], conversations: Sequence[Conversation],
                    on_wave: Optional[Callable[[TurnRun], None]] = None) -> RoundRobinRun:
    """Every wave of `conversations`, split between `engines` by `engine_for`, each engine's share sent before any
    answer is awaited (the engines serve at the same time)."""
    answers: list[list[tuple[int, ...]]] = [[] for _ in conversations]
    run = RoundRobinRun([], [])
    for wave in range(max(c.start + len(c.turns) for c in conversations)):
        sending = [(i, turn) for i, c in enumerate(conversations) if (turn := c.turn_in(wave)) is not None]
        if not sending:
            continue
        prompts = [prompt_of(conversations[i], answers[i], t) for i, t in sending]
        outputs = [conversations[i].turns[t].output_tokens for i, t in sending]
        shares = split_wave(sending, len(engines))
        started = time.perf_counter()
        for engine, share in zip(engines, shares):
            if share:
                engine.send_wave([prompts[k] for k in share], [outputs[k] for k in share])
        results: list[Optional[EngineWave]] = [engine.wave_result() if share else None
                                               for engine, share in zip(engines, shares)]
        wall = time.perf_counter() - started
        completions: dict[int, Completion] = {}
        for share, result in zip(shares, results):
            if result is not None:
                completions.update(zip(share, result.completions))
        turn = TurnRun(wave, tuple(i for i, _ in sending), tuple(completions[k] for k in range(len(sending))), wall)
        for i, done in zip(turn.conversations, turn.completions):
            answers[i].append(done.token_ids)
        run.turns.append(turn)
        run.shares.append(results)
        if on_wave is not None:
            on_wave(turn)
    return run


# ---- the child process ------------------------------------------------------------------------------------------

def _held(engine: Any) -> Held:
    from ...store.commands import Tier

    half = engine.scheduler_connector.scheduler_half
    used, capacity = half.view.occupancy()[Tier.ARENA]
    return Held(int(used), int(capacity), int(half.object_bytes) * int(half.place.world))


def _settle(engine: Any) -> None:
    """One more step issues the stores the last step planned; then the worker's puts and writes finish."""
    engine.generate([[FIRST_TOKEN] * 3], 1)
    executor = engine.worker_connector.worker_half.executor
    if executor is not None and not executor.wait_idle(SETTLE_TIMEOUT_S):
        raise RuntimeError(f"the engine's stores did not finish in {SETTLE_TIMEOUT_S:.0f} s")


def _pin(cpus: Sequence[int]) -> None:
    """Runs this process on `cpus` with as many compute threads (set before torch starts its thread pool), so two
    engines on one machine do not fight over the same cores."""
    if not cpus:
        return
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cpus))


def _serve(connection: Any, spec: EngineSpec) -> None:
    """The child: builds and warms up the engine, then answers the parent's messages until told to stop."""
    os.environ.update(spec.env)
    _pin(spec.cpus)
    engine = None
    try:
        from .runner import generate_wave
        from .runs import TurnAccounting, start_engine
        from .sizing import device_capacity_tokens
        from .warmup import warm_up

        engine = start_engine(spec.settings, spec.config)
        clock = HookClock()
        if spec.config.plugin:  # wrapped before the hit ledger wraps its hook: its own time is not counted
            clock.wrap(engine.scheduler_connector, SCHEDULER_HOOKS)
        accounting = TurnAccounting(engine, spec.config)
        warm = (warm_up(engine, [list(p) for p in spec.warmup], logprobs=COMPARED_LOGPROBS) if spec.warmup
                else None)
        if spec.config.plugin:
            _settle(engine)
        accounting.restart()
        held = _held(engine) if spec.config.plugin else Held()
        connection.send(("ready", EngineReady(warm, device_capacity_tokens(engine), held)))
        turn = 0
        while True:
            message = connection.recv()
            if message[0] == "stop":
                break
            if message[0] == "wave":
                _, prompts, outputs = message
                before = clock.total()
                started = time.perf_counter()
                completions = generate_wave(engine, prompts, outputs, COMPARED_LOGPROBS)
                wall = time.perf_counter() - started
                hits = accounting.turn(turn, completions)
                turn += 1
                seconds, steps, lookups = (a - b for a, b in zip(clock.total(), before))
                connection.send(("wave", EngineWave(tuple(completions), hits, wall, seconds, int(steps),
                                                    int(lookups))))
            elif message[0] == "finish":
                if spec.config.plugin:
                    _settle(engine)
                connection.send(("finish", EngineReport(
                    spec.name, _held(engine) if spec.config.plugin else Held(),
                    engine.plugin_stats() if spec.config.plugin else {}, accounting.reloaded_tokens,
                    tuple(accounting.mismatches), dict(clock.seconds), dict(clock.calls))))
            else:
                raise ValueError(f"unknown message {message[0]!r} from the driver")
    except BaseException:
        try:
            connection.send(("error", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
        raise
    finally:
        if engine is not None:
            engine.close()
        connection.close()


__all__ = ["EnginePool", "EngineProcess", "EngineSpec", "EngineReport", "RoundRobinRun", "engine_for", "split_wave",
           "run_round_robin", "HookClock"]
