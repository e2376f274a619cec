"""The sweep: one `vllm serve` per configuration (the settings every configuration shares, its own connector), all
started (and warmed up with unrelated prompts) before anything is measured, then every workload at every pace of
the grid, each run on every server in turn, one server at a time, the order rotating run by run: a slow stretch of
the machine lands on every configuration alike instead of on whichever server ran then (measured one server after
another, a VM slowing down for minutes lands on one configuration only). Per point: the client's numbers from
`vllm bench serve` and the server's counters over the point (vLLM's prefix-cache hits, the connector's).

`random` (the no-reuse verdict) runs `random_repeats` times at every pace, and the reusing workloads `reuse_repeats`
times at theirs, in rounds (round 1 every pace, round 2 every pace, ...) so a slow stretch of the machine spreads over
the paces instead of landing on one; every run has its own point index (fresh prompts, hash ids no other run uses),
so a repeat of a reusing workload finds nothing of the run before it."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ...checks import check_int
from ..replay.configs import RunConfig
from ..replay.connectors import connector_services, transfer_config_json
from .load import LoadResult, LoadSpec, run_load
from .metrics import ServerCounters, read_counters, settled_counters
from .server import ServerSettings, ServerStartError, vllm_server
from .workloads import MAX_POINT, WORKLOADS, Workloads

logger = logging.getLogger(__name__)

NO_REUSE = "random"  # the workload nothing can hit: the overhead verdict's, swept over every pace
WARMUP_SEED = 1_000_003  # far from any point's seed: the warm-up shares no tokens with the measured points
WARMUP_POINT = MAX_POINT  # the warm-up's random prompts use hash ids no measured point reaches


@dataclass(frozen=True)
class Pace:
    """One column of the grid: a concurrency cap (request rate unlimited) or a request rate (no cap)."""

    max_concurrency: Optional[int] = None
    request_rate: float = math.inf

    @property
    def label(self) -> str:
        if self.max_concurrency is not None:
            return f"concurrency {self.max_concurrency}"
        return f"{self.request_rate:g} req/s"

    @property
    def x(self) -> float:
        """Where the point sits on a plot's x axis."""
        return float(self.max_concurrency) if self.max_concurrency is not None else self.request_rate


def grid(concurrencies: Sequence[int], request_rates: Sequence[float]) -> list[Pace]:
    """The paces a sweep runs: concurrency caps or request rates, one kind (a plot's x axis has one unit)."""
    if bool(concurrencies) == bool(request_rates):
        raise ValueError("sweep either --concurrency or --request-rate (exactly one of them)")
    bad = [c for c in concurrencies if c < 1] + [r for r in request_rates if not r > 0]
    if bad:
        raise ValueError(f"concurrencies must be >= 1 and request rates > 0, got {bad}")
    if concurrencies:
        return [Pace(max_concurrency=c) for c in concurrencies]
    return [Pace(request_rate=r) for r in request_rates]


LAST_MEASURED_POINT = WARMUP_POINT - 1  # the highest point index a measured run may take


@dataclass(frozen=True)
class Run:
    """One run of a workload: its pace, which repeat at that pace (0 first), and its point index (its prompts)."""

    pace: Pace
    repeat: int
    index: int


@dataclass(frozen=True)
class SweepSettings:
    """What each server runs: the workloads `names`, `random` (the no-reuse verdict) at every one of `paces`, the
    reusing workloads at `reuse_paces` (None: `paces` too), after `warmup_prompts` unrelated prompts."""

    workloads: Workloads = Workloads()
    names: tuple[str, ...] = WORKLOADS
    paces: tuple[Pace, ...] = (Pace(max_concurrency=1), Pace(max_concurrency=2))
    warmup_prompts: int = 2
    seed: int = 0
    # the reusing workloads' hits do not depend much on the pace: one pace keeps a 2-core sweep short
    reuse_paces: Optional[tuple[Pace, ...]] = (Pace(max_concurrency=4),)
    # one run of random moves a few percent either way on a 2-core VM: the verdict takes the median of these
    random_repeats: int = 3
    # the reusing workloads too: with one run each, the plugin and a peer within 5 % of each other order at random
    reuse_repeats: int = 1

    def __post_init__(self) -> None:
        unknown = [n for n in self.names if n not in WORKLOADS]
        if unknown or not self.names:
            raise ValueError(f"workloads must be some of {', '.join(WORKLOADS)}, got {list(self.names)}")
        if not self.paces or (self.reuse_paces is not None and not self.reuse_paces):
            raise ValueError("a sweep needs at least one pace for random and one for the reusing workloads")
        kinds = {p.max_concurrency is None for p in (*self.paces, *(self.reuse_paces or ()))}
        if len(kinds) > 1:
            raise ValueError("a sweep paces every workload by concurrency or every one by request rate, not both "
                             "(a plot's x axis has one unit)")
        if self.warmup_prompts < 0:
            raise ValueError(f"warmup_prompts must be >= 0, got {self.warmup_prompts}")
        for key in ("random_repeats", "reuse_repeats"):
            check_int(key, getattr(self, key), lo=1)  # runs of each workload per pace
        for name in self.names:
            runs = len(self.paces_for(name)) * self.repeats_for(name)
            if runs > LAST_MEASURED_POINT + 1:
                raise ValueError(f"{name} would run {runs} times ({len(self.paces_for(name))} pace(s) x "
                                 f"{self.repeats_for(name)} repeat(s)), but point indices stop at "
                                 f"{LAST_MEASURED_POINT} (workloads.MAX_POINT {MAX_POINT} is the warm-up's): use "
                                 f"fewer paces or repeats")

    def paces_for(self, name: str) -> tuple[Pace, ...]:
        """The paces workload `name` runs at."""
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        if name == NO_REUSE or self.reuse_paces is None:
            return self.paces
        return self.reuse_paces

    def repeats_for(self, name: str) -> int:
        """How many times workload `name` runs at each of its paces."""
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        return self.random_repeats if name == NO_REUSE else self.reuse_repeats

    def runs_of(self, name: str) -> tuple[Run, ...]:
        """Workload `name`'s runs in the order they go: round by round, every pace in each round; index k is the
        k-th run, so no two runs of a workload share a point index (nor prompts)."""
        paces = self.paces_for(name)
        return tuple(Run(pace, repeat, repeat * len(paces) + position)
                     for repeat in range(self.repeats_for(name)) for position, pace in enumerate(paces))

    @property
    def all_paces(self) -> tuple[Pace, ...]:
        """Every pace some workload of the sweep runs at, each once, in order."""
        return tuple(dict.fromkeys(p for name in self.names for p in self.paces_for(name)))


@dataclass(frozen=True)
class Point:
    """One configuration at one workload and pace."""

    config: str
    plugin: bool
    workload: str
    pace: Pace
    load: LoadResult
    counters: ServerCounters  # the difference over the point
    repeat: int = 0  # which run at this pace (random runs several)

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "plugin": self.plugin, "workload": self.workload,
                "max_concurrency": self.pace.max_concurrency, "repeat": self.repeat,
                "request_rate": None if math.isinf(self.pace.request_rate) else self.pace.request_rate,
                **self.load.to_json(), **{f"server_{k}": v for k, v in self.counters.to_json().items()}}


@dataclass
class SweepResult:
    configs: list[str]  # the first is the baseline
    points: list[Point] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # configuration -> why it did not run

    def point(self, config: str, workload: str, pace: Pace, repeat: int = 0) -> Optional[Point]:
        """The point of `config` at `workload` and `pace` (its first run unless `repeat` says which), or None."""
        return next((p for p in self.points if p.config == config and p.workload == workload and p.pace == pace
                     and p.repeat == repeat), None)

    def repeats(self, config: str, workload: str, pace: Pace) -> list[Point]:
        """Every run of `config` at `workload` and `pace`, by repeat ([] if it never ran there)."""
        return sorted((p for p in self.points if p.config == config and p.workload == workload and p.pace == pace),
                      key=lambda p: p.repeat)


def run_sweep(configs: Sequence[RunConfig], server: ServerSettings, sweep: SweepSettings, scratch: Path,
              on_point: Optional[Callable[[Point], None]] = None,
              on_phase: Optional[Callable[[str], None]] = None) -> SweepResult:
    """Every configuration over the whole grid, one server each, runs interleaved across the servers."""
    if server.tokenizer is None:
        raise ValueError("bench-serve needs a tokenizer (vLLM's datasets make text prompts): set ServerSettings."
                         "tokenizer")
    scratch.mkdir(parents=True, exist_ok=True)
    with connector_services(configs) as services, contextlib.ExitStack() as stack:
        runnable = services.runnable(configs)
        result = SweepResult([c.name for c in runnable], unavailable=dict(services.unavailable))
        servers: list[tuple[RunConfig, str, Path]] = []
        for config in runnable:
            args = server.args(transfer_config_json(config, services))
            folder = scratch / config.name.replace(" ", "_").replace("+", "plus")
            folder.mkdir(parents=True, exist_ok=True)
            if on_phase is not None:
                on_phase(f"{config.name}: starting vllm serve")
            try:
                base = stack.enter_context(vllm_server(server.model, args, folder / "serve.log",
                                                       env={**services.env, **server.env()}))
            except ServerStartError as exc:
                if config is runnable[0]:  # without the baseline nothing else can be compared
                    raise
                _did_not_start(result, config.name, exc)
                continue
            _warm_up(base, server, sweep, folder)
            servers.append((config, base, folder))
        turn = 0
        for name in sweep.names:
            repeats = sweep.repeats_for(name)
            for run in sweep.runs_of(name):
                for config, base, folder in _rotated(servers, turn):
                    if on_phase is not None:
                        of = f" (run {run.repeat + 1} of {repeats})" if repeats > 1 else ""
                        on_phase(f"{config.name}: {name}, {run.pace.label}{of}")
                    point = _run_point(base, server, sweep, config, name, run, folder)
                    result.points.append(point)
                    if on_point is not None:
                        on_point(point)
                turn += 1
    return result


def _rotated(servers: Sequence[Any], turn: int) -> list[Any]:
    """The servers in the order of turn `turn`: each goes first once every len(servers) turns."""
    if not servers:
        return []
    shift = turn % len(servers)
    return [*servers[shift:], *servers[:shift]]


def _did_not_start(result: SweepResult, name: str, error: ServerStartError) -> None:
    """Records a configuration whose server never came up (the others still run); its log's last lines say why."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    why = lines[0] + (f" ... {' | '.join(lines[-3:])}" if len(lines) > 1 else "")
    logger.warning("%s did not start: %s", name, str(error)[-4000:])
    result.unavailable[name] = why[:600]
    result.configs.remove(name)


def _warm_up(base: str, server: ServerSettings, sweep: SweepSettings, folder: Path) -> None:
    """A few unrelated random prompts, so no measured point pays the server's first requests."""
    if sweep.warmup_prompts == 0:
        return
    assert server.tokenizer is not None
    args, _ = sweep.workloads.dataset("random", WARMUP_POINT, folder)
    spec = LoadSpec(args, sweep.warmup_prompts, max_concurrency=2, seed=WARMUP_SEED)
    run_load(spec, base, server.model, server.tokenizer, folder / "warmup.json", folder / "warmup.log")


def _run_point(base: str, server: ServerSettings, sweep: SweepSettings, config: RunConfig, name: str, run: Run,
               folder: Path) -> Point:
    assert server.tokenizer is not None
    index, pace = run.index, run.pace
    dataset, prompts = sweep.workloads.dataset(name, index, folder)
    # the same seed for every configuration (the same prompts), a new one per point (no point hits another's)
    spec = LoadSpec(dataset, prompts, pace.max_concurrency, pace.request_rate, seed=sweep.seed + index)
    before = settled_counters(lambda: read_counters(base))
    stem = f"{name}-{index}"
    load = run_load(spec, base, server.model, server.tokenizer, folder / f"{stem}.json", folder / f"{stem}.log")
    after = settled_counters(lambda: read_counters(base))
    counters = after.minus(before)
    logger.info("%s %s %s (repeat %d): %s, %s", config.name, name, pace.label, run.repeat, load, counters)
    return Point(config.name, config.plugin, name, pace, load, counters, run.repeat)

